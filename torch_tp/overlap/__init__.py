"""Communication/computation-overlapped tensor parallelism on any backend (gloo on CPU included).

A sequence-parallel ``ColwiseParallel`` layer all-gathers its input and then multiplies;
a sequence-parallel ``RowwiseParallel`` layer multiplies and then reduce-scatters. The fused
ops here split that work into one step per rank: while the chunk a rank already holds is
multiplied, the next chunk (or the running partial sum) travels to the neighbouring rank
by P2P. See ``docs/overlap.md`` for the schedule and its timeline.

- :func:`all_gather_matmul`: ``(all_gather(a_shard), [all_gather(a_shard) @ b for b in bs])``
- :func:`matmul_reduce_scatter`: ``reduce_scatter(a @ b)``
- :func:`all_gather_then_matmul`, :func:`matmul_then_reduce_scatter`: the same results
  computed the unfused way (one collective, then one matmul), for comparison.

The fused ops are ``torch.library`` custom ops (``torch.ops.torch_tp.all_gather_matmul`` /
``matmul_reduce_scatter``) with fake implementations and autograd, so they trace under
``torch.compile(fullgraph=True)`` as single nodes and train. ``b`` may be an
:class:`~torch_tp.quant.Int8SymmetricTensor`: the int8 bytes are consumed chunk by chunk.
In a model, use ``ColwiseParallel(overlap=True)`` / ``RowwiseParallel(overlap=True)``.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> from torch_tp.overlap import all_gather_matmul, matmul_reduce_scatter
    >>> x = torch.randn(2, 8, 64)                        # this rank's 8 tokens of the sequence
    >>> gathered, (h,) = all_gather_matmul(x, [w1.t()], gather_dim=1, group=mesh)
    >>> y = matmul_reduce_scatter(h, w2.t(), scatter_dim=1, group=mesh)   # back to 8 tokens
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from torch_tp.overlap import _custom_ops
from torch_tp.overlap._custom_ops import REDUCE_OPS

__all__ = [
    "REDUCE_OPS",
    "all_gather_matmul",
    "all_gather_then_matmul",
    "group_name_of",
    "matmul_reduce_scatter",
    "matmul_then_reduce_scatter",
]

Group = Union[dist.ProcessGroup, str, DeviceMesh]


def group_name_of(group: Group) -> str:
    """The registered name of ``group``: a ``ProcessGroup``, its name, or a 1-D ``DeviceMesh``.

    Example::

        >>> group_name_of("tp-group-name")
        'tp-group-name'
    """
    if isinstance(group, str):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"the fused ops run over one mesh dim; got a {group.ndim}-D DeviceMesh "
                f"{group.mesh_dim_names}: pass mesh['tp'] (or that dim's name)"
            )
        return group.get_group().group_name
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    raise TypeError(f"group must be a ProcessGroup, its name (str) or a 1-D DeviceMesh; got {type(group).__name__}")


def _leading_dim(dim: int, ndim: int, argument: str, op: str) -> int:
    if not isinstance(dim, int):
        raise TypeError(f"{op}: {argument} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: {argument}={dim} is out of range for a {ndim}-D input")
    return dim % ndim


def all_gather_matmul(
    a_shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    gather_dim: int,
    group: Group,
    *,
    check_shapes: bool = True,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All-gather ``a_shard`` on ``gather_dim`` and multiply by each ``b``, overlapping the two.

    Args:
        a_shard: this rank's shard, ``(..., K)``; every rank passes the same shape.
        bs: matrices ``(K, N_i)`` (e.g. ``linear.weight.t()``; float or
            :class:`~torch_tp.quant.Int8SymmetricTensor`).
        gather_dim: the dim that is sharded over the ranks; any dim but the last.
        group: a ``ProcessGroup``, its name, or a 1-D ``DeviceMesh``.
        check_shapes: first compare the ranks' ``a_shard`` shapes (one small all-gather), so
            that uneven shards raise ``ValueError`` on every rank; with ``False`` a mismatch
            fails inside the P2P transfer instead (gloo aborts the process). Skipped while
            ``torch.compile`` traces; the styles skip it because DTensor shapes are known.

    Returns:
        ``(a_gathered, [a_gathered @ b for b in bs])``, both gathered on ``gather_dim``.

    Raises ``ValueError`` for a ``gather_dim`` that is the contracted (last) dim, for ``b``
    shapes that do not fit ``a_shard`` and for shards of different shapes.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> x = torch.randn(4, 16)                        # 4 of the 4 * world rows
        >>> rows, (y,) = all_gather_matmul(x, [torch.randn(16, 8)], gather_dim=0, group=mesh)
        >>> y.shape
        torch.Size([8, 8])    # world size 2
    """
    op = "all_gather_matmul"
    if isinstance(bs, torch.Tensor):
        raise TypeError(f"{op}: bs is a list of matrices; wrap a single one as [b]")
    gather_dim = _leading_dim(gather_dim, a_shard.ndim, "gather_dim", op)
    name = group_name_of(group)
    if check_shapes and not torch.compiler.is_compiling():
        _require_same_shapes(a_shard, name, op)
    return torch.ops.torch_tp.all_gather_matmul(a_shard, list(bs), gather_dim, name)


