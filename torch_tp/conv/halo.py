"""Halo exchange: each rank borrows border slices from its neighbours along one tensor dim.

A tensor sharded along ``dim`` over the ranks of a process group (or of one mesh dim) is
extended on every rank by the last slices of its left neighbour's shard and the first slices
of its right neighbour's, with batched point-to-point messages between neighbours only (the
first rank has no left neighbour and the last no right one: nothing wraps around). The
backward is the exact adjoint: halo gradients go back to the ranks that own those slices and
are added there. :func:`halo_bytes` gives, from the geometry alone, the bytes each rank sends.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from torch_tp.conv._geometry import ShardWindow

__all__ = ["halo_bytes", "halo_exchange"]


@dataclasses.dataclass(frozen=True)
class _Neighbours:
    """Where this rank sits on the exchanging group: its position and its peers' global ranks."""

    group: Any  # ProcessGroup
    position: int
    size: int
    left: Optional[int]
    right: Optional[int]


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


def _send_recv(
    to_left: torch.Tensor,
    to_right: torch.Tensor,
    from_left: torch.Tensor,
    from_right: torch.Tensor,
    nb: _Neighbours,
) -> None:
    """Send ``to_left``/``to_right`` and fill ``from_left``/``from_right`` (empty ones skipped)."""
    ops = []
    for peer, send, recv in ((nb.left, to_left, from_left), (nb.right, to_right, from_right)):
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, peer=peer, group=nb.group))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, peer=peer, group=nb.group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _empty_slices(like: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    shape = list(like.shape)
    shape[dim] = count
    return like.new_empty(shape)


class _HaloExchange(torch.autograd.Function):
    """Autograd node of :func:`halo_exchange` (see its docstring for the formulas)."""

    @staticmethod
    def forward(ctx, x_shard, dim, recv_left, recv_right, send_left, send_right, nb):  # type: ignore
        ctx.args = (dim, recv_left, recv_right, send_left, send_right, nb, x_shard.shape[dim])  # no tensors
        return _exchange_forward(x_shard, dim, recv_left, recv_right, send_left, send_right, nb)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_strip):  # type: ignore[override]
        return _exchange_backward(grad_strip, *ctx.args), None, None, None, None, None, None


def _exchange_forward(
    x_shard: torch.Tensor, dim: int, recv_left: int, recv_right: int, send_left: int, send_right: int,
    nb: _Neighbours,
) -> torch.Tensor:
    """The forward exchange on plain tensors (no autograd): ``cat(halo_left, x_shard, halo_right)``."""
    n = x_shard.shape[dim]
    to_left = x_shard.narrow(dim, 0, send_left).contiguous()
    to_right = x_shard.narrow(dim, n - send_right, send_right).contiguous()
    halo_left = _empty_slices(x_shard, dim, recv_left)
    halo_right = _empty_slices(x_shard, dim, recv_right)
    _send_recv(to_left, to_right, halo_left, halo_right, nb)
    return torch.cat([halo_left, x_shard, halo_right], dim=dim)


def _exchange_backward(
    grad_strip: torch.Tensor, dim: int, recv_left: int, recv_right: int, send_left: int, send_right: int,
    nb: _Neighbours, n: int,
) -> torch.Tensor:
    """The adjoint of :func:`_exchange_forward` on plain tensors: the gradient of the ``n`` own slices."""
    grad_halo_left = grad_strip.narrow(dim, 0, recv_left).contiguous()
    grad_halo_right = grad_strip.narrow(dim, recv_left + n, recv_right).contiguous()
    grad_prefix = _empty_slices(grad_strip, dim, send_left)
    grad_suffix = _empty_slices(grad_strip, dim, send_right)
    _send_recv(grad_halo_left, grad_halo_right, grad_prefix, grad_suffix, nb)
    grad_x = grad_strip.narrow(dim, recv_left, n).clone()
    grad_x.narrow(dim, 0, send_left).add_(grad_prefix)
    grad_x.narrow(dim, n - send_right, send_right).add_(grad_suffix)
    return grad_x


def _check_counts(x_shard: torch.Tensor, dim: int, counts: dict[str, int], nb: _Neighbours) -> int:
    """Validate the four counts against the shard and the rank's position; return ``dim`` >= 0."""
    if x_shard.dim() == 0 or not -x_shard.dim() <= dim < x_shard.dim():
        raise ValueError(f"halo_exchange: dim={dim} is out of range for a {x_shard.dim()}-D shard")
    dim %= x_shard.dim()
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"halo_exchange: {name} must be an int >= 0, got {value!r}")
    n = x_shard.shape[dim]
    for name in ("send_left", "send_right"):
        if counts[name] > n:
            raise ValueError(
                f"halo_exchange: {name}={counts[name]} but this rank's shard holds only {n} slices "
                f"along dim {dim}"
            )
    edges = (("left", nb.left, "recv_left", "send_left"), ("right", nb.right, "recv_right", "send_right"))
    for side, peer, recv, send in edges:
        if peer is None and (counts[recv] or counts[send]):
            raise ValueError(
                f"halo_exchange: the rank at position {nb.position} of {nb.size} has no {side} neighbour "
                f"(nothing wraps around), so {recv} and {send} must be 0, "
                f"got {counts[recv]} and {counts[send]}"
            )
    return dim


