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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from torch_tp.conv._geometry import ShardWindow

__all__ = ["halo_bytes", "halo_exchange"]

Count = Union[int, Sequence[int]]  # slices, or slices per hop (nearest rank first)


@dataclasses.dataclass(frozen=True)
class _Neighbours:
    """Where this rank sits on the exchanging group: its position and its peers' global ranks."""

    group: Any  # ProcessGroup
    position: int
    size: int
    left: Optional[int]
    right: Optional[int]

    def peer(self, offset: int) -> int:
        """Global rank of the rank ``offset`` positions away on the group (``-1``: left)."""
        if offset == -1 and self.left is not None:
            return self.left
        if offset == 1 and self.right is not None:
            return self.right
        return dist.get_global_rank(self.group, self.position + offset)


def _resolve_neighbours(group: Any, mesh: Any, mesh_dim: Any) -> _Neighbours:
    """The group to exchange on, from ``group=`` or from ``mesh=`` + ``mesh_dim=``.

    On a mesh the position is the rank's coordinate on ``mesh_dim`` (never its global rank),
    so the exchange stays inside the mesh dim's sub-group on a 2-D mesh.
    """
    if (group is None) == (mesh is None):
        raise ValueError("halo_exchange needs exactly one of group= or mesh= (with mesh_dim=)")
    if mesh is not None:
        if mesh_dim is None:
            if mesh.ndim != 1:
                raise ValueError(f"halo_exchange on a {mesh.ndim}-D mesh needs mesh_dim= (a name or index)")
            mesh_dim = 0
        group = mesh.get_group(mesh_dim)
        position = mesh.get_local_rank(mesh_dim)
        assert position == dist.get_rank(group), "mesh coordinate and sub-group rank disagree"
    else:
        if mesh_dim is not None:
            raise ValueError("mesh_dim= goes with mesh=; with group= the group itself is the dim")
        position = dist.get_rank(group)
        if position < 0:
            raise ValueError(
                f"global rank {dist.get_rank()} is not a member of the group passed to halo_exchange"
            )
    size = dist.get_world_size(group)
    left = dist.get_global_rank(group, position - 1) if position > 0 else None
    right = dist.get_global_rank(group, position + 1) if position + 1 < size else None
    return _Neighbours(group, position, size, left, right)


def _transfer(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], nb: _Neighbours) -> None:
    """One batch of P2P ops: ``sends[o]`` goes to, and ``recvs[o]`` is filled from, the rank
    ``o`` positions away (negative: left), waited for."""
    _start_transfer(sends, recvs, nb).wait()


@dataclasses.dataclass
class _Transfer:
    """A started batch of P2P ops: its works, and every tensor they read or fill. The tensors
    are kept alive until :meth:`wait`: a send may read its buffer after ``batch_isend_irecv``
    has returned (gloo does), and a temporary freed earlier would be reused by the compute
    running meanwhile (found as wrong gradients, before this class held them)."""

    works: list
    tensors: list

    def wait(self) -> None:
        """Wait for every op (again: no-op), then let the tensors go."""
        for work in self.works:
            work.wait()
        self.works.clear()
        self.tensors.clear()


@contextlib.contextmanager
def _settled_on_error(flights: list) -> Iterator[list]:
    """Yield ``flights``, a list to put started exchanges (``_HalosInFlight`` /
    ``_GradientsInFlight``) in; if the code inside raises, wait for them before the error
    propagates. An exchange left in flight would have the backend write into buffers Python
    frees with the failing frame (heap corruption, seen later and elsewhere). Every rank
    started the same exchanges before its local compute, so the wait completes."""
    try:
        yield flights
    except BaseException:
        for flight in flights:
            flight.transfer.wait()
        raise


def _start_transfer(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], nb: _Neighbours) -> _Transfer:
    """:func:`_transfer` without the wait (``recvs`` are filled once it is done). Empty
    tensors are skipped; the ops are ordered by distance, left before right, send before
    receive (one hop: the neighbours' pattern)."""
    ops = []
    for offset in sorted(set(sends) | set(recvs), key=lambda o: (abs(o), o > 0)):
        for op, tensor in ((dist.isend, sends.get(offset)), (dist.irecv, recvs.get(offset))):
            if tensor is not None and tensor.numel():
                ops.append(dist.P2POp(op, tensor, peer=nb.peer(offset), group=nb.group))
    return _Transfer(dist.batch_isend_irecv(ops) if ops else [], [op.tensor for op in ops])


def _run_p2p(ops: list) -> None:
    """Issue ``ops`` (``dist.P2POp``) as one batch and wait for all of them."""
    _Transfer(dist.batch_isend_irecv(ops) if ops else [], [op.tensor for op in ops]).wait()


@dataclasses.dataclass(frozen=True)
class _Picks:
    """The slices of each halo piece that travel, keyed by hop offset (``-1 - h``: the rank
    ``h + 1`` to the left; ``1 + h``: to the right); a piece without an entry travels whole.

    ``send[o]`` indexes the own shard (0 is its first slice), ``recv[o]`` the received piece
    (0 is its first slice, the farthest from the own shard on the left).
    """

    send: dict
    recv: dict


