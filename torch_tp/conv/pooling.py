"""DTensor handlers for max and average pooling on a spatially sharded input (halo exchange).

The input is a DTensor sharded ``Shard(d)`` on one spatial dim over one mesh dim; other mesh
dims may be ``Replicate()``, ``Shard`` on batch or channels, or ``Partial`` (reduced first).
A pooling window is a convolution window, so each rank receives exactly the border slices its
outputs read (with stride > kernel or dilation, only the columns a window covers), laid out as :func:`~torch_tp.conv.conv_windows` lays them out (plus the outputs
``ceil_mode`` adds), pools locally with padding 0 on ``d`` and keeps its ``torch.chunk`` piece
of the output: a true ``Shard(d)`` of the global output, uneven and empty strips included.
The backward sends the halo gradients back to their owners (the exact adjoint).

| op | reached by | the handler |
| --- | --- | --- |
| ``max_pool{2,3}d_with_indices`` | ``nn.MaxPool1d/2d/3d`` | halo exchange, ``-inf`` past the edges |
| ``max_pool{2,3}d_with_indices_backward`` | autograd of the above | local kernel, adjoint exchange |
| ``avg_pool{2,3}d`` | ``nn.AvgPool1d/2d/3d``, ``nn.LPPool*d`` | halo exchange, the edges' divisors |
| ``avg_pool{2,3}d_backward`` | autograd of the above | local kernel, adjoint exchange |
| ``adaptive_max_pool{2,3}d`` | ``nn.AdaptiveMaxPool1d/2d/3d`` | size 1 on ``d``: 1 ``all_gather`` |
| ``adaptive_max_pool{2,3}d_backward`` | autograd of the above | to the argmax's owner, no messages |
| ``max_pool{1,2,3}d``, ``*_pool1d*`` | the modules in ``torch.inference_mode`` | decomposed into the above |

Installed by a ``SpatialParallel`` model that needs it, or for every op by :func:`sharded_pooling`
(:mod:`torch_tp.conv._registry`).

With autograd on, the 1d pools reach the 2d ops through ``unsqueeze(-2)`` (``Shard(2)`` of
``(N, C, L)`` becomes ``Shard(3)`` of ``(N, C, 1, L)``); under ``torch.inference_mode`` the
composite ops of the last row (``max_pool1d_with_indices``, ``avg_pool1d``,
``adaptive_max_pool1d`` too) reach DTensor whole, which would gather the input, so they are
decomposed here (traced with a dispatch mode, CPU, torch 2.13). At the global edges max
pooling pads with ``-inf`` and average pooling divides by one process's count
(``count_include_pad`` counts the padding but not what ``ceil_mode`` adds past it;
``divisor_override`` as is); interior halos are real data. The edge averages are the local
kernel's rescaled, so they agree with one process's within a rounding (the rest bit for bit);
a max window whose real values are all ``-inf`` may pick a padding position (its gradient is
then dropped, where one process gives it to the window's first real element).

**Indices** (``return_indices=True``, and what the backward reads) index the *global* input
plane, as one process's do: the sharded indices are the ``torch.chunk`` piece of the
single-process indices. ``nn.MaxUnpool*d`` on a sharded input is not supported.

**Global pooling**: ``adaptive_max_pool*d`` with output size 1 on ``d`` takes each strip's
maxima (bins on the other dims as usual) and one ``all_gather`` picks the global ones (ties:
the lowest global index, as one process's scan); a larger size on ``d`` gathers the input.
Either output is ``Replicate()`` on that mesh dim. Average pooling to size 1
(``nn.AdaptiveAvgPool*d(1)``, ``x.mean((2, 3))``) reaches ``aten.mean.dim``, which
:mod:`torch_tp.conv.global_mean` reduces without a gather on even and uneven strips alike;
other adaptive averages (``_adaptive_avg_pool*d``) are left to DTensor, which gathers the
input for them.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from torch_tp.conv.pooling import sharded_pooling
    >>> x = distribute_tensor(image, mesh, [Shard(3)])                 # width-sharded NCHW
    >>> with sharded_pooling():
    ...     y = nn.MaxPool2d(3, stride=2, padding=1)(x)                 # y.placements == (Shard(3),)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from torch_tp._layouts import shard_bounds
from torch_tp.conv._core import bind, expand, spatial_layout, without_partials, wrap
from torch_tp.conv._geometry import ShardWindow, _chunk_windows
from torch_tp.conv._halo_exchange import exchange_backward, exchange_forward, picks_of, resolve_neighbours
from torch_tp.conv._registry import HandlerSet

__all__ = [
    "adaptive_max_pool_backward_handler",
    "adaptive_max_pool_handler",
    "avg_pool_backward_handler",
    "avg_pool_handler",
    "install",
    "is_installed",
    "max_pool_backward_handler",
    "max_pool_handler",
    "sharded_pooling",
    "uninstall",
]

aten = torch.ops.aten
HANDLERS = HandlerSet("torch_tp.conv.pooling")

_MAX_ARGS = ("self", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
_MAX_BACKWARD_ARGS = ("grad_output", "self", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
                      "indices")
_AVG_ARGS = ("self", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
_AVG_BACKWARD_ARGS = ("grad_output",) + _AVG_ARGS


# --------------------------------------------------------------------------------------------
# Layout and geometry
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Where the input is sharded and, for a windowed pool, this rank's window on that dim."""

    mesh: Any
    placements: tuple  # the input's, Partial replaced by Replicate
    spatial_dim: Optional[int]  # the sharded spatial tensor dim, or None
    mesh_dim: Optional[int]
    first_spatial: int  # tensor dim of the first spatial dim (1 unbatched, 2 batched)
    window: Optional[ShardWindow] = None
    padding: Optional[list[int]] = None  # the op's padding, 0 on the sharded dim

    @property
    def index(self) -> int:
        """Position of the sharded dim among the spatial dims (its kernel_size entry)."""
        return self.spatial_dim - self.first_spatial

    def gathered(self) -> list:
        """Placements with the sharded mesh dim replicated (a global pool's output)."""
        return [Replicate() if i == self.mesh_dim else p for i, p in enumerate(self.placements)]


