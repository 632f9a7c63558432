"""DTensor handlers for ``aten.convolution`` / ``aten.convolution_backward`` on a spatially sharded input.

| op | reached by | the handler |
| --- | --- | --- |
| ``convolution.default``, ``transposed=False`` | ``nn.Conv1d/2d/3d``, ``F.conv*d`` | :func:`convolution_handler`: halo exchange, local convolution |
| ``convolution_backward.default``, ``transposed=False`` | autograd of the above | :func:`convolution_backward_handler`: the exchange's adjoint |

Installed by a ``SpatialParallel`` model that needs it, or for every op by
:func:`sharded_convolution` (:mod:`torch_tp.conv._registry`).

(``transposed=True`` calls are :mod:`torch_tp.conv.transposed_conv`'s.)

The input is a DTensor sharded ``Shard(d)`` on one spatial dim ``d >= 2`` over one mesh dim
(other mesh dims ``Replicate()`` or ``Shard(0)``: batch), weight and bias replicated. Each rank
gets from the ranks beside it on that mesh dim exactly the border slices its outputs read
(:func:`~torch_tp.conv.conv_windows`; with stride or dilation, only the columns its taps read,
the others zero in the local input), convolves locally with padding 0 on ``d`` and keeps
its own chunk of the output, which is therefore a true ``Shard(d)`` of the global output. The
backward recomputes the strip, runs the local ``convolution_backward`` and sends the halo
gradients back to their owners (the exact adjoint of the exchange). Weight and bias gradients
come back ``Partial()`` over every mesh dim the input is sharded on (spatial or batch).

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from torch_tp.conv import sharded_convolution
    >>> x = distribute_tensor(image, mesh, [Shard(3)])             # width-sharded NCHW
    >>> conv = nn.Conv2d(3, 8, 3, padding=1)
    >>> w, b = (distribute_tensor(p, mesh, [Replicate()]) for p in (conv.weight, conv.bias))
    >>> with sharded_convolution():
    ...     y = F.conv2d(x, w, b, padding=1)                         # y.placements == (Shard(3),)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torch_tp.conv._core import CONV_ARGS, CONV_BACKWARD_ARGS, bind, check_replicated, expand, partial_where_sharded, spatial_layout, \
    without_partials, wrap
from torch_tp.conv._geometry import ShardWindow, conv_windows
from torch_tp.conv._registry import HandlerSet
from torch_tp.conv._halo_exchange import (
    exchange_backward,
    exchange_backward_start,
    exchange_forward,
    exchange_start,
    picks_of,
    resolve_neighbours,
    settled_on_error,
)

__all__ = [
    "convolution_backward_handler",
    "convolution_handler",
    "halo_overlap",
    "install",
    "is_installed",
    "overlaps_halos",
    "sharded_convolution",
    "uninstall",
]

aten = torch.ops.aten
HANDLERS = HandlerSet("torch_tp.conv.sharded_conv", serves=(nn.Conv1d, nn.Conv2d, nn.Conv3d))


# --------------------------------------------------------------------------------------------
# Layout: what is sharded where, validated
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The spatially sharded dim (if any) and this rank's window on it."""

    mesh: Any
    placements: tuple
    spatial_dim: Optional[int]  # tensor dim d >= 2, or None (batch-only / replicated)
    mesh_dim: Optional[int]
    window: Optional[ShardWindow]
    stride: list[int]
    padding: list[int]  # the op's padding, with 0 on the sharded dim
    dilation: list[int]


_WHAT = "sharded convolution"


def _spatial_shard(x: DTensor) -> tuple[Optional[int], Optional[int]]:
    """``(tensor dim, mesh dim)`` of the one spatial shard, or ``(None, None)``; raise otherwise."""
    if x.ndim not in (3, 4, 5):
        raise NotImplementedError(
            f"{_WHAT} supports Conv1d/2d/3d inputs (3-5 dims with batch), got {x.ndim} dims"
        )
    return spatial_layout(x, _WHAT).one_spatial_dim(_WHAT)


def _require_not_transposed(transposed: Any) -> None:
    if transposed:  # the overlap of neighbouring outputs, the adjoint of the halo: its own set
        raise ValueError("convolution_handler takes transposed=False calls only; "
                         "torch_tp.conv.transposed_conv.transposed_convolution_handler takes the others")


# aten.convolution serves ordinary and transposed convolution: this set takes transposed=False
# calls, torch_tp.conv.transposed_conv's the others
def _is_ordinary(args: tuple, kwargs: dict) -> bool:
    return not bind(args, kwargs, CONV_ARGS)[6]


