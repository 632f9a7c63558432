"""Rows as int8 with one float32 scale each: the one symmetric int8 rule of torch_tp.

A row is a slice of a tensor's last dim: a weight's row (``torch_tp.quant``'s per-row weights
quantize through :func:`quantize_tokens`) or an activation's token (its features).
:func:`quantize_tokens` is symmetric (``scale = amax / 127``; a row of zeros, or of no
elements, gets scale 1); :func:`packed_tokens` lays each leading row's int8 values and then
its scales' bytes out in one int8 row, so one collective moves both; :func:`unpacked_tokens`
reverses it. The packing serves the int8 communication ops of :mod:`torch_tp.overlap`
(``comm_dtype=torch.int8``). This module imports nothing from torch_tp.

Example::

    >>> x = torch.tensor([[[1.0, -0.5]], [[0.0, 2.0]]])
    >>> rows = packed_tokens(x)                      # (2, 2 int8 + 4 scale bytes)
    >>> rows.shape, torch.allclose(unpacked_tokens(rows, [2, 1, 2], torch.float32), x, atol=0.01)
    (torch.Size([2, 6]), True)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["QMAX", "dequantize_tokens", "numel", "packed_tokens", "quantize_tokens", "unpacked_tokens"]

#: The largest int8 magnitude used: the range is symmetric, [-127, 127].
QMAX = 127


def quantize_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(int8 values, float32 scale per row)`` of ``x``: symmetric, one scale per row of its
    last dim (``amax / 127``; a row of zeros, or of no elements, gets scale 1).

    Example::

        >>> q, scale = quantize_tokens(torch.tensor([[1.0, -0.5], [0.0, 0.0]]))
        >>> q.tolist(), scale.flatten().tolist()
        ([[127, -64], [0, 0]], [0.007874015718698502, 1.0])
    """
    x32 = x.float()
    if x32.shape[-1] == 0:  # rows of no elements (amax refuses them): scale 1
        amax = x32.new_zeros(*x32.shape[:-1], 1)
    else:
        amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    return torch.clamp(torch.round(x32 / scale), -QMAX, QMAX).to(torch.int8), scale


def dequantize_tokens(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``q * scale`` in float32, returned as ``dtype`` (``scale`` broadcasts over ``q``).

    Example::

        >>> dequantize_tokens(torch.tensor([[127, -64]], dtype=torch.int8), torch.tensor([[0.5]]), torch.float32)
        tensor([[ 63.5000, -32.0000]])
    """
    return (q.float() * scale).to(dtype)


def packed_tokens(x: Tensor) -> Tensor:
    """``x`` (``(rows, ..., E)``) quantized per token, as one int8 row per leading index: the
    int8 values, then the scales' bytes.

    Example::

        >>> packed_tokens(torch.ones(3, 2, 4)).shape   # 2 tokens of 4 features: 8 + 2 * 4 bytes
        torch.Size([3, 16])
    """
    q, scale = quantize_tokens(x)
    rows = x.shape[0]
    return torch.cat([q.reshape(rows, -1), scale.reshape(rows, -1).view(torch.int8)], dim=1)


def unpacked_tokens(packed: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    """The inverse of :func:`packed_tokens`: ``packed`` ``(rows, bytes)`` back to floats of ``shape``.

    Example::

        >>> unpacked_tokens(packed_tokens(torch.ones(3, 2, 4)), [3, 2, 4], torch.float32).unique()
        tensor([1.])
    """
    per_row = numel(shape[1:])
    q = packed[:, :per_row].reshape(shape)
    scale = packed[:, per_row:].contiguous().view(torch.float32).reshape(*shape[:-1], 1)
    return dequantize_tokens(q, scale, dtype)


def numel(shape) -> int:
    """The product of ``shape``.

    Example::

        >>> numel([2, 3, 4])
        24
    """
    n = 1
    for size in shape:
        n *= size
    return n
