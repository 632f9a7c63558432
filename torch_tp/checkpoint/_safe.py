"""Distributed checkpoints that load without trusting the files: ``torch.distributed.checkpoint``
(DCP) with every pickle in the checkpoint restricted to an allowlist.

Plain ``dcp.load`` trusts the checkpoint directory. ``FileSystemReader.read_metadata``
unpickles ``.metadata`` with ``pickle.load``, and ``DefaultLoadPlanner.load_bytes`` unpickles
every value of the state dict that is not a tensor (step counts, learning rates, strings,
lists) with ``torch.load(weights_only=False)``: a tampered file runs arbitrary code in every
process that loads it. Only the tensors are read with ``torch.load(weights_only=True)``.

:func:`load` is ``dcp.load`` with :class:`SafeFileSystemReader`, which reads

- ``.metadata`` (and the rank-local ``__<rank>.metadata``) with an unpickler that builds only
  DCP's metadata classes and the torch values genuine metadata holds (``torch.Size``, dtypes,
  layouts, memory formats, ``pathlib`` paths): any other global raises
  ``pickle.UnpicklingError`` naming it before anything is called;
- every non-tensor value with ``torch.load(weights_only=True)``: plain Python values, tensors
  and the classes registered with ``torch.serialization.add_safe_globals`` (such as
  :class:`~torch_tp.quant.Int8SymmetricTensor`);
- the data files after checking that each one holds every byte the metadata points to, so a
  truncated, missing or unreadable file raises an error naming it;
- no file through a symlink: ``.metadata``, each data file the metadata names, and every folder
  on the way to one must be real entries of the checkpoint directory (the directory itself
  may be a link), and the names must be relative without ``..``, so nothing outside the
  directory is read. Every rank checks every data file before any rank reads one.

:func:`save` is ``dcp.save`` to a local directory. See ``docs/checkpoint.md``.

Example::

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as path:
    ...     _ = save({"w": torch.arange(4.0), "step": 3}, path)
    ...     state = {"w": torch.zeros(4), "step": 0}
    ...     load(state, path)
    >>> state
    {'w': tensor([0., 1., 2., 3.]), 'step': 3}
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
import re
import stat
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from torch_tp.checkpoint._errors import Fix, dcp_error, load_fix, save_fix

__all__ = ["SafeFileSystemReader", "load", "save"]


def save(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> Metadata:
    """``dcp.save(state_dict, checkpoint_id=...)`` to the local directory ``checkpoint_id``.

    Every rank of ``process_group`` calls it with its own shards (DTensors are saved once per
    shard, replicated values once); without an initialized process group it saves in this
    process alone, without ``dcp.save``'s warning. Values that are not tensors are pickled:
    :func:`load` accepts those that ``torch.load(weights_only=True)`` accepts.

    Args:
        state_dict: what to save, as for ``dcp.save`` (nested dicts and lists, tensors,
            DTensors, Python values, ``Stateful`` objects).
        checkpoint_id: the directory to write ``.metadata`` and the ``.distcp`` files into.

    Keyword Args:
        process_group: the ranks that save together (default: the default group).

    Returns:
        the checkpoint's ``Metadata``, as ``dcp.save`` returns it.

    Raises:
        CheckpointError: DCP's save failed on a rank (a directory it cannot write, a full disk):
            every rank raises it, naming the rank and its error, with DCP's
            ``CheckpointException`` as its cause.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as path:
        ...     metadata = save({"w": torch.ones(2, 3)}, path)
        >>> metadata.state_dict_metadata["w"].size
        torch.Size([2, 3])
    """
    return _save(state_dict, checkpoint_id, process_group=process_group, what="torch_tp.checkpoint.save")


def _save(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike, *, process_group: dist.ProcessGroup | None,
          what: str) -> Metadata:
    """:func:`save`, its failure raised as :class:`CheckpointError` starting with ``what``."""
    writer = _dcp_filesystem.FileSystemWriter(checkpoint_id)
    no_dist = _no_dist(process_group)
    try:
        with _single_process_is_intended(no_dist):
            return dcp.save(state_dict, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    except dcp.CheckpointException as failure:
        raise dcp_error(failure, checkpoint_id, what, save_fix) from failure


def load(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """``dcp.load(state_dict, checkpoint_id=...)`` without trusting the checkpoint's pickles.

    Loads in place, as ``dcp.load`` does: tensors and DTensors of ``state_dict`` receive the
    saved values (resharded to their own placements), other values are replaced. The files are
    read with :class:`SafeFileSystemReader`; on failure every rank raises the error of the file
    it could not read, or of the rank that could not, or a :class:`CheckpointError` naming the
    key or shape DCP refused, instead of DCP's ``CheckpointException``.

    Args:
        state_dict: the state dict to fill, as for ``dcp.load``.
        checkpoint_id: the directory :func:`save` (or ``dcp.save``) wrote.

    Keyword Args:
        process_group: the ranks that load together (default: the default group).

    Raises:
        pickle.UnpicklingError: a pickle names a global outside the allowlist (the message
            names the file and the global), or ``.metadata`` is truncated or corrupted.
        FileNotFoundError: ``.metadata`` or a data file is missing.
        RuntimeError: a data file is truncated or cannot be read, or a file of the checkpoint
            (or a folder on the way to it) is a symlink or not a regular file, refused before
            anything is read (the message names it).
        CheckpointMismatchError: DCP refused the state dict before reading: a key the checkpoint
            lacks, or another shape (the message names the checkpoint, the key and the shapes).
        CheckpointError: any other failure of DCP's (the first rank's error, named). Both
            chain DCP's ``CheckpointException`` as their cause.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as path:
        ...     _ = save({"optim": {"lr": 0.1, "betas": (0.9, 0.95)}}, path)
        ...     state = {"optim": {"lr": 0.0, "betas": None}}
        ...     load(state, path)
        >>> state["optim"]
        {'lr': 0.1, 'betas': (0.9, 0.95)}
    """
    _load(state_dict, checkpoint_id, process_group=process_group, what="torch_tp.checkpoint.load")


def _load(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike, *, process_group: dist.ProcessGroup | None,
          what: str, fix: Fix = load_fix) -> None:
    """:func:`load`; DCP's refusals that are not about a file raised by :func:`dcp_error` (``what``, ``fix``)."""
    reader = SafeFileSystemReader(checkpoint_id)
    no_dist = _no_dist(process_group)
    try:
        with _single_process_is_intended(no_dist):
            dcp.load(state_dict, storage_reader=reader, process_group=process_group, no_dist=no_dist)
    except dcp.CheckpointException as failure:
        error = reader._failure or _first_file_error(failure)
        if error is None:
            raise dcp_error(failure, checkpoint_id, what, fix) from failure
        raise error  # noqa: B904 (the CheckpointException stays as the context)


