"""Which ops a spatial model runs on its strips: an allowlist, checked at every op.

Inside a ``SpatialParallel`` model's forward, :class:`RegionGuard` (a ``TorchDispatchMode``)
sees every aten op before DTensor does. An op on a DTensor that is sharded or partial (its
strips, or a partial sum of them) runs only along a path known to be correct there:

====================================================  ===========================================
op                                                    path
====================================================  ===========================================
an op of a handler set the model holds (convolution,  torch_tp's handler (:mod:`torch_tp.conv._registry`)
BatchNorm, GroupNorm, pooling, padding, upsampling,
the activations DTensor lacks, spatial means)
an elementwise op (``torch.Tag.pointwise``)           DTensor's pointwise rule: same strips in and out
``VIEWS``: views, copies, ``*_like``, ``cat``         DTensor's view and tensor rules
``REDUCTIONS``: ``sum``, ``amax``, ``var``, ...       DTensor's reduction rules (partial, then reduced)
``MATMULS``: ``mm``, ``addmm``, ``bmm``, ...           DTensor's matrix-product rules (those of TP)
``SCANS``: ``cumsum``, ``cumprod``, ...               DTensor's scan rule (it gathers a sharded dim)
a random op (dropout, ``rand_like``, ``bernoulli``)   refused: each rank's generator would draw its own
                                                      strip's numbers, unlike one process
anything else                                         refused: :class:`UnsupportedSpatialOpError`
====================================================  ===========================================

Every ``dim`` argument is normalized (``-1`` -> ``ndim - 1``) before DTensor sees it: upstream's
scan rule compares a negative dim with its shard dims and scanned each strip on its own.
An op on plain tensors, or on DTensors replicated on every mesh dim (the head of a classifier
after its global pool), runs as in one process and is not checked, except random ops.

What the guard cannot see: the backward pass (autograd derives it from the forward ops allowed
here; the handlers' backward ops run through their handlers).

Example::

    >>> from torch_tp.conv._region_ops import allowed_reason
    >>> import torch
    >>> aten = torch.ops.aten
    >>> allowed_reason(aten.add.Tensor), allowed_reason(aten.cumsum.default)
    ('elementwise', 'scan')
    >>> allowed_reason(aten.sort.default) is None
    True
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torch_tp.conv import _registry

__all__ = ["MATMULS", "REDUCTIONS", "SCANS", "VIEWS", "RegionGuard", "UnsupportedSpatialOpError", "allowed_reason"]

aten = torch.ops.aten


class UnsupportedSpatialOpError(NotImplementedError):
    """An op a spatial model ran on its strips that torch_tp cannot prove correct there.

    Example::

        >>> raise UnsupportedSpatialOpError("torch_tp.conv: aten.sort.default in 'net' ...")
        Traceback (most recent call last):
        ...
        torch_tp.conv._region_ops.UnsupportedSpatialOpError: torch_tp.conv: aten.sort.default in 'net' ...
    """


def _overloads(*packets: Any) -> frozenset:
    return frozenset(getattr(p, name) for p in packets for name in p.overloads())


#: DTensor's view, copy and tensor-creation rules: they keep a strip a strip, or gather first.
VIEWS = _overloads(
    aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.t, aten.unsqueeze,
    aten.squeeze, aten.flatten, aten.expand, aten.alias, aten.detach, aten.clone, aten.contiguous,
    aten._to_copy, aten.copy_, aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like,
    aten.fill_, aten.zero_, aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full,
    aten.cat, aten.stack, aten.split, aten.split_with_sizes, aten.chunk, aten.slice, aten.select,
    aten.unbind, aten.narrow, aten.movedim, aten.view_as, aten.expand_as,
)

#: DTensor's reduction rules: a reduced sharded dim becomes a partial result, then reduced.
REDUCTIONS = _overloads(
    aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.var, aten.std, aten.var_mean,
    aten.std_mean, aten.prod, aten.linalg_vector_norm, aten.norm, aten.any, aten.all, aten.argmax,
    aten.argmin, aten.logsumexp,
)

#: DTensor's matrix-product rules (the ones tensor parallelism runs on): a contracted sharded dim
#: gives a partial sum, reduced where needed.
MATMULS = _overloads(aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.mv, aten.addmv, aten.dot)

#: DTensor's scan rule: a sharded scanned dim is gathered first (once dims are normalized).
SCANS = _overloads(aten.cumsum, aten.cumprod, aten.cummax, aten.cummin, aten.logcumsumexp)

_ADDS_A_DIM = _overloads(aten.unsqueeze, aten.stack)
_DIM_ARGUMENTS = ("dim", "dims", "dim0", "dim1", "start_dim", "end_dim", "source", "destination")


@functools.cache
def _random_ops() -> frozenset:
    return frozenset(DTensor._op_dispatcher._random_ops) | _overloads(
        aten.dropout, aten.native_dropout, aten.bernoulli, aten.bernoulli_, aten.rand_like, aten.randn_like,
        aten.randint_like, aten.uniform_, aten.normal_, aten.exponential_, aten.geometric_, aten.log_normal_,
        aten.cauchy_, aten.random_, aten.multinomial, aten.randperm,
    )


def allowed_reason(op: Any) -> str | None:
    """Why ``op`` may run on a spatial model's strips (``"handler"``, ``"elementwise"``, ``"view"``,
    ``"reduction"``, ``"matmul"``, ``"scan"``), or ``None`` when nothing proves it correct there.

    Example::

        >>> allowed_reason(torch.ops.aten.sum.dim_IntList)
        'reduction'
    """
    if op in _random_ops():
        return None
    if _registry.handles(op):
        return "handler"
    if torch.Tag.pointwise in op.tags:
        return "elementwise"
    for reason, table in (("view", VIEWS), ("reduction", REDUCTIONS), ("matmul", MATMULS), ("scan", SCANS)):
        if op in table:
            return reason
    return None


def _split_strips(args: Any) -> bool:
    """Whether any DTensor among ``args`` is sharded or partial on some mesh dim."""
    flat, _ = tree_flatten(args)
    return any(isinstance(a, DTensor) and any(not isinstance(p, Replicate) for p in a.placements) for a in flat)


def _has_dtensor(args: Any) -> bool:
    flat, _ = tree_flatten(args)
    return any(isinstance(a, DTensor) for a in flat)


def _first_ndim(args: tuple, kwargs: dict) -> int | None:
    flat, _ = tree_flatten((args, kwargs))
    return next((a.ndim for a in flat if isinstance(a, torch.Tensor)), None)


def _normalized_dims(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with every negative dim argument made positive (``ndim`` of the first
    tensor; ``unsqueeze`` counts the dim it adds)."""
    ndim = _first_ndim(args, kwargs)
    if ndim is None:
        return args, kwargs
    if op in _ADDS_A_DIM:
        ndim += 1

    def fix(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            return value % ndim if ndim else value
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            return type(value)(fix(v) for v in value)
        return value

    args, kwargs = list(args), dict(kwargs)
    for i, argument in enumerate(op._schema.arguments):
        if argument.name not in _DIM_ARGUMENTS:
            continue
        if i < len(args):
            args[i] = fix(args[i])
        elif argument.name in kwargs:
            kwargs[argument.name] = fix(kwargs[argument.name])
    return tuple(args), kwargs


class RegionGuard(TorchDispatchMode):
    """Checks each op a spatial model runs (see the module's table); ``where`` names the model.

    Entered by the model's forward pre-hook, left by its forward hook (also on exceptions).

    Example::

        >>> import torch
        >>> with RegionGuard("net"):
        ...     torch.ones(2).cumsum(-1)  # plain tensors run as in one process
        tensor([1., 2.])
    """

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            args, kwargs = self._checked(func, args, kwargs)
        return func(*args, **kwargs)

    def _checked(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if func in _random_ops() and _has_dtensor((args, kwargs)):
            raise UnsupportedSpatialOpError(
                f"torch_tp.conv: the random op {func} ran on DTensors inside the spatial model {self.where}: "
                f"each rank's generator would draw its own numbers, unlike one process (a dropout mask per "
                f"strip). Run it outside the model (SpatialParallel(until=...) stops the region before a "
                f"head with dropout), or put the model in eval() mode"
            )
        if not _split_strips((args, kwargs)):
            return args, kwargs
        reason = allowed_reason(func)
        if reason is None:
            raise UnsupportedSpatialOpError(
                f"torch_tp.conv: {func} ran on a spatially sharded DTensor inside the spatial model "
                f"{self.where}, and torch_tp knows no rule for it along the sharded dim (DTensor's default "
                f"could give each strip its own answer). Run it outside the region (SpatialParallel(until=...)), "
                f"on a whole tensor (x.full_tensor()), or add a handler (DEVELOPERS.md: 'Adding a spatial op "
                f"handler'); torch_tp.conv._region_ops lists what runs"
            )
        return _normalized_dims(func, args, kwargs)
