"""The fused ops' public functions: argument handling around ``torch.ops.torch_tp.*``, the unfused
references, and the seam for weight tensor subclasses.

:func:`all_gather_matmul` and :func:`matmul_reduce_scatter` accept a ``ProcessGroup``, its
name or a 1-D ``DeviceMesh``, negative dims, and check the ranks' shapes before the ring
starts; :func:`all_gather_then_matmul` / :func:`matmul_then_reduce_scatter` compute the same
results unfused. A weight subclass whose matmul the ring cannot express as ``rows @ b``
(:class:`~torch_tp.quant.Int8SymmetricTensor`) registers its own custom ops around
:func:`ring_all_gather_matmul` / :func:`ring_matmul_reduce_scatter` (the same rings with the
chunk product supplied; :func:`int8_ring_all_gather_matmul` / :func:`int8_ring_matmul_reduce_scatter`
for the rings of ``comm_dtype=torch.int8``, which move int8 tokens) and validates with :func:`check_all_gather_matmul` /
:func:`check_matmul_reduce_scatter`: that is the whole seam, no private import.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> gathered, (h,) = all_gather_matmul(x, [w1.t()], gather_dim=1, group=mesh)
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from torch_tp._agreement import Fact, agree_or_raise
from torch_tp.overlap import _custom_ops, _int8_comm
from torch_tp.overlap._custom_ops import REDUCE_OPS, check_all_gather_matmul, check_matmul_reduce_scatter

__all__ = [
    "REDUCE_OPS",
    "all_gather_matmul",
    "all_gather_then_matmul",
    "check_all_gather_matmul",
    "check_matmul_reduce_scatter",
    "group_name_of",
    "int8_ring_all_gather_matmul",
    "int8_ring_matmul_reduce_scatter",
    "matmul_reduce_scatter",
    "matmul_then_reduce_scatter",
    "ring_all_gather_matmul",
    "ring_matmul_reduce_scatter",
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
        check_shapes: first check every rank's arguments together, with one all-gather of an
            8-byte digest per rank (each rank receives ``8 * world`` bytes; the details are
            gathered only when something is wrong): each rank checks its own arguments and
            the ranks compare ``a_shard``'s dtype, contracted dim ``K`` and shape,
            ``gather_dim``, and the shape and kind (plain or subclass) of each ``b``. Any error
            or difference then raises on every rank before the first transfer: a rank whose
            own arguments are wrong raises its own error, the others a ``ValueError`` naming
            that rank and why; a difference raises ``ValueError`` naming what differs, each
            rank's value and what to change. With ``False`` each rank only checks its own
            arguments, and ranks that disagree fail inside the P2P transfer (gloo aborts the
            process) or compute garbage. Skipped while ``torch.compile`` traces; the styles
            skip it because DTensor shapes are known.

    Returns:
        ``(a_gathered, [a_gathered @ b for b in bs])``, both gathered on ``gather_dim``.

    Raises ``ValueError`` for a ``gather_dim`` that is the contracted (last) dim, an empty
    ``a_shard`` (``K = 0`` included), ``b`` shapes that do not fit ``a_shard`` and (with
    ``check_shapes``) ranks whose arguments differ; ``TypeError`` for a ``b`` of another dtype.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> x = torch.randn(4, 16)                        # 4 of the 4 * world rows
        >>> rows, (y,) = all_gather_matmul(x, [torch.randn(16, 8)], gather_dim=0, group=mesh)
        >>> y.shape
        torch.Size([8, 8])    # world size 2
    """
    op = "all_gather_matmul"
    name = group_name_of(group)
    if check_shapes and not torch.compiler.is_compiling():
        _check_on_every_rank(op, name, a_shard, partial(_all_gather_matmul_facts, a_shard, bs, gather_dim))
    bs = _matrix_list(bs, op)
    gather_dim = _leading_dim(gather_dim, a_shard.ndim, "gather_dim", op)
    return torch.ops.torch_tp.all_gather_matmul(a_shard, bs, gather_dim, name)


