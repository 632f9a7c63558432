"""The collectives that move activations as int8 with one scale per token: ``comm_dtype=torch.int8``.

==========================================  ==============================================  ==============================
op                                          forward                                         backward
==========================================  ==============================================  ==============================
``torch_tp::int8_all_gather(x, dim, g)``    every token (a row of the last dim) quantized   ``int8_reduce_scatter`` of the
                                            (symmetric, one float32 scale per token), the   gradient
                                            int8 rows and their scales packed in one
                                            buffer, one all-gather, dequantized in place
``torch_tp::int8_reduce_scatter(x, dim,     ``x`` cut into the ranks' chunks along ``dim``, ``int8_all_gather`` of the
g)``                                        each chunk quantized per token, one             gradient
                                            all-to-all of the packed chunks, each rank's
                                            received chunks dequantized and summed in
                                            float32
``torch_tp::int8_all_gather_matmul(a,      ``overlap=True``'s ring (:mod:`torch_tp.overlap.  ``int8_reduce_scatter`` of the
bs, dim, g)``                               _ring`) moving packed int8 tokens, each chunk   summed input gradients
                                            dequantized and multiplied as it arrives
``torch_tp::matmul_int8_reduce_scatter(a,   :mod:`torch_tp.overlap._ring`'s pairwise        ``int8_all_gather_matmul`` of
b, dim, g)``                                schedule: at step ``k`` the quantized partial   the gradient
                                            sum for rank ``r + k`` goes straight there
                                            while the next one is multiplied
==========================================  ==============================================  ==============================

What travels per token of ``E`` features: ``E`` int8 bytes and one 4-byte scale, against
``4 E`` (float32) or ``2 E`` (bfloat16) bytes: ``(E + 4) / 4E`` of float32, 0.258 at
``E = 128``. The error: each element is within half a step (``amax / 254`` of its token) of
the value sent; a reduce-scatter adds the ranks' rounding errors (each partial sum is
quantized once, before the sum), so its error grows with the ranks, not with the hops.

Each op is one c10d collective, waited before it returns (two functional collectives in
flight at once over gloo corrupt the heap in torch 2.13: :mod:`torch_tp.quant._ops_collective`).
Both are ``torch.library`` custom ops with fake implementations, so ``torch.compile`` traces
each call as one node (no graph break), and each other's autograd.

The styles reach them through ``ColwiseParallel`` / ``RowwiseParallel(comm_dtype=torch.int8)``
(:mod:`torch_tp.parallel._int8_comm`); the tokens are packed by :mod:`torch_tp._tokens`.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> full = torch.ops.torch_tp.int8_all_gather(x_local, 1, group.group_name)   # (B, T, E)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch_tp._tokens import numel, packed_tokens, unpacked_tokens
from torch_tp.overlap._custom_ops import _rows, gathered_shape, group_size, resolve_group, scattered_shape
from torch_tp.overlap._ring import pairwise_matmul_reduce_scatter, ring_all_gather_matmul

__all__ = ["run_int8_all_gather_matmul", "run_matmul_int8_reduce_scatter"]


def _check(x: Tensor, dim: int, op: str) -> None:
    if not 0 <= dim < x.ndim - 1:
        raise ValueError(
            f"torch_tp.overlap._int8_comm.{op}: dim={dim} for an input of shape {tuple(x.shape)}: it must be "
            f"a leading dim (the sequence), not the features, which are quantized per token"
        )
    if not x.dtype.is_floating_point:
        raise TypeError(f"torch_tp.overlap._int8_comm.{op}: the input must be floating point, got {x.dtype}")


# ------------------------------------------------------------------ all-gather


@torch.library.custom_op("torch_tp::int8_all_gather", mutates_args=())
def _int8_all_gather(x: Tensor, dim: int, group_name: str) -> Tensor:
    _check(x, dim, "int8_all_gather")
    group = resolve_group(group_name)
    world = group.size()
    front = x.movedim(dim, 0).contiguous()
    packed = packed_tokens(front)
    gathered = packed.new_empty(world * packed.shape[0], packed.shape[1])
    dist.all_gather_into_tensor(gathered, packed, group=group)
    whole = unpacked_tokens(gathered, [world * front.shape[0], *front.shape[1:]], x.dtype)
    return whole.movedim(0, dim).contiguous()


@_int8_all_gather.register_fake
def _int8_all_gather_fake(x, dim, group_name):
    _check(x, dim, "int8_all_gather")
    return x.new_empty(gathered_shape(x, dim, group_size(group_name)))


def _all_gather_backward(ctx, grad):
    return torch.ops.torch_tp.int8_reduce_scatter(grad, ctx.dim, ctx.group_name), None, None


def _setup(ctx, inputs, output):
    _, ctx.dim, ctx.group_name = inputs


_int8_all_gather.register_autograd(_all_gather_backward, setup_context=_setup)


# ------------------------------------------------------------------ reduce-scatter


@torch.library.custom_op("torch_tp::int8_reduce_scatter", mutates_args=())
def _int8_reduce_scatter(x: Tensor, dim: int, group_name: str) -> Tensor:
    _check(x, dim, "int8_reduce_scatter")
    group = resolve_group(group_name)
    world = group.size()
    _check_even(x, dim, world)
    front = x.movedim(dim, 0).contiguous()
    chunk = [front.shape[0] // world, *front.shape[1:]]
    packed = packed_tokens(front.reshape(world, *chunk).flatten(1, -2))
    received = torch.empty_like(packed)
    dist.all_to_all_single(received, packed, group=group)
    parts = unpacked_tokens(received, [world, numel(chunk[:-1]), chunk[-1]], torch.float32)
    return parts.sum(0).reshape(chunk).to(x.dtype).movedim(0, dim).contiguous()


def _check_even(x: Tensor, dim: int, world: int) -> None:
    if x.shape[dim] % world:
        raise ValueError(
            f"torch_tp.overlap._int8_comm.int8_reduce_scatter: dim {dim} of the input has size {x.shape[dim]}, "
            f"which does not split evenly over {world} ranks; use a sequence length that does, or comm_dtype=None"
        )


@_int8_reduce_scatter.register_fake
def _int8_reduce_scatter_fake(x, dim, group_name):
    _check(x, dim, "int8_reduce_scatter")
    _check_even(x, dim, group_size(group_name))
    return x.new_empty(scattered_shape(x, x.shape[-1], dim, group_size(group_name)))


def _reduce_scatter_backward(ctx, grad):
    return torch.ops.torch_tp.int8_all_gather(grad, ctx.dim, ctx.group_name), None, None


_int8_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_setup)


# ------------------------------------------------------------------ fused with the matmul (overlap=True)


def run_int8_all_gather_matmul(a_shard: Tensor, chunk_matmul, out_features: list[int], gather_dim: int,
                               group_name: str) -> tuple[Tensor, list[Tensor]]:
    """The ring of ``int8_all_gather_matmul`` with the chunk product supplied: every token travels
    as int8 with its scale, and ``chunk_matmul(rows)`` (rows 2-D, ``(m, K)``, dequantized) returns
    ``[rows @ b for each b]``, ``out_features`` columns each. The float weights' op and the int8
    weights' op of :mod:`torch_tp.quant` run this one ring."""
    _check(a_shard, gather_dim, "int8_all_gather_matmul")
    group = resolve_group(group_name)
    front = a_shard.movedim(gather_dim, 0).contiguous()
    inner = list(front.shape[1:])

    def on_chunk(chunk: Tensor) -> list[Tensor]:
        rows = unpacked_tokens(chunk, [chunk.shape[0], *inner], a_shard.dtype).reshape(-1, inner[-1])
        return [y.reshape(chunk.shape[0], -1) for y in chunk_matmul(rows)]

    packed, outs = ring_all_gather_matmul(packed_tokens(front), on_chunk, group)
    rows = group.size() * front.shape[0]
    gathered = unpacked_tokens(packed, [rows, *inner], a_shard.dtype).movedim(0, gather_dim).contiguous()
    return gathered, [o.reshape(rows, *inner[:-1], n).movedim(0, gather_dim).contiguous()
                      for o, n in zip(outs, out_features)]


