"""Worker side of the distributed test harness: what runs inside each rank.

:mod:`torch_tp.testing._dist` starts one process per rank with
:func:`_worker_main` as its target (pickled by reference, so every worker
imports this module by name). A worker sends its output to a per-rank log,
joins the process group (gloo on CPU; on ``TORCH_TP_TEST_DEVICE=cuda`` rank ``r``
computes on ``cuda:r``, its default device, over NCCL: :mod:`torch_tp.testing._device`),
then runs the tasks the parent sends until told to stop. :func:`rank`,
:func:`world_size`, :func:`tp_mesh` and :func:`mesh_2x2` are for the functions
those tasks run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch_tp._supervise.orphans import exit_with, mark_job
from torch_tp._supervise.rank_failure import TRACEBACK_CHARS, bounded, exception_record, formatted_traceback, native_errors_to_stderr
from torch_tp.testing._device import backend_for, to_current_device


__all__ = ["COLLECTIVE_TIMEOUT", "mesh_2x2", "rank", "tp_mesh", "world_size"]

#: Seconds any single collective may block before gloo (or NCCL) fails it on its own.
#: Applies to the default group and to every group created later on a worker
#: (e.g. the sub-groups of a ``DeviceMesh``).
COLLECTIVE_TIMEOUT = 60.0

# Where a worker writes its output and its stack dumps; the parent reads both
# for its failure reports.


def _log_path(workdir: str, r: int) -> str:
    return os.path.join(workdir, f"rank{r}.log")


def _stack_path(workdir: str, r: int) -> str:
    return os.path.join(workdir, f"rank{r}.stacks")


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


def _worker_main(r: int, size: int, workdir: str, conn: Any, owner_pid: int, device: str = "cpu") -> None:
    """Entry point of one worker process: set up, join the group on ``device``, serve tasks."""
    exit_with(owner_pid)  # a rank blocked in a collective would outlive a killed pytest
    mark_job(workdir)  # what the tasks start ends with the pool (_WorkerPool.kill)
    _redirect_stdio_to(_log_path(workdir, r))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    faulthandler.enable(file=sys.stderr, all_threads=True)
    native_errors_to_stderr()
    stacks = open(_stack_path(workdir, r), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    _init_process_group(r, size, workdir, device)
    conn.send(("ready", os.getpid()))
    _serve_tasks(conn)
    dist.destroy_process_group()


def _redirect_stdio_to(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
        setattr(sys, name, stream)


def _init_process_group(r: int, size: int, workdir: str, device: str = "cpu") -> None:
    global _DEVICE
    _DEVICE = device
    if device == "cuda":  # one GPU per rank, which the tasks' factory calls use
        torch.cuda.set_device(r)
        torch.set_default_device(device)
    if sys.platform.startswith("linux"):
        # Single host: avoid gloo resolving the hostname to an unreachable address.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT)
    # Groups created later (DeviceMesh sub-groups, new_group) default to this.
    from torch.distributed import distributed_c10d

    if hasattr(distributed_c10d, "default_pg_timeout"):
        distributed_c10d.default_pg_timeout = timeout
    dist.init_process_group(
        backend_for(device),
        init_method=f"file://{os.path.join(workdir, 'store')}",
        rank=r,
        world_size=size,
        timeout=timeout,
    )


def _serve_tasks(conn: Any) -> None:
    while True:
        try:
            message = conn.recv()
        except EOFError:  # parent went away
            return
        if message[0] == "stop":
            return
        _, sys_path, task = message
        reply = _run_task(sys_path, task)
        conn.send(reply)
        if reply[0] == "error":
            # The pool is discarded after a failure. Leaving now closes this rank's gloo
            # connections: a peer waiting in a collective fails at once ("Connection closed
            # by peer", a symptom in the report) instead of after the parent's FAILURE_GRACE.
            os._exit(0)


def _run_task(sys_path: list[str], task: bytes) -> tuple[str, Any]:
    _adopt_sys_path(sys_path)
    torch.manual_seed(0)
    try:
        fn, args, kwargs = pickle.loads(task)
        if _DEVICE != "cpu":  # the parent's CUDA tensors unpickle on its device, not this rank's
            args, kwargs = to_current_device((args, kwargs))
        result = fn(*args, **kwargs)
    except BaseException as exc:
        return ("error", _failure_record(exc))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        return ("ok", pickle.dumps(result))
    except Exception as exc:
        record = exception_record(exc, with_traceback=False)  # its traceback is set below
        record["traceback"] = (
            "the return value is not picklable; return plain data or tensors "
            "(e.g. dtensor.full_tensor()), not DTensors or meshes:\n" + formatted_traceback(exc)
        )
        return ("error", record)


def _adopt_sys_path(parent_path: list[str]) -> None:
    """Put the parent's ``sys.path`` first so its modules import the same way."""
    sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]


