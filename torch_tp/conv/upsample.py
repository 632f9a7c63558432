"""DTensor handlers for upsampling on a spatially sharded input.

The input is a DTensor sharded ``Shard(d)`` on one spatial dim ``d >= 2`` over one mesh dim
(other mesh dims ``Replicate()``, ``Shard(0)`` or ``Shard(1)``). The output is a true
``Shard(d)`` of the global output: rank ``r`` owns the outputs the ``torch.chunk`` rule gives
it on the *output* length, which need not line up with its input strip (uneven and empty
strips included). With :mod:`torch_tp.conv.transposed_conv`, so that U-Nets run on spatial shards:

| op | reached by | the handler |
| --- | --- | --- |
| ``upsample_nearest{1,2,3}d.default`` | ``F.interpolate`` / ``nn.Upsample``, ``mode="nearest"`` | :func:`upsample_handler` |
| ``_upsample_nearest_exact{1,2,3}d.default`` | ``mode="nearest-exact"`` | :func:`upsample_handler` |
| ``upsample_linear1d``, ``upsample_bilinear2d``, ``upsample_trilinear3d`` (``.default``) | ``mode="linear"/"bilinear"/"trilinear"`` | :func:`upsample_handler` |
| the ``*_backward.default`` of each | autograd of the above | :func:`upsample_backward_handler` |

Installed by a ``SpatialParallel`` model that needs it, or for every op by
:func:`sharded_upsampling` (:mod:`torch_tp.conv._registry`).

Only the ``.default`` overloads reach DTensor (the ``.vec`` ones decompose before it). Without
these handlers DTensor all-gathers the input for an upsample (right values, but a replicated
output and input gradient).

Along each spatial dim output ``j`` reads one input (nearest: ``floor(j * scale)``) or two
(linear: ``i0 = floor(src)``, ``i1 = i0 + 1`` with weights ``1 - t`` and ``t``, ``src`` from
``align_corners``), computed with aten's own formulas and precision. Each rank receives from
whichever ranks hold them exactly the input slices its output chunk reads
(:mod:`torch_tp.conv._ranges`), then applies the interpolation as ``index_select`` (+ lerp)
dim by dim, last dim first, as the CPU kernel nests them. The backward is the exact adjoint:
``index_add`` along each dim, then every received slice's gradient goes back to its owner and
is added there.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from torch_tp.conv.upsample import sharded_upsampling
    >>> x = distribute_tensor(image, mesh, [Shard(3)])               # width-sharded NCHW
    >>> with sharded_upsampling():
    ...     y = F.interpolate(x, scale_factor=2, mode="bilinear")    # y.placements == (Shard(3),)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor

from torch_tp._layouts import shard_bounds
from torch_tp.conv._core import bind, spatial_layout, wrap
from torch_tp.conv._ranges import _gather, _Ranges, _ranges, _scatter_add, _slices
from torch_tp.conv._registry import HandlerSet

__all__ = [
    "install",
    "is_installed",
    "sharded_upsampling",
    "uninstall",
    "upsample_backward_handler",
    "upsample_handler",
]

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------
# Upsampling: aten's source indices and weights along one dim, applied dim by dim
# --------------------------------------------------------------------------------------------

_SCALE_NAMES = {1: ("scales",), 2: ("scales_h", "scales_w"), 3: ("scales_d", "scales_h", "scales_w")}
_UPSAMPLE_OPS = {  # aten op name -> (kind, spatial dims, takes align_corners); "<name>_backward" too
    "upsample_nearest1d": ("nearest", 1, False),
    "upsample_nearest2d": ("nearest", 2, False),
    "upsample_nearest3d": ("nearest", 3, False),
    "_upsample_nearest_exact1d": ("nearest-exact", 1, False),
    "_upsample_nearest_exact2d": ("nearest-exact", 2, False),
    "_upsample_nearest_exact3d": ("nearest-exact", 3, False),
    "upsample_linear1d": ("linear", 1, True),
    "upsample_bilinear2d": ("linear", 2, True),
    "upsample_trilinear3d": ("linear", 3, True),
}
_UPSAMPLE = {getattr(aten, name).default: spec for name, spec in _UPSAMPLE_OPS.items()}
_UPSAMPLE_BACKWARD = {getattr(aten, f"{name}_backward").default: spec for name, spec in _UPSAMPLE_OPS.items()}

HANDLERS = HandlerSet("torch_tp.conv.upsample")


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale(n_in: int, n_out: int, align_corners: bool, scale: Optional[float], dtype: torch.dtype) -> torch.Tensor:
    """aten's ``area_pixel_compute_scale`` (``compute_scales_value`` without ``align_corners``)
    in ``dtype``, as a 0-d tensor."""
    if align_corners:
        if n_out <= 1:
            return torch.tensor(0, dtype=dtype)
        return torch.tensor(n_in - 1, dtype=dtype) / torch.tensor(n_out - 1, dtype=dtype)
    if scale is not None and scale > 0:
        return torch.tensor(1.0 / scale, dtype=dtype)  # the double quotient, rounded once
    return torch.tensor(n_in, dtype=dtype) / torch.tensor(n_out, dtype=dtype)


def _half_pixel(scale: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """``max(scale * (j + 0.5) - 0.5, 0)`` rounded once, as aten's CPU kernels get it from a
    fused multiply-add (exact in float64 for a float32 scale)."""
    if scale.dtype == torch.float32:
        return (scale.double() * (j.double() + 0.5) - 0.5).float().clamp_min(0)
    return (scale * (j.double() + 0.5) - 0.5).clamp_min(0)


def _nearest_index(kind: str, n_in: int, n_out: int, scale: Optional[float], dtype: torch.dtype,
                   legacy: bool) -> torch.Tensor:
    """Source index of each output for ``nearest`` / ``nearest-exact``.

    aten has two formulas that differ only in rare float64 cases: ``legacy`` is
    ``nearest_idx`` / ``nearest_exact_idx`` (a float32 scale; the backward kernels and the
    channels-last forward kernels), otherwise the generic forward kernel's (the opmath scale).
    """
    j = torch.arange(n_out)
    if legacy:
        if kind == "nearest" and n_out == n_in:
            return j
        if kind == "nearest" and n_out == 2 * n_in:
            return j // 2
        s = _scale(n_in, n_out, False, scale, torch.float32)
        real = j.float() * s if kind == "nearest" else ((j.double() + 0.5) * float(s)).float()
    else:
        s = _scale(n_in, n_out, False, scale, _opmath(dtype))
        real = (s * j.to(s.dtype)).float() if kind == "nearest" else (_half_pixel(s, j).double() + 0.5).float()
    return torch.floor(real).long().clamp_max(n_in - 1)


def _taps(kind: str, n_in: int, n_out: int, align_corners: bool, scale: Optional[float],
          dtype: torch.dtype, legacy: bool = False) -> tuple[list, list]:
    """``(indices, weights)`` of the outputs ``0 .. n_out - 1`` along one dim, as aten's CPU
    kernels compute them: one index and no weight (nearest), or ``[i0, i1]`` and ``[1 - t, t]``
    (linear; the weights in the opmath dtype, rounded through ``dtype`` as the kernel stores them)."""
    if kind != "linear":
        return [_nearest_index(kind, n_in, n_out, scale, dtype, legacy)], []
    j, op = torch.arange(n_out), _opmath(dtype)
    if n_out == n_in:
        return [j, j], [torch.ones(n_out, dtype=op), torch.zeros(n_out, dtype=op)]
    s = _scale(n_in, n_out, align_corners, scale, op)
    real = s * j.to(op) if align_corners else _half_pixel(s, j)
    i0 = torch.floor(real.float()).long().clamp_max(n_in - 1)
    t = (real - i0.to(op)).clamp(0, 1).to(dtype).to(op)
    return [i0, i0 + (i0 < n_in - 1).long()], [(1 - t).to(dtype).to(op), t]


def _legacy_nearest_forward(x: DTensor, out_spatial: Sequence[int]) -> bool:
    """Whether aten's forward takes its channels-last kernel (``nearest_idx``) for this global
    input: 2-d with channels-last memory and C > 3 or ``out_h + out_w <= 128``; 3-d with
    channels-last-3d memory and C > 3. Decided from the global shape and strides, the same on
    every rank."""
    if x.ndim not in (4, 5):
        return False
    meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    fmt = torch.channels_last if x.ndim == 4 else torch.channels_last_3d
    wide = meta.is_contiguous(memory_format=fmt) and x.shape[1] > 3
    return wide or (x.ndim == 4 and sum(out_spatial) <= 128)


def _interpolate(x: torch.Tensor, dim: int, index: list, weight: list) -> torch.Tensor:
    """Along ``dim``: ``x[index]`` (nearest) or ``w0 * x[i0] + w1 * x[i1]`` (linear)."""
    picked = [x.index_select(dim, i) for i in index]
    if not weight:
        return picked[0]
    shape = [1] * x.ndim
    shape[dim] = -1
    return weight[0].view(shape) * picked[0] + weight[1].view(shape) * picked[1]


def _interpolate_adjoint(g: torch.Tensor, dim: int, index: list, weight: list, n_in: int) -> torch.Tensor:
    """The adjoint of :func:`_interpolate`: each output's gradient added to the inputs it read."""
    out = _slices(g, dim, n_in, fill=0)
    shape = [1] * g.ndim
    shape[dim] = -1
    for k, i in enumerate(index):
        out.index_add_(dim, i, g * weight[k].view(shape) if weight else g)
    return out


