"""DTensor handlers for training-mode BatchNorm on a spatially sharded input.

The input is a DTensor sharded ``Shard(d)`` on a spatial dim ``d >= 2`` (the width of NCHW,
the length of NCL, ...) over one mesh dim, other mesh dims ``Replicate()`` or ``Shard(0)``
(batch); weight and bias are replicated DTensors, the running statistics replicated DTensors
or plain tensors (the same on every rank), or ``None``. The statistics are those of the
*global* batch, exactly as a single process computes them:

| op | reached by | the handler |
| --- | --- | --- |
| ``native_batch_norm.default``, training | ``nn.BatchNorm*d`` in train mode | global statistics, 1 ``all_gather`` |
| ``native_batch_norm.default``, eval | ``.eval()`` modules | the local kernel, no communication |
| ``native_batch_norm_backward.default``, training | autograd of the above | global sums, 1 ``all_reduce`` |
| ``native_batch_norm_backward.default``, eval | autograd of the above | the local kernel, no communication |

Installed by a ``SpatialParallel`` model that needs it, or for every op by
:func:`sharded_batch_norm` (:mod:`torch_tp.conv._registry`).

Training forward: each rank's count, mean and centred sum of squares per channel, one
``all_gather`` of them per sharded mesh dim and Chan's parallel merge in float64; each rank
normalizes its own strip and updates the running statistics in place (the same bits on every
rank). Training backward: one ``all_reduce`` of the per-channel sums of ``dy`` and
``dy * (x - mean)``, then the local elementwise formula. ``F.batch_norm`` reaches the same ops.

``out`` and ``grad_input`` keep the input's placements with the exact global shape;
``save_mean`` / ``save_invstd`` are replicated. Weight and bias gradients come back
``Partial()`` over every mesh dim the input is sharded on, as the convolution handlers'
do (:mod:`torch_tp.conv.sharded_conv`). A batch-sharded (``Shard(0)``) or replicated input
takes the same path (batch sharding gives ``SyncBatchNorm``'s global statistics); a
channel-sharded one (``Shard(1)``) raises. In eager mode on CPU with torch 2.13 these two ops
are the only batch-norm ops that reach DTensor (``_native_batch_norm_legit*`` do not;
traced with a dispatch mode for ``BatchNorm1d/2d/3d`` in both modes); on CUDA, cuDNN's
``cudnn_batch_norm`` may be chosen instead, which these handlers do not cover.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from torch_tp.conv.batch_norm import sharded_batch_norm
    >>> bn = nn.BatchNorm2d(8)                                        # train mode
    >>> bn.weight, bn.bias = (nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]))
    ...                       for p in (bn.weight, bn.bias))
    >>> x = distribute_tensor(image, mesh, [Shard(3)])                 # width-sharded NCHW
    >>> with sharded_batch_norm():
    ...     y = bn(x)                      # y.placements == (Shard(3),), statistics of the whole image
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from torch_tp.conv._core import bind, check_replicated, compute_dtype, local, merge_moments, \
    partial_where_sharded, spatial_layout, wrap
from torch_tp.conv._registry import HandlerSet

__all__ = [
    "batch_norm_backward_handler",
    "batch_norm_handler",
    "install",
    "is_installed",
    "sharded_batch_norm",
    "uninstall",
]

aten = torch.ops.aten
HANDLERS = HandlerSet("torch_tp.conv.batch_norm", serves=(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))

_FORWARD_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
_BACKWARD_ARGS = ("grad_out", "input", "weight", "running_mean", "running_var", "save_mean",
                  "save_invstd", "train", "eps", "output_mask")


# --------------------------------------------------------------------------------------------
# Layout: which mesh dims the batch statistics are spread over, validated
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The input's mesh and placements, and what the per-channel statistics reduce over."""

    mesh: Any
    placements: tuple
    sharded_mesh_dims: tuple[int, ...]  # mesh dims the input is sharded on (batch or spatial)
    reduce_dims: tuple[int, ...]  # tensor dims of one channel's values: 0, 2, 3, ...
    count: int  # values per channel in the global input

    def reduced_placements(self) -> list:
        """Placements of a per-channel sum over the local strip: ``Partial`` where sharded."""
        return partial_where_sharded(self.placements)


_WHAT = "sharded batch norm"


def _layout(x: Any, tensors: dict[str, Any]) -> _Layout:
    parsed = spatial_layout(x, _WHAT)
    for name, t in tensors.items():  # running statistics may be plain: the same on every rank
        check_replicated(t, parsed.mesh, name, _WHAT, plain_ok=name not in ("weight", "bias"))
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    return _Layout(parsed.mesh, parsed.placements, parsed.sharded_mesh_dims, (0, *range(2, x.ndim)), count)


def _channel_shape(ndim: int) -> list[int]:
    """Shape that broadcasts a per-channel vector over an (N, C, ...) tensor."""
    return [1, -1] + [1] * (ndim - 2)


