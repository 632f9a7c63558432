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

:func:`register` gives each of them DTensor's own pointwise rule, the one its built-in
pointwise ops use: every tensor argument follows the output's placement on the dims they
share (broadcast dims, such as PReLU's per-channel weight, stay replicated), uneven and
empty shards allowed, no ``Partial`` passed through (these functions are not linear). A
backward op such as ``hardswish_backward(grad, self)`` takes two tensors with the same
placement; if they differ, DTensor redistributes the cheaper one. An op that DTensor already
has a rule for is left alone, so a later torch that adds one keeps its own.

Squeeze-excite (``x.mean((2, 3), keepdim=True)`` → 1x1 conv → act → gate → ``x * s``) needs
nothing more: the mean of an evenly sharded input is ``Partial(avg)`` (DTensor all-gathers an
unevenly sharded one first, correct but the whole activation), the convolution handlers of
:mod:`torch_tp.conv.sharded_conv` reduce a ``Partial`` input, and the replicated
``(N, C, 1, 1)`` gate broadcasts against the shard locally. With a rank holding nothing, the
input gradient comes back ``Replicate()`` (DTensor adds the mean's replicated gradient to the
shard by replicating); its values are right.

``nn.LogSigmoid`` is not covered: its ``log_sigmoid_forward`` returns a buffer that is the
input's shape on CPU but empty on CUDA, which no one pointwise rule fits.

Private torch API used: ``torch.distributed.tensor._ops._pointwise_ops._register_single_dim_pointwise``
(how DTensor registers its own pointwise ops), the propagator's
``op_single_dim_strategy_funcs`` / ``op_to_schema_info_for_single_dim_strategy`` tables (to
undo a registration), and ``torch.distributed.tensor.debug._clear_sharding_prop_cache``. The
public ``torch.distributed.tensor.experimental.register_sharding`` was not used: its rules
refuse a sharded dim smaller than the mesh, the empty-rank case above.

Nothing is registered on import: call :func:`register` (idempotent) or use
:func:`sharded_pointwise`.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from torch_tp.conv import pointwise
    >>> pointwise.register()
    >>> x = distribute_tensor(image, mesh, [Shard(3)]).requires_grad_()   # width-sharded NCHW
    >>> y = nn.Hardswish()(x)                                             # y.placements == (Shard(3),)
    >>> y.sum().backward()                                                # local hardswish_backward
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor

__all__ = ["POINTWISE_OPS", "is_registered", "register", "registered_ops", "sharded_pointwise", "unregister"]

aten = torch.ops.aten

#: The ops :func:`register` gives DTensor's pointwise rule, where DTensor has none.
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

_REGISTERED: list = []  # the ops the current registration added, in order


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def _has_rule(op) -> bool:
    prop = _propagator()
    return op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs or op in prop.op_to_rules


def _clear_sharding_caches() -> None:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def register() -> None:
    """Give every op of :data:`POINTWISE_OPS` that DTensor has no rule for DTensor's pointwise rule.

    Idempotent: a second call changes nothing. Clears DTensor's sharding-propagation caches,
    so rules derived earlier from decompositions are not reused.

    Raises:
        RuntimeError: this torch has no ``_register_single_dim_pointwise`` (the private
            helper moved); the message names the torch version.

    Example:
        >>> from torch_tp.conv import pointwise
        >>> pointwise.register(); pointwise.register()
        >>> pointwise.is_registered()
        True
        >>> pointwise.unregister()
    """
    if _REGISTERED:
        return
    try:
        from torch.distributed.tensor._ops._pointwise_ops import _register_single_dim_pointwise
    except ImportError as err:  # pragma: no cover - depends on the torch version
        raise RuntimeError(
            f"torch_tp.conv.pointwise needs torch.distributed.tensor._ops._pointwise_ops."
            f"_register_single_dim_pointwise (torch 2.13); torch {torch.__version__} has none"
        ) from err
    for op in POINTWISE_OPS:
        if not _has_rule(op):
            _register_single_dim_pointwise(op)
            _REGISTERED.append(op)
    _clear_sharding_caches()


def unregister() -> None:
    """Remove the rules :func:`register` added (DTensor's own rules are never touched).

    Example:
        >>> import torch
        >>> from torch_tp.conv import pointwise
        >>> op = torch.ops.aten.hardswish_backward.default
        >>> pointwise.register(); pointwise.unregister()
        >>> op in pointwise.registered_ops()
        False
    """
    prop = _propagator()
    while _REGISTERED:
        op = _REGISTERED.pop()
        prop.op_single_dim_strategy_funcs.pop(op, None)
        prop.op_to_schema_info_for_single_dim_strategy.pop(op, None)
    _clear_sharding_caches()


def registered_ops() -> tuple:
    """The ops the current :func:`register` added (empty when not registered).

    Example:
        >>> from torch_tp.conv import pointwise
        >>> with pointwise.sharded_pointwise():
        ...     print("aten.hardswish_backward.default" in map(str, pointwise.registered_ops()))
        True
    """
    return tuple(_REGISTERED)


def is_registered() -> bool:
    """Whether every op of :data:`POINTWISE_OPS` has a rule now (ours or DTensor's own).

    Example:
        >>> from torch_tp.conv import pointwise
        >>> with pointwise.sharded_pointwise():
        ...     print(pointwise.is_registered())
        True
    """
    return all(_has_rule(op) for op in POINTWISE_OPS)


@contextlib.contextmanager
def sharded_pointwise() -> Iterator[None]:
    """Context manager: :func:`register` on entry and, if it was not registered before,
    :func:`unregister` on exit (also on exceptions).

    Example:
        >>> from torch_tp.conv import pointwise
        >>> with pointwise.sharded_pointwise():
        ...     pass
        >>> pointwise.registered_ops()
        ()
    """
    was_registered = bool(_REGISTERED)
    register()
    try:
        yield
    finally:
        if not was_registered:
            unregister()
