"""Plain-tensor math of symmetric per-row int8 quantization of weights (no subclass here).

``w ~= qdata * scale`` with ``qdata = round(w / scale)`` in [-127, 127] and
``scale = max|row| / 127`` per row, zero-point 0. An all-zero row gets scale 1 (finite;
its values dequantize to exactly 0), and so does a row of no elements (a ``(rows, 0)``
weight: ``qdata`` ``(rows, 0)``, ``scale`` ``(rows, 1)``). The rule itself is
:func:`torch_tp._tokens.quantize_tokens`, shared with the int8 activation communication;
this module adds what a weight must be.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torch_tp._tokens import QMAX, dequantize_rows, quantize_tokens

__all__ = ["QMAX", "quantize_per_row", "dequantize_per_row"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_weight(w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"expected a float tensor to quantize, got {type(w).__name__}")
    if isinstance(w, DTensor):
        raise TypeError(
            f"this weight is already a DTensor ({w.placements}): quantize the model first, "
            f"then parallelize_module it (the styles shard the quantized weight)"
        )
    if w.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"int8 symmetric quantization takes a float32/bfloat16/float16 weight, got {w.dtype}; "
            f"integer tensors are already quantized or are not weights"
        )
    if w.ndim != 2:
        raise ValueError(
            f"int8 symmetric quantization takes a 2-D weight (rows x features, as nn.Linear / "
            f"nn.Embedding hold), got shape {tuple(w.shape)}"
        )
    if w.device.type != "meta" and not torch.compiler.is_compiling() and not bool(torch.isfinite(w).all()):
        raise ValueError("cannot quantize a weight containing NaN or inf")


def quantize_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float ``w`` to ``(qdata int8 of w's shape, scale float32 of shape (rows, 1))``.

    Example::

        >>> qdata, scale = quantize_per_row(torch.tensor([[1.0, -0.5], [0.0, 0.0]]))
        >>> qdata.tolist(), scale.flatten().tolist()
        ([[127, -64], [0, 0]], [0.007874015718698502, 1.0])
    """
    _check_weight(w)
    return quantize_tokens(w.detach())


def dequantize_per_row(qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``qdata * scale`` in float32, returned as ``dtype`` (``scale`` broadcasts over ``qdata``).

    Example::

        >>> dequantize_per_row(torch.tensor([[127, -64]], dtype=torch.int8), torch.tensor([[0.5]]), torch.float32)
        tensor([[ 63.5000, -32.0000]])
    """
    return dequantize_rows(qdata, scale, dtype)  # a weight is never marked: non-finite weights are refused
