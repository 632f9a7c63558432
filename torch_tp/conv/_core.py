"""The shared core of ``torch_tp.conv``'s DTensor handlers: binding, wrapping, the one spatial-layout
parser, the replicated-tensor check, partial reduction and the moments merge.

Every handler module (``sharded_conv``, ``transposed_conv``, ``batch_norm``, ``group_norm``,
``pooling``, ``upsample``, ``padding``, ``global_mean``, ``pointwise``) imports from
``torch_tp.conv`` only this module, :mod:`torch_tp.conv._registry`, :mod:`torch_tp.conv.halo`,
:mod:`torch_tp.conv._geometry` and :mod:`torch_tp.conv._ranges` (and from the root package
``torch_tp._layouts``' shard arithmetic); a helper two handlers need lives here, once.

| helper | what it does |
| --- | --- |
| :func:`bind` | an aten call's positional and keyword arguments, in schema order (``CONV_ARGS``, ...) |
| :func:`wrap` | a local result as this rank's shard of a DTensor of a given global shape |
| :func:`spatial_layout` | the input's placements parsed once: which mesh dims shard batch, channels, which spatial dim |
| :func:`check_replicated` | weight / bias / statistics: a replicated DTensor on the input's mesh |
| :func:`without_partials` | ``Partial`` mesh dims reduced to ``Replicate()`` |
| :func:`partial_where_sharded` | placements of a sum over the local strip: ``Partial()`` on every sharded mesh dim |
| :func:`merge_moments` | Chan's parallel merge of per-rank (count, mean, centred sum of squares) rows |
| :func:`compute_dtype` | float32 for half types, the dtype itself for float32 / float64 |
| :func:`expand` | an int or per-dim list (``kernel_size``, ``stride``, ...) as one entry per spatial dim |
| :func:`contiguous_stride` | the strides of a contiguous tensor of a shape |
| :func:`written_into` | a write through a slice or select of the strips, out of place (``y[..., :2].zero_()``) |
| :class:`UnsupportedSpatialOpError` | the refusal of an op on strips (the region guard's, and a handler's inside a spatial model) |
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from torch_tp._layouts import shard_bounds

__all__ = [
    "CONV_ARGS",
    "CONV_BACKWARD_ARGS",
    "SpatialLayout",
    "UnsupportedSpatialOpError",
    "bind",
    "check_replicated",
    "compute_dtype",
    "contiguous_stride",
    "expand",
    "local",
    "merge_moments",
    "partial_where_sharded",
    "spatial_layout",
    "WRITABLE_VIEWS",
    "without_partials",
    "wrap",
    "written_into",
]


#: ``aten.convolution`` and ``aten.convolution_backward``'s argument names (ordinary and transposed).
CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
CONV_BACKWARD_ARGS = ("grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation",
                      "transposed", "output_padding", "groups", "output_mask")


def bind(args: tuple, kwargs: Optional[dict], names: Sequence[str]) -> list:
    """``args`` and ``kwargs`` of an aten call as one list in the order of ``names`` (missing: ``None``).

    Example:
        >>> bind((1, 2), {"c": 3}, ("a", "b", "c", "d"))
        [1, 2, 3, None]
    """
    values = list(args) + [None] * (len(names) - len(args))
    for i, name in enumerate(names):
        if name in (kwargs or {}):
            values[i] = kwargs[name]
    return values


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a dim of size 0 counts as 1).

    Example:
        >>> contiguous_stride((2, 3, 4))
        (12, 4, 1)
    """
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def wrap(local_tensor: torch.Tensor, mesh: Any, placements: Sequence[Any], shape: Sequence[int]) -> DTensor:
    """A DTensor with ``local_tensor`` as this rank's shard of a tensor of global ``shape`` (contiguous).

    Example:
        >>> # xdoctest: +SKIP("needs a process group")
        >>> y = wrap(torch.zeros(2, 5, 8, 6), mesh, [Shard(3)], (2, 5, 8, 30))   # rank 3 of 4
        >>> y.shape, y.placements
        (torch.Size([2, 5, 8, 30]), (Shard(dim=3),))
    """
    meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), local_tensor.dtype)
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local_tensor, spec, requires_grad=False)


