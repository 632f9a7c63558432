"""No orphans: a process torch_tp starts ends when the process that started the run ends.

A rank blocked inside a gloo collective never notices that its parent died: nothing it waits
on closes. Two mechanisms, both armed by :func:`exit_with`:

==========================  ==============================================================
the direct parent dies      Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills us
the run's owner dies        (a fork server sits between us and it) a daemon thread waits on
                            the owner's ``pidfd`` (Linux >= 5.3) or polls it every 0.2 s,
                            then SIGKILLs this process
==========================  ==============================================================

SIGKILL, not SIGTERM: a rank stuck in C++ would run no Python handler, and nothing it holds
needs cleaning (its files live in the run's directory, which the parent removes).

The processes a rank starts (``subprocess.Popen`` in the rank's function, a helper server) end
with the run too. The parent kills them when the run ends (:func:`end_processes`), found two
ways: the descendants of the ranks in ``/proc`` (:func:`descendants`; the launcher notes them
while the ranks live, since a dead rank's children are re-parented), and every process whose
environment carries the run's mark (:func:`mark_job`: a program a rank runs inherits it, and
keeps it after the rank died). Linux only; elsewhere these find nothing.

Imports nothing from torch_tp (shared by :mod:`torch_tp.launch` and :mod:`torch_tp.testing`).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time

__all__ = [
    "JOB_ENV",
    "descendants",
    "end_processes",
    "exit_with",
    "mark_job",
    "process_state",
    "without_watcher_threads",
]

#: The environment variable that marks the processes of one run (see :func:`mark_job`).
JOB_ENV = "TORCH_TP_JOB"

_PR_SET_PDEATHSIG = 1
_POLL_SECONDS = 0.2


def exit_with(owner_pid: int) -> None:
    """Kill this process as soon as its parent or ``owner_pid`` ends.

    Call it first thing in a child. If the owner is already gone, this process ends now.

    Example::

        >>> # xdoctest: +SKIP("would tie this process to its parent")
        >>> exit_with(int(os.environ["TORCH_TP_OWNER_PID"]))
    """
    parent = os.getppid()
    _kill_me_when_parent_dies()
    if os.getppid() != parent or not _alive(owner_pid):  # it died before prctl took effect
        _die()
    if owner_pid != parent:
        threading.Thread(target=_wait_then_die, args=(owner_pid,), name="torch_tp-exit-with", daemon=True).start()


def without_watcher_threads(stack_dump: str) -> str:
    """A faulthandler dump without the blocks of :func:`exit_with`'s watcher thread (noise).

    Example::

        >>> watcher = ["Thread 0x1 (most recent call first):", '  File "/x/_orphans.py", line 9 in _wait_then_die']
        >>> main = ["Current thread 0x2 (most recent call first):", '  File "t.py", line 5 in main']
        >>> print(without_watcher_threads("\\n".join(watcher) + "\\n\\n" + "\\n".join(main)))
        Current thread 0x2 (most recent call first):
          File "t.py", line 5 in main
    """
    blocks = stack_dump.split("\n\n")
    return "\n\n".join(b for b in blocks if "_orphans.py" not in b or "_wait_then_die" not in b)


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in ``/proc`` (``"R"``, ``"S"``, ``"T"``: stopped by a signal,
    ``"Z"``: ended), or ``None`` when there is no such process (or no ``/proc``).

    Example::

        >>> process_state(os.getpid()) in ("R", "S", None)
        True
    """
    stat = _stat(pid)
    return stat[0] if stat else None


def descendants(pids: list[int]) -> dict[int, int]:
    """Every process below ``pids`` (children, their children, ...), each with its start time (so
    that a pid reused later is not taken for it), from one pass over ``/proc``.

    Example::

        >>> import subprocess
        >>> child = subprocess.Popen(["sleep", "30"])
        >>> below = descendants([os.getpid()])
        >>> sorted(end_processes({child.pid: below[child.pid]}) if below else [child.pid]) == [child.pid]
        True
        >>> child.kill(); child.wait() in (-9,)
        True
    """
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for pid, stat in _all_stats().items():
        children.setdefault(int(stat[1]), []).append(pid)
        started[pid] = int(stat[19])
    found: dict[int, int] = {}
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = started[child]
                todo.append(child)
    return found


def mark_job(job: str) -> None:
    """Mark the processes this process starts from now on as part of ``job`` (:data:`JOB_ENV` in
    their environment), for :func:`end_processes` to find them when the run ends.

    Example::

        >>> # xdoctest: +SKIP("marks this process's children")
        >>> mark_job("torch_tp-1234abcd")  # first thing in a rank
    """
    os.environ[JOB_ENV] = job


def end_processes(found: dict[int, int], job: str | None = None) -> list[int]:
    """SIGKILL what is left of a run: the processes of ``found`` (pid: start time, from
    :func:`descendants`) still running with the same start time, and every process marked with
    ``job`` (:func:`mark_job`). Never this process. Returns the pids it killed.

    Example::

        >>> end_processes({}, job="no-such-job")
        []
    """
    stats = _all_stats()
    targets = {pid for pid, start in found.items() if pid in stats and int(stats[pid][19]) == start}
    if job is not None:
        targets |= {pid for pid in stats if _marked(pid, job)}
    killed = []
    for pid in sorted(targets - {os.getpid()}):
        if stats[pid][0] == "Z":
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name: [state, ppid, ...]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def _all_stats() -> dict[int, list[str]]:
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    stats = {}
    for entry in entries:
        if entry.isdigit() and (stat := _stat(int(entry))) is not None and len(stat) > 19:
            stats[int(entry)] = stat
    return stats


def _marked(pid: int, job: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{JOB_ENV}={job}".encode() in f.read().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def _kill_me_when_parent_dies() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the watcher thread still covers the owner
        pass


def _wait_then_die(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux, an old kernel, or already gone
        while _alive(pid):
            time.sleep(_POLL_SECONDS)
        _die()
        return
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll()  # readable once the process has ended (zombie or reaped)
    _die()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    return process_state(pid) == "Z"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