def _is_ordinary_backward(args: tuple, kwargs: dict) -> bool:
    return not bind(args, kwargs, CONV_BACKWARD_ARGS)[7]


def _plan(x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any,
          transposed: bool, groups: int) -> _Plan:
    if not isinstance(x, DTensor):
        raise NotImplementedError(
            f"sharded convolution needs the input as a DTensor, got a plain {type(x).__name__} "
            f"(with a DTensor weight)"
        )
    mesh = x.device_mesh
    check_replicated(weight, mesh, "weight", _WHAT)
    check_replicated(bias, mesh, "bias", _WHAT)
    d, mesh_dim = _spatial_shard(x)
    n_spatial = x.ndim - 2
    stride, padding, dilation = (expand(v, n_spatial, name, _WHAT) for v, name in
                                 ((stride, "stride"), (padding, "padding"), (dilation, "dilation")))
    window = None
    if d is not None:
        i = d - 2
        windows = conv_windows(
            x.shape[d], mesh.size(mesh_dim), kernel_size=weight.shape[d], stride=stride[i],
            padding=padding[i], dilation=dilation[i],
        )
        window = windows[mesh.get_local_rank(mesh_dim)]
        padding = list(padding)
        padding[i] = 0
    return _Plan(mesh, tuple(x.placements), d, mesh_dim, window, stride, padding, dilation)


def _out_size(size: int, k: int, stride: int, pad: int, dilation: int) -> int:
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


# --------------------------------------------------------------------------------------------
# The local input: exchanged strip, trimmed, padded
# --------------------------------------------------------------------------------------------


def _exchange_args(plan: _Plan) -> tuple:
    w = plan.window
    nb = resolve_neighbours(None, plan.mesh, plan.mesh_dim)
    return (plan.spatial_dim, *w.hops, nb)


def _picks(plan: _Plan) -> Any:
    """Which halo positions travel (``None``: all): those the receiver's taps read."""
    return picks_of(plan.window)


def _local_input(x_local: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """``pad(strip[trim_left : strip_size - trim_right], (pad_left, pad_right))`` along d."""
    w, d = plan.window, plan.spatial_dim
    strip = exchange_forward(x_local, *_exchange_args(plan), picks=_picks(plan))
    kept = strip.narrow(d, w.trim_left, w.strip_size - w.trim_left - w.trim_right)
    return _pad_dim(kept, d, w.pad_left, w.pad_right)


def _conv(local_in: torch.Tensor, *, w_local: torch.Tensor, b_local: Optional[torch.Tensor], plan: _Plan,
          output_padding: list, groups: int) -> torch.Tensor:
    """The local convolution: padding 0 on the sharded dim (the window holds the zeros)."""
    return aten.convolution.default(local_in, w_local, b_local, plan.stride, plan.padding, plan.dilation, False,
                                    output_padding, groups)


def _no_outputs(x_local: torch.Tensor, weight: DTensor, plan: _Plan) -> torch.Tensor:
    """The empty output of a rank that owns no output along the sharded dim."""
    shape = [x_local.shape[0], weight.shape[0]] + [
        _out_size(_local_shape(x_local, plan)[2 + i], weight.shape[2 + i], plan.stride[i], plan.padding[i],
                  plan.dilation[i]) for i in range(x_local.ndim - 2)
    ]
    shape[plan.spatial_dim] = 0
    return x_local.new_zeros(shape)


def _overlapped(x_local: torch.Tensor, plan: _Plan, conv: Any, *, stride: int, span: int) -> torch.Tensor:
    """The local convolution with the halo exchange in flight while the interior is computed.

    The outputs whose taps read no halo (:meth:`ShardWindow.interior_outputs`) are computed
    from the own shard and the edge zeros as soon as the exchange has started; the border
    outputs once the halos have arrived. The three pieces are the one convolution's outputs,
    split along the sharded dim (each carries the bias once).
    """
    w, d = plan.window, plan.spatial_dim
    flight = exchange_start(x_local, *_exchange_args(plan), picks=_picks(plan))
    with settled_on_error([flight]):  # a failing kernel must not strand the halos in flight
        local_in = x_local.new_empty(_local_shape(x_local, plan))
        _zero_edges(local_in, d, w)
        _place(local_in, d, w, w.recv_left, x_local)
        j0, j1 = w.interior_outputs(stride, span)

        def outputs(first: int, stop: int) -> Optional[torch.Tensor]:  # local outputs [first, stop)
            if stop <= first:
                return None
            return conv(local_in.narrow(d, first * stride, (stop - 1 - first) * stride + span + 1))

        interior = outputs(j0, j1)
        _place_halos(local_in, plan, flight)
        pieces = [p for p in (outputs(0, j0), interior, outputs(j1, w.out_size)) if p is not None]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)


