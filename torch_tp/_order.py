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

#: attribute set on a module whose forward ``checkpoint_by_pattern`` wrapped
CHECKPOINTED = "_torch_tp_checkpointed"

_ORDER = "parallelize_module (TP), then checkpoint_by_pattern, then fully_shard_by_pattern (FSDP)"


def _stage_of(module: nn.Module) -> str | None:
    if isinstance(module, FSDPModule):
        return "fully_shard"
    if getattr(module, CHECKPOINTED, False):
        return "checkpoint_by_pattern"
    return None


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