def local(t: Any) -> Optional[torch.Tensor]:
    """``t.to_local()`` for a DTensor, else ``t`` (a plain tensor or ``None``).

    Example:
        >>> local(None) is None, local(torch.ones(2)).shape
        (True, torch.Size([2]))
    """
    return t.to_local() if isinstance(t, DTensor) else t


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics and normalizations are computed in: float32 or float64.

    Example:
        >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def expand(values: Any, n: int, name: str, what: str) -> list[int]:
    """An int or a list of 1 or ``n`` ints as ``n`` ints (one per spatial dim).

    Example:
        >>> expand(3, 2, "kernel_size", "sharded pooling"), expand([1, 2], 2, "stride", "sharded pooling")
        ([3, 3], [1, 2])
        >>> expand([1, 2, 3], 2, "stride", "sharded pooling")
        Traceback (most recent call last):
        ValueError: sharded pooling: stride has 3 entries for 2 spatial dims
    """
    values = [values] if isinstance(values, int) else list(values)
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"{what}: {name} has {len(values)} entries for {n} spatial dims")
    return values


def without_partials(x: Any) -> Any:
    """``x`` with every ``Partial`` mesh dim reduced to ``Replicate()`` (a non-DTensor unchanged).

    Example:
        >>> # xdoctest: +SKIP("needs a process group")
        >>> without_partials(x_partial).placements      # from (Partial(sum), Shard(3))
        (Replicate(), Shard(dim=3))
    """
    if not isinstance(x, DTensor) or not any(p.is_partial() for p in x.placements):
        return x
    return x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])


def partial_where_sharded(placements: Sequence[Any]) -> list:
    """Placements of a sum over the local strip (a weight or bias gradient): ``Partial()`` on
    every mesh dim that shards the input, ``Replicate()`` elsewhere.

    Example:
        >>> partial_where_sharded([Shard(3), Replicate()])
        [Partial(sum), Replicate()]
    """
    return [Partial() if isinstance(p, Shard) else Replicate() for p in placements]


def check_replicated(t: Any, mesh: Any, name: str, what: str, *, plain_ok: bool = False) -> None:
    """Refuse a ``t`` (weight, bias, statistic) that is not a replicated DTensor on ``mesh``.

    ``None`` passes; a plain tensor passes only with ``plain_ok`` (running statistics: the same
    on every rank).

    Example:
        >>> check_replicated(None, None, "bias", "sharded convolution")
        >>> check_replicated(torch.ones(3), None, "weight", "sharded convolution")
        Traceback (most recent call last):
        NotImplementedError: sharded convolution needs the weight as a replicated DTensor on the input's mesh, got a plain Tensor
    """
    if t is None or (plain_ok and not isinstance(t, DTensor)):
        return
    if not isinstance(t, DTensor):
        raise NotImplementedError(
            f"{what} needs the {name} as a replicated DTensor on the input's mesh, got a plain {type(t).__name__}"
        )
    if t.device_mesh != mesh:
        raise ValueError(f"{what}: the {name} lives on {t.device_mesh}, the input on {mesh}")
    if not all(isinstance(p, Replicate) for p in t.placements):
        raise NotImplementedError(f"{what} needs a replicated {name} (all Replicate()), got {t.placements}")


def merge_moments(rows: torch.Tensor) -> torch.Tensor:
    """Chan et al.'s parallel merge of ``(ranks, 1 + 2K)`` rows ``[n, mean_0..K-1, m2_0..K-1]`` into one.

    ``mean = sum_r n_r mean_r / n`` and ``m2 = sum_r m2_r + sum_r n_r (mean_r - mean)^2``:
    every term is non-negative, so no variance comes from a difference of large sums.

    Example:
        >>> rows = torch.tensor([[2., 1., 0.5], [2., 3., 0.5]], dtype=torch.float64)  # [n, mean, m2]
        >>> merge_moments(rows).tolist()
        [4.0, 2.0, 5.0]
    """
    k = (rows.shape[1] - 1) // 2
    n_r = rows[:, :1]
    means, m2s = rows[:, 1:1 + k], rows[:, 1 + k:]
    n = n_r.sum()
    mean = (n_r * means).sum(0) / n.clamp_min(1)
    m2 = m2s.sum(0) + (n_r * (means - mean) ** 2).sum(0)
    return torch.cat([n.reshape(1), mean, m2])


