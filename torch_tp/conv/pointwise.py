"""DTensor sharding rules for the activation ops modern CNNs use that torch 2.13's DTensor lacks.

An activation computes each element on its own, so on a spatially sharded input (a DTensor
``Shard(d)``, uneven or empty strips included) it should run on the local strip and keep the
input's placements, forward and backward, without communication. In torch 2.13 DTensor does
that for the ops it registers as pointwise (``relu``, ``silu``, ``gelu``, ``sigmoid``,
``tanh``, ``hardtanh``, ``leaky_relu``, ``elu``, ``mish``, ``softplus``, ``hardsigmoid``, their
in-place forms, and the backward ops ``threshold_backward``, ``silu_backward``,
``gelu_backward``, ``sigmoid_backward``, ``tanh_backward``). The ops below have no rule; DTensor
either fails or derives one by tracing the op's decomposition, and that derived rule refuses
a sharded dim smaller than the mesh (a rank holding nothing), so it all-gathers:

| op | reached by | torch 2.13 without :func:`register` |
| --- | --- | --- |
| ``hardswish.default`` | ``nn.Hardswish`` | local; all-gathers to ``Replicate()`` when a rank is empty |
| ``hardswish_.default`` | ``nn.Hardswish(inplace=True)`` | **wrong** with an empty rank: labelled ``Replicate()`` |
| ``hardswish_backward.default`` | autograd of both | fails: no sharding strategy |
| ``hardsigmoid_backward.default`` | ``nn.Hardsigmoid``, SE gates | fails: no sharding strategy |
| ``hardtanh_backward.default`` | ``nn.ReLU6``, ``nn.Hardtanh`` | fails: no sharding strategy |
| ``hardshrink_backward.default`` | ``nn.Hardshrink`` | fails: no sharding strategy |
| ``softshrink_backward.default`` | ``nn.Softshrink`` | fails: no sharding strategy |
| ``mish_backward.default`` | ``nn.Mish`` | local; ``Replicate()`` grad when a rank is empty |
| ``elu_backward.default`` | ``nn.ELU``, ``nn.CELU``, ``nn.SELU`` | local; ``Replicate()`` grad when a rank is empty |
| ``leaky_relu_backward.default`` | ``nn.LeakyReLU`` | local; ``Replicate()`` grad when a rank is empty |
| ``softplus_backward.default`` | ``nn.Softplus`` | local; ``Replicate()`` grad when a rank is empty |
| ``_prelu_kernel.default`` | ``nn.PReLU`` (weight viewed ``(C, 1, 1)``) | local; ``Replicate()`` when a rank is empty |
| ``_prelu_kernel_backward.default`` | autograd of the above | fails: no sharding strategy |

Installed by a ``SpatialParallel`` model that needs it, or for every op by
:func:`sharded_pointwise` (:mod:`torch_tp.conv._registry`).

:func:`pointwise_handler` runs each of them as DTensor's own pointwise rule would: every
tensor argument follows the placements of the largest one on the dims they share (broadcast
dims, such as PReLU's per-channel weight, stay replicated), uneven and empty shards allowed,
no ``Partial`` passed through (these functions are not linear); the op runs on the local
strips and its outputs keep the placements. An op that DTensor has a rule for itself (a later
torch) is left to DTensor (:class:`~torch_tp.conv._registry.Decline`).

Squeeze-excite (``x.mean((2, 3), keepdim=True)`` → 1x1 conv → act → gate → ``x * s``) needs
nothing more: the mean of an evenly sharded input is ``Partial(avg)`` (DTensor all-gathers an
unevenly sharded one first, correct but the whole activation), the convolution handlers of
:mod:`torch_tp.conv.sharded_conv` reduce a ``Partial`` input, and the replicated
``(N, C, 1, 1)`` gate broadcasts against the shard locally. With a rank holding nothing, the
input gradient comes back ``Replicate()`` (DTensor adds the mean's replicated gradient to the
shard by replicating); its values are right.

One in-place op more, of the derivatives rather than the activations: ``masked_fill_(mask, 0)`` on a
``Partial`` sum, which ``std``/``std_mean`` and ``linalg.vector_norm`` (any ``ord`` but 2) run in
their backward (``(grad / result).masked_fill_(result == 0, 0)``) when the gradient reaching them
is a partial sum (a reduction over the strips broadcast back onto them, ``x * x.std(-1, True)``).
DTensor refuses it (an in-place op would need the sum first); zeroing every rank's summand zeroes
the sum, so :func:`masked_zero_handler` runs it on the local summands and keeps ``Partial``. Any
other fill value on a partial sum is not linear: DTensor's refusal outside a spatial model, a
named :class:`~torch_tp.conv.UnsupportedSpatialOpError` inside one.

And ``sum(dim=[], keepdim=True)`` (every dim summed), which the derivatives of ``amax``/``amin``
over every dim and of a whole-tensor norm of ``ord=inf``/``-inf`` run to count the maxima
(``grad / (x == result).sum(dim, True)``): on a sharded input torch 2.13's DTensor sums nothing
for an empty ``dim`` (a wrong gradient, silently); :func:`sum_every_dim_handler` names every dim.
(``mean`` with ``dim=[]`` is :mod:`torch_tp.conv.global_mean`'s.)

``nn.LogSigmoid`` is not covered: its ``log_sigmoid_forward`` returns a buffer that is the
input's shape on CPU but empty on CUDA, which no one pointwise rule fits.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from torch_tp.conv import pointwise
    >>> pointwise.install()
    >>> x = distribute_tensor(image, mesh, [Shard(3)]).requires_grad_()   # width-sharded NCHW
    >>> y = nn.Hardswish()(x)                                             # y.placements == (Shard(3),)
    >>> y.sum().backward()                                                # local hardswish_backward
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from torch_tp.conv import _registry
from torch_tp.conv._core import UnsupportedSpatialOpError, bind, local, without_partials, wrap
from torch_tp.conv._registry import Decline, HandlerSet

__all__ = ["POINTWISE_OPS", "install", "is_installed", "masked_zero_handler", "pointwise_handler", "sharded_pointwise",
           "sum_every_dim_handler", "uninstall"]

aten = torch.ops.aten

#: The ops :func:`pointwise_handler` serves where DTensor has no rule of its own.
POINTWISE_OPS = (
    aten.hardswish.default,
    aten.hardswish_.default,
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.hardtanh_backward.default,
    aten.hardshrink_backward.default,
    aten.softshrink_backward.default,
    aten.mish_backward.default,
    aten.elu_backward.default,
    aten.leaky_relu_backward.default,
    aten.softplus_backward.default,
    aten._prelu_kernel.default,
    aten._prelu_kernel_backward.default,
)
_ACTIVATIONS = (nn.Hardswish, nn.Hardsigmoid, nn.ReLU6, nn.Hardtanh, nn.Hardshrink, nn.Softshrink, nn.Mish,
                nn.ELU, nn.CELU, nn.SELU, nn.LeakyReLU, nn.Softplus, nn.PReLU)
HANDLERS = HandlerSet("torch_tp.conv.pointwise", serves=_ACTIVATIONS)


def _has_dtensor_rule(op: Any) -> bool:
    prop = DTensor._op_dispatcher.sharding_propagator
    return op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs or op in prop.op_to_rules


_DTENSOR_HAS_RULE = frozenset(op for op in POINTWISE_OPS if _has_dtensor_rule(op))


def _following(t: DTensor, ref: DTensor) -> list:
    """Placements for ``t`` that follow ``ref``'s on the dims they share (right-aligned, as
    broadcasting does); a dim ``t`` broadcasts stays replicated."""
    placements = []
    for p in ref.placements:
        d = p.dim % ref.ndim - (ref.ndim - t.ndim) if isinstance(p, Shard) else -1
        shares = d >= 0 and t.shape[d] == ref.shape[p.dim % ref.ndim]
        placements.append(Shard(d) if shares else Replicate())
    return placements


def _local_following(t: Any, ref: DTensor) -> Any:
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh != ref.device_mesh:
        raise Decline
    placements = _following(t, ref)
    return (t if list(t.placements) == placements else t.redistribute(ref.device_mesh, placements)).to_local()


@HANDLERS.implements(*POINTWISE_OPS)
def pointwise_handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor handler for the ops of :data:`POINTWISE_OPS` (an element-wise function and its backward).

    The largest tensor argument (``Partial`` reduced first) sets the placements; the others
    follow it on the dims they share; the op runs on the local strips and every output (all
    of that argument's shape) keeps its placements. In-place forms update the input's strip.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; a spatial model or install() routes the ops here")
        >>> gi = pointwise_handler(aten.hardswish_backward.default, (dy, x), {})   # both Shard(3)
        >>> gi.placements
        (Shard(dim=3),)
    """
    if op_call in _DTENSOR_HAS_RULE:
        raise Decline
    tensors = [a for a in args if isinstance(a, DTensor)]
    ref = max(tensors, key=lambda t: t.ndim)
    inplace = op_call is aten.hardswish_.default
    if inplace and any(p.is_partial() for p in ref.placements):
        raise Decline  # DTensor refuses an in-place op on a partial sum with its own message
    ref = without_partials(ref)
    outs = op_call(*(ref.to_local() if a is ref or (a is args[0] and inplace) else _local_following(a, ref)
                     for a in args), **(kwargs or {}))
    if inplace:
        return args[0]
    if isinstance(outs, tuple):
        return tuple(wrap(o, ref.device_mesh, ref.placements, ref.shape) for o in outs)
    return wrap(outs, ref.device_mesh, ref.placements, ref.shape)


