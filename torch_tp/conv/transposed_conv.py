"""DTensor handlers for transposed convolution on a spatially sharded input.

| op | reached by | the handler |
| --- | --- | --- |
| ``convolution.default``, ``transposed=True`` | ``nn.ConvTranspose*d``, ``F.conv_transpose*d`` | :func:`transposed_convolution_handler` |
| ``convolution_backward.default``, ``transposed=True`` | autograd of the above | :func:`transposed_convolution_backward_handler` |

The input is a DTensor sharded ``Shard(d)`` on one spatial dim ``d >= 2`` over one mesh dim
(other mesh dims ``Replicate()`` or ``Shard(0)``), weight and bias replicated. The output is a
true ``Shard(d)`` of the global output: rank ``r`` owns the outputs the ``torch.chunk`` rule
gives it on the *output* length. Without these handlers DTensor fails with a shape error.

Input ``i`` adds to outputs ``i * stride - padding + k * dilation``. Each rank runs the local
transposed convolution of its strip (padding 0 on ``d``), cuts what falls in the padding,
sends each rank the part that lands in its output chunk (only the outputs its inputs reach:
with stride > 1 the taps can skip some) and sums what it receives (the adjoint
of the convolution's halo exchange, :func:`torch_tp.conv._ranges._scatter_add`), then adds the
bias. The backward gathers the gradient over the strip's reach (the forward exchange), and the
local ``convolution_backward`` gives the input gradient with no further exchange. Weight and
bias gradients come back ``Partial()`` over every mesh dim the input is sharded on.

Both ops are shared with ordinary convolution (:mod:`torch_tp.conv.sharded_conv`): each set
claims the calls of its kind (``when=``, :mod:`torch_tp.conv._registry`), so
:func:`torch_tp.conv.install` (or :func:`~torch_tp.conv.sharded_convolution`), which installs
both, is all it takes.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from torch_tp.conv import sharded_convolution
    >>> x = distribute_tensor(image, mesh, [Shard(3)])               # width-sharded NCHW
    >>> up = nn.ConvTranspose2d(8, 4, 2, stride=2)                     # replicated weights
    >>> with sharded_convolution():
    ...     y = up(x)                                                 # y.placements == (Shard(3),)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torch_tp._layouts import shard_bounds
from torch_tp.conv._core import CONV_ARGS, CONV_BACKWARD_ARGS, bind, check_replicated, expand, partial_where_sharded, spatial_layout, \
    without_partials, wrap
from torch_tp.conv._geometry import _tapped
from torch_tp.conv._ranges import _gather, _Ranges, _ranges, _scatter_add, _slices
from torch_tp.conv._registry import HandlerSet

__all__ = [
    "install",
    "is_installed",
    "transposed_convolution",
    "transposed_convolution_backward_handler",
    "transposed_convolution_handler",
    "uninstall",
]

aten = torch.ops.aten


def _is_transposed(args: tuple, kwargs: dict) -> bool:
    return bool(bind(args, kwargs, CONV_ARGS)[6])


def _is_transposed_backward(args: tuple, kwargs: dict) -> bool:
    return bool(bind(args, kwargs, CONV_BACKWARD_ARGS)[7])


HANDLERS = HandlerSet("torch_tp.conv.transposed_conv", serves=(nn.ConvTranspose1d, nn.ConvTranspose2d,
                                                                nn.ConvTranspose3d))


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
        over the output chunks, and where this rank's local output starts and ends. Where the
        taps skip outputs of a range (stride > 1), its picks name the outputs reached: only
        those travel."""
        i = self.dim - 2
        s, p, dil, n_out = self.stride[i], self.padding[i], self.dilation[i], self.out_shape[self.dim]
        size = self.mesh.size(self.mesh_dim)
        reach, spans = _reach(self.in_size, size, n_out, stride=s, padding=p, dilation=dil, kernel_size=k)
        bounds = shard_bounds(n_out, size)
        picks = _reached_picks(shard_bounds(self.in_size, size), bounds, reach, stride=s, padding=p,
                               dilation=dil, kernel_size=k)
        rg = _ranges(self.mesh, self.mesh_dim, bounds, reach, picks)
        return rg, *spans[rg.position]


