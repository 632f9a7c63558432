"""The report of :func:`torch_tp.verify_plan`: its findings, their merge across ranks, and the table.

Every rank finds what it finds; :func:`merged` folds the gathered findings into one per
(kind, name, step), so :class:`VerificationReport` is the same on every rank.

Example::

    >>> merged([Finding("output", "output", 0, 0.5, "", (0,)), Finding("output", "output", 0, 0.7, "", (1,))])
    [Finding(kind='output', name='output', step=0, error=0.7, detail='', ranks=(0, 1))]
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Finding", "VerificationReport", "merged", "input_findings", "display_order"]

TIE = "tie broken"
NAMES = "parameter names differ"
INITIAL = "initial parameter"
INPUTS = "inputs differ across ranks"
OUTPUT = "output"
GRADIENT = "gradient"
RANK_GRADIENT = "gradient differs across ranks"
PLAIN = "plain parameter on DTensor inputs"
UPDATED = "updated parameter"
BUFFER = "buffer"
EVAL = "eval-mode output"

# What each kind of finding usually means, and what to change.
_HINTS = {
    TIE: "parameters shared in the single-process model are separate in the parallel one, so they "
    "get separate gradients and drift apart. Give every sharer a style that places the weight alike "
    "(torch_tp.parallelize_module keeps an embedding/head tie: RowwiseParallel on the embedding, "
    "ColwiseParallel on the head), or re-tie after parallelizing",
    NAMES: "verify_plan pairs parameters by name, and these are in one model only: parallelize "
    "without renaming, wrapping, adding or dropping modules",
    INITIAL: "parallelizing changed parameter values: keep src_data_rank=0 (scatter/broadcast rank 0's "
    "values) and build the same model on every rank",
    INPUTS: "example_inputs gave different values on different ranks: build them from fixed values or "
    "torch's RNG (verify_plan seeds it before each call), not from rank-dependent state",
    OUTPUT: "the parallel model computes something else. Look for a module that hands on a local piece "
    "(a Partial output must be reduced: output_layouts=Replicate() or Shard(...)), a forward replaced "
    "by a base class's, or a module that needs other ranks' data",
    GRADIENT: "the forward agrees but gradients do not: a parameter misses other ranks' contributions "
    "(see 'gradient differs across ranks'), a tie is broken, or loss_fn/gather_outputs is not "
    "differentiable",
    RANK_GRADIENT: "a replicated parameter whose module runs on sharded activations gets only this rank's "
    "part of its gradient. Put the module in the plan with the layout of its input: "
    "ReplicateParallel(input_layouts=Shard(2)) for a per-head q_norm/k_norm, SequenceParallel() for a "
    "norm on sequence shards",
    PLAIN: "a module ran on DTensor inputs with plain parameters, so nothing reduces their gradients "
    "over the ranks: put the module in the plan (ReplicateParallel(...), SequenceParallel()) or pass "
    "replicate_unplanned_params=True",
    UPDATED: "the parameter differs after the optimizer step: follows from a gradient difference, "
    "or, where gradients agree, the optimizer saw another gradient or does not hold the parameter",
    BUFFER: "a buffer differs (BatchNorm's running statistics, a cache the forward updates): its module "
    "updated it from this rank's piece of an activation rather than the whole. Put the module in the "
    "plan with the layout of its input, or keep its input whole",
    EVAL: "the model in eval mode, after the updates, computes something else: where parameters differ "
    "after the updates, it follows from them; where training agreed, a module whose eval path differs "
    "(BatchNorm's running statistics, a cache) reads state the parallel model holds differently (see the "
    "'buffer' rows)",
}
_KIND_ORDER = tuple(_HINTS)
_MAX_ROWS = 40


@dataclass(frozen=True)
class Finding:
    """One difference between the parallel model and its single-process twin.

    ``kind`` is one of the module constants (``"output"``, ``"gradient"``, ``"tie broken"``,
    ...); ``name`` the parameter path or the output's place (``output['logits']``); ``step``
    the training step (``None`` for structural findings and initial parameters); ``error`` the
    largest absolute difference over every rank that saw it (``None`` where no number applies);
    ``ranks`` the mesh ranks where it showed.

    Example::

        >>> Finding("gradient", "layers.0.attention.q_norm.weight", 0, 0.25, "", (0, 1)).where
        'step 0'
    """

    kind: str
    name: str
    step: int | None
    error: float | None
    detail: str
    ranks: tuple[int, ...] = ()

    @property
    def where(self) -> str:
        """``"step N"``, or ``"model"`` for what belongs to no step (structure, initial values)."""
        return "model" if self.step is None else f"step {self.step}"


@dataclass(frozen=True)
class VerificationReport:
    """What :func:`verify_plan` found; identical on every rank. ``str(report)`` is a table.

    ``ok`` is true when nothing was found. ``findings`` lists every difference;
    ``compared`` counts the tensors each rank compared; ``worst_error`` is the largest
    difference seen in any comparison (passing ones included), at ``worst_name``.

    Example::

        >>> report = VerificationReport(
        ...     findings=(Finding("output", "output", 0, 0.5, "", (0, 1)),), steps=1, world_size=2,
        ...     compared=10, worst_error=0.5, worst_name="output (output)", atol=1e-5, rtol=1e-5)
        >>> report.ok
        False
        >>> print(str(report).splitlines()[0])
        verify_plan: 1 finding (1 step on 2 ranks, atol=1e-05, rtol=1e-05; 10 tensors compared per rank)
    """

    findings: tuple[Finding, ...]
    steps: int
    world_size: int
    compared: int
    worst_error: float
    worst_name: str
    atol: float
    rtol: float
    #: What the report adds about the model, shown under the findings (e.g. W8A8's tolerance).
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the parallel model matched the single-process one everywhere."""
        return not self.findings

    def __str__(self) -> str:
        return _format_report(self)

    def __repr__(self) -> str:
        return f"VerificationReport(ok={self.ok}, {len(self.findings)} findings)"


