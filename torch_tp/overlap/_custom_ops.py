"""The fused ops as ``torch.library`` custom ops: ``torch.ops.torch_tp.*``, with fakes and autograd.

``torch.ops.torch_tp.all_gather_matmul(Tensor a_shard, Tensor[] bs, SymInt gather_dim, str group_name) -> (Tensor, Tensor[])``
``torch.ops.torch_tp.matmul_reduce_scatter(Tensor a, Tensor b, SymInt scatter_dim, str group_name, str reduce_op) -> Tensor``

Both run the P2P ring of :mod:`torch_tp.overlap._ring` on any backend (gloo, NCCL, ...).
Their fake implementations only compute shapes, so ``torch.compile(fullgraph=True)``
traces a call as one opaque node; their autograd is each other:

- ``all_gather_matmul``: ``grad a_shard = matmul_reduce_scatter(sum_i grad_i @ b_i.T)``
  (plus the reduce-scattered gradient of ``a_gathered`` when it is used), and
  ``grad b_i = a_gathered.T @ grad_i``.
- ``matmul_reduce_scatter``: ``grad a = all_gather_matmul(grad, [b.T])`` and
  ``grad b = a.T @ all_gather(grad)``.

Call them through :func:`torch_tp.overlap.all_gather_matmul` and
:func:`torch_tp.overlap.matmul_reduce_scatter`, which also accept a ``ProcessGroup`` or a
1-D ``DeviceMesh`` for the group and negative dims.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> gathered, (y,) = torch.ops.torch_tp.all_gather_matmul(x, [w.t()], 1, group.group_name)
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from torch_tp.overlap._ring import ring_all_gather_matmul, ring_matmul_reduce_scatter

__all__ = [
    "REDUCE_OPS",
    "check_all_gather_matmul",
    "check_matmul_reduce_scatter",
    "check_matmul_reduce_scatter_operands",
    "check_reduce_op",
    "group_size",
    "resolve_group",
    "run_all_gather_matmul",
    "run_matmul_reduce_scatter",
]

#: The ``reduce_op`` values :func:`matmul_reduce_scatter` takes.
REDUCE_OPS = ("sum", "avg")


def resolve_group(group_name: str):
    """The ``ProcessGroup`` registered under ``group_name``."""
    return _resolve_process_group(group_name)


def group_size(group_name: str) -> int:
    """Number of ranks in the process group registered under ``group_name``."""
    return _resolve_process_group(group_name).size()


# ------------------------------------------------------------------ argument checks


def _check_b(a: Tensor, b: Tensor, what: str, op: str) -> None:
    if b.ndim != 2:
        raise ValueError(f"{op}: {what} must be a 2-D matrix (K, N), got shape {tuple(b.shape)}")
    if b.shape[0] != a.shape[-1]:
        raise ValueError(
            f"{op}: {what} has {b.shape[0]} rows but the input's last (contracted) dim is "
            f"{a.shape[-1]}; pass the weight transposed, e.g. linear.weight.t()"
        )
    if b.dtype != a.dtype:
        raise TypeError(f"{op}: {what} is {b.dtype} but the input is {a.dtype}; use one dtype")


def _check_dim(a: Tensor, dim: int, argument: str, op: str) -> None:
    if a.ndim < 2:
        raise ValueError(f"{op}: the input must have at least 2 dims, got shape {tuple(a.shape)}")
    if not 0 <= dim < a.ndim - 1:
        raise ValueError(
            f"{op}: {argument}={dim} for an input of shape {tuple(a.shape)}: it must be one of "
            f"the leading dims 0..{a.ndim - 2} (the last dim is the one the matmul contracts)"
        )


def _check_not_empty(a: Tensor, op: str) -> None:
    """The ring moves and multiplies rows of the input: an input with none (or with rows of
    no elements, K = 0) is refused here, before any transfer is posted."""
    if a.numel() == 0:
        empty = "its last (contracted) dim K is 0" if a.shape[-1] == 0 else "it has no rows"
        raise ValueError(
            f"{op}: the input of shape {tuple(a.shape)} is empty ({empty}); the fused ops "
            f"need at least one element on every rank: skip the call for an empty input"
        )


def check_all_gather_matmul(a_shard: Tensor, bs: list[Tensor], gather_dim: int) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``all_gather_matmul`` can take these arguments:
    a leading ``gather_dim``, a non-empty input (``K > 0``), and ``bs`` of ``(K, N)`` matrices
    in the input's dtype.

    Example::

        >>> check_all_gather_matmul(torch.ones(4, 8), [torch.ones(8, 2)], 0)
        >>> check_all_gather_matmul(torch.ones(4, 8), [torch.ones(2, 8)], 0)
        Traceback (most recent call last):
        ValueError: all_gather_matmul: bs[0] has 2 rows but the input's last (contracted) dim is 8; ...
    """
    op = "all_gather_matmul"
    _check_dim(a_shard, gather_dim, "gather_dim", op)
    _check_not_empty(a_shard, op)
    if len(bs) == 0:
        raise ValueError(f"{op}: bs is empty; pass at least one matrix to multiply by")
    for i, b in enumerate(bs):
        _check_b(a_shard, b, f"bs[{i}]", op)