@dataclasses.dataclass(frozen=True)
class _Upsample:
    """One upsample call, bound: kind, sizes and per-dim scales, and the sharded dim (if any)."""

    kind: str
    in_shape: tuple  # global, (N, C, *spatial)
    out_spatial: tuple
    align_corners: bool
    scales: tuple
    mesh: Any
    placements: tuple
    dim: Optional[int]  # tensor dim >= 2 sharded over mesh_dim, or None
    mesh_dim: Optional[int]
    legacy: bool  # nearest: aten's nearest_idx formula (see _nearest_index)

    @property
    def out_shape(self) -> list:
        return [*self.in_shape[:2], *self.out_spatial]

    def taps(self, d: int, dtype: torch.dtype) -> tuple[list, list]:
        return _taps(self.kind, self.in_shape[d], self.out_spatial[d - 2], self.align_corners,
                     self.scales[d - 2], dtype, self.legacy)

    def exchange(self, taps: tuple) -> tuple[_Ranges, tuple[int, int]]:
        """The input ranges each rank reads along the sharded dim, and this rank's outputs."""
        d, size = self.dim, self.mesh.size(self.mesh_dim)
        out_bounds = shard_bounds(self.out_spatial[d - 2], size)
        needs = []
        for a, b in out_bounds:
            reads = [i[a:b] for i in taps[0]]
            needs.append((min(int(r.min()) for r in reads), max(int(r.max()) for r in reads) + 1)
                         if b > a else (0, 0))
        rg = _ranges(self.mesh, self.mesh_dim, shard_bounds(self.in_shape[d], size), needs)
        return rg, out_bounds[rg.position]


