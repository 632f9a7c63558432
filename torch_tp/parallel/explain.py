"""``explain_plan``: what a plan would do to every parameter, without doing it.

The report lists, for each parameter of each matched module, its global shape, the
placement the style gives it, the local shape and bytes on every rank, and flags uneven
or empty shards and modules a style cannot handle. It reads only shapes and dtypes, so
it works on a model built on the ``meta`` device — check the plan of a model too big
for one machine before allocating anything — and the mesh may be a plain rank count.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_tp._layouts import shard_sizes
from torch_tp.parallel import rules
from torch_tp.parallel._upstream import UpstreamStyle
from torch_tp.parallel.plan import resolve_plan
from torch_tp.parallel.style import ParallelStyle

__all__ = ["ParamRow", "PlanReport", "explain_plan", "shard_sizes"]

#: The styles whose rows are mixture-of-experts weights
EXPERT_STYLES = ("ExpertParallel", "ExpertTensorParallel")


@dataclass(frozen=True)
class ParamRow:
    """One parameter (or a parameterless module) under the plan.

    ``placement`` is ``None`` for a parameter the plan leaves a plain tensor;
    ``local_shapes`` and ``bytes_per_rank`` have one entry per rank. ``note`` flags
    uneven or empty shards, or why the style cannot handle the module.

    Example::

        >>> from torch_tp import ColwiseParallel
        >>> row = explain_plan(nn.Linear(4, 10), 4, ColwiseParallel()).rows[0]
        >>> row.name, row.local_shapes[-1], row.note
        ('weight', (1, 4), 'uneven: 10 over 4 ranks -> 3, 3, 3, 1')
    """

    module_path: str
    name: str | None
    style: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype | None
    placement: Placement | None
    local_shapes: tuple[tuple[int, ...], ...]
    bytes_per_rank: tuple[int, ...]
    note: str = ""

    @property
    def path(self) -> str:
        """Full dotted path of the parameter (the module path for a parameterless row)."""
        if self.name is None:
            return self.module_path
        return f"{self.module_path}.{self.name}" if self.module_path else self.name


class PlanReport:
    """The rows of :func:`explain_plan`; ``str(report)`` is a table, iterate for the rows.

    Example::

        >>> from torch_tp import ColwiseParallel
        >>> report = explain_plan(nn.Sequential(nn.Linear(4, 8)), 2, {"0": ColwiseParallel()})
        >>> [row.path for row in report], report.bytes_per_rank()
        (['0.weight', '0.bias'], (80, 80))
    """

    def __init__(self, num_ranks: int, rows: list[ParamRow]):
        self.num_ranks = num_ranks
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]

    def bytes_per_rank(self, styles: Collection[str] | None = None) -> tuple[int, ...]:
        """Parameter bytes each rank holds once the plan is applied (of the rows of ``styles`` only, if given)."""
        rows = [row for row in self.rows if styles is None or row.style in styles]
        return tuple(sum(row.bytes_per_rank[r] for row in rows) for r in range(self.num_ranks))

    def expert_bytes_per_rank(self) -> tuple[int, ...]:
        """Bytes of mixture-of-experts weights each rank holds (``ExpertParallel`` /
        ``ExpertTensorParallel`` rows): ``1/world`` of the experts under either style.

        Example::

            >>> from torch_tp.models.moe import GroupedExperts
            >>> from torch_tp import ExpertParallel
            >>> explain_plan(GroupedExperts(4, 2, num_experts=4), 2, ExpertParallel()).expert_bytes_per_rank()
            (192, 192)
        """
        return self.bytes_per_rank(EXPERT_STYLES)

    def problems(self) -> list[str]:
        """Notes that block applying the plan (a style that cannot handle its module)."""
        return [f"{row.path}: {row.note}" for row in self.rows if row.note.startswith("error")]

    def __str__(self) -> str:
        return _format_table(self)

    def __repr__(self) -> str:
        return f"PlanReport({len(self.rows)} rows over {self.num_ranks} ranks)"


def _dim_sizes(size: int, placement: Placement, num_ranks: int) -> tuple[int, ...]:
    """Each rank's length of the sharded dim; a packed shard holds a slice of each part."""
    parts = rules.parts_of(placement)
    return tuple(parts * n for n in shard_sizes(size // parts, num_ranks))


def _local_shape(shape: tuple[int, ...], placement: Placement | None, rank: int, num_ranks: int):
    dim = rules.sharded_dim(placement)
    if dim is None:
        return shape
    dim %= len(shape)
    local = list(shape)
    local[dim] = _dim_sizes(shape[dim], placement, num_ranks)[rank]
    return tuple(local)


def _shard_note(shape: tuple[int, ...], placement: Placement | None, num_ranks: int) -> str:
    dim = rules.sharded_dim(placement)
    if dim is None:
        return ""
    size = shape[dim % len(shape)]
    parts = rules.parts_of(placement)
    what = f"{size}" if parts == 1 else f"each of {parts} parts of {size // parts}"
    sizes = shard_sizes(size // parts, num_ranks)
    if 0 in sizes:
        empty = [r for r, n in enumerate(sizes) if n == 0]
        return f"empty shard: {what} over {num_ranks} ranks leaves ranks {empty} nothing"
    if len(set(sizes)) > 1:
        return f"uneven: {what} over {num_ranks} ranks -> {', '.join(map(str, sizes))}"
    return ""


def _local_bytes(param: torch.Tensor, local_shape: tuple[int, ...], placement) -> int:
    """Bytes of one rank's shard. A tensor subclass that stores inner tensors (torchao's
    ``tensor_data_names``: e.g. int8 ``qdata`` + float32 ``scale``) is counted by those, each
    sharded along a dim only where its size follows the outer tensor's."""
    inner_names = getattr(param, "tensor_data_names", None)
    if not inner_names:
        return int(torch.Size(local_shape).numel()) * param.element_size()
    total = 0
    for inner in (getattr(param, name) for name in inner_names):
        shape = list(inner.shape)
        dim = rules.sharded_dim(placement)
        if dim is not None and inner.ndim == param.ndim:
            dim %= param.ndim
            if inner.shape[dim] == param.shape[dim]:
                shape[dim] = local_shape[dim]
        total += int(torch.Size(shape).numel()) * inner.element_size()
    return total


def _param_row(module_path, name, param, style, placement, num_ranks, note="") -> ParamRow:
    shape = tuple(param.shape)
    locals_ = tuple(_local_shape(shape, placement, r, num_ranks) for r in range(num_ranks))
    nbytes = tuple(_local_bytes(param, s, placement) for s in locals_)
    note = note or _shard_note(shape, placement, num_ranks)
    return ParamRow(module_path, name, style, shape, param.dtype, placement, locals_, nbytes, note)


def _check_note(style, module, mesh, path) -> str:
    try:
        style.check(module, mesh, path)
    except (TypeError, ValueError) as err:
        return f"error: {err}"
    return ""


def _rows_for_entry(root, entry, mesh, num_ranks) -> list[ParamRow]:
    module = root.get_submodule(entry.path)
    style = entry.style if isinstance(entry.style, ParallelStyle) else UpstreamStyle(entry.style)
    style_name = type(entry.style).__name__
    note = _check_note(style, module, mesh, entry.path)
    placements = {} if note else style.param_placements(module)
    if not placements:
        empty = ((),) * num_ranks
        return [ParamRow(entry.path, None, style_name, (), None, None, empty, (0,) * num_ranks, note)]
    rows = []
    for name, placement in placements.items():
        param = module.get_parameter(name)
        module_path = ".".join(p for p in (entry.path, name.rpartition(".")[0]) if p)
        rows.append(_param_row(module_path, name.rpartition(".")[2], param, style_name, placement, num_ranks))
    return rows


def explain_plan(
    module: nn.Module,
    device_mesh: DeviceMesh | int,
    parallelize_plan,
    *,
    replicate_unplanned_params: bool = False,
) -> PlanReport:
    """Report what ``parallelize_module(module, device_mesh, parallelize_plan)`` would do.

    Nothing is changed and nothing is communicated. ``device_mesh`` may be a 1-D
    :class:`DeviceMesh` or just the number of ranks. Plan keys are resolved exactly as
    :func:`torch_tp.parallelize_module` does (an unmatched or conflicting key raises);
    a module a style cannot handle is reported in its row's ``note`` and in
    :meth:`PlanReport.problems`. Parameters outside the plan are listed with style ``-``
    (placement ``None``: they stay plain tensors, or ``Replicate()`` with
    ``replicate_unplanned_params=True``).

    Example::

        >>> from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
        >>> with torch.device("meta"):
        ...     model = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=100))
        >>> report = explain_plan(model, 8, tensor_parallel_plan())
        >>> report.bytes_per_rank()[0] < sum(p.nbytes for p in model.parameters())
        True
        >>> print(report)  # doctest: +SKIP
    """
    rules.require_1d_mesh(device_mesh, "explain_plan")
    num_ranks = rules.mesh_size(device_mesh)
    rows: list[ParamRow] = []
    covered: set[str] = set()
    for entry in resolve_plan(module, parallelize_plan):
        entry_rows = _rows_for_entry(module, entry, device_mesh, num_ranks)
        rows += entry_rows
        covered.update(row.path for row in entry_rows if row.name is not None)
    rest = Replicate() if replicate_unplanned_params else None
    for name, param in module.named_parameters():
        if name not in covered:
            owner, _, leaf = name.rpartition(".")
            rows.append(_param_row(owner, leaf, param, "-", rest, num_ranks))
    position = {path: i for i, (path, _) in enumerate(module.named_modules())}
    rows.sort(key=lambda row: position[row.module_path])  # model order; stable within a module
    return PlanReport(num_ranks, rows)


# ---------------------------------------------------------------------------- table


def _short(placement: Placement | None) -> str:
    if placement is None:
        return "plain"
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if rules.parts_of(placement) > 1:
        return f"Shard({placement.dim}) packed={rules.parts_of(placement)}"
    return type(placement).__name__ + "()"


def _per_rank(values: tuple) -> str:
    """Run-length form: ``"(13, 64) x7 | (9, 64) x1"``."""
    runs: list[list] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return " | ".join(f"{value} x{count}" for value, count in runs)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _format_table(report: PlanReport) -> str:
    header = ("parameter", "style", "global", "placement", "local shape per rank", "bytes per rank", "note")
    body = [
        (
            row.path,
            row.style,
            str(row.global_shape) if row.name else "",
            _short(row.placement) if row.name else "",
            _per_rank(tuple(str(s) for s in row.local_shapes)) if row.name else "",
            _per_rank(tuple(_human_bytes(b) for b in row.bytes_per_rank)) if row.name else "",
            row.note,
        )
        for row in report
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1] for line in [header, *body]]
    lines.insert(1, "-" * len(lines[0]))
    totals = _per_rank(tuple(_human_bytes(b) for b in report.bytes_per_rank()))
    lines.append(f"parameter bytes per rank: {totals} (rank order)")
    if any(row.style in EXPERT_STYLES for row in report):
        experts = _per_rank(tuple(_human_bytes(b) for b in report.expert_bytes_per_rank()))
        lines.append(f"expert parameter bytes per rank: {experts} (rank order)")
    return "\n".join(line.rstrip() for line in lines)