def _op(op_call: Any) -> tuple[int, str]:
    """``(spatial dims, name)`` of a 2d / 3d pooling op: ``(2, "max_pool2d_with_indices")``."""
    name = op_call.__name__.split(".")[0]
    return (3 if "3d" in name else 2), name


def _layout(x: Any, n_spatial: int, what: str) -> _Plan:
    if isinstance(x, DTensor) and x.ndim - n_spatial not in (1, 2):
        raise NotImplementedError(f"sharded {what} needs a (C, ...) or (N, C, ...) input, got {x.ndim} dims")
    first = x.ndim - n_spatial if isinstance(x, DTensor) else 2
    parsed = spatial_layout(x, f"sharded {what}", first_spatial=first, channels=True, partials="reduce")
    d, mesh_dim = parsed.one_spatial_dim(f"sharded {what}")
    return _Plan(parsed.mesh, parsed.placements, d, mesh_dim, first)


def _pool_params(n: int, kernel: Any, stride: Any, padding: Any, dilation: Any, what: str) -> tuple:
    """``(kernel, stride, padding, dilation)`` as lists of ``n``, with the schema's defaults."""
    kernel = expand(kernel, n, "kernel_size", f"sharded {what}")
    stride = expand(stride, n, "stride", f"sharded {what}") if stride else list(kernel)  # [] means the kernel
    padding = expand(0 if padding is None else padding, n, "padding", f"sharded {what}")
    return kernel, stride, padding, expand(1 if dilation is None else dilation, n, "dilation", f"sharded {what}")


def _pool_windows(in_size: int, num_ranks: int, out_total: int, *, kernel_size: int, stride: int,
                  padding: int, dilation: int) -> list[ShardWindow]:
    """:func:`~torch_tp.conv.conv_windows` for ``out_total`` outputs (``ceil_mode`` may add one
    whose window runs past the right padding; that part becomes ``pad_right``)."""
    return _chunk_windows(shard_bounds(in_size, num_ranks), shard_bounds(out_total, num_ranks), stride=stride,
                          pad_l=padding, dilation=dilation, span=dilation * (kernel_size - 1))