def _upsample_call(op_call: Any, args: tuple, kwargs: dict, backward: bool) -> tuple[_Upsample, Any, list]:
    table = _UPSAMPLE_BACKWARD if backward else _UPSAMPLE
    if op_call not in table:
        raise NotImplementedError(f"sharded upsampling has no handler for {op_call}")
    kind, n, takes_ac = table[op_call]
    names = (("grad_output", "output_size", "input_size") if backward else ("input", "output_size"))
    names += (("align_corners",) if takes_ac else ()) + _SCALE_NAMES[n]
    values = bind(args, kwargs, names)
    t, out_size = values[0], [int(s) for s in values[1]]
    in_shape = tuple(values[2]) if backward else None
    rest = values[3 if backward else 2:]
    align_corners = bool(rest[0]) if takes_ac else False
    scales = tuple(rest[1:] if takes_ac else rest)
    mesh, placements, d, mesh_dim = _upsample_layout(t, n, "grad_output" if backward else "input")
    legacy = backward or (kind != "linear" and d is not None and _legacy_nearest_forward(t, out_size))
    call = _Upsample(kind, in_shape or tuple(t.shape), tuple(out_size), align_corners, scales, mesh, placements,
                     d, mesh_dim, legacy)
    return call, t, values[1:]


def _upsample_layout(t: Any, n: int, what: str) -> tuple:
    if isinstance(t, DTensor) and t.ndim != n + 2:
        raise ValueError(f"sharded upsampling: a {n}-d upsample needs a {n + 2}-dim {what}, got {t.ndim} dims")
    # upsampling is linear: the upsampled partial values (sum or avg) are the output's
    parsed = spatial_layout(t, "sharded upsampling", channels=True, partials="keep", name=what)
    d, mesh_dim = parsed.one_spatial_dim("sharded upsampling")
    return parsed.mesh, parsed.placements, d, mesh_dim