class SafeFileSystemReader(_dcp_filesystem.FileSystemReader):
    """``FileSystemReader`` whose pickles cannot run code, and whose file errors name the file.

    Pass it to ``dcp.load`` to keep DCP's other options (a custom ``planner``, ``no_dist``)::

        dcp.load(state_dict, storage_reader=SafeFileSystemReader(path), planner=...)

    It reads ``.metadata`` with the restricted unpickler, and hands the planner every
    non-tensor value unpickled with ``torch.load(weights_only=True)`` and pickled again, so even
    a planner that calls ``torch.load(weights_only=False)`` (DCP's default) receives only what
    that allowlist builds. A refused ``.metadata`` is not replaced by a rank-local
    ``__<rank>.metadata``, and metadata that points outside the directory, or a symlink in
    it, is refused.

    Args:
        path: the checkpoint directory.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as path:
        ...     _ = save({"w": torch.ones(2)}, path)
        ...     SafeFileSystemReader(path).read_metadata().state_dict_metadata["w"].properties.dtype
        torch.float32
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._failure: Exception | None = None  # the error this reader raised, for load()
        self._reading: Any = None  # the storage entry being read, to name its file

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._failure = self._reading = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None and isinstance(self._failure, _REFUSALS):
            raise self._failure  # DCP's fallback to __<rank>.metadata must not bypass a refusal
        directory = pathlib.Path(self.path)
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        try:
            _require_regular_file(directory, name)
            metadata = _read_metadata_file(directory / name)
            for data_file in sorted({info.relative_path for info in metadata.storage_data.values()}):
                _require_regular_file(directory, data_file)  # every rank, before any rank reads
        except Exception as error:
            if rank is None or not isinstance(error, FileNotFoundError) or self._failure is None:
                self._failure = error  # a missing __<rank>.metadata keeps the error of .metadata
            raise
        self._failure = None
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        ends, self._reading = self._file_ends(plan), None
        try:
            for name, (end, fqn) in ends.items():
                _require_regular_file(pathlib.Path(self.path), name)
                _require_length(pathlib.Path(self.path) / name, end, fqn)
            return super().read_data(plan, _SafeBytesPlanner(planner, self))
        except _FILE_ERRORS as error:
            raise self._fail(error)
        except Exception as error:
            raise self._fail(self._read_error(error, ends)) from error

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self._reading = sinfo  # called for each item, just before it is read
        return super()._slice_file(file, sinfo)

    def _read_error(self, error: Exception, ends: dict[str, tuple[int, str]]) -> Exception:
        """``error``, raised while reading an item, as an error naming the item's file."""
        where = self._reading.relative_path if self._reading is not None else " or ".join(sorted(ends))
        at = f" at offset {self._reading.offset}" if self._reading is not None else ""
        head = f"{_rank_prefix()}{pathlib.Path(self.path) / where}: reading the item{at} failed"
        if isinstance(error, pickle.UnpicklingError):  # the tensor's own pickle, read with weights_only=True
            return _CheckpointPickleError(f"{head}: {_weights_only_reason(error)}")
        return _CheckpointFileError(
            f"{head} ({type(error).__name__}: {error}); the file is corrupted or does not belong to "
            f"this .metadata: save the checkpoint again or restore the file"
        )

    def _file_ends(self, plan: Any) -> dict[str, tuple[int, str]]:
        """Each file the plan reads: the end of its last requested item, and that item's key."""
        ends: dict[str, tuple[int, str]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            end = info.offset + info.length
            if end > ends.get(info.relative_path, (-1, ""))[0]:
                ends[info.relative_path] = (end, item.storage_index.fqn)
        return ends

    def _safe_bytes(self, read_item: Any, value: io.BytesIO) -> io.BytesIO:
        """A non-tensor value unpickled with ``weights_only=True``, pickled again for the planner."""
        path = pathlib.Path(self.path) / self.storage_data[read_item.storage_index].relative_path
        fqn = read_item.storage_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise _CheckpointPickleError(
                f"{_rank_prefix()}{path}: refusing to unpickle the value of {fqn!r}: "
                f"{_weights_only_reason(error)}. Non-tensor values load with "
                f"torch.load(weights_only=True): plain Python values, tensors and classes registered "
                f"with torch.serialization.add_safe_globals; register the class if you trust it"
            ) from error
        except Exception as error:
            raise _CheckpointFileError(
                f"{_rank_prefix()}{path}: the value of {fqn!r} is truncated or corrupted "
                f"({type(error).__name__}: {error}); save the checkpoint again or restore the file"
            ) from error
        clean = io.BytesIO()
        torch.save(loaded, clean)
        clean.seek(0)
        return clean

    def _fail(self, error: Exception) -> Exception:
        self._failure = error
        return error


class _SafeBytesPlanner:
    """The planner as ``FileSystemReader.read_data`` sees it: non-tensor values pass through
    ``SafeFileSystemReader._safe_bytes`` first; everything else goes to the real planner."""

    def __init__(self, planner: Any, reader: SafeFileSystemReader) -> None:
        self._planner, self._reader = planner, reader

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self._planner.load_bytes(read_item, self._reader._safe_bytes(read_item, value))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


# ---------------------------------------------------------------- errors


class _CheckpointPickleError(pickle.UnpicklingError):
    """A pickle in the checkpoint is refused, truncated or corrupted."""


class _CheckpointFileError(RuntimeError):
    """A data file is truncated or unreadable."""


class _CheckpointMissingFile(FileNotFoundError):
    """A file the checkpoint needs does not exist."""


class _CheckpointLinkError(RuntimeError):
    """A file of the checkpoint, or a folder on the way to it, is a symlink (or not a regular file)."""


_FILE_ERRORS = (_CheckpointPickleError, _CheckpointFileError, _CheckpointMissingFile, _CheckpointLinkError)
#: refusals of the checkpoint's content, which DCP's fallback to __<rank>.metadata must not bypass
_REFUSALS = (_CheckpointPickleError, _CheckpointLinkError)


def _first_file_error(failure: Any) -> Exception | None:
    """The first rank's file error inside DCP's ``CheckpointException``, if it holds one."""
    for _, (error, _) in sorted(failure.failures.items()):
        if isinstance(error, _FILE_ERRORS):
            return error
    return None


def _rank_prefix() -> str:
    return f"rank {dist.get_rank()}: " if dist.is_available() and dist.is_initialized() else ""


def _no_dist(process_group: dist.ProcessGroup | None) -> bool:
    return process_group is None and not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_is_intended(no_dist: bool) -> Iterator[None]:
    """Without a process group, silence DCP's warning that it assumes one process: we chose it."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _require_regular_file(directory: pathlib.Path, name: str) -> None:
    """Refuse ``directory / name`` unless it and every folder between are real entries, not links.

    ``name`` is a relative path without ``..`` (``_check_metadata`` refuses others), so a path
    whose every component is a real folder or file cannot lead outside ``directory``: checking
    each component with ``lstat`` is the whole check. The file itself must be a regular file
    (a FIFO would block the read forever). ``directory`` may be a link (the user named it, e.g.
    a ``latest`` link to the newest step). A missing file passes here and is reported where it
    is read.
    """
    path, target = directory, directory / name
    for part in pathlib.PurePosixPath(name).parts:
        path = path / part
        try:
            mode = path.lstat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            return
        if stat.S_ISLNK(mode):
            via = "" if path == target else f" on the way to {target}"
            raise _CheckpointLinkError(
                f"{_rank_prefix()}{path} is a symlink (to {os.readlink(path)}){via}: refusing to read "
                f"through it. A checkpoint holds regular files inside its directory, and a link lets the "
                f"checkpoint make load read any file, so nothing was loaded. If you trust the checkpoint, "
                f"replace the link with a copy of the file it points to (cp -L), or save the checkpoint again"
            )
    if not stat.S_ISREG(mode):
        raise _CheckpointLinkError(
            f"{_rank_prefix()}{target} is not a regular file ({_file_kind(mode)}): refusing to read it. A "
            f"checkpoint holds regular files inside its directory, so nothing was loaded; put the file "
            f"dcp.save wrote there, or save the checkpoint again"
        )


def _file_kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((kind for test, kind in kinds.items() if test(mode)), f"mode {stat.filemode(mode)}")


def _require_length(path: pathlib.Path, end: int, fqn: str) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise _CheckpointMissingFile(
            f"{_rank_prefix()}{path} does not exist, but the checkpoint's .metadata stores {fqn!r} "
            f"in it; copy the whole checkpoint directory"
        ) from None
    if size < end:
        raise _CheckpointFileError(
            f"{_rank_prefix()}{path} is truncated: it has {size} bytes, but the checkpoint's "
            f".metadata stores {fqn!r} up to byte {end}; save the checkpoint again or copy the "
            f"complete file"
        )


def _weights_only_reason(error: pickle.UnpicklingError) -> str:
    """Why ``torch.load(weights_only=True)`` refused: the global as ``module.name`` where it names one."""
    text = str(error)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found is not None:
        name = found.group(1) if "." in found.group(1) else f"builtins.{found.group(1)}"
        return f"it names the global {name}, which torch.load(weights_only=True) does not allow"
    detail = text.split("WeightsUnpickler error:", 1)[-1].split("Check the documentation", 1)[0].strip()
    return (f"torch.load(weights_only=True) refused it ({' '.join(detail.split()) or type(error).__name__}): "
            f"it is corrupted or holds an object that torch.load(weights_only=True) does not build")


# ---------------------------------------------------------------- the metadata unpickler


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` for every global a genuine ``.metadata`` pickles.

    Saving checkpoints with torch 2.13 (tensors of every dtype, DTensors on 2 ranks, int8
    weights, optimizer state, Python values) and listing the globals of their ``.metadata``
    gives DCP's metadata dataclasses, ``filesystem._StorageInfo``, the enum
    ``_MEM_FORMAT_ENCODING``, ``torch.Size``, ``torch.<dtype>``,
    ``torch.serialization._get_layout`` (how a layout pickles) and ``pathlib.PosixPath`` (the
    checkpoint id). Layouts and memory formats by name are allowed too: they are constants.
    """
    md, fs = _dcp_metadata, _dcp_filesystem
    classes = [
        md.Metadata, md.StorageMeta, md.MetadataIndex, md.TensorStorageMetadata, md.BytesStorageMetadata,
        md.ChunkStorageMetadata, md.TensorProperties, getattr(md, "_MEM_FORMAT_ENCODING", None),
        getattr(fs, "_StorageInfo", None), torch.Size, getattr(torch.serialization, "_get_layout", None),
    ]
    allowed = {(c.__module__, c.__qualname__): c for c in classes if c is not None}
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    allowed.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, kinds)})
    for path_class in (pathlib.PosixPath, pathlib.WindowsPath):
        allowed[("pathlib", path_class.__name__)] = path_class
        allowed[(path_class.__module__, path_class.__qualname__)] = path_class
    return allowed