def _windowed_plan(x: DTensor, n: int, params: tuple, out_shape: Sequence[int], what: str) -> _Plan:
    """The layout of ``x`` and, if a spatial dim is sharded, this rank's window for the global
    output ``out_shape`` (so ``ceil_mode``'s extra outputs are included)."""
    plan = _layout(x, n, what)
    if plan.spatial_dim is None:
        return plan
    kernel, stride, padding, dilation = params
    i, d, mesh = plan.index, plan.spatial_dim, plan.mesh
    try:
        windows = _pool_windows(x.shape[d], mesh.size(plan.mesh_dim), out_shape[d], kernel_size=kernel[i],
                                stride=stride[i], padding=padding[i], dilation=dilation[i])
    except ValueError as err:
        raise ValueError(f"sharded {what} along dim {d}: {err}") from None
    local_padding = list(padding)
    local_padding[i] = 0
    return dataclasses.replace(plan, window=windows[mesh.get_local_rank(plan.mesh_dim)], padding=local_padding)


# --------------------------------------------------------------------------------------------
# The local input (exchanged strip, trimmed, edge-padded) and the adjoint
# --------------------------------------------------------------------------------------------


def _neighbours(plan: _Plan) -> tuple:
    w = plan.window
    nb = resolve_neighbours(None, plan.mesh, plan.mesh_dim)
    return (plan.spatial_dim, *w.hops, nb)


def _local_input(x_local: torch.Tensor, plan: _Plan, fill: float) -> torch.Tensor:
    """``pad(strip[trim_left : strip_size - trim_right], (pad_left, pad_right), fill)`` along d."""
    w, d = plan.window, plan.spatial_dim
    strip = exchange_forward(x_local, *_neighbours(plan), picks=picks_of(w))  # every rank exchanges
    kept = strip.narrow(d, w.trim_left, w.strip_size - w.trim_left - w.trim_right)
    if w.pad_left == 0 and w.pad_right == 0:
        return kept
    return F.pad(kept, [0, 0] * (kept.ndim - 1 - d) + [w.pad_left, w.pad_right], value=fill)


def _strip_grad_to_shard(g_local: torch.Tensor, plan: _Plan, n: int) -> torch.Tensor:
    """Undo pad and trim (zero-filling the trimmed slices), then the adjoint halo exchange."""
    w, d = plan.window, plan.spatial_dim
    kept = g_local.narrow(d, w.pad_left, w.local_size - w.pad_left - w.pad_right)
    shape = list(g_local.shape)
    shape[d] = w.strip_size
    strip = g_local.new_zeros(shape)
    strip.narrow(d, w.trim_left, kept.shape[d]).copy_(kept)
    return exchange_backward(strip, *_neighbours(plan), n, picks=picks_of(w))


def _with_size(shape: Sequence[int], d: int, size: int) -> list[int]:
    shape = list(shape)
    shape[d] = size
    return shape


def _lowest(dtype: torch.dtype) -> float:
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _move_indices(idx: torch.Tensor, inner: int, size_from: int, size_to: int, offset: int) -> torch.Tensor:
    """Flat plane indices over a plane with ``size_from`` positions on the sharded dim (``inner``
    elements per position) to one with ``size_to``, the position shifted by ``offset``."""
    pos, rest = idx.div(inner, rounding_mode="floor"), idx.remainder(inner)
    outer, pos = pos.div(size_from, rounding_mode="floor"), pos.remainder(size_from)
    return (outer * size_to + pos + offset) * inner + rest


def _redistributed(t: Any, plan: _Plan, placements: Sequence[Any], what: str) -> torch.Tensor:
    """The local tensor of ``t`` (a DTensor on the plan's mesh) with ``placements``."""
    if not isinstance(t, DTensor):
        raise NotImplementedError(f"sharded {what} backward needs its tensors as DTensors, got a plain one")
    if tuple(t.placements) != tuple(placements) or t.device_mesh != plan.mesh:
        t = t.redistribute(plan.mesh, placements)
    return t.to_local()


# --------------------------------------------------------------------------------------------
# Windowed pooling: the forward and backward skeletons, then max and average
# --------------------------------------------------------------------------------------------


