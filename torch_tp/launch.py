"""Run a function on every rank: spawned CPU ranks by default, or the ranks ``torchrun`` made.

Scripts (the demo, the tutorials) call :func:`launch` so that ``python script.py`` starts
``nproc`` CPU ranks talking over gloo, while ``torchrun --nproc-per-node N script.py`` uses the
launcher's ranks, with NCCL when CUDA is available.

The ranks are started by torch's elastic agent, the engine behind ``torchrun``
(``torch.distributed.launcher.api.elastic_launch``): it rendezvouses the ranks, watches them
and, the moment one fails, stops the others. What it does not do, torch_tp does on top:

====================================  =======================================================
torchrun's agent alone                :func:`launch`
====================================  =======================================================
root cause = earliest failure, to     each rank records its exception with a nanosecond
the second; a peer that timed out in  timestamp and the collective it came out of; a failure
a collective can come first           inside a collective counts as a consequence, never the
                                      root cause (:mod:`torch_tp._root_cause`)
a hung rank is SIGTERMed, silently    its Python stack is dumped (faulthandler) and the report
                                      names it as the rank its peers waited for, with the
                                      collective, the group and the ranks that never arrived
``os._exit(0)`` on a rank is success  "exited with code 0 before its function returned"
a killed parent leaves ranks running  ranks die with the process that launched them (Linux
(blocked in a collective)             parent-death signal, pidfd watch: :mod:`torch_tp._orphans`)
====================================  =======================================================

The failure is raised in the parent as :class:`LaunchFailure`, root cause first.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import glob
import json
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch_tp._orphans import exit_with, without_watcher_threads
from torch_tp._rank_failure import exception_record
from torch_tp._root_cause import RankOutcome, explain, root_cause

__all__ = ["LaunchFailure", "launch", "launched_by_torchrun", "rank_device"]

DEFAULT_TIMEOUT = timedelta(seconds=120)

# A rank whose collective failed (a consequence) waits this long before it exits, so that
# torchrun's agent, which orders failures by the second they were seen, sees the cause first.
SYMPTOM_GRACE_SECONDS = 2.0
_MONITOR_INTERVAL = 0.05  # how often the agent polls the ranks, seconds
_SHUTDOWN_TIMEOUT = 3  # seconds a rank gets to end after SIGTERM before SIGKILL
_STACK_WAIT = 2.0  # seconds the parent waits for a stopped rank's stack dump to appear
_OUTPUT_LINES = 30
_PRELOAD = ["torch", "torch.distributed"]
# faulthandler's first line for each fatal signal
_FATAL_SIGNALS = {
    "Aborted": -signal.SIGABRT,
    "Segmentation fault": -signal.SIGSEGV,
    "Bus error": -signal.SIGBUS,
    "Floating-point exception": -signal.SIGFPE,
    "Illegal instruction": -signal.SIGILL,
}


def launched_by_torchrun() -> bool:
    """True when the launcher already set this process's rank (``torchrun``, ``torch.distributed.run``).

    Example::

        >>> import os
        >>> launched_by_torchrun() == ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
        True
    """
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_device() -> torch.device:
    """The device this rank computes on: its CUDA device under torchrun with CUDA, else CPU.

    Example::

        >>> rank_device().type in ("cpu", "cuda")
        True
    """
    if launched_by_torchrun() and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class LaunchFailure(RuntimeError):
    """Raised by :func:`launch` when a rank failed: its message names the root-cause rank first.

    ``root_cause_rank`` is that rank; ``failed_ranks`` every rank that failed, raised, hung or
    was stopped; ``exit_codes`` the exit code of every rank that ended non-zero (negative: the
    signal that killed it), as torch's agent saw them.

    Example::

        >>> # xdoctest: +SKIP("starts processes")
        >>> try:
        ...     launch(_rank_1_raises, nproc=2)
        ... except LaunchFailure as e:
        ...     print(e.root_cause_rank, e.exit_codes)
        1 {0: -15, 1: 1}
    """

    def __init__(self, message: str, root_cause_rank: int, failed_ranks: list[int], exit_codes: dict[int, int]) -> None:
        super().__init__(message)
        self.root_cause_rank = root_cause_rank
        self.failed_ranks = failed_ranks
        self.exit_codes = exit_codes

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.root_cause_rank, self.failed_ranks, self.exit_codes))


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int = 2,
    timeout: timedelta = DEFAULT_TIMEOUT,
    start_method: str | None = None,
    check_collectives: bool = False,
) -> None:
    """Call ``fn(*args)`` on every rank with the default process group initialized.

    Under ``torchrun`` this process is one rank (``nproc`` is ignored; torchrun reports
    failures, this rank's recorded for it). Otherwise ``nproc`` CPU ranks are started on this
    machine by torch's elastic agent, with the gloo backend. Every collective times out after
    ``timeout``. If a rank fails, the others are stopped at once and :class:`LaunchFailure`
    is raised here, naming the rank that failed first, its exception type, message and
    traceback (or exit code, signal, or, for a rank its peers waited for, its Python stack),
    then what happened to the other ranks.

    ``start_method`` is ``"forkserver"`` (the default where available: ranks fork from a
    server that has torch imported, so they start in a fraction of a second) or ``"spawn"``.
    ``fn`` and ``args`` are pickled: ``fn`` must be a module-level function.

    ``check_collectives=True`` runs the ranks under torch's collective check
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``): before every collective the ranks compare the op, the
    shapes and the dtypes, so a rank that calls ``all_gather`` while the others call
    ``all_reduce``, or passes a different size, is named before anything is sent. It costs an
    extra small collective per call: a debugging switch.

    Example::

        >>> # xdoctest: +SKIP("spawns processes")
        >>> def hello():
        ...     print(f"rank {dist.get_rank()} of {dist.get_world_size()}")
        >>> launch(hello, nproc=2)
    """
    if nproc < 1:
        raise ValueError(f"torch_tp.launch: nproc must be at least 1, got {nproc}")
    if launched_by_torchrun():
        _torchrun_rank(fn, args, timeout)
        return
    method = start_method or _default_start_method()
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"torch_tp.launch: start_method must be 'forkserver' or 'spawn', got {method!r}")
    run_dir = tempfile.mkdtemp(prefix="torch_tp_launch_")
    try:
        _launch_elastic(fn, args, nproc, timeout, method, run_dir, check_collectives)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# -- one rank ------------------------------------------------------------------------------------


def _run_rank(fn: Callable[..., Any], args: tuple, timeout: timedelta) -> None:
    device = rank_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timeout)
    fn(*args)
    # Only after success: no rank may tear its group down while a peer still talks to it (gloo
    # aborts the process then). A failing rank leaves it to its process's end, and its peers
    # learn of the failure from the launcher, not from a closed connection.
    dist.barrier()
    dist.destroy_process_group()
    # What fn built (a model's hooks, meshes) can sit in reference cycles that would otherwise
    # be collected during interpreter shutdown, destroying gloo objects with the runtime half
    # gone: "terminate called without an active exception", SIGABRT after a successful run.
    gc.collect()


def _torchrun_rank(fn: Callable[..., Any], args: tuple, timeout: timedelta) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    try:
        _run_rank(fn, args, timeout)
    except Exception as exc:
        if exception_record(exc, with_traceback=False)["symptom"]:
            time.sleep(SYMPTOM_GRACE_SECONDS)  # let the agent see the root cause first
        ErrorHandler().record_exception(exc)  # what @record writes: torchrun prints it
        raise


def _elastic_rank(
    fn: Callable[..., Any], args: tuple, timeout: timedelta, run_dir: str, owner_pid: int, nproc: int, check: bool
) -> None:
    """Entry point of a rank started by :func:`launch` (module-level: the agent pickles it)."""
    exit_with(owner_pid)
    if check:  # the env var is read once, at import: the fork server imported torch already
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    rank = int(os.environ["RANK"])
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a rank even inside a collective
    faulthandler.enable(all_threads=True)  # SIGABRT, SIGSEGV: the stack goes to stderr (captured)
    stacks = open(_stack_path(run_dir, rank), "w")
    faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    try:
        _run_rank(fn, args, timeout)
    except BaseException as exc:
        # The agent may already be stopping the ranks (SIGTERM reaches whichever thread it
        # likes, so it cannot be held back): the record without its traceback goes first, in
        # microseconds; formatting the traceback reads source files and takes far longer.
        _write_json(_record_path(run_dir, rank), exception_record(exc, with_traceback=False))
        _write_json(_record_path(run_dir, rank), exception_record(exc))
        raise
    _write_json(_record_path(run_dir, rank), {"done": True})


def _write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)  # the parent never reads half a record


def _record_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.json")


def _stack_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.stack")


# -- the parent ------------------------------------------------------------------------------------


def _default_start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _launch_elastic(
    fn: Callable[..., Any], args: tuple, nproc: int, timeout: timedelta, method: str, run_dir: str, check: bool
) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if method == "forkserver":
        multiprocessing.set_forkserver_preload(_PRELOAD)  # only before the server first starts
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"torch_tp-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=_MONITOR_INTERVAL,
        start_method=method,
        shutdown_timeout=_SHUTDOWN_TIMEOUT,
        # stderr goes to a file per rank and, prefixed, to this terminal: the report quotes it
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "logs"), redirects=Std.ERR, tee=Std.ERR),
        log_line_prefix_template="[rank${rank}]:",
    )
    entry = elastic_launch(config, _elastic_rank)
    try:
        with _quiet_agent(), _signal_handlers_restored():
            entry(fn, args, timeout, run_dir, os.getpid(), nproc, check)
    except ChildFailedError as failed:
        raise _failure(fn, nproc, run_dir, failed) from None
    _raise_if_a_rank_left_early(fn, nproc, run_dir)


def _failure(fn: Callable[..., Any], nproc: int, run_dir: str, failed: Any) -> LaunchFailure:
    seen = {rank: f.exitcode for rank, f in failed.failures.items()}
    outcomes = [_outcome(run_dir, rank, seen.get(rank, 0)) for rank in range(nproc)]
    return _launch_failure(fn, nproc, outcomes, _exit_codes(outcomes, seen))


def _exit_codes(outcomes: list[RankOutcome], seen: dict[int, int]) -> dict[int, int]:
    """Every failed rank's exit code. The agent lists the ranks it saw fail before it stopped
    the rest; the others are known from their records: ``sys.exit(n)`` ends with ``n``, another
    exception with 1 (torch.multiprocessing's rule), a rank stopped by the agent with SIGTERM."""
    codes = {}
    for o in outcomes:
        if o.rank in seen:
            codes[o.rank] = seen[o.rank]
        elif o.state == "raised":
            codes[o.rank] = _system_exit_code(o.record) if o.record["type"] == "SystemExit" else 1
        elif o.state == "running":
            codes[o.rank] = -signal.SIGTERM
        elif o.state == "exited":
            codes[o.rank] = o.exit_code
    return codes


def _system_exit_code(record: dict) -> int:
    code = record["message"]
    if code in ("None", "0"):
        return 0
    return int(code) if code.lstrip("-").isdigit() else 1


def _raise_if_a_rank_left_early(fn: Callable[..., Any], nproc: int, run_dir: str) -> None:
    """All ranks ended with code 0; one that never recorded success left early (``os._exit(0)``)."""
    outcomes = [_outcome(run_dir, rank, 0) for rank in range(nproc)]
    if any(o.failed for o in outcomes):
        raise _launch_failure(fn, nproc, outcomes, {})


def _launch_failure(fn: Callable[..., Any], nproc: int, outcomes: list[RankOutcome], exit_codes: dict[int, int]) -> LaunchFailure:
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    message = explain(f"torch_tp.launch: {name} failed on {nproc} ranks", outcomes)
    ordered = root_cause(outcomes)
    return LaunchFailure(message, ordered[0].rank, sorted(o.rank for o in ordered), exit_codes)


def _outcome(run_dir: str, rank: int, exit_code: int | None) -> RankOutcome:
    """What ``rank`` did, from its record, its exit code, its stack dump and its stderr."""
    # a rank stopped between writing its record and renaming it into place left a whole .tmp
    record = _read_json(_record_path(run_dir, rank)) or _read_json(_record_path(run_dir, rank) + ".tmp")
    output = _stderr_tail(run_dir, rank)
    if record and record.get("done"):
        return RankOutcome(rank, "ok")
    if record:
        return RankOutcome(rank, "raised", record=record, exit_code=exit_code, output=output)
    # Stopped by the agent while running: the agent lists such a rank with its signal, or not at
    # all (then its SIGTERM stack dump tells it apart from a rank that exited 0 on its own).
    stopped = exit_code in (-signal.SIGTERM, -signal.SIGKILL)
    stack = _stack_of(run_dir, rank, wait=_STACK_WAIT if stopped else 0.0)
    if stopped or (exit_code == 0 and stack):
        how = "stopped by the launcher (SIGTERM)" if exit_code in (0, -signal.SIGTERM) else "stopped by the launcher (SIGKILL)"
        return RankOutcome(rank, "running", exit_code=exit_code, stack=stack, output=output, how=how)
    before, fatal = _split_fatal_dump(output)
    if exit_code == 0 and fatal:  # killed by a fatal signal the agent did not get to list
        exit_code = _FATAL_SIGNALS.get(fatal.splitlines()[0].removeprefix("Fatal Python error: ").strip(), exit_code)
    return RankOutcome(rank, "exited", exit_code=exit_code, stack=fatal, output=before)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _stack_of(run_dir: str, rank: int, wait: float) -> str:
    """The rank's SIGTERM stack dump, waiting up to ``wait`` seconds for it to appear."""
    path = _stack_path(run_dir, rank)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if os.path.getsize(path) > 0:
                break
        time.sleep(0.05)
    with contextlib.suppress(OSError), open(path) as f:
        return without_watcher_threads(f.read())
    return ""


def _stderr_tail(run_dir: str, rank: int) -> str:
    paths = glob.glob(os.path.join(run_dir, "logs", "*", "attempt_*", str(rank), "stderr.log"))
    if not paths:
        return ""
    with open(paths[0], errors="replace") as f:
        lines = f.read().rstrip().splitlines()
    return "\n".join(lines[-_OUTPUT_LINES:])


def _split_fatal_dump(output: str) -> tuple[str, str]:
    """A rank's stderr, split before faulthandler's dump of a fatal signal (SIGABRT, SIGSEGV)."""
    start = output.find("Fatal Python error")
    if start < 0:
        return output, ""
    return output[:start], without_watcher_threads(output[start:])


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent logs every failure at length; :class:`LaunchFailure` says it once, in order."""
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _signal_handlers_restored() -> Iterator[None]:
    """The agent installs its own SIGINT/SIGTERM handlers; put this process's back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    except Exception as exc:
        sigval = getattr(exc, "sigval", None)
        if sigval == signal.SIGINT:  # the agent's SignalException for Ctrl-C
            raise KeyboardInterrupt from None
        raise
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
