"""The checkpoint directory of a training run: step names, and every decision about its files
taken once and agreed by every rank before any rank acts on it.

================================  ==============================================================
``step-<step>``                   a complete checkpoint; ``step`` zero-padded to 8 digits
                                  (``step-00000012``), longer past 99,999,999
                                  (``step-100000000``); ordered by the step's value
``step-<step>.partial``           being written (or left by a job that died): never loaded
================================  ==============================================================

What the ranks agree on (one all-gather of 8 bytes per rank each, :mod:`torch_tp._agreement`),
so that a rank that sees another directory, or cannot write it, makes every rank raise
:class:`~torch_tp.checkpoint.CheckpointError` at once instead of loading mixed checkpoints or
leaving the others waiting in a collective until its timeout:

- loading: each rank's newest complete checkpoint (:class:`Choice`: its step and a digest of
  its ``.metadata``, which names one save), or none on every rank;
- saving: the step, rank 0 could create ``step-<step>.partial``, and every rank sees the
  marker file rank 0 wrote into it (:func:`agree_on_partial`); afterwards, rank 0's rename.

Example::

    >>> step_name(12), step_name(10**8), step_of(pathlib.Path("ckpt/step-100000000"))
    ('step-00000012', 'step-100000000', 100000000)
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import os
import pathlib
import re
import shutil
import uuid
from typing import Any, Sequence

import torch.distributed as dist

from torch_tp._agreement import Fact, agree_or_raise
from torch_tp.checkpoint._errors import CheckpointError, CheckpointMismatchError
from torch_tp.checkpoint._safe import SafeFileSystemReader

__all__ = [
    "Choice",
    "PARTIAL",
    "agree",
    "agree_on_partial",
    "agreed_newest",
    "checkpoint_root",
    "complete_checkpoints",
    "create_partial",
    "publish",
    "rank_of",
    "require_keep",
    "require_step",
    "step_name",
    "step_of",
]

#: a complete checkpoint's name: 8 digits (zeros kept), or more without a leading zero
_STEP = re.compile(r"step-(\d{8}|[1-9]\d{8,})")
PARTIAL = ".partial"
_MARKER = ".torch_tp_save"  # rank 0's token in a new .partial, removed once every rank saw it
_SHARED = ("pass one directory that every rank sees (a shared filesystem, the same path on every rank), "
           "not a node-local one or a path that differs by rank")


def step_name(step: int) -> str:
    """``step-<step>``, zero-padded to 8 digits.

    Example::

        >>> step_name(5)
        'step-00000005'
    """
    return f"step-{step:08d}"


def step_of(path: pathlib.Path) -> int | None:
    """The step of a complete checkpoint's directory name, or ``None`` for any other name.

    Example::

        >>> step_of(pathlib.Path("step-00000005")), step_of(pathlib.Path("step-00000005.partial"))
        (5, None)
    """
    found = _STEP.fullmatch(path.name)
    return int(found[1]) if found is not None else None


def require_step(step: Any, *, what: str) -> int:
    """``step`` as an ``int``: any non-negative integer (``int``, a NumPy or 0-d integer tensor).

    Example::

        >>> require_step(5, what="save"), require_step(10**8, what="save")
        (5, 100000000)
    """
    if isinstance(step, bool) or not hasattr(type(step), "__index__"):
        whole = isinstance(step, float) and step.is_integer()
        raise TypeError(
            f"{what}: step={step!r} ({type(step).__name__}) is not an integer; pass the number of steps "
            f"trained so far as an int, 0 or more" + (f" (here step={int(step)})" if whole else "")
        )
    value = operator.index(step)
    if value < 0:
        raise ValueError(f"{what}: step={value} is negative; pass the number of steps trained so far, 0 or more")
    return value


def require_keep(keep: int | None) -> None:
    """``keep`` is ``None`` or an ``int`` of at least 1.

    Example::

        >>> require_keep(2)
    """
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(
            f"torch_tp.checkpoint: save_training_state(keep={keep!r}) would keep no checkpoint; "
            "pass keep=1 or more (the number of complete checkpoints to leave), or keep=None to keep all"
        )


def checkpoint_root(directory: str | os.PathLike) -> pathlib.Path:
    """``directory`` as a path; a file raises :class:`CheckpointMismatchError`.

    Example::

        >>> checkpoint_root("ckpt")
        PosixPath('ckpt')
    """
    root = pathlib.Path(directory)
    if root.exists() and not root.is_dir():
        raise CheckpointMismatchError(
            f"torch_tp.checkpoint: {str(root)!r} is a file, not a checkpoint directory; "
            "pass a directory (it is created if missing)"
        )
    return root


def complete_checkpoints(root: pathlib.Path) -> list[pathlib.Path]:
    """The complete checkpoints in ``root``, oldest step first (none when ``root`` does not exist).

    Example::

        >>> complete_checkpoints(pathlib.Path("nothing here"))
        []
    """
    if not root.exists():
        return []
    found = [(step, path) for path in root.iterdir() if (step := step_of(path)) is not None and path.is_dir()]
    return [path for _, path in sorted(found)]


def rank_of(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 without a process group).

    Example::

        >>> rank_of(None)
        0
    """
    return dist.get_rank(group) if dist.is_initialized() else 0