@functools.lru_cache(maxsize=256)
def _picks_of(window: Optional[ShardWindow]) -> Optional[_Picks]:
    """The window's ``recv_picks`` / ``send_picks`` as :class:`_Picks` (``None``: all dense).

    Example:
        >>> from torch_tp.conv import conv_windows
        >>> _picks_of(conv_windows(16, 2, kernel_size=5, stride=2, dilation=2, padding=4)[1])
        _Picks(send={-1: (0, 2)}, recv={-1: (0, 2)})
        >>> _picks_of(conv_windows(16, 2, kernel_size=3, padding=1)[1]) is None
        True
    """
    if window is None or not (window.recv_picks or window.send_picks):
        return None
    recv = {q - window.rank: tuple(p - start for p in picks)
            for (q, start, stop), picks in zip(window.recv_ranges, window.recv_picks) if len(picks) < stop - start}
    send = {q - window.rank: tuple(p - window.in_start for p in picks)
            for (q, start, stop), picks in zip(window.send_ranges, window.send_picks) if len(picks) < stop - start}
    return _Picks(send, recv)


def _index(positions: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=like.device)


def _hops(count: Count) -> tuple[int, ...]:
    """The per-hop split, nearest rank first, of a count: an int (one hop) or a sequence
    (a :attr:`ShardWindow.hops <torch_tp.conv.ShardWindow.hops>` entry)."""
    if isinstance(count, int):
        return (count,) if count else ()
    return tuple(count)


def _with_size(like: torch.Tensor, dim: int, count: int) -> list[int]:
    shape = list(like.shape)
    shape[dim] = count
    return shape


def _empty_slices(like: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    return like.new_empty(_with_size(like, dim, count))


class _HaloExchange(torch.autograd.Function):
    """Autograd node of :func:`halo_exchange` (see its docstring for the formulas)."""

    @staticmethod
    def forward(ctx, x_shard, dim, recv_left, recv_right, send_left, send_right, nb, picks):  # type: ignore
        ctx.args = (dim, recv_left, recv_right, send_left, send_right, nb, x_shard.shape[dim])  # no tensors
        ctx.picks = picks
        return _exchange_forward(x_shard, dim, recv_left, recv_right, send_left, send_right, nb, picks=picks)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_strip):  # type: ignore[override]
        return (_exchange_backward(grad_strip, *ctx.args, picks=ctx.picks),) + (None,) * 7


@dataclasses.dataclass
class _HalosInFlight:
    """The forward exchange, started: the halo buffers fill once :meth:`wait` returns."""

    halo_left: list[torch.Tensor]  # nearest rank first
    halo_right: list[torch.Tensor]
    transfer: _Transfer
    dim: int
    fills: list = dataclasses.field(default_factory=list)  # (halo piece, index, picked slices received)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(halo_left, halo_right)``, each in position order (farthest left rank first)."""
        self.transfer.wait()
        for piece, index, received in self.fills:
            piece.index_copy_(self.dim, index, received)
        self.fills.clear()
        return _cat(self.halo_left[::-1], self.dim), _cat(self.halo_right, self.dim)


