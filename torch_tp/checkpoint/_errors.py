"""The errors of ``torch_tp.checkpoint``, and DCP's ``CheckpointException`` turned into one of them.

``torch.distributed.checkpoint`` reports a failed load or save as ``CheckpointException``, a
``BaseException`` whose message is every failed rank's traceback. :func:`dcp_error` turns it
into one :class:`CheckpointError` whose message starts with the caller's name (the module
path, ``torch_tp.checkpoint.load_training_state``), names the checkpoint and the first key or
shape DCP refused, and says what to change; the ``CheckpointException`` stays chained as its
cause. DCP hands the same failures to every rank, so every rank raises the same message.

============================  ==================================================================
DCP's failure                 raised as
============================  ==================================================================
a key the state dict has and  :class:`CheckpointMismatchError`: ``<path> holds no 'model.w',
the checkpoint lacks          which the state dict to load has; <fix>``
another global shape          :class:`CheckpointMismatchError`: ``<path> holds 'w' of shape [3],
                              the state dict to load has [5]; <fix>``
anything else                 :class:`CheckpointError`: ``<path>: DCP failed on rank 0
                              (<type>: <message>); <fix>``
============================  ==================================================================
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

__all__ = ["CheckpointError", "CheckpointMismatchError", "dcp_error"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked, raised on every rank.

    The ranks see different checkpoints, or none while others do (each rank passed another
    path, or a node-local directory); rank 0 cannot write the directory; DCP refused the load
    or the save. The message starts with the function that raised it and says what to change.

    Example::

        >>> import tempfile, torch
        >>> from torch_tp.checkpoint import save_training_state
        >>> with tempfile.NamedTemporaryFile() as f:   # a directory under a file: rank 0 cannot create it
        ...     model = torch.nn.Linear(2, 2)
        ...     try:
        ...         save_training_state(f"{f.name}/ckpt", 1, model, torch.optim.SGD(model.parameters()))
        ...     except CheckpointError as error:
        ...         print(str(error).startswith("torch_tp.checkpoint.save_training_state: rank 0 cannot create"))
        True
    """


class CheckpointMismatchError(CheckpointError):
    """The checkpoint holds another model (or the same one at another size or dtype, or another
    optimizer's state), or DIR is no checkpoint directory; raised on every rank before anything
    is loaded or written.

    Example::

        >>> import tempfile
        >>> from torch_tp.checkpoint import latest_checkpoint
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     try:
        ...         latest_checkpoint(f.name)
        ...     except CheckpointMismatchError as error:
        ...         print(str(error).endswith("pass a directory (it is created if missing)"))
        True
    """


#: ``fix(kind, key)``: what to change, for ``kind`` ``"missing"`` (a key the checkpoint lacks),
#: ``"shape"`` (another shape) or ``"other"`` (``key`` is then ``""``)
Fix = Callable[[str, str], str]

_MISSING_KEY = re.compile(r"Missing key in checkpoint state_dict: (.+?)\.?$")
_SIZE_MISMATCH = re.compile(r"Size mismatch between saved (.+) and current: (.+) for (.+)$")
_SIZE = re.compile(r"torch\.Size\((\[.*\])\)")


def load_fix(kind: str, key: str) -> str:
    """What to change when ``torch_tp.checkpoint.load`` is refused: the state dict is the caller's.

    Example::

        >>> load_fix("shape", "w")
        'load into a tensor of the saved shape (the model at the size that saved it)'
    """
    return {
        "missing": "load into a state dict with only the keys the checkpoint holds "
                   "(SafeFileSystemReader(path).read_metadata().state_dict_metadata lists them), or pass "
                   "dcp.load a DefaultLoadPlanner(allow_partial_load=True) with SafeFileSystemReader(path)",
        "shape": "load into a tensor of the saved shape (the model at the size that saved it)",
        "other": "load into the state dict that was saved (the same keys, shapes and tensor types), "
                 "or save the checkpoint again",
    }[kind]


def save_fix(kind: str, key: str) -> str:
    """What to change when ``torch_tp.checkpoint.save`` fails.

    Example::

        >>> save_fix("other", "").startswith("pass a directory every rank can write")
        True
    """
    return "pass a directory every rank can write, on a filesystem with room for the checkpoint"


def dcp_error(failure: BaseException, checkpoint: str | os.PathLike, what: str, fix: Fix) -> CheckpointError:
    """DCP's ``CheckpointException`` as one named error: the first rank's failure, its key or
    shapes when DCP names them, and ``fix``'s advice. Raise it ``from failure``.

    Example::

        >>> from torch.distributed.checkpoint import CheckpointException
        >>> failure = CheckpointException("plan", {0: (RuntimeError("Missing key in checkpoint state_dict: step."), None)})
        >>> print(dcp_error(failure, "ckpt", "my_load", load_fix))
        my_load: ckpt holds no 'step', which the state dict to load has; load into a state dict with only ...
    """
    rank, error = _first_failure(failure)
    text = str(error)
    missing, resized = _MISSING_KEY.search(text), _SIZE_MISMATCH.search(text)
    if missing is not None:
        key = missing[1]
        return CheckpointMismatchError(
            f"{what}: {checkpoint} holds no {key!r}, which the state dict to load has; {fix('missing', key)}")
    if resized is not None:
        saved, current, key = _shape(resized[1]), _shape(resized[2]), resized[3]
        return CheckpointMismatchError(
            f"{what}: {checkpoint} holds {key!r} of shape {saved}, the state dict to load has {current}; "
            f"{fix('shape', key)}")
    on = f" on rank {rank}" if rank is not None else ""
    return CheckpointError(
        f"{what}: {checkpoint}: DCP failed{on} ({type(error).__name__}: {' '.join(text.split())}); {fix('other', '')}")


def _first_failure(failure: BaseException) -> tuple[int | None, Any]:
    """The lowest rank's exception in a ``CheckpointException`` (the same on every rank)."""
    failures = getattr(failure, "failures", None) or {}
    for rank, (error, _) in sorted(failures.items()):
        return rank, error
    return None, failure


def _shape(text: str) -> str:
    """``torch.Size([3, 4])`` as ``[3, 4]``."""
    found = _SIZE.fullmatch(text.strip())
    return found[1] if found is not None else text.strip()