def check_matmul_reduce_scatter(a: Tensor, b: Tensor, scatter_dim: int, group_name: str, reduce_op: str) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``matmul_reduce_scatter`` can take these arguments
    over the process group registered as ``group_name``: as :func:`check_all_gather_matmul`, and
    a ``scatter_dim`` whose size divides by the group size.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> check_matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 2), 0, group_name, "sum")
        >>> check_matmul_reduce_scatter(torch.ones(3, 8), torch.ones(8, 2), 0, group_name, "sum")
        Traceback (most recent call last):
        ValueError: matmul_reduce_scatter: dim 0 of the input has size 3, which does not split evenly over 2 ranks ...
    """
    check_matmul_reduce_scatter_operands(a, b, scatter_dim, reduce_op)
    _check_even_scatter(a, scatter_dim, group_size(group_name))


def check_matmul_reduce_scatter_operands(a: Tensor, b: Tensor, scatter_dim: int, reduce_op: str) -> None:
    """:func:`check_matmul_reduce_scatter` without the group: what one rank's arguments alone decide."""
    op = "matmul_reduce_scatter"
    _check_dim(a, scatter_dim, "scatter_dim", op)
    _check_not_empty(a, op)
    _check_b(a, b, "b", op)
    check_reduce_op(reduce_op, op)


def _check_even_scatter(a: Tensor, scatter_dim: int, world: int) -> None:
    """Raise ``ValueError`` unless ``a``'s ``scatter_dim`` splits evenly over ``world`` ranks."""
    if a.shape[scatter_dim] % world:
        raise ValueError(
            f"matmul_reduce_scatter: dim {scatter_dim} of the input has size {a.shape[scatter_dim]}, "
            f"which does not split evenly over {world} ranks (uneven leading size); pad it to a "
            f"multiple of {world}"
        )


def check_reduce_op(reduce_op: str, op: str) -> None:
    """Raise ``ValueError`` unless ``reduce_op`` is one of :data:`REDUCE_OPS`."""
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"{op}: reduce_op={reduce_op!r} is not supported; use one of {REDUCE_OPS}")


# ------------------------------------------------------------------ all_gather_matmul


def _float_chunk_matmul(bs: list[Tensor]):
    return lambda rows: [torch.mm(rows, b) for b in bs]


def gathered_shape(a_shard: Tensor, gather_dim: int, world: int) -> list[int]:
    shape = list(a_shard.shape)
    shape[gather_dim] *= world
    return shape


def run_all_gather_matmul(a_shard: Tensor, chunk_matmul, gather_dim: int, group_name: str):
    """The ring with ``gather_dim`` moved to the front and back; outputs are contiguous."""
    group = _resolve_process_group(group_name)
    gathered, outs = ring_all_gather_matmul(a_shard.movedim(gather_dim, 0), chunk_matmul, group)
    return (
        gathered.movedim(0, gather_dim).contiguous(),
        [out.movedim(0, gather_dim).contiguous() for out in outs],
    )


@torch.library.custom_op("torch_tp::all_gather_matmul", mutates_args=())
def _all_gather_matmul(
    a_shard: Tensor, bs: list[Tensor], gather_dim: int, group_name: str
) -> tuple[Tensor, list[Tensor]]:
    check_all_gather_matmul(a_shard, bs, gather_dim)
    return run_all_gather_matmul(a_shard, _float_chunk_matmul(bs), gather_dim, group_name)


@_all_gather_matmul.register_fake
def _all_gather_matmul_fake(a_shard, bs, gather_dim, group_name):
    check_all_gather_matmul(a_shard, bs, gather_dim)
    shape = gathered_shape(a_shard, gather_dim, group_size(group_name))
    return a_shard.new_empty(shape), [a_shard.new_empty([*shape[:-1], b.shape[-1]]) for b in bs]


