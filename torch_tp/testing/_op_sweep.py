"""Every op of PyTorch's OpInfo database, on one of torch_tp's tensor kinds, against the float op.

A *surface* is a tensor kind torch_tp hands users (an int8 weight: :mod:`torch_tp.testing._op_sweep_int8`, ...): :class:`Surface` says
which arguments of an OpInfo sample it can stand for (``positions``), how to build it from the
float argument (``lift``), and the float value it stands for (``value``). For each op and
sample and each such position, :func:`sweep_ops` runs the op twice, on the surface tensor and on
its float value (the same RNG seed each time), and files the case as one of:

==============  =====================================================================
``equal``       the results agree (surface results compared by their float values;
                NaN where the float op has NaN; ops that return uninitialized memory by
                shape and dtype only)
``refused``     a ``TypeError`` / ``ValueError`` / ``NotImplementedError`` /
                ``IndexError`` whose message names torch_tp: a named error
``wrong``       a result that differs: a silent wrong result
``unclear``     any other exception, or one that does not name torch_tp
==============  =====================================================================

Cases where the float op itself raises are not cases. :func:`coverage_table` writes the result
as the markdown table the docs hold (``docs/op_coverage.md``); ``python3 -m torch_tp.testing._op_sweep``
rewrites it.

Example::

    >>> # xdoctest: +SKIP("imports the OpInfo database (a few seconds)")
    >>> from torch_tp.testing._op_sweep_int8 import INT8_WEIGHT
    >>> result = sweep_ops(INT8_WEIGHT, samples_per_op=2)
    >>> [case for case in result.cases if case.outcome in ("wrong", "unclear")]
    []
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "COVERAGE_DOC",
    "OUTCOMES",
    "Surface",
    "SweepCase",
    "SweepResult",
    "assert_documented",
    "assert_same",
    "compared",
    "coverage_table",
    "cpu_seeding",
    "describe",
    "documented_counts",
    "marked_section",
    "op_name",
    "refusal",
    "sampled_ops",
    "swept_counts",
    "sweep_ops",
    "write_coverage",
]

#: The outcomes of a case, best first.
OUTCOMES = ("equal", "refused", "wrong", "unclear")
_NAMED_ERRORS = (TypeError, ValueError, NotImplementedError, IndexError)
#: Ops whose results are uninitialized memory: compared by shape and dtype.
_UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                            "empty_permuted"})


@dataclasses.dataclass(frozen=True)
class Surface:
    """A tensor kind of torch_tp the sweep runs every op on.

    Example::

        >>> # xdoctest: +SKIP("imports torch_tp.quant")
        >>> from torch_tp.testing._op_sweep_int8 import INT8_WEIGHT
        >>> INT8_WEIGHT.name
        'int8 weight'
    """

    name: str
    positions: Callable[[Sequence[Any]], list[int]]   # which of (input, *args) it can stand for
    lift: Callable[[torch.Tensor], torch.Tensor] | None = None   # the surface tensor for a float argument
    value: Callable[[torch.Tensor], torch.Tensor] | None = None  # the float value a surface tensor stands for
    #: ``run(op, args, kwargs, position)`` -> ``[(variant, outcome, detail), ...]`` (``[]``: not a case);
    #: default: the op on ``lift`` of the argument against the op on its ``value``, out of place
    run: Callable[..., list[tuple[str, str, str]]] | None = None
    #: ``extra(args, kwargs)`` -> ``[(label, args, kwargs), ...]``: samples the database lacks (empty,
    #: uneven, non-finite), built from an op's first sample the surface takes
    extra: Callable[..., list[tuple[str, list, dict]]] | None = None


@dataclasses.dataclass(frozen=True)
class SweepCase:
    """One op, sample and argument position, and what happened."""

    op: str
    sample: int | str  # the database's sample index, or the label of an extra sample
    position: int
    outcome: str
    detail: str = ""
    variant: str = "out of place"  # or "in place", "view written through"


@dataclasses.dataclass
class SweepResult:
    """Every case of a sweep of ``surface``."""

    surface: Surface
    cases: list[SweepCase]

    def by_op(self) -> dict[str, Counter]:
        """``{op: Counter(outcome -> cases)}``, ops in database order."""
        table: dict[str, Counter] = {}
        for case in self.cases:
            table.setdefault(case.op, Counter())[case.outcome] += 1
        return table

    def failures(self) -> list[SweepCase]:
        """The ``wrong`` and ``unclear`` cases."""
        return [case for case in self.cases if case.outcome in ("wrong", "unclear")]


def op_name(op) -> str:
    """An OpInfo's name with its variant: ``"nn.functional.linear"``, ``"split.list_args"``."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def sweep_ops(surface: Surface, *, ops: Iterable | None = None, samples_per_op: int | None = None,
              rtol: float = 1e-4, atol: float = 1e-4) -> SweepResult:
    """Run every op of ``ops`` (default: the OpInfo database's ops for float32 on the CPU) on
    ``surface`` at each position it can take, ``samples_per_op`` samples per op (default all).

    Example::

        >>> # xdoctest: +SKIP("imports the OpInfo database (a few seconds)")
        >>> sweep_ops(INT8_WEIGHT, samples_per_op=1).by_op()["t"]
        Counter({'equal': 1})
    """
    if ops is None:
        from torch.testing._internal.common_methods_invocations import op_db

        ops = op_db
    cases: list[SweepCase] = []
    with warnings.catch_warnings(), cpu_seeding():  # the database's deprecated ops warn on every sample
        warnings.simplefilter("ignore")
        for op in ops:
            cases.extend(_op_cases(op, surface, samples_per_op, rtol, atol))
    return SweepResult(surface, cases)