def agree(group: dist.ProcessGroup | None, problem: Exception | None, facts: Sequence[Fact], *, what: str) -> None:
    """:func:`torch_tp._agreement.agree_or_raise` on ``group`` (default: the default group; alone,
    ``problem`` is raised or nothing happens): a rank whose check failed raises its own error,
    the others :class:`CheckpointError` naming it, or naming the fact the ranks hold differently.

    Example::

        >>> agree(None, None, [Fact("steps differ", 5, "pass one step")], what="save")
    """
    if not dist.is_initialized():
        if problem is not None:
            raise problem
        return
    try:
        agree_or_raise(group if group is not None else dist.group.WORLD, problem, facts, what=what)
    except ValueError as error:
        if error is problem or isinstance(error, CheckpointError):
            raise
        agreed = CheckpointError(str(error))
        agreed.consequence = getattr(error, "consequence", False)  # another rank's error is the root cause
        raise agreed from None


# ---------------------------------------------------------------- loading: the newest checkpoint


@dataclasses.dataclass(frozen=True, repr=False)
class Choice:
    """One rank's newest complete checkpoint as the ranks compare it. A :class:`Fact` value
    compares by ``repr``: the step's name and the digest of its ``.metadata`` (which names one
    save), so copies of one checkpoint agree wherever they lie; ``str`` shows the rank's path.

    Example::

        >>> choice = Choice(1, pathlib.Path("ckpt"), pathlib.Path("ckpt/step-00000005"), "1a2b3c4d")
        >>> repr(choice), str(choice)
        ('step-00000005 1a2b3c4d', 'rank 1: ckpt/step-00000005 (.metadata 1a2b3c4d)')
    """

    rank: int
    root: pathlib.Path
    path: pathlib.Path | None
    digest: str

    def __repr__(self) -> str:
        return "none" if self.path is None else f"{self.path.name} {self.digest}"

    def __str__(self) -> str:
        if self.path is None:
            return f"rank {self.rank}: no complete checkpoint in {self.root}"
        return f"rank {self.rank}: {self.path} (.metadata {self.digest})"


def newest_checkpoint(directory: str | os.PathLike, rank: int) -> tuple[Choice, Any]:
    """This rank's newest complete checkpoint in ``directory`` and its metadata (``None``: none),
    the metadata read with :class:`SafeFileSystemReader`.

    Example::

        >>> newest_checkpoint("nothing here", 0)
        (none, None)
    """
    root = checkpoint_root(directory)
    found = complete_checkpoints(root)
    if not found:
        return Choice(rank, root, None, ""), None
    path = found[-1]
    metadata = SafeFileSystemReader(path).read_metadata()  # refuses a link, a FIFO, a tampered pickle
    digest = hashlib.sha256((path / ".metadata").read_bytes()).hexdigest()[:8]
    return Choice(rank, root, path, digest), metadata


def agreed_newest(directory: str | os.PathLike, group: dist.ProcessGroup | None, *, what: str) -> tuple[pathlib.Path | None, Any]:
    """The newest complete checkpoint in ``directory`` and its metadata, the same on every rank
    of ``group`` (``None``: none on any rank); else every rank raises :class:`CheckpointError`
    naming each rank's newest.

    Example::

        >>> agreed_newest("nothing here", None, what="load")
        (None, None)
    """
    try:
        (choice, metadata), problem = newest_checkpoint(directory, rank_of(group)), None
    except Exception as error:
        choice, metadata, problem = None, None, error
    fix = f"every rank must load the same checkpoint: {_SHARED}; nothing was loaded"
    agree(group, problem, [Fact("newest complete checkpoints differ", choice, fix)], what=what)
    return choice.path, metadata


# ---------------------------------------------------------------- saving: one directory, written by every rank


