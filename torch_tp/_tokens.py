"""Rows as int8 with one float32 scale each: the one symmetric int8 rule of torch_tp.

A row is a slice of a tensor's last dim: a weight's row (``torch_tp.quant``'s per-row weights
quantize through :func:`quantize_tokens`) or an activation's token (its features).
:func:`quantize_tokens` is symmetric (``scale = amax / 127``; a row of zeros, or of no
elements, gets scale 1); :func:`packed_tokens` lays each leading row's int8 values and then
its scales' bytes out in one int8 row, so one collective moves both; :func:`unpacked_tokens`
reverses it. The packing serves the int8 communication ops of :mod:`torch_tp.overlap`
(``comm_dtype=torch.int8``). This module imports nothing from torch_tp.

**Non-finite values stay what they are**, element by element, as float communication keeps
them: a diverging run must not come out of an int8 collective with a finite loss. A row holding
NaN or +-inf is sent in *marked* form: its scale is negated (``-amax / 126``, ``amax`` over its
finite values), its finite values are rounded into ``[-126, 126]``, and the three codes left
over name the non-finite ones (:data:`NAN_CODE` -128, :data:`POS_INF_CODE` 127,
:data:`NEG_INF_CODE` -127). :func:`dequantize_tokens` decodes both forms; an unmarked row
(every row of a finite tensor) is exactly what it was before marking existed. Cost, measured by
``benchmarks/tokens.py``: no slower than the unmarked rule (the finite amax is one
``nan_to_num`` more, the decode one select over the codes).
Weights never take the marked form (``torch_tp.quant`` refuses a non-finite weight and any
``-128`` in int8 data that enters from outside). W8A8 (``torch_tp.quant``) multiplies the int8
values themselves: a marked row's output is NaN (:func:`marked_rows`).
Example::

    >>> x = torch.tensor([[[1.0, -0.5]], [[0.0, 2.0]]])
    >>> rows = packed_tokens(x)                      # (2, 2 int8 + 4 scale bytes)
    >>> rows.shape, torch.allclose(unpacked_tokens(rows, [2, 1, 2], torch.float32), x, atol=0.01)
    (torch.Size([2, 6]), True)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "NAN_CODE",
    "NEG_INF_CODE",
    "POS_INF_CODE",
    "QMAX",
    "dequantize_rows",
    "dequantize_tokens",
    "marked_rows",
    "numel",
    "packed_tokens",
    "quantize_tokens",
    "unpacked_tokens",
]

#: The largest int8 magnitude used: the range is symmetric, [-127, 127].
QMAX = 127


#: The codes of a marked row's non-finite values (its finite ones lie in [-126, 126]).
NAN_CODE, POS_INF_CODE, NEG_INF_CODE = -128, QMAX, -QMAX


def quantize_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(int8 values, float32 scale per row)`` of ``x``: symmetric, one scale per row of its
    last dim (``amax / 127``; a row of zeros, or of no elements, gets scale 1). A row holding
    NaN or +-inf is marked (negative scale, see the module docstring).

    Example::

        >>> q, scale = quantize_tokens(torch.tensor([[1.0, -0.5], [0.0, 0.0]]))
        >>> q.tolist(), scale.flatten().tolist()
        ([[127, -64], [0, 0]], [0.007874015718698502, 1.0])
        >>> q, scale = quantize_tokens(torch.tensor([[1.0, float("nan"), float("-inf")]]))
        >>> q.tolist(), scale.flatten().tolist()
        ([[126, -128, -127]], [-0.007936508394777775])
    """
    x32 = x.float()
    magnitude = x32.abs()
    if x32.shape[-1] == 0:  # rows of no elements (amax refuses them): scale 1
        amax = x32.new_zeros(*x32.shape[:-1], 1)
        marked = amax != 0
    else:  # amax propagates NaN and inf: a row's amax differs from its finite amax iff it holds one
        amax = torch.nan_to_num(magnitude, nan=0.0, posinf=0.0).amax(dim=-1, keepdim=True)
        marked = magnitude.amax(dim=-1, keepdim=True) != amax
    step = amax / torch.where(marked, QMAX - 1.0, float(QMAX))
    scale = torch.where(step > 0, step, 1.0)  # zeros, and amax so small its step underflows: scale 1
    # finite values round into [-126, 126] in a marked row; +-inf clamp to +-127; NaN stays NaN
    q = torch.clamp(torch.round(x32 / scale), -QMAX, QMAX).nan_to_num_(nan=NAN_CODE)
    return q.to(torch.int8), torch.where(marked, -scale, scale)


