"""Which rank failed first: ordering what every rank of a failed run reported.

When one rank fails, its peers fail too: blocked in a collective, they time out or lose the
connection, or the launcher stops them. Reported in rank order, the consequence often hides
the cause. Both harnesses that run ranks (:func:`torch_tp.launch.launch` and
:func:`torch_tp.testing.run_on_ranks`) describe each rank as a :class:`RankOutcome` and let
:func:`explain` put the root cause first:

=====================================================  ===========================================
a rank that ...                                        is
=====================================================  ===========================================
raised outside a collective, or ``sys.exit(n)``        a cause (the earliest one is the root cause)
ended without a word: ``os._exit``, SIGABRT, SIGSEGV,  a cause
SIGKILL (the OOM killer), a SIGTERM the launcher did
not send
was stopped by a signal (SIGSTOP) and never continued  a cause: its peers waited for it
raised inside a collective (timed out, lost its peer)  a consequence: it waited for another rank
was still running when the run was stopped, and not    the root cause when no rank is a cause: its
inside a collective                                    peers waited for it (a hang); its stack
                                                       shows where it was
was still running, inside a collective                 a consequence, or, when every rank sits in
                                                       a collective, one side of a mismatch
returned from its function while its peers waited in   the root cause when no rank is a cause and
a collective                                           none hangs elsewhere: it returned early
=====================================================  ===========================================

Every text a report quotes (messages, tracebacks, stacks, output) is bounded
(:func:`torch_tp._supervise.rank_failure.bounded`): a rank that prints 50 MiB gets a report of kilobytes.

Imports nothing from torch_tp beyond :mod:`torch_tp._supervise.rank_failure` (the records' format).
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field
from typing import Any

from torch_tp._supervise.rank_failure import MESSAGE_CHARS, TRACEBACK_CHARS, bounded, collective_in_stack, recording_in_stack

__all__ = ["OUTPUT_CHARS", "STOPPED", "RankOutcome", "explain", "exit_description", "output_tail", "root_cause"]

#: The most characters of a rank's output (and of a stack dump) a report quotes.
OUTPUT_CHARS = 8192
_SUMMARY_CHARS = 500  # of one rank's message on the summary line
#: How a rank found stopped by a signal is described (its peers wait for it, then time out).
STOPPED = "stopped by SIGSTOP (or another stop signal: the process was in state T) and never continued"
#: Where native code says why a process ended, most telling first: a C++ exception's ``what():``,
#: glibc's heap checks (on stderr once :func:`torch_tp._supervise.rank_failure.native_errors_to_stderr`
#: ran), Python's fatal error.
_NATIVE_REASONS = (
    "what():", "malloc(): ", "free(): ", "realloc(): ", "double free or corruption", "corrupted size vs. prev_size",
    "munmap_chunk(): ", "Fatal Python error:",
)
_SIGTERM_HINT = (", sent from outside the launcher, which stops ranks only once one has failed (a job scheduler "
                 "preempting or cancelling the job, `kill`, a timeout): run the job again, from its newest checkpoint")
_OOM_HINT = " (most often the kernel's OOM killer, when memory runs out: see `dmesg`; nothing in a process can catch SIGKILL)"


@dataclass
class RankOutcome:
    """What one rank of a failed run did.

    ``state`` is ``"ok"`` (its function returned), ``"raised"`` (``record`` holds the
    exception, see :mod:`torch_tp._supervise.rank_failure`), ``"exited"`` (the process ended on its own
    without a record; ``exit_code`` is negative for a signal), ``"running"`` (still inside its
    function when the run was stopped; ``stack`` is its Python stack, ``how`` says how it was
    stopped), ``"stopped"`` (found stopped by a signal, SIGSTOP: it never continued; ``stack``
    is where it stopped) or ``"returned"`` (its function returned, then it waited for the
    others and the run was stopped; ``record`` may hold what it raised while waiting).
    ``output`` is the tail of what it printed.

    Example::

        >>> RankOutcome(1, "exited", exit_code=3).is_cause
        True
    """

    rank: int
    state: str
    record: dict[str, Any] | None = None
    exit_code: int | None = None
    stack: str = ""
    output: str = ""
    how: str = "still running when the run was stopped"
    _collective: str | None = field(default=None, init=False, repr=False)

    @property
    def failed(self) -> bool:
        return self.state != "ok"

    @property
    def is_cause(self) -> bool:
        if self.state == "raised":
            return not self.record["symptom"]
        return self.state in ("exited", "stopped")

    @property
    def returned(self) -> bool:
        """Its function returned (the run may still have failed around it)."""
        return self.state in ("ok", "returned")

    @property
    def collective(self) -> str | None:
        """The collective this rank was in when it failed or was stopped, if any."""
        if self.record and self.record.get("collective"):
            return self.record["collective"]["op"]
        return collective_in_stack(self.stack)

    @property
    def time_ns(self) -> float:
        return self.record.get("time_ns", math.inf) if self.record else math.inf


def _absent(o: RankOutcome) -> bool:
    """Still running, and its stack shows it outside any collective (an empty stack, or one caught
    while the rank recorded its own failure, proves nothing)."""
    return o.state == "running" and bool(o.stack.strip()) and o.collective is None and not recording_in_stack(o.stack)


def root_cause(outcomes: list[RankOutcome]) -> list[RankOutcome]:
    """The failed ranks, root cause first, consequences after (see the module's table).

    Example::

        >>> waited = RankOutcome(0, "raised", record={"symptom": True, "time_ns": 2, "collective": None})
        >>> raised = RankOutcome(1, "raised", record={"symptom": False, "time_ns": 5, "collective": None})
        >>> [o.rank for o in root_cause([waited, raised])]
        [1, 0]
    """
    failed = [o for o in outcomes if o.failed]
    odd = _odd_calls(outcomes)
    if odd:
        return sorted(failed, key=lambda o: (o.rank not in odd, o.rank))
    causes = sorted((o for o in failed if o.is_cause), key=lambda o: (o.time_ns, o.rank))
    absent = [o for o in failed if _absent(o)]
    early = [] if causes or absent else _returned_early(outcomes)
    waiting = sorted((o for o in failed if o not in causes + absent + early), key=lambda o: (o.time_ns, o.rank))
    return causes + absent + early + waiting


def _returned_early(outcomes: list[RankOutcome]) -> list[RankOutcome]:
    """The ranks whose function returned while others waited in a collective (inside their
    function, not in the launcher's closing barrier): they never made that call."""
    if not any(not o.returned and o.failed and o.collective for o in outcomes):
        return []
    return [o for o in outcomes if o.returned]


def explain(headline: str, outcomes: list[RankOutcome], footer: str = "") -> str:
    """A failure report: ``headline``, a one-line summary naming the root cause, then one
    section per failed rank, root cause first.

    Example::

        >>> text = explain("f failed", [RankOutcome(0, "ok"), RankOutcome(1, "exited", exit_code=3)])
        >>> text.splitlines()[0]
        'f failed: rank 1 exited with code 3.'
    """
    ordered = root_cause(outcomes)
    sections = [_section(o, i == 0) for i, o in enumerate(ordered)]
    summary = _summary(ordered, outcomes)
    return "\n".join([f"{headline}: {summary}.{(' ' + footer) if footer else ''}", *sections])


def exit_description(exit_code: int | None) -> str:
    """``"exit code 3"``, ``"exit code -6, killed by SIGABRT"``.

    Example::

        >>> exit_description(-9)
        'exit code -9, killed by SIGKILL'
    """
    if exit_code is None:
        return "exit code unknown"
    if exit_code < 0:
        return f"exit code {exit_code}, killed by {_signal_name(-exit_code)}"
    return f"exit code {exit_code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# -- the summary line -------------------------------------------------------------------------


def _summary(ordered: list[RankOutcome], everyone: list[RankOutcome]) -> str:
    odd = _odd_calls(everyone)
    if odd:
        return _mismatch(odd, _all_calls(everyone))
    first = ordered[0]
    if first.is_cause:
        text, named = _what_it_did(first), {first.rank}
    elif first.returned and _returned_early(everyone):
        text, named = _left_early(ordered), {o.rank for o in ordered if o.returned}
    elif _absent(first):
        waiters = _waiters(ordered)[:1]
        text, named = _did_not_arrive(first, ordered), {o.rank for o in ordered if _absent(o)} | {o.rank for o in waiters}
    else:
        return _all_waiting(ordered)
    rest = [o for o in ordered if o.rank not in named]
    return text + ("; then " + "; ".join(_consequence(o) for o in rest) if rest else "")


def _what_it_did(o: RankOutcome) -> str:
    where = f" in {o.collective}" if o.collective else ""
    if o.state == "raised":
        if o.record["type"] == "SystemExit":
            return f"rank {o.rank} called sys.exit({_first_line(o.record['message'])})"
        return f"rank {o.rank} raised {o.record['type']}: {_first_line(o.record['message'])}"
    if o.state == "stopped":
        return f"rank {o.rank} was {o.how}{where}; its peers waited for it until they timed out"
    if o.exit_code == 0:
        return f"rank {o.rank} exited with code 0 before its function returned (os._exit, or a library ending the process)"
    if o.exit_code is not None and o.exit_code < 0:
        hint = {signal.SIGKILL: _OOM_HINT, signal.SIGTERM: _SIGTERM_HINT}.get(-o.exit_code, "")
        return f"rank {o.rank} was killed by {_signal_name(-o.exit_code)}{where}{_abort_reason(o.output)}{hint}"
    return f"rank {o.rank} exited with code {o.exit_code}"


def _left_early(ordered: list[RankOutcome]) -> str:
    early = sorted(o.rank for o in ordered if o.returned)
    ops = sorted({o.collective for o in ordered if not o.returned and o.collective})
    waiters = sorted(o.rank for o in ordered if not o.returned and o.collective)
    its = "its function" if len(early) == 1 else "their functions"
    return (
        f"{_ranks(early)} returned early: {its} returned while {_ranks(waiters)} waited in {', '.join(ops)}, "
        f"a call {_ranks(early)} never made (every rank must make the same collective calls)"
    )


def output_tail(text: str, lines: int) -> str:
    r"""The last ``lines`` lines of a rank's ``text``, at most :data:`OUTPUT_CHARS` characters, with
    any earlier line in which native code said why the process ended kept in front: a SIGABRT's
    ``what():`` comes before faulthandler's dump of every thread, which alone outgrows the tail.

    Example::

        >>> text = "  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes\n" + "stack\n" * 50
        >>> output_tail(text, 2).splitlines()
        ['  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes', '... (48 lines cut)', 'stack', 'stack']
    """
    every = text.rstrip().splitlines()
    kept = every[-lines:]
    earlier = every[:-lines] if len(every) > lines else []
    reasons = [line for line in earlier if any(marker in line for marker in _NATIVE_REASONS)]
    if reasons:
        kept = [*reasons, f"... ({len(earlier) - len(reasons)} lines cut)", *kept]
    return bounded("\n".join(kept), OUTPUT_CHARS)


def _abort_reason(output: str, limit: int = 300) -> str:
    r"""``": <why>"`` from a rank's last output when native code said why it ended (a C++
    exception's ``what():`` line, glibc's heap error, Python's fatal error line; the first of
    :data:`_NATIVE_REASONS` found), else ``""``: the summary line is
    what a truncated CI log keeps.

    Example::

        >>> _abort_reason("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        ...               "  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes")
        ': [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes'
    """
    lines = output.splitlines()
    for marker in _NATIVE_REASONS:
        for line in reversed(lines):
            if marker in line:
                why = line.split("what():", 1)[-1].strip() if marker == "what():" else line.strip()
                return f": {bounded(why, limit)}"
    return ""


def _did_not_arrive(absent: RankOutcome, ordered: list[RankOutcome]) -> str:
    waiters = _waiters(ordered)
    if not waiters:
        return f"rank {absent.rank} was {absent.how} (its stack below)"
    waiter = waiters[0]
    ranks = waiter.record["collective"]["ranks"] if waiter.record and waiter.record.get("collective") else None
    group = f" on the group of ranks {ranks}" if ranks else ""
    verb = "timed out in" if waiter.record and "timed out" in waiter.record.get("message", "").lower() else "waited in"
    missing = [o.rank for o in ordered if _absent(o)]
    return (
        f"rank {waiter.rank} {verb} {waiter.collective}{group}, which {_ranks(missing)} never "
        f"reached ({'it was' if len(missing) == 1 else 'they were'} elsewhere: stack below)"
    )


def _all_calls(outcomes: list[RankOutcome]) -> dict[int, str]:
    calls: dict[int, str] = {}
    for o in outcomes:
        if o.record:
            calls.update({int(r): c for r, c in (o.record.get("calls") or {}).items()})
    return calls


def _odd_calls(outcomes: list[RankOutcome]) -> dict[int, str]:
    """The ranks whose call differs from the most common one, from torch's collective check."""
    calls = _all_calls(outcomes)
    if len(set(calls.values())) < 2:
        return {}
    counts = {c: list(calls.values()).count(c) for c in set(calls.values())}
    usual = max(counts, key=lambda c: (counts[c], c))
    return {r: c for r, c in calls.items() if c != usual}


def _mismatch(odd: dict[int, str], calls: dict[int, str]) -> str:
    usual = sorted(r for r in calls if r not in odd)
    theirs = "; ".join(f"rank {r} called {c}" for r, c in sorted(odd.items()))
    return (
        f"{theirs}, unlike {_ranks(usual)} ({calls[usual[0]]}), found by torch's collective check "
        f"before the call: every rank must make the same calls in the same order, with the same shapes"
    )


def _waiters(ordered: list[RankOutcome]) -> list[RankOutcome]:
    return [o for o in ordered if o.collective is not None]


def _all_waiting(ordered: list[RankOutcome]) -> str:
    ops = {o.rank: o.collective for o in ordered if o.collective}  # ranks of unknown whereabouts left out
    if not ops:
        return f"{_ranks(sorted(o.rank for o in ordered))} failed or were stopped, and none said where (see below)"
    if len(set(ops.values())) > 1:
        calls = ", ".join(f"rank {r} in {op or 'no collective'}" for r, op in sorted(ops.items()))
        return f"the ranks called different collectives ({calls}): every rank must make the same calls in the same order"
    op = next(iter(ops.values()))
    return f"{_ranks(sorted(ops))} waited in {op} for a peer that never joined it"


def _consequence(o: RankOutcome) -> str:
    where = f" in {o.collective}" if o.collective else ""
    if o.state in ("running", "stopped"):
        return f"rank {o.rank} was {o.how}{where}"
    if o.state == "raised":
        return f"rank {o.rank} raised {o.record['type']}{where}: {_first_line(o.record['message'])}"
    if o.returned:
        return f"rank {o.rank} returned from its function, then waited for the others{where}"
    return f"rank {o.rank} ended ({exit_description(o.exit_code)}){_abort_reason(o.output)}"


# -- one section per rank ----------------------------------------------------------------------


def _section(o: RankOutcome, is_first: bool) -> str:
    role = "root cause" if is_first else "then"
    if o.state == "raised" or (o.returned and o.record and o.record.get("type")):
        title = f"rank {o.rank}: {'raised' if o.state == 'raised' else 'returned from its function, then raised'}"
        body = o.record["traceback"] or (
            f"{o.record['type']}: {o.record['message']}\n(no traceback: the rank was stopped while writing it)"
        )
    elif o.returned:
        title, body = f"rank {o.rank}: returned from its function", ""
    elif o.state == "exited":
        title, body = f"rank {o.rank}: worker process died ({exit_description(o.exit_code)})", o.stack
    elif o.state == "stopped":
        title, body = f"rank {o.rank}: {o.how} (Python stack where it stopped below)", o.stack or "(no stack dump was written)"
    else:
        title, body = f"rank {o.rank}: did not answer ({o.how}; Python stack below)", o.stack or "(no stack dump was written)"
    parts = [f"===== {title} [{role}] =====", bounded(body.rstrip(), TRACEBACK_CHARS + MESSAGE_CHARS)]
    if o.output:
        parts.append(f"----- rank {o.rank} output (last lines) -----\n{bounded(o.output.rstrip(), OUTPUT_CHARS)}")
    return "\n".join(p for p in parts if p)


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return bounded(lines[0], _SUMMARY_CHARS).replace("\n", " ") if lines else ""


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