@dataclasses.dataclass(frozen=True, repr=False)
class _View:
    """What one rank sees of the new ``.partial``: rank 0's token (compared), or nothing."""

    rank: int
    partial: pathlib.Path
    token: str | None

    def __repr__(self) -> str:
        return self.token or "none"

    def __str__(self) -> str:
        seen = f"save {self.token[:8]}" if self.token else "not there"
        return f"rank {self.rank}: {self.partial} ({seen})"


def create_partial(partial: pathlib.Path, *, what: str) -> None:
    """On rank 0: an empty ``partial`` (a previous one removed) holding a new token.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     create_partial(pathlib.Path(d, "step-00000001.partial"), what="save")
        ...     os.listdir(d)
        ['step-00000001.partial']
    """
    try:
        partial.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a job that died mid-save
        partial.mkdir()
        (partial / _MARKER).write_text(uuid.uuid4().hex)
    except OSError as error:
        raise CheckpointError(
            f"{what}: rank 0 cannot create {partial} ({type(error).__name__}: {error.strerror or error}); "
            f"pass a directory that rank 0 can write and every rank sees (a shared filesystem); nothing was saved"
        ) from error


def agree_on_partial(partial: pathlib.Path, group: dist.ProcessGroup | None, *, what: str) -> None:
    """Every rank sees the token rank 0 wrote into ``partial`` and can write there; else every
    rank raises :class:`CheckpointError`. Rank 0 then removes the token.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     create_partial(pathlib.Path(d, "step-00000001.partial"), what="save")
        ...     agree_on_partial(pathlib.Path(d, "step-00000001.partial"), None, what="save")
        ...     os.listdir(f"{d}/step-00000001.partial")
        []
    """
    rank, view, problem = rank_of(group), None, None
    try:
        try:
            view = _View(rank, partial, (partial / _MARKER).read_text())
        except (FileNotFoundError, NotADirectoryError):
            view = _View(rank, partial, None)
        if view.token is not None and not os.access(partial, os.W_OK):
            raise CheckpointError(
                f"{what}: rank {rank} cannot write {partial}, which rank 0 created; give every rank's user "
                f"write permission there, or {_SHARED}; nothing was saved"
            )
    except Exception as error:
        problem = error
    fix = f"every rank writes its part where rank 0 created it: {_SHARED}; nothing was saved"
    agree(group, problem, [Fact("views of the new checkpoint's directory differ", view, fix)], what=what)
    if rank == 0:
        (partial / _MARKER).unlink()


def publish(partial: pathlib.Path, final: pathlib.Path, keep: int | None, *, what: str) -> None:
    """On rank 0, once every rank wrote its files: rename ``partial`` to ``final`` (replacing an
    older save of that step), then remove the oldest complete checkpoints until ``keep`` remain.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     os.makedirs(f"{d}/step-00000001"); os.makedirs(f"{d}/step-00000002.partial")
        ...     publish(pathlib.Path(d, "step-00000002.partial"), pathlib.Path(d, "step-00000002"), 1, what="save")
        ...     os.listdir(d)
        ['step-00000002']
    """
    try:
        if final.exists():  # saved again after a resume from an older step: replace it whole
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_directory(final.parent)
    except OSError as error:
        raise CheckpointError(
            f"{what}: rank 0 cannot rename {partial} to {final} ({type(error).__name__}: {error}); every rank's "
            f"files are in {partial}, which is never loaded: make the directory writable and save again"
        ) from error
    if keep is not None:
        _prune(final.parent, keep, final, what)


def _prune(root: pathlib.Path, keep: int, final: pathlib.Path, what: str) -> None:
    """Remove the oldest complete checkpoints but ``final`` until ``keep`` remain (``final`` included).

    Each is renamed to ``.partial`` first: a job that dies while removing one leaves a directory
    that is never loaded (and is removed by the next save of that step).
    """
    older = [p for p in complete_checkpoints(root) if p != final]
    for old in older[:max(len(older) - (keep - 1), 0)]:
        doomed = old.with_name(old.name + PARTIAL)
        try:
            shutil.rmtree(doomed, ignore_errors=True)
            os.rename(old, doomed)
            shutil.rmtree(doomed)
        except OSError as error:
            raise CheckpointError(
                f"{what}: rank 0 cannot remove the old checkpoint {old} (keep={keep}; {type(error).__name__}: "
                f"{error}); the new checkpoint {final} is complete: remove the old one yourself, or save with keep=None"
            ) from error


def _fsync_directory(path: pathlib.Path) -> None:
    """Make the rename durable (a crash of the machine right after keeps it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
