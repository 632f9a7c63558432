"""Failure reports of the distributed test harness (parent side).

When a task or a pool startup fails, :mod:`torch_tp.testing._dist` turns what
each rank answered, the stack dumps of ranks that did not answer and the
recent output of every failed rank into the message of a
:class:`~torch_tp.testing.RankFailure`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from torch_tp._supervise.orphans import without_watcher_threads
from torch_tp._supervise.rank_failure import MESSAGE_CHARS, TRACEBACK_CHARS, bounded
from torch_tp._supervise.root_cause import OUTPUT_CHARS, STOPPED, RankOutcome, explain, output_tail, root_cause
from torch_tp.testing._rank import _log_path


#: How many trailing lines of a failing rank's output go into the report.
LOG_TAIL_LINES = 40


@dataclass
class _Reply:
    """What one rank answered to one request."""

    kind: str  # "ready" | "ok" | "error" (payload: a torch_tp._supervise.rank_failure record) | "died"
    payload: Any = None

    @property
    def failed(self) -> bool:
        return self.kind in ("error", "died")


@dataclass
class _Report:
    message: str
    failed_ranks: list[int]
    root_cause_rank: int | None


def _parent_side_record(text: str) -> dict[str, Any]:
    """A failure record for what went wrong in the parent on a rank's behalf."""
    return {"type": "RuntimeError", "message": bounded(text.strip().splitlines()[0], MESSAGE_CHARS),
            "traceback": bounded(text, TRACEBACK_CHARS), "time_ns": time.time_ns(), "collective": None,
            "symptom": False, "calls": {}}


def _build_report(
    headline: str,
    workdir: str,
    replies: dict[int, _Reply],
    stacks: dict[int, str],
    log_offsets: list[int],
    stopped: frozenset[int] = frozenset(),
) -> _Report:
    """Report on every rank that failed or, missing from ``replies``, did not answer: the root
    cause first (:mod:`torch_tp._supervise.root_cause`).

    ``stacks`` holds the stack dumps of ranks that did not answer, ``stopped`` those of them
    found stopped by a signal (SIGSTOP); ``log_offsets`` (one per rank) says where each rank's
    log stood before.
    """
    outcomes = [
        _outcome(r, replies.get(r), stacks.get(r), _tail(_log_path(workdir, r), log_offsets[r]), r in stopped)
        for r in range(len(log_offsets))
    ]
    message = explain(headline, outcomes, footer="The pool was killed and will be respawned on the next call.")
    ordered = root_cause(outcomes)
    return _Report(message, sorted(o.rank for o in ordered), ordered[0].rank if ordered else None)


def _outcome(r: int, reply: _Reply | None, stack: str | None, output: str, stopped: bool = False) -> RankOutcome:
    if reply is None:
        state, how = ("stopped", STOPPED) if stopped else ("running", "still running")
        return RankOutcome(r, state, stack=without_watcher_threads(stack or ""), output=output, how=how)
    if reply.kind == "error":
        record = reply.payload if isinstance(reply.payload, dict) else _parent_side_record(str(reply.payload))
        return RankOutcome(r, "raised", record=record, output=output)
    if reply.kind == "died":
        return RankOutcome(r, "exited", exit_code=reply.payload, output=output)
    return RankOutcome(r, "ok", output=output)  # quoted if it returned early


# Reading the files the ranks write (logs and stack dumps).


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int, limit: int | None = None) -> str:
    """The file from ``offset`` on; with ``limit``, only its last ``limit`` bytes (a rank that
    printed 50 MiB is not read whole)."""
    try:
        with open(path, "rb") as f:
            if limit is not None:
                offset = max(offset, f.seek(0, os.SEEK_END) - limit)
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _tail(path: str, offset: int) -> str:
    """The last lines a rank printed since ``offset`` (:func:`torch_tp._supervise.root_cause.output_tail`)."""
    return output_tail(_read_from(path, offset, limit=4 * OUTPUT_CHARS), LOG_TAIL_LINES)


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