@contextlib.contextmanager
def cpu_seeding() -> Iterator[None]:
    """``torch.manual_seed`` seeds only the CPU generator inside: the same numbers on the CPU, without
    queueing a lazy seed (with its formatted stack, milliseconds) for each accelerator module, which
    the database's sample generators do before every sample (half a sweep's time).

    Example::

        >>> with cpu_seeding():
        ...     _ = torch.manual_seed(0)
        ...     a = torch.rand(2)
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(a, torch.rand(2))
        True
    """
    original = torch.manual_seed
    torch.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    try:
        yield
    finally:
        torch.manual_seed = original


def _op_cases(op, surface: Surface, samples_per_op: int | None, rtol: float, atol: float) -> Iterable[SweepCase]:
    if torch.float32 not in op.supported_dtypes("cpu"):
        return
    torch.manual_seed(0)  # the samples' values: the same cases on every run
    try:
        samples = op.sample_inputs("cpu", torch.float32, requires_grad=False)
    except Exception:  # an OpInfo whose sample generator needs something this build lacks
        return
    first = None
    for index, sample in enumerate(samples):
        if samples_per_op is not None and index >= samples_per_op:
            break
        args = [sample.input, *sample.args]
        first = first or (surface.positions(args) and (args, sample.kwargs))
        yield from _sample_cases(op, index, args, sample.kwargs, surface, rtol, atol)
    if first and surface.extra is not None:
        for label, args, kwargs in surface.extra(*first):
            yield from _sample_cases(op, label, args, kwargs, surface, rtol, atol)


def _sample_cases(op, label, args, kwargs, surface: Surface, rtol, atol) -> Iterable[SweepCase]:
    for position in surface.positions(args):
        if surface.run is not None:
            found = surface.run(op, args, kwargs, position)
        else:
            found = _run_case(op, kwargs, args, position, surface, rtol, atol)
            found = [] if found is None else [("out of place", *found)]
        for variant, outcome, detail in found:
            yield SweepCase(op_name(op), label, position, outcome, detail, variant)


def _run_case(op, kwargs, args, position, surface: Surface, rtol, atol) -> tuple[str, str] | None:
    lifted = surface.lift(args[position])
    floats, surfaced = list(args), list(args)
    floats[position], surfaced[position] = surface.value(lifted), lifted
    try:
        torch.manual_seed(0)
        want = op(*floats, **kwargs)
    except Exception:
        return None  # not a case: the float op refuses this sample on the float value too
    try:
        torch.manual_seed(0)
        got = op(*surfaced, **kwargs)
    except Exception as error:
        return refusal(error)
    return compared(_float_values(got), want, op.name in _UNINITIALIZED, rtol, atol)


def refusal(error: BaseException) -> tuple[str, str]:
    """``("refused", "")`` for a named error (one of the refusal types, naming torch_tp), else
    ``("unclear", what it was)``."""
    if isinstance(error, _NAMED_ERRORS) and "torch_tp" in str(error):
        return "refused", ""
    return "unclear", describe(error)


def compared(got: Any, want: Any, shapes_only: bool, rtol: float, atol: float) -> tuple[str, str]:
    """``("equal", "")`` when :func:`assert_same` passes, else ``("wrong", the first line of why)``."""
    try:
        assert_same(got, want, shapes_only, rtol, atol)
    except Exception as error:
        return "wrong", str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    return "equal", ""


