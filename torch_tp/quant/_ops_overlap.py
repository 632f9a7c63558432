"""The fused overlap ops (:mod:`torch_tp.overlap`) with ``Int8SymmetricTensor`` right operands.

The fused ops called with int8 weights reach this table through ``__torch_dispatch__`` and
run as plain-tensor custom ops that take the int8 ``qdata`` and float32 ``scale`` separately,
so the weight stays int8 while the ring multiplies chunk by chunk:

=============================================  ==========================================================
op (int8 right operands)                       runs as
=============================================  ==========================================================
``torch_tp::all_gather_matmul``                ``torch_tp::all_gather_int8_matmul(a_shard, qdatas, scales,
                                               gather_dim, group_name)``
``torch_tp::matmul_reduce_scatter``            ``torch_tp::int8_matmul_reduce_scatter(a, qdata, scale,
                                               scatter_dim, group_name, reduce_op)``
``torch_tp::int8_all_gather_matmul``           ``torch_tp::int8_all_gather_int8_matmul(a_shard, qdatas,
(``comm_dtype=torch.int8``: int8 tokens)       scales, gather_dim, group_name)``
``torch_tp::matmul_int8_reduce_scatter``       ``torch_tp::int8_matmul_int8_reduce_scatter(a, qdata, scale,
(int8 partial sums)                            scatter_dim, group_name)``
=============================================  ==========================================================

So ``overlap=True`` with ``comm_dtype=torch.int8`` and int8 weights moves int8 tokens and
multiplies int8 weights. The fused ops are weight-only: W8A8 weights (``activations="int8"``) are refused by name
(``NotImplementedError``), since the ring would multiply float chunks by them.

Autograd stays with the float ops above ``__torch_dispatch__``: their backward calls the
fused ops again with ``b.t()`` (still int8; scales then lie along the summed dim, which
:func:`_quantized_matmul` folds into the activations). Quantized weights get no gradient.
Under ``torch.compile`` the subclass is flattened and these ops appear as single nodes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch_tp import overlap
from torch_tp.quant._ops_matmul import _quantized_matmul, _scales_per_output_column
from torch_tp.quant.int8_tensor import Int8SymmetricTensor, implements

__all__: list[str] = []


def _int8_chunk_matmul(qdatas: list[Tensor], scales: list[Tensor], dtype: torch.dtype):
    """``rows -> [rows @ (q * s) for each weight]``, preparing each int8 matrix once per call.

    Scales per output column keep ``qdata`` int8 (the int8 kernel reads it). Scales per
    summed row make :func:`_quantized_matmul` convert ``qdata`` to ``dtype``: that is done
    once here rather than once per chunk (its conversion of a float matrix is a no-op).
    """
    prepared = [
        (qdata if _scales_per_output_column(qdata, scale) else qdata.to(dtype), scale)
        for qdata, scale in zip(qdatas, scales)
    ]
    return lambda rows: [_quantized_matmul(rows, qdata, scale) for qdata, scale in prepared]


def _check_int8_operands(qdatas: list[Tensor], scales: list[Tensor], a: Tensor, op: str) -> None:
    """The int8 layout of each matrix. Dims, shapes and empty inputs are the float op's checks,
    which the ops run on float stand-ins (``overlap.check_*``) before any transfer."""
    for qdata, scale in zip(qdatas, scales, strict=True):
        if qdata.dtype != torch.int8 or qdata.ndim != 2 or qdata.shape[0] != a.shape[-1]:
            raise ValueError(f"{op}: expected int8 (K={a.shape[-1]}, N) data, got {qdata.dtype} {tuple(qdata.shape)}")
        if scale.ndim != 2 or not (scale.shape[0] == 1 or scale.shape[1] == 1):
            raise ValueError(f"{op}: expected a (1, N) or (K, 1) scale, got {tuple(scale.shape)}")


@torch.library.custom_op("torch_tp::all_gather_int8_matmul", mutates_args=())
def _all_gather_int8_matmul(
    a_shard: Tensor, qdatas: list[Tensor], scales: list[Tensor], gather_dim: int, group_name: str
) -> tuple[Tensor, list[Tensor]]:
    _check_int8_operands(qdatas, scales, a_shard, "all_gather_int8_matmul")
    overlap.check_all_gather_matmul(a_shard, _float_stand_ins(a_shard, qdatas, "meta"), gather_dim)
    chunk_matmul = _int8_chunk_matmul(qdatas, scales, a_shard.dtype)
    return overlap.ring_all_gather_matmul(a_shard, chunk_matmul, gather_dim, group_name)


def _float_stand_ins(a: Tensor, qdatas: list[Tensor], device=None) -> list[Tensor]:
    """Float matrices of the int8 ones' shapes, for the float op's checks and fakes
    (``device="meta"``: shapes only, no memory)."""
    return [q.new_empty(q.shape, dtype=a.dtype, device=device) for q in qdatas]


@_all_gather_int8_matmul.register_fake
def _all_gather_int8_matmul_fake(a_shard, qdatas, scales, gather_dim, group_name):
    # the float op's fake gives the shapes (and checks them) for float weights of these shapes
    return torch.ops.torch_tp.all_gather_matmul(a_shard, _float_stand_ins(a_shard, qdatas), gather_dim, group_name)


@torch.library.custom_op("torch_tp::int8_matmul_reduce_scatter", mutates_args=())
def _int8_matmul_reduce_scatter(
    a: Tensor, qdata: Tensor, scale: Tensor, scatter_dim: int, group_name: str, reduce_op: str
) -> Tensor:
    _check_int8_operands([qdata], [scale], a, "int8_matmul_reduce_scatter")
    (b,) = _float_stand_ins(a, [qdata], "meta")
    overlap.check_matmul_reduce_scatter(a, b, scatter_dim, group_name, reduce_op)
    chunk_matmul = _int8_chunk_matmul([qdata], [scale], a.dtype)
    return overlap.ring_matmul_reduce_scatter(a, chunk_matmul, scatter_dim, group_name, reduce_op)


@_int8_matmul_reduce_scatter.register_fake
def _int8_matmul_reduce_scatter_fake(a, qdata, scale, scatter_dim, group_name, reduce_op):
    (b,) = _float_stand_ins(a, [qdata])
    return torch.ops.torch_tp.matmul_reduce_scatter(a, b, scatter_dim, group_name, reduce_op)


@torch.library.custom_op("torch_tp::int8_all_gather_int8_matmul", mutates_args=())
def _int8_all_gather_int8_matmul(
    a_shard: Tensor, qdatas: list[Tensor], scales: list[Tensor], gather_dim: int, group_name: str
) -> tuple[Tensor, list[Tensor]]:
    _check_int8_operands(qdatas, scales, a_shard, "int8_all_gather_int8_matmul")
    chunk_matmul = _int8_chunk_matmul(qdatas, scales, a_shard.dtype)
    return overlap.int8_ring_all_gather_matmul(a_shard, chunk_matmul, [q.shape[-1] for q in qdatas], gather_dim,
                                               group_name)


@_int8_all_gather_int8_matmul.register_fake
def _int8_all_gather_int8_matmul_fake(a_shard, qdatas, scales, gather_dim, group_name):
    return torch.ops.torch_tp.int8_all_gather_matmul(a_shard, _float_stand_ins(a_shard, qdatas), gather_dim, group_name)


@torch.library.custom_op("torch_tp::int8_matmul_int8_reduce_scatter", mutates_args=())
def _int8_matmul_int8_reduce_scatter(a: Tensor, qdata: Tensor, scale: Tensor, scatter_dim: int, group_name: str) -> Tensor:
    _check_int8_operands([qdata], [scale], a, "int8_matmul_int8_reduce_scatter")
    chunk_matmul = _int8_chunk_matmul([qdata], [scale], a.dtype)
    return overlap.int8_ring_matmul_reduce_scatter(a, chunk_matmul, qdata.shape[-1], scatter_dim, group_name)


@_int8_matmul_int8_reduce_scatter.register_fake
def _int8_matmul_int8_reduce_scatter_fake(a, qdata, scale, scatter_dim, group_name):
    (b,) = _float_stand_ins(a, [qdata])
    return torch.ops.torch_tp.matmul_int8_reduce_scatter(a, b, scatter_dim, group_name)


def _require_int8_weights(a: Tensor, bs: list[Tensor], op: str) -> None:
    if isinstance(a, Int8SymmetricTensor):
        raise NotImplementedError(f"{op} with an int8 input (left operand): only weights are quantized")
    if not all(isinstance(b, Int8SymmetricTensor) for b in bs):
        kinds = [type(b).__name__ for b in bs]
        raise NotImplementedError(
            f"{op} got a mix of int8 and float matrices {kinds}: quantize all of them or none"
        )
    modes = sorted({b.activations for b in bs})
    if modes != ["float"]:
        raise NotImplementedError(
            f"torch_tp.quant: {op} (overlap=True) with W8A8 weights (activations={modes}): the fused "
            f"ring multiplies float activation chunks by int8 weights, weight-only. Use overlap=False "
            f"for W8A8 layers, or quantize them with Int8SymmetricWeightConfig(activations='float')"
        )


def _arguments(schema_op, args, kwargs) -> list:
    names = [argument.name for argument in schema_op._schema.arguments]
    return [*args, *(kwargs[name] for name in names[len(args):])]


@implements(torch.ops.torch_tp.all_gather_matmul.default)
def _int8_all_gather_matmul(func, types, args, kwargs):
    a_shard, bs, gather_dim, group_name = _arguments(func, args, kwargs)
    _require_int8_weights(a_shard, bs, "all_gather_matmul")
    overlap.check_all_gather_matmul(a_shard, bs, gather_dim)
    return torch.ops.torch_tp.all_gather_int8_matmul(
        a_shard, [b.qdata for b in bs], [b.scale for b in bs], gather_dim, group_name
    )


@implements(torch.ops.torch_tp.matmul_reduce_scatter.default)
def _int8_matmul_reduce_scatter_dispatch(func, types, args, kwargs):
    a, b, scatter_dim, group_name, reduce_op = _arguments(func, args, kwargs)
    _require_int8_weights(a, [b], "matmul_reduce_scatter")
    overlap.check_matmul_reduce_scatter(a, b, scatter_dim, group_name, reduce_op)
    return torch.ops.torch_tp.int8_matmul_reduce_scatter(a, b.qdata, b.scale, scatter_dim, group_name, reduce_op)


@implements(torch.ops.torch_tp.int8_all_gather_matmul.default)
def _int8_tokens_int8_matmul(func, types, args, kwargs):
    a_shard, bs, gather_dim, group_name = _arguments(func, args, kwargs)
    _require_int8_weights(a_shard, bs, "int8_all_gather_matmul")
    return torch.ops.torch_tp.int8_all_gather_int8_matmul(
        a_shard, [b.qdata for b in bs], [b.scale for b in bs], gather_dim, group_name
    )


@implements(torch.ops.torch_tp.matmul_int8_reduce_scatter.default)
def _int8_matmul_int8_partials(func, types, args, kwargs):
    a, b, scatter_dim, group_name = _arguments(func, args, kwargs)
    _require_int8_weights(a, [b], "matmul_int8_reduce_scatter")
    return torch.ops.torch_tp.int8_matmul_int8_reduce_scatter(a, b.qdata, b.scale, scatter_dim, group_name)
