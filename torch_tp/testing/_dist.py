"""Distributed test harness: persistent pools of gloo worker processes.

Every distributed test runs real CPU process groups through :func:`run_on_ranks`.
Worker processes are started once per world size and reused by every later
call, so a test costs one task round-trip instead of a multi-second spawn.
A failing, hanging or dying rank turns into a :class:`RankFailure` carrying
that rank's traceback (or Python stack) and its recent output; the pool is
then killed and respawned on the next call, never reused.

Example (in a pytest module; the rank function must be module-level)::

    import torch
    import torch.distributed as dist
    from torch_tp.testing import rank, run_on_ranks, world_sizes

    def _sum_ranks():
        t = torch.tensor([float(rank())])
        dist.all_reduce(t)
        return t.item()

    @world_sizes(1, 2, 4)
    def test_sum(world_size):
        expected = sum(range(world_size))
        assert run_on_ranks(_sum_ranks, world_size) == [expected] * world_size

Workers are POSIX processes (they rely on ``SIGUSR1`` for stack dumps).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as _wait_for_ready
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist


__all__ = [
    "COLLECTIVE_TIMEOUT",
    "RankFailure",
    "assert_comm_counts",
    "comm_counts",
    "mesh_2x2",
    "rank",
    "run_on_ranks",
    "shutdown_pools",
    "tp_mesh",
    "world_size",
    "world_sizes",
]

#: Seconds any single collective may block before gloo fails it on its own.
#: Applies to the default group and to every group created later on a worker
#: (e.g. the sub-groups of a ``DeviceMesh``).
COLLECTIVE_TIMEOUT = 60.0

#: Default bound, in seconds, on one :func:`run_on_ranks` task.
DEFAULT_TASK_TIMEOUT = 120.0

#: Seconds allowed for a fresh pool to start and join its process group.
STARTUP_TIMEOUT = 120.0

#: After the first rank fails, how long the other ranks get to answer.
FAILURE_GRACE = 3.0

#: How many trailing lines of a failing rank's output go into the report.
LOG_TAIL_LINES = 40

#: Multiprocessing start method for workers. ``forkserver`` (with torch
#: preloaded in the server) starts a pool several times faster than ``spawn``;
#: override with the environment variable ``TORCH_TP_START_METHOD``.
START_METHOD = os.environ.get("TORCH_TP_START_METHOD", "forkserver")

# Imported once by the fork server so that workers start with them loaded
# (test modules import all of these; debug pulls in torch._dynamo, ~0.7 s).
_FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.tensor.debug",
    "torch.distributed.tensor.parallel",
    "pytest",
]
_STACK_DUMP_WAIT = 2.0
_STOP_WAIT = 5.0


class RankFailure(AssertionError):
    """Raised by :func:`run_on_ranks` when a rank raised, hung or died.

    The message holds, per failed rank, ``rank N`` with its formatted
    traceback (or, for a rank that did not answer, its Python stack dump and
    for a dead rank its exit code), followed by the rank's recent output.
    ``failed_ranks`` lists the ranks concerned.

    Example:
        >>> # xdoctest: +SKIP("starts worker processes")
        >>> with pytest.raises(RankFailure, match="boom-rank1"):
        ...     run_on_ranks(_raise_on_rank_1, 2)
    """

    def __init__(self, message: str, failed_ranks: list[int]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.failed_ranks))


RankFailure.__module__ = "torch_tp.testing"  # how pytest names it in reports


# --------------------------------------------------------------------------
# Parent side: the public entry point
# --------------------------------------------------------------------------


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TASK_TIMEOUT,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` pool.

    Returns the per-rank return values, indexed by rank. ``fn`` must be a
    module-level function (pickled by reference and imported by the workers,
    which receive this process's ``sys.path``); arguments and return values
    must be picklable (return ``dtensor.full_tensor()``, not a DTensor).
    Each rank calls ``torch.manual_seed(0)`` before running ``fn``.

    ``timeout`` (seconds) bounds the task, not the one-off pool startup. If a
    rank raises, hangs past ``timeout`` or dies, :class:`RankFailure` is
    raised and the pool is killed (the next call starts a fresh one).

    Example:
        >>> # xdoctest: +SKIP("starts worker processes; fn must be module-level")
        >>> run_on_ranks(torch.add, 2, torch.ones(1), other=torch.ones(1))
        [tensor([2.]), tensor([2.])]
    """
    __tracebackhide__ = True
    _check_world_size(world_size)
    task = _pickle_task(fn, args, kwargs)
    pool = _pool_for(world_size)
    return pool.run(task, timeout=timeout, what=_describe_fn(fn))


