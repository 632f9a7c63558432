"""Matmul ops of ``Int8SymmetricTensor``: int8 weight, float activations, output in the input's dtype.

| op | the path that reaches it |
| --- | --- |
| ``F.linear`` (torch function) | ``nn.Linear`` with an unsharded quantized weight |
| ``linear`` | ``F.linear`` when it is not decomposed |
| ``mm`` / ``addmm`` | ``F.linear`` decomposed (``x @ w.t()``, DTensor's local op) |
| ``matmul`` | ``x @ w.t()`` in user code (decomposes to ``mm``) |
| ``embedding`` | ``nn.Embedding`` / ``F.embedding`` |

A linear layer's weight is ``(out, in)`` with one scale per output row, so
``x @ w.t() == (x @ qdata.t()) * scale.t()``: the scale factors out of the sum and the
int8 matrix is consumed by ``aten._weight_int8pack_mm`` (no float copy of the weight) for
float32 on CPU, or converted to the input dtype elsewhere (see ``_PACKED_MM_DTYPES``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_tp.quant.int8_tensor import Int8SymmetricTensor, implements, implements_torch_function

__all__: list[str] = []

aten = torch.ops.aten
# torch 2.13's CPU _weight_int8pack_mm is only used for float32: for bfloat16 it returns
# wrong results when K is not a multiple of 16 (e.g. a 40-feature input split over 2
# ranks, K = 20) and crashes the process for small K. Other dtypes convert the int8
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


def _require_output_scales(w: Int8SymmetricTensor, op: str, out_dim: int) -> None:
    """The scale must vary along the output features, not the summed (reduction) dim."""
    reduction_dim = 1 - out_dim
    if w.scale_follows(reduction_dim) and w.shape[reduction_dim] != 1:
        raise NotImplementedError(
            f"{op} with an {type(w).__name__} whose scales run along the summed dim "
            f"(shape {tuple(w.shape)}, scale {tuple(w.scale.shape)}): the scale cannot be "
            f"factored out. Use the weight as nn.Linear does, x @ w.t()"
        )


def _linear(x: torch.Tensor, w: Int8SymmetricTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for a weight of shape ``(out, in)`` with per-output-row scales."""
    _require_output_scales(w, "linear", out_dim=0)
    x2d = x.reshape(-1, x.shape[-1])
    y = _rows_times_weight(x2d, w.qdata, w.scale.reshape(-1))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _require_plain_input(x, op: str) -> None:
    if isinstance(x, Int8SymmetricTensor):
        raise NotImplementedError(
            f"{op} with {type(x).__name__} as the input (left operand): only weights are "
            f"quantized; int8 x int8 products are not implemented"
        )


@implements_torch_function(F.linear)
@implements(aten.linear.default)
def _int8_linear(func, types, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    _require_plain_input(x, "linear")
    return _linear(x, w, bias)


def _mm_by_transposed_weight(x: torch.Tensor, w_t: Int8SymmetricTensor, op: str) -> torch.Tensor:
    """``x @ w_t`` where ``w_t`` is a linear weight transposed: ``(in, out)``, scales per column."""
    _require_plain_input(x, op)
    _require_output_scales(w_t, op, out_dim=1)
    return _rows_times_weight(x, w_t.qdata.t(), w_t.scale.reshape(-1))


@implements(aten.mm.default)
def _int8_mm(func, types, args, kwargs):
    return _mm_by_transposed_weight(args[0], args[1], "mm")


@implements(aten.addmm.default)
def _int8_addmm(func, types, args, kwargs):
    bias, x, w_t = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    y = _mm_by_transposed_weight(x, w_t, "addmm")
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