def marked_rows(scale: Tensor) -> Tensor:
    """Which rows :func:`quantize_tokens` marked as holding NaN or +-inf (their scale is negative).

    Example::

        >>> marked_rows(quantize_tokens(torch.tensor([[1.0], [float("inf")]]))[1]).flatten().tolist()
        [False, True]
    """
    return scale < 0


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``q * scale`` in float32 for rows never marked (a weight's), returned as ``dtype``:
    within float32's range (``127 * (amax / 127)`` may round past ``amax``; it never becomes inf).

    Example::

        >>> dequantize_rows(torch.tensor([[127, -64]], dtype=torch.int8), torch.tensor([[0.5]]), torch.float32)
        tensor([[ 63.5000, -32.0000]])
    """
    return _scaled(q, scale).to(dtype)


def dequantize_tokens(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``q * scale`` in float32, returned as ``dtype`` (``scale`` broadcasts over ``q``); a
    marked row's codes decode to NaN and +-inf.

    Example::

        >>> dequantize_tokens(torch.tensor([[127, -64]], dtype=torch.int8), torch.tensor([[0.5]]), torch.float32)
        tensor([[ 63.5000, -32.0000]])
        >>> dequantize_tokens(torch.tensor([[126, -128, -127]], dtype=torch.int8), torch.tensor([[-0.5]]), torch.float32)
        tensor([[63.,  nan, -inf]])
    """
    values = _scaled(q, scale.abs())
    special = marked_rows(scale) & ((q >= POS_INF_CODE) | (q <= NEG_INF_CODE))  # only in marked rows
    decoded = torch.where(q == NAN_CODE, torch.nan, torch.where(q > 0, torch.inf, -torch.inf))
    return torch.where(special, decoded, values).to(dtype)


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _scaled(q: Tensor, scale: Tensor) -> Tensor:
    return (q.float() * scale).clamp_(-_FLOAT32_MAX, _FLOAT32_MAX)


def packed_tokens(x: Tensor) -> Tensor:
    """``x`` (``(rows, ..., E)``) quantized per token, as one int8 row per leading index: the
    int8 values, then the scales' bytes.

    Example::

        >>> packed_tokens(torch.ones(3, 2, 4)).shape   # 2 tokens of 4 features: 8 + 2 * 4 bytes
        torch.Size([3, 16])
    """
    q, scale = quantize_tokens(x)
    rows, tokens = x.shape[0], numel(x.shape[1:-1])  # explicit sizes: any of them may be 0
    return torch.cat([q.reshape(rows, tokens * x.shape[-1]), scale.reshape(rows, tokens).view(torch.int8)], dim=1)


def unpacked_tokens(packed: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    """The inverse of :func:`packed_tokens`: ``packed`` ``(rows, bytes)`` back to floats of ``shape``.

    Example::

        >>> unpacked_tokens(packed_tokens(torch.ones(3, 2, 4)), [3, 2, 4], torch.float32).unique()
        tensor([1.])
    """
    per_row = numel(shape[1:])
    q = packed[:, :per_row].reshape(shape)
    scale = packed[:, per_row:].clone().reshape(-1).view(torch.float32).reshape(*shape[:-1], 1)  # at offset 0
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
