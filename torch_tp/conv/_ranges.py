"""Moving exact index ranges between the ranks of one mesh dim (upsampling, transposed convolution).

Where a halo exchange (:mod:`torch_tp.conv.halo`) extends each shard by slices adjoining it, the
ops here read arbitrary ranges: upsampling's output chunk reads input positions that need not
line up with the rank's own strip, and a transposed convolution's strip writes outputs owned by
other ranks. :class:`_Ranges` records who holds and who reads what (every rank knows every
rank's ranges, so no sizes are exchanged); :func:`_gather` assembles a rank's reads from their
holders and :func:`_scatter_add` is its exact adjoint. One batch of P2P ops each.

A range may have positions that do not count (a transposed convolution with stride > 1 reaches
only some outputs of its span): ``picks`` lists, per rank, the positions of its ``needs``
outside its own ``bounds`` that travel; the others are neither sent nor received (zero in a
gathered range, nothing added in a scatter).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from torch_tp.conv._halo_exchange import run_p2p

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class _Ranges:
    """Who holds and who reads which global positions along the sharded dim.

    ``bounds[q]`` is the ``[start, stop)`` rank ``q`` holds (``torch.chunk`` rule), ``needs[q]``
    the ``[lo, hi)`` it reads (``lo == hi``: nothing). :func:`_gather` assembles ``needs`` from
    the holders, wherever they sit on the mesh dim; :func:`_scatter_add` is its exact adjoint.
    ``picks[q]``: the sorted positions of ``needs[q]`` outside ``bounds[q]`` that travel
    (``None``, or ``picks`` itself ``None``: all of them).
    """

    bounds: tuple
    needs: tuple
    position: int
    group: Any
    peers: tuple  # global rank of each position
    picks: Optional[tuple] = None

    def picked(self, q: int, span: tuple[int, int]) -> Optional[tuple[int, ...]]:
        """The travelling positions of ``needs[q]`` in ``span`` (``None``: every position).

        Example:
            >>> _Ranges(((0, 4), (4, 8)), ((0, 6), (3, 8)), 0, None, (0, 1), ((4,), None)).picked(0, (4, 6))
            (4,)
        """
        chosen = self.picks[q] if self.picks is not None else None
        return None if chosen is None else tuple(p for p in chosen if span[0] <= p < span[1])


def _ranges(mesh: Any, mesh_dim: int, bounds: Sequence, needs: Sequence, picks: Optional[Sequence] = None) -> _Ranges:
    group = mesh.get_group(mesh_dim)
    peers = tuple(dist.get_global_rank(group, q) for q in range(mesh.size(mesh_dim)))
    chosen = None if picks is None or all(p is None for p in picks) else tuple(picks)
    return _Ranges(tuple(bounds), tuple(needs), mesh.get_local_rank(mesh_dim), group, peers, chosen)


def _overlap(a: tuple, b: tuple) -> tuple[int, int]:
    return max(a[0], b[0]), min(a[1], b[1])


def _slices(like: torch.Tensor, dim: int, count: int, fill: Optional[float] = None) -> torch.Tensor:
    shape = list(like.shape)
    shape[dim] = count
    return like.new_empty(shape) if fill is None else like.new_full(shape, fill)


def _move(src: torch.Tensor, src_start: int, dst: torch.Tensor, dst_start: int, dim: int, rg: _Ranges,
          transfers: list, add: bool) -> torch.Tensor:
    """One batch of P2P ops: per rank ``q``, ``(q, peer, sent, received)``, each a global range
    ``(start, stop)`` and its travelling positions (``None``: all); the sent one is read from
    ``src`` (which starts at global position ``src_start``), the received one copied (or, with
    ``add``, added) into ``dst`` (starting at ``dst_start``); this rank's own range is combined
    locally, whole."""
    ops, received = [], []
    for q, peer, ((s0, s1), s_picks), ((r0, r1), r_picks) in transfers:
        if q == rg.position:
            if r1 > r0:
                _combine(dst, dim, r0 - dst_start, src.narrow(dim, r0 - src_start, r1 - r0), None, add)
            continue
        if s1 > s0 and (s_picks is None or s_picks):
            piece = (src.narrow(dim, s0 - src_start, s1 - s0).contiguous() if s_picks is None
                     else src.index_select(dim, _index(s_picks, src_start, src)))
            ops.append(dist.P2POp(dist.isend, piece, peer=peer, group=rg.group))
        if r1 > r0 and (r_picks is None or r_picks):
            index = None if r_picks is None else _index(r_picks, dst_start, dst)
            received.append((r0 - dst_start, index, _slices(src, dim, r1 - r0 if index is None else len(index))))
            ops.append(dist.P2POp(dist.irecv, received[-1][2], peer=peer, group=rg.group))
    run_p2p(ops)
    for at, index, buf in received:
        _combine(dst, dim, at, buf, index, add)
    return dst


def _index(positions: tuple, start: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([p - start for p in positions], dtype=torch.long, device=like.device)


def _combine(dst: torch.Tensor, dim: int, at: int, buf: torch.Tensor, index: Optional[torch.Tensor],
             add: bool) -> None:
    """``buf`` copied or added into ``dst`` from position ``at`` on, or at ``index``."""
    if index is not None:
        (dst.index_add_ if add else dst.index_copy_)(dim, index, buf)
        return
    target = dst.narrow(dim, at, buf.shape[dim])
    target.add_(buf) if add else target.copy_(buf)


def _transfers(rg: _Ranges) -> list:
    """Per rank ``q``: ``(q, peer, held_for_q, read_from_q)``, the positions this rank holds that
    ``q`` reads and those ``q`` holds that this rank reads, each ``((start, stop), picks)``
    (empty when ``start >= stop``; ``picks`` ``None`` for every position)."""
    me = rg.position
    mine, reads = rg.bounds[me], rg.needs[me]
    out = []
    for q, peer in enumerate(rg.peers):
        held, read = _overlap(mine, rg.needs[q]), _overlap(rg.bounds[q], reads)
        out.append((q, peer, (held, rg.picked(q, held)), (read, rg.picked(me, read))))
    return out


def _gather(shard: torch.Tensor, dim: int, rg: _Ranges) -> torch.Tensor:
    """This rank's ``needs`` slice ``[lo, hi)`` along ``dim``, from the ranks that hold it (zero
    at the positions ``picks`` leaves out)."""
    (start, stop), (lo, hi) = rg.bounds[rg.position], rg.needs[rg.position]
    assert shard.shape[dim] == stop - start, (shard.shape, dim, rg.bounds)
    sparse = rg.picks is not None and rg.picks[rg.position] is not None
    out = _slices(shard, dim, hi - lo, fill=0 if sparse else None)
    return _move(shard, start, out, lo, dim, rg, _transfers(rg), add=False)


def _scatter_add(strip: torch.Tensor, dim: int, rg: _Ranges) -> torch.Tensor:
    """The adjoint of :func:`_gather`: each slice of ``strip`` (this rank's ``needs``) goes to
    its holder, and every rank returns the sum of what lands in its own ``bounds``."""
    (start, stop), (lo, hi) = rg.bounds[rg.position], rg.needs[rg.position]
    assert strip.shape[dim] == hi - lo, (strip.shape, dim, rg.needs)
    reversed_transfers = [(q, peer, read, held) for q, peer, held, read in _transfers(rg)]
    out = _slices(strip, dim, stop - start, fill=0)
    return _move(strip, lo, out, start, dim, rg, reversed_transfers, add=True)
