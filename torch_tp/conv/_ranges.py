"""Moving exact index ranges between the ranks of one mesh dim (upsampling, transposed convolution).

Where a halo exchange (:mod:`torch_tp.conv.halo`) extends each shard by slices adjoining it, the
ops here read arbitrary ranges: upsampling's output chunk reads input positions that need not
line up with the rank's own strip, and a transposed convolution's strip writes outputs owned by
other ranks. :class:`_Ranges` records who holds and who reads what (every rank knows every
rank's ranges, so no sizes are exchanged); :func:`_gather` assembles a rank's reads from their
holders and :func:`_scatter_add` is its exact adjoint. One batch of P2P ops each.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from torch_tp.conv.halo import _run_p2p

__all__: list[str] = []


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


def _move(src: torch.Tensor, src_start: int, dst: torch.Tensor, dst_start: int, dim: int, rg: _Ranges,
          transfers: list, combine: Any) -> torch.Tensor:
    """One batch of P2P ops: per rank ``q``, ``(q, peer, sent, received)`` global ranges; the sent
    one is read from ``src`` (which starts at global position ``src_start``), the received one
    ``combine``-d into ``dst`` (starting at ``dst_start``); this rank's own range is combined locally."""
    ops, received = [], []
    for q, peer, (s0, s1), (r0, r1) in transfers:
        if q == rg.position:
            if r1 > r0:
                combine(dst.narrow(dim, r0 - dst_start, r1 - r0), src.narrow(dim, r0 - src_start, r1 - r0))
            continue
        if s1 > s0:
            piece = src.narrow(dim, s0 - src_start, s1 - s0).contiguous()
            ops.append(dist.P2POp(dist.isend, piece, peer=peer, group=rg.group))
        if r1 > r0:
            received.append((r0 - dst_start, _slices(src, dim, r1 - r0)))
            ops.append(dist.P2POp(dist.irecv, received[-1][1], peer=peer, group=rg.group))
    _run_p2p(ops)
    for at, buf in received:
        combine(dst.narrow(dim, at, buf.shape[dim]), buf)
    return dst


def _transfers(rg: _Ranges) -> list:
    """Per rank ``q``: ``(q, peer, held_for_q, read_from_q)``, the positions this rank holds that
    ``q`` reads and those ``q`` holds that this rank reads (empty when ``lo >= hi``)."""
    mine, reads = rg.bounds[rg.position], rg.needs[rg.position]
    return [(q, peer, _overlap(mine, rg.needs[q]), _overlap(rg.bounds[q], reads)) for q, peer in enumerate(rg.peers)]


def _gather(shard: torch.Tensor, dim: int, rg: _Ranges) -> torch.Tensor:
    """This rank's ``needs`` slice ``[lo, hi)`` along ``dim``, from the ranks that hold it."""
    (start, stop), (lo, hi) = rg.bounds[rg.position], rg.needs[rg.position]
    assert shard.shape[dim] == stop - start, (shard.shape, dim, rg.bounds)
    return _move(shard, start, _slices(shard, dim, hi - lo), lo, dim, rg, _transfers(rg), torch.Tensor.copy_)


def _scatter_add(strip: torch.Tensor, dim: int, rg: _Ranges) -> torch.Tensor:
    """The adjoint of :func:`_gather`: each slice of ``strip`` (this rank's ``needs``) goes to
    its holder, and every rank returns the sum of what lands in its own ``bounds``."""
    (start, stop), (lo, hi) = rg.bounds[rg.position], rg.needs[rg.position]
    assert strip.shape[dim] == hi - lo, (strip.shape, dim, rg.needs)
    reversed_transfers = [(q, peer, read, held) for q, peer, held, read in _transfers(rg)]
    out = _slices(strip, dim, stop - start, fill=0)
    return _move(strip, lo, out, start, dim, rg, reversed_transfers, torch.Tensor.add_)
