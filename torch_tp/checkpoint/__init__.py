"""Checkpoints: DCP that loads without trusting the files, and training runs saved and resumed.

Two concerns, one namespace:

- :func:`save`, :func:`load`, :class:`SafeFileSystemReader` (``_safe.py``): ``dcp.save`` to a
  local directory, and ``dcp.load`` with every pickle restricted to an allowlist, every file
  checked before it is read (see ``docs/checkpoint.md``).
- :func:`save_training_state`, :func:`load_training_state`, :func:`latest_checkpoint`,
  :func:`read_extra` (``_training.py``): model, optimizer, step, the caller's values and the RNG state of a
  training run, in ``DIR/step-<n>`` directories that appear only once complete, resumed from
  the newest on any mesh. The ranks agree on every decision about the files (which
  checkpoint, whether rank 0 could create the new one, whether every rank sees it) before any
  rank acts on it (``_directory.py``).
- :class:`CheckpointError` (``_errors.py``), raised on every rank: the ranks see different
  checkpoints, a directory cannot be written, DCP refused a load or a save;
  :class:`CheckpointMismatchError`, one of them: the checkpoint holds another model.

Example::

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as path:
    ...     _ = save({"w": torch.ones(2)}, f"{path}/step-00000003")
    ...     latest_checkpoint(path).name
    'step-00000003'
"""

import torch  # noqa: F401 (the example above runs with this module's globals)

from torch_tp.checkpoint._safe import SafeFileSystemReader, load, save
from torch_tp.checkpoint._training import (
    CheckpointError,
    CheckpointMismatchError,
    TrainingState,
    latest_checkpoint,
    load_training_state,
    read_extra,
    save_training_state,
)

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "SafeFileSystemReader",
    "TrainingState",
    "latest_checkpoint",
    "load",
    "load_training_state",
    "read_extra",
    "save",
    "save_training_state",
]
