"""DTensor handlers for GroupNorm on a spatially sharded input, and channel LayerNorm's empty shards.

The input is a DTensor sharded ``Shard(d)`` on a spatial dim ``d >= 2`` (the width of NCHW,
the length of NCL, ...) over one or more mesh dims, other mesh dims ``Replicate()`` or
``Shard(0)`` (batch); weight and bias are replicated DTensors or ``None``. GroupNorm's
statistics are per (sample, group) over the group's channels and *all* spatial positions,
so the spatial part crosses ranks; the handlers compute them exactly as one process does:

| op | reached by | what :func:`install` puts in place |
| --- | --- | --- |
| ``native_group_norm.default`` | ``nn.GroupNorm``, ``F.group_norm`` | handler: statistics, 1 ``all_gather`` |
| ``native_group_norm_backward.default`` | autograd of the above | handler: group sums, 1 ``all_reduce`` |
| ``native_layer_norm.default`` | ``LayerNorm2d``, ``F.layer_norm`` over C | DTensor's rule, empty shards allowed |
| ``native_layer_norm_backward.default`` | autograd of the above | DTensor's rule, empty shards allowed |

Forward: each rank's count, mean and centred sum of squares per (sample, group) of its
strip, one ``all_gather`` of them per spatially sharded mesh dim and Chan's parallel merge
in float64 (:func:`torch_tp.conv.batch_norm._merge_moments`, so no variance comes from a
difference of large sums); each rank normalizes its own strip. Backward: one ``all_reduce``
of the per-(sample, group) sums of ``dy * w`` and ``dy * w * (x - mean)``, then the local
elementwise formula. A mesh dim sharding the batch needs no communication (samples are
independent): ``mean`` / ``rstd`` (shape ``(N, groups)``) come back ``Shard(0)`` on it and
``Replicate()`` elsewhere. ``out`` and ``grad_input`` keep the input's placements with the
exact global shape; weight and bias gradients come back ``Partial()`` over every mesh dim
the input is sharded on, as the convolution and batch-norm handlers' do. A channel-sharded
input (``Shard(1)``) raises. Without these handlers DTensor all-gathers the whole input,
forward and backward (its rule shards only the batch), and returns the output replicated.

Channel LayerNorm (ConvNeXt / timm ``LayerNorm2d``: ``permute(0, 2, 3, 1)`` →
``F.layer_norm(x, (C,))`` → permute back; or ``F.layer_norm`` on a channels-last tensor; or
the channels-first form written with ``x.mean(1, keepdim=True)``) normalizes over C alone,
which no rank shares with another: DTensor already runs it locally, keeps the shard through
the permutes and returns ``Partial`` weight and bias gradients. Its one gap in torch 2.13:
the layer-norm rules are registered with ``allow_uneven_sharding=False``, so a sharded dim
smaller than the mesh (a rank holding nothing, e.g. height 3 on 4 ranks) makes DTensor
all-gather the input and return ``Replicate()``. :func:`install` sets that flag on the two
layer-norm rules (the rule only shards dims in front of the normalized ones, which is
exact for any shard sizes) and :func:`uninstall` restores the original rule objects. The
channels-first form needs nothing (``mean.dim`` over C and pointwise ops).

Nothing is installed on import: use :func:`install` / :func:`uninstall` or
:func:`sharded_group_norm`, which restore exactly the entries that were there before.
Private torch APIs used: ``DTensor._op_dispatcher._custom_op_handlers`` (as the other
handlers), ``sharding_propagator.op_single_dim_strategy_funcs`` and its
``_SingleDimStrategyInfo.allow_uneven_sharding`` field, and
``torch.distributed.tensor.debug._clear_sharding_prop_cache``.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from torch_tp.conv.group_norm import sharded_group_norm
    >>> gn = nn.GroupNorm(4, 32)
    >>> gn.weight, gn.bias = (nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]))
    ...                       for p in (gn.weight, gn.bias))
    >>> x = distribute_tensor(image, mesh, [Shard(3)])                 # width-sharded NCHW
    >>> with sharded_group_norm():
    ...     y = gn(x)                      # y.placements == (Shard(3),), statistics of whole images
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torch_tp.conv._handler_table import HandlerTable
from torch_tp.conv.batch_norm import _merge_moments
from torch_tp.conv.sharded_conv import _bind, _wrap

__all__ = [
    "group_norm_backward_handler",
    "group_norm_handler",
    "install",
    "is_installed",
    "sharded_group_norm",
    "uninstall",
]

aten = torch.ops.aten

_FORWARD_ARGS = ("input", "weight", "bias", "N", "C", "HxW", "group", "eps")
_BACKWARD_ARGS = ("grad_out", "input", "mean", "rstd", "weight", "N", "C", "HxW", "group", "output_mask")


# --------------------------------------------------------------------------------------------
# Layout: which mesh dims the statistics are spread over, validated
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The input's mesh and placements, and what the per-(sample, group) statistics span."""

    mesh: Any
    placements: tuple
    spatial_mesh_dims: tuple[int, ...]  # mesh dims sharding a spatial dim: statistics merged over them
    sharded_mesh_dims: tuple[int, ...]  # mesh dims sharding anything (batch too): parameter grads Partial
    groups: int
    count: int  # values per (sample, group) in the global input

    def stats_placements(self) -> list:
        """Placements of ``mean`` / ``rstd`` ``(N, groups)``: ``Shard(0)`` where the batch is sharded."""
        return [Replicate() if i in self.spatial_mesh_dims or isinstance(p, Replicate) else Shard(0)
                for i, p in enumerate(self.placements)]

    def reduced_placements(self) -> list:
        """Placements of a per-channel sum over the local strip: ``Partial`` where sharded."""
        return [Partial() if i in self.sharded_mesh_dims else Replicate() for i in range(self.mesh.ndim)]