def merged(findings: list[Finding]) -> list[Finding]:
    """One finding per (kind, name, step): the largest error and every rank that saw it."""
    merged: dict[tuple, Finding] = {}
    for f in findings:
        key = (f.kind, f.name, f.step)
        seen = merged.get(key)
        if seen is None:
            merged[key] = f
            continue
        errors = [e for e in (seen.error, f.error) if e is not None]
        merged[key] = Finding(
            f.kind, f.name, f.step, max(errors) if errors else None, seen.detail or f.detail,
            tuple(sorted(set(seen.ranks) | set(f.ranks))),
        )
    return list(merged.values())


def input_findings(digests_per_rank: list[list[str]]) -> list[Finding]:
    findings = []
    for step, digests in enumerate(zip(*digests_per_rank)):
        others = tuple(rank for rank, digest in enumerate(digests) if digest != digests[0])
        if others:
            detail = f"ranks {list(others)} got other input values than rank 0"
            findings.append(Finding(INPUTS, "example_inputs", step, None, detail, others))
    return findings


def display_order(finding: Finding) -> tuple:
    step = -1 if finding.step is None else finding.step
    return step, _KIND_ORDER.index(finding.kind)


def _format_report(report: VerificationReport) -> str:
    plural = "s" if report.steps != 1 else ""
    scope = (
        f"{report.steps} step{plural} on {report.world_size} ranks, atol={report.atol}, rtol={report.rtol}; "
        f"{report.compared} tensors compared per rank"
    )
    if report.ok:
        return (
            f"verify_plan: OK, the parallel model trains like the single-process one ({scope}; "
            f"largest difference {report.worst_error:.1e} at {report.worst_name})"
        )
    count = len(report.findings)
    lines = [f"verify_plan: {count} finding{'s' if count != 1 else ''} ({scope})", ""]
    lines += _table(report.findings[:_MAX_ROWS], report.world_size)
    if count > _MAX_ROWS:
        lines.append(f"... and {count - _MAX_ROWS} more (report.findings lists them all)")
    kinds = [kind for kind in _KIND_ORDER if any(f.kind == kind for f in report.findings)]
    lines += ["", "what they mean and what to change:"] + [f"- {kind}: {_HINTS[kind]}" for kind in kinds]
    lines += [f"- note: {note}" for note in report.notes]
    return "\n".join(lines)


def _table(findings: tuple[Finding, ...], world_size: int) -> list[str]:
    header = ("when", "finding", "parameter / output", "max |diff|", "ranks", "detail")
    rows = [header] + [
        (
            f.where,
            f.kind,
            f.name,
            "-" if f.error is None else f"{f.error:.2e}",
            "all" if len(f.ranks) == world_size else ",".join(map(str, f.ranks)),
            f.detail,
        )
        for f in findings
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = ["  ".join([*(cell.ljust(width) for cell, width in zip(row, widths)), row[-1]]).rstrip() for row in rows]
    return [lines[0], "-" * len(lines[0]), *lines[1:]]
