"""One check across the ranks of a group, before a collective that needs them to agree.

A collective whose ranks disagree (another shape, another dtype, a plan that failed on one
rank) aborts the process or leaves the other ranks waiting until the timeout. So every rank
first runs its own checks and states, as :class:`Fact` rows, what the ranks must hold the
same; then :func:`agree_or_raise` compares them and every rank raises the same way before
any rank enters the real collective:

- a rank whose own check failed raises its own exception;
- the other ranks raise ``ValueError`` naming each rank that failed and its error;
- ranks that passed but hold different facts raise ``ValueError`` naming the first fact
  that differs, each rank's value and what to change.

It costs one ``dist.all_gather`` of an 8-byte digest per rank (of this rank's facts, or of
its error), so each rank receives ``8 * group size`` bytes. Where the caller runs a
fixed-size collective before the data-dependent one anyway (MoE's token-count exchange), the
digest rides on it instead: :func:`runtime_verdict` is this rank's side, :func:`settle`
compares every rank's digest, and no collective of its own runs. Only when the digests
differ does one ``dist.all_gather_object`` of every rank's error and facts follow, to write
the message. ``parallelize_module`` states its plan and its parameters' shapes; the fused
ops state their operands' dtype, shape, dims and kinds.

A check is never skipped on the strength of an earlier one: whether a rank joins a
collective must not depend on what that rank alone saw (a rank whose inputs changed would
check while its peers, whose did not, went on to the data's collective, and wait there).

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> try:
    ...     problem, facts = None, [Fact("inputs have different shapes", tuple(x.shape), "pad them")]
    ... except ValueError as error:  # this rank's own checks
    ...     problem, facts = error, []
    >>> agree_or_raise(group, problem, facts, what="my_op")
    >>> # on 2 ranks whose x differ, both raise:
    >>> # ValueError: my_op: the ranks' inputs have different shapes [(3, 8), (2, 8)]; pad them
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Callable, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "Fact",
    "Verdict",
    "agree_or_raise",
    "check_on_every_rank",
    "checks_run",
    "digest_device",
    "runtime_checks",
    "runtime_checks_enabled",
    "runtime_verdict",
    "settle",
]

_MISSING = "<missing>"  # shown for a rank that does not state a fact the others state


class Fact(NamedTuple):
    """One thing every rank of the group must hold the same.

    A difference reads ``"<what>: the ranks' <topic> [<value on each rank>]; <fix>"``, so
    ``topic`` is a phrase such as ``"inputs have different shapes"`` or ``"models hold
    parameter 'w' as"``. Values are compared by ``repr`` and shown by ``str``; they are
    pickled to the other ranks only when something differs.

    Example::

        >>> Fact("inputs have different dtypes", torch.float32, "convert with .to(dtype)").topic
        'inputs have different dtypes'
    """

    topic: str
    value: object
    fix: str


def agree_or_raise(
    group: dist.ProcessGroup,
    problem: Exception | None,
    facts: Sequence[Fact],
    *,
    what: str,
) -> None:
    """Return on every rank of ``group`` if no rank failed and all hold the same ``facts``;
    else raise on every rank.

    Args:
        group: the ranks that will run the collective; every one of them must call this.
        problem: the exception this rank's own checks raised, or ``None``.
        facts: what this rank holds (ignored when ``problem`` is set).

    Keyword Args:
        what: the caller's name, which starts every message (``"all_gather_matmul"``).

    The digest travels on the group's own device (:func:`digest_device`), never one a caller
    or its data suggests, so every rank of the group uses the same one.

    Raises:
        ``problem`` on this rank if set; otherwise ``ValueError`` if another rank failed or
        the ranks' facts differ. Values are listed in group order, followed by the group's
        global ranks when they are not ``0 .. size - 1``.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> agree_or_raise(group, None, [Fact("calls pass different reduce_op values", "sum", "use one")],
        ...                what="my_op")
    """
    verdict = _verdict(problem, facts, what)
    if group.size() > 1:
        settle(group, verdict, _gathered_digests(group, verdict.digest), what=what)
    elif problem is not None:
        raise problem


class Verdict(NamedTuple):
    """This rank's side of one agreement: its own checks' error (or ``None``), its facts, and
    the 8-byte digest of the error or the facts, which :func:`settle` compares with every rank's.

    Example::

        >>> verdict = runtime_verdict(lambda: [Fact("calls pass different k", 2, "use one k")], what="my_op")
        >>> verdict.problem is None, isinstance(verdict.digest, int)
        (True, True)
    """

    problem: Exception | None
    facts: list[Fact]
    digest: int


def runtime_verdict(checked_facts: Callable[[], Sequence[Fact]], *, what: str) -> Verdict | None:
    """This rank's verdict for a forward pass's check whose digest travels *inside a collective
    the caller runs anyway* (MoE's token-count exchange: :func:`settle` then compares), or
    ``None`` where :func:`check_on_every_rank` would skip the agreement (traced by
    ``torch.compile``, recomputed by activation checkpointing, or the checks are off; this
    rank's own checks still raise in the last case).

    Every rank of the group must run the carrying collective either way: a rank whose own
    checks failed carries its error's digest (and the caller sends placeholder data), so
    every rank raises at :func:`settle`, none waits.

    Example::

        >>> runtime_verdict(lambda: [], what="my_op").facts
        []
    """
    if _runtime_skipped():
        return None
    if not _RUNTIME_CHECKS[0]:
        checked_facts()  # this rank's own checks still raise; only the agreement is skipped
        return None
    try:
        problem, facts = None, list(checked_facts())
    except (TypeError, ValueError, IndexError, NotImplementedError) as error:
        problem, facts = error, []
    return _verdict(problem, facts, what)


def settle(group: dist.ProcessGroup, verdict: Verdict, digests: Sequence[int], *, what: str) -> None:
    """Return on every rank if every rank's digest (``digests``, in group order, gathered by the
    caller's collective: the same list on every rank) equals this one and this rank's checks
    passed; else raise on every rank, as :func:`agree_or_raise` does. Only then does one
    ``dist.all_gather_object`` of every rank's error and facts follow, to write the message.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> settle(group, verdict, incoming[:, -1].tolist(), what="ExpertParallel")
    """
    _AGREEMENTS[0] += 1
    if any(digest != verdict.digest for digest in digests):
        details = [None] * group.size()
        refusal = None if verdict.problem is None else _refusal(verdict.problem, what)
        dist.all_gather_object(details, (refusal, list(verdict.facts)), group=group)
        if verdict.problem is None:
            error = ValueError(_disagreement(details, dist.get_process_group_ranks(group), what))
            # another rank's own check failed: this rank's error is a consequence, and failure
            # reports (torch_tp._supervise.root_cause) name that rank as the root cause
            error.consequence = any(refusal is not None for refusal, _ in details)
            raise error
    if verdict.problem is not None:
        raise verdict.problem


def _verdict(problem: Exception | None, facts: Sequence[Fact], what: str) -> Verdict:
    refusal = None if problem is None else _refusal(problem, what)
    return Verdict(problem, list(facts), _digest(refusal, facts))


# ---------------------------------------------------------------------------------------------
# Checks before the data-dependent collectives of a forward pass (MoE routes and token counts,
# the local widths styles annotate as shards, a loss's targets): on by default, one switch.
# ---------------------------------------------------------------------------------------------

_RUNTIME_CHECKS = [os.environ.get("TORCH_TP_RUNTIME_CHECKS", "1") != "0"]


def runtime_checks_enabled() -> bool:
    """Whether forward passes run their agreement checks (default: yes; ``TORCH_TP_RUNTIME_CHECKS=0``
    or :func:`runtime_checks` turns them off).

    Example::

        >>> runtime_checks_enabled()
        True
    """
    return _RUNTIME_CHECKS[0]


@contextlib.contextmanager
def runtime_checks(enabled: bool) -> Iterator[None]:
    """Turn the forward-pass agreement checks on or off inside the block.

    Each check costs one all-gather of 8 bytes per rank, or 8 bytes more in the MoE count
    exchange (see ``docs/plans_and_styles.md``, *Checks at forward time*, for the cost per
    training step). Off, a rank whose inputs disagree with its peers' aborts or hangs the
    job inside the collective instead of raising a named error on every rank: turn them off
    only for a job whose inputs are known good.

    Example::

        >>> with runtime_checks(False):
        ...     runtime_checks_enabled()
        False
    """
    previous, _RUNTIME_CHECKS[0] = _RUNTIME_CHECKS[0], bool(enabled)
    try:
        yield
    finally:
        _RUNTIME_CHECKS[0] = previous


def check_on_every_rank(
    group: dist.ProcessGroup,
    checked_facts: Callable[[], Sequence[Fact]],
    *,
    what: str,
    at_runtime: bool = False,
) -> None:
    """Run this rank's checks, ``checked_facts()`` (it raises ``TypeError``, ``ValueError``,
    ``IndexError`` or ``NotImplementedError`` on a bad argument, else returns the facts the
    ranks must share), then :func:`agree_or_raise`. ``at_runtime``: a forward pass's check,
    skipped when ``torch.compile`` traces it (the compiled graph is specialized to its inputs'
    shapes) or activation checkpointing recomputes the forward in the backward pass (the forward
    checked the same inputs); with the checks off, this rank's own checks
    still run and raise here, only the collective is skipped.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> check_on_every_rank(group, lambda: [Fact("inputs have different dtypes", x.dtype, "cast")],
        ...                     what="my_op")
    """
    if at_runtime and _runtime_skipped():
        return
    if at_runtime and not _RUNTIME_CHECKS[0]:
        checked_facts()  # this rank's own checks still raise; only the agreement is skipped
        return
    try:
        problem, facts = None, list(checked_facts())
    except (TypeError, ValueError, IndexError, NotImplementedError) as error:
        problem, facts = error, []
    agree_or_raise(group, problem, facts, what=what)


def _runtime_skipped() -> bool:
    """Traced (the graph is specialized), or a forward recomputed in backward (checked in forward)."""
    return torch.compiler.is_compiling() or torch._C._current_graph_task_id() != -1


def _refusal(problem: Exception, what: str) -> str:
    """``"ValueError: <message>"``, without the caller's name the message may start with."""
    return f"{type(problem).__name__}: {str(problem).removeprefix(f'{what}: ')}"


def _digest(refusal: str | None, facts: Sequence[Fact]) -> int:
    """64 bits of SHA-256 over this rank's error, or over its facts' topics and values."""
    text = f"refused {refusal}" if refusal is not None else "\n".join(f"{f.topic}: {f.value!r}" for f in facts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


_CHECKS_RUN = [0]  # agreements run in this process (each one all-gather), for tools that count collectives
_AGREEMENTS = [0]  # agreements settled in this process: those, and those carried by a caller's collective


def checks_run() -> int:
    """How many agreements (each one all-gather of 8 bytes per rank) this process has run.

    Example::

        >>> isinstance(checks_run(), int)
        True
    """
    return _CHECKS_RUN[0]


def digest_device(group: dist.ProcessGroup) -> torch.device:
    """Where ``group``'s agreement digests travel: the CPU when the group has a CPU backend (gloo,
    or ``"cpu:gloo,cuda:nccl"``: host memory, no wait on a GPU queue), else the current device of
    the first device type it has (an NCCL-only group: the rank's own GPU, after
    ``torch.cuda.set_device``). Read off the group's backend config, the same on every rank.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> digest_device(dist.group.WORLD)   # gloo, or cpu:gloo,cuda:nccl
        device(type='cpu')
    """
    types = [entry.split(":")[0] for entry in dist.get_backend_config(group).split(",")]
    if "cpu" in types:
        return torch.device("cpu")
    module = getattr(torch, types[0])
    return torch.device(types[0], module.current_device())


def _gathered_digests(group: dist.ProcessGroup, digest: int) -> list[int]:
    """The one all-gather of the happy path: 8 bytes from each rank."""
    _CHECKS_RUN[0] += 1
    mine = torch.tensor([digest], dtype=torch.int64, device=digest_device(group))
    gathered = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(gathered, mine, group=group)
    return torch.cat(gathered).tolist()


def _disagreement(details: list, ranks: list[int], what: str) -> str:
    """The message for a rank whose own checks passed: who failed, else what differs."""
    refused = [f"rank {rank}: {refusal}" for rank, (refusal, _) in zip(ranks, details) if refusal is not None]
    if refused:
        return (
            f"{what}: another rank refused its arguments ({'; '.join(refused)}). This rank's "
            f"arguments passed, but {what} runs on every rank of the group at once: fix the "
            f"call on the rank named"
        )
    return _first_difference([facts for _, facts in details], ranks, what)


def _first_difference(fact_lists: list[list[Fact]], ranks: list[int], what: str) -> str:
    """The first topic (in rank order of statement) whose value is not the same on every rank."""
    held_by_rank = [{fact.topic: fact for fact in facts} for facts in fact_lists]
    for topic in dict.fromkeys(fact.topic for facts in fact_lists for fact in facts):
        held = [facts.get(topic) for facts in held_by_rank]
        if len({_MISSING if fact is None else repr(fact.value) for fact in held}) > 1:
            return _difference(topic, held, ranks, what)
    return f"{what}: the ranks' facts differ but compare equal; report this as a bug in torch_tp"


def _difference(topic: str, held: list[Fact | None], ranks: list[int], what: str) -> str:
    values = ", ".join(_MISSING if fact is None else str(fact.value) for fact in held)
    where = "" if ranks == list(range(len(ranks))) else f" on ranks {ranks}"
    fix = next(fact.fix for fact in held if fact is not None)
    return f"{what}: the ranks' {topic} [{values}]{where}; {fix}"
