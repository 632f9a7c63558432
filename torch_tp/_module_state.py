"""What torch_tp records on a user's module: one private :class:`ModuleState` per module.

Styles, sibling groups, the order check and the spatial regions all remember something about
the modules they touched (which forward stages a style converts, the fused all-gather a layer
shares, the routing of its last call, ...). Every such record lives in one :class:`ModuleState`,
stored on the module under one attribute, :data:`STATE_ATTR`, and read and written only through
this module (FSDP2's ``fully_shard.state(module)`` is the anchor): :func:`state_of` reads it,
:func:`ensure_state` creates it on first write. A Parameter that ``parallelize_module`` replaced
carries one too, for its one field :attr:`ModuleState.placed_as` (ties split across calls).

The state sits in the object's ``__dict__``, written past ``nn.Module.__setattr__``: it is no
parameter, buffer or submodule, so ``state_dict``, ``named_modules`` and ``parameters`` do not see
it; ``copy.deepcopy`` copies it with the module (the members of a sibling group map to the
copied siblings), and ``torch.compile`` reads it as a plain attribute.

This module imports nothing from torch_tp, so every package may use it.

Example::

    >>> import torch.nn as nn
    >>> layer = nn.Linear(2, 2)
    >>> state_of(layer) is None
    True
    >>> ensure_state(layer).applied["input"] = "ColwiseParallel"
    >>> state_of(layer).applied
    {'input': 'ColwiseParallel'}
    >>> "_torch_tp_state" in layer.state_dict()
    False
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["STATE_ATTR", "ModuleState", "ensure_state", "state_of"]

#: The one attribute torch_tp sets on a user's module (or replaced Parameter).
STATE_ATTR = "_torch_tp_state"


@dataclass
class ModuleState:
    """Everything torch_tp records on one module; every field starts empty.

    Attributes:
        applied: ``{forward stage ("input", "output"): the style that converts it}``, so a second
            style cannot stack conversions (``parallel/rules.py``: ``mark_prepared``,
            ``require_unprepared``, ``is_prepared``).
        checkpointed: ``checkpoint_by_pattern`` wrapped the module's forward (``_order.py``).
        overlap_key: of a ``ColwiseParallel(overlap=True)`` layer: ``(process group name, input
            layout, local weight type, int8 communication)``; siblings with equal keys share one
            fused all-gather (``parallel/_overlap.py``).
        shared_gather: ``(SharedGather, this member's index)`` of such a layer in a group, else None.
        int8_comm: such a layer's ring moves int8 tokens (``comm_dtype=torch.int8``).
        shared_input: the ``SharedInput`` of sibling Colwise layers converting one input once
            (``parallel/_shared_input.py``).
        route: the ``Routing`` of an ``ExpertParallel`` module's last forward
            (``parallel/experts.py``: ``routing_summary``).
        spatial_plain_inputs: per ``SpatialParallel`` region call in flight, ``(input was a plain
            tensor, its ndim)``; a stack, as a module may re-enter (``conv/spatial.py``).
        region_guards: the ``RegionGuard`` of each spatial scope call in flight; a stack too.
        placed_as: on a Parameter ``parallelize_module`` replaced: ``(weakref to its DTensor
            replacement, its path)``, for ties split across calls (``parallel/_ties.py``).

    Example::

        >>> ModuleState().applied
        {}
    """

    applied: dict[str, str] = field(default_factory=dict)
    checkpointed: bool = False
    overlap_key: tuple | None = None
    shared_gather: tuple[Any, int] | None = None
    int8_comm: bool = False
    shared_input: Any = None
    route: Any = None
    spatial_plain_inputs: list[tuple[bool, int]] = field(default_factory=list)
    region_guards: list[Any] = field(default_factory=list)
    placed_as: tuple[Any, str] | None = None


def state_of(obj: Any) -> ModuleState | None:
    """The :class:`ModuleState` of ``obj`` (a module, or a replaced Parameter), or None if torch_tp
    recorded nothing on it.

    Example::

        >>> import torch.nn as nn
        >>> state_of(nn.Linear(2, 2)) is None
        True
    """
    return getattr(obj, STATE_ATTR, None)


def ensure_state(obj: Any) -> ModuleState:
    """The :class:`ModuleState` of ``obj``, created (empty) on first use.

    Example::

        >>> import torch.nn as nn
        >>> layer = nn.Linear(2, 2)
        >>> ensure_state(layer) is ensure_state(layer)
        True
    """
    state = state_of(obj)
    if state is None:
        state = obj.__dict__[STATE_ATTR] = ModuleState()
    return state
