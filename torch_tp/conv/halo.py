"""Halo exchange: each rank borrows border slices from the ranks beside it along one tensor dim.

A tensor sharded along ``dim`` over the ranks of a process group (or of one mesh dim) is
extended on every rank by the last slices of its left neighbour's shard and the first slices
of its right neighbour's, with one batch of point-to-point messages (the first rank has no
left neighbour and the last no right one: nothing wraps around). A halo wider than the
neighbour's shard continues into the next ranks' shards ("multi-hop"): the counts are then
given per hop, and each piece travels directly between its owner and the rank that needs it
(no relaying), in the same batch. The backward is the exact adjoint: halo gradients go back
to the ranks that own those slices and are added there. :func:`halo_bytes` gives, from the
geometry alone, the bytes each rank sends.

Driven by a :class:`~torch_tp.conv.ShardWindow` (``window=``, as the convolution and pooling
handlers do), only the positions the receiver's taps read travel (the window's
``recv_picks`` / ``send_picks``: with stride or dilation > 1 a border block can have columns
no tap reads); the received halo keeps its contiguous layout, with zeros at the positions
left out, and the backward returns the gradients of the picked positions only.

This module is the public, autograd-level exchange: it checks a user's counts and wraps the
plain-tensor forward and adjoint of :mod:`torch_tp.conv._halo_exchange` (the private API the
handlers use directly, with its own table) in one autograd ``Function``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from torch_tp.conv._geometry import ShardWindow
from torch_tp.conv._halo_exchange import (
    Count,
    Neighbours,
    Picks,
    exchange_backward,
    exchange_forward,
    per_hop,
    picks_of,
    resolve_neighbours,
)

__all__ = ["halo_bytes", "halo_exchange"]


class _HaloExchange(torch.autograd.Function):
    """Autograd node of :func:`halo_exchange` (see its docstring for the formulas)."""

    @staticmethod
    def forward(ctx, x_shard, dim, recv_left, recv_right, send_left, send_right, nb, picks):  # type: ignore
        ctx.args = (dim, recv_left, recv_right, send_left, send_right, nb, x_shard.shape[dim])  # no tensors
        ctx.picks = picks
        return exchange_forward(x_shard, dim, recv_left, recv_right, send_left, send_right, nb, picks=picks)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_strip):  # type: ignore[override]
        return (exchange_backward(grad_strip, *ctx.args, picks=ctx.picks),) + (None,) * 7


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_counts(x_shard: torch.Tensor, dim: int, counts: dict[str, Count], nb: Neighbours) -> int:
    """Validate the four counts against the shard and the rank's position; return ``dim`` >= 0."""
    if x_shard.dim() == 0 or not -x_shard.dim() <= dim < x_shard.dim():
        raise ValueError(f"halo_exchange: dim={dim} is out of range for a {x_shard.dim()}-D shard")
    dim %= x_shard.dim()
    hops = {}
    for name, value in counts.items():
        if not _is_count(value) and not (isinstance(value, (tuple, list)) and all(map(_is_count, value))):
            raise ValueError(
                f"halo_exchange: {name} must be an int >= 0, got {value!r} (or a sequence of them: "
                f"the count per hop, nearest rank first)"
            )
        hops[name] = per_hop(value)
    n = x_shard.shape[dim]
    for name in ("send_left", "send_right"):
        if any(c > n for c in hops[name]):
            shown = counts[name] if len(hops[name]) == 1 else hops[name]
            raise ValueError(
                f"halo_exchange: {name}={shown} but this rank's shard holds only {n} slices along dim {dim}"
            )
    edges = (("left", nb.position, "recv_left", "send_left"),
             ("right", nb.size - 1 - nb.position, "recv_right", "send_right"))
    for side, room, recv, send in edges:
        if room == 0 and (hops[recv] or hops[send]):
            raise ValueError(
                f"halo_exchange: the rank at position {nb.position} of {nb.size} has no {side} neighbour "
                f"(nothing wraps around), so {recv} and {send} must be 0, "
                f"got {sum(hops[recv])} and {sum(hops[send])}"
            )
        for name in (recv, send):
            if len(hops[name]) > room:
                raise ValueError(
                    f"halo_exchange: {name}={hops[name]} reaches {len(hops[name])} ranks to the {side}, but "
                    f"the rank at position {nb.position} of {nb.size} has only {room} there"
                )
    return dim


