"""DTensor handlers for upsampling and transposed convolution on a spatially sharded input.

The input is a DTensor sharded ``Shard(d)`` on one spatial dim ``d >= 2`` over one mesh dim
(other mesh dims ``Replicate()``, ``Shard(0)`` or, for upsampling, ``Shard(1)``). The output is
a true ``Shard(d)`` of the global output: rank ``r`` owns the outputs the ``torch.chunk`` rule
gives it on the *output* length, which need not line up with its input strip (uneven and empty
strips included). So that U-Nets run on spatial shards:

| op | reached by | the handler |
| --- | --- | --- |
| ``upsample_nearest{1,2,3}d.default`` | ``F.interpolate`` / ``nn.Upsample``, ``mode="nearest"`` | :func:`upsample_handler` |
| ``_upsample_nearest_exact{1,2,3}d.default`` | ``mode="nearest-exact"`` | :func:`upsample_handler` |
| ``upsample_linear1d``, ``upsample_bilinear2d``, ``upsample_trilinear3d`` (``.default``) | ``mode="linear"/"bilinear"/"trilinear"`` | :func:`upsample_handler` |
| the ``*_backward.default`` of each | autograd of the above | :func:`upsample_backward_handler` |
| ``convolution.default``, ``transposed=True`` | ``nn.ConvTranspose*d``, ``F.conv_transpose*d`` | :func:`transposed_convolution_handler` |
| ``convolution_backward.default``, ``transposed=True`` | autograd of the above | :func:`transposed_convolution_backward_handler` |

Only the ``.default`` overloads reach DTensor (the ``.vec`` ones decompose before it). Without
these handlers DTensor all-gathers the input for an upsample (right values, but a replicated
output and input gradient), and a transposed convolution fails with a shape error.

Upsampling: along each spatial dim output ``j`` reads one input (nearest: ``floor(j * scale)``)
or two (linear: ``i0 = floor(src)``, ``i1 = i0 + 1`` with weights ``1 - t`` and ``t``, ``src``
from ``align_corners``), computed with aten's own formulas and precision. Each rank receives
from whichever ranks hold them exactly the input slices its output chunk reads, then applies
the interpolation as ``index_select`` (+ lerp) dim by dim, last dim first, as the CPU kernel
nests them. The backward is the exact adjoint: ``index_add`` along each dim, then every
received slice's gradient goes back to its owner and is added there.

Transposed convolution: input ``i`` adds to outputs ``i * stride - padding + k * dilation``.
Each rank runs the local transposed convolution of its strip (padding 0 on ``d``), cuts what
falls in the padding, sends each rank the part that lands in its output chunk and sums what
it receives (the adjoint of the convolution's halo exchange), then adds the bias. The backward
gathers the gradient over the strip's reach (the forward exchange), and the local
``convolution_backward`` gives the input gradient with no further exchange. Weight and bias
gradients come back ``Partial()`` over every mesh dim the input is sharded on.

Nothing is installed on import: :func:`install` / :func:`uninstall` / :func:`sharded_upsampling`
put the upsample handlers into DTensor's custom op table and restore exactly the entries that
were there before. Transposed convolution goes through ``aten.convolution``, whose entry belongs
to :mod:`torch_tp.conv.sharded_conv`: its handler routes ``transposed=True`` calls here.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from torch_tp.conv.upsample import sharded_upsampling
    >>> x = distribute_tensor(image, mesh, [Shard(3)])               # width-sharded NCHW
    >>> with sharded_upsampling():
    ...     y = F.interpolate(x, scale_factor=2, mode="bilinear")    # y.placements == (Shard(3),)
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torch_tp._layouts import shard_bounds
from torch_tp.conv.sharded_conv import _bind, _check_replicated, _expand, _spatial_shard, _wrap

__all__ = [
    "install",
    "is_installed",
    "sharded_upsampling",
    "transposed_convolution_backward_handler",
    "transposed_convolution_handler",
    "uninstall",
    "upsample_backward_handler",
    "upsample_handler",
]

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------
# Moving exact index ranges between the ranks of one mesh dim
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ranges:
    """Who holds and who reads which global positions along the sharded dim.

    ``bounds[q]`` is the ``[start, stop)`` rank ``q`` holds (``torch.chunk`` rule), ``needs[q]``
    the ``[lo, hi)`` it reads (``lo == hi``: nothing). :func:`_gather` assembles ``needs`` from
    the holders, wherever they sit on the mesh dim; :func:`_scatter_add` is its exact adjoint.
    """

    bounds: tuple
    needs: tuple
    position: int
    group: Any
    peers: tuple  # global rank of each position


def _ranges(mesh: Any, mesh_dim: int, bounds: Sequence, needs: Sequence) -> _Ranges:
    group = mesh.get_group(mesh_dim)
    peers = tuple(dist.get_global_rank(group, q) for q in range(mesh.size(mesh_dim)))
    return _Ranges(tuple(bounds), tuple(needs), mesh.get_local_rank(mesh_dim), group, peers)


def _overlap(a: tuple, b: tuple) -> tuple[int, int]:
    return max(a[0], b[0]), min(a[1], b[1])


def _slices(like: torch.Tensor, dim: int, count: int, fill: Optional[float] = None) -> torch.Tensor:
    shape = list(like.shape)
    shape[dim] = count
    return like.new_empty(shape) if fill is None else like.new_full(shape, fill)


def _run_p2p(ops: list) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _gather(shard: torch.Tensor, dim: int, rg: _Ranges) -> torch.Tensor:
    """This rank's ``needs`` slice ``[lo, hi)`` along ``dim``, from the ranks that hold it."""
    me, (start, stop), (lo, hi) = rg.position, rg.bounds[rg.position], rg.needs[rg.position]
    assert shard.shape[dim] == stop - start, (shard.shape, dim, rg.bounds)
    strip = _slices(shard, dim, hi - lo)
    ops, received = [], []
    for q, peer in enumerate(rg.peers):
        s0, s1 = _overlap((start, stop), rg.needs[q])
        if q != me and s1 > s0:
            piece = shard.narrow(dim, s0 - start, s1 - s0).contiguous()
            ops.append(dist.P2POp(dist.isend, piece, peer=peer, group=rg.group))
        r0, r1 = _overlap(rg.bounds[q], (lo, hi))
        if r1 <= r0:
            continue
        if q == me:
            strip.narrow(dim, r0 - lo, r1 - r0).copy_(shard.narrow(dim, r0 - start, r1 - r0))
        else:
            buf = _slices(shard, dim, r1 - r0)
            ops.append(dist.P2POp(dist.irecv, buf, peer=peer, group=rg.group))
            received.append((r0, buf))
    _run_p2p(ops)
    for r0, buf in received:
        strip.narrow(dim, r0 - lo, buf.shape[dim]).copy_(buf)
    return strip


