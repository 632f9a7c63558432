"""The op sweep's W8A8 surface: an ``Int8SymmetricTensor`` with ``activations="int8"`` in place of
each non-empty 2-D float32 argument, against the op on its float values *with the activations
rounded as W8A8 rounds them*.

W8A8 (``torch_tp/quant/_ops_matmul.py``) quantizes the left operand of a product whose weight
scales are per output column (``x @ w.t()``: ``F.linear``, ``mm``, ``addmm``, ``matmul``,
``bmm`` of a broadcast weight) per row, by :func:`torch_tp._tokens.quantize_tokens`, and
multiplies the int8 values exactly. So the reference runs the op on the weight's float values
(``dequantize()``) under :class:`RoundedActivations`, a dispatch mode that replaces that left
operand by ``dequantize_tokens(*quantize_tokens(x))`` at exactly those products (the weight's
transpose as the right operand; a product that sums over the weight's rows, ``grad @ w``, stays
weight-only, as in W8A8). W8A8's rounding is then not counted as wrong; anything else is.
A marked row (NaN or +-inf in a token) gives W8A8 a NaN output row, where the reference is
non-finite too: equal under "non-finite where one process is".

Extra samples, as for int8 weights (:func:`~torch_tp.testing._op_sweep_int8.weight_extra_samples`):
``non-finite`` activations and ``no rows``.

Example::

    >>> # xdoctest: +SKIP("imports the OpInfo database (a few seconds)")
    >>> from torch_tp.testing._op_sweep import sweep_ops
    >>> sweep_ops(W8A8, samples_per_op=2).failures()
    []
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_tp._tokens import dequantize_tokens, quantize_tokens
from torch_tp.testing._op_sweep import _UNINITIALIZED, Surface, _float_values, compared, refusal
from torch_tp.testing._op_sweep_int8 import int8_weight_positions, weight_extra_samples

__all__ = ["W8A8", "RoundedActivations"]

aten = torch.ops.aten
_TOLERANCE = dict(rtol=1e-4, atol=1e-4)
#: products W8A8 runs (``_ops_matmul.py``): ``(left operand index, right operand index)``
_PRODUCTS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
             aten.linear.default: (0, 1)}


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` as W8A8 sees it: quantized per row of its last dim and dequantized."""
    return dequantize_tokens(*quantize_tokens(x), x.dtype)


class RoundedActivations(TorchDispatchMode):
    """Inside, a product of a float tensor and ``weight``'s transpose (``x @ weight.t()``, what W8A8
    quantizes the input of) runs on the rounded tensor: ``dequantize_tokens(*quantize_tokens(x))``.

    Example::

        >>> w = torch.tensor([[1.0, 2.0]])
        >>> x = torch.tensor([[0.3, 1.0]])
        >>> with RoundedActivations(w):
        ...     y = x @ w.t()
        >>> torch.allclose(y, _rounded(x) @ w.t()), torch.equal(y, x @ w.t())
        (True, False)
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def _per_output_column(self, b: torch.Tensor, linear: bool) -> bool:
        """Whether ``b`` (a right operand) is a view of the weight's rows used with their scales per
        output column: transposed (``weight.t()``, a chunk of its rows transposed: attention's packed
        projection), or untransposed for ``linear``; a batch of it too (``bmm``'s ``expand``)."""
        w = self.weight
        if b.ndim < 2 or b.untyped_storage().data_ptr() != w.untyped_storage().data_ptr():
            return False
        if any(s != 0 for s in b.stride()[:-2]):
            return False
        row, column = w.stride()
        if b.numel() == 1:  # a (1, 1) weight's scale is both per row and per column: W8A8 takes it as per column
            return True
        return b.stride()[-2:] == ((row, column) if linear else (column, row))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _PRODUCTS:
            left, right = _PRODUCTS[func]
            a, b = args[left], args[right]
            if (isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor) and a.is_floating_point()
                    and self._per_output_column(b, func is aten.linear.default)):
                args = (*args[:left], _rounded(a), *args[left + 1:])
        return func(*args, **kwargs)


def _w8a8_weight(t: torch.Tensor) -> torch.Tensor:
    from torch_tp.quant import Int8SymmetricTensor

    return Int8SymmetricTensor.from_hp(torch.nan_to_num(t), activations="int8")


def _run_w8a8(op, args: list, kwargs: dict, position: int) -> list[tuple[str, str, str]]:
    lifted = _w8a8_weight(args[position])
    floats, surfaced = list(args), list(args)
    floats[position], surfaced[position] = lifted.dequantize(), lifted
    try:
        torch.manual_seed(0)
        with RoundedActivations(floats[position]):
            want = op(*floats, **kwargs)
    except Exception:
        return []  # not a case: the float op refuses this sample
    try:
        torch.manual_seed(0)
        got = op(*surfaced, **kwargs)
    except Exception as error:
        return [("out of place", *refusal(error))]
    return [("out of place", *compared(_float_values(got), want, op.name in _UNINITIALIZED, **_TOLERANCE))]


#: ``Int8SymmetricTensor.from_hp(w, activations="int8")`` (W8A8) in place of each non-empty 2-D
#: float32 argument, against the op on its float values with W8A8's activation rounding.
W8A8 = Surface("W8A8 weight", int8_weight_positions, run=_run_w8a8, extra=weight_extra_samples)