def _matrix_list(bs: Sequence[torch.Tensor], op: str) -> list[torch.Tensor]:
    if isinstance(bs, torch.Tensor):
        raise TypeError(f"{op}: bs is a list of matrices; wrap a single one as [b]")
    return list(bs)


def _all_gather_matmul_facts(a_shard: torch.Tensor, bs, gather_dim: int, world: int) -> list[Fact]:
    """This rank's arguments, checked as the op checks them, then stated for the other ranks."""
    op = "all_gather_matmul"
    bs = _matrix_list(bs, op)
    gather_dim = _leading_dim(gather_dim, a_shard.ndim, "gather_dim", op)
    check_all_gather_matmul(a_shard, bs, gather_dim)
    count = Fact("calls pass different numbers of matrices in bs", len(bs), _SAME_WEIGHTS)
    matrices = _matrix_facts([(f"bs[{i}]", b) for i, b in enumerate(bs)])
    return _input_facts(a_shard, "gather_dim", gather_dim, world) + [count] + matrices


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
        check_shapes: first check every rank's arguments together, as in
            :func:`all_gather_matmul` (one all-gather of 8 bytes per rank; ``reduce_op``
            and ``scatter_dim`` are compared too). The size of ``scatter_dim`` is checked
            against the group size once the ranks agree on the shape.

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
    name = group_name_of(group)
    if check_shapes and not torch.compiler.is_compiling():
        _check_on_every_rank(op, name, a, partial(_matmul_reduce_scatter_facts, a, b, scatter_dim, reduce_op))
    scatter_dim = _leading_dim(scatter_dim, a.ndim, "scatter_dim", op)
    return torch.ops.torch_tp.matmul_reduce_scatter(a, b, scatter_dim, name, reduce_op)


def _matmul_reduce_scatter_facts(
    a: torch.Tensor, b: torch.Tensor, scatter_dim: int, reduce_op: str, world: int
) -> list[Fact]:
    """This rank's arguments, checked as the op checks them (but for the split of ``scatter_dim``
    over the group, which the ranks check once they agree on the shape), then stated."""
    scatter_dim = _leading_dim(scatter_dim, a.ndim, "scatter_dim", "matmul_reduce_scatter")
    _custom_ops.check_matmul_reduce_scatter_operands(a, b, scatter_dim, reduce_op)
    op_fact = Fact("calls pass different reduce_op values", reduce_op, "every rank must pass the same reduce_op")
    return _input_facts(a, "scatter_dim", scatter_dim, world) + [op_fact] + _matrix_facts([("b", b)])


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


# ------------------------------------------------------------------ the seam for weight subclasses

ChunkMatmul = Callable[[torch.Tensor], list[torch.Tensor]]


