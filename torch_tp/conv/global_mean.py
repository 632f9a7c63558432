"""A DTensor handler for ``aten.mean.dim`` that reduces uneven strips without gathering them.

| op | reached by | the handler |
| --- | --- | --- |
| ``mean.dim`` | ``x.mean((2, 3))`` (squeeze-excite), ``nn.AdaptiveAvgPool*d(1)``, any ``mean`` over dims | :func:`mean_handler`: a ``sum`` over the dims, divided by the global count |
| ``mean.default`` | ``x.mean()`` | :func:`mean_handler`, over every dim |

Installed by a ``SpatialParallel`` model that needs it, or for every op by :func:`sharded_mean`
(:mod:`torch_tp.conv._registry`).

DTensor's own rule for ``mean`` over a sharded dim gives ``Partial(avg)`` (the mean of the
ranks' means) only when the shards are even; on uneven strips (width 18 on 4 ranks: 5, 5, 5, 3)
it all-gathers the whole input first, on every rank, in every squeeze-excite block. Here the
mean is computed as ``sum(x, dims) / count`` with DTensor's ``sum``, which reduces uneven shards
locally to ``Partial(sum)``; dividing by the global count keeps it partial. So the forward
sends nothing (the ``Partial`` is reduced where its value is needed, one all-reduce of the
small result), whatever the strips. Floating-point half types accumulate in float32, as
aten's ``mean`` does. The backward is autograd's formula for ``mean``, unchanged.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from torch_tp.conv.global_mean import sharded_mean
    >>> x = distribute_tensor(torch.randn(2, 8, 4, 18), mesh, [Shard(3)])   # 4 ranks: 5, 5, 5, 3
    >>> with sharded_mean():
    ...     y = x.mean((2, 3))
    >>> y.placements                                                       # no all-gather
    (Partial(sum),)
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor

from torch_tp.conv._core import bind
from torch_tp.conv._registry import HandlerSet

__all__ = ["install", "is_installed", "mean_handler", "sharded_mean", "uninstall"]

aten = torch.ops.aten
HANDLERS = HandlerSet("torch_tp.conv.global_mean")

_HALF_TYPES = (torch.float16, torch.bfloat16)


def _reduced_dims(ndim: int, dim: Optional[Sequence[int]]) -> list[int]:
    """The dims ``mean`` reduces, non-negative (``None`` or ``[]``: all of them).

    Example:
        >>> _reduced_dims(4, [-1, 2]), _reduced_dims(3, None)
        ([3, 2], [0, 1, 2])
    """
    if not dim:
        return list(range(ndim))
    return [d % ndim for d in dim]


@HANDLERS.implements(aten.mean.dim, aten.mean.default)
def mean_handler(op_call: Any, args: tuple, kwargs: dict) -> DTensor:
    """DTensor handler for ``aten.mean.dim`` (``args`` = ``(input, dim, keepdim=False, dtype=None)``)
    and ``aten.mean.default`` (``(input,)``, ``dtype`` a keyword).

    Returns ``sum(input, dim, keepdim) / count`` computed by DTensor (its placements are
    ``sum``'s: ``Partial(sum)`` on each mesh dim that shards a reduced dim), ``count`` being the
    number of elements each output averages in the global tensor.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; install() routes mean on DTensors here")
        >>> y = mean_handler(aten.mean.dim, (x, [2, 3]), {})
        >>> y.placements, y.full_tensor().shape
        ((Partial(sum),), torch.Size([2, 8]))
    """
    if op_call is aten.mean.default:  # mean(input, *, dtype=None): every dim
        (x,), dim, keepdim, dtype = args, None, False, (kwargs or {}).get("dtype")
    else:
        x, dim, keepdim, dtype = bind(args, kwargs, ("input", "dim", "keepdim", "dtype"))
    out_dtype = dtype or x.dtype
    if not (out_dtype.is_floating_point or out_dtype.is_complex):
        torch.zeros(1, dtype=out_dtype).mean(0)  # raises aten's own error (its text), on every rank
    accumulate = torch.float32 if out_dtype in _HALF_TYPES else out_dtype
    dims = _reduced_dims(x.ndim, dim)
    count = math.prod(x.shape[d] for d in dims)
    total = aten.sum.dim_IntList(x, dims, bool(keepdim), dtype=accumulate)
    mean = aten.div.Scalar(total, count)
    return mean if mean.dtype == out_dtype else aten._to_copy.default(mean, dtype=out_dtype)


# --------------------------------------------------------------------------------------------
# Installation
# --------------------------------------------------------------------------------------------

install, uninstall, is_installed, sharded_mean = HANDLERS.public_functions("sharded_mean", "mean")
