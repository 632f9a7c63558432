"""Failure reports of the distributed test harness (parent side).

When a task or a pool startup fails, :mod:`torch_tp.testing._dist` turns what
each rank answered, the stack dumps of ranks that did not answer and the
recent output of every failed rank into the message of a
:class:`~torch_tp.testing.RankFailure`.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from torch_tp.testing._rank import _log_path


#: How many trailing lines of a failing rank's output go into the report.
LOG_TAIL_LINES = 40


@dataclass
class _Reply:
    """What one rank answered to one request."""

    kind: str  # "ready" | "ok" | "error" | "died"
    payload: Any = None

    @property
    def failed(self) -> bool:
        return self.kind in ("error", "died")


@dataclass
class _Report:
    message: str
    failed_ranks: list[int]


def _build_report(
    headline: str,
    workdir: str,
    replies: dict[int, _Reply],
    stacks: dict[int, str],
    log_offsets: list[int],
) -> _Report:
    """Report on every rank that failed or, missing from ``replies``, did not answer.

    ``stacks`` holds the stack dumps of ranks that did not answer;
    ``log_offsets`` (one per rank) says where each rank's log stood before.
    """
    size = len(log_offsets)
    silent = [r for r in range(size) if r not in replies]
    sections = []
    failed_ranks = []
    for r in range(size):
        reply = replies.get(r)
        if reply is not None and not reply.failed:
            continue
        failed_ranks.append(r)
        sections.append(_rank_section(workdir, r, reply, stacks.get(r), log_offsets[r]))
    summary = _summarize(replies, silent)
    message = (
        f"{headline}: {summary}. The pool was killed and will be respawned "
        f"on the next call.\n" + "\n".join(sections)
    )
    return _Report(message, failed_ranks)


def _rank_section(
    workdir: str, r: int, reply: _Reply | None, stack: str | None, log_offset: int
) -> str:
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
    output = _tail(_log_path(workdir, r), log_offset)
    if output:
        parts.append(f"----- rank {r} output (last {LOG_TAIL_LINES} lines) -----\n{output}")
    return "\n".join(p for p in parts if p)


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


# Reading the files the ranks write (logs and stack dumps).


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