def shutdown_pools() -> None:
    """Stop every cached worker pool (also done automatically at exit).

    Example:
        >>> # xdoctest: +SKIP("would stop the pools of a running test session")
        >>> shutdown_pools()  # e.g. from a pytest_sessionfinish hook
    """
    for size in list(_POOLS):
        _POOLS.pop(size).stop()


def world_sizes(*sizes: int) -> Any:
    """Parametrize a test over world sizes as ``world_size`` (ids ``ws<N>``).

    Example:
        >>> @world_sizes(1, 2, 4)
        ... def test_something(world_size):
        ...     run_on_ranks(_case, world_size)
        >>> [(m.args, m.kwargs["ids"]) for m in test_something.pytestmark]
        [(('world_size', (1, 2, 4)), ['ws1', 'ws2', 'ws4'])]
    """
    import pytest

    for size in sizes:
        _check_world_size(size)
    return pytest.mark.parametrize("world_size", sizes, ids=[f"ws{n}" for n in sizes])


def _check_world_size(size: Any) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {size!r}")


def _describe_fn(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", "?")
    name = getattr(fn, "__qualname__", repr(fn))
    return f"{module}.{name}"


def _pickle_task(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"run_on_ranks needs a module-level function that workers can import, "
            f"got {fn!r} ({exc}); move it to module scope (not a lambda or a "
            f"function defined inside a test)"
        ) from exc
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"run_on_ranks could not pickle the arguments for {_describe_fn(fn)}: "
            f"{exc}; pass plain data or tensors"
        ) from exc


# --------------------------------------------------------------------------
# Parent side: pool cache and lifecycle
# --------------------------------------------------------------------------

_POOLS: dict[int, "_WorkerPool"] = {}
_SESSION_DIR: str | None = None


def _pool_for(size: int) -> "_WorkerPool":
    __tracebackhide__ = True
    pool = _POOLS.get(size)
    if pool is not None and not pool.all_alive():
        _POOLS.pop(size).kill()
        pool = None
    if pool is None:
        pool = _WorkerPool(size, _session_dir())
        pool.start()
        _POOLS[size] = pool
    return pool


def _session_dir() -> str:
    """Directory for this process's pools' logs; removed at exit."""
    global _SESSION_DIR
    if _SESSION_DIR is None or not os.path.isdir(_SESSION_DIR):
        _SESSION_DIR = tempfile.mkdtemp(prefix="torch_tp_dist_")
    return _SESSION_DIR


def _shutdown_at_exit() -> None:
    shutdown_pools()
    if _SESSION_DIR is not None:
        shutil.rmtree(_SESSION_DIR, ignore_errors=True)


atexit.register(_shutdown_at_exit)


def _mp_context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        # Only effective before the fork server starts; harmless afterwards.
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


@contextlib.contextmanager
def _stdio_fds_redirected(path: str) -> Iterator[None]:
    """Point this process's fds 1 and 2 at ``path`` while children are created.

    Children (and the fork server) inherit these fds, so nothing they print
    before redirecting themselves lands in pytest's per-test capture.
    """
    try:
        saved = [os.dup(1), os.dup(2)]
    except OSError:  # no stdio at all: nothing to protect
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)


@dataclass
class _Reply:
    """What one rank answered to one request."""

    kind: str  # "ready" | "ok" | "error" | "died"
    payload: Any = None

    @property
    def failed(self) -> bool:
        return self.kind in ("error", "died")