class UnsupportedSpatialOpError(NotImplementedError):
    """An op a spatial model ran on its strips that torch_tp cannot prove correct there.

    Defined here, beside the handlers that raise it too (``torch_tp.conv.pointwise``); public as
    ``torch_tp.conv.UnsupportedSpatialOpError``.

    Example::

        >>> raise UnsupportedSpatialOpError("torch_tp.conv: aten.sort.default in 'net' ...")
        Traceback (most recent call last):
        ...
        torch_tp.conv.UnsupportedSpatialOpError: torch_tp.conv: aten.sort.default in 'net' ...
    """


UnsupportedSpatialOpError.__module__ = "torch_tp.conv"  # its public name (tracebacks, pickling)


# --------------------------------------------------------------------------------------------
# A write through a view of the strips
# --------------------------------------------------------------------------------------------

_aten = torch.ops.aten
#: The views :func:`written_into` writes through.
WRITABLE_VIEWS = frozenset({_aten.slice.Tensor, _aten.select.int, _aten.alias.default, _aten.detach.default})


def written_into(parent: DTensor, op: Any, args: tuple, kwargs: dict, value: DTensor) -> Optional[DTensor]:
    """``parent`` with the elements of its view ``op(parent, *args, **kwargs)`` replaced by ``value``
    (the view's shape), out of place; ``None`` for a view or placement it cannot write through.

    ``op`` is one of :data:`WRITABLE_VIEWS`, ``parent`` is ``Shard(d)`` or ``Replicate()`` on a 1-D
    mesh. Autograd sees each rank's strip cloned with the rank's part of ``value`` written in: the
    gradient of ``value`` is a ``Partial`` sum of the ranks' parts (``Replicate()`` for a replicated
    ``parent``), the overwritten elements of ``parent`` get none. Every rank writes (an empty
    piece where its strip holds none of the view), so every rank's backward runs the same collectives.

    Example:
        >>> # xdoctest: +SKIP("needs a process group")
        >>> y2 = written_into(y, aten.slice.Tensor, (3, 0, 2), {}, torch.zeros_like(y[..., :2]))
        >>> y.copy_(y2)   # what y[..., :2].zero_() means, on the strips
    """
    mesh = parent.device_mesh
    if op not in WRITABLE_VIEWS or mesh.ndim != 1 or type(parent.placements[0]) not in (Shard, Replicate):
        return None
    d = parent.placements[0].dim % parent.ndim if isinstance(parent.placements[0], Shard) else None
    lo, hi = shard_bounds(parent.shape[d], mesh.size())[mesh.get_local_rank()] if d is not None else (0, 0)
    whole = value.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial() if d is not None else Replicate()])
    local = parent.to_local().clone()
    whole = whole.to(local.dtype)
    if op in (_aten.alias.default, _aten.detach.default):
        local = whole.narrow(d, lo, hi - lo).clone() if d is not None else whole.clone()
    else:
        k, start, stop, step, whole = _as_slice(parent, op, args, kwargs, whole)
        lo, hi = (lo, hi) if k == d else (0, parent.shape[k])
        first = start + max(0, -(-(lo - start) // step)) * step  # the view's first element in the strip
        last = max(first, min(stop, hi))
        index = [slice(None)] * parent.ndim
        index[k] = slice(first - lo, last - lo, step)
        local[tuple(index)] = whole.narrow(k, min((first - start) // step, whole.shape[k]), len(range(first, last, step)))
    return DTensor.from_local(local, mesh, parent.placements, run_check=False, shape=parent.shape,
                              stride=contiguous_stride(parent.shape))


def _as_slice(parent: DTensor, op: Any, args: tuple, kwargs: dict, whole: torch.Tensor) -> tuple:
    """``(dim, start, stop, step, value)`` of a slice or select, bounds clamped as Python's (a select
    is a slice of one, its value given the dim back)."""
    if op is _aten.select.int:
        k, i = bind(args, kwargs, ("dim", "index"))
        k = k % parent.ndim
        i = i % parent.shape[k]
        return k, i, i + 1, 1, whole.unsqueeze(k)
    k, start, stop, step = bind(args, kwargs, ("dim", "start", "end", "step"))
    k = (k or 0) % parent.ndim
    size = parent.shape[k]
    start, stop = (default if b is None else max(0, min(size, b if b >= 0 else b + size))
                   for b, default in ((start, 0), (stop, size)))
    return k, start, stop, step or 1, whole


# --------------------------------------------------------------------------------------------
# The one spatial-layout parser
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpatialLayout:
    """What a DTensor's placements shard: per mesh dim, batch, channels or a spatial dim.

    ``placements`` are the input's, with ``Partial`` replaced by ``Replicate()`` where the
    parser was asked to reduce partials (the caller redistributes to them).
    """

    mesh: Any
    placements: tuple
    first_spatial: int  # tensor dim of the first spatial dim: 2 for (N, C, ...), 1 for (C, ...)
    spatial: tuple[tuple[int, int], ...]  # (tensor dim, mesh dim) of every spatial shard
    sharded_mesh_dims: tuple[int, ...]  # mesh dims sharding anything (batch, channels, space)

    @property
    def spatial_mesh_dims(self) -> tuple[int, ...]:
        """The mesh dims that shard a spatial dim."""
        return tuple(mesh_dim for _, mesh_dim in self.spatial)

    def one_spatial_dim(self, what: str) -> tuple[Optional[int], Optional[int]]:
        """``(tensor dim, mesh dim)`` of the one spatial shard, ``(None, None)`` for none; raise for more."""
        if len(self.spatial) > 1:
            raise NotImplementedError(
                f"{what} supports the input sharded on one spatial dim over one mesh dim, got "
                f"{self.placements} ((tensor dim, mesh dim) = {list(self.spatial)})"
            )
        return self.spatial[0] if self.spatial else (None, None)


def spatial_layout(
    x: Any, what: str, *, first_spatial: int = 2, channels: bool = False, partials: str = "refuse",
    name: str = "input",
) -> SpatialLayout:
    """Parse the placements of ``x``, an ``(N, C, *spatial)`` DTensor (``(C, *spatial)`` with
    ``first_spatial=1``), refusing what ``what`` (e.g. ``"sharded batch norm"``) cannot run.

    Args:
        channels: whether a dim in front of the spatial ones other than the batch (channels)
            may be sharded; refused by default (a convolution mixes every channel).
        partials: ``"refuse"``, ``"reduce"`` (reported as ``Replicate()``: the caller reduces),
            or ``"keep"`` (a linear op runs on partial values as they are; sum or avg only).

    Raises:
        NotImplementedError: ``x`` is not a DTensor, has fewer dims than ``first_spatial``, or a
            placement the op cannot run (a ``Shard`` subclass, a channel shard, a ``Partial``).

    Example:
        >>> # xdoctest: +SKIP("needs a process group")
        >>> layout = spatial_layout(x, "sharded batch norm")       # x: Shard(3) on a 1-D mesh
        >>> layout.spatial, layout.sharded_mesh_dims
        (((3, 0),), (0,))
    """
    if not isinstance(x, DTensor):
        raise NotImplementedError(f"{what} needs the {name} as a DTensor, got a plain {type(x).__name__}")
    if x.ndim < first_spatial:
        raise NotImplementedError(f"{what} needs an (N, C, ...) {name}, got {x.ndim} dims")
    placements, spatial, sharded = [], [], []
    for mesh_dim, p in enumerate(x.placements):
        if p.is_partial() and partials == "reduce":
            p = Replicate()
        elif p.is_partial() and partials == "keep" and getattr(p, "reduce_op", None) in ("sum", "avg"):
            pass
        elif not isinstance(p, Replicate) and type(p) is not Shard:
            also = ", Partial() (sum or avg)" if partials == "keep" else ""
            raise NotImplementedError(
                f"{what} supports Replicate(), Shard(0) (batch){also} and Shard(d) on spatial dims; mesh dim "
                f"{mesh_dim} of the {name} is {p}: redistribute it first"
            )
        elif isinstance(p, Shard):
            d = p.dim % x.ndim
            if 0 < d < first_spatial and not channels:
                raise NotImplementedError(
                    f"{what} cannot shard the channel dim (Shard({d}) on mesh dim {mesh_dim}); shard the "
                    f"batch (dim 0) or a spatial dim ({first_spatial}..{x.ndim - 1}) instead"
                )
            sharded.append(mesh_dim)
            if d >= first_spatial:
                spatial.append((d, mesh_dim))
        placements.append(p)
    return SpatialLayout(x.device_mesh, tuple(placements), first_spatial, tuple(spatial), tuple(sharded))
