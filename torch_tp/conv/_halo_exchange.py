"""The plain-tensor halves of the halo exchange: the private API of ``torch_tp.conv``'s handlers.

:func:`torch_tp.conv.halo_exchange` (:mod:`torch_tp.conv.halo`) is the public, autograd-level
exchange; this module is what it is made of, on plain tensors and without autograd, for the
handlers that run the forward and the adjoint themselves (to keep an exchange in flight behind
compute, or to exchange inside their own backward). The module is private to ``torch_tp.conv``;
the names below are its declared API there (``__all__``). Outside ``conv/`` only
``benchmarks/halo_conv.py`` reaches in, to time ``HalosInFlight.wait`` / ``GradientsInFlight.wait``.

| name | what it does | used by |
| --- | --- | --- |
| :data:`Count` | a halo size: slices, or slices per hop (nearest rank first) | ``halo`` |
| :class:`Neighbours`, :func:`resolve_neighbours` | the exchanging group from ``group=`` or ``mesh=`` + ``mesh_dim=``: the rank's position, its peers' global ranks | ``halo``, ``sharded_conv``, ``pooling`` |
| :class:`Picks`, :func:`picks_of` | a :class:`~torch_tp.conv.ShardWindow`'s travelling positions (``None``: every position) | ``halo``, ``sharded_conv``, ``pooling`` |
| :func:`per_hop` | a count as its per-hop split | ``halo`` (count checks) |
| :func:`exchange_forward` | the forward exchange, started and waited for: ``cat(halo_left, x_shard, halo_right)`` | ``halo``, ``sharded_conv``, ``pooling`` |
| :func:`exchange_start`, :class:`HalosInFlight` | the forward exchange started; ``wait()`` gives the halos | ``sharded_conv`` (overlap) |
| :func:`exchange_backward` | the exact adjoint, started and waited for: the own slices' gradient | ``halo``, ``sharded_conv``, ``pooling`` |
| :func:`exchange_backward_start`, :class:`GradientsInFlight` | the adjoint started; ``wait()`` adds the returned halo gradients | ``sharded_conv`` (overlap) |
| :func:`settled_on_error` | waits for started exchanges before an error propagates | ``sharded_conv`` |
| :func:`start_transfer`, :class:`Transfer` | one batch of P2P ops to and from ranks some positions away, kept alive until waited for | the exchanges here |
| :func:`run_p2p` | one batch of ``dist.P2POp``, waited for | ``_ranges`` |

Each exchange takes the counts in one order, ``(x, dim, recv_left, recv_right, send_left,
send_right, neighbours)`` (the adjoint also ``n``, the own shard's length), each count an int
or per hop (:attr:`ShardWindow.hops <torch_tp.conv.ShardWindow.hops>` gives the four), and
``picks=`` (:func:`picks_of`). They validate nothing: :func:`~torch_tp.conv.halo_exchange`
checks the counts of a user's call, and a handler's counts come from the geometry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from torch_tp.conv._geometry import ShardWindow

__all__ = [
    "Count",
    "GradientsInFlight",
    "HalosInFlight",
    "Neighbours",
    "Picks",
    "Transfer",
    "exchange_backward",
    "exchange_backward_start",
    "exchange_forward",
    "exchange_start",
    "per_hop",
    "picks_of",
    "resolve_neighbours",
    "run_p2p",
    "settled_on_error",
    "start_transfer",
]

Count = Union[int, Sequence[int]]  # slices, or slices per hop (nearest rank first)


@dataclasses.dataclass(frozen=True)
class Neighbours:
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


def resolve_neighbours(group: Any, mesh: Any, mesh_dim: Any) -> Neighbours:
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
    return Neighbours(group, position, size, left, right)


@dataclasses.dataclass
class Transfer:
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
def settled_on_error(flights: list) -> Iterator[list]:
    """Yield ``flights``, a list to put started exchanges (``HalosInFlight`` /
    ``GradientsInFlight``) in; if the code inside raises, wait for them before the error
    propagates. An exchange left in flight would have the backend write into buffers Python
    frees with the failing frame (heap corruption, seen later and elsewhere). Every rank
    started the same exchanges before its local compute, so the wait completes."""
    try:
        yield flights
    except BaseException:
        for flight in flights:
            flight.transfer.wait()
        raise


def start_transfer(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], nb: Neighbours) -> Transfer:
    """Start one batch of P2P ops: ``sends[o]`` goes to, and ``recvs[o]`` is filled from, the
    rank ``o`` positions away (negative: left); ``recvs`` are filled once the returned
    :class:`Transfer` is waited for. Empty tensors are skipped; the ops are ordered by
    distance, left before right, send before receive (one hop: the neighbours' pattern)."""
    ops = []
    for offset in sorted(set(sends) | set(recvs), key=lambda o: (abs(o), o > 0)):
        for op, tensor in ((dist.isend, sends.get(offset)), (dist.irecv, recvs.get(offset))):
            if tensor is not None and tensor.numel():
                ops.append(dist.P2POp(op, tensor, peer=nb.peer(offset), group=nb.group))
    return Transfer(dist.batch_isend_irecv(ops) if ops else [], [op.tensor for op in ops])


def run_p2p(ops: list) -> None:
    """Issue ``ops`` (``dist.P2POp``) as one batch and wait for all of them."""
    Transfer(dist.batch_isend_irecv(ops) if ops else [], [op.tensor for op in ops]).wait()


@dataclasses.dataclass(frozen=True)
class Picks:
    """The slices of each halo piece that travel, keyed by hop offset (``-1 - h``: the rank
    ``h + 1`` to the left; ``1 + h``: to the right); a piece without an entry travels whole.

    ``send[o]`` indexes the own shard (0 is its first slice), ``recv[o]`` the received piece
    (0 is its first slice, the farthest from the own shard on the left).
    """

    send: dict
    recv: dict


@functools.lru_cache(maxsize=256)
def picks_of(window: Optional[ShardWindow]) -> Optional[Picks]:
    """The window's ``recv_picks`` / ``send_picks`` as :class:`Picks` (``None``: all dense).

    Example:
        >>> from torch_tp.conv import conv_windows
        >>> picks_of(conv_windows(16, 2, kernel_size=5, stride=2, dilation=2, padding=4)[1])
        Picks(send={-1: (0, 2)}, recv={-1: (0, 2)})
        >>> picks_of(conv_windows(16, 2, kernel_size=3, padding=1)[1]) is None
        True
    """
    if window is None or not (window.recv_picks or window.send_picks):
        return None
    recv = {q - window.rank: tuple(p - start for p in picks)
            for (q, start, stop), picks in zip(window.recv_ranges, window.recv_picks) if len(picks) < stop - start}
    send = {q - window.rank: tuple(p - window.in_start for p in picks)
            for (q, start, stop), picks in zip(window.send_ranges, window.send_picks) if len(picks) < stop - start}
    return Picks(send, recv)


def _index(positions: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=like.device)


def per_hop(count: Count) -> tuple[int, ...]:
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


@dataclasses.dataclass
class HalosInFlight:
    """The forward exchange, started: the halo buffers fill once :meth:`wait` returns."""

    halo_left: list[torch.Tensor]  # nearest rank first
    halo_right: list[torch.Tensor]
    transfer: Transfer
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


def exchange_start(
    x_shard: torch.Tensor, dim: int, recv_left: Count, recv_right: Count, send_left: Count, send_right: Count,
    nb: Neighbours, *, picks: Optional[Picks] = None,
) -> HalosInFlight:
    """Start the forward exchange (no autograd) and return at once: compute that does not read
    the halos can run while they are in flight (:mod:`torch_tp.conv.sharded_conv`). With
    ``picks``, only the picked slices of a piece travel; the others are zero on arrival."""
    n = x_shard.shape[dim]
    recv_l, recv_r, send_l, send_r = (per_hop(c) for c in (recv_left, recv_right, send_left, send_right))
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
    return HalosInFlight(halo_left, halo_right, start_transfer(sends, recvs, nb), dim, fills)


def exchange_forward(
    x_shard: torch.Tensor, dim: int, recv_left: Count, recv_right: Count, send_left: Count, send_right: Count,
    nb: Neighbours, *, picks: Optional[Picks] = None,
) -> torch.Tensor:
    """The forward exchange on plain tensors (no autograd): ``cat(halo_left, x_shard, halo_right)``.

    Each count is an int (one hop) or split per hop (:func:`per_hop`); the halo pieces are
    concatenated in position order (farthest left rank first). ``picks``: see
    :func:`exchange_start`.
    """
    halo_left, halo_right = exchange_start(x_shard, dim, recv_left, recv_right, send_left, send_right, nb,
                                            picks=picks).wait()
    return torch.cat([halo_left, x_shard, halo_right], dim=dim)


@dataclasses.dataclass
class GradientsInFlight:
    """The adjoint exchange, started: :meth:`wait` adds what arrives onto the own gradient."""

    grad_x: torch.Tensor  # the own slices' gradient, without the pieces still to arrive
    arrivals: list  # (first own slice or index of own slices, what a reader sends back)
    transfer: Transfer
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


def exchange_backward_start(
    grad_strip: torch.Tensor, dim: int, recv_left: Count, recv_right: Count, send_left: Count,
    send_right: Count, nb: Neighbours, n: int, *, picks: Optional[Picks] = None,
) -> GradientsInFlight:
    """Start the adjoint of :func:`exchange_forward` and return at once (compute that does not
    need the own gradient can run while the halo gradients travel). With ``picks`` only the
    picked slices' gradients travel back (the others' are zero: no tap read them)."""
    recv_l, recv_r, send_l, send_r = (per_hop(c) for c in (recv_left, recv_right, send_left, send_right))
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
    transfer = start_transfer(sends, recvs, nb)
    return GradientsInFlight(grad_strip.narrow(dim, left, n).clone(), arrivals, transfer, dim)


def exchange_backward(
    grad_strip: torch.Tensor, dim: int, recv_left: Count, recv_right: Count, send_left: Count,
    send_right: Count, nb: Neighbours, n: int, *, picks: Optional[Picks] = None,
) -> torch.Tensor:
    """The adjoint of :func:`exchange_forward` on plain tensors: the gradient of the ``n`` own slices."""
    return exchange_backward_start(grad_strip, dim, recv_left, recv_right, send_left, send_right, nb, n,
                                    picks=picks).wait()