def _scatter_add(strip: torch.Tensor, dim: int, rg: _Ranges) -> torch.Tensor:
    """The adjoint of :func:`_gather`: each slice of ``strip`` (this rank's ``needs``) goes to
    its holder, and every rank returns the sum of what lands in its own ``bounds``."""
    me, (start, stop), (lo, hi) = rg.position, rg.bounds[rg.position], rg.needs[rg.position]
    assert strip.shape[dim] == hi - lo, (strip.shape, dim, rg.needs)
    out = _slices(strip, dim, stop - start, fill=0)
    ops, received = [], []
    for q, peer in enumerate(rg.peers):
        r0, r1 = _overlap(rg.bounds[q], (lo, hi))
        if r1 > r0:
            piece = strip.narrow(dim, r0 - lo, r1 - r0)
            if q == me:
                out.narrow(dim, r0 - start, r1 - r0).add_(piece)
            else:
                ops.append(dist.P2POp(dist.isend, piece.contiguous(), peer=peer, group=rg.group))
        s0, s1 = _overlap((start, stop), rg.needs[q])
        if q != me and s1 > s0:
            buf = _slices(strip, dim, s1 - s0)
            ops.append(dist.P2POp(dist.irecv, buf, peer=peer, group=rg.group))
            received.append((s0, buf))
    _run_p2p(ops)
    for s0, buf in received:
        out.narrow(dim, s0 - start, buf.shape[dim]).add_(buf)
    return out


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
    values = _bind(args, kwargs, names)
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
    if not isinstance(t, DTensor):
        raise NotImplementedError(f"sharded upsampling needs the {what} as a DTensor, got {type(t).__name__}")
    if t.ndim != n + 2:
        raise ValueError(f"sharded upsampling: a {n}-d upsample needs a {n + 2}-dim {what}, got {t.ndim} dims")
    found = []
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Replicate) or (isinstance(p, Partial) and p.reduce_op in ("sum", "avg")):
            continue  # upsampling is linear: the upsampled partial values are the output's
        if type(p) is not Shard:
            raise NotImplementedError(
                f"sharded upsampling supports Replicate(), Partial() (sum or avg) and Shard(d) "
                f"placements; mesh dim {mesh_dim} of the {what} is {type(p).__name__} ({p}): "
                f"redistribute it first"
            )
        if p.dim % t.ndim >= 2:
            found.append((p.dim % t.ndim, mesh_dim))
    if len(found) > 1:
        raise NotImplementedError(
            f"sharded upsampling supports one spatial dim sharded over one mesh dim, got {t.placements} "
            f"((tensor dim, mesh dim) = {found})"
        )
    d, mesh_dim = found[0] if found else (None, None)
    return t.device_mesh, tuple(t.placements), d, mesh_dim


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
        return _wrap(out, call.mesh, call.placements, call.out_shape)
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
    return _wrap(out.to(x_local.dtype), call.mesh, call.placements, call.out_shape)


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
        return _wrap(gi, call.mesh, call.placements, call.in_shape)
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
    return _wrap(gi.to(g_local.dtype), call.mesh, call.placements, call.in_shape)