def _cat(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _exchange_start(
    x_shard: torch.Tensor, dim: int, recv_left: Count, recv_right: Count, send_left: Count, send_right: Count,
    nb: _Neighbours, *, picks: Optional[_Picks] = None,
) -> _HalosInFlight:
    """Start the forward exchange (no autograd) and return at once: compute that does not read
    the halos can run while they are in flight (:mod:`torch_tp.conv.sharded_conv`). With
    ``picks``, only the picked slices of a piece travel; the others are zero on arrival."""
    n = x_shard.shape[dim]
    recv_l, recv_r, send_l, send_r = (_hops(c) for c in (recv_left, recv_right, send_left, send_right))
    send_picks, recv_picks = (picks.send, picks.recv) if picks is not None else ({}, {})
    sends = {}
    for offset, start, c in [(-1 - h, 0, c) for h, c in enumerate(send_l)] + [
            (1 + h, n - c, c) for h, c in enumerate(send_r)]:
        chosen = send_picks.get(offset)
        sends[offset] = (x_shard.narrow(dim, start, c).contiguous() if chosen is None
                         else x_shard.index_select(dim, _index(chosen, x_shard)))
    halo_left, halo_right, recvs, fills = [], [], {}, []
    for offset, c, pieces in [(-1 - h, c, halo_left) for h, c in enumerate(recv_l)] + [
            (1 + h, c, halo_right) for h, c in enumerate(recv_r)]:
        chosen = recv_picks.get(offset)
        if chosen is None:
            pieces.append(recvs.setdefault(offset, _empty_slices(x_shard, dim, c)))
            continue
        pieces.append(x_shard.new_zeros(_with_size(x_shard, dim, c)))
        recvs[offset] = _empty_slices(x_shard, dim, len(chosen))
        fills.append((pieces[-1], _index(chosen, x_shard), recvs[offset]))
    halo_left = halo_left or [_empty_slices(x_shard, dim, 0)]
    halo_right = halo_right or [_empty_slices(x_shard, dim, 0)]
    return _HalosInFlight(halo_left, halo_right, _start_transfer(sends, recvs, nb), dim, fills)


def _exchange_forward(
    x_shard: torch.Tensor, dim: int, recv_left: Count, recv_right: Count, send_left: Count, send_right: Count,
    nb: _Neighbours, *, picks: Optional[_Picks] = None,
) -> torch.Tensor:
    """The forward exchange on plain tensors (no autograd): ``cat(halo_left, x_shard, halo_right)``.

    Each count is an int (one hop) or split per hop (:func:`_hops`); the halo pieces are
    concatenated in position order (farthest left rank first). ``picks``: see
    :func:`_exchange_start`.
    """
    halo_left, halo_right = _exchange_start(x_shard, dim, recv_left, recv_right, send_left, send_right, nb,
                                            picks=picks).wait()
    return torch.cat([halo_left, x_shard, halo_right], dim=dim)


@dataclasses.dataclass
class _GradientsInFlight:
    """The adjoint exchange, started: :meth:`wait` adds what arrives onto the own gradient."""

    grad_x: torch.Tensor  # the own slices' gradient, without the pieces still to arrive
    arrivals: list  # (first own slice or index of own slices, what a reader sends back)
    transfer: _Transfer
    dim: int

    def wait(self) -> torch.Tensor:
        """The gradient of the ``n`` own slices, every reader's piece added."""
        self.transfer.wait()
        for at, piece in self.arrivals:
            if isinstance(at, int):
                self.grad_x.narrow(self.dim, at, piece.shape[self.dim]).add_(piece)
            else:
                self.grad_x.index_add_(self.dim, at, piece)
        return self.grad_x


def _exchange_backward_start(
    grad_strip: torch.Tensor, dim: int, recv_left: Count, recv_right: Count, send_left: Count,
    send_right: Count, nb: _Neighbours, n: int, *, picks: Optional[_Picks] = None,
) -> _GradientsInFlight:
    """Start the adjoint of :func:`_exchange_forward` and return at once (compute that does not
    need the own gradient can run while the halo gradients travel). With ``picks`` only the
    picked slices' gradients travel back (the others' are zero: no tap read them)."""
    recv_l, recv_r, send_l, send_r = (_hops(c) for c in (recv_left, recv_right, send_left, send_right))
    send_picks, recv_picks = (picks.send, picks.recv) if picks is not None else ({}, {})
    left = sum(recv_l)
    pieces, stop = [], left
    for h, c in enumerate(recv_l):  # the piece from h + 1 to the left sits just below the nearer ones
        pieces.append((-1 - h, stop - c, c))
        stop -= c
    start = left + n
    for h, c in enumerate(recv_r):
        pieces.append((1 + h, start, c))
        start += c
    sends = {}
    for offset, first, c in pieces:
        piece, chosen = grad_strip.narrow(dim, first, c), recv_picks.get(offset)
        sends[offset] = piece.contiguous() if chosen is None else piece.index_select(dim, _index(chosen, piece))
    recvs, arrivals = {}, []
    for offset, first, c in [(-1 - h, 0, c) for h, c in enumerate(send_l)] + [
            (1 + h, n - c, c) for h, c in enumerate(send_r)]:
        chosen = send_picks.get(offset)
        recvs[offset] = _empty_slices(grad_strip, dim, c if chosen is None else len(chosen))
        arrivals.append((first if chosen is None else _index(chosen, grad_strip), recvs[offset]))
    transfer = _start_transfer(sends, recvs, nb)
    return _GradientsInFlight(grad_strip.narrow(dim, left, n).clone(), arrivals, transfer, dim)


def _exchange_backward(
    grad_strip: torch.Tensor, dim: int, recv_left: Count, recv_right: Count, send_left: Count,
    send_right: Count, nb: _Neighbours, n: int, *, picks: Optional[_Picks] = None,
) -> torch.Tensor:
    """The adjoint of :func:`_exchange_forward` on plain tensors: the gradient of the ``n`` own slices."""
    return _exchange_backward_start(grad_strip, dim, recv_left, recv_right, send_left, send_right, nb, n,
                                    picks=picks).wait()


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_counts(x_shard: torch.Tensor, dim: int, counts: dict[str, Count], nb: _Neighbours) -> int:
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
        hops[name] = _hops(value)
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
    nb = _resolve_neighbours(group, mesh, mesh_dim)
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


def _counts_and_picks(counts: dict, window: Optional[ShardWindow], nb: _Neighbours) -> tuple[dict, Optional[_Picks]]:
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
    return dict(zip(counts, window.hops)), _picks_of(window)


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