def halo_exchange(
    x_shard: torch.Tensor,
    *,
    dim: int,
    recv_left: int,
    recv_right: int,
    send_left: int,
    send_right: int,
    group: Any = None,
    mesh: Any = None,
    mesh_dim: Any = None,
) -> torch.Tensor:
    """Extend this rank's shard with the border slices of its neighbours' shards along ``dim``.

    Shapes (along ``dim``; every other dim is unchanged): ``x_shard`` is ``[n]``, the result
    ``[recv_left + n + recv_right]``. Let ``L`` / ``R`` be the left / right neighbour's shard.

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

    Saved for backward: no tensors, only the four counts, ``n`` and the neighbours (the
    adjoint is linear and needs no activations). It is once differentiable: the messages are
    not themselves recorded by autograd, so double backward raises instead of being wrong.

    Keyword Args:
        dim: the tensor dim the shards are split along.
        recv_left, recv_right: slices received from the left / right neighbour.
        send_left, send_right: slices sent to the left / right neighbour; must equal that
            neighbour's ``recv_right`` / ``recv_left`` (``conv_windows`` gives consistent counts).
        group: the process group whose ranks, in group order, hold consecutive shards. Or:
        mesh, mesh_dim: a ``DeviceMesh`` and the dim (name or index) the tensor is sharded
            over; the rank's position is its coordinate on that dim, and only ranks of its
            sub-group exchange. ``mesh_dim`` may be left out on a 1-D mesh.

    Returns:
        ``cat(halo_left, x_shard, halo_right)`` along ``dim``, differentiable w.r.t. ``x_shard``.

    Raises:
        ValueError: negative or non-int counts, sending more slices than the shard holds,
            a halo on the side of an edge rank that has no neighbour there, ``dim`` out of
            range, a DTensor instead of its local shard, or not exactly one of ``group`` / ``mesh``.

    Example::

        >>> # xdoctest: +SKIP("needs a process group of 2 ranks")
        >>> x = torch.arange(4.0) + 4 * rank          # rank 0: [0, 1, 2, 3], rank 1: [4, 5, 6, 7]
        >>> w = conv_windows(8, 2, kernel_size=3, padding=1)[rank]
        >>> halo_exchange(x, dim=0, recv_left=w.recv_left, recv_right=w.recv_right,
        ...               send_left=w.send_left, send_right=w.send_right, mesh=tp_mesh)
        tensor([0., 1., 2., 3., 4.])                 # rank 0
        tensor([3., 4., 5., 6., 7.])                 # rank 1

    .. note::
        Like a collective, every rank of the group calls it, and if one rank backpropagates
        through it all must (a rank whose loss does not depend on the result still has halo
        gradients to receive and send: add ``0 * out.sum()``). The counts of neighbouring ranks
        must agree; a mismatch is not detected locally (the backend fails or hangs until its
        timeout). With NCCL, the first P2P call on a group must involve all of its ranks; a
        rank with nothing to exchange issues no call.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(x_shard, DTensor):
        raise ValueError("halo_exchange takes the local shard (x.to_local()), not a DTensor")
    nb = _resolve_neighbours(group, mesh, mesh_dim)
    counts = dict(recv_left=recv_left, recv_right=recv_right, send_left=send_left, send_right=send_right)
    dim = _check_counts(x_shard, dim, counts, nb)
    return _HaloExchange.apply(x_shard, dim, recv_left, recv_right, send_left, send_right, nb)


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

    Returns:
        ``list[int]`` indexed by the rank's position on the sharded dim. Inner ranks send up to
        two halos, edge ranks at most one.

    Example:
        >>> from torch_tp.conv import conv_windows
        >>> windows = conv_windows(30, 4, kernel_size=4, padding="same")  # pads (1, 2)
        >>> [(w.send_left, w.send_right) for w in windows]
        [(0, 1), (2, 1), (2, 1), (2, 0)]
        >>> halo_bytes(windows, slice_numel=3, element_size=4)
        [12, 36, 36, 24]
        >>> halo_bytes(windows, slice_numel=3, element_size=4, direction="backward")
        [24, 36, 36, 12]
    """
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    per_slice = slice_numel * element_size
    if direction == "forward":
        return [(w.send_left + w.send_right) * per_slice for w in windows]
    return [(w.recv_left + w.recv_right) * per_slice for w in windows]