def _layout(x: Any, groups: int, tensors: dict[str, Any]) -> _Layout:
    if not isinstance(x, DTensor):
        raise NotImplementedError(
            f"sharded group norm needs the input as a DTensor, got a plain {type(x).__name__}"
        )
    if x.ndim < 2:
        raise NotImplementedError(f"sharded group norm needs an (N, C, ...) input, got {x.ndim} dims")
    channels = x.shape[1]
    if groups <= 0 or channels % groups:
        raise ValueError(f"sharded group norm: {channels} channels do not split into {groups} groups")
    spatial, sharded = [], []
    for mesh_dim, p in enumerate(x.placements):
        if isinstance(p, Replicate):
            continue
        if type(p) is not Shard:
            raise NotImplementedError(
                f"sharded group norm supports Replicate(), Shard(0) (batch) and Shard(d) on spatial "
                f"dims; mesh dim {mesh_dim} of the input is {p}"
            )
        d = p.dim % x.ndim
        if d == 1:
            raise NotImplementedError(
                f"sharded group norm cannot shard the channel dim (Shard(1) on mesh dim {mesh_dim}); "
                f"shard the batch (dim 0) or a spatial dim (2..{x.ndim - 1}) instead"
            )
        sharded.append(mesh_dim)
        if d >= 2:
            spatial.append(mesh_dim)
    mesh = x.device_mesh
    for name, t in tensors.items():
        _check_on_mesh(t, mesh, name)
    count = x.numel() // (x.shape[0] * groups) if x.shape[0] else 0
    return _Layout(mesh, tuple(x.placements), tuple(spatial), tuple(sharded), groups, count)


def _check_on_mesh(t: Any, mesh: Any, name: str) -> None:
    """Weight and bias: replicated DTensors (or None); mean and rstd: DTensors on the mesh."""
    if t is None:
        return
    if not isinstance(t, DTensor):
        what = "a replicated DTensor on the input's mesh (its gradient is one)" if name in ("weight", "bias") \
            else "a DTensor on the input's mesh (as the forward handler returns it)"
        raise NotImplementedError(f"sharded group norm needs the {name} as {what}, got a plain {type(t).__name__}")
    if t.device_mesh != mesh:
        raise ValueError(f"sharded group norm: the {name} lives on {t.device_mesh}, the input on {mesh}")
    if name in ("weight", "bias") and not all(isinstance(p, Replicate) for p in t.placements):
        raise NotImplementedError(
            f"sharded group norm needs a replicated {name} (all Replicate()), got {t.placements}"
        )