class _WorkerPool:
    """``size`` worker processes sharing one gloo process group."""

    def __init__(self, size: int, parent_dir: str) -> None:
        self.size = size
        self.workdir = tempfile.mkdtemp(prefix=f"ws{size}_", dir=parent_dir)
        self.bootstrap_log = os.path.join(parent_dir, "bootstrap.log")
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        __tracebackhide__ = True
        ctx = _mp_context()
        bootstrap_offset = _file_size(self.bootstrap_log)
        child_ends = []
        try:
            with _stdio_fds_redirected(self.bootstrap_log):
                for r in range(self.size):
                    parent_end, child_end = ctx.Pipe(duplex=True)
                    proc = ctx.Process(
                        target=_worker_main,
                        args=(r, self.size, self.workdir, child_end),
                        name=f"torch_tp-ws{self.size}-rank{r}",
                        daemon=True,
                    )
                    proc.start()
                    self.procs.append(proc)
                    self.conns.append(parent_end)
                    child_ends.append(child_end)
        except BaseException:
            self.kill()
            raise
        finally:
            for end in child_ends:
                end.close()
        self._await_ready(bootstrap_offset)

    def _await_ready(self, bootstrap_offset: int) -> None:
        __tracebackhide__ = True
        try:
            replies = self._gather(STARTUP_TIMEOUT)
        except BaseException:
            self.kill()
            raise
        if len(replies) == self.size and all(r.kind == "ready" for r in replies.values()):
            return
        report = self._failure_report(
            f"could not start a pool of {self.size} ranks (start method "
            f"{START_METHOD!r}, {STARTUP_TIMEOUT:.0f} s allowed)",
            replies,
            log_offsets=[0] * self.size,
        )
        bootstrap = _tail(self.bootstrap_log, bootstrap_offset)
        if bootstrap:
            report.message += f"\n----- worker bootstrap output -----\n{bootstrap}"
        self.kill()
        raise RankFailure(report.message, report.failed_ranks)

    def all_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def stop(self) -> None:
        """Ask workers to leave cleanly; kill whatever does not."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        deadline = time.monotonic() + _STOP_WAIT
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every worker and remove the pool's files."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(_STOP_WAIT)
            with contextlib.suppress(ValueError):
                proc.close()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- tasks -------------------------------------------------------------

    def run(self, task: bytes, *, timeout: float, what: str) -> list[Any]:
        __tracebackhide__ = True
        log_offsets = [_file_size(_log_path(self.workdir, r)) for r in range(self.size)]
        message = ("task", _absolute_sys_path(), task)
        try:
            replies = self._send_to_all(message)
            replies.update(self._gather(timeout, skip=replies))
            results, report = self._unpack_results(replies, log_offsets, what, timeout)
        except BaseException:  # e.g. KeyboardInterrupt: never reuse a pool mid-task
            self._discard()
            raise
        if report is not None:
            self._discard()
            raise RankFailure(report.message, report.failed_ranks)
        return results

    def _discard(self) -> None:
        if _POOLS.get(self.size) is self:
            del _POOLS[self.size]
        self.kill()

    def _send_to_all(self, message: tuple) -> dict[int, _Reply]:
        """Send ``message`` to every rank; ranks that cannot take it are dead."""
        dead: dict[int, _Reply] = {}
        for r, conn in enumerate(self.conns):
            try:
                conn.send(message)
            except OSError:
                dead[r] = self._death_reply(r)
        return dead

    def _gather(self, timeout: float, skip: Mapping[int, _Reply] | None = None) -> dict[int, _Reply]:
        """Collect one reply per rank until all answered, the deadline passes,
        or ``FAILURE_GRACE`` seconds after the first failure."""
        replies = dict(skip or {})
        deadline = time.monotonic() + timeout
        first_failure = time.monotonic() if any(r.failed for r in replies.values()) else None
        while len(replies) < self.size:
            limit = deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            owners = {}
            for r in range(self.size):
                if r not in replies:
                    owners[self.conns[r]] = r
                    owners[self.procs[r].sentinel] = r
            for ready in _wait_for_ready(list(owners), remaining):
                r = owners[ready]
                if r in replies:  # both its pipe and its sentinel fired
                    continue
                replies[r] = self._receive(r)
                if replies[r].failed and first_failure is None:
                    first_failure = time.monotonic()
        return replies

    def _receive(self, r: int) -> _Reply:
        conn = self.conns[r]
        try:
            if conn.poll():
                kind, payload = conn.recv()
                return _Reply(kind, payload)
        except (EOFError, OSError):
            pass
        return self._death_reply(r)

    def _death_reply(self, r: int) -> _Reply:
        self.procs[r].join(1.0)
        return _Reply("died", self.procs[r].exitcode)

    def _unpack_results(
        self,
        replies: dict[int, _Reply],
        log_offsets: list[int],
        what: str,
        timeout: float,
    ) -> tuple[list[Any], "_Report | None"]:
        results: list[Any] = [None] * self.size
        for r, reply in sorted(replies.items()):
            if reply.kind != "ok":
                continue
            try:
                results[r] = pickle.loads(reply.payload)
            except Exception:
                replies[r] = _Reply(
                    "error",
                    "the parent could not unpickle this rank's return value:\n"
                    + traceback.format_exc(),
                )
        failed = any(reply.failed for reply in replies.values())
        if not failed and len(replies) == self.size:
            return results, None
        if failed:
            headline = f"{what} failed on world_size={self.size}"
        else:
            headline = f"{what} timed out after {timeout:g} s on world_size={self.size}"
        return results, self._failure_report(headline, replies, log_offsets)

    # -- failure reports ---------------------------------------------------

    def _failure_report(
        self, headline: str, replies: dict[int, _Reply], log_offsets: list[int]
    ) -> "_Report":
        silent = [r for r in range(self.size) if r not in replies]
        stacks = self._dump_stacks(silent)
        sections = []
        failed_ranks = []
        for r in range(self.size):
            reply = replies.get(r)
            if reply is not None and not reply.failed:
                continue
            failed_ranks.append(r)
            sections.append(self._rank_section(r, reply, stacks.get(r), log_offsets[r]))
        summary = _summarize(replies, silent)
        message = (
            f"{headline}: {summary}. The pool was killed and will be respawned "
            f"on the next call.\n" + "\n".join(sections)
        )
        return _Report(message, failed_ranks)

    def _rank_section(self, r: int, reply: _Reply | None, stack: str | None, log_offset: int) -> str:
        if reply is None:
            title = f"rank {r}: did not answer (still running; Python stack below)"
            body = stack or "(no stack dump was written)"
        elif reply.kind == "error":
            title = f"rank {r}: raised"
            body = reply.payload
        else:
            title = f"rank {r}: worker process died ({_exit_description(reply.payload)})"
            body = ""
        parts = [f"===== {title} =====", body.rstrip()]
        output = _tail(_log_path(self.workdir, r), log_offset)
        if output:
            parts.append(f"----- rank {r} output (last {LOG_TAIL_LINES} lines) -----\n{output}")
        return "\n".join(p for p in parts if p)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask live ``ranks`` to write their Python stacks; return what they wrote."""
        offsets = {}
        for r in ranks:
            proc = self.procs[r]
            path = _stack_path(self.workdir, r)
            if proc.is_alive() and proc.pid is not None:
                offsets[r] = _file_size(path)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR1)
        _wait_for_files_to_settle(
            {_stack_path(self.workdir, r): off for r, off in offsets.items()}, _STACK_DUMP_WAIT
        )
        return {r: _read_from(_stack_path(self.workdir, r), off) for r, off in offsets.items()}