def _fill_local_input(local_in: torch.Tensor, x_local: torch.Tensor, plan: _Plan, flight: Any) -> None:
    """Write the whole local input into ``local_in``: edge zeros, own slices, then the halos
    once ``flight`` (the started exchange) has arrived."""
    w, d = plan.window, plan.spatial_dim
    _zero_edges(local_in, d, w)
    _place(local_in, d, w, w.recv_left, x_local)
    _place_halos(local_in, plan, flight)


def _place_halos(local_in: torch.Tensor, plan: _Plan, flight: Any) -> None:
    w, d = plan.window, plan.spatial_dim
    halo_left, halo_right = flight.wait()
    _place(local_in, d, w, 0, halo_left)
    _place(local_in, d, w, w.recv_left + w.in_size, halo_right)


def _zero_edges(local_in: torch.Tensor, d: int, w: ShardWindow) -> None:
    local_in.narrow(d, 0, w.pad_left).zero_()
    local_in.narrow(d, w.local_size - w.pad_right, w.pad_right).zero_()


def _place(local_in: torch.Tensor, d: int, w: ShardWindow, start: int, data: torch.Tensor) -> None:
    """Copy ``data``, the strip positions ``[start, start + len)``, to where the trimmed and
    edge-padded local input keeps them (trimmed positions are dropped)."""
    lo, hi = max(start, w.trim_left), min(start + data.shape[d], w.strip_size - w.trim_right)
    if hi > lo:
        local_in.narrow(d, w.pad_left + lo - w.trim_left, hi - lo).copy_(data.narrow(d, lo - start, hi - lo))


def _pad_dim(t: torch.Tensor, d: int, left: int, right: int) -> torch.Tensor:
    if left == 0 and right == 0:
        return t
    pads = [0, 0] * (t.ndim - 1 - d) + [left, right]
    return F.pad(t, pads)


def _local_shape(x_local: torch.Tensor, plan: _Plan) -> list[int]:
    shape = list(x_local.shape)
    if plan.spatial_dim is not None:
        shape[plan.spatial_dim] = plan.window.local_size
    return shape


def _global_out_shape(x: DTensor, weight: DTensor, plan_args: tuple) -> list[int]:
    stride, padding, dilation = plan_args
    spatial = [
        _out_size(x.shape[2 + i], weight.shape[2 + i], stride[i], padding[i], dilation[i])
        for i in range(x.ndim - 2)
    ]
    return [x.shape[0], weight.shape[0], *spatial]


# --------------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------------


@HANDLERS.implements(aten.convolution.default, when=_is_ordinary)
def convolution_handler(op_call: Any, args: tuple, kwargs: dict) -> DTensor:
    """DTensor handler for ``aten.convolution.default`` with a spatially sharded input.

    ``args`` = ``(input, weight, bias, stride, padding, dilation, transposed, output_padding,
    groups)``. Returns a DTensor with the input's placements and the exact global output shape.

    Raises:
        NotImplementedError: the input sharded on channels or on more than one spatial dim,
            weight or bias not replicated. (A ``Partial`` input is reduced first; a transposed
            convolution goes to :func:`torch_tp.conv.transposed_conv.transposed_convolution_handler`.)
        ValueError: what :func:`conv_windows` refuses (e.g. an input shorter than the dilated kernel).

    Example:
        >>> # xdoctest: +SKIP("needs a process group; install() routes F.conv* on DTensors here")
        >>> x = distribute_tensor(torch.randn(2, 3, 8, 30), mesh, [Shard(3)])   # width on 4 ranks
        >>> w = distribute_tensor(torch.randn(5, 3, 3, 3), mesh, [Replicate()])
        >>> y = convolution_handler(aten.convolution.default,
        ...                         (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {})
        >>> y.placements, y.shape, y.to_local().shape                            # rank 3 of 4
        ((Shard(dim=3),), torch.Size([2, 5, 8, 30]), torch.Size([2, 5, 8, 6]))
    """
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = bind(args, kwargs, CONV_ARGS)
    _require_not_transposed(transposed)
    x = without_partials(x)  # a spatial mean feeding a 1x1 convolution (squeeze-excite)
    plan = _plan(x, weight, bias, stride, padding, dilation, transposed, groups)
    n_spatial = x.ndim - 2
    op_padding = expand(padding, n_spatial, "padding", _WHAT)
    out_shape = _global_out_shape(x, weight, (plan.stride, op_padding, plan.dilation))
    x_local = x.to_local()
    w_local = weight.to_local()
    b_local = bias.to_local() if bias is not None else None
    conv = functools.partial(_conv, w_local=w_local, b_local=b_local, plan=plan,
                             output_padding=list(output_padding), groups=groups)
    if plan.spatial_dim is None:
        out = conv(x_local)
    elif plan.window.out_size == 0:
        _local_input(x_local, plan)  # every rank exchanges, outputs or not
        out = _no_outputs(x_local, weight, plan)
    elif _OVERLAP_HALOS:
        k = plan.spatial_dim - 2
        out = _overlapped(x_local, plan, conv, stride=plan.stride[k], span=plan.dilation[k] * (weight.shape[plan.spatial_dim] - 1))
    else:
        out = conv(_local_input(x_local, plan))
    return wrap(out, plan.mesh, plan.placements, out_shape)