@HANDLERS.implements(aten.masked_fill_.Scalar, aten.masked_fill_.Tensor)
def masked_zero_handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor handler for ``masked_fill_(mask, 0)`` on a ``Partial`` sum (or mean): the local summands
    are zeroed where ``mask`` (replicated) holds, and the result stays ``Partial``.

    Everything else is DTensor's (:class:`~torch_tp.conv._registry.Decline`), except a fill of a
    partial sum with another value inside a spatial model: refused, naming the op.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; a spatial model or install() routes the op here")
        >>> g = masked_zero_handler(aten.masked_fill_.Scalar, (grad_partial, mask_replicated, 0), {})
        >>> g.placements
        (Partial(sum),)
    """
    self, mask, value = bind(args, kwargs, ("self", "mask", "value"))
    if not isinstance(self, DTensor) or not any(p.is_partial() for p in self.placements):
        raise Decline
    zero = (value == 0) if not isinstance(value, torch.Tensor) else bool((local(value) == 0).all())
    replicated = isinstance(mask, DTensor) and mask.device_mesh == self.device_mesh and all(
        isinstance(p, Replicate) for p in mask.placements)
    linear = all(getattr(p, "reduce_op", None) in ("sum", "avg") for p in self.placements if p.is_partial())
    if zero and replicated and linear:
        self.to_local().masked_fill_(mask.to_local(), 0)
        return self
    if not _registry.scope_active():
        raise Decline
    raise UnsupportedSpatialOpError(
        f"torch_tp.conv.pointwise: {op_call} fills a partial sum {self.placements} in place inside a spatial "
        f"model, with value {value!r} and a mask of placements {getattr(mask, 'placements', 'plain')}: only a "
        f"zero fill with a replicated mask leaves the sum right. Use the out-of-place "
        f"torch.where(mask, value, x) (DTensor reduces the sum first)"
    )


def _no_dims(args: tuple, kwargs: dict) -> bool:
    dims = bind(args, kwargs, ("self", "dim"))[1]
    return dims is not None and not len(dims)


@HANDLERS.implements(aten.sum.dim_IntList, when=_no_dims)
def sum_every_dim_handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor handler for ``sum(x, dim=[])`` (every dim summed, as the op defines it): the same sum
    with every dim named, which DTensor's reduction rule sums right on shards.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; a spatial model or install() routes the op here")
        >>> sum_every_dim_handler(aten.sum.dim_IntList, (x_sharded, [], True), {}).placements
        (Partial(sum),)
    """
    x, _, keepdim, dtype = bind(args, kwargs, ("self", "dim", "keepdim", "dtype"))
    if not isinstance(x, DTensor):
        raise Decline
    return op_call(x, list(range(x.ndim)), bool(keepdim), dtype=dtype)


install, uninstall, is_installed, sharded_pointwise = HANDLERS.public_functions("sharded_pointwise", "pointwise")