@dataclass
class _Report:
    message: str
    failed_ranks: list[int]


def _summarize(replies: dict[int, _Reply], silent: list[int]) -> str:
    groups = [
        ([r for r, reply in sorted(replies.items()) if reply.kind == "error"], "raised"),
        ([r for r, reply in sorted(replies.items()) if reply.kind == "died"], "died"),
        (silent, "did not answer"),
    ]
    return "; ".join(f"{_ranks_phrase(ranks)} {verb}" for ranks, verb in groups if ranks)


def _ranks_phrase(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its connection; exit code unknown"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"exit code {exitcode}, killed by {name}"
    return f"exit code {exitcode}"


def _absolute_sys_path() -> list[str]:
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path]


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _tail(path: str, offset: int) -> str:
    lines = _read_from(path, offset).rstrip().splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _wait_for_files_to_settle(offsets: dict[str, int], limit: float) -> None:
    """Wait until each file grew past its offset and stopped growing."""
    deadline = time.monotonic() + limit
    last = {}
    while time.monotonic() < deadline:
        sizes = {path: _file_size(path) for path in offsets}
        grown = all(sizes[p] > off for p, off in offsets.items())
        if grown and sizes == last:
            return
        last = sizes
        time.sleep(0.05)


def _log_path(workdir: str, r: int) -> str:
    return os.path.join(workdir, f"rank{r}.log")


def _stack_path(workdir: str, r: int) -> str:
    return os.path.join(workdir, f"rank{r}.stacks")


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