# --------------------------------------------------------------------------------------------
# Transposed convolution: local contributions, summed by the owners of the output chunks
# --------------------------------------------------------------------------------------------

_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding",
              "groups")
_CONV_BACKWARD_ARGS = ("grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation",
                       "transposed", "output_padding", "groups", "output_mask")


@dataclasses.dataclass(frozen=True)
class _Transposed:
    """A transposed convolution's parameters, its global output shape and the spatial shard."""

    mesh: Any
    placements: tuple
    dim: Optional[int]
    mesh_dim: Optional[int]
    stride: list
    padding: list
    dilation: list
    output_padding: list
    groups: int
    in_size: Optional[int]  # global input length along the sharded dim
    out_shape: list

    def local_params(self) -> tuple:
        """stride, padding, dilation, output_padding of the local op: 0 padding on the shard."""
        padding, output_padding = list(self.padding), list(self.output_padding)
        padding[self.dim - 2] = output_padding[self.dim - 2] = 0
        return self.stride, padding, self.dilation, output_padding

    def geometry(self, k: int) -> tuple[_Ranges, int, int]:
        """The output ranges each rank's inputs reach (clipped to the output) as a :class:`_Ranges`
        over the output chunks, and where this rank's local output starts and ends."""
        i = self.dim - 2
        s, p, dil, n_out = self.stride[i], self.padding[i], self.dilation[i], self.out_shape[self.dim]
        size = self.mesh.size(self.mesh_dim)
        reach, spans = [], []
        for i0, i1 in shard_bounds(self.in_size, size):
            start, stop = i0 * s - p, (i1 - 1) * s - p + dil * (k - 1) + 1
            lo, hi = max(start, 0), min(stop, n_out)
            reach.append((lo, hi) if i1 > i0 and hi > lo else (0, 0))
            spans.append((start, stop))
        rg = _ranges(self.mesh, self.mesh_dim, shard_bounds(n_out, size), reach)
        return rg, *spans[rg.position]


def _without_partials(x: Any) -> Any:
    """A partial-sum input reduced first (as :mod:`~torch_tp.conv.sharded_conv` does): the
    convolution of the whole value, its gradient replicated on those mesh dims."""
    if not isinstance(x, DTensor) or not any(p.is_partial() for p in x.placements):
        return x
    return x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])