def _local(t: Any) -> Optional[torch.Tensor]:
    return t.to_local() if isinstance(t, DTensor) else t


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _per_channel(per_group: torch.Tensor, channels: int) -> torch.Tensor:
    """``(n, groups)`` → ``(n, channels)``: each group's value repeated over its channels."""
    n, groups = per_group.shape
    return per_group.reshape(n, groups, 1).expand(n, groups, channels // groups).reshape(n, channels)


def _broadcast_shape(x: torch.Tensor) -> list[int]:
    """Shape that broadcasts an ``(n, C)`` tensor over an ``(n, C, ...)`` one."""
    return [x.shape[0], x.shape[1]] + [1] * (x.ndim - 2)


# --------------------------------------------------------------------------------------------
# Statistics: count, mean and centred sum of squares per (sample, group), merged over ranks
# --------------------------------------------------------------------------------------------


def _local_moments(x_local: torch.Tensor, groups: int) -> torch.Tensor:
    """``[n, mean_0 .. mean_{K-1}, m2_0 .. m2_{K-1}]`` (float64, ``K = samples * groups``) of
    this rank's strip; ``n`` the values per (sample, group) here, 0 for an empty strip."""
    samples, channels = x_local.shape[:2]
    n = x_local.numel() // (samples * groups) if samples else 0
    k = samples * groups
    row = x_local.new_zeros(1 + 2 * k, dtype=torch.float64)
    row[0] = n
    if n:
        grouped = x_local.reshape(samples, groups, n).to(_compute_dtype(x_local.dtype))
        var, mean = torch.var_mean(grouped, dim=2, correction=0)
        row[1:1 + k] = mean.flatten()
        row[1 + k:] = var.double().flatten() * n
    return row


def _global_moments(x_local: torch.Tensor, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and centred sum of squares ``(samples, groups)`` (float64) over the whole spatial
    extent: one ``all_gather`` of ``1 + 2 * samples * groups`` values per spatial mesh dim."""
    row = _local_moments(x_local, layout.groups)
    for mesh_dim in layout.spatial_mesh_dims:
        rows = [torch.empty_like(row) for _ in range(layout.mesh.size(mesh_dim))]
        dist.all_gather(rows, row, group=layout.mesh.get_group(mesh_dim))
        row = _merge_moments(torch.stack(rows))
    k = (row.numel() - 1) // 2
    shape = (x_local.shape[0], layout.groups)
    return row[1:1 + k].reshape(shape), row[1 + k:].reshape(shape)


def _all_reduce_sum(t: torch.Tensor, layout: _Layout) -> torch.Tensor:
    t = t.clone()
    for mesh_dim in layout.spatial_mesh_dims:
        dist.all_reduce(t, group=layout.mesh.get_group(mesh_dim))
    return t


# --------------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------------


def group_norm_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor handler for ``aten.native_group_norm.default`` with a sharded input.

    ``args`` = ``(input, weight, bias, N, C, HxW, group, eps)`` (``N``, ``C``, ``HxW`` are the
    global sizes; the handler reads the input's). Returns ``(out, mean, rstd)``: ``out`` with the
    input's placements and global shape, ``mean`` / ``rstd`` of shape ``(N, group)``, replicated
    (``Shard(0)`` on a mesh dim that shards the batch), in the weight's dtype (else the input's)
    as the CPU kernel returns them.

    Raises:
        NotImplementedError: the input sharded on channels (``Shard(1)``) or ``Partial``; weight
            or bias not a replicated DTensor.
        ValueError: a weight or bias on another mesh; channels not divisible by ``group``.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; install() routes GroupNorm on DTensors here")
        >>> x = distribute_tensor(torch.randn(2, 6, 4, 10), mesh, [Shard(3)])    # width on 4 ranks
        >>> out, mean, rstd = group_norm_handler(
        ...     aten.native_group_norm.default, (x, None, None, 2, 6, 40, 3, 1e-5), {})
        >>> out.placements, out.to_local().shape, mean.shape, mean.placements  # rank 3 of 4
        ((Shard(dim=3),), torch.Size([2, 6, 4, 1]), torch.Size([2, 3]), (Replicate(),))
    """
    x, weight, bias, _, _, _, groups, eps = _bind(args, kwargs, _FORWARD_ARGS)
    layout = _layout(x, groups, {"weight": weight, "bias": bias})
    x_local = x.to_local()
    mean, m2 = _global_moments(x_local, layout)
    rstd = torch.rsqrt(m2 / max(layout.count, 1) + eps)
    out = _normalize(x_local, mean, rstd, _local(weight), _local(bias))
    dtype = weight.dtype if weight is not None else x.dtype
    stats = layout.stats_placements()
    stats_shape = (x.shape[0], groups)
    return (
        _wrap(out, layout.mesh, layout.placements, x.shape),
        _wrap(mean.to(dtype), layout.mesh, stats, stats_shape),
        _wrap(rstd.to(dtype), layout.mesh, stats, stats_shape),
    )


def _normalize(x_local: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: Any,
               bias: Any) -> torch.Tensor:
    """``(x - mean) * rstd * weight + bias`` as ``x * alpha + beta`` with per-(sample, channel)
    float64 coefficients, applied in float32 or higher."""
    channels = x_local.shape[1]
    alpha = _per_channel(rstd, channels)
    if weight is not None:
        alpha = alpha * weight.double()
    beta = -_per_channel(mean, channels) * alpha
    if bias is not None:
        beta = beta + bias.double()
    dtype = _compute_dtype(x_local.dtype)
    shape = _broadcast_shape(x_local)
    out = torch.addcmul(beta.to(dtype).view(shape), x_local.to(dtype), alpha.to(dtype).view(shape))
    return out.to(x_local.dtype)


def group_norm_backward_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor handler for ``aten.native_group_norm_backward.default`` (whole-image statistics).

    ``args`` = ``(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask)``. Returns
    ``(grad_input, grad_weight, grad_bias)``: ``grad_input`` with the input's placements, the
    other two ``Partial()`` over every mesh dim the input is sharded on (sums over the local
    strips); ``None`` where ``output_mask`` says so. With ``grad_input`` wanted, one
    ``all_reduce`` of ``2 * samples * group`` values per spatially sharded mesh dim.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; autograd calls it for a DTensor GroupNorm")
        >>> gi, gw, gb = group_norm_backward_handler(
        ...     aten.native_group_norm_backward.default,
        ...     (grad_y, x, mean, rstd, w, 2, 6, 40, 3, [True, True, True]), {})
        >>> gi.placements, gw.placements, gb.placements
        ((Shard(dim=3),), (Partial(sum),), (Partial(sum),))
    """
    grad_out, x, mean, rstd, weight, _, _, _, groups, output_mask = _bind(args, kwargs, _BACKWARD_ARGS)
    layout = _layout(x, groups, {"weight": weight, "mean": mean, "rstd": rstd})
    if not isinstance(grad_out, DTensor):
        raise NotImplementedError("sharded group norm backward needs grad_out as a DTensor")
    if tuple(grad_out.placements) != layout.placements or grad_out.device_mesh != layout.mesh:
        grad_out = grad_out.redistribute(layout.mesh, layout.placements)
    stats = layout.stats_placements()
    mean, rstd = (t.redistribute(layout.mesh, stats) if list(t.placements) != stats else t for t in (mean, rstd))
    mask = list(output_mask)
    gi, gw, gb = _backward(grad_out.to_local(), x.to_local(), mean.to_local(), rstd.to_local(),
                           _local(weight), layout, mask)
    reduced = layout.reduced_placements()
    channels = (x.shape[1],)
    return (
        _wrap(gi, layout.mesh, layout.placements, x.shape) if mask[0] else None,
        _wrap(gw, layout.mesh, reduced, channels) if mask[1] else None,
        _wrap(gb, layout.mesh, reduced, channels) if mask[2] else None,
    )


def _backward(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
              weight: Optional[torch.Tensor], layout: _Layout, mask: list) -> tuple:
    """Local pieces of the backward; only ``grad_input`` needs the global sums.

    Per (sample ``n``, group ``g``) with ``M`` values, ``r = rstd`` and ``w`` the weight of each
    channel: ``s1 = sum(dy * w)``, ``s2 = sum(dy * w * (x - mean))`` over the global group, and
    ``grad_input = r * w * dy - r * s1 / M - r^3 * s2 / M * (x - mean)``; per channel
    ``grad_weight = sum_n r * sum(dy * (x - mean))`` and ``grad_bias = sum(dy)`` (here over the
    local strip: ``Partial``).
    """
    samples, channels = x.shape[:2]
    dtype = _compute_dtype(x.dtype)
    shape = _broadcast_shape(x)
    spatial = tuple(range(2, x.ndim))
    mean_c, rstd_c = _per_channel(mean.double(), channels), _per_channel(rstd.double(), channels)
    dy_c = dy.to(dtype)
    x_mu = x.to(dtype) - mean_c.to(dtype).view(shape)
    # per (sample, channel) sums over the local positions: [sum(dy), sum(dy * (x - mean))]
    sums = torch.stack([dy_c.sum(spatial) if spatial else dy_c,
                        (dy_c * x_mu).sum(spatial) if spatial else dy_c * x_mu]).double()
    param_dtype = weight.dtype if weight is not None else x.dtype
    gw = (sums[1] * rstd_c).sum(0).to(param_dtype) if mask[1] else None
    gb = sums[0].sum(0).to(param_dtype) if mask[2] else None
    gi = None
    if mask[0]:
        w = weight.double() if weight is not None else torch.ones(channels, dtype=torch.float64, device=x.device)
        per_group = (sums * w).reshape(2, samples, layout.groups, channels // layout.groups).sum(3)
        s1, s2 = _all_reduce_sum(per_group, layout).unbind(0)
        m = max(layout.count, 1)
        r = rstd.double()
        scale = rstd_c * w
        shift = _per_channel(-r * s1 / m, channels)
        proj = _per_channel(-(r ** 3) * s2 / m, channels)
        gi = (dy_c * scale.to(dtype).view(shape) + x_mu * proj.to(dtype).view(shape)
              + shift.to(dtype).view(shape)).to(x.dtype)
    return gi, gw, gb


# --------------------------------------------------------------------------------------------
# Installation
# --------------------------------------------------------------------------------------------

_TABLE = HandlerTable("torch_tp.conv.group_norm", {
    aten.native_group_norm.default: group_norm_handler,
    aten.native_group_norm_backward.default: group_norm_backward_handler,
})
_UNEVEN_LAYER_NORM_OPS = (aten.native_layer_norm.default, aten.native_layer_norm_backward.default)
_SAVED_RULES: list[dict] = []  # one entry per install(): the layer-norm strategy infos it replaced


def _strategies() -> dict:
    return DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs


def _clear_sharding_caches() -> None:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def _layer_norm_allows_empty_shards() -> bool:
    rules = _strategies()  # an op without a single-dim rule (another torch) has nothing to allow
    return all(getattr(rules.get(op), "allow_uneven_sharding", True) for op in _UNEVEN_LAYER_NORM_OPS)


def install() -> None:
    """Put the sharded group-norm handlers into DTensor's custom op handler table and let
    DTensor's layer-norm rules keep shards that are empty on some ranks.

    Nests: each :func:`install` remembers the entries it replaced, and the matching
    :func:`uninstall` puts exactly those back.

    Example:
        >>> from torch_tp.conv import group_norm
        >>> group_norm.install()
        >>> group_norm.is_installed()
        True
        >>> group_norm.uninstall()
        >>> group_norm.is_installed()
        False
    """
    _TABLE.install()
    strategies = _strategies()
    _SAVED_RULES.append({op: strategies[op] for op in _UNEVEN_LAYER_NORM_OPS if op in strategies})
    for op in _UNEVEN_LAYER_NORM_OPS:
        info = strategies.get(op)
        if info is not None and not info.allow_uneven_sharding:
            strategies[op] = dataclasses.replace(info, allow_uneven_sharding=True)
    _clear_sharding_caches()


def uninstall() -> None:
    """Restore the entries the latest :func:`install` replaced (the identical objects).

    Raises:
        RuntimeError: no :func:`install` is outstanding.

    Example:
        >>> import torch
        >>> from torch.distributed.tensor import DTensor
        >>> from torch_tp.conv import group_norm
        >>> rules = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs
        >>> op = torch.ops.aten.native_layer_norm.default
        >>> before = rules[op]
        >>> group_norm.install(); group_norm.uninstall()
        >>> rules[op] is before
        True
    """
    _TABLE.uninstall()
    _strategies().update(_SAVED_RULES.pop())
    _clear_sharding_caches()


def is_installed() -> bool:
    """Whether DTensor's table maps both group-norm ops to these handlers (and the layer-norm
    rules accept empty shards).

    Example:
        >>> from torch_tp.conv.group_norm import is_installed, sharded_group_norm
        >>> with sharded_group_norm():
        ...     print(is_installed())
        True
        >>> is_installed()
        False
    """
    return _TABLE.is_installed() and _layer_norm_allows_empty_shards()


@contextlib.contextmanager
def sharded_group_norm() -> Iterator[None]:
    """Context manager: :func:`install` on entry, :func:`uninstall` on exit (also on exceptions).

    Example:
        >>> from torch_tp.conv.group_norm import is_installed, sharded_group_norm
        >>> try:
        ...     with sharded_group_norm():
        ...         raise KeyError("boom")
        ... except KeyError:
        ...     pass
        >>> is_installed()
        False
    """
    install()
    try:
        yield
    finally:
        uninstall()