def halo_exchange(
    x_shard: torch.Tensor,
    *,
    dim: int,
    recv_left: Optional[Count] = None,
    recv_right: Optional[Count] = None,
    send_left: Optional[Count] = None,
    send_right: Optional[Count] = None,
    window: Optional[ShardWindow] = None,
    group: Any = None,
    mesh: Any = None,
    mesh_dim: Any = None,
) -> torch.Tensor:
    """Extend this rank's shard with the border slices of the shards beside it along ``dim``.

    Shapes (along ``dim``; every other dim is unchanged): ``x_shard`` is ``[n]``, the result
    ``[recv_left + n + recv_right]``. Let ``L`` / ``R`` be the left / right neighbour's shard.
    With one hop (every count an int):

    Forward::

        send  x_shard[:send_left]          -> left neighbour   (its halo_right)
        send  x_shard[n - send_right:]     -> right neighbour  (its halo_left)
        recv  halo_left  = L[-recv_left:]  <- left neighbour
        recv  halo_right = R[:recv_right]  <- right neighbour
        out   = cat(halo_left, x_shard, halo_right)

    Backward (the exact adjoint: ``<exchange(x), g> == <x, exchange^T(g)>`` summed over
    ranks), with ``g`` the gradient of ``out``::

        send  g[:recv_left]                -> left neighbour   (it owns those slices)
        send  g[recv_left + n:]            -> right neighbour
        grad_x = g[recv_left : recv_left + n]
        grad_x[:send_left]       += what the left neighbour sends back  ([send_left])
        grad_x[n - send_right:]  += what the right neighbour sends back ([send_right])

    Multi-hop: a count may be a sequence, the slices per hop, nearest rank first.
    ``recv_left=(2, 1)`` takes the whole shard (2 slices) of the rank 1 to the left and the
    last slice of the rank 2 to the left, ``halo_left = L2[-1:] ++ L1``; ``send_right=(2, 1)``
    sends ``x_shard[n - 2:]`` to the rank 1 to the right and ``x_shard[n - 1:]`` to the rank
    2 to the right (their ``recv_left`` entries for this rank). Every piece goes directly to
    the rank that needs it, all in one batch of P2P ops; the backward returns each piece's
    gradient to its owner, which adds the pieces onto its border. A :class:`ShardWindow`
    gives the four splits as ``window.hops`` (recv_left, recv_right, send_left, send_right).

    Saved for backward: no tensors, only the four counts, ``n`` and the neighbours (the
    adjoint is linear and needs no activations). It is once differentiable: the messages are
    not themselves recorded by autograd, so double backward raises instead of being wrong.

    Keyword Args:
        dim: the tensor dim the shards are split along.
        recv_left, recv_right: slices received from the left / right neighbour; or per hop,
            a sequence (nearest rank first: every rank's whole shard but the farthest's).
        send_left, send_right: slices sent to the left / right neighbour (a prefix / suffix
            of ``x_shard``), or per hop; entry ``h`` must equal entry ``h`` of the matching
            ``recv_right`` / ``recv_left`` of the rank ``h + 1`` away (``conv_windows``
            gives consistent counts).
        window: instead of the four counts, this rank's :class:`~torch_tp.conv.ShardWindow`
            (``conv_windows(...)[position]``): its counts per hop, and only the positions its
            ``recv_picks`` / ``send_picks`` name travel (every position where they are
            empty). A position left out arrives as zero and its gradient is not sent back:
            no tap of the receiver's outputs reads it.
        group: the process group whose ranks, in group order, hold consecutive shards. Or:
        mesh, mesh_dim: a ``DeviceMesh`` and the dim (name or index) the tensor is sharded
            over; the rank's position is its coordinate on that dim, and only ranks of its
            sub-group exchange. ``mesh_dim`` may be left out on a 1-D mesh.

    Returns:
        ``cat(halo_left, x_shard, halo_right)`` along ``dim``, differentiable w.r.t. ``x_shard``.

    Raises:
        ValueError: negative or non-int counts, both ``window`` and counts (or neither),
            a window of another position or shard length, sending more slices than the shard holds,
            a halo on the side of an edge rank that has no neighbour there (or more hops than
            there are ranks on that side), ``dim`` out of range, a DTensor instead of its local
            shard, or not exactly one of ``group`` / ``mesh``.

    Example::

        >>> # xdoctest: +SKIP("needs a process group of 2 ranks")
        >>> x = torch.arange(4.0) + 4 * rank          # rank 0: [0, 1, 2, 3], rank 1: [4, 5, 6, 7]
        >>> w = conv_windows(8, 2, kernel_size=3, padding=1)[rank]
        >>> halo_exchange(x, dim=0, recv_left=w.recv_left, recv_right=w.recv_right,
        ...               send_left=w.send_left, send_right=w.send_right, mesh=tp_mesh)
        tensor([0., 1., 2., 3., 4.])                 # rank 0
        tensor([3., 4., 5., 6., 7.])                 # rank 1
        >>> # kernel 5, stride 2, dilation 2: rank 1's outputs read 4 and 6 of rank 0's [4, 8)
        >>> w = conv_windows(16, 2, kernel_size=5, stride=2, dilation=2, padding=4)[rank]
        >>> halo_exchange(torch.arange(8.0) + 8 * rank, dim=0, window=w, mesh=tp_mesh)[:4]
        tensor([4., 0., 6., 0.])                     # rank 1: two columns sent, not four

    .. note::
        Like a collective, every rank of the group calls it, and if one rank backpropagates
        through it all must (a rank whose loss does not depend on the result still has halo
        gradients to receive and send: add ``0 * out.sum()``). The counts of the ranks must
        agree; a mismatch is not detected locally (the backend fails or hangs until its
        timeout). With NCCL, the first P2P call on a group must involve all of its ranks; a
        rank with nothing to exchange issues no call.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(x_shard, DTensor):
        raise ValueError("halo_exchange takes the local shard (x.to_local()), not a DTensor")
    nb = resolve_neighbours(group, mesh, mesh_dim)
    counts = dict(recv_left=recv_left, recv_right=recv_right, send_left=send_left, send_right=send_right)
    counts, picks = _counts_and_picks(counts, window, nb)
    dim = _check_counts(x_shard, dim, counts, nb)
    if window is not None and x_shard.shape[dim] != window.in_size:
        raise ValueError(
            f"torch_tp.conv.halo_exchange: the window is for a shard of {window.in_size} slices "
            f"([{window.in_start}, {window.in_stop})), this rank's holds {x_shard.shape[dim]} along dim {dim}; "
            f"pass the window of this tensor's global length (conv_windows(length, ...)[position])"
        )
    return _HaloExchange.apply(x_shard, dim, *counts.values(), nb, picks)


def _counts_and_picks(counts: dict, window: Optional[ShardWindow], nb: Neighbours) -> tuple[dict, Optional[Picks]]:
    """The four counts (per hop) and the picks, from ``window`` or from the counts given."""
    given = [name for name, value in counts.items() if value is not None]
    if window is None:
        if len(given) < len(counts):
            missing = ", ".join(f"{name}=" for name in counts if name not in given)
            raise ValueError(
                f"torch_tp.conv.halo_exchange needs the four counts or window=; missing {missing} "
                f"(pass window=conv_windows(...)[position] to take them from the geometry)"
            )
        return counts, None
    if given:
        raise ValueError(
            f"torch_tp.conv.halo_exchange takes window= or the counts, not both (got {', '.join(given)} "
            f"as well): drop the counts, the window carries them"
        )
    if not isinstance(window, ShardWindow):
        raise ValueError(f"torch_tp.conv.halo_exchange: window= must be a ShardWindow (conv_windows(...)[position]), "
                         f"got {type(window).__name__}")
    if window.rank != nb.position:
        raise ValueError(
            f"torch_tp.conv.halo_exchange: window= is position {window.rank}'s, this rank is at position "
            f"{nb.position} of {nb.size}; pass conv_windows(...)[{nb.position}]"
        )
    return dict(zip(counts, window.hops)), picks_of(window)


def halo_bytes(
    windows: Sequence[ShardWindow], *, slice_numel: int, element_size: int, direction: str = "forward"
) -> list[int]:
    """Bytes each rank sends in one :func:`halo_exchange` driven by ``windows``.

    Keyword Args:
        slice_numel: elements in one slice along the sharded dim (the product of the other
            dims, e.g. ``N * C * H`` for an ``(N, C, H, W)`` input sharded on ``W``).
        element_size: bytes per element (``tensor.element_size()``).
        direction: ``"forward"`` (each rank sends ``send_left + send_right`` slices) or
            ``"backward"`` (it returns the gradients of its halos: ``recv_left + recv_right``).

    Counts the slices that travel (:attr:`ShardWindow.send_total
    <torch_tp.conv.ShardWindow.send_total>` forward, ``recv_total`` backward): with stride or
    dilation > 1 only the positions the receiver's taps read, as :func:`halo_exchange` with
    ``window=`` and the convolution and pooling handlers send them.

    Returns:
        ``list[int]`` indexed by the rank's position on the sharded dim. With one hop, inner
        ranks send up to two halos, edge ranks at most one; with multi-hop halos a rank sends
        a piece to every rank that reads part of its shard (the counts are the totals).

    Example:
        >>> from torch_tp.conv import conv_windows
        >>> windows = conv_windows(30, 4, kernel_size=4, padding="same")  # pads (1, 2)
        >>> [(w.send_left, w.send_right) for w in windows]
        [(0, 1), (2, 1), (2, 1), (2, 0)]
        >>> halo_bytes(windows, slice_numel=3, element_size=4)
        [12, 36, 36, 24]
        >>> halo_bytes(windows, slice_numel=3, element_size=4, direction="backward")
        [24, 36, 36, 12]
        >>> windows = conv_windows(5, 4, kernel_size=7, padding=3)  # shards 2, 2, 1, 0: multi-hop
        >>> [w.send_ranges for w in windows]  # (to rank, start, stop)
        [((1, 0, 2), (2, 1, 2)), ((0, 2, 4), (2, 2, 4)), ((0, 4, 5), (1, 4, 5)), ()]
        >>> halo_bytes(windows, slice_numel=1, element_size=4)
        [12, 16, 8, 0]
        >>> halo_bytes(windows, slice_numel=1, element_size=4, direction="backward")
        [12, 12, 12, 0]
        >>> windows = conv_windows(16, 2, kernel_size=5, stride=2, dilation=2, padding=4)
        >>> [(w.send_left + w.send_right, w.send_total) for w in windows]  # every other column read
        [(4, 2), (3, 2)]
        >>> halo_bytes(windows, slice_numel=1, element_size=4)
        [8, 8]
    """
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    per_slice = slice_numel * element_size
    if direction == "forward":
        return [w.send_total * per_slice for w in windows]
    return [w.recv_total * per_slice for w in windows]
