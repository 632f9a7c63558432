"""``ParallelStyle``: the base class of torch_tp's styles, apart from the styles themselves.

:mod:`torch_tp.parallel.style` (Colwise, Rowwise, Sequence) and
:mod:`torch_tp.parallel.prepare` (the ``PrepareModule*`` styles) both build on it, and
``style`` re-exports the prepare styles (upstream users import them from ``.style``); with
the base class here neither module imports the other's classes back.

Example::

    >>> from torch_tp import ColwiseParallel
    >>> issubclass(ColwiseParallel, ParallelStyle)
    True
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any, ClassVar

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import style as _upstream
from torch.distributed.tensor.placement_types import Placement

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # Python 3.10: typing_extensions has it (torch requires it and imports it itself)
    from typing_extensions import dataclass_transform

__all__ = ["ParallelStyle"]


# Tells type checkers what __init_subclass__ does at runtime: every subclass is a keyword-only
# dataclass of its annotated fields, so ``ColwiseParallel(overlap=True, foo=1)`` is flagged.
@dataclass_transform(kw_only_default=True, eq_default=False)
class ParallelStyle(_upstream.ParallelStyle):
    """Base class of torch_tp's styles: a description of how to parallelize one module.

    Subclasses become keyword-only dataclasses of their annotated fields, normalize them in
    ``__post_init__`` and implement :meth:`check` (raise if the module cannot be handled,
    without changing it) and :meth:`apply_to` (do it, without checking again). Equality,
    hashing and the upstream-shaped ``repr`` come from the dataclass fields; fields listed
    in ``_additive_defaults`` (torch_tp-only settings) are left out of ``repr`` at their default.

    Example::

        >>> from torch.distributed.tensor import Replicate
        >>> from torch_tp import ColwiseParallel
        >>> ColwiseParallel() == ColwiseParallel(input_layouts=Replicate())
        True
    """

    #: torch_tp-only settings (absent upstream), left out of ``repr`` at these defaults
    _additive_defaults: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs):
        # Every style is a keyword-only dataclass of its settings; equality, hashing and
        # repr are this class's (a subclass that writes its own __init__ keeps it).
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(kw_only=True, eq=False, repr=False)(cls)

    def check(self, module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None = None) -> None:
        """Raise if this style cannot be applied to ``module`` on ``device_mesh``; change nothing."""
        raise NotImplementedError(f"{type(self).__name__} does not implement check")

    def apply_to(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        src_data_rank: int | None = 0,
        module_path: str | None = None,
    ) -> nn.Module:
        """Parallelize ``module`` in place and return it (call :meth:`check` first)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement apply_to")

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Where applying this style puts each parameter of ``module`` (none by default)."""
        return {}

    def link_siblings(self, modules: Sequence[nn.Module], where: str) -> None:
        """Called once with the sibling modules one plan entry gave this style; nothing by default."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Upstream's entry point: upstream's parallelize_module sets self.src_data_rank first.
        self.check(module, device_mesh)
        return self.apply_to(module, device_mesh, src_data_rank=self.src_data_rank)

    def _settings(self) -> tuple[tuple[str, Any], ...]:
        return tuple((f.name, _hashable(getattr(self, f.name))) for f in dataclasses.fields(self))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._settings() == other._settings()

    def __hash__(self) -> int:
        return hash((type(self), self._settings()))

    def __repr__(self) -> str:
        shown = (
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if self._additive_defaults.get(f.name, _ALWAYS) != getattr(self, f.name)
        )
        return f"{type(self).__name__}({', '.join(shown)})"


_ALWAYS = object()


def _hashable(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value
