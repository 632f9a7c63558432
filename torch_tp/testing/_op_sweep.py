"""Every op of PyTorch's OpInfo database, on one of torch_tp's tensor kinds, against the float op.

A *surface* is a tensor kind torch_tp hands users (an int8 weight, ...): :class:`Surface` says
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
    >>> result = sweep_ops(INT8_WEIGHT, samples_per_op=2)
    >>> [case for case in result.cases if case.outcome in ("wrong", "unclear")]
    []
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "COVERAGE_DOC",
    "INT8_WEIGHT",
    "OUTCOMES",
    "SURFACES",
    "Surface",
    "SweepCase",
    "SweepResult",
    "coverage_table",
    "marked_section",
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
        >>> INT8_WEIGHT.name
        'int8 weight'
    """

    name: str
    positions: Callable[[Sequence[Any]], list[int]]   # which of (input, *args) it can stand for
    lift: Callable[[torch.Tensor], torch.Tensor]      # the surface tensor for a float argument
    value: Callable[[torch.Tensor], torch.Tensor]     # the float value a surface tensor stands for


@dataclasses.dataclass(frozen=True)
class SweepCase:
    """One op, sample and argument position, and what happened."""

    op: str
    sample: int
    position: int
    outcome: str
    detail: str = ""


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
    with warnings.catch_warnings():  # the database's deprecated ops warn on every sample
        warnings.simplefilter("ignore")
        for op in ops:
            cases.extend(_op_cases(op, surface, samples_per_op, rtol, atol))
    return SweepResult(surface, cases)


def _op_cases(op, surface: Surface, samples_per_op: int | None, rtol: float, atol: float) -> Iterable[SweepCase]:
    if torch.float32 not in op.supported_dtypes("cpu"):
        return
    torch.manual_seed(0)  # the samples' values: the same cases on every run
    try:
        samples = op.sample_inputs("cpu", torch.float32, requires_grad=False)
    except Exception:  # an OpInfo whose sample generator needs something this build lacks
        return
    for index, sample in enumerate(samples):
        if samples_per_op is not None and index >= samples_per_op:
            break
        args = [sample.input, *sample.args]
        for position in surface.positions(args):
            case = _run_case(op, sample.kwargs, args, position, surface, rtol, atol)
            if case is not None:
                yield SweepCase(op_name(op), index, position, *case)


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
    except _NAMED_ERRORS as error:
        return ("refused", "") if "torch_tp" in str(error) else ("unclear", _describe(error))
    except Exception as error:
        return "unclear", _describe(error)
    try:
        _assert_same(_float_values(got), want, op.name in _UNINITIALIZED, rtol, atol)
    except Exception as error:
        return "wrong", str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    return "equal", ""


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def _float_values(result: Any) -> Any:
    """``result`` with every tensor subclass that stands for floats (``dequantize()``) replaced by them."""
    return pytree.tree_map(lambda t: t.dequantize() if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor
                           and hasattr(t, "dequantize") else t, result)


def _assert_same(got: Any, want: Any, shapes_only: bool, rtol: float, atol: float) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec, f"result structure {got_spec} differs from the float op's {want_spec}"
    for g, w in zip(got_leaves, want_leaves):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), f"got {type(g).__name__}, the float op a tensor"
            if shapes_only:
                assert (g.shape, g.dtype) == (w.shape, w.dtype), ((g.shape, g.dtype), (w.shape, w.dtype))
            else:
                torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
        else:
            assert g == w, (g, w)


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
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- surfaces


def _int8_weight_positions(args: Sequence[Any]) -> list[int]:
    return [i for i, a in enumerate(args) if type(a) is torch.Tensor and a.layout == torch.strided
            and a.dtype == torch.float32 and a.ndim == 2 and a.numel() > 0]


def _int8_weight(t: torch.Tensor) -> torch.Tensor:
    from torch_tp.quant import Int8SymmetricTensor

    return Int8SymmetricTensor.from_hp(torch.nan_to_num(t))  # a weight holds no NaN or inf (refused)


def _dequantized(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize()


#: ``Int8SymmetricTensor`` (weight-only) in place of each non-empty 2-D float32 argument.
INT8_WEIGHT = Surface("int8 weight", _int8_weight_positions, _int8_weight, _dequantized)


SURFACES = {"int8-weight": INT8_WEIGHT}
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


if __name__ == "__main__":  # python3 -m torch_tp.testing._op_sweep [SURFACE ...]: rewrite the docs' tables
    import sys

    for key in sys.argv[1:] or list(SURFACES):
        swept = sweep_ops(SURFACES[key])
        write_coverage(COVERAGE_DOC, swept)
        print(f"{SURFACES[key].name}: {len(swept.cases)} cases, {len(swept.failures())} wrong or unclear "
              f"-> {COVERAGE_DOC}")
