"""Matmul ops of ``Int8SymmetricTensor``: int8 weight, float activations, output in the input's dtype.

| op | the path that reaches it |
| --- | --- |
| ``linear`` | ``F.linear`` when it reaches dispatch undecomposed |
| ``mm`` / ``addmm`` | ``F.linear`` decomposed (``x @ w.t()``, DTensor's local op); its input gradient (``grad @ w``) |
| ``matmul`` | ``x @ w.t()`` in user code (decomposes to ``mm``) |
| ``embedding`` | ``nn.Embedding`` / ``F.embedding`` |

A linear layer's weight is ``(out, in)`` with one scale per output row, so
``x @ w.t() == (x @ qdata.t()) * scale.t()``: the scale factors out of the sum and the
int8 matrix is consumed by ``aten._weight_int8pack_mm`` (no float copy of the weight) for
float32 on CPU, or converted to the input dtype elsewhere (see ``_PACKED_MM_DTYPES``).
"""

from __future__ import annotations

import torch

from torch_tp.quant.int8_tensor import Int8SymmetricTensor, implements

__all__: list[str] = []

aten = torch.ops.aten
# torch 2.13's CPU _weight_int8pack_mm is only used for float32: for bfloat16 it returns
# wrong results, or crashes the process, for some K that are not multiples of 8 (seen at
# K = 4, 12, 20, 28, 36, 100 -- e.g. a 40-feature input split over 2 ranks, K = 20). Other dtypes convert the int8
# matrix (exactly: |q| <= 127 fits bfloat16's mantissa) and use the regular matmul.
_PACKED_MM_DTYPES = (torch.float32,)


def _rows_times_weight(x2d: torch.Tensor, qdata_nk: torch.Tensor, scale_n: torch.Tensor) -> torch.Tensor:
    """``x2d @ (qdata_nk * scale_n[:, None]).t()`` computed in ``x2d.dtype`` without dequantizing."""
    scale_n = scale_n.to(x2d.dtype)
    if x2d.device.type == "cpu" and x2d.dtype in _PACKED_MM_DTYPES:
        return aten._weight_int8pack_mm(x2d.contiguous(), qdata_nk.contiguous(), scale_n)
    # ``scale * mm``, not ``mm * scale``: inductor pattern-matches the latter (bfloat16) into
    # _weight_int8pack_mm, the kernel avoided above, and then fails to lower it (torch 2.13).
    return scale_n * torch.mm(x2d, qdata_nk.t().to(x2d.dtype))


def _scales_per_output_column(qdata_kn: torch.Tensor, scale_kn: torch.Tensor) -> bool:
    """Whether a ``(K, N)`` operand's scales are ``(1, N)`` (one per output column), not
    ``(K, 1)`` (one per summed row). Decided by ``N``: a one-row shard's ``(1, 1)`` scale with
    ``N > 1`` is per summed row (``grad @ w`` for a weight of one output row)."""
    return scale_kn.shape[0] == 1 and scale_kn.shape[1] == qdata_kn.shape[1]


def _quantized_matmul(x2d: torch.Tensor, qdata_kn: torch.Tensor, scale_kn: torch.Tensor) -> torch.Tensor:
    """``x2d @ (qdata_kn * scale_kn)`` for a ``(K, N)`` int8 operand, in ``x2d.dtype``.

    Scales per output column (``(1, N)``, a linear weight used as ``x @ w.t()``) factor out
    of the sum: ``(x @ q) * s``. Scales per summed row (``(K, 1)``: ``grad @ w`` in the
    backward of ``F.linear``) fold into the input first: ``(x * s.T) @ q``. Either way the
    int8 matrix is never scaled in float.
    """
    if _scales_per_output_column(qdata_kn, scale_kn):
        return _rows_times_weight(x2d, qdata_kn.t(), scale_kn.reshape(-1))
    scaled = x2d * scale_kn.reshape(1, -1).to(x2d.dtype)
    return torch.mm(scaled, qdata_kn.to(x2d.dtype))


def _linear(x: torch.Tensor, w: Int8SymmetricTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, bias)``: ``x @ w.t()`` for a weight of shape ``(out, in)``."""
    x2d = x.reshape(-1, x.shape[-1])
    y = _quantized_matmul(x2d, w.qdata.t(), w.scale.t())
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _require_plain_input(x, op: str) -> None:
    if isinstance(x, Int8SymmetricTensor):
        raise NotImplementedError(
            f"{op} with {type(x).__name__} as the input (left operand): only weights are "
            f"quantized; int8 x int8 products are not implemented"
        )


# No __torch_function__ override for F.linear: that would run above autograd, and the CPU
# int8 kernel has no derivative. F.linear decomposes to t + addmm/mm below autograd, whose
# backward (grad @ w) is the mm below with scales along the summed dim.
@implements(aten.linear.default)
def _int8_linear(func, types, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    _require_plain_input(x, "linear")
    return _linear(x, w, bias)


def _mm(x: torch.Tensor, w: Int8SymmetricTensor, op: str) -> torch.Tensor:
    """``x @ w`` for a quantized ``(K, N)`` right operand (``w.t()`` of a linear weight, or the
    weight itself in ``F.linear``'s input gradient)."""
    _require_plain_input(x, op)
    return _quantized_matmul(x, w.qdata, w.scale)


@implements(aten.mm.default)
def _int8_mm(func, types, args, kwargs):
    return _mm(args[0], args[1], "mm")


@implements(aten.addmm.default)
def _int8_addmm(func, types, args, kwargs):
    bias, x, w_t = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    y = _mm(x, w_t, "addmm")
    if alpha != 1:
        y = y * alpha
    return y + (bias if beta == 1 else bias * beta).to(y.dtype)


@implements(aten.embedding.default)
def _int8_embedding(func, types, args, kwargs):
    weight, indices = args[0], args[1]
    if not weight.scale_follows(0):
        raise NotImplementedError(f"embedding with a transposed {type(weight).__name__}")
    rows = aten.embedding.default(weight.qdata, indices)
    scales = aten.embedding.default(weight.scale, indices)
    return (rows.to(torch.float32) * scales).to(weight.dtype)
