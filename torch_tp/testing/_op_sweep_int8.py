"""The op sweep's int8 weight surface: ``Int8SymmetricTensor`` (weight-only) in place of each
non-empty 2-D float32 argument of an OpInfo sample, against the op on its float values
(``dequantize()``); and the extra samples both int8 weight surfaces (this and W8A8,
:mod:`torch_tp.testing._op_sweep_w8a8`) add to the database's.

Example::

    >>> # xdoctest: +SKIP("imports the OpInfo database (a few seconds)")
    >>> from torch_tp.testing._op_sweep import sweep_ops
    >>> sweep_ops(INT8_WEIGHT, samples_per_op=1).by_op()["t"]["equal"]
    2
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from torch_tp.testing._op_sweep import Surface

__all__ = ["INT8_WEIGHT", "int8_weight_positions", "weight_extra_samples"]


def int8_weight_positions(args: Sequence[Any]) -> list[int]:
    """The positions of ``args`` an int8 weight can take: non-empty 2-D float32 tensors.

    Example::

        >>> int8_weight_positions([torch.ones(2, 3), 1.0, torch.ones(3)])
        [0]
    """
    return [i for i, a in enumerate(args) if type(a) is torch.Tensor and a.layout == torch.strided
            and a.dtype == torch.float32 and a.ndim == 2 and a.numel() > 0]


def _int8_weight(t: torch.Tensor) -> torch.Tensor:
    from torch_tp.quant import Int8SymmetricTensor

    return Int8SymmetricTensor.from_hp(torch.nan_to_num(t))  # a weight holds no NaN or inf (refused)


def _dequantized(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize()


def weight_extra_samples(args: list, kwargs: dict) -> list[tuple[str, list, dict]]:
    """The int8 weight surfaces' extra samples of an op: ``non-finite`` (NaN, inf and -inf in every
    float argument, the activations; the weight is made finite, weights hold none) and ``no rows``
    (the first argument with 0 rows: an empty batch).

    Example::

        >>> [label for label, _, _ in weight_extra_samples([torch.ones(2, 2), torch.ones(2, 2)], {})]
        ['non-finite', 'no rows']
    """
    def non_finite(a: Any) -> Any:
        if not (type(a) is torch.Tensor and a.layout == torch.strided and a.dtype == torch.float32 and a.numel() >= 3):
            return a
        bad = a.clone(memory_format=torch.contiguous_format)
        bad.view(-1)[0], bad.view(-1)[1], bad.view(-1)[-1] = math.nan, math.inf, -math.inf
        return bad

    extra = [("non-finite", [non_finite(a) for a in args], kwargs)]
    x = args[0]
    if type(x) is torch.Tensor and x.layout == torch.strided and x.ndim >= 2 and x.shape[0] > 0:
        extra.append(("no rows", [x[:0].clone(), *args[1:]], kwargs))
    return extra


#: ``Int8SymmetricTensor`` (weight-only) in place of each non-empty 2-D float32 argument.
INT8_WEIGHT = Surface("int8 weight", int8_weight_positions, _int8_weight, _dequantized, extra=weight_extra_samples)
