"""Distributed test harness: persistent pools of gloo worker processes.

Every distributed test runs real process groups through :func:`run_on_ranks`: gloo on
CPU, or one GPU per rank under ``TORCH_TP_TEST_DEVICE=cuda`` (:mod:`torch_tp.testing._device`).
Worker processes are started once per world size and reused by every later
call, so a test costs one task round-trip instead of a multi-second spawn.
A failing, hanging or dying rank turns into a :class:`RankFailure` carrying
that rank's traceback (or Python stack) and its recent output; the pool is
then killed and respawned on the next call, never reused. Processes a rank's
function started (``subprocess.Popen``) end with the pool: when it is killed
after a failure, at :func:`shutdown_pools` and at exit.

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

This module is the parent (pytest) side. What runs inside a worker lives in
:mod:`torch_tp.testing._rank`, the failure reports' text in
:mod:`torch_tp.testing._report`, collective counting in
:mod:`torch_tp.testing._comm`.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait as _wait_for_ready
from typing import Any, Callable, Iterator, Mapping

from torch_tp._supervise.orphans import descendants, end_processes, process_state
from torch_tp.testing._device import device_count, device_skip_reason, harness_device, to_current_device
from torch_tp.testing._rank import _log_path, _stack_path, _worker_main
from torch_tp.testing._report import (
    _Reply,
    _Report,
    _build_report,
    _file_size,
    _parent_side_record,
    _read_from,
    _tail,
    _wait_for_files_to_settle,
)


__all__ = ["RankFailure", "run_on_ranks", "shutdown_pools", "world_sizes"]

#: Default bound, in seconds, on one :func:`run_on_ranks` task.
DEFAULT_TASK_TIMEOUT = 120.0

#: Seconds allowed for a fresh pool to start and join its process group.
STARTUP_TIMEOUT = 120.0

#: After the first rank fails, how long the other ranks get to answer.
FAILURE_GRACE = 1.0

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
# Imported by the fork server as well when the session has imported the package (pytest imports
# every test module at collection, before the first pool starts): a worker would otherwise import
# them on its first task, each worker again (transformers' models: ~3 s of CPU per worker).
_FORKSERVER_PRELOAD_IF_IMPORTED = {
    "torch_tp": ["torch_tp", "torch_tp.testing"],
    "transformers": ["transformers", "transformers.modeling_utils"],
}
_STACK_DUMP_WAIT = 2.0
_STOP_WAIT = 5.0


class RankFailure(AssertionError):
    """Raised by :func:`run_on_ranks` when a rank raised, hung or died.

    The message opens with the root cause: the rank that failed first (its
    exception, its exit code), or the rank its peers waited for in a collective
    (a hang), or the ranks that called different collectives; a failure inside
    a collective (a timeout, a lost peer) is a consequence and comes after.
    Then, per failed rank, root cause first, ``rank N`` with its formatted
    traceback (or, for a rank that did not answer, its Python stack dump and
    for a dead rank its exit code), followed by the rank's recent output.
    ``failed_ranks`` lists the ranks concerned, ``root_cause_rank`` the first.

    Example:
        >>> # xdoctest: +SKIP("starts worker processes")
        >>> with pytest.raises(RankFailure, match="boom-rank1"):
        ...     run_on_ranks(_raise_on_rank_1, 2)
    """

    def __init__(self, message: str, failed_ranks: list[int], root_cause_rank: int | None = None) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        self.root_cause_rank = root_cause_rank

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.failed_ranks, self.root_cause_rank))


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

    Under ``TORCH_TP_TEST_DEVICE=cuda`` rank ``r`` computes on ``cuda:r``; a
    ``world_size`` above the GPUs visible skips the calling test (outside a
    test: ``RuntimeError``). CUDA tensors in the arguments and results arrive
    on the receiver's current device.

    Example:
        >>> # xdoctest: +SKIP("starts worker processes; fn must be module-level")
        >>> run_on_ranks(torch.add, 2, torch.ones(1), other=torch.ones(1))
        [tensor([2.]), tensor([2.])]
    """
    __tracebackhide__ = True
    _check_world_size(world_size)
    task = _pickle_task(fn, args, kwargs)
    device = harness_device()
    _require_devices_for(world_size, device)
    pool = _pool_for(world_size, device)
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


