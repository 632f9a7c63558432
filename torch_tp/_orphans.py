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

__all__ = ["exit_with", "without_watcher_threads"]

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
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
