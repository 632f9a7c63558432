"""``explain_plan``: what a plan would do to every parameter, without doing it.

The report lists, for each parameter of each matched module, its global shape, the
placement the style gives it, the local shape and bytes on every rank, and flags uneven
or empty shards and modules a style cannot handle. It reads only shapes and dtypes, so
it works on a model built on the ``meta`` device — check the plan of a model too big
for one machine before allocating anything — and the mesh may be a plain rank count.

On a 2-D mesh (``("dp", "tp")``, or a mapping ``{"dp": 2, "tp": 4}``) the report is that of
``parallelize_module`` on the tp axis followed by
:func:`torch_tp.fully_shard_by_pattern` on the dp axis: each row also carries its dp
placement as FSDP will choose it (:mod:`torch_tp.tools.predict`), and the local shapes
and bytes of every rank of the mesh.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_tp._layouts import shard_sizes
from torch_tp.parallel import rules
from torch_tp.parallel.plan import outermost_matches, resolve_plan
from torch_tp.tools.predict import DEFAULT_MIN_WEIGHT_SIZE, axis_sizes, check_min_weight_size, predict_dp_placement

__all__ = ["ParamRow", "PlanReport", "explain_plan", "shard_sizes"]

#: The styles whose rows are mixture-of-experts weights
EXPERT_STYLES = ("ExpertParallel", "ExpertTensorParallel")


@dataclass(frozen=True)
class ParamRow:
    """One parameter (or a parameterless module) under the plan.

    ``placement`` is ``None`` for a parameter the plan leaves a plain tensor;
    ``local_shapes`` and ``bytes_per_rank`` have one entry per rank. ``note`` flags
    uneven or empty shards, or why the style cannot handle the module. On a 2-D mesh,
    ``placement`` is the tp placement, ``dp_placement`` the dp one (``Shard(d)`` or
    ``Replicate()``; ``None`` on a 1-D report), the ranks are the mesh's in row-major order
    (rank ``dp_index * tp + tp_index``), and ``note`` also says why a parameter is not
    sharded over dp (too small, no divisible dim).

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
    dp_placement: Placement | None = None

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

    def __init__(self, num_ranks: int, rows: list[ParamRow], *, mesh_axes: dict[str, int] | None = None, fsdp_units: list[str] | None = None):
        self.num_ranks = num_ranks
        self.rows = rows
        #: ``{"dp": n, "tp": m}`` for a 2-D report (``None``: 1-D, tensor parallel only)
        self.mesh_axes = mesh_axes
        #: the module paths FSDP wraps, ``""`` (the root) last; ``None`` without FSDP
        self.fsdp_units = fsdp_units

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

    def replicated_over_dp(self) -> list[str]:
        """On a 2-D report: ``"path: why"`` for each parameter FSDP will not shard over dp.

        Example::

            >>> report = explain_plan(nn.Linear(6, 10), {"dp": 4, "tp": 1}, None, fsdp_patterns=[""], min_weight_size=1)
            >>> report.replicated_over_dp()
            ['weight: no divisible dim: (10, 6) has no dim divisible by dp 4', 'bias: no divisible dim: (10,) has no dim divisible by dp 4']
        """
        return [f"{row.path}: {row.note}" for row in self.rows if row.name is not None and row.dp_placement == Replicate()]

    def problems(self) -> list[str]:
        """Notes that block applying the plan (a style that cannot handle its module)."""
        return [f"{row.path}: {row.note}" for row in self.rows if row.note.startswith("error")]

    def __str__(self) -> str:
        return _format_table(self)

    def __repr__(self) -> str:
        where = f"{self.num_ranks} ranks" if self.mesh_axes is None else " x ".join(f"{n} {k}" for k, n in self.mesh_axes.items())
        return f"PlanReport({len(self.rows)} rows over {where})"


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


def _local_bytes(param: torch.Tensor, local_shape: tuple[int, ...]) -> int:
    """Bytes of one rank's shard of shape ``local_shape`` (cut by every mesh dim: tp and dp). A
    tensor subclass that stores inner tensors (torchao's ``tensor_data_names``: e.g. int8
    ``qdata`` + float32 ``scale``) is counted by those, each cut along every dim where its size
    follows the outer tensor's (a ``(rows, 1)`` scale is cut along the rows only)."""
    inner_names = getattr(param, "tensor_data_names", None)
    if not inner_names:
        return int(torch.Size(local_shape).numel()) * param.element_size()
    total = 0
    for inner in (getattr(param, name) for name in inner_names):
        shape = list(inner.shape)
        if inner.ndim == param.ndim:
            shape = [local if size == whole else size for size, whole, local in zip(shape, param.shape, local_shape)]
        total += int(torch.Size(shape).numel()) * inner.element_size()
    return total