_METADATA_GLOBALS = _metadata_globals()


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`_METADATA_GLOBALS`: a pickle can call
    nothing else, since every callable it reaches comes through ``find_class``."""

    def __init__(self, data: bytes, path: pathlib.Path) -> None:
        super().__init__(io.BytesIO(data))
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _METADATA_GLOBALS[(module, name)]
        except KeyError:
            raise _CheckpointPickleError(
                f"{_rank_prefix()}{self._path}: refusing to load the global {module}.{name}; a "
                f"checkpoint's metadata holds only DCP's metadata classes and torch's dtypes, sizes "
                f"and layouts, so this file was tampered with or not written by dcp.save. Plain "
                f"dcp.load would call it; load this checkpoint only if you trust where it came from"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise _CheckpointPickleError(
            f"{_rank_prefix()}{self._path}: refusing a persistent id {pid!r}; DCP metadata has none"
        )


def _read_metadata_file(path: pathlib.Path) -> Metadata:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _CheckpointMissingFile(
            f"{_rank_prefix()}{path} does not exist: {path.parent} is not a complete checkpoint "
            f"(dcp.save writes .metadata last); pass the directory save wrote"
        ) from None
    try:
        metadata = _MetadataUnpickler(data, path).load()
    except _CheckpointPickleError:
        raise
    except Exception as error:
        raise _CheckpointPickleError(
            f"{_rank_prefix()}{path} is truncated or corrupted ({type(error).__name__}: {error}); "
            f"save the checkpoint again or copy the complete file"
        ) from error
    _check_metadata(metadata, path)
    return metadata


def _check_metadata(metadata: Any, path: pathlib.Path) -> None:
    """The unpickled object is DCP metadata whose storage entries name files in the directory."""

    def refuse(what: str) -> None:
        raise _CheckpointPickleError(f"{_rank_prefix()}{path}: {what}; this is not metadata dcp.save wrote")

    if not isinstance(metadata, Metadata):
        refuse(f"holds a {type(metadata).__name__}, not a torch.distributed.checkpoint Metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        refuse("its state_dict_metadata or storage_data is not a dict")
    for index, info in metadata.storage_data.items():
        fqn, name = getattr(index, "fqn", index), getattr(info, "relative_path", None)
        if not _inside_directory(name):
            refuse(f"the item {fqn!r} is stored at {name!r}, outside the checkpoint directory")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            refuse(f"the item {fqn!r} has no valid offset and length ({offset!r}, {length!r})")


def _inside_directory(name: Any) -> bool:
    """A relative path with no ``..``: what ``FileSystemWriter`` writes (``__0_0.distcp``)."""
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    path = pathlib.PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts
