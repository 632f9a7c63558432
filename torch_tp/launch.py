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
                                      root cause (:mod:`torch_tp._supervise.root_cause`)
a hung rank is SIGTERMed, silently    its Python stack is dumped (faulthandler) and the report
                                      names it as the rank its peers waited for, with the
                                      collective, the group and the ranks that never arrived
``os._exit(0)`` on a rank is success  "exited with code 0 before its function returned"
names only the first failed rank's    every rank's exit code; a rank killed by SIGKILL (the OOM
exit code; a rank killed by SIGKILL   killer) is named as killed by SIGKILL, a rank stopped by
later reads as "exit code 0"          SIGSTOP as stopped, with its stack (the launcher watches
                                      the ranks' ``/proc`` state)
a stopped rank holds the agent for    the launcher delivers the agent's SIGTERM (SIGCONT) once
30 s after its peers timed out        a peer has ended
a rank that returns while its peers   named as the rank that returned early
wait in a collective: a timeout in
the closing barrier
a killed parent leaves ranks running  ranks die with the process that launched them (Linux
(blocked in a collective)             parent-death signal, pidfd watch: :mod:`torch_tp._supervise.orphans`)
processes a rank started outlive the  they end with the run (:func:`torch_tp._supervise.orphans.end_processes`)
run
a 50 MiB exception message makes a    every message, traceback and output is bounded
100 MiB report                        (:func:`torch_tp._supervise.rank_failure.bounded`)
====================================  =======================================================

The failure is raised in the parent as :class:`LaunchFailure`, root cause first.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import glob
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch_tp._supervise.heartbeat import Heartbeat, lost_ranks_line
from torch_tp._supervise.orphans import descendants, end_processes, exit_with, mark_job, process_state, without_watcher_threads
from torch_tp._supervise.rank_failure import exception_record, native_errors_to_stderr
from torch_tp._supervise.root_cause import OUTPUT_CHARS, STOPPED, RankOutcome, explain, output_tail, root_cause

__all__ = ["LaunchFailure", "launch", "launched_by_torchrun", "rank_device"]

DEFAULT_TIMEOUT = timedelta(seconds=120)

# A rank whose collective failed (a consequence) waits this long before it exits, so that
# torchrun's agent, which orders failures by the second they were seen, sees the cause first.
SYMPTOM_GRACE_SECONDS = 2.0
_MONITOR_INTERVAL = 0.05  # how often the agent (and torch_tp's watch) polls the ranks, seconds
_TREE_EVERY = 5  # the watch notes the ranks' descendants every this many polls (a /proc scan)
_SHUTDOWN_TIMEOUT = 3  # seconds a rank gets to end after SIGTERM before SIGKILL
_STACK_WAIT = 2.0  # seconds the parent waits for a stopped rank's stack dump to appear
_OUTPUT_LINES = 30
#: What the fork server imports once, so that every rank forks with it loaded (a rank would
#: otherwise import torch_tp and the program's main module itself: seconds per rank).
_PRELOAD = ["torch", "torch.distributed", "torch_tp"]
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
    server that has torch, torch_tp and the program's main module imported, so they start in a
    fraction of a second) or ``"spawn"``.
    ``fn`` and ``args`` are pickled: ``fn`` must be a module-level function. A ``fn`` that carries
    a ``before_group`` attribute has it called with ``args`` on each rank before the rank joins
    the process group (``tests/launch/fault_matrix.py`` faults a rank at the rendezvous with it).

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


def _run_rank(
    fn: Callable[..., Any],
    args: tuple,
    timeout: timedelta,
    on_return: Callable[[], None] | None = None,
    on_group: Callable[[dist.Store], None] | None = None,
) -> None:
    native_errors_to_stderr()
    before_group = getattr(fn, "before_group", None)  # the fault matrix's rendezvous site
    if before_group is not None:
        before_group(*args)
    device = rank_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = _init_default_group(backend, timeout)
    if on_group is not None:
        on_group(store)
    fn(*args)
    if on_return is not None:
        on_return()  # a rank that then waits in the barrier for peers still in a collective returned early
    # Only after success: no rank may tear its group down while a peer still talks to it (gloo
    # aborts the process then). A failing rank leaves it to its process's end, and its peers
    # learn of the failure from the launcher, not from a closed connection.
    dist.barrier()
    dist.destroy_process_group()
    # What fn built (a model's hooks, meshes) can sit in reference cycles that would otherwise
    # be collected during interpreter shutdown, destroying gloo objects with the runtime half
    # gone: "terminate called without an active exception", SIGABRT after a successful run.
    gc.collect()


def _init_default_group(backend: str, timeout: timedelta) -> dist.Store:
    """``init_process_group`` from the launcher's environment (``env://``), its keys under the
    restart attempt (``TORCHELASTIC_RESTART_COUNT``).

    torchrun's agent keeps one store for the whole job and its workers share it; a worker group
    restarted after a failure (``--max-restarts``) would find the previous attempt's gloo
    addresses under the same keys and fail in ``init_process_group`` ("connectFullMesh failed",
    about one restart in two with torch 2.13). Each attempt gets its own prefix instead, and
    so does each group a process starts (a script that calls :func:`launch` twice under
    torchrun initializes the default group twice, in the same store). Returns that store.
    """
    from torch.distributed.rendezvous import rendezvous

    global _GROUPS_STARTED
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store, rank, world_size = next(rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"torch_tp/attempt-{attempt}/group-{_GROUPS_STARTED}", store)
    _GROUPS_STARTED += 1
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return store


_GROUPS_STARTED = 0  # default groups this process initialized through launch (their store prefix)


def _torchrun_rank(fn: Callable[..., Any], args: tuple, timeout: timedelta) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    exit_with(os.getppid())  # the agent: a worker whose agent was killed (its node lost) ends too
    beats: list[Heartbeat] = []

    def start_beating(store: dist.Store) -> None:
        beats.append(Heartbeat(store, dist.get_rank(), dist.get_world_size()))
        beats[0].start()

    try:
        _run_rank(fn, args, timeout, on_group=start_beating)
    except Exception as exc:
        record = exception_record(exc)
        if record["symptom"]:  # a consequence: let the agent see the root cause first, meanwhile
            lost = _name_the_lost_ranks(beats)  # find out who is gone (the agent prints the traceback)
            record["message"], record["traceback"] = record["message"] + lost, record["traceback"] + lost
        _record_for_torchrun(record, ErrorHandler)
        raise
    finally:
        for beat in beats:
            beat.stop()


def _name_the_lost_ranks(beats: list[Heartbeat]) -> str:
    """After a failed collective: the line naming the peers with no heartbeat, printed to this
    rank's stderr (the agent's console) and returned for the error file. Takes
    ``SYMPTOM_GRACE_SECONDS`` either way."""
    if not beats:  # the group never started: nothing beats
        time.sleep(SYMPTOM_GRACE_SECONDS)
        return ""
    beat, start = beats[0], time.monotonic()
    line = lost_ranks_line(beat.rank, beat.world_size, beat.lost_ranks(probe_s=SYMPTOM_GRACE_SECONDS), SYMPTOM_GRACE_SECONDS)
    print(line, file=sys.stderr, flush=True)
    # a store that cannot be read fails the probe at once: wait out the rest, so that the agent
    # sees its store gone first (`python -m torch_tp.run` then names this node's and the lost ranks)
    time.sleep(max(0.0, SYMPTOM_GRACE_SECONDS - (time.monotonic() - start)))
    return "\n" + line


def _record_for_torchrun(record: dict, handler: type) -> None:
    """What ``@record`` writes to torchrun's error file (torchrun prints it), from the bounded
    record: the type survives a ``__str__`` that raises, and a 50 MiB message is cut."""
    path = handler()._get_error_file_path()
    if not path:
        return
    data = {"message": {"message": f"{record['type']}: {record['message']}",
                        "extraInfo": {"py_callstack": record["traceback"], "timestamp": str(int(time.time()))}}}
    with open(path, "w") as f:
        json.dump(data, f)


def _elastic_rank(
    fn: Callable[..., Any], args: tuple, timeout: timedelta, run_dir: str, owner_pid: int, nproc: int, check: bool
) -> None:
    """Entry point of a rank started by :func:`launch` (module-level: the agent pickles it)."""
    exit_with(owner_pid)
    mark_job(run_dir)  # the processes it starts end with the run (_RankWatch)
    if check:  # the env var is read once, at import: the fork server imported torch already
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    rank = int(os.environ["RANK"])
    _write_json(_pid_path(run_dir, rank), {"pid": os.getpid()})
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a rank even inside a collective
    faulthandler.enable(all_threads=True)  # SIGABRT, SIGSEGV: the stack goes to stderr (captured)
    stacks = open(_stack_path(run_dir, rank), "w")
    faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    returned: dict[str, Any] = {}

    def note_return() -> None:
        returned.update(returned=True, time_ns=time.time_ns())
        _write_json(_record_path(run_dir, rank), returned)

    try:
        _run_rank(fn, args, timeout, note_return)
    except BaseException as exc:
        # The agent may already be stopping the ranks (SIGTERM reaches whichever thread it
        # likes, so it cannot be held back): the record without its traceback goes first, in
        # microseconds; formatting the traceback reads source files and takes far longer.
        _write_json(_record_path(run_dir, rank), {**returned, **exception_record(exc, with_traceback=False)})
        _write_json(_record_path(run_dir, rank), {**returned, **exception_record(exc)})
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


def _pid_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.pid")


# -- the parent ------------------------------------------------------------------------------------


def _forkserver_preload() -> list[str]:
    """:data:`_PRELOAD` and the program's main module: its script (``"__main__"``, which the
    fork server imports from its path, as a spawned rank would) or, for ``-m pkg.mod``, its
    package ``pkg``. Not ``pkg.mod`` itself: each rank runs it again as ``__mp_main__``, and
    runpy warns (a ``RuntimeWarning`` on every rank) when it finds that module already imported."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    package = [spec.parent] if spec is not None and spec.parent else []
    return ["__main__", *_PRELOAD, *package]


def _default_start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _launch_elastic(
    fn: Callable[..., Any], args: tuple, nproc: int, timeout: timedelta, method: str, run_dir: str, check: bool
) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if method == "forkserver":
        multiprocessing.set_forkserver_preload(_forkserver_preload())  # only before the server first starts
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
    watch = _RankWatch(run_dir, nproc)
    try:
        with watch, watch.agent_stops_noted(), _quiet_agent(), _rendezvous_event_names_from_frames(), _signal_handlers_restored():
            entry(fn, args, timeout, run_dir, os.getpid(), nproc, check)
    except ChildFailedError as failed:
        raise _failure(fn, nproc, run_dir, failed, watch) from None
    _raise_if_a_rank_left_early(fn, nproc, run_dir, watch)


class _RankWatch:
    """What the agent does not say, watched from the launching process while the ranks run.

    Every ``_MONITOR_INTERVAL`` seconds a thread notes each rank's process (from the pid file
    the rank writes) and, through it, the rank's exit code (the agent names only the first
    failure: a rank killed by SIGKILL after it read as "exit code 0"); whether a rank is stopped
    by a signal (SIGSTOP): such a rank never ends, and holds the agent's SIGTERM pending for 30 s,
    so once a peer has ended the watch sends SIGTERM itself and continues it (its stack is dumped
    where it stopped); and the processes the ranks started, which :meth:`__exit__` ends with
    those marked with the run (:func:`torch_tp._supervise.orphans.end_processes`).
    """

    def __init__(self, run_dir: str, nproc: int) -> None:
        self.run_dir, self.nproc = run_dir, nproc
        self.pids: dict[int, int] = {}  # rank: pid
        self.stopped: set[int] = set()  # ranks found stopped by a signal once a peer had ended
        self.ended_before_agent: set[int] | None = None  # ranks gone when the agent began stopping ranks
        self.started: dict[int, int] = {}  # the ranks' descendants: pid: start time
        self._procs: dict[int, Any] = {}  # pid: the agent's multiprocessing.Process
        # rank: its Process, from the agent's context (a rank ended before it wrote its pid file,
        # e.g. stopped by the agent while it started, has an exit code all the same)
        self.by_rank: dict[int, Any] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torch_tp-launch-watch", daemon=True)

    def __enter__(self) -> "_RankWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._done.set()
        self._thread.join()
        end_processes(self.started, job=self.run_dir)

    @contextlib.contextmanager
    def agent_stops_noted(self) -> Iterator[None]:
        """Note which ranks had already ended when the agent began stopping the others: the first
        SIGTERM it sends, from torch.multiprocessing's ``ProcessContext.join`` (on the first failure
        it sees) or its ``PContext.close``. A rank that ended by SIGTERM before then was sent it
        from outside (``kill``, a scheduler), though the agent may list first the peer that lost
        its connection to it."""
        from torch.distributed.elastic.multiprocessing import api
        from torch.multiprocessing.spawn import ProcessContext

        original_close, original_join = api.PContext.close, ProcessContext.join

        def close(context: Any, *args: Any, **kwargs: Any) -> Any:
            self._note_agent_stopping()
            return original_close(context, *args, **kwargs)

        def join(context: Any, *args: Any, **kwargs: Any) -> Any:
            self.by_rank.update(enumerate(context.processes))  # local rank order: one node
            for process in context.processes:
                if "terminate" not in vars(process):  # the process's own SIGTERM, noted first
                    process.terminate = functools.partial(self._terminate, process)
            return original_join(context, *args, **kwargs)

        api.PContext.close, ProcessContext.join = close, join
        try:
            yield
        finally:
            api.PContext.close, ProcessContext.join = original_close, original_join

    def _terminate(self, process: Any) -> None:
        self._note_agent_stopping()
        type(process).terminate(process)

    def _note_agent_stopping(self) -> None:
        if self.ended_before_agent is None:
            self._read_pids()
            self.ended_before_agent = {r for r, pid in self.pids.items() if process_state(pid) in (None, "Z")}

    def exit_codes(self) -> dict[int, int]:
        """Each rank's exit code, where its process was seen (call after the agent returned)."""
        self._read_pids()  # a rank that ended between two polls left its pid file behind
        codes = {}
        for rank in range(self.nproc):
            proc = self._procs.get(self.pids[rank]) if rank in self.pids else None
            with contextlib.suppress(ValueError):  # a closed Process
                proc = proc or self.by_rank.get(rank)
                if proc is not None and proc.exitcode is not None:
                    codes[rank] = proc.exitcode
        return codes

    def _read_pids(self) -> None:
        for rank in range(self.nproc):
            if rank not in self.pids and (record := _read_json(_pid_path(self.run_dir, rank))):
                self.pids[rank] = record["pid"]

    def _run(self) -> None:
        polls = 0
        while not self._done.wait(_MONITOR_INTERVAL):
            try:
                self._poll(tree=polls % _TREE_EVERY == 0)
            except Exception:  # noqa: BLE001 - the watch only adds to the report; the run goes on
                pass
            polls += 1

    def _poll(self, tree: bool) -> None:
        # the agent's Process objects (multiprocessing's registry of this process's children,
        # from their start until the agent joins them): their exit codes, once it has
        children = getattr(multiprocessing.process, "_children", set())
        self._procs.update((p.pid, p) for p in children.copy() if p.pid is not None)
        self._read_pids()
        states = {rank: process_state(pid) for rank, pid in self.pids.items()}
        if any(state in (None, "Z") for state in states.values()):  # a rank ended: so does the run
            for rank in (r for r, state in states.items() if state == "T" and r not in self.stopped):
                self.stopped.add(rank)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pids[rank], signal.SIGTERM)  # delivered (stack dump, then the end)
                    os.kill(self.pids[rank], signal.SIGCONT)  # as it continues
        if tree:
            self.started.update(descendants([pid for rank, pid in self.pids.items() if states[rank] not in (None, "Z")]))


def _failure(fn: Callable[..., Any], nproc: int, run_dir: str, failed: Any, watch: _RankWatch) -> LaunchFailure:
    seen = {rank: f.exitcode for rank, f in failed.failures.items()}  # the agent's first failure
    known = {**watch.exit_codes(), **seen}
    # a rank that ended by SIGTERM before the agent stopped anyone: sent from outside (`kill`, a
    # scheduler), a cause, though the agent may list the peer that lost its connection first
    outside = {r for r in watch.ended_before_agent or () if known.get(r) == -signal.SIGTERM}
    outcomes = [
        _outcome(run_dir, rank, known.get(rank, 0), listed=rank in seen or rank in outside, stopped=rank in watch.stopped)
        for rank in range(nproc)
    ]
    return _launch_failure(fn, nproc, outcomes, _exit_codes(outcomes, known))


def _exit_codes(outcomes: list[RankOutcome], known: dict[int, int]) -> dict[int, int]:
    """Every failed rank's exit code: as the watch saw it, else from its record: ``sys.exit(n)``
    ends with ``n``, another exception with 1 (torch.multiprocessing's rule), a rank stopped by
    the agent with SIGTERM."""
    codes = {}
    for o in outcomes:
        if o.rank in known and (o.failed or known[o.rank] != 0):
            codes[o.rank] = known[o.rank]
        elif o.record and o.record.get("type"):
            codes[o.rank] = _system_exit_code(o.record) if o.record["type"] == "SystemExit" else 1
        elif o.state in ("running", "stopped", "returned"):
            codes[o.rank] = -signal.SIGTERM
        elif o.state == "exited":
            codes[o.rank] = o.exit_code
    return codes


def _system_exit_code(record: dict) -> int:
    code = record["message"]
    if code in ("None", "0"):
        return 0
    return int(code) if code.lstrip("-").isdigit() else 1


def _raise_if_a_rank_left_early(fn: Callable[..., Any], nproc: int, run_dir: str, watch: _RankWatch) -> None:
    """All ranks ended with code 0; one that never recorded success left early (``os._exit(0)``)."""
    outcomes = [_outcome(run_dir, rank, 0, listed=False, stopped=rank in watch.stopped) for rank in range(nproc)]
    if any(o.failed for o in outcomes):
        raise _launch_failure(fn, nproc, outcomes, {})


def _launch_failure(fn: Callable[..., Any], nproc: int, outcomes: list[RankOutcome], exit_codes: dict[int, int]) -> LaunchFailure:
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    message = explain(f"torch_tp.launch: {name} failed on {nproc} ranks", outcomes)
    ordered = root_cause(outcomes)
    return LaunchFailure(message, ordered[0].rank, sorted(o.rank for o in ordered), exit_codes)


def _outcome(run_dir: str, rank: int, exit_code: int | None, listed: bool = False, stopped: bool = False) -> RankOutcome:
    """What ``rank`` did, from its record, its exit code (``listed``: the agent named it as the
    first failure, before it stopped anyone), whether the watch found it ``stopped`` by a signal,
    its stack dump and its stderr."""
    # a rank stopped between writing its record and renaming it into place left a whole .tmp
    record = _read_json(_record_path(run_dir, rank)) or _read_json(_record_path(run_dir, rank) + ".tmp")
    output = _stderr_tail(run_dir, rank)
    if stopped:  # its stack was dumped where it stopped, when the watch continued it
        stack = _stack_of(run_dir, rank, wait=_STACK_WAIT)
        return RankOutcome(rank, "stopped", exit_code=exit_code, stack=stack, output=output, how=STOPPED)
    if record and record.get("done"):
        return RankOutcome(rank, "ok")
    if record and record.get("type") and not record.get("returned"):
        return RankOutcome(rank, "raised", record=record, exit_code=exit_code, output=output)
    # Stopped by the agent while running: a rank the agent did not list ended by its SIGTERM or,
    # after 3 s, its SIGKILL (then the SIGTERM stack dump was written: a rank killed by SIGKILL
    # from outside, e.g. by the OOM killer, has none). With no exit code known (0), the dump
    # tells such a rank apart from one that exited 0 on its own.
    by_agent = not listed and exit_code in (-signal.SIGTERM, -signal.SIGKILL)
    stack = _stack_of(run_dir, rank, wait=_STACK_WAIT if by_agent and exit_code == -signal.SIGTERM else 0.0)
    if record:  # it returned from its function, then waited for the others (the closing barrier)
        record = record if record.get("type") else None
        return RankOutcome(rank, "returned", record=record, exit_code=exit_code, stack=stack, output=output)
    if (by_agent and (exit_code == -signal.SIGTERM or stack)) or (exit_code == 0 and stack):
        how = "stopped by the launcher (SIGTERM)" if exit_code in (0, -signal.SIGTERM) else "stopped by the launcher (SIGKILL)"
        return RankOutcome(rank, "running", exit_code=exit_code, stack=stack, output=output, how=how)
    before, fatal = _split_fatal_dump(output)
    if exit_code == 0 and fatal:  # killed by a fatal signal the agent did not get to list
        exit_code = _FATAL_SIGNALS.get(fatal.splitlines()[0].removeprefix("Fatal Python error: ").strip(), exit_code)
    return RankOutcome(rank, "exited", exit_code=exit_code, stack=fatal or stack, output=before)


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
    """The last lines of the rank's stderr, at most ``OUTPUT_CHARS`` characters (a rank that
    printed 50 MiB is not read whole)."""
    paths = glob.glob(os.path.join(run_dir, "logs", "*", "attempt_*", str(rank), "stderr.log"))
    if not paths:
        return ""
    with open(paths[0], "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * OUTPUT_CHARS))
        return output_tail(f.read().decode(errors="replace"), _OUTPUT_LINES)


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
def _rendezvous_event_names_from_frames() -> Iterator[None]:
    """The agent's rendezvous names each event it records after the calling method, found with
    ``inspect.stack()`` twice per event: every frame's source file looked up, every module
    searched. That was half of a launch (0.5 s of 1 s; more in a process with many modules
    loaded, such as a test session). The same name read from the frame itself costs nothing."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # what inspect.stack()[depth].function gives
        except ValueError:
            return "no_method_name"

    original = dynamic_rendezvous.get_method_name
    dynamic_rendezvous.get_method_name = get_method_name
    try:
        yield
    finally:
        dynamic_rendezvous.get_method_name = original


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
