"""The order of the 2-D transforms: TP, then activation checkpointing, then FSDP.

``parallelize_module`` turns parameters into tp DTensors and hooks submodules;
``checkpoint_by_pattern`` must wrap the forward that already holds those hooks (so the
recompute re-runs them); ``fully_shard_by_pattern`` must see the tp DTensors to shard them
over dp (FSDP2 composes its placements with theirs) and be last, like torchtitan's
``apply_tp`` / ``apply_ac`` / ``apply_fsdp``. Each transform calls :func:`require_before`
first; another order raises, naming the module that was transformed too early.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from torch_tp._module_state import ensure_state, state_of

__all__ = ["mark_checkpointed", "require_before"]

_ORDER = "parallelize_module (TP), then checkpoint_by_pattern, then fully_shard_by_pattern (FSDP)"


def _stage_of(module: nn.Module) -> str | None:
    if isinstance(module, FSDPModule):
        return "fully_shard"
    state = state_of(module)
    if state is not None and state.checkpointed:
        return "checkpoint_by_pattern"
    return None


def mark_checkpointed(module: nn.Module) -> None:
    """Record that ``checkpoint_by_pattern`` wrapped ``module``'s forward (its ``ModuleState``).

    Example::

        >>> layer = nn.Linear(2, 2)
        >>> mark_checkpointed(layer)
        >>> _stage_of(layer)
        'checkpoint_by_pattern'
    """
    ensure_state(module).checkpointed = True


def require_before(root: nn.Module, caller: str, later: tuple[str, ...]) -> None:
    """Raise ``ValueError`` if a module under ``root`` already went through a stage in ``later``.

    ``later`` holds the stages that must come after ``caller``: ``"fully_shard"`` (FSDP2's,
    applied by hand or by ``fully_shard_by_pattern``) and/or ``"checkpoint_by_pattern"``.
    """
    for path, module in root.named_modules():
        stage = _stage_of(module)
        if stage in later:
            raise ValueError(
                f"{caller}: module {path or '<root>'!r} ({type(module).__name__}) already went through "
                f"{stage}; apply the transforms in the order {_ORDER}, each once, on a fresh model"
            )
