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
| ``native_layer_norm.default`` | ``LayerNorm2d``, ``F.layer_norm`` over C | handler: the local kernel, empty shards kept |
| ``native_layer_norm_backward.default`` | autograd of the above | handler: the local kernel, ``Partial`` weight grads |

Installed by a ``SpatialParallel`` model that needs it, or for every op by
:func:`sharded_group_norm` (:mod:`torch_tp.conv._registry`).

Forward: each rank's count, mean and centred sum of squares per (sample, group) of its
strip, one ``all_gather`` of them per spatially sharded mesh dim and Chan's parallel merge
in float64 (:func:`torch_tp.conv._core.merge_moments`, so no variance comes from a
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
the layer-norm rules refuse a sharded dim smaller than the mesh (a rank holding nothing, e.g.
height 3 on 4 ranks), so DTensor all-gathers the input and returns ``Replicate()``. The
layer-norm handlers run the local kernel whenever only dims in front of the normalized ones
are sharded (exact for any shard sizes) and leave every other layout to DTensor's rule
(:class:`~torch_tp.conv._registry.Decline`). The channels-first form needs nothing
(``mean.dim`` over C and pointwise ops).

Private torch API used: ``DTensor._op_dispatcher._custom_op_handlers`` (through the registry).

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

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from torch_tp.conv._core import bind, check_replicated, compute_dtype, local, merge_moments, \
    partial_where_sharded, spatial_layout, wrap
from torch_tp.conv._registry import Decline, HandlerSet

__all__ = [
    "group_norm_backward_handler",
    "group_norm_handler",
    "install",
    "is_installed",
    "sharded_group_norm",
    "uninstall",
]

aten = torch.ops.aten
HANDLERS = HandlerSet("torch_tp.conv.group_norm", serves=(nn.GroupNorm,))

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
        return partial_where_sharded(self.placements)


_WHAT = "sharded group norm"


def _layout(x: Any, groups: int, tensors: dict[str, Any]) -> _Layout:
    parsed = spatial_layout(x, _WHAT)
    channels = x.shape[1]
    if groups <= 0 or channels % groups:
        raise ValueError(f"{_WHAT}: {channels} channels do not split into {groups} groups")
    for name, t in tensors.items():
        _check_on_mesh(t, parsed.mesh, name)
    count = x.numel() // (x.shape[0] * groups) if x.shape[0] else 0
    return _Layout(parsed.mesh, parsed.placements, parsed.spatial_mesh_dims, parsed.sharded_mesh_dims, groups, count)


def _check_on_mesh(t: Any, mesh: Any, name: str) -> None:
    """Weight and bias: replicated DTensors (or None); mean and rstd: DTensors on the mesh."""
    if name in ("weight", "bias"):
        check_replicated(t, mesh, name, _WHAT)
    elif not isinstance(t, DTensor):
        raise NotImplementedError(
            f"{_WHAT} needs the {name} as a DTensor on the input's mesh (as the forward handler returns it), "
            f"got a plain {type(t).__name__}"
        )
    elif t.device_mesh != mesh:
        raise ValueError(f"{_WHAT}: the {name} lives on {t.device_mesh}, the input on {mesh}")


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
        grouped = x_local.reshape(samples, groups, n).to(compute_dtype(x_local.dtype))
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
        row = merge_moments(torch.stack(rows))
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


@HANDLERS.implements(aten.native_group_norm.default)
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
    x, weight, bias, _, _, _, groups, eps = bind(args, kwargs, _FORWARD_ARGS)
    layout = _layout(x, groups, {"weight": weight, "bias": bias})
    x_local = x.to_local()
    mean, m2 = _global_moments(x_local, layout)
    rstd = torch.rsqrt(m2 / max(layout.count, 1) + eps)
    out = _normalize(x_local, mean, rstd, local(weight), local(bias))
    dtype = weight.dtype if weight is not None else x.dtype
    stats = layout.stats_placements()
    stats_shape = (x.shape[0], groups)
    return (
        wrap(out, layout.mesh, layout.placements, x.shape),
        wrap(mean.to(dtype), layout.mesh, stats, stats_shape),
        wrap(rstd.to(dtype), layout.mesh, stats, stats_shape),
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
    dtype = compute_dtype(x_local.dtype)
    shape = _broadcast_shape(x_local)
    out = torch.addcmul(beta.to(dtype).view(shape), x_local.to(dtype), alpha.to(dtype).view(shape))
    return out.to(x_local.dtype)


@HANDLERS.implements(aten.native_group_norm_backward.default)
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
    grad_out, x, mean, rstd, weight, _, _, _, groups, output_mask = bind(args, kwargs, _BACKWARD_ARGS)
    layout = _layout(x, groups, {"weight": weight, "mean": mean, "rstd": rstd})
    if not isinstance(grad_out, DTensor):
        raise NotImplementedError("sharded group norm backward needs grad_out as a DTensor")
    if tuple(grad_out.placements) != layout.placements or grad_out.device_mesh != layout.mesh:
        grad_out = grad_out.redistribute(layout.mesh, layout.placements)
    stats = layout.stats_placements()
    mean, rstd = (t.redistribute(layout.mesh, stats) if list(t.placements) != stats else t for t in (mean, rstd))
    mask = list(output_mask)
    gi, gw, gb = _backward(grad_out.to_local(), x.to_local(), mean.to_local(), rstd.to_local(),
                           local(weight), layout, mask)
    reduced = layout.reduced_placements()
    channels = (x.shape[1],)
    return (
        wrap(gi, layout.mesh, layout.placements, x.shape) if mask[0] else None,
        wrap(gw, layout.mesh, reduced, channels) if mask[1] else None,
        wrap(gb, layout.mesh, reduced, channels) if mask[2] else None,
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
    dtype = compute_dtype(x.dtype)
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

# Channel LayerNorm (ConvNeXt's LayerNorm2d) normalizes over C alone, which no rank shares with
# another: each rank runs it on its strip. DTensor does too, but in torch 2.13 its layer-norm rules
# refuse a sharded dim smaller than the mesh (an empty rank) and all-gather.


def _layer_norm_layout(x: Any, axis: int, tensors: dict[str, Any]) -> Any:
    """The input's layout when only dims in front of the normalized ones are sharded, else :class:`Decline`."""
    if not isinstance(x, DTensor) or any(type(p) not in (Replicate, Shard) for p in x.placements):
        raise Decline
    if any(isinstance(p, Shard) and p.dim % x.ndim >= axis for p in x.placements):
        raise Decline
    for t in tensors.values():
        if t is not None and (not isinstance(t, DTensor) or t.device_mesh != x.device_mesh
                              or not all(isinstance(p, Replicate) for p in t.placements)):
            raise Decline
    return x.device_mesh, tuple(x.placements)


@HANDLERS.implements(aten.native_layer_norm.default)
def layer_norm_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor handler for ``aten.native_layer_norm.default`` on an input sharded in front of the
    normalized dims (a channel LayerNorm on spatial strips, some of them empty): the local kernel.

    Returns ``(out, mean, rstd)``, each with the input's placements. Any other layout goes to
    DTensor's own rule.

    Example:
        >>> # xdoctest: +SKIP("needs a process group")
        >>> x = distribute_tensor(torch.randn(2, 3, 8), mesh, [Shard(1)])     # height 3 on 4 ranks
        >>> out, mean, rstd = layer_norm_handler(aten.native_layer_norm.default, (x, [8], None, None, 1e-5), {})
        >>> out.placements, mean.shape
        ((Shard(dim=1),), torch.Size([2, 3, 1]))
    """
    x, normalized_shape, weight, bias, eps = bind(args, kwargs, ("input", "normalized_shape", "weight", "bias", "eps"))
    axis = x.ndim - len(normalized_shape)
    mesh, placements = _layer_norm_layout(x, axis, {"weight": weight, "bias": bias})
    out, mean, rstd = op_call(x.to_local(), normalized_shape, local(weight), local(bias), eps)
    stats_shape = (*x.shape[:axis], *[1] * len(normalized_shape))
    return (wrap(out, mesh, placements, x.shape), wrap(mean, mesh, placements, stats_shape),
            wrap(rstd, mesh, placements, stats_shape))


@HANDLERS.implements(aten.native_layer_norm_backward.default)
def layer_norm_backward_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor handler for ``aten.native_layer_norm_backward.default`` (the adjoint of
    :func:`layer_norm_handler`): the local kernel; weight and bias gradients ``Partial()``
    over every mesh dim the input is sharded on.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; autograd calls it")
        >>> gi, gw, gb = layer_norm_backward_handler(aten.native_layer_norm_backward.default,
        ...                                          (dy, x, [8], mean, rstd, w, b, [True, True, True]), {})
        >>> gw.placements
        (Partial(sum),)
    """
    grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask = bind(
        args, kwargs, ("grad_out", "input", "normalized_shape", "mean", "rstd", "weight", "bias", "output_mask"))
    axis = x.ndim - len(normalized_shape)
    mesh, placements = _layer_norm_layout(x, axis, {"weight": weight, "bias": bias})
    if not all(isinstance(t, DTensor) for t in (grad_out, mean, rstd)):
        raise Decline
    grad_out, mean, rstd = (t if tuple(t.placements) == placements else t.redistribute(mesh, placements)
                            for t in (grad_out, mean, rstd))
    gi, gw, gb = op_call(grad_out.to_local(), x.to_local(), normalized_shape, mean.to_local(), rstd.to_local(),
                         local(weight), local(bias), output_mask)
    reduced = partial_where_sharded(placements)
    return (wrap(gi, mesh, placements, x.shape) if gi is not None else None,
            wrap(gw, mesh, reduced, gw.shape) if gw is not None else None,
            wrap(gb, mesh, reduced, gb.shape) if gb is not None else None)


# --------------------------------------------------------------------------------------------
# Installation
# --------------------------------------------------------------------------------------------

install, uninstall, is_installed, sharded_group_norm = HANDLERS.public_functions("sharded_group_norm", "group norm")