def _require_devices_for(size: int, device: str) -> None:
    """Skip the calling test (raise outside one) when ``device`` cannot hold ``size`` ranks."""
    __tracebackhide__ = True
    if device == "cpu":
        return
    reason = device_skip_reason(device, device_count(device), world_size=size)
    if reason is None:
        return
    if "PYTEST_CURRENT_TEST" in os.environ:  # a test that calls run_on_ranks(fn, N) itself
        import pytest

        pytest.skip(reason)
    raise RuntimeError(f"run_on_ranks: {reason}")


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


def _pool_for(size: int, device: str = "cpu") -> "_WorkerPool":
    __tracebackhide__ = True
    pool = _POOLS.get(size)
    if pool is not None and not (pool.all_alive() and pool.device == device):
        _POOLS.pop(size).kill()
        pool = None
    if pool is None:
        pool = _WorkerPool(size, _session_dir(), device)
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
        imported = [m for package, modules in _FORKSERVER_PRELOAD_IF_IMPORTED.items() if package in sys.modules for m in modules]
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD + imported)
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


class _WorkerPool:
    """``size`` worker processes sharing one process group on ``device`` (gloo on CPU)."""

    def __init__(self, size: int, parent_dir: str, device: str = "cpu") -> None:
        self.size, self.device = size, device
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
                        args=(r, self.size, self.workdir, child_end, os.getpid(), self.device),
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
        raise RankFailure(report.message, report.failed_ranks, report.root_cause_rank)

    def all_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def stop(self) -> None:
        """Ask workers to leave cleanly; kill whatever does not."""
        started = self._started()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        deadline = time.monotonic() + _STOP_WAIT
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill(started)

    def kill(self, started: dict[int, int] | None = None) -> None:
        """Kill every worker and what they started (:func:`torch_tp._supervise.orphans.end_processes`:
        the workers' descendants, ``started`` if noted earlier, and every process marked with
        this pool's directory), and remove the pool's files."""
        started = {**(started or {}), **self._started()}  # before the workers die: then they are orphans
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(_STOP_WAIT)
            with contextlib.suppress(ValueError):
                proc.close()
        for conn in self.conns:
            conn.close()
        end_processes(started, job=self.workdir)
        self.procs, self.conns = [], []
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _started(self) -> dict[int, int]:
        return descendants([p.pid for p in self.procs if p.pid is not None and p.is_alive()])

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
            raise RankFailure(report.message, report.failed_ranks, report.root_cause_rank)
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
                return _Reply(*conn.recv())
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
                if self.device != "cpu":  # rank r's CUDA tensors unpickle on cuda:r
                    results[r] = to_current_device(results[r])
            except Exception:
                replies[r] = _Reply("error", _parent_side_record(
                    "the parent could not unpickle this rank's return value:\n" + traceback.format_exc()
                ))
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
    ) -> _Report:
        silent = [r for r in range(self.size) if r not in replies]
        stopped = frozenset(r for r in silent if self.procs[r].pid and process_state(self.procs[r].pid) == "T")
        stacks = self._dump_stacks(silent, stopped)
        return _build_report(headline, self.workdir, replies, stacks, log_offsets, stopped)

    def _dump_stacks(self, ranks: list[int], stopped: frozenset[int] = frozenset()) -> dict[int, str]:
        """Ask live ``ranks`` to write their Python stacks; return what they wrote. A rank
        ``stopped`` by a signal is continued to write it (the pool is killed afterwards)."""
        offsets = {}
        for r in ranks:
            proc = self.procs[r]
            path = _stack_path(self.workdir, r)
            if proc.is_alive() and proc.pid is not None:
                offsets[r] = _file_size(path)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR1)
                    if r in stopped:  # the dump runs first, where it stopped
                        os.kill(proc.pid, signal.SIGCONT)
        _wait_for_files_to_settle(
            {_stack_path(self.workdir, r): off for r, off in offsets.items()}, _STACK_DUMP_WAIT
        )
        return {r: _read_from(_stack_path(self.workdir, r), off) for r, off in offsets.items()}


def _absolute_sys_path() -> list[str]:
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path]