@HANDLERS.implements(aten.convolution_backward.default, when=_is_ordinary_backward)
def convolution_backward_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor handler for ``aten.convolution_backward.default`` (the adjoint of the forward).

    ``args`` = ``(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, output_mask)``. Returns ``(grad_input, grad_weight, grad_bias)``:
    ``grad_input`` with the input's placements, the other two ``Partial()`` over every mesh dim
    the input is sharded on; ``None`` where ``output_mask`` says so.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; autograd calls it for a DTensor convolution")
        >>> gi, gw, gb = convolution_backward_handler(
        ...     aten.convolution_backward.default,
        ...     (grad_y, x, w, [5], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]), {})
        >>> gi.placements, gw.placements, gb.placements
        ((Shard(dim=3),), (Partial(sum),), (Partial(sum),))
    """
    (grad_out, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
     output_mask) = bind(args, kwargs, CONV_BACKWARD_ARGS)
    _require_not_transposed(transposed)
    x = without_partials(x)  # a spatial mean feeding a 1x1 convolution (squeeze-excite)
    plan = _plan(x, weight, None, stride, padding, dilation, transposed, groups)
    if not isinstance(grad_out, DTensor):
        raise NotImplementedError("sharded convolution backward needs grad_output as a DTensor")
    if tuple(grad_out.placements) != plan.placements or grad_out.device_mesh != plan.mesh:
        grad_out = grad_out.redistribute(plan.mesh, plan.placements)
    mask = list(output_mask)
    x_local, w_local, go_local = x.to_local(), weight.to_local(), grad_out.to_local()
    w = plan.window
    conv_backward = functools.partial(_conv_backward, go_local, w_local=w_local, bias_sizes=bias_sizes, plan=plan,
                                      output_padding=list(output_padding), groups=groups)
    if plan.spatial_dim is None:
        gi, gw, gb = conv_backward(x_local, mask)
    elif _OVERLAP_HALOS and w.out_size > 0:
        gi, gw, gb = _backward_overlapped(x_local, plan, conv_backward, mask)
    else:
        gi, gw, gb = _backward_serial(x_local, w_local, weight, plan, conv_backward, mask)
    grad_input = wrap(gi, plan.mesh, plan.placements, x.shape) if mask[0] else None
    reduced = partial_where_sharded(plan.placements)
    grad_weight = wrap(gw, plan.mesh, reduced, weight.shape) if mask[1] else None
    grad_bias = wrap(gb, plan.mesh, reduced, gb.shape) if mask[2] else None
    return grad_input, grad_weight, grad_bias


def _conv_backward(go_local: torch.Tensor, local_in: torch.Tensor, mask: list, *, w_local: torch.Tensor,
                   bias_sizes: Any, plan: _Plan, output_padding: list, groups: int) -> tuple:
    """The local ``convolution_backward`` (its input gradient reads only ``local_in``'s shape)."""
    return aten.convolution_backward.default(go_local, local_in, w_local, bias_sizes, plan.stride, plan.padding,
                                             plan.dilation, False, output_padding, groups, mask)


def _backward_serial(x_local: torch.Tensor, w_local: torch.Tensor, weight: DTensor, plan: _Plan,
                     conv_backward: Any, mask: list) -> tuple:
    """Exchange the strip again (the weight gradient reads it), run the local backward, send the
    halo gradients back. A rank without outputs still takes part in both exchanges."""
    if mask[1]:
        local_in = _local_input(x_local, plan)
    else:
        local_in = x_local.new_zeros(_local_shape(x_local, plan))  # only its shape is read
    if plan.window.out_size == 0:
        gi = local_in.new_zeros(local_in.shape) if mask[0] else None
        gw = torch.zeros_like(w_local) if mask[1] else None
        gb = w_local.new_zeros(weight.shape[0]) if mask[2] else None
    else:
        gi, gw, gb = conv_backward(local_in, mask)
    if mask[0]:
        gi = exchange_backward(_grad_strip(gi, plan), *_exchange_args(plan), x_local.shape[plan.spatial_dim],
                               picks=_picks(plan))
    return gi, gw, gb


def _backward_overlapped(x_local: torch.Tensor, plan: _Plan, conv_backward: Any, mask: list) -> tuple:
    """:func:`_backward_serial` with each exchange in flight behind compute that does not need it.

    The input gradient reads no input data, so it is computed while the strip travels again;
    the weight and bias gradients are computed while the halo gradients travel back. The two
    exchanges still run one after the other, in the same order on every rank.
    """
    d = plan.spatial_dim
    flight = exchange_start(x_local, *_exchange_args(plan), picks=_picks(plan)) if mask[1] else None
    with settled_on_error([flight] if flight is not None else []) as flights:
        local_in = x_local.new_empty(_local_shape(x_local, plan))
        gi = conv_backward(local_in, [True, False, False])[0] if mask[0] else None
        if flight is not None:
            _fill_local_input(local_in, x_local, plan, flight)
        returning = None
        if mask[0]:
            returning = exchange_backward_start(_grad_strip(gi, plan), *_exchange_args(plan), x_local.shape[d],
                                                picks=_picks(plan))
            flights.append(returning)
        gw = gb = None
        if mask[1] or mask[2]:
            _, gw, gb = conv_backward(local_in, [False, mask[1], mask[2]])
    return (returning.wait() if returning is not None else None), gw, gb


def _grad_strip(g_local: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """The local input's gradient as the exchanged strip's: pad undone, trimmed slices zero."""
    w, d = plan.window, plan.spatial_dim
    kept = g_local.narrow(d, w.pad_left, w.local_size - w.pad_left - w.pad_right)
    if not (w.trim_left or w.trim_right):
        return kept
    shape = list(g_local.shape)
    shape[d] = w.strip_size
    strip = g_local.new_zeros(shape)
    strip.narrow(d, w.trim_left, kept.shape[d]).copy_(kept)
    return strip


# --------------------------------------------------------------------------------------------
# Overlap of the halo exchange with the interior's compute
# --------------------------------------------------------------------------------------------

_OVERLAP_HALOS = True


def overlaps_halos() -> bool:
    """Whether the convolution handler computes a strip's interior while its halos are in flight.

    Example:
        >>> overlaps_halos()
        True
    """
    return _OVERLAP_HALOS


@contextlib.contextmanager
def halo_overlap(enabled: bool) -> Iterator[None]:
    """Context manager: turn the overlap of the halo exchange with the interior's compute on or
    off (it is on by default) for the convolutions run inside; restored on exit.

    Off, each rank waits for its halos, then convolves the whole strip at once (one larger
    kernel call instead of up to three). The results agree to rounding: convolving a strip's
    borders apart from its interior may change the last bit of a border output for some
    channel counts (the CPU kernel blocks narrow inputs differently), as any change of
    summation order does; off reproduces the whole-strip path bit for bit. The backward's
    overlap splits no computation and changes no bit.

    Example:
        >>> from torch_tp.conv import halo_overlap, overlaps_halos
        >>> with halo_overlap(False):
        ...     print(overlaps_halos())
        False
        >>> overlaps_halos()
        True
    """
    global _OVERLAP_HALOS
    previous, _OVERLAP_HALOS = _OVERLAP_HALOS, bool(enabled)
    try:
        yield
    finally:
        _OVERLAP_HALOS = previous


# --------------------------------------------------------------------------------------------
# Installation
# --------------------------------------------------------------------------------------------

install, uninstall, is_installed, sharded_convolution = HANDLERS.public_functions("sharded_convolution", "convolution")