@functools.lru_cache(maxsize=256)
def _reach(in_size: int, size: int, n_out: int, *, stride: int, padding: int, dilation: int,
           kernel_size: int) -> tuple[tuple, tuple]:
    """Per rank, the output range ``[lo, hi)`` its inputs reach (clipped to the output, ``(0, 0)``
    for none) and its local output's unclipped span.

    Example:
        >>> _reach(6, 2, 12, stride=2, padding=0, dilation=1, kernel_size=2)
        (((0, 6), (6, 12)), ((0, 6), (6, 12)))
    """
    reach, spans = [], []
    for i0, i1 in shard_bounds(in_size, size):
        start, stop = i0 * stride - padding, (i1 - 1) * stride - padding + dilation * (kernel_size - 1) + 1
        lo, hi = max(start, 0), min(stop, n_out)
        reach.append((lo, hi) if i1 > i0 and hi > lo else (0, 0))
        spans.append((start, stop))
    return tuple(reach), tuple(spans)


def _reached_picks(in_chunks: list, bounds: list, reach: tuple, *, stride: int, padding: int, dilation: int,
                   kernel_size: int) -> list:
    """Per rank, the outputs of its reach outside its own chunk that a tap of its inputs adds
    to (``input * stride - padding + tap * dilation``), or ``None`` where that is all of them.

    Example:
        >>> # 5 inputs on 4 ranks, kernel 2, stride 3: input i adds to outputs 3i and 3i + 1
        >>> _reached_picks([(0, 2), (2, 4), (4, 5), (5, 5)], [(0, 4), (4, 8), (8, 12), (12, 14)],
        ...                ((0, 5), (6, 11), (12, 14), (0, 0)), stride=3, padding=0, dilation=1, kernel_size=2)
        [None, (9, 10), None, None]
    """
    taps = dict(stride=stride, pad_l=padding, dilation=dilation, span=dilation * (kernel_size - 1))
    picks = []
    for chunk, (own_lo, own_hi), (lo, hi) in zip(in_chunks, bounds, reach):
        outside = [(lo, min(hi, own_lo)), (max(lo, own_hi), hi)]
        chosen = [o for a, b in outside if b > a for o in _tapped(a, b, chunk, **taps)]
        picks.append(None if len(chosen) == sum(max(0, b - a) for a, b in outside) else tuple(chosen))
    return picks


_WHAT = "sharded transposed convolution"


def _transposed(x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any, transposed: Any,
                output_padding: Any, groups: int) -> _Transposed:
    if not transposed:
        raise ValueError("transposed_convolution_handler takes transposed=True calls only; "
                         "torch_tp.conv.sharded_conv.convolution_handler takes the others")
    if not isinstance(x, DTensor):
        raise NotImplementedError(f"sharded transposed convolution needs the input as a DTensor, got "
                                  f"a plain {type(x).__name__}")
    mesh = x.device_mesh
    check_replicated(weight, mesh, "weight", _WHAT)
    check_replicated(bias, mesh, "bias", _WHAT)
    d, mesh_dim = spatial_layout(x, _WHAT).one_spatial_dim(_WHAT)
    n = x.ndim - 2
    stride, padding, dilation, output_padding = (
        expand(v, n, name, _WHAT) for v, name in ((stride, "stride"), (padding, "padding"),
                                            (dilation, "dilation"), (output_padding, "output_padding")))
    spatial = [(x.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (weight.shape[2 + i] - 1)
               + output_padding[i] + 1 for i in range(n)]
    out_shape = [x.shape[0], weight.shape[1] * groups, *spatial]
    return _Transposed(mesh, tuple(x.placements), d, mesh_dim, stride, padding, dilation, output_padding,
                       groups, x.shape[d] if d is not None else None, out_shape)


@HANDLERS.implements(aten.convolution.default, when=_is_transposed)
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
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = bind(args, kwargs, CONV_ARGS)
    x = without_partials(x)
    tc = _transposed(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    x_local, w_local = x.to_local(), weight.to_local()
    b_local = bias.to_local() if bias is not None else None
    if tc.dim is None:
        out = aten.convolution.default(x_local, w_local, b_local, tc.stride, tc.padding, tc.dilation, True,
                                       tc.output_padding, groups)
        return wrap(out, tc.mesh, tc.placements, tc.out_shape)
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
    return wrap(out, tc.mesh, tc.placements, tc.out_shape)


@HANDLERS.implements(aten.convolution_backward.default, when=_is_transposed_backward)
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
     output_mask) = bind(args, kwargs, CONV_BACKWARD_ARGS)
    x = without_partials(x)
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
    reduced = partial_where_sharded(tc.placements)
    return (
        wrap(gi, tc.mesh, tc.placements, x.shape) if mask[0] else None,
        wrap(gw, tc.mesh, reduced, weight.shape) if mask[1] else None,
        wrap(gb, tc.mesh, reduced, gb.shape) if mask[2] else None,
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
# Installation
# --------------------------------------------------------------------------------------------


install, uninstall, is_installed, transposed_convolution = HANDLERS.public_functions(
    "transposed_convolution", "transposed convolution")