@torch.library.custom_op("torch_tp::int8_all_gather_matmul", mutates_args=())
def _int8_all_gather_matmul(a_shard: Tensor, bs: list[Tensor], gather_dim: int, group_name: str) -> tuple[Tensor, list[Tensor]]:
    """``all_gather_matmul`` whose ring moves every token as int8 with its scale: each chunk is
    dequantized as it arrives and multiplied while the next one travels."""
    return run_int8_all_gather_matmul(a_shard, lambda rows: [rows @ b for b in bs], [b.shape[-1] for b in bs],
                                      gather_dim, group_name)


@_int8_all_gather_matmul.register_fake
def _int8_all_gather_matmul_fake(a_shard, bs, gather_dim, group_name):
    _check(a_shard, gather_dim, "int8_all_gather_matmul")
    shape = gathered_shape(a_shard, gather_dim, group_size(group_name))
    return a_shard.new_empty(shape), [a_shard.new_empty([*shape[:-1], b.shape[-1]]) for b in bs]


def _int8_all_gather_matmul_setup(ctx, inputs, output):
    _, bs, ctx.dim, ctx.group_name = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[0] if any(b.requires_grad for b in bs) else None, *bs)


def _int8_all_gather_matmul_backward(ctx, grad_gathered, grad_outs):
    gathered, *bs = ctx.saved_tensors
    grad_a = None
    if ctx.needs_input_grad[0]:  # the members' input gradients summed, then one int8 reduce-scatter
        terms = [g @ b.t() for g, b in zip(grad_outs, bs) if g is not None]
        if grad_gathered is not None:
            terms.append(grad_gathered)
        if terms:
            grad_a = torch.ops.torch_tp.int8_reduce_scatter(torch.stack(terms).sum(0) if len(terms) > 1 else terms[0],
                                                            ctx.dim, ctx.group_name)
    grad_bs = [_rows(gathered).t() @ _rows(g) if need and g is not None else None
               for need, g in zip(ctx.needs_input_grad[1], grad_outs)]
    return grad_a, grad_bs, None, None