def _windowed_forward(x: Any, n: int, what: str, params: tuple, run: Any, fill: float) -> tuple:
    """``(plan, global out shape, run(local input, padding) or None)``: ``None`` for a rank
    that owns no output (it still exchanges); ``run`` calls the op with its other arguments."""
    x = without_partials(x)  # pooling is per element: reduce partial sums first
    meta = run(torch.empty(x.shape, dtype=x.dtype, device="meta"), params[2])  # torch's checks
    out_shape = (meta[0] if isinstance(meta, tuple) else meta).shape
    plan = _windowed_plan(x, n, params, out_shape, what)
    if plan.spatial_dim is None:
        return plan, out_shape, run(x.to_local(), params[2])
    local_in = _local_input(x.to_local(), plan, fill)  # every rank exchanges, outputs or not
    return plan, out_shape, run(local_in, plan.padding) if plan.window.out_size else None


def _empty_outputs(x: DTensor, plan: _Plan, out_shape: Sequence[int]) -> torch.Tensor:
    """The output strip of a rank that owns no output (size 0 on the sharded dim)."""
    x_local = x.to_local()
    shape = list(x_local.shape[:plan.first_spatial]) + list(out_shape[plan.first_spatial:])
    return x_local.new_zeros(_with_size(shape, plan.spatial_dim, 0))


def _windowed_backward(grad_out: Any, x: DTensor, n: int, what: str, params: tuple, run: Any) -> DTensor:
    """``grad_input``: ``run(grad, zeros of the local input, padding, plan)`` is the op's local
    backward (only the input's shape is read: no forward exchange is repeated), followed on a
    sharded dim by the adjoint of trim, pad and exchange."""
    plan = _windowed_plan(x, n, params, grad_out.shape, what)
    go, x_local = _redistributed(grad_out, plan, plan.placements, what), x.to_local()
    if plan.spatial_dim is None:
        return wrap(run(go, x_local, params[2], plan), plan.mesh, plan.placements, x.shape)
    d, w = plan.spatial_dim, plan.window
    g_local = x_local.new_zeros(_with_size(x_local.shape, d, w.local_size))
    if w.out_size:
        g_local = run(go, g_local, plan.padding, plan)
    gi = _strip_grad_to_shard(g_local, plan, x_local.shape[d])
    return wrap(gi, plan.mesh, plan.placements, x.shape)