def _all_gather_matmul_setup(ctx, inputs, output):
    _, bs, gather_dim, group_name = inputs
    gathered, _ = output
    ctx.set_materialize_grads(False)  # unused outputs cost no collective in the backward
    # the gathered input only serves weight gradients: frozen (e.g. int8) weights keep none alive
    ctx.save_for_backward(gathered if any(b.requires_grad for b in bs) else None, *bs)
    ctx.gather_dim, ctx.group_name = gather_dim, group_name


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _joined(terms) -> list[tuple[Tensor, Tensor]]:
    """``[(cat g_i, cat b_i)]`` (one product for ``sum_i g_i @ b_i``), or ``terms`` as they are
    when the ``b_i`` cannot be joined (e.g. int8 pieces whose scales differ along a shared dim)."""
    if len(terms) == 1:
        return terms
    try:
        b = torch.cat([b for _, b in terms], dim=0)
    except (ValueError, NotImplementedError):
        return terms
    return [(torch.cat([g for g, _ in terms], dim=-1), b)]


def _sum_of_products_reduce_scattered(terms, scatter_dim: int, group_name: str) -> Tensor:
    """``reduce_scatter(sum_i g_i @ b_i)`` with as few fused calls as the operands allow."""
    parts = [
        torch.ops.torch_tp.matmul_reduce_scatter(g, b, scatter_dim, group_name, "sum")
        for g, b in _joined(terms)
    ]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)


def _all_gather_matmul_backward(ctx, grad_gathered, grad_outs):
    gathered, *bs = ctx.saved_tensors
    needs_a, needs_bs = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_a = None
    if needs_a:
        terms = [(g, b.t()) for g, b in zip(grad_outs, bs) if g is not None]
        if terms:
            grad_a = _sum_of_products_reduce_scattered(terms, ctx.gather_dim, ctx.group_name)
        if grad_gathered is not None:
            scattered = funcol.reduce_scatter_single(grad_gathered, "sum", ctx.gather_dim, ctx.group_name)
            scattered = funcol.wait_tensor(scattered)
            grad_a = scattered if grad_a is None else grad_a + scattered
    grad_bs = [
        _rows(gathered).t() @ _rows(g) if need and g is not None else None
        for need, g in zip(needs_bs, grad_outs)
    ]
    return grad_a, grad_bs, None, None


_all_gather_matmul.register_autograd(_all_gather_matmul_backward, setup_context=_all_gather_matmul_setup)


# ------------------------------------------------------------------ matmul_reduce_scatter


def run_matmul_reduce_scatter(a: Tensor, chunk_matmul, scatter_dim: int, group_name: str, reduce_op: str):
    """The ring with ``scatter_dim`` moved to the front and back; the output is contiguous."""
    group = _resolve_process_group(group_name)
    out = ring_matmul_reduce_scatter(a.movedim(scatter_dim, 0), chunk_matmul, group)
    if reduce_op == "avg":
        out = out / group.size()
    return out.movedim(0, scatter_dim).contiguous()


def scattered_shape(a: Tensor, n_out: int, scatter_dim: int, world: int) -> list[int]:
    shape = [*a.shape[:-1], n_out]
    shape[scatter_dim] //= world
    return shape


@torch.library.custom_op("torch_tp::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter(a: Tensor, b: Tensor, scatter_dim: int, group_name: str, reduce_op: str) -> Tensor:
    check_matmul_reduce_scatter(a, b, scatter_dim, group_name, reduce_op)
    return run_matmul_reduce_scatter(a, lambda rows: [torch.mm(rows, b)], scatter_dim, group_name, reduce_op)


@_matmul_reduce_scatter.register_fake
def _matmul_reduce_scatter_fake(a, b, scatter_dim, group_name, reduce_op):
    check_matmul_reduce_scatter(a, b, scatter_dim, group_name, reduce_op)
    return a.new_empty(scattered_shape(a, b.shape[-1], scatter_dim, group_size(group_name)))


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    a, b, scatter_dim, group_name, reduce_op = inputs
    ctx.save_for_backward(a if b.requires_grad else None, b)  # a only serves b's gradient
    ctx.scatter_dim, ctx.group_name, ctx.reduce_op = scatter_dim, group_name, reduce_op


def _matmul_reduce_scatter_backward(ctx, grad):
    a, b = ctx.saved_tensors
    needs_a, needs_b = ctx.needs_input_grad[:2]
    if ctx.reduce_op == "avg":
        grad = grad / group_size(ctx.group_name)
    grad_a = grad_b = None
    if needs_a:
        gathered, (grad_a,) = torch.ops.torch_tp.all_gather_matmul(grad, [b.t()], ctx.scatter_dim, ctx.group_name)
    elif needs_b:
        gathered = funcol.wait_tensor(funcol.all_gather_single(grad, ctx.scatter_dim, ctx.group_name))
    if needs_b:
        grad_b = _rows(a).t() @ _rows(gathered)
    return grad_a, grad_b, None, None, None


_matmul_reduce_scatter.register_autograd(_matmul_reduce_scatter_backward, setup_context=_matmul_reduce_scatter_setup)