@HANDLERS.implements(*_UPSAMPLE)
def upsample_handler(op_call: Any, args: tuple, kwargs: dict) -> DTensor:
    """DTensor handler for the nearest, nearest-exact and (bi/tri)linear ``upsample_*.default`` ops.

    ``args`` = ``(input, output_size, [align_corners,] *scales)``. Returns a DTensor with the
    input's placements and the global output shape: with a spatial ``Shard(d)``, this rank's
    ``torch.chunk`` piece of the global output along ``d``, computed from exactly the input
    slices it reads (received from the ranks that hold them); otherwise the local op.

    A ``Partial`` (sum or avg) placement passes through: upsampling is linear, so the upsampled
    partial values are the output's, with no communication.

    Raises:
        NotImplementedError: a plain-tensor input, a ``Partial`` max or min, or more than one
            sharded spatial dim.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; install() routes F.interpolate here")
        >>> x = distribute_tensor(torch.randn(2, 3, 4, 10), mesh, [Shard(3)])   # width on 4 ranks
        >>> y = upsample_handler(aten.upsample_bilinear2d.default, (x, [8, 20], False, 2.0, 2.0), {})
        >>> y.placements, y.shape, y.to_local().shape                            # rank 3 of 4
        ((Shard(dim=3),), torch.Size([2, 3, 8, 20]), torch.Size([2, 3, 8, 5]))
    """
    call, x, rest = _upsample_call(op_call, args, kwargs, backward=False)
    x_local = x.to_local()
    if call.dim is None:
        out = op_call(x_local, *rest)
        return wrap(out, call.mesh, call.placements, call.out_shape)
    dtype = x_local.dtype if call.kind != "linear" else _opmath(x_local.dtype)  # the kernel's math
    taps = {d: call.taps(d, x_local.dtype) for d in range(2, x.ndim)}
    rg, (a, b) = call.exchange(taps[call.dim])
    strip = _gather(x_local, call.dim, rg).to(dtype)  # every rank exchanges, outputs or not
    lo = rg.needs[rg.position][0]
    out = strip
    for d in reversed(range(2, x.ndim)):  # the last dim innermost, as the CPU kernel nests them
        index, weight = taps[d]
        if d == call.dim:
            index, weight = [i[a:b] - lo for i in index], [w[a:b] for w in weight]
        out = _interpolate(out, d, index, weight)
    return wrap(out.to(x_local.dtype), call.mesh, call.placements, call.out_shape)


@HANDLERS.implements(*_UPSAMPLE_BACKWARD)
def upsample_backward_handler(op_call: Any, args: tuple, kwargs: dict) -> DTensor:
    """DTensor handler for the ``upsample_*_backward.default`` ops (the exact adjoint).

    ``args`` = ``(grad_output, output_size, input_size, [align_corners,] *scales)``. Returns
    ``grad_input`` with ``grad_output``'s placements and the global ``input_size``: with a
    spatial ``Shard(d)``, each rank adds its outputs' gradients to the input slices they read
    and sends the slices it received in the forward back to their holders, who add them.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; autograd calls it for a DTensor upsample")
        >>> gi = upsample_backward_handler(aten.upsample_nearest2d_backward.default,
        ...                                (grad_y, [8, 20], [2, 3, 4, 10], 2.0, 2.0), {})
        >>> gi.placements, gi.shape
        ((Shard(dim=3),), torch.Size([2, 3, 4, 10]))
    """
    call, grad_out, rest = _upsample_call(op_call, args, kwargs, backward=True)
    g_local = grad_out.to_local()
    if call.dim is None:
        local_in = [*g_local.shape[:2], *call.in_shape[2:]]
        gi = op_call(g_local, rest[0], local_in, *rest[2:])
        return wrap(gi, call.mesh, call.placements, call.in_shape)
    dtype = g_local.dtype if call.kind != "linear" else _opmath(g_local.dtype)
    taps = {d: call.taps(d, g_local.dtype) for d in range(2, grad_out.ndim)}
    rg, (a, b) = call.exchange(taps[call.dim])
    lo, hi = rg.needs[rg.position]
    g = g_local.to(dtype)
    for d in range(2, grad_out.ndim):  # the forward's dims in reverse order
        index, weight = taps[d]
        n_in = call.in_shape[d]
        if d == call.dim:
            index, weight, n_in = [i[a:b] - lo for i in index], [w[a:b] for w in weight], hi - lo
        g = _interpolate_adjoint(g, d, index, weight, n_in)
    gi = _scatter_add(g, call.dim, rg)
    return wrap(gi.to(g_local.dtype), call.mesh, call.placements, call.in_shape)


# --------------------------------------------------------------------------------------------
# Installation (the upsample ops; transposed convolution shares aten.convolution's entry)
# --------------------------------------------------------------------------------------------

install, uninstall, is_installed, sharded_upsampling = HANDLERS.public_functions("sharded_upsampling", "upsampling")