def describe(error: BaseException) -> str:
    """``"TypeName: first line of the message"`` (at most 200 characters of it)."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def _float_values(result: Any) -> Any:
    """``result`` with every tensor subclass that stands for floats (``dequantize()``) replaced by them."""
    return pytree.tree_map(lambda t: t.dequantize() if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor
                           and hasattr(t, "dequantize") else t, result)


def assert_same(got: Any, want: Any, shapes_only: bool, rtol: float, atol: float) -> None:
    """Raise unless ``got`` is ``want``: the same structure, tensors of the same shape and dtype and
    close values, non-finite (NaN or an infinity) exactly where ``want`` is non-finite (CPU kernels
    give NaN or inf for one input by vector length); ``shapes_only`` compares no values."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec, f"result structure {got_spec} differs from the float op's {want_spec}"
    for g, w in zip(got_leaves, want_leaves):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), f"got {type(g).__name__}, the float op a tensor"
            assert (g.shape, g.dtype) == (w.shape, w.dtype), ((g.shape, g.dtype), (w.shape, w.dtype))
            if shapes_only:
                continue
            if w.is_floating_point() or w.is_complex():
                finite = torch.isfinite(w)
                assert torch.equal(torch.isfinite(g), finite), "non-finite at other positions than the float op"
                g, w = g[finite], w[finite]
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
        else:
            assert g == w or (g != g and w != w), (g, w)  # NaN == NaN for floats


def coverage_table(result: SweepResult) -> str:
    """The markdown table of ``result``: per outcome, the ops and cases, then every op that ran
    equal on some case (the surface's working ops) with its counts.

    Example::

        >>> # xdoctest: +SKIP("imports the OpInfo database (a few seconds)")
        >>> print(coverage_table(sweep_ops(INT8_WEIGHT, samples_per_op=1)).splitlines()[0])
        | surface | ops | cases | equal | refused by name | wrong | unclear |
    """
    by_op = result.by_op()
    totals = Counter()
    for counts in by_op.values():
        totals.update(counts)
    lines = [
        "| surface | ops | cases | equal | refused by name | wrong | unclear |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {result.surface.name} | {len(by_op)} | {sum(totals.values())} | "
        + " | ".join(str(totals[outcome]) for outcome in OUTCOMES) + " |",
        "",
        "| op (OpInfo name) | cases | equal | refused by name |",
        "| --- | --- | --- | --- |",
    ]
    for name, counts in by_op.items():
        if counts["equal"]:
            lines.append(f"| `{name}` | {sum(counts.values())} | {counts['equal']} | {counts['refused']} |")
    refused = [f"`{name}` {counts['refused']}" for name, counts in by_op.items()
               if counts["refused"] == sum(counts.values())]
    lines += ["", f"{_REFUSED_EVERYWHERE} {', '.join(refused) or 'none'}."]
    return "\n".join(lines) + "\n"


_REFUSED_EVERYWHERE = "Refused by name on every case (op cases):"


