"""Sibling Colwise layers that read one input convert it once.

``q``/``k``/``v`` (``w1``/``w3``) read one activation. Converted layer by layer, each gets its
own DTensor (or int8 gather) of it, so the backward reduces each one's input gradient on its
own: three all-reduces (or reduce-scatters) where one would do. Siblings given equal styles
under one parent (``parallelize_module``'s sibling groups) share a :class:`SharedInput`: the
first member called converts the input, the others called on the same input take that very
tensor, and autograd sums their gradients on it before its one reduction, as a shipped plan's
``PrepareModuleInput`` on the parent does. A member called on another input (or twice, or
after the input was modified in place) converts anew.

Example::

    >>> group = SharedInput([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    >>> x = torch.ones(2)
    >>> group.converted(group.members[0], x, lambda: x * 2) is group.converted(group.members[1], x, lambda: x * 3)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from torch_tp._layouts import same_input
from torch_tp._module_state import ensure_state, state_of

__all__ = ["SharedInput", "share_input", "shared_input_of"]


class SharedInput:
    """The members' one conversion of the input they read (see the module docstring)."""

    def __init__(self, members: Sequence[nn.Module]):
        self.members = list(members)
        self.input: torch.Tensor | None = None
        self.version = -1
        self.value: torch.Tensor | None = None
        self.served: set[int] = set()

    def converted(self, member: nn.Module, raw: torch.Tensor, convert: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``member``'s converted input: this round's if ``raw`` is its input (unchanged since)
        and ``member`` has not taken it yet, else ``convert()``, which starts a round."""
        key = id(member)
        version = raw._version if not torch.compiler.is_compiling() else 0
        if (self.value is None or key in self.served or version != self.version
                or not same_input(raw, self.input)):
            self.input, self.version, self.value, self.served = raw, version, convert(), set()
        self.served.add(key)
        value = self.value
        if len(self.served) == len(self.members):  # every member served: let the tensors go
            self.input = self.value = None
            self.served = set()
        return value


def share_input(members: Sequence[nn.Module]) -> SharedInput:
    """Make ``members`` (siblings reading one input) share one conversion of it."""
    group = SharedInput(members)
    for member in members:
        ensure_state(member).shared_input = group
    return group


def shared_input_of(module: nn.Module) -> SharedInput | None:
    """The :class:`SharedInput` ``module`` belongs to, if any."""
    state = state_of(module)
    return state.shared_input if state is not None else None
