"""Import torchao without its import-time noise.

On a CPU-only machine torchao logs a "Failed to load ... .so" warning for each CUDA
extension it ships, and torch warns once about an Enum it registers with pytree. Neither
is actionable for torch_tp users, so the two loggers are raised to ERROR while torchao is
imported (and restored afterwards; later torchao warnings are shown as usual).
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

__all__: list[str] = []

_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def import_torchao(module: str = "torchao") -> ModuleType:
    """``importlib.import_module(module)`` with torchao's import-time warnings silenced."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