@HANDLERS.implements(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
def max_pool_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor handler for ``aten.max_pool{2,3}d_with_indices.default`` with a spatially sharded input.

    ``args`` = ``(input, kernel_size, stride, padding, dilation, ceil_mode)``. Returns
    ``(out, indices)`` with the input's placements (``Partial`` reduced first) and the global
    shape; ``indices`` index the global input plane, as one process's do.

    Raises:
        NotImplementedError: sharded on more than one spatial dim, an unsupported placement.
        RuntimeError: what torch itself refuses (e.g. padding above half the kernel).

    Example:
        >>> # xdoctest: +SKIP("needs a process group; install() routes max pooling on DTensors here")
        >>> x = distribute_tensor(torch.randn(2, 3, 8, 11), mesh, [Shard(3)])   # width on 4 ranks
        >>> out, idx = max_pool_handler(aten.max_pool2d_with_indices.default, (x, [3, 3], [2, 2], [1, 1]), {})
        >>> out.placements, out.shape, out.to_local().shape                       # rank 3 of 4
        ((Shard(dim=3),), torch.Size([2, 3, 4, 6]), torch.Size([2, 3, 4, 0]))
    """
    x, kernel, stride, padding, dilation, ceil_mode = bind(args, kwargs, _MAX_ARGS)
    n, what = _op(op_call)
    params = _pool_params(n, kernel, stride, padding, dilation, what)
    run = lambda t, pads: op_call(t, params[0], params[1], pads, params[3], bool(ceil_mode))  # noqa: E731
    plan, out_shape, result = _windowed_forward(x, n, what, params, run, _lowest(x.dtype))
    if plan.spatial_dim is None:
        out, idx = result
    elif result is None:
        out = _empty_outputs(x, plan, out_shape)
        idx = out.to(torch.long)
    else:
        d, w = plan.spatial_dim, plan.window
        out, idx = result
        idx = _move_indices(idx, math.prod(x.shape[d + 1:]), w.local_size, x.shape[d], w.need_start)
    return wrap(out, plan.mesh, plan.placements, out_shape), wrap(idx, plan.mesh, plan.placements, out_shape)


@HANDLERS.implements(aten.max_pool2d_with_indices_backward.default, aten.max_pool3d_with_indices_backward.default)
def max_pool_backward_handler(op_call: Any, args: tuple, kwargs: dict) -> DTensor:
    """DTensor handler for ``aten.max_pool{2,3}d_with_indices_backward.default`` (the adjoint).

    ``args`` = ``(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode,
    indices)``, ``indices`` global as :func:`max_pool_handler` returns them: each rank maps
    them to its exchanged strip, scatters its output gradients there and sends the halo part
    back to its owner. Returns ``grad_input`` with the input's placements.
    """
    grad_out, x, kernel, stride, padding, dilation, ceil_mode, indices = bind(args, kwargs, _MAX_BACKWARD_ARGS)
    n, what = _op(op_call)
    params = _pool_params(n, kernel, stride, padding, dilation, what)

    def run(go: torch.Tensor, local_in: torch.Tensor, pads: list, plan: _Plan) -> torch.Tensor:
        idx = _redistributed(indices, plan, plan.placements, what)
        if plan.spatial_dim is not None:
            d, w = plan.spatial_dim, plan.window
            idx = _move_indices(idx, math.prod(x.shape[d + 1:]), x.shape[d], w.local_size, -w.need_start)
        return op_call(go, local_in, params[0], params[1], pads, params[3], ceil_mode, idx)

    return _windowed_backward(grad_out, x, n, what, params, run)


def _edge_scale(plan: _Plan, params: tuple, in_size: int, count_include_pad: bool, divisor_override: Any,
                like: torch.Tensor) -> Optional[torch.Tensor]:
    """Per owned output along d, ``kernel / the global divisor's factor on d`` (``None``: all 1).

    The local pool sees every owned window whole, so its factor on d is the kernel size; one
    process's is ``min(start + k, L + p) - start`` with ``count_include_pad``, else the real
    positions ``min(start + k, L) - max(start, 0)``. The divisor is a product over the spatial
    dims, so the other dims' factors need nothing.
    """
    if divisor_override:
        return None
    i, w = plan.index, plan.window
    k, s, p = params[0][i], params[1][i], params[2][i]
    starts = [j * s - p for j in range(w.out_start, w.out_stop)]
    factors = [min(a + k, in_size + p) - a if count_include_pad else min(a + k, in_size) - max(a, 0)
               for a in starts]
    if all(f == k for f in factors):
        return None
    if not like.dtype.is_floating_point:
        raise NotImplementedError(f"sharded average pooling of {like.dtype} needs a floating dtype at the borders")
    scale = torch.tensor([k / f for f in factors], dtype=torch.float64, device=like.device).to(like.dtype)
    return scale.view(_with_size([1] * like.ndim, plan.spatial_dim, -1))


@HANDLERS.implements(aten.avg_pool2d.default, aten.avg_pool3d.default)
def avg_pool_handler(op_call: Any, args: tuple, kwargs: dict) -> DTensor:
    """DTensor handler for ``aten.avg_pool{2,3}d.default`` with a spatially sharded input.

    ``args`` = ``(input, kernel_size, stride, padding, ceil_mode, count_include_pad,
    divisor_override)``. Returns the output with the input's placements and global shape, the
    outputs at the global edges divided as one process divides them. Raises as
    :func:`max_pool_handler` does.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; install() routes average pooling on DTensors here")
        >>> x = distribute_tensor(torch.randn(2, 3, 8, 10), mesh, [Shard(3)])   # width on 4 ranks
        >>> y = avg_pool_handler(aten.avg_pool2d.default, (x, [3, 3], [2, 2], [1, 1], True, False), {})
        >>> y.placements, y.shape, y.to_local().shape                             # rank 3 of 4
        ((Shard(dim=3),), torch.Size([2, 3, 5, 6]), torch.Size([2, 3, 5, 0]))
    """
    x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override = bind(args, kwargs, _AVG_ARGS)
    n, what = _op(op_call)
    params = _pool_params(n, kernel, stride, padding, 1, what)
    include_pad = True if count_include_pad is None else bool(count_include_pad)
    rest = (bool(ceil_mode), include_pad, divisor_override)
    run = lambda t, pads: op_call(t, params[0], params[1], pads, *rest)  # noqa: E731
    plan, out_shape, out = _windowed_forward(x, n, what, params, run, 0)
    if plan.spatial_dim is not None:
        if out is None:
            out = _empty_outputs(x, plan, out_shape)
        else:
            scale = _edge_scale(plan, params, x.shape[plan.spatial_dim], include_pad, divisor_override, out)
            out = out if scale is None else out * scale
    return wrap(out, plan.mesh, plan.placements, out_shape)


@HANDLERS.implements(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)
def avg_pool_backward_handler(op_call: Any, args: tuple, kwargs: dict) -> DTensor:
    """DTensor handler for ``aten.avg_pool{2,3}d_backward.default`` (the adjoint of the forward).

    ``args`` = ``(grad_output, input, kernel_size, stride, padding, ceil_mode,
    count_include_pad, divisor_override)``. The edge outputs' gradients are rescaled as the
    forward rescaled them, spread over the exchanged strip by the local kernel and the halo
    part sent back. Returns ``grad_input`` with the input's placements.
    """
    grad_out, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override = bind(
        args, kwargs, _AVG_BACKWARD_ARGS)
    n, what = _op(op_call)
    params = _pool_params(n, kernel, stride, padding, 1, what)

    def run(go: torch.Tensor, local_in: torch.Tensor, pads: list, plan: _Plan) -> torch.Tensor:
        if plan.spatial_dim is not None:
            scale = _edge_scale(plan, params, x.shape[plan.spatial_dim], count_include_pad, divisor_override, go)
            go = go if scale is None else go * scale
        return op_call(go, local_in, params[0], params[1], pads, ceil_mode, count_include_pad, divisor_override)

    return _windowed_backward(grad_out, x, n, what, params, run)


# --------------------------------------------------------------------------------------------
# Adaptive max pooling (global max pooling)
# --------------------------------------------------------------------------------------------


def _global_max(op_call: Any, x_local: torch.Tensor, output_size: list[int], plan: _Plan,
                in_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each strip's maximum per bin, then the global one by one ``all_gather`` of
    ``(value, global index)`` pairs (in float64: exact for every float dtype and for indices
    below 2**53). Ties go to the lowest global index and NaN wins (the last NaN), as in one
    process's scan; an empty strip offers ``-inf`` at index ``+inf``."""
    d, mesh = plan.spatial_dim, plan.mesh
    shape = list(x_local.shape[:plan.first_spatial]) + output_size
    if x_local.shape[d] == 0:
        pair = torch.stack([x_local.new_full(shape, -math.inf, dtype=torch.float64),
                            x_local.new_full(shape, math.inf, dtype=torch.float64)])
    else:
        vals, idx = op_call(x_local, output_size)
        start = shard_bounds(in_size, mesh.size(plan.mesh_dim))[mesh.get_local_rank(plan.mesh_dim)][0]
        idx = _move_indices(idx, math.prod(x_local.shape[d + 1:]), x_local.shape[d], in_size, start)
        pair = torch.stack([vals.double(), idx.double()])
    pairs = [torch.empty_like(pair) for _ in range(mesh.size(plan.mesh_dim))]
    dist.all_gather(pairs, pair.contiguous(), group=mesh.get_group(plan.mesh_dim))
    vals, idx = torch.stack(pairs, dim=1).unbind(0)  # (ranks, *shape) each
    best, nan = vals.amax(0), vals.isnan()
    first = torch.where(vals == best, idx, math.inf).amin(0)
    last_nan = torch.where(nan, idx, -math.inf).amax(0)
    return best.to(x_local.dtype), torch.where(nan.any(0), last_nan, first).long()


@HANDLERS.implements(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor handler for ``aten.adaptive_max_pool{2,3}d.default`` with a spatially sharded input.

    ``args`` = ``(input, output_size)``. Output size 1 on the sharded dim (global max pooling,
    ``nn.AdaptiveMaxPool2d(1)``): each rank pools its strip and one ``all_gather`` of the
    per-bin maxima picks the global ones. A larger size on that dim gathers the input first.
    Returns ``(out, indices)``, ``Replicate()`` on the sharded mesh dim (other mesh dims as the
    input's), ``indices`` into the global input plane.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; install() routes adaptive max pooling here")
        >>> x = distribute_tensor(torch.randn(2, 3, 8, 10), mesh, [Shard(3)])
        >>> out, idx = adaptive_max_pool_handler(aten.adaptive_max_pool2d.default, (x, [1, 1]), {})
        >>> out.placements, out.shape
        ((Replicate(),), torch.Size([2, 3, 1, 1]))
    """
    x, output_size = bind(args, kwargs, ("self", "output_size"))
    n, what = _op(op_call)
    plan = _layout(x, n, what)
    x = without_partials(x)
    output_size = expand(output_size, n, "output_size", f"sharded {what}")
    out_shape = op_call(torch.empty(x.shape, dtype=x.dtype, device="meta"), output_size)[0].shape
    if plan.spatial_dim is None:
        out, idx = op_call(x.to_local(), output_size)
        placements = plan.placements
    elif output_size[plan.index] == 1:
        out, idx = _global_max(op_call, x.to_local(), output_size, plan, x.shape[plan.spatial_dim])
        placements = plan.gathered()
    else:
        placements = plan.gathered()
        out, idx = op_call(x.redistribute(plan.mesh, placements).to_local(), output_size)
    return wrap(out, plan.mesh, placements, out_shape), wrap(idx, plan.mesh, placements, out_shape)


@HANDLERS.implements(aten.adaptive_max_pool2d_backward.default, aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool_backward_handler(op_call: Any, args: tuple, kwargs: dict) -> DTensor:
    """DTensor handler for ``aten.adaptive_max_pool{2,3}d_backward.default``.

    ``args`` = ``(grad_output, input, indices)``, both replicated on the sharded mesh dim as the
    forward returns them. Each rank adds the gradients whose (global) index falls in its own
    strip: the argmax's owner gets it, no communication. Returns ``grad_input`` with the
    input's placements.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; autograd calls it for a DTensor adaptive max pool")
        >>> gi = adaptive_max_pool_backward_handler(aten.adaptive_max_pool2d_backward.default, (gy, x, idx), {})
        >>> gi.placements
        (Shard(dim=3),)
    """
    grad_out, x, indices = bind(args, kwargs, ("grad_output", "self", "indices"))
    n, what = _op(op_call)
    plan = _layout(x, n, what)
    x_local = x.to_local()
    if plan.spatial_dim is None:
        go = _redistributed(grad_out, plan, plan.placements, what)
        gi = op_call(go, x_local, _redistributed(indices, plan, plan.placements, what))
    else:
        go = _redistributed(grad_out, plan, plan.gathered(), what)
        idx = _redistributed(indices, plan, plan.gathered(), what)
        gi = _scatter_owned(go, idx, x_local, plan, x.shape[plan.spatial_dim])
    return wrap(gi, plan.mesh, plan.placements, x.shape)


def _scatter_owned(go: torch.Tensor, idx: torch.Tensor, x_local: torch.Tensor, plan: _Plan,
                   in_size: int) -> torch.Tensor:
    """``grad_input`` of this strip: ``go`` added at the global ``idx`` that fall in it."""
    d, first = plan.spatial_dim, plan.first_spatial
    gi = x_local.new_zeros(list(x_local.shape[:first]) + [math.prod(x_local.shape[first:])])
    size = x_local.shape[d]
    if gi.numel() == 0:
        return gi.view(x_local.shape)
    start = shard_bounds(in_size, plan.mesh.size(plan.mesh_dim))[plan.mesh.get_local_rank(plan.mesh_dim)][0]
    inner = math.prod(x_local.shape[d + 1:])
    pos = idx.div(inner, rounding_mode="floor").remainder(in_size) - start
    mine = (pos >= 0) & (pos < size)
    local = _move_indices(idx, inner, in_size, size, -start)
    gi.scatter_add_(-1, torch.where(mine, local, 0).flatten(first), torch.where(mine, go, 0).flatten(first))
    return gi.view(x_local.shape)


# --------------------------------------------------------------------------------------------
# 1d ops under inference mode, and installation
# --------------------------------------------------------------------------------------------


@HANDLERS.implements(aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
                    aten.max_pool1d_with_indices.default, aten.avg_pool1d.default, aten.adaptive_max_pool1d.default)
def _decompose_handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """A 1d pooling op that reached DTensor whole (``torch.inference_mode``): run its
    decomposition (``unsqueeze(-2)`` + the 2d op), whose ops reach the handlers above."""
    return op_call.decompose(*args, **(kwargs or {}))


install, uninstall, is_installed, sharded_pooling = HANDLERS.public_functions("sharded_pooling", "pooling")
