"""Upstream ``torch.distributed.tensor.parallel`` styles seen through torch_tp's style interface.

torch_tp's styles expose ``check`` (validate without changing anything), ``apply_to``
(with ``src_data_rank`` and the module path as arguments) and ``param_placements``.
Upstream styles only have ``_apply``. :class:`UpstreamStyle` wraps them so that
``parallelize_module`` and ``explain_plan`` treat every style alike: upstream styles are
checked up front too, and applied to a copy so the user's object is never changed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.tensor.parallel import style as upstream

from torch_tp.parallel import rules

__all__ = ["UpstreamStyle"]

_BOTH = rules.BOTH_STAGES


@dataclass(frozen=True)
class _Rule:
    check: Callable | None
    stages: tuple[str, ...]
    placements: Callable | None


# What upstream's _apply would reject, which forward stages it converts, and where it
# puts parameters (the same places as torch_tp's styles of the same name).
_RULES: dict[type, _Rule] = {
    upstream.ColwiseParallel: _Rule(rules.check_colwise, _BOTH, rules.colwise_placements),
    upstream.RowwiseParallel: _Rule(rules.check_rowwise, _BOTH, rules.rowwise_placements),
    upstream.SequenceParallel: _Rule(None, _BOTH, rules.replicated_placements),
    upstream.PrepareModuleInput: _Rule(rules.check_prepare_input, ("input",), None),
    upstream.PrepareModuleOutput: _Rule(rules.check_prepare_output, ("output",), None),
    upstream.PrepareModuleInputOutput: _Rule(None, _BOTH, None),
}
_UNKNOWN = _Rule(None, (), None)


def _rule_for(style: upstream.ParallelStyle) -> _Rule:
    for cls in type(style).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    return _UNKNOWN


class UpstreamStyle:
    """An upstream style with torch_tp's ``check`` / ``apply_to`` / ``param_placements``."""

    def __init__(self, style: upstream.ParallelStyle):
        self.style = style
        self.name = type(style).__name__
        self.rule = _rule_for(style)

    def check(self, module: nn.Module, device_mesh, module_path: str | None = None) -> None:
        rules.require_1d_mesh(device_mesh, self.name)
        rules.require_unprepared(module, self.rule.stages, self.name, module_path)
        if self.rule.check is not None:
            self.rule.check(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None) -> nn.Module:
        applied = copy.copy(self.style)  # upstream writes to the style; never to the user's
        applied.src_data_rank = src_data_rank
        try:
            applied._apply(module, device_mesh)
        except (NotImplementedError, ValueError, TypeError) as err:
            raise type(err)(f"{rules.describe(module, module_path)}: {err}") from err
        rules.mark_prepared(module, self.rule.stages, self.name)
        return module

    def param_placements(self, module: nn.Module) -> dict:
        return self.rule.placements(module) if self.rule.placements else {}

    def link_siblings(self, modules, where: str) -> None:
        """Upstream styles share nothing between siblings."""