def documented_counts(text: str, surface: Surface) -> tuple[Counter, dict[str, Counter]]:
    """The totals and the per-op counts (``Counter(cases=, equal=, refused=)``) of ``surface``'s
    table in the markdown ``text``: what :func:`coverage_table` wrote, read back.

    Example::

        >>> # xdoctest: +SKIP("imports the OpInfo database (a few seconds)")
        >>> result = sweep_ops(INT8_WEIGHT, samples_per_op=1)
        >>> documented_counts(coverage_table(result), INT8_WEIGHT)[1]["t"]
        Counter({'cases': 1, 'equal': 1})
    """
    begin, end = marked_section(surface)
    table = text.split(begin, 1)[1].split(end, 1)[0] if begin in text else text
    rows = [line.strip("|").split("|") for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")]
    if len(rows) < 2 or _REFUSED_EVERYWHERE not in table:
        raise ValueError(f"{COVERAGE_DOC} holds no coverage table of {surface.name!r} between {begin} and {end}; "
                         f"write it with python3 -m torch_tp.testing._op_sweep_tables")
    total = rows[1]
    totals = Counter(dict(zip(("ops", "cases", *OUTCOMES), (int(v) for v in total[1:]))))
    per_op = {row[0].strip().strip("`"): Counter(dict(zip(("cases", "equal", "refused"), map(int, row[1:]))))
              for row in rows[3:]}
    refused = table.split(_REFUSED_EVERYWHERE, 1)[1].strip().rstrip(".")
    for item in (refused.split(", ") if refused != "none" else []):
        name, cases = item.rsplit(" ", 1)
        per_op[name.strip("`")] = Counter(cases=int(cases), refused=int(cases))
    for counts in per_op.values():
        for key in [k for k, v in counts.items() if v == 0]:
            del counts[key]
    return totals, per_op


def swept_counts(result: SweepResult) -> dict[str, Counter]:
    """``result``'s per-op counts in :func:`documented_counts`'s form."""
    return {name: Counter({k: v for k, v in (("cases", sum(c.values())), ("equal", c["equal"]),
                                             ("refused", c["refused"])) if v})
            for name, c in result.by_op().items()}


def assert_documented(result: SweepResult, text: str, command: str, *, known_wrong: dict[str, int] | None = None) -> None:
    """Raise ``AssertionError`` unless ``result`` (a sweep of some ops) has no wrong or unclear case and
    each of its ops has the counts ``text``'s table of its surface gives, and that table is whole:
    its totals are its rows' and show no wrong or unclear case. ``command`` rewrites the table.
    ``known_wrong`` (``{op: cases}``, upstream's expected failures) names ops whose wrong cases are
    known and not yet fixed: they may fail, and the table must record exactly that many.

    Example::

        >>> # xdoctest: +SKIP("imports the OpInfo database (a few seconds)")
        >>> assert_documented(sweep_ops(INT8_WEIGHT, ops=some_ops), open(COVERAGE_DOC).read(),
        ...                   "python3 -m torch_tp.testing._op_sweep")
    """
    known_wrong = known_wrong or {}
    failures = [c for c in result.failures() if c.op not in known_wrong]
    assert not failures, "\n".join(f"{c.op} sample {c.sample} arg {c.position} {c.variant}: {c.outcome}: {c.detail}"
                                   for c in failures[:30])
    totals, documented = documented_counts(text, result.surface)
    stale = {name: (counts, documented.get(name)) for name, counts in swept_counts(result).items()
             if documented.get(name) != counts}
    assert not stale, (f"{COVERAGE_DOC}'s table of {result.surface.name} is not the sweep's for "
                       f"{len(stale)} ops (swept, documented): {dict(list(stale.items())[:10])}; run {command}")
    rows = Counter()
    for counts in documented.values():
        rows.update(counts)
    assert (totals["ops"], totals["cases"], totals["equal"], totals["refused"]) == (
        len(documented), rows["cases"], rows["equal"], rows["refused"]), (
        f"{COVERAGE_DOC}'s totals of {result.surface.name} are not its rows' ({totals} vs {rows}); run {command}")
    assert (totals["wrong"] + totals["unclear"]) == sum(known_wrong.values()), (
        f"{COVERAGE_DOC} records wrong or unclear cases of {result.surface.name} beyond the known ones "
        f"{known_wrong}: {totals}")


def sampled_ops(ops: Iterable, *, keep: Iterable[str] = (), every: int = 8) -> list:
    """The ops CI sweeps: those named in ``keep`` and about one in ``every`` of the rest, chosen by
    a stable hash of the name (the same ops on every run and machine).

    Example::

        >>> import types
        >>> [op.name for op in sampled_ops([types.SimpleNamespace(name="t", variant_test_name="")], keep=["t"])]
        ['t']
    """
    keep = set(keep)
    return [op for op in ops if op_name(op) in keep or zlib.crc32(op_name(op).encode()) % every == 0]


#: Where each surface's coverage table lives, between these markers.
COVERAGE_DOC = "docs/op_coverage.md"


def marked_section(surface: Surface) -> tuple[str, str]:
    """The markers around ``surface``'s table in :data:`COVERAGE_DOC`."""
    return f"<!-- sweep: {surface.name} -->", f"<!-- end sweep: {surface.name} -->"


def write_coverage(path: str, result: SweepResult) -> None:
    """Replace ``result.surface``'s table in the markdown file at ``path`` by :func:`coverage_table`."""
    begin, end = marked_section(result.surface)
    with open(path) as f:
        text = f.read()
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(f"{head}{begin}\n{coverage_table(result)}{end}{tail}")


if __name__ == "__main__":  # the older command: python3 -m torch_tp.testing._op_sweep [SURFACE ...]
    import runpy

    runpy.run_module("torch_tp.testing._op_sweep_tables", run_name="__main__")
