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
``REDUCTIONS``: ``sum``, ``amax``, ``var``, ...       DTensor's reduction rules (partial, then reduced);
                                                      with an empty strip, ``NO_IDENTITY`` ones gather
                                                      first; a boolean partial sum (``any``) is reduced
``MATMULS``: ``mm``, ``addmm``, ``bmm``, ...           DTensor's matrix-product rules (those of TP)
``SCANS``: ``cumsum``, ``cummax``, ...                DTensor's scan rule (it gathers a sharded dim)
``PLAIN_TENSOR_BACKWARD``: ``prod`` over a dim,       called directly (``torch.cumprod``, ``x.prod(3)``):
``cumprod``, ``cummax``, ``cummin``, needing a        run on the whole value as plain tensors; reached
gradient (on any DTensor)                             any other way: refused
an in-place write into a view the sharded dim was     carried back to the strips (:func:`~torch_tp.conv.
gathered for (``y[..., :2].zero_()``, ``y[..., 0] =   _core.written_into`` for a slice or select), or
v``, ``y.narrow(-1, 0, 2).mul_(0)``)                  refused naming the op and the dim
a random op (dropout, ``rand_like``, ``bernoulli``)   refused: each rank's generator would draw its own
                                                      strip's numbers, unlike one process
anything else                                         refused: :class:`UnsupportedSpatialOpError`
====================================================  ===========================================

Every ``dim`` argument is normalized (``-1`` -> ``ndim - 1``; ``dim=[]`` of a reduction that then
reduces every dim, every dim) before DTensor sees it: upstream's scan rule compares a negative dim
with its shard dims and scanned each strip on its own, and its reduction rules reduce nothing for
``dim=[]``. An op on plain tensors, or on DTensors replicated on every mesh dim (the head of a
classifier after its global pool), runs as in one process and is not checked, except random ops,
``PLAIN_TENSOR_BACKWARD`` and writes into a recorded view.

Writes through views: a view of a sharded DTensor along its sharded dim is a gathered copy
(DTensor replicates the dim first), so a write into it would be lost for the strips, and so would
autograd's bookkeeping of in-place ops on views. The guard records such copies (and views of
them); :class:`_RegionWrites`, a ``TorchFunctionMode`` entered with the guard, sees in-place
methods and ``__setitem__`` above autograd and runs them out of place, writing the result into the
strips with an ordinary ``copy_`` (forward and backward equal one process); a recorded view read
after its base changed in place is refreshed first.

What the guard cannot see: the backward pass (autograd derives it from the forward ops allowed
here; the handlers' backward ops run through their handlers, :mod:`torch_tp.conv.pointwise`'s
among them: ``masked_fill_(mask, 0)`` on a partial sum and ``sum`` with ``dim=[]``,
which the derivatives of ``std``, the norms and ``amax`` run).

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

import dataclasses
import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from torch_tp._layouts import shard_sizes
from torch_tp.conv import _registry
from torch_tp.conv._core import UnsupportedSpatialOpError, written_into

__all__ = ["MATMULS", "NO_IDENTITY", "OFF_THE_ALLOWLIST", "PLAIN_TENSOR_BACKWARD", "REDUCTIONS", "SCANS", "VIEWS", "RegionGuard",
           "UnsupportedSpatialOpError", "allowed_reason"]

aten = torch.ops.aten


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

#: DTensor's scan rule: a sharded scanned dim is gathered first (once dims are normalized); those of
#: :data:`PLAIN_TENSOR_BACKWARD` need a gradient only through the whole-value path.
SCANS = _overloads(aten.cumsum, aten.cumprod, aten.cummax, aten.cummin, aten.logcumsumexp)

_ADDS_A_DIM = _overloads(aten.unsqueeze, aten.stack)
#: Ops of the kinds above that the op sweep (``torch_tp/testing/_op_sweep_spatial.py``) found wrong
#: on strips and that are refused until a rule proves them: ``special.chebyshev_polynomial_u``
#: (elementwise; its values on a strip differ from the whole tensor's beyond 1e-4, not investigated).
OFF_THE_ALLOWLIST = _overloads(aten.special_chebyshev_polynomial_u)
#: Reductions for which ``dim=[]`` reduces every dim (``any``/``all`` reduce none; ``logsumexp`` fails).
_EMPTY_DIM_IS_EVERY_DIM = REDUCTIONS - _overloads(aten.any, aten.all, aten.logsumexp)
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
    if op in _random_ops() or op in OFF_THE_ALLOWLIST:
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
        if op in _EMPTY_DIM_IS_EVERY_DIM and argument.name == "dim":  # DTensor's rules reduce none, or fail
            if i < len(args) and isinstance(args[i], (list, tuple)) and not args[i]:
                args[i] = list(range(ndim))
            elif isinstance(kwargs.get("dim"), (list, tuple)) and not kwargs["dim"]:
                kwargs["dim"] = list(range(ndim))
        if i < len(args):
            args[i] = fix(args[i])
        elif argument.name in kwargs:
            kwargs[argument.name] = fix(kwargs[argument.name])
    return tuple(args), kwargs


# ---------------------------------------------------------------------------- reductions and scans

#: Reductions and scans whose derivative formula builds a plain tensor beside the DTensor (``prod``
#: over a dim: a column of ones; ``cumprod``: zeros; ``cummax``/``cummin``: a scatter base), which
#: DTensor's backward refuses, on every placement. Called directly (``torch.cumprod(x, -1)``,
#: ``x.prod(3)``) they run on the whole value (:class:`_RegionWrites`); reached any other way while
#: a gradient is needed they are refused.
PLAIN_TENSOR_BACKWARD = frozenset({aten.prod.dim_int, aten.cumprod.default, aten.cummax.default, aten.cummin.default})
_WHOLE_VALUE_FUNCTIONS = frozenset({torch.prod, torch.Tensor.prod, torch.cumprod, torch.Tensor.cumprod,
                                    torch.cummax, torch.Tensor.cummax, torch.cummin, torch.Tensor.cummin})

#: Reductions without an identity: a rank whose strip is empty cannot reduce it (``amax`` of
#: nothing; a norm of order ``inf``, ``-inf`` or below 0 too), so with an empty strip the reduced
#: sharded dim is gathered first.
NO_IDENTITY = _overloads(aten.amax, aten.amin, aten.max, aten.min, aten.argmax, aten.argmin)
_NORMS = _overloads(aten.linalg_vector_norm, aten.norm)


def _has_no_identity(op: Any, args: tuple, kwargs: dict) -> bool:
    if op in NO_IDENTITY:
        return True
    if op not in _NORMS:
        return False
    names = [a.name for a in op._schema.arguments]
    name = "ord" if "ord" in names else "p"
    i = names.index(name)
    order = kwargs.get(name, args[i] if i < len(args) else 2)
    order = 2 if order is None else order
    return isinstance(order, (int, float)) and (order < 0 or order == float("inf"))


def _needs_grad(args: Any) -> bool:
    flat, _ = tree_flatten(args)
    return torch.is_grad_enabled() and any(isinstance(a, DTensor) and a.requires_grad for a in flat)


def _reduced_dims(op: Any, args: tuple, kwargs: dict, ndim: int) -> set[int]:
    """The dims ``op`` (a reduction) reduces: its ``dim`` argument, every dim when it has none."""
    names = [a.name for a in op._schema.arguments]
    dims = kwargs.get("dim", args[names.index("dim")] if "dim" in names and names.index("dim") < len(args) else None)
    if dims is None or dims == []:
        return set(range(ndim))
    return {d % ndim for d in ([dims] if isinstance(dims, int) else dims)}


def _gather_empty_strips(op: Any, args: tuple, kwargs: dict) -> tuple:
    """``args`` with the input gathered along its sharded dim when ``op`` (a reduction without an
    identity) reduces that dim and some rank's strip of it is empty; else ``args``."""
    x = args[0] if args else None
    if not isinstance(x, DTensor):
        return args
    mesh_dims = [i for i, p in enumerate(x.placements) if isinstance(p, Shard)
                 and p.dim % x.ndim in _reduced_dims(op, args, kwargs, x.ndim)
                 and 0 in shard_sizes(x.shape[p.dim % x.ndim], x.device_mesh.size(i))]
    if not mesh_dims:
        return args
    placements = [Replicate() if i in mesh_dims else p for i, p in enumerate(x.placements)]
    return (x.redistribute(x.device_mesh, placements), *args[1:])


def _without_boolean_partials(out: Any) -> Any:
    """``out`` with a boolean ``Partial(sum)`` reduced at once: DTensor's ``any`` over a sharded dim is
    a partial sum of booleans, which a later cast or product would add up (``True + True = 2``)."""
    def reduce(t: Any) -> Any:
        if isinstance(t, DTensor) and t.dtype is torch.bool and any(p.is_partial() for p in t.placements):
            return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])
        return t

    return tuple(reduce(t) for t in out) if isinstance(out, tuple) else reduce(out)


def _on_whole_value(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on the whole value of its DTensor arguments, as plain tensors (its derivative runs
    on plain tensors too); the results come back as replicated DTensors."""
    mesh = next(a for a in tree_flatten(args)[0] if isinstance(a, DTensor)).device_mesh
    whole = [Replicate()] * mesh.ndim

    def plain(a: Any) -> Any:
        return a.redistribute(mesh, whole).to_local() if isinstance(a, DTensor) else a

    out = func(*tree_map(plain, args), **tree_map(plain, kwargs))
    return tree_map(lambda o: DTensor.from_local(o, mesh, whole, run_check=False) if isinstance(o, torch.Tensor) else o, out)


# ---------------------------------------------------------------------------- writes through views

# A view of a sharded DTensor along its sharded dim (``y[..., :2]``, ``y.narrow(-1, 0, 2)``,
# ``y[..., 0]``) is a gathered copy, not a view of the strips: DTensor's slice rule replicates the
# dim first. An in-place op on it would write the copy (lost for ``y``), and autograd's in-place
# bookkeeping for views (``CopySlices``) would do the same with the gradient. So the guard records
# each such copy, and every view of it, as a link to its parent (_LINKS); then
#   - an in-place method or ``__setitem__`` on it (seen above autograd, by _RegionWrites) runs out
#     of place on a clone and writes the result into the parent's strips (_assign): ``parent.copy_(
#     parent with the view's elements replaced)``, so forward and backward equal one process;
#   - any other write into it (``out=``, an op deeper in a library) is refused, naming the op;
#   - a read of it after its parent changed (``y`` written in place later) refreshes it first.

#: Views DTensor refuses along a sharded dim (it would not redistribute): gathered first.
_GATHERED_FIRST = frozenset({aten.unbind.int})
_NOT_WRITES = frozenset({"requires_grad_", "detach_", "share_memory_", "retain_grad"})  # in-place, not on values
_INPLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                              "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


@dataclasses.dataclass
class _Link:
    parent: DTensor
    op: Any
    args: tuple  # the view op's arguments after the parent
    kwargs: dict
    index: int | None  # which output of a multi-output view (split, unbind)
    gathered: bool  # a gathered copy (else a view of the parent's local tensor)
    dim: int  # the sharded dim of the first ancestor whose strips are not a copy
    version: int  # the parent's version when the view's values were last taken from it


_LINKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _record_views(op: Any, args: tuple, kwargs: dict, out: Any) -> None:
    parent = args[0] if args else None
    if not isinstance(parent, DTensor):
        return
    outs = out if isinstance(out, (tuple, list)) else (out,)
    above = _LINKS.get(parent)
    for index, view in enumerate(outs):
        if not isinstance(view, DTensor):
            continue
        lost = [p.dim % parent.ndim for p, q in zip(parent.placements, view.placements)  # Shard, _StridedShard
                if not isinstance(p, (Replicate, Partial)) and hasattr(p, "dim") and isinstance(q, Replicate)]
        if lost or above is not None:
            _LINKS[view] = _Link(parent, op, tuple(args[1:]), dict(kwargs),
                                 index if isinstance(out, (tuple, list)) else None, bool(lost),
                                 lost[0] if lost else above.dim, parent._version)


def _gathered_along(args: tuple, kwargs: dict) -> tuple:
    """``args`` of an ``unbind`` with its input gathered along the unbound dim when that dim is sharded."""
    x, d = args[0], kwargs.get("dim", args[1] if len(args) > 1 else 0)
    placements = [Replicate() if isinstance(p, Shard) and p.dim % x.ndim == d % x.ndim else p for p in x.placements]
    return args if placements == list(x.placements) else (x.redistribute(x.device_mesh, placements), *args[1:])


#: Ops DTensor may refuse on strips (no rule for the split it meets: a ``view`` that merges the
#: sharded dim with another, ``expand`` of a sharded dim of size 1): run on the strips gathered.
_GATHERED_WHEN_REFUSED = _overloads(aten.view, aten._unsafe_view, aten.expand)
_RESHAPES = _overloads(aten.view, aten._unsafe_view)


def _whole_strips(args: Any) -> Any:
    """``args`` with every sharded or partial DTensor redistributed to whole (``Replicate``)."""
    def whole(a: Any) -> Any:
        if isinstance(a, DTensor) and any(not isinstance(p, Replicate) for p in a.placements):
            return a.redistribute(a.device_mesh, [Replicate()] * a.device_mesh.ndim)
        return a
    flat, spec = tree_flatten(args)
    return tree_unflatten([whole(a) for a in flat], spec)


def _empty_reshape(func: Any, args: tuple, kwargs: dict) -> DTensor:
    """A reshape of a DTensor with no elements, run on the (empty) whole value: DTensor's view rule
    loops forever on some empty shapes (``view_groups`` in torch 2.13)."""
    x = args[0]
    out = func(torch.empty(x.shape, dtype=x.dtype, device=x.to_local().device), *args[1:], **kwargs)
    return DTensor.from_local(out, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)


def _logsumexp_keeping_dims(x: DTensor, dims: Any) -> DTensor:
    """``logsumexp(x, dims, keepdim=True)`` as the reduction without ``keepdim``, its dims put back
    (``unsqueeze``): DTensor's rule (torch 2.13) places the result as if ``keepdim`` dropped the
    dims, so a strip along a later dim came back on the wrong dim (found by the op sweep)."""
    dims = sorted(d % x.ndim for d in ([dims] if isinstance(dims, int) else dims or range(x.ndim)))
    out = aten.logsumexp.default(x, dims, False)
    for d in dims:
        out = out.unsqueeze(d)
    return out


def _run_or_refuse(func: Any, args: tuple, kwargs: dict, where: str) -> Any:
    """``func`` on the strips; where DTensor refuses it (a ``RuntimeError`` of its propagation), the
    ops of :data:`_GATHERED_WHEN_REFUSED` run on the strips gathered, an in-place op runs out of
    place and is copied into its strips, and anything else is refused by name. (A reshape of no
    elements never reaches DTensor: :func:`_empty_reshape`.)"""
    if func is aten.logsumexp.default and (args[2] if len(args) > 2 else kwargs.get("keepdim", False)):
        return _logsumexp_keeping_dims(args[0], args[1])
    try:
        return func(*args, **kwargs)
    except RuntimeError as error:
        if func in _GATHERED_WHEN_REFUSED:
            return func(*_whole_strips(args), **_whole_strips(kwargs))
        name = _short(func)
        if "mixed torch.Tensor and DTensor" in str(error):
            raise UnsupportedSpatialOpError(
                f"torch_tp.conv: {func} got a plain tensor beside the spatially sharded DTensors inside the spatial "
                f"model {where}: a plain tensor is not split into the strips. Make it a DTensor "
                f"(DTensor.from_local(t, mesh, [Replicate()])), or run the op outside the region"
            ) from error
        outplace = getattr(aten, name[:-1], None) if name.endswith("_") and not name.startswith("_") else None
        target = args[0]
        if outplace is not None and isinstance(target, DTensor) and not any(p.is_partial() for p in target.placements):
            try:  # e.g. clamp_ with whole bounds on strips: DTensor keeps no placement in place
                result = outplace(*args, **kwargs).redistribute(target.device_mesh, target.placements)
            except RuntimeError:
                pass
            else:
                with torch.no_grad():
                    target.copy_(result)
                return target
        raise UnsupportedSpatialOpError(
            f"torch_tp.conv: {func} on DTensors inside the spatial model {where} has no "
            f"DTensor rule for these strips ({str(error).splitlines()[0][:200]}). Run it outside the region "
            f"(SpatialParallel(until=...)), on a whole tensor (x.full_tensor()), or add a handler "
            f"(DEVELOPERS.md: 'Adding a spatial op handler')"
        ) from error


def _refresh(view: DTensor) -> None:
    """Bring a recorded view's values up to date with its parent (after an in-place write to it)."""
    link = _LINKS.get(view)
    if link is None:
        return
    _refresh(link.parent)
    if link.parent._version == link.version:
        return
    if link.gathered:
        args = (link.parent, *link.args)
        args = _gathered_along(args, link.kwargs) if link.op in _GATHERED_FIRST else args
        with torch.no_grad():
            try:
                fresh = link.op(*args, **link.kwargs)
            except RuntimeError:  # refused on strips: run gathered, as when the view was made
                if link.op not in _GATHERED_WHEN_REFUSED:
                    raise
                fresh = link.op(*_whole_strips(args), **link.kwargs)
            view.to_local().copy_((fresh[link.index] if link.index is not None else fresh).to_local())
    link.version = link.parent._version


def _write_refused(what: str, link: _Link, where: str) -> UnsupportedSpatialOpError:
    return UnsupportedSpatialOpError(
        f"torch_tp.conv: {what} writes in place into a view that {link.op} took along the sharded dim "
        f"{link.dim} inside the spatial model {where}; that view is a gathered copy of the strips, and "
        f"torch_tp cannot carry this write back to them, so it would be lost. Write it out of place "
        f"instead: torch.where(mask, value, y) with a mask of the positions (e.g. from torch.arange along "
        f"dim {link.dim}), or rebuild y with torch.cat / F.pad. (Writes into a slice or select of y itself "
        f"are carried back: y[..., a:b] = v, y[..., i] = v, y[..., :2].zero_(), y.narrow(-1, 0, 2).mul_(0))"
    )


def _assign(view: DTensor, value: DTensor, what: str, where: str) -> None:
    """Write ``value`` into a recorded view: into its parent's strips, up to the first ancestor
    that is not a copy (an ordinary in-place ``copy_`` there, which autograd follows)."""
    link = _LINKS[view]
    parent = written_into(link.parent, link.op, link.args, link.kwargs, value)
    if parent is None:
        raise _write_refused(what, link, where)
    if link.parent in _LINKS:
        _assign(link.parent, parent, what, where)
    else:
        link.parent.copy_(parent)
    _refresh(view)


class _RegionWrites(TorchFunctionMode):
    """Above autograd, inside a spatial model's forward: in-place writes into the recorded views
    (see above), and the reductions of :data:`PLAIN_TENSOR_BACKWARD` on whole values."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if isinstance(target, DTensor):
            name = getattr(func, "__name__", "")
            if name == "__setitem__":
                return self._setitem(func, *args)
            if target in _LINKS and name not in _NOT_WRITES and (
                    name in _INPLACE_DUNDERS or kwargs.get("inplace") is True
                    or (name.endswith("_") and not name.startswith("__"))):
                return self._write(target, lambda copy: func(copy, *args[1:], **kwargs), name)
            if func in _WHOLE_VALUE_FUNCTIONS and _needs_grad(args) and (name != "prod" or len(args) > 1 or kwargs):
                return _on_whole_value(func, args, kwargs)
        return func(*args, **kwargs)

    def _write(self, view: DTensor, write: Any, what: str) -> DTensor:
        """Run ``write`` (an in-place op) on a clone of ``view``, then carry the clone into the strips."""
        copy = view.clone()
        write(copy)
        _assign(view, copy, what, self.where)
        return view

    def _setitem(self, func: Any, target: DTensor, index: Any, value: Any) -> None:
        if target in _LINKS:
            self._write(target, lambda copy: func(copy, index, value), "__setitem__")
            return None
        if _split_strips(target):
            view = target[index]
            if view in _LINKS:
                if not isinstance(value, DTensor) and isinstance(value, torch.Tensor):
                    value = DTensor.from_local(value, view.device_mesh, [Replicate()] * view.device_mesh.ndim,
                                               run_check=False)
                self._write(view, lambda copy: copy.copy_(value) if isinstance(value, torch.Tensor) else copy.fill_(value),
                            "__setitem__")
                return None
        func(target, index, value)
        return None


# ---------------------------------------------------------------------------- the guard


class RegionGuard(TorchDispatchMode):
    """Checks each op a spatial model runs (see the module's table); ``where`` names the model.

    Entered by the model's forward pre-hook, left by its forward hook (also on exceptions);
    entering it also enters :class:`_RegionWrites`, its half above autograd.

    Example::

        >>> import torch
        >>> with RegionGuard("net"):
        ...     torch.ones(2).cumsum(-1)  # plain tensors run as in one process
        tensor([1., 2.])
    """

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self._writes = _RegionWrites(where)

    def __enter__(self) -> "RegionGuard":
        self._writes.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._writes.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._writes.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not any(issubclass(t, DTensor) for t in types):
            return func(*args, **kwargs)
        given = args
        args, kwargs = self._checked(func, args, kwargs)
        if func in _RESHAPES and isinstance(args[0], DTensor) and args[0].numel() == 0:
            out = _empty_reshape(func, args, kwargs)  # split or not: DTensor's rule may loop forever
        else:
            out = _run_or_refuse(func, args, kwargs, self.where)
        if func.is_view:
            _record_views(func, given, kwargs, out)
        elif func in REDUCTIONS:
            out = _without_boolean_partials(out)
        return out

    def _checked(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if func in _random_ops() and _has_dtensor((args, kwargs)):
            raise UnsupportedSpatialOpError(
                f"torch_tp.conv: the random op {func} ran on DTensors inside the spatial model {self.where}: "
                f"each rank's generator would draw its own numbers, unlike one process (a dropout mask per "
                f"strip). Run it outside the model (SpatialParallel(until=...) stops the region before a "
                f"head with dropout), or put the model in eval() mode"
            )
        if _LINKS:
            self._check_links(func, args, kwargs)
        if func in PLAIN_TENSOR_BACKWARD and _needs_grad((args, kwargs)):
            raise UnsupportedSpatialOpError(
                f"torch_tp.conv: {func} ran on DTensors that need a gradient inside the spatial model {self.where}, "
                f"reached from inside another function: its derivative builds a plain tensor beside the DTensor, "
                f"which DTensor's backward refuses. Call torch.{_short(func)}(x, ...) or x.{_short(func)}(...) "
                f"in the model's forward itself (torch_tp runs it on the whole value), or run it on a whole "
                f"tensor (x.full_tensor()) or under torch.no_grad()"
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
        args, kwargs = _normalized_dims(func, args, kwargs)
        if _has_no_identity(func, args, kwargs):
            args = _gather_empty_strips(func, args, kwargs)
        elif func in _GATHERED_FIRST:
            args = _gathered_along(args, kwargs)
        return args, kwargs

    def _check_links(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Refuse a write into a recorded view; refresh a recorded view its parent changed under."""
        for i, argument in enumerate(func._schema.arguments):
            given = args[i] if i < len(args) else kwargs.get(argument.name)
            for value in given if isinstance(given, (list, tuple)) else (given,):  # cat's list, ...
                if isinstance(value, DTensor) and value in _LINKS:
                    if argument.alias_info is not None and argument.alias_info.is_write:
                        raise _write_refused(str(func), _LINKS[value], self.where)
                    _refresh(value)


def _short(op: Any) -> str:
    return op._schema.name.split("::")[-1]
