"""Matmul ops of ``Int8SymmetricTensor``: int8 weight, float activations, output in the input's dtype.

| op | the path that reaches it |
| --- | --- |
| ``linear`` | ``F.linear`` when it reaches dispatch undecomposed |
| ``mm`` / ``addmm`` | ``F.linear`` decomposed (``x @ w.t()``, DTensor's local op); its input gradient (``grad @ w``) |
| ``matmul`` | ``x @ w.t()`` in user code (decomposes to ``mm``) |
| ``bmm`` | ``F.linear`` on a batched input that cannot fold to 2-D (non-contiguous, e.g. transposed): matmul broadcasts the weight (``expand``, ``_ops_shape.py``) and calls ``bmm``; its input gradient |
| ``embedding`` | ``nn.Embedding`` / ``F.embedding`` |

A linear layer's weight is ``(out, in)`` with one scale per output row, so
``x @ w.t() == (x @ qdata.t()) * scale.t()``: the scale factors out of the sum. The weight's
activation mode (``activations``) picks how that sum is computed.

**Weight-only** (``activations="float"``, the default). The int8 matrix is consumed by
``aten._weight_int8pack_mm`` (no float copy of the weight) for float32 on CPU, or converted to
the input dtype elsewhere (see ``_PACKED_MM_DTYPES``). Exactness: the result is
``x @ (qdata * scale).T`` computed in the input's dtype, up to float summation order (and,
for bfloat16, its rounding); the int8 to float conversion is exact (|q| <= 127).

**W8A8** (``activations="int8"``). The 2-D input is quantized per token (dynamic, symmetric,
one float32 scale per row: :func:`torch_tp._tokens.quantize_tokens`, ``x_scale = amax / 127``)
and ``y = (torch._int_mm(x_q, qdata.t()).float() * x_scale) * scale.t()``, cast to the input's
dtype; a token holding NaN or +-inf gives a NaN output row (its sum has no int8 product; float
would give NaN or +-inf there). Exactness: the int32 product of the int8 operands is exact (``K * 127 * 127`` must fit
int32: ``K <= 133144``, else ``ValueError``); the only float steps are the two scalings and the
cast. It differs from weight-only by the activation rounding alone: per element
``|x - x_q * x_scale| <= x_scale / 2``, so per output
``|y_w8a8 - y_weight_only| <= (x_scale / 2) * sum_k |qdata[n, k] * scale[n]|`` (plus float
rounding). Rowwise sharding (``Shard(1)`` weight, the input sharded on its features) quantizes
each rank's local K-slice with its own per-token scale (the slice's amax, <= the whole row's),
so a Rowwise W8A8 layer is *not* bit-equal to the single-process W8A8 layer: each is within the
bound above of the weight-only product (the sharded one with its smaller per-slice scales), so
they differ by at most ``x_scale * sum_k |w[n, k]|``. Colwise (a replicated input, whole rows)
quantizes exactly as one process does: bit-equal. Bit-equality for Rowwise would need the
whole row's amax on every rank (an all-reduce-max of one float per token) and the int32
partial products summed before the scaling (an int32 all-reduce in place of the float one);
neither is done here (``RowwiseParallel`` reduces float partial outputs).

Only products whose scales are per output column (``x @ w.t()``: the forward) are W8A8. The
input gradient ``grad @ w`` sums over the weight's rows, which carry the scales, and stays on
the weight-only path with a float ``grad``: it is the straight-through gradient of the
activation rounding (``round`` has zero derivative almost everywhere; the useful gradient is
that of the unrounded ``x @ w.T``, i.e. ``grad @ (qdata * scale)``), and quantizing ``grad``
too would add rounding error to every upstream gradient. The weight itself is frozen
(``requires_grad=False``) in both modes.

``torch._int_mm`` on CUDA (cuBLASLt) checks ``mat1.size(0) > 16``, ``mat1.size(1) > 0`` and a
multiple of 8, and ``mat2.size(1) > 0`` and a multiple of 8 (``_int_mm_out_cuda`` in
``aten/src/ATen/native/cuda/Blas.cpp``, e.g. pytorch/pytorch@960a684; the CPU kernel has no
such limits). :func:`_padded_int_mm` zero-pads the rows of ``x_q`` to 17, ``K`` and ``N`` to
multiples of 8 and slices the result back: exact, since the added products are ``0 * q``.
It runs on CUDA only (``_PADDED_DEVICE_TYPES``); a decode step (``M <= 16``) pads only the
small activation, and the weight is padded (an int8 copy, never float) only when ``K`` or ``N``
is not a multiple of 8. Refused by name: a non-float input (``TypeError``), an input on a device
other than CPU or CUDA (``NotImplementedError``), an ``Int8SymmetricTensor`` as the left operand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_tp._tokens import QMAX, marked_rows, quantize_tokens
from torch_tp.quant.int8_tensor import Int8SymmetricTensor, implements

__all__: list[str] = []

aten = torch.ops.aten
# torch 2.13's CPU _weight_int8pack_mm is only used for float32: for bfloat16 it returns
# wrong results, or crashes the process, for some K that are not multiples of 8 (seen at
# K = 4, 12, 20, 28, 36, 100 -- e.g. a 40-feature input split over 2 ranks, K = 20). Other dtypes convert the int8
# matrix (exactly: |q| <= 127 fits bfloat16's mantissa) and use the regular matmul.
_PACKED_MM_DTYPES = (torch.float32,)
# W8A8: the inputs it quantizes, the devices it runs on, and the longest exact int32 sum
_W8A8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_W8A8_DEVICE_TYPES = ("cpu", "cuda", "meta")
_MAX_EXACT_K = (2**31 - 1) // (QMAX * QMAX)
# where torch._int_mm needs cuBLASLt's shapes (see the module docstring); tests add "cpu"
_PADDED_DEVICE_TYPES = ("cuda",)
_CUBLASLT_MIN_ROWS, _CUBLASLT_MULTIPLE = 17, 8


def _rows_times_weight(x2d: torch.Tensor, qdata_nk: torch.Tensor, scale_n: torch.Tensor) -> torch.Tensor:
    """``x2d @ (qdata_nk * scale_n[:, None]).t()`` computed in ``x2d.dtype`` without dequantizing."""
    scale_n = scale_n.to(x2d.dtype)
    if x2d.device.type == "cpu" and x2d.dtype in _PACKED_MM_DTYPES:
        return aten._weight_int8pack_mm(_unit_last_stride(x2d), _unit_last_stride(qdata_nk), scale_n)
    # ``scale * mm``, not ``mm * scale``: inductor pattern-matches the latter (bfloat16) into
    # _weight_int8pack_mm, the kernel avoided above, and then fails to lower it (torch 2.13).
    return scale_n * torch.mm(x2d, qdata_nk.t().to(x2d.dtype))


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with stride 1 along its last dim, as the CPU int8 kernel reads it. ``contiguous()``
    alone keeps a ``(M, 1)`` view of stride ``(1, M)`` (size-1 dims count as contiguous)."""
    if t.stride(-1) == 1 and t.is_contiguous():
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def _round_up(size: int, multiple: int) -> int:
    return -(-max(size, 1) // multiple) * multiple


def _padded_int_mm(x_q: torch.Tensor, qdata_nk: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm(x_q, qdata_nk.t())`` with the operands zero-padded to cuBLASLt's shapes
    (``M > 16``; ``K``, ``N`` positive multiples of 8) and the ``(M, N)`` result sliced out.
    Exact: a padded row or column of zeros adds nothing to any int32 sum."""
    m, k = x_q.shape
    n = qdata_nk.shape[0]
    pad_m, pad_k = max(m, _CUBLASLT_MIN_ROWS) - m, _round_up(k, _CUBLASLT_MULTIPLE) - k
    pad_n = _round_up(n, _CUBLASLT_MULTIPLE) - n
    if pad_m or pad_k:
        x_q = F.pad(x_q, (0, pad_k, 0, pad_m))
    if pad_k or pad_n:
        qdata_nk = F.pad(qdata_nk, (0, pad_k, 0, pad_n))
    out = torch._int_mm(x_q, qdata_nk.t())
    return out[:m, :n] if pad_m or pad_n else out


def _int8_product(x_q: torch.Tensor, qdata_nk: torch.Tensor) -> torch.Tensor:
    """The exact int32 ``x_q @ qdata_nk.t()`` (``torch._int_mm``; padded where the device needs it)."""
    qdata_nk = qdata_nk.contiguous()  # mat2 column-major, the layout cuBLASLt's int8 GEMM takes
    if x_q.device.type in _PADDED_DEVICE_TYPES:
        return _padded_int_mm(x_q, qdata_nk)
    return torch._int_mm(x_q, qdata_nk.t())


def _check_w8a8_input(x2d: torch.Tensor) -> None:
    where = "torch_tp.quant W8A8 linear (Int8SymmetricTensor with activations='int8')"
    if x2d.dtype not in _W8A8_DTYPES:
        raise TypeError(
            f"{where}: the input is {x2d.dtype}; it quantizes float32/bfloat16/float16 activations "
            f"per token. Cast the input, or quantize the weight with activations='float' (weight-only)"
        )
    if x2d.device.type not in _W8A8_DEVICE_TYPES:
        raise NotImplementedError(
            f"{where}: the input is on {x2d.device.type}; torch._int_mm is used on CPU and CUDA only. "
            f"Quantize the weight with activations='float' (weight-only) on this device"
        )
    if x2d.shape[-1] > _MAX_EXACT_K:
        raise ValueError(
            f"{where}: K = {x2d.shape[-1]} summed int8 products may overflow int32 (exact up to "
            f"K = {_MAX_EXACT_K}); shard the input features (RowwiseParallel) or use activations='float'"
        )


def _w8a8_rows_times_weight(x2d: torch.Tensor, qdata_nk: torch.Tensor, scale_n: torch.Tensor) -> torch.Tensor:
    """``x2d @ (qdata_nk * scale_n[:, None]).t()`` with ``x2d`` quantized per token: the exact
    int32 product of the int8 operands, times ``x_scale`` (per row) and ``scale_n`` (per column)."""
    _check_w8a8_input(x2d)
    x_q, x_scale = quantize_tokens(x2d)
    accumulated = _int8_product(x_q, qdata_nk)
    y = accumulated.to(torch.float32) * x_scale * scale_n.reshape(1, -1)
    # a token holding NaN or +-inf (a marked row) has no int8 product: its output row is NaN
    return torch.where(marked_rows(x_scale), torch.nan, y).to(x2d.dtype)


def _scales_per_output_column(qdata_kn: torch.Tensor, scale_kn: torch.Tensor) -> bool:
    """Whether a ``(K, N)`` operand's scales are ``(1, N)`` (one per output column), not
    ``(K, 1)`` (one per summed row). Decided by ``N``: a one-row shard's ``(1, 1)`` scale with
    ``N > 1`` is per summed row (``grad @ w`` for a weight of one output row)."""
    return scale_kn.shape[0] == 1 and scale_kn.shape[1] == qdata_kn.shape[1]


def _quantized_matmul(x2d: torch.Tensor, qdata_kn: torch.Tensor, scale_kn: torch.Tensor,
                      activations: str = "float") -> torch.Tensor:
    """``x2d @ (qdata_kn * scale_kn)`` for a ``(K, N)`` int8 operand, in ``x2d.dtype``.

    Scales per output column (``(1, N)``, a linear weight used as ``x @ w.t()``) factor out
    of the sum: ``(x @ q) * s``, with ``x`` quantized per token first when ``activations`` is
    ``"int8"`` (W8A8). Scales per summed row (``(K, 1)``: ``grad @ w`` in the backward of
    ``F.linear``) fold into the input first: ``(x * s.T) @ q``, weight-only in either mode (see
    the module docstring). Either way the int8 matrix is never scaled in float.
    """
    if _scales_per_output_column(qdata_kn, scale_kn):
        if activations == "int8":
            return _w8a8_rows_times_weight(x2d, qdata_kn.t(), scale_kn.reshape(-1))
        return _rows_times_weight(x2d, qdata_kn.t(), scale_kn.reshape(-1))
    scaled = x2d * scale_kn.reshape(1, -1).to(x2d.dtype)
    return torch.mm(scaled, qdata_kn.to(x2d.dtype))


def _linear(x: torch.Tensor, w: Int8SymmetricTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, bias)``: ``x @ w.t()`` for a weight of shape ``(out, in)``."""
    x2d = x.reshape(-1, x.shape[-1])
    y = _quantized_matmul(x2d, w.qdata.t(), w.scale.t(), w.activations)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _require_plain_input(x, op: str) -> None:
    if isinstance(x, Int8SymmetricTensor):
        raise NotImplementedError(
            f"torch_tp.quant: {op} with {type(x).__name__} as the input (left operand): only "
            f"weights are Int8SymmetricTensor. Pass float activations; for an int8 x int8 product, "
            f"quantize the weight with activations='int8' (W8A8 quantizes the input itself)"
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
    if not isinstance(w, Int8SymmetricTensor):  # the int8 tensor came in another role (addmm's added input)
        raise NotImplementedError(
            f"torch_tp.quant: {op} with an Int8SymmetricTensor that is not the right operand: int8 "
            f"tensors are weights, multiplied as x @ w.t() (F.linear). Dequantize it for other roles"
        )
    return _quantized_matmul(x, w.qdata, w.scale, w.activations)


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


@implements(aten.bmm.default)
def _int8_bmm(func, types, args, kwargs):
    """``x @ w`` per batch for a weight broadcast over the batch (stride 0: matmul's ``expand``
    of a 2-D weight): one ``(B * M, K) @ (K, N)`` product, per token as the 2-D path."""
    x, w = args[0], args[1]
    _require_plain_input(x, "bmm")
    if not isinstance(w, Int8SymmetricTensor) or w.qdata.stride(0) != 0 or w.scale.stride(0) != 0:
        raise NotImplementedError(
            f"torch_tp.quant: bmm with an Int8SymmetricTensor that is not one 2-D weight broadcast over "
            f"the batch (x @ w.t() of a batched input); int8 tensors are weights. Dequantize it for other roles"
        )
    batch, rows, k = x.shape
    y = _quantized_matmul(x.reshape(batch * rows, k), w.qdata[0], w.scale[0], w.activations)
    return y.reshape(batch, rows, y.shape[-1])


# A lookup multiplies nothing: the same in both activation modes.
@implements(aten.embedding.default)
def _int8_embedding(func, types, args, kwargs):
    weight, indices = args[0], args[1]
    if not weight.scale_follows(0):
        raise NotImplementedError(f"embedding with a transposed {type(weight).__name__}")
    rows = aten.embedding.default(weight.qdata, indices)
    scales = aten.embedding.default(weight.scale, indices)
    return (rows.to(torch.float32) * scales).to(weight.dtype)