def _require_same_shapes(a_shard: torch.Tensor, group_name: str, op: str) -> None:
    """Raise ``ValueError`` on every rank unless all ranks' shards have one shape."""
    group = _custom_ops.resolve_group(group_name)
    mine = torch.tensor([a_shard.ndim, *a_shard.shape], dtype=torch.int64)
    padded = torch.full((9,), -1, dtype=torch.int64)  # ndim, then up to 8 sizes
    padded[: min(9, mine.numel())] = mine[:9]
    padded = padded.to(a_shard.device)  # NCCL only moves device tensors
    if group.size() > 1:
        shapes = [torch.empty_like(padded) for _ in range(group.size())]
        dist.all_gather(shapes, padded, group=group)
        if any(not torch.equal(s, padded) for s in shapes):
            described = [tuple(s[1 : 1 + int(s[0])].tolist()) for s in shapes]
            raise ValueError(
                f"{op}: the ranks' inputs have different shapes {described}; every rank must "
                f"pass the same shape (shard the gathered dim evenly, e.g. pad the sequence to a "
                f"multiple of {group.size()})"
            )


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    scatter_dim: int,
    group: Group,
    reduce_op: str = "sum",
    *,
    check_shapes: bool = True,
) -> torch.Tensor:
    """``reduce_scatter(a @ b)`` on ``scatter_dim``, each step's transfer overlapping a matmul.

    Args:
        a: this rank's ``(..., K)`` operand (e.g. activations sharded on features).
        b: ``(K, N)`` (float or :class:`~torch_tp.quant.Int8SymmetricTensor`).
        scatter_dim: the dim to scatter over the ranks; any dim but the last, and its size
            must divide by the group size (uneven sizes raise ``ValueError``).
        group: a ``ProcessGroup``, its name, or a 1-D ``DeviceMesh``.
        reduce_op: ``"sum"`` (default) or ``"avg"``.
        check_shapes: first compare the ranks' ``a`` shapes, as in :func:`all_gather_matmul`.

    Returns:
        This rank's chunk of the reduced ``a @ b``: ``(..., N)`` with ``scatter_dim`` divided
        by the group size.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> y = matmul_reduce_scatter(torch.randn(2, 16, 32), w2.t(), scatter_dim=1, group=mesh)
        >>> y.shape   # world size 2, w2: (64, 32)
        torch.Size([2, 8, 64])
    """
    op = "matmul_reduce_scatter"
    scatter_dim = _leading_dim(scatter_dim, a.ndim, "scatter_dim", op)
    name = group_name_of(group)
    if check_shapes and not torch.compiler.is_compiling():
        _require_same_shapes(a, name, op)
    return torch.ops.torch_tp.matmul_reduce_scatter(a, b, scatter_dim, name, reduce_op)


def all_gather_then_matmul(
    a_shard: torch.Tensor, bs: Sequence[torch.Tensor], gather_dim: int, group: Group
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What :func:`all_gather_matmul` computes, done unfused: one all-gather, then the matmuls.

    Differentiable (the all-gather's backward is a reduce-scatter).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> rows, (y,) = all_gather_then_matmul(x, [w.t()], gather_dim=0, group=mesh)
    """
    gather_dim = _leading_dim(gather_dim, a_shard.ndim, "gather_dim", "all_gather_then_matmul")
    gathered = funcol.all_gather_single_autograd(a_shard, gather_dim, group_name_of(group))
    return gathered, [gathered @ b for b in bs]


def matmul_then_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, scatter_dim: int, group: Group, reduce_op: str = "sum"
) -> torch.Tensor:
    """What :func:`matmul_reduce_scatter` computes, done unfused: the matmul, then one reduce-scatter.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> y = matmul_then_reduce_scatter(h, w2.t(), scatter_dim=1, group=mesh)
    """
    scatter_dim = _leading_dim(scatter_dim, a.ndim, "scatter_dim", "matmul_then_reduce_scatter")
    _custom_ops.check_reduce_op(reduce_op, "matmul_then_reduce_scatter")
    name = group_name_of(group)
    # "sum" then divide: the functional reduce-scatter has no backward for "avg"
    out = funcol.reduce_scatter_single_autograd(a @ b, "sum", scatter_dim, name)
    return out / _custom_ops.group_size(name) if reduce_op == "avg" else out