def _stats_dtype(x: DTensor, weight: Any, running_mean: Any) -> torch.dtype:
    """The dtype of ``save_mean`` / ``save_invstd``: the parameters' (float32 for a bf16 input
    with float32 parameters), else the input's, as the CPU kernel returns them."""
    return next((t.dtype for t in (weight, running_mean) if t is not None), x.dtype)


# --------------------------------------------------------------------------------------------
# Statistics: count, mean and centred sum of squares per channel, merged over the ranks
# --------------------------------------------------------------------------------------------


def _local_moments(x_local: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """``[n, mean_0 .. mean_{C-1}, m2_0 .. m2_{C-1}]`` (float64) of this rank's strip.

    ``m2`` is the sum of squares about the *local* mean, so no cancellation happens here or
    in the merge; a rank with an empty strip contributes ``n = 0``.
    """
    channels = x_local.shape[1]
    n = x_local.numel() // channels if channels else 0
    row = x_local.new_zeros(1 + 2 * channels, dtype=torch.float64)
    row[0] = n
    if n:
        var, mean = torch.var_mean(x_local.to(compute_dtype(x_local.dtype)), dim=layout.reduce_dims,
                                   correction=0)
        row[1:1 + channels] = mean
        row[1 + channels:] = var.double() * n
    return row


def _global_moments(x_local: torch.Tensor, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and centred sum of squares of the global input (float64), the same
    bits on every rank: one ``all_gather`` of ``1 + 2C`` values per sharded mesh dim."""
    row = _local_moments(x_local, layout)
    for mesh_dim in layout.sharded_mesh_dims:
        rows = [torch.empty_like(row) for _ in range(layout.mesh.size(mesh_dim))]
        dist.all_gather(rows, row, group=layout.mesh.get_group(mesh_dim))
        row = merge_moments(torch.stack(rows))
    channels = (row.numel() - 1) // 2
    return row[1:1 + channels], row[1 + channels:]


def _all_reduce_sum(t: torch.Tensor, layout: _Layout) -> torch.Tensor:
    t = t.clone()
    for mesh_dim in layout.sharded_mesh_dims:
        dist.all_reduce(t, group=layout.mesh.get_group(mesh_dim))
    return t


def _update_running_stats(running_mean: Any, running_var: Any, mean: torch.Tensor, m2: torch.Tensor,
                          count: int, momentum: float) -> None:
    """``running = momentum * batch + (1 - momentum) * running`` in place (unbiased batch
    variance, ``m2 / (n - 1)`` with the global ``n``), computed in float64 as the CPU kernel does."""
    if running_mean is not None:
        rm = local(running_mean)
        rm.copy_(momentum * mean + (1 - momentum) * rm.double())
    if running_var is not None:
        rv = local(running_var)
        rv.copy_(momentum * (m2 / (count - 1)) + (1 - momentum) * rv.double())


# --------------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------------


@HANDLERS.implements(aten.native_batch_norm.default)
def batch_norm_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor handler for ``aten.native_batch_norm.default`` with a sharded input.

    ``args`` = ``(input, weight, bias, running_mean, running_var, training, momentum, eps)``.
    Returns ``(out, save_mean, save_invstd)``: ``out`` with the input's placements and global
    shape, the other two replicated (empty in eval mode, as the kernel returns them). In
    training mode the statistics are the global batch's and the running statistics are
    updated in place on every rank; in eval mode nothing is communicated.

    Raises:
        NotImplementedError: the input sharded on channels (``Shard(1)``) or ``Partial``;
            weight or bias not a replicated DTensor; a running statistic sharded.
        ValueError: a weight, bias or running statistic on another mesh.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; install() routes BatchNorm on DTensors here")
        >>> x = distribute_tensor(torch.randn(2, 3, 4, 10), mesh, [Shard(3)])    # width on 4 ranks
        >>> out, mean, invstd = batch_norm_handler(
        ...     aten.native_batch_norm.default, (x, None, None, None, None, True, 0.1, 1e-5), {})
        >>> out.placements, out.shape, out.to_local().shape, mean.placements     # rank 3 of 4
        ((Shard(dim=3),), torch.Size([2, 3, 4, 10]), torch.Size([2, 3, 4, 1]), (Replicate(),))
    """
    x, weight, bias, running_mean, running_var, training, momentum, eps = bind(args, kwargs, _FORWARD_ARGS)
    layout = _layout(x, {"weight": weight, "bias": bias, "running_mean": running_mean,
                         "running_var": running_var})
    x_local, w_local, b_local = local(x), local(weight), local(bias)
    replicated = [Replicate()] * layout.mesh.ndim
    if not training:
        out, save_mean, save_invstd = aten.native_batch_norm.default(
            x_local, w_local, b_local, local(running_mean), local(running_var), False, momentum, eps)
    else:
        mean, m2 = _global_moments(x_local, layout)
        invstd = torch.rsqrt(m2 / max(layout.count, 1) + eps)
        out = _normalize(x_local, mean, invstd, w_local, b_local)
        _update_running_stats(running_mean, running_var, mean, m2, layout.count, momentum)
        dtype = _stats_dtype(x, weight, running_mean)
        save_mean, save_invstd = mean.to(dtype), invstd.to(dtype)
    return (
        wrap(out, layout.mesh, layout.placements, x.shape),
        wrap(save_mean, layout.mesh, replicated, save_mean.shape),
        wrap(save_invstd, layout.mesh, replicated, save_invstd.shape),
    )


def _normalize(x_local: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, weight: Any,
               bias: Any) -> torch.Tensor:
    """``(x - mean) * invstd * weight + bias`` as ``x * alpha + beta``, per channel (float64
    coefficients, applied in float32 or higher)."""
    alpha = invstd if weight is None else invstd * weight.double()
    beta = -mean * alpha if bias is None else bias.double() - mean * alpha
    dtype = compute_dtype(x_local.dtype)
    shape = _channel_shape(x_local.ndim)
    out = torch.addcmul(beta.to(dtype).view(shape), x_local.to(dtype), alpha.to(dtype).view(shape))
    return out.to(x_local.dtype)


@HANDLERS.implements(aten.native_batch_norm_backward.default)
def batch_norm_backward_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor handler for ``aten.native_batch_norm_backward.default`` (the global batch's).

    ``args`` = ``(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
    train, eps, output_mask)``. Returns ``(grad_input, grad_weight, grad_bias)``: ``grad_input``
    with the input's placements, the other two ``Partial()`` over every mesh dim the input is
    sharded on (sums over the local strips); ``None`` where ``output_mask`` says so. In training
    mode with ``grad_input`` wanted, one ``all_reduce`` of ``2C`` values per sharded mesh dim.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; autograd calls it for a DTensor BatchNorm")
        >>> gi, gw, gb = batch_norm_backward_handler(
        ...     aten.native_batch_norm_backward.default,
        ...     (grad_y, x, w, None, None, mean, invstd, True, 1e-5, [True, True, True]), {})
        >>> gi.placements, gw.placements, gb.placements
        ((Shard(dim=3),), (Partial(sum),), (Partial(sum),))
    """
    (grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
     output_mask) = bind(args, kwargs, _BACKWARD_ARGS)
    layout = _layout(x, {"weight": weight, "running_mean": running_mean, "running_var": running_var,
                         "save_mean": save_mean, "save_invstd": save_invstd})
    if not isinstance(grad_out, DTensor):
        raise NotImplementedError("sharded batch norm backward needs grad_out as a DTensor")
    if tuple(grad_out.placements) != layout.placements or grad_out.device_mesh != layout.mesh:
        grad_out = grad_out.redistribute(layout.mesh, layout.placements)
    mask = list(output_mask)
    if train:
        gi, gw, gb = _train_backward(grad_out.to_local(), x.to_local(), local(weight), local(save_mean),
                                     local(save_invstd), layout, mask)
    else:
        gi, gw, gb = aten.native_batch_norm_backward.default(
            grad_out.to_local(), x.to_local(), local(weight), local(running_mean), local(running_var),
            local(save_mean), local(save_invstd), False, eps, mask)
    reduced = layout.reduced_placements()
    return (
        wrap(gi, layout.mesh, layout.placements, x.shape) if mask[0] else None,
        wrap(gw, layout.mesh, reduced, gw.shape) if mask[1] else None,
        wrap(gb, layout.mesh, reduced, gb.shape) if mask[2] else None,
    )


def _train_backward(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                    invstd: torch.Tensor, layout: _Layout, mask: list) -> tuple:
    """Local pieces of the training-mode backward; only ``grad_input`` needs the global sums.

    With ``n`` the global count, ``s = sum(dy)`` and ``p = sum(dy * (x - mean))`` per channel
    over the global batch: ``grad_input = (dy - s / n - (x - mean) * p * invstd^2 / n) *
    invstd * weight``, ``grad_weight = p * invstd`` and ``grad_bias = s`` (here over the
    local strip: ``Partial``).
    """
    dtype = compute_dtype(x.dtype)
    shape = _channel_shape(x.ndim)
    dy_c = dy.to(dtype)
    x_mu = x.to(dtype) - mean.to(dtype).view(shape)
    sums = torch.stack([dy_c.sum(layout.reduce_dims), (dy_c * x_mu).sum(layout.reduce_dims)]).double()
    invstd64 = invstd.double()
    param_dtype = weight.dtype if weight is not None else x.dtype
    gw = (sums[1] * invstd64).to(param_dtype) if mask[1] else None
    gb = sums[0].to(param_dtype) if mask[2] else None
    gi = None
    if mask[0]:
        s, p = _all_reduce_sum(sums, layout).unbind(0)
        n = max(layout.count, 1)
        scale = invstd64 if weight is None else invstd64 * weight.double()
        grad_mean, proj = s / n, p * invstd64 * invstd64 / n
        gi = ((dy_c - grad_mean.to(dtype).view(shape) - x_mu * proj.to(dtype).view(shape))
              * scale.to(dtype).view(shape)).to(x.dtype)
    return gi, gw, gb


# --------------------------------------------------------------------------------------------
# Installation
# --------------------------------------------------------------------------------------------

install, uninstall, is_installed, sharded_batch_norm = HANDLERS.public_functions("sharded_batch_norm", "batch norm")