_int8_all_gather_matmul.register_autograd(_int8_all_gather_matmul_backward, setup_context=_int8_all_gather_matmul_setup)


def run_matmul_int8_reduce_scatter(a: Tensor, chunk_matmul, out_features: int, scatter_dim: int,
                                   group_name: str) -> Tensor:
    """The pairwise schedule of ``matmul_int8_reduce_scatter`` with the chunk product supplied:
    ``chunk_matmul(rows)`` returns ``[rows @ b]`` (``out_features`` columns); each partial sum is
    quantized once and summed in float32 on arrival."""
    _check(a, scatter_dim, "matmul_int8_reduce_scatter")
    group = resolve_group(group_name)
    _check_even(a, scatter_dim, group.size())
    front = a.movedim(scatter_dim, 0)
    shape = [front.shape[0] // group.size(), *front.shape[1:-1], out_features]
    out = pairwise_matmul_reduce_scatter(
        front, chunk_matmul, group,
        encode=packed_tokens, decode=lambda packed: unpacked_tokens(packed, shape, torch.float32))
    return out.to(a.dtype).movedim(0, scatter_dim).contiguous()


@torch.library.custom_op("torch_tp::matmul_int8_reduce_scatter", mutates_args=())
def _matmul_int8_reduce_scatter(a: Tensor, b: Tensor, scatter_dim: int, group_name: str) -> Tensor:
    """``matmul_reduce_scatter`` whose partial sums travel as int8 with one scale per token."""
    return run_matmul_int8_reduce_scatter(a, lambda rows: [torch.mm(rows, b)], b.shape[-1], scatter_dim, group_name)


@_matmul_int8_reduce_scatter.register_fake
def _matmul_int8_reduce_scatter_fake(a, b, scatter_dim, group_name):
    _check(a, scatter_dim, "matmul_int8_reduce_scatter")
    _check_even(a, scatter_dim, group_size(group_name))
    return a.new_empty(scattered_shape(a, b.shape[-1], scatter_dim, group_size(group_name)))


def _matmul_int8_reduce_scatter_setup(ctx, inputs, output):
    a, b, ctx.dim, ctx.group_name = inputs
    ctx.save_for_backward(a if b.requires_grad else None, b)


def _matmul_int8_reduce_scatter_backward(ctx, grad):
    a, b = ctx.saved_tensors
    gathered, (grad_a,) = torch.ops.torch_tp.int8_all_gather_matmul(grad, [b.t()], ctx.dim, ctx.group_name)
    grad_b = _rows(a).t() @ _rows(gathered) if ctx.needs_input_grad[1] else None
    return (grad_a if ctx.needs_input_grad[0] else None), grad_b, None, None


_matmul_int8_reduce_scatter.register_autograd(_matmul_int8_reduce_scatter_backward,
                                              setup_context=_matmul_int8_reduce_scatter_setup)