def _failure_record(exc: BaseException) -> dict[str, Any]:
    """:func:`torch_tp._supervise.rank_failure.exception_record`, with the harness's own frame left out."""
    record = exception_record(exc, with_traceback=False)
    record["traceback"] = _format_exception(bare_assert=isinstance(exc, AssertionError) and not record["message"])
    return record


def _format_exception(bare_assert: bool = False) -> str:
    """The current exception's traceback, minus the harness's own frame (bounded, like every
    text of a record: :func:`torch_tp._supervise.rank_failure.bounded`)."""
    exc = sys.exc_info()[1]
    assert exc is not None and exc.__traceback__ is not None
    tb = exc.__traceback__.tb_next or exc.__traceback__
    text = formatted_traceback(exc, tb)
    if bare_assert:  # a bare `assert`
        text += _innermost_locals(exc.__traceback__)
    return bounded(text, TRACEBACK_CHARS)


def _innermost_locals(tb: Any, limit: int = 200) -> str:
    """Short reprs of the failing frame's locals (plain asserts carry no values)."""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    lines = []
    for name, value in tb.tb_frame.f_locals.items():
        try:
            text = repr(value)
        except Exception as exc:  # a broken __repr__ must not hide the failure
            text = f"<repr failed: {exc!r}>"
        if len(text) > limit:
            text = text[:limit] + "..."
        lines.append(f"    {name} = {text}")
    return "Locals of the failing frame:\n" + "\n".join(lines) + "\n" if lines else ""


# --------------------------------------------------------------------------
# Rank-side helpers (call these inside a function run by run_on_ranks)
# --------------------------------------------------------------------------

_MESHES: dict[str, Any] = {}
_DEVICE = "cpu"  # the pool's device type (set when the worker joins its group)


def _require_worker(helper: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"{helper}() only works inside a function run by run_on_ranks(fn, world_size); "
            f"no process group is initialized in this process"
        )


def rank() -> int:
    """This worker's global rank.

    Example:
        >>> # xdoctest: +SKIP("only inside a function run by run_on_ranks")
        >>> rank()  # on the second worker
        1
    """
    _require_worker("rank")
    return dist.get_rank()


def world_size() -> int:
    """Number of ranks in this worker's pool.

    Example:
        >>> # xdoctest: +SKIP("only inside a function run by run_on_ranks")
        >>> world_size()  # in a pool started by run_on_ranks(fn, 4)
        4
    """
    _require_worker("world_size")
    return dist.get_world_size()


def tp_mesh() -> Any:
    """1-D ``DeviceMesh`` named ``("tp",)`` over all ranks, cached per worker (of the pool's
    device type: ``cpu``, or ``cuda`` under ``TORCH_TP_TEST_DEVICE=cuda``).

    Example:
        >>> # xdoctest: +SKIP("only inside a function run by run_on_ranks")
        >>> t = distribute_tensor(torch.ones(4, 4), tp_mesh(), [Shard(0)])
        >>> t.to_local().shape  # with 2 ranks
        torch.Size([2, 4])
    """
    _require_worker("tp_mesh")
    if "tp" not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES["tp"] = init_device_mesh(_DEVICE, (dist.get_world_size(),), mesh_dim_names=("tp",))
    return _MESHES["tp"]


def mesh_2x2() -> Any:
    """2-D ``DeviceMesh`` of shape (2, 2) named ``("dp", "tp")``, cached per worker (of the
    pool's device type, as :func:`tp_mesh`).

    Only valid with 4 ranks; rows ``{0, 1}`` and ``{2, 3}`` are the "tp" groups.

    Example:
        >>> # xdoctest: +SKIP("only inside a function run by run_on_ranks(fn, 4)")
        >>> mesh_2x2()["tp"].get_local_rank()  # on global rank 3
        1
    """
    _require_worker("mesh_2x2")
    if dist.get_world_size() != 4:
        raise RuntimeError(
            f"mesh_2x2() needs world_size 4, but this pool has "
            f"{dist.get_world_size()} ranks; run the test with run_on_ranks(fn, 4)"
        )
    if "2x2" not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES["2x2"] = init_device_mesh(_DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
    return _MESHES["2x2"]