def _worker_main(r: int, size: int, workdir: str, conn: Any) -> None:
    """Entry point of one worker process: set up, join the group, serve tasks."""
    _redirect_stdio_to(_log_path(workdir, r))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    faulthandler.enable(file=sys.stderr, all_threads=True)
    stacks = open(_stack_path(workdir, r), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    _init_process_group(r, size, workdir)
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


def _init_process_group(r: int, size: int, workdir: str) -> None:
    if sys.platform.startswith("linux"):
        # Single host: avoid gloo resolving the hostname to an unreachable address.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT)
    # Groups created later (DeviceMesh sub-groups, new_group) default to this.
    from torch.distributed import distributed_c10d

    if hasattr(distributed_c10d, "default_pg_timeout"):
        distributed_c10d.default_pg_timeout = timeout
    dist.init_process_group(
        "gloo",
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
        conn.send(_run_task(sys_path, task))


def _run_task(sys_path: list[str], task: bytes) -> tuple[str, Any]:
    _adopt_sys_path(sys_path)
    torch.manual_seed(0)
    try:
        fn, args, kwargs = pickle.loads(task)
        result = fn(*args, **kwargs)
    except BaseException:
        return ("error", _format_exception())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        return ("ok", pickle.dumps(result))
    except Exception:
        return (
            "error",
            "the return value is not picklable; return plain data or tensors "
            "(e.g. dtensor.full_tensor()), not DTensors or meshes:\n" + traceback.format_exc(),
        )


def _adopt_sys_path(parent_path: list[str]) -> None:
    """Put the parent's ``sys.path`` first so its modules import the same way."""
    sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]


def _format_exception() -> str:
    """The current exception's traceback, minus the harness's own frame."""
    exc = sys.exc_info()[1]
    assert exc is not None and exc.__traceback__ is not None
    tb = exc.__traceback__.tb_next or exc.__traceback__
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    if isinstance(exc, AssertionError) and not str(exc):  # a bare `assert`
        text += _innermost_locals(exc.__traceback__)
    return text


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
    """1-D ``DeviceMesh`` named ``("tp",)`` over all ranks, cached per worker.

    Example:
        >>> # xdoctest: +SKIP("only inside a function run by run_on_ranks")
        >>> t = distribute_tensor(torch.ones(4, 4), tp_mesh(), [Shard(0)])
        >>> t.to_local().shape  # with 2 ranks
        torch.Size([2, 4])
    """
    _require_worker("tp_mesh")
    if "tp" not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES["tp"] = init_device_mesh(
            "cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)
        )
    return _MESHES["tp"]


def mesh_2x2() -> Any:
    """2-D ``DeviceMesh`` of shape (2, 2) named ``("dp", "tp")``, cached per worker.

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

        _MESHES["2x2"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return _MESHES["2x2"]


# --------------------------------------------------------------------------
# Communication counting
# --------------------------------------------------------------------------

# In-place c10d ops (what torch.distributed.* calls dispatch to) -> the
# functional-collective name for the same communication.
_C10D_TO_FUNCTIONAL = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce_coalesced",
    "_allgather_base_": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather_coalesced",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_": "reduce_scatter",
    "alltoall_base_": "all_to_all_single",
    "alltoall_": "all_to_all",
    "broadcast_": "broadcast",
    "gather_": "gather",
    "scatter_": "scatter",
    "reduce_": "reduce",
}


def _collective_name(key: Any) -> str:
    """Short name of a collective given as an op packet, op overload or string."""
    if isinstance(key, str):
        parts = key.rsplit("::", 1)[-1].split(".")  # "c10d_functional.all_reduce"
        if len(parts) > 1 and parts[-1] == "default":  # "all_reduce.default"
            parts.pop()
        name = parts[-1]
    else:
        packet = getattr(key, "_overloadpacket", key)
        name = getattr(packet, "__name__", None) or str(key)
    return _C10D_TO_FUNCTIONAL.get(name, name)


def _normalize_counts(counts: Mapping[Any, int]) -> dict[str, int]:
    normalized: dict[str, int] = {}
    for key, count in counts.items():
        name = _collective_name(key)
        normalized[name] = normalized.get(name, 0) + int(count)
    return {name: count for name, count in sorted(normalized.items()) if count}


def comm_counts(mode: Any) -> dict[str, int]:
    """``{short_collective_name: count}`` from a ``CommDebugMode``.

    Example:
        >>> # xdoctest: +SKIP("only inside a function run by run_on_ranks")
        >>> with CommDebugMode() as mode:
        ...     sharded.redistribute(tp_mesh(), [Replicate()])
        >>> comm_counts(mode)
        {'all_gather_into_tensor': 1}
    """
    return _normalize_counts(mode.get_comm_counts())


def assert_comm_counts(counts: Mapping[Any, int], expected: Mapping[Any, int], what: str) -> None:
    """Assert collective counts match; keys may be op packets or short names.

    Zero counts are ignored on both sides, so ``{"all_reduce": 0}`` means
    "no all_reduce". Raises ``AssertionError`` showing both dicts.

    Example:
        >>> assert_comm_counts({"all_reduce": 1}, {"all_reduce": 1, "broadcast": 0}, "row-wise")
        >>> assert_comm_counts({"all_reduce": 2}, {"all_reduce": 1}, "row-wise")
        Traceback (most recent call last):
        AssertionError: row-wise: collective counts differ...
    """
    actual = _normalize_counts(counts)
    wanted = _normalize_counts(expected)
    if actual != wanted:
        raise AssertionError(
            f"{what}: collective counts differ\n  expected: {wanted}\n  actual:   {actual}"
        )