def ring_all_gather_matmul(
    a_shard: torch.Tensor, chunk_matmul: ChunkMatmul, gather_dim: int, group_name: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`all_gather_matmul`'s ring with the chunk product supplied: ``chunk_matmul(rows)``
    returns ``[rows @ b for each b]`` for one rank's chunk of rows (2-D, ``(m, K)``).

    For weight subclasses that register their own custom op (the int8 weights of
    :mod:`torch_tp.quant` pass ``qdata`` and ``scale`` as plain tensors). Outputs are
    contiguous, gathered on ``gather_dim``; no autograd (wrap it in a custom op).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> gathered, (y,) = ring_all_gather_matmul(x, lambda rows: [rows @ w.t()], 1, group_name)
    """
    return _custom_ops.run_all_gather_matmul(a_shard, chunk_matmul, gather_dim, group_name)


def ring_matmul_reduce_scatter(
    a: torch.Tensor, chunk_matmul: ChunkMatmul, scatter_dim: int, group_name: str, reduce_op: str = "sum"
) -> torch.Tensor:
    """:func:`matmul_reduce_scatter`'s ring with the chunk product supplied (one output):
    ``chunk_matmul(rows)`` returns ``[rows @ b]``.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> y = ring_matmul_reduce_scatter(h, lambda rows: [rows @ w2.t()], 1, group_name)
    """
    return _custom_ops.run_matmul_reduce_scatter(a, chunk_matmul, scatter_dim, group_name, reduce_op)


def int8_ring_all_gather_matmul(
    a_shard: torch.Tensor, chunk_matmul: ChunkMatmul, out_features: Sequence[int], gather_dim: int, group_name: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`ring_all_gather_matmul` whose ring moves every token as int8 with one float32 scale
    (``torch.ops.torch_tp.int8_all_gather_matmul``'s ring): ``chunk_matmul(rows)`` gets each
    chunk dequantized, ``(m, K)``, and returns ``[rows @ b for each b]`` of ``out_features``
    columns each. No autograd (wrap it in a custom op).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> gathered, (y,) = int8_ring_all_gather_matmul(x, lambda rows: [rows @ w.t()], [w.shape[0]], 1, name)
    """
    return _int8_comm.run_int8_all_gather_matmul(a_shard, chunk_matmul, list(out_features), gather_dim, group_name)


def int8_ring_matmul_reduce_scatter(
    a: torch.Tensor, chunk_matmul: ChunkMatmul, out_features: int, scatter_dim: int, group_name: str
) -> torch.Tensor:
    """:func:`ring_matmul_reduce_scatter` whose partial sums travel as int8 with one scale per token
    (``torch.ops.torch_tp.matmul_int8_reduce_scatter``'s schedule, summed in float32 on arrival):
    ``chunk_matmul(rows)`` returns ``[rows @ b]`` of ``out_features`` columns.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> y = int8_ring_matmul_reduce_scatter(h, lambda rows: [rows @ w2.t()], w2.shape[0], 1, name)
    """
    return _int8_comm.run_matmul_int8_reduce_scatter(a, chunk_matmul, out_features, scatter_dim, group_name)


# ------------------------------------------------------------------ one argument check across the ranks
#
# With check_shapes=True each rank checks its own arguments and states its operands as facts;
# torch_tp._agreement compares them (one all-gather of 8 bytes per rank) and every rank raises
# the same way before any transfer: no rank is left inside a collective.


def _check_on_every_rank(op: str, group_name: str, a, checked_facts: Callable[[int], list[Fact]]) -> None:
    """Run this rank's checks, ``checked_facts(group size)``, and raise on every rank of the
    group, before any transfer, if they failed on any rank or the ranks' facts differ."""
    group = _custom_ops.resolve_group(group_name)
    try:
        problem, facts = None, checked_facts(group.size())
    except Exception as error:  # noqa: BLE001  any error here is reported to every rank, then raised
        problem, facts = error, []
    agree_or_raise(group, problem, facts, what=op)


_SAME_WEIGHTS = "every rank must pass the same weights"


def _input_facts(a: torch.Tensor, dim_name: str, dim: int, world: int) -> list[Fact]:
    """The input's dtype, then ``K`` (so another weight is named as such), its shape, and the dim."""
    even = f"shard the gathered dim evenly, e.g. pad the sequence to a multiple of {world}"
    return [
        Fact("inputs have different dtypes", a.dtype, "every rank must pass the same dtype (convert with .to(dtype))"),
        Fact("inputs have different contracted (last) dims K", a.shape[-1], "every rank must multiply by one weight"),
        Fact("inputs have different shapes", tuple(a.shape), f"every rank must pass the same shape ({even})"),
        Fact(f"calls pass different {dim_name} values", dim, f"every rank must pass the same {dim_name}"),
    ]


def _matrix_facts(named: list[tuple[str, torch.Tensor]]) -> list[Fact]:
    """Each matrix's shape and kind, in order."""
    facts = []
    for name, b in named:
        facts.append(Fact(f"matrices {name} have different shapes", tuple(b.shape), _SAME_WEIGHTS))
        facts.append(Fact(f"matrices {name} are of different kinds", _kind(b), "quantize it on every rank or on none"))
    return facts


def _kind(b: torch.Tensor) -> str:
    """``"plain"`` (a parameter included) or the subclass, such as an int8 weight, whose matmul differs."""
    return "plain" if type(b) in (torch.Tensor, torch.nn.Parameter) else type(b).__name__
