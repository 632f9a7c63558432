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