def _param_row(module_path, name, param, style, placement, num_ranks, note="") -> ParamRow:
    shape = tuple(param.shape)
    locals_ = tuple(_local_shape(shape, placement, r, num_ranks) for r in range(num_ranks))
    sizes = {s: _local_bytes(param, s) for s in set(locals_)}
    nbytes = tuple(sizes[s] for s in locals_)
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
    style = entry.checked_style
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
    fsdp_patterns: str | list[str] | None = None,
    min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
    dp_dim: str = "dp",
    tp_dim: str = "tp",
) -> PlanReport:
    """Report what ``parallelize_module(module, device_mesh, parallelize_plan)`` would do.

    Nothing is changed and nothing is communicated. ``device_mesh`` may be a 1-D
    :class:`DeviceMesh` or just the number of ranks. Plan keys are resolved exactly as
    :func:`torch_tp.parallelize_module` does (an unmatched or conflicting key raises);
    a module a style cannot handle is reported in its row's ``note`` and in
    :meth:`PlanReport.problems`. Parameters outside the plan are listed with style ``-``
    (placement ``None``: they stay plain tensors, or ``Replicate()`` with
    ``replicate_unplanned_params=True``).

    A 2-D ``device_mesh`` (a ``DeviceMesh`` with dims ``dp_dim``/``tp_dim``, or a mapping
    ``{"dp": 2, "tp": 4}``) reports the plan on the tp axis and
    ``fully_shard_by_pattern(module, mesh, fsdp_patterns, min_weight_size=...)`` on the dp
    axis (``fsdp_patterns=None``: no FSDP, every parameter replicated over dp); see
    :func:`torch_tp.predict_placements`.

    Example::

        >>> from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
        >>> with torch.device("meta"):
        ...     model = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=100))
        >>> report = explain_plan(model, 8, tensor_parallel_plan())
        >>> report.bytes_per_rank()[0] < sum(p.nbytes for p in model.parameters())
        True
        >>> print(report)  # doctest: +SKIP
    """
    if isinstance(device_mesh, Mapping) or getattr(device_mesh, "ndim", 1) > 1:
        return _explain_2d(module, device_mesh, parallelize_plan, replicate_unplanned_params, fsdp_patterns, min_weight_size, dp_dim, tp_dim)
    if fsdp_patterns is not None:
        raise ValueError(
            "explain_plan(fsdp_patterns=...) needs a 2-D mesh (a DeviceMesh with dims "
            f"({dp_dim!r}, {tp_dim!r}) or {{{dp_dim!r}: n, {tp_dim!r}: m}}); a 1-D mesh is the tp axis"
        )
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


# ------------------------------------------------------------------------- 2-D mesh


def _explain_2d(module, mesh, plan, replicate_unplanned, fsdp_patterns, min_weight_size, dp_dim, tp_dim) -> PlanReport:
    """The tp report on the tp axis, each row then split over dp as FSDP will split it."""
    caller = "explain_plan" if fsdp_patterns is None else "predict_placements"
    axes = axis_sizes(mesh, dp_dim=dp_dim, tp_dim=tp_dim, caller=caller)
    min_weight_size = check_min_weight_size(min_weight_size, caller)
    dp, tp = axes[dp_dim], axes.get(tp_dim, 1)
    if plan is None:
        if tp > 1:
            raise ValueError(f"{caller}: the mesh has a tp dim {tp_dim!r} of size {tp} but no parallelize_plan was given")
        tp_report = explain_plan(module, 1, {}, replicate_unplanned_params=replicate_unplanned)
    else:
        tp_report = explain_plan(module, tp, plan, replicate_unplanned_params=replicate_unplanned)
    units = None
    if fsdp_patterns is not None:
        units = [u for u in outermost_matches(module, fsdp_patterns, what=f"{caller} fsdp pattern") if u] + [""]
    rows = [_split_over_dp(module, row, dp, tp, min_weight_size if units is not None else None) for row in tp_report]
    return PlanReport(dp * tp, rows, mesh_axes=axes, fsdp_units=units)


def _split_over_dp(root: nn.Module, row: ParamRow, dp: int, tp: int, min_weight_size: int | None) -> ParamRow:
    """``row`` (tp ranks) on every rank of the (dp, tp) mesh; ``min_weight_size=None``: no FSDP."""
    if row.name is None:
        return replace(row, local_shapes=((),) * (dp * tp), bytes_per_rank=(0,) * (dp * tp))
    if min_weight_size is None:
        placement, why = Replicate(), ""
    else:
        placement, why = predict_dp_placement(row.global_shape, row.placement, dp_size=dp, tp_size=tp, min_weight_size=min_weight_size)
    dim = rules.sharded_dim(placement)
    shapes = []
    for rank in range(dp * tp):
        shape = list(row.local_shapes[rank % tp])
        if dim is not None:
            shape[dim] //= dp
        shapes.append(tuple(shape))
    param = root.get_parameter(row.path)
    sizes = {shape: _local_bytes(param, shape) for shape in set(shapes)}  # a few shapes over many ranks
    nbytes = tuple(sizes[shape] for shape in shapes)
    note = "; ".join(n for n in (row.note, why) if n)
    return replace(row, local_shapes=tuple(shapes), bytes_per_rank=nbytes, note=note, dp_placement=placement)


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


def _placement_cell(row: ParamRow, report: PlanReport) -> str:
    if row.name is None:
        return ""
    if report.mesh_axes is None:
        return _short(row.placement)
    return f"({_short(row.dp_placement)}, {_short(row.placement)})"


def _format_table(report: PlanReport) -> str:
    where = "placement" if report.mesh_axes is None else f"placement ({', '.join(report.mesh_axes)})"
    header = ("parameter", "style", "global", where, "local shape per rank", "bytes per rank", "note")
    body = [
        (
            row.path,
            row.style,
            str(row.global_shape) if row.name else "",
            _placement_cell(row, report),
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
    if report.fsdp_units is not None:
        lines.append(f"fsdp units: {', '.join(u or '<root>' for u in report.fsdp_units)}")
    if any(row.style in EXPERT_STYLES for row in report):
        experts = _per_rank(tuple(_human_bytes(b) for b in report.expert_bytes_per_rank()))
        lines.append(f"expert parameter bytes per rank: {experts} (rank order)")
    return "\n".join(line.rstrip() for line in lines)