def _transposed(x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any, transposed: Any,
                output_padding: Any, groups: int) -> _Transposed:
    if not transposed:
        raise ValueError("transposed_convolution_handler takes transposed=True calls only; "
                         "torch_tp.conv.sharded_conv.convolution_handler takes the others")
    if not isinstance(x, DTensor):
        raise NotImplementedError(f"sharded transposed convolution needs the input as a DTensor, got "
                                  f"a plain {type(x).__name__}")
    mesh = x.device_mesh
    _check_replicated(weight, mesh, "weight")
    _check_replicated(bias, mesh, "bias")
    d, mesh_dim = _spatial_shard(x)
    n = x.ndim - 2
    stride, padding, dilation, output_padding = (
        _expand(v, n, name) for v, name in ((stride, "stride"), (padding, "padding"),
                                            (dilation, "dilation"), (output_padding, "output_padding")))
    spatial = [(x.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (weight.shape[2 + i] - 1)
               + output_padding[i] + 1 for i in range(n)]
    out_shape = [x.shape[0], weight.shape[1] * groups, *spatial]
    return _Transposed(mesh, tuple(x.placements), d, mesh_dim, stride, padding, dilation, output_padding,
                       groups, x.shape[d] if d is not None else None, out_shape)


def _reduced(placements: tuple) -> list:
    return [Partial() if isinstance(p, Shard) else Replicate() for p in placements]


def transposed_convolution_handler(op_call: Any, args: tuple, kwargs: dict) -> DTensor:
    """DTensor handler for ``aten.convolution.default`` with ``transposed=True``.

    ``args`` as for :func:`~torch_tp.conv.sharded_conv.convolution_handler`. Returns a DTensor
    with the input's placements and the global output shape; with a spatial ``Shard(d)``, this
    rank's ``torch.chunk`` piece of the output along ``d``: the sum of every rank's
    contributions to it (each rank sends the others the parts of its local transposed
    convolution that land in their chunks), plus the bias.

    A ``Partial`` input is reduced first, as the ordinary handler does.

    Raises:
        ValueError: ``transposed=False`` (that is the ordinary handler's).
        NotImplementedError: as the ordinary handler (channel or two spatial shards, weight or
            bias not replicated).

    Example:
        >>> # xdoctest: +SKIP("needs a process group; sharded_conv routes transposed=True here")
        >>> x = distribute_tensor(torch.randn(2, 4, 6, 10), mesh, [Shard(3)])   # width on 4 ranks
        >>> w = distribute_tensor(torch.randn(4, 2, 2, 2), mesh, [Replicate()])
        >>> y = transposed_convolution_handler(
        ...     aten.convolution.default, (x, w, None, [2, 2], [0, 0], [1, 1], True, [0, 0], 1), {})
        >>> y.placements, y.shape, y.to_local().shape                            # rank 3 of 4
        ((Shard(dim=3),), torch.Size([2, 2, 12, 20]), torch.Size([2, 2, 12, 5]))
    """
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = _bind(args, kwargs, _CONV_ARGS)
    x = _without_partials(x)
    tc = _transposed(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    x_local, w_local = x.to_local(), weight.to_local()
    b_local = bias.to_local() if bias is not None else None
    if tc.dim is None:
        out = aten.convolution.default(x_local, w_local, b_local, tc.stride, tc.padding, tc.dilation, True,
                                       tc.output_padding, groups)
        return _wrap(out, tc.mesh, tc.placements, tc.out_shape)
    d = tc.dim
    rg, start, _stop = tc.geometry(weight.shape[d])
    lo, hi = rg.needs[rg.position]
    if hi > lo:
        stride, padding, dilation, output_padding = tc.local_params()
        full = aten.convolution.default(x_local, w_local, None, stride, padding, dilation, True,
                                        output_padding, groups)
        piece = full.narrow(d, lo - start, hi - lo)
    else:
        piece = x_local.new_empty([x_local.shape[0], *tc.out_shape[1:d], 0, *tc.out_shape[d + 1:]])
    out = _scatter_add(piece, d, rg)  # every rank exchanges, contributions or not
    if b_local is not None:
        out = out + b_local.view([1, -1] + [1] * (out.ndim - 2))
    return _wrap(out, tc.mesh, tc.placements, tc.out_shape)


def transposed_convolution_backward_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor handler for ``aten.convolution_backward.default`` with ``transposed=True``.

    ``args`` as for :func:`~torch_tp.conv.sharded_conv.convolution_backward_handler`. Returns
    ``(grad_input, grad_weight, grad_bias)``: ``grad_input`` with the input's placements, the
    other two ``Partial()`` over every mesh dim the input is sharded on; ``None`` where
    ``output_mask`` says so. With a spatial shard each rank gathers the output gradient over
    the positions its strip reaches (the adjoint of the forward's sums); its input gradient
    then needs no exchange. The bias gradient sums the rank's own output chunk only.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; autograd calls it for a DTensor ConvTranspose")
        >>> gi, gw, gb = transposed_convolution_backward_handler(
        ...     aten.convolution_backward.default,
        ...     (grad_y, x, w, [2], [2, 2], [0, 0], [1, 1], True, [0, 0], 1, [True, True, True]), {})
        >>> gi.placements, gw.placements, gb.placements
        ((Shard(dim=3),), (Partial(sum),), (Partial(sum),))
    """
    (grad_out, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
     output_mask) = _bind(args, kwargs, _CONV_BACKWARD_ARGS)
    x = _without_partials(x)
    tc = _transposed(x, weight, None, stride, padding, dilation, transposed, output_padding, groups)
    if not isinstance(grad_out, DTensor):
        raise NotImplementedError("sharded transposed convolution backward needs grad_output as a DTensor")
    if tuple(grad_out.placements) != tc.placements or grad_out.device_mesh != tc.mesh:
        grad_out = grad_out.redistribute(tc.mesh, tc.placements)
    mask = list(output_mask)
    x_local, w_local, go_local = x.to_local(), weight.to_local(), grad_out.to_local()
    if tc.dim is None:
        gi, gw, gb = aten.convolution_backward.default(
            go_local, x_local, w_local, bias_sizes, tc.stride, tc.padding, tc.dilation, True,
            tc.output_padding, groups, mask)
    else:
        gi, gw = _sharded_transposed_grads(tc, go_local, x_local, w_local, weight.shape[tc.dim], mask)
        gb = go_local.sum([0, *range(2, go_local.ndim)]) if mask[2] else None
    reduced = _reduced(tc.placements)
    return (
        _wrap(gi, tc.mesh, tc.placements, x.shape) if mask[0] else None,
        _wrap(gw, tc.mesh, reduced, weight.shape) if mask[1] else None,
        _wrap(gb, tc.mesh, reduced, gb.shape) if mask[2] else None,
    )


def _sharded_transposed_grads(tc: _Transposed, go_local: torch.Tensor, x_local: torch.Tensor,
                              w_local: torch.Tensor, k: int, mask: list) -> tuple:
    """``(grad_input, grad_weight)`` of the local strip from the output gradient over its reach."""
    if not (mask[0] or mask[1]):
        return None, None
    d = tc.dim
    rg, start, stop = tc.geometry(k)
    lo, hi = rg.needs[rg.position]
    reach = _gather(go_local, d, rg)
    if x_local.shape[d] == 0:
        return torch.zeros_like(x_local) if mask[0] else None, torch.zeros_like(w_local) if mask[1] else None
    pads = [0, 0] * (go_local.ndim - 1 - d)
    if hi > lo:
        go_full = F.pad(reach, pads + [lo - start, stop - hi])
    else:
        go_full = _slices(go_local, d, stop - start, fill=0)
    stride, padding, dilation, output_padding = tc.local_params()
    gi, gw, _ = aten.convolution_backward.default(
        go_full, x_local, w_local, None, stride, padding, dilation, True, output_padding, tc.groups,
        [mask[0], mask[1], False])
    return gi, gw


# --------------------------------------------------------------------------------------------
# Installation (the upsample ops; transposed convolution shares aten.convolution's entry)
# --------------------------------------------------------------------------------------------

_MISSING = object()
_HANDLERS = {
    **{op: upsample_handler for op in _UPSAMPLE},
    **{op: upsample_backward_handler for op in _UPSAMPLE_BACKWARD},
}
_SAVED: list[dict] = []  # one entry per install(): the table entries it replaced


def _table() -> dict:
    return DTensor._op_dispatcher._custom_op_handlers


def install() -> None:
    """Put the sharded upsample handlers into DTensor's custom op handler table.

    Nests: each :func:`install` remembers the entries it replaced, and the matching
    :func:`uninstall` puts exactly those back.

    Example:
        >>> from torch_tp.conv import upsample
        >>> upsample.install()
        >>> upsample.is_installed()
        True
        >>> upsample.uninstall()
        >>> upsample.is_installed()
        False
    """
    table = _table()
    _SAVED.append({op: table.get(op, _MISSING) for op in _HANDLERS})
    table.update(_HANDLERS)


def uninstall() -> None:
    """Restore the entries the latest :func:`install` replaced (in torch 2.13: none, removed).

    Raises:
        RuntimeError: no :func:`install` is outstanding.

    Example:
        >>> import torch
        >>> from torch.distributed.tensor import DTensor
        >>> from torch_tp.conv import upsample
        >>> table = DTensor._op_dispatcher._custom_op_handlers
        >>> op = torch.ops.aten.upsample_bilinear2d.default
        >>> before = table.get(op)
        >>> upsample.install(); upsample.uninstall()
        >>> table.get(op) is before
        True
    """
    if not _SAVED:
        raise RuntimeError("torch_tp.conv.upsample.uninstall() without a matching install()")
    table = _table()
    for op, previous in _SAVED.pop().items():
        if previous is _MISSING:
            table.pop(op, None)
        else:
            table[op] = previous


def is_installed() -> bool:
    """Whether DTensor's table currently maps every upsample op here to these handlers.

    Example:
        >>> from torch_tp.conv.upsample import is_installed, sharded_upsampling
        >>> with sharded_upsampling():
        ...     print(is_installed())
        True
        >>> is_installed()
        False
    """
    table = _table()
    return all(table.get(op) is handler for op, handler in _HANDLERS.items())


@contextlib.contextmanager
def sharded_upsampling() -> Iterator[None]:
    """Context manager: :func:`install` on entry, :func:`uninstall` on exit (also on exceptions).

    Example:
        >>> from torch_tp.conv.upsample import is_installed, sharded_upsampling
        >>> try:
        ...     with sharded_upsampling():
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
