"""A training run saved and resumed: model, optimizer, step, the caller's values and the RNG.

Built on PyTorch's engines: ``get_state_dict``/``set_state_dict``
(``torch.distributed.checkpoint.state_dict``) give the model's and the optimizer's state as
DTensors of whatever mesh the model is on (tensor parallel, FSDP2 x TP), and DCP writes and
reshards them (through :func:`torch_tp.checkpoint.save` and the pickle-safe
:func:`torch_tp.checkpoint.load`). What torch_tp adds is the directory discipline that makes a
run resumable after a rank died at any moment:

============================  ==================================================================
``DIR/step-00000012/``        a complete checkpoint: renamed from ``.partial`` once every rank
                              had written its files (``os.rename``, atomic on one filesystem)
``DIR/step-00000015.partial`` being written, or left by a job that died mid-save: never loaded,
                              removed by the next save of that step
============================  ==================================================================

:func:`latest_checkpoint` is the newest complete one; :func:`save_training_state` writes one and
:func:`load_training_state` resumes from the newest (``keep=`` prunes the oldest). Before anything
is loaded, the checkpoint's parameter names, global shapes and dtypes are compared with the
model's: another model, the same model at another size or in another dtype (bfloat16 for
float32, int8 weights for float ones), raises :class:`CheckpointMismatchError` naming the first
difference.
The RNG states (each rank's CPU generator, and CUDA's where it is initialized) are restored
only on the world size that saved them: resuming on another mesh continues the run's numbers
(model, optimizer, step, data position), not its random streams.

Example::

    >>> # xdoctest: +SKIP("every rank of a training job")
    >>> state = load_training_state("ckpt", model, optimizer)
    >>> start = state.step if state is not None else 0
    >>> for step in range(start + 1, steps + 1):
    ...     train_one_step(batches[step - 1])
    ...     if step % 5 == 0:
    ...         save_training_state("ckpt", step, model, optimizer, extra={"data_position": step})
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from torch_tp.checkpoint._safe import SafeFileSystemReader, load, save

__all__ = [
    "CheckpointMismatchError",
    "TrainingState",
    "latest_checkpoint",
    "load_training_state",
    "read_extra",
    "save_training_state",
]

_STEP = re.compile(r"step-(\d{8})")
_PARTIAL = ".partial"
_DTYPES = "parameter_dtypes"  # each model tensor's dtype, with its storage (int8 weights): JSON


class CheckpointMismatchError(ValueError):
    """The checkpoint holds another model (or the same one at another size), or DIR is no
    checkpoint directory; raised on every rank before anything is loaded or written.

    Example::

        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     try:
        ...         latest_checkpoint(f.name)
        ...     except CheckpointMismatchError as error:
        ...         print(str(error).endswith("pass a directory (it is created if missing)"))
        True
    """


@dataclasses.dataclass(frozen=True)
class TrainingState:
    """What :func:`load_training_state` restored besides the model and the optimizer.

    Attributes:
        step: the step the checkpoint was saved after (the next step to run is ``step + 1``).
        extra: the caller's values saved with it (plain JSON: ints, floats, strings, lists, dicts).
        path: the checkpoint's directory.
        rng_restored: whether the RNG states were restored (same world size as the save).

    Example::

        >>> TrainingState(step=12, extra={"data_position": 12}, path=pathlib.Path("ckpt/step-00000012"),
        ...               rng_restored=True).step
        12
    """

    step: int
    extra: dict[str, Any]
    path: pathlib.Path
    rng_restored: bool


def latest_checkpoint(directory: str | os.PathLike) -> pathlib.Path | None:
    """The newest complete checkpoint in ``directory`` (``step-<8 digits>``), or ``None``.

    Checkpoints still being written (``*.partial``) are never returned. A ``directory`` that does
    not exist holds none; one that is a file raises :class:`CheckpointMismatchError`.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     os.makedirs(f"{d}/step-00000005"); os.makedirs(f"{d}/step-00000010.partial")
        ...     latest_checkpoint(d).name
        'step-00000005'
    """
    steps = _complete_checkpoints(_checkpoint_root(directory))
    return steps[-1] if steps else None


def read_extra(directory: str | os.PathLike, *, process_group: dist.ProcessGroup | None = None) -> dict[str, Any] | None:
    """The ``extra`` values of the newest complete checkpoint in ``directory``, or ``None``.

    Reads nothing else: what a script needs before it can build the model the checkpoint holds
    (its sizes, saved in ``extra``). Call it on every rank, as DCP's load is collective.

    Example::

        >>> # xdoctest: +SKIP("every rank of a training job")
        >>> read_extra("ckpt")
        {'data_position': 12, 'model_args': {'dim': 64, 'n_layers': 2}}
    """
    path = latest_checkpoint(directory)
    if path is None:
        return None
    state = {"extra": ""}
    load(state, path, process_group=process_group)
    return json.loads(state["extra"])


def save_training_state(
    directory: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    extra: dict[str, Any] | None = None,
    keep: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> pathlib.Path:
    """Save ``model``, ``optimizer``, ``step``, ``extra`` and the RNG states as ``DIR/step-<step>``.

    Call it on every rank of ``process_group`` (default: the default group), as DCP requires.
    The files go to ``step-<step>.partial`` first; once every rank has written its part, rank 0
    renames it to ``step-<step>``, so a job that dies while saving leaves a ``.partial`` that is
    never loaded, and the previous checkpoint stays the newest complete one. With ``keep``, rank 0
    then removes the oldest complete checkpoints until ``keep`` remain, the new one among them
    (each is renamed to ``.partial`` before it is removed, so one half removed is never loaded).

    Args:
        directory: where checkpoints live (created if missing).
        step: the number of steps trained so far.
        model: the (parallelized) model; its state dict holds DTensors of its mesh.
        optimizer: its optimizer.

    Keyword Args:
        extra: plain values to keep with the step (data position, configuration), JSON-encodable.
        keep: how many complete checkpoints to leave in ``directory`` (at least 1; ``None``: all).
        process_group: the ranks that save together.

    Returns:
        the complete checkpoint's directory.

    Raises:
        ValueError: ``keep`` is below 1 (raised on every rank before anything is written).

    Example (one process here; a training job calls it on every rank; ``keep=2``: the two
    newest remain)::

        >>> import tempfile
        >>> model = nn.Linear(2, 2)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> with tempfile.TemporaryDirectory() as d:
        ...     for step in (5, 10, 15):
        ...         path = save_training_state(d, step, model, optimizer, extra={"data_position": step}, keep=2)
        ...     path.name, sorted(p.name for p in pathlib.Path(d).iterdir())
        ('step-00000015', ['step-00000010', 'step-00000015'])
    """
    _require_keep(keep)
    root = _checkpoint_root(directory)
    final = root / f"step-{step:08d}"
    partial = final.with_name(final.name + _PARTIAL)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {
        "model": model_state,
        "optimizer": optim_state,
        "step": step,
        "extra": json.dumps(extra or {}, sort_keys=True),
        _DTYPES: json.dumps(_dtypes(model_state), sort_keys=True),
        "world_size": _world_size(process_group),
        "rng": {f"rank{_rank(process_group)}": _rng_states()},
    }
    if _rank(process_group) == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a job that died mid-save
        partial.mkdir()
    _barrier(process_group)
    save(state, partial, process_group=process_group)
    _barrier(process_group)  # every rank's files are written (dcp.save wrote .metadata last)
    if _rank(process_group) == 0:
        if final.exists():  # saved again after a resume from an older step: replace it whole
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_directory(root)
        if keep is not None:
            _prune(root, keep, final)
    _barrier(process_group)
    return final


def load_training_state(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> TrainingState | None:
    """Restore ``model`` and ``optimizer`` from the newest complete checkpoint in ``directory``.

    Returns ``None`` (and changes nothing) when there is none. The model and the optimizer may
    be on another mesh than the one that saved them: DCP reshards every DTensor. The RNG states
    are restored only on the world size that saved them (``rng_restored``).

    Raises:
        CheckpointMismatchError: the checkpoint's parameters differ from the model's (a name
            missing on either side, another global shape, another dtype: float32 saved and
            bfloat16 in the model, int8 weights saved and float ones in the model, or the
            reverse), or ``directory`` is a file.

    Example::

        >>> # xdoctest: +SKIP("every rank of a training job")
        >>> state = load_training_state("ckpt", model, optimizer)
        >>> state.step, state.extra
        (12, {'data_position': 12})
    """
    path = latest_checkpoint(directory)
    if path is None:
        return None
    model_state, optim_state = get_state_dict(model, optimizer)
    saved = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    _check_same_model(model_state, saved, path)
    rank, world = _rank(process_group), _world_size(process_group)
    header = {"world_size": 0, **({_DTYPES: ""} if _DTYPES in saved else {})}  # older checkpoints: none
    load(header, path, process_group=process_group)
    if _DTYPES in header:
        _check_same_dtypes(_dtypes(model_state), json.loads(header[_DTYPES]), path)
    same_world = header["world_size"] == world
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state, "step": 0, "extra": ""}
    if same_world:
        state["rng"] = {f"rank{rank}": _rng_states()}
    load(state, path, process_group=process_group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if same_world:
        _set_rng_states(state["rng"][f"rank{rank}"])
    return TrainingState(step=int(state["step"]), extra=json.loads(state["extra"]), path=path,
                         rng_restored=same_world)


def _checkpoint_root(directory: str | os.PathLike) -> pathlib.Path:
    root = pathlib.Path(directory)
    if root.exists() and not root.is_dir():
        raise CheckpointMismatchError(
            f"torch_tp.checkpoint: {str(root)!r} is a file, not a checkpoint directory; "
            "pass a directory (it is created if missing)"
        )
    return root


def _complete_checkpoints(root: pathlib.Path) -> list[pathlib.Path]:
    """The complete checkpoints in ``root``, oldest first (none when ``root`` does not exist)."""
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP.fullmatch(p.name))


def _require_keep(keep: int | None) -> None:
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(
            f"torch_tp.checkpoint: save_training_state(keep={keep!r}) would keep no checkpoint; "
            "pass keep=1 or more (the number of complete checkpoints to leave), or keep=None to keep all"
        )


def _prune(root: pathlib.Path, keep: int, final: pathlib.Path) -> None:
    """Remove the oldest complete checkpoints but ``final`` until ``keep`` remain (``final`` included).

    Each is renamed to ``.partial`` first: a job that dies while removing one leaves a directory
    that is never loaded (and is removed by the next save of that step).
    """
    older = [p for p in _complete_checkpoints(root) if p != final]
    for old in older[:max(len(older) - (keep - 1), 0)]:
        doomed = old.with_name(old.name + _PARTIAL)
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(old, doomed)
        shutil.rmtree(doomed)


def _dtypes(model_state: dict[str, Any]) -> dict[str, str]:
    """Each tensor's dtype as the checkpoint's check names it: ``"float32"``, or for a tensor
    subclass its storage, class and logical dtype (``"int8 (Int8SymmetricTensor, logical float32)"``).

    DCP's metadata records only the logical dtype, which an int8 weight shares with a float one.

    Example::

        >>> _dtypes({"w": torch.ones(2, dtype=torch.bfloat16), "step": 3})
        {'w': 'bfloat16'}
    """
    return {name: _dtype_name(value) for name, value in model_state.items() if torch.is_tensor(value)}


def _dtype_name(value: torch.Tensor) -> str:
    local = value.to_local() if isinstance(value, DTensor) else value
    if type(local) in (torch.Tensor, nn.Parameter):
        return _dtype_str(value.dtype)
    inner = getattr(local, "qdata", None)  # the stored values of a quantized tensor
    stored = _dtype_str(inner.dtype if torch.is_tensor(inner) else value.dtype)
    return f"{stored} ({type(local).__name__}, logical {_dtype_str(value.dtype)})"


def _dtype_str(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "not a tensor"


def _check_same_model(model_state: dict[str, Any], saved: dict[str, Any], path: pathlib.Path) -> None:
    """The model's parameter names, global shapes and dtypes are the checkpoint's (``model.*`` entries)."""
    theirs = {key[len("model."):]: meta for key, meta in saved.items() if key.startswith("model.")}
    ours = {name: tuple(value.shape) for name, value in model_state.items() if torch.is_tensor(value)}
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"torch_tp.checkpoint: {path} holds another model: "
            + "; ".join(filter(None, [
                f"the model's {_names(missing)} not in the checkpoint" if missing else "",
                f"the checkpoint's {_names(unexpected)} not in the model" if unexpected else "",
            ]))
            + "; resume with the model that saved it, or use another checkpoint directory"
        )
    for name, shape in sorted(ours.items()):
        saved_shape = tuple(getattr(theirs[name], "size", ()))
        if saved_shape != shape:
            raise CheckpointMismatchError(
                f"torch_tp.checkpoint: {path} holds {name} of shape {list(saved_shape)}, the model's is "
                f"{list(shape)}: the checkpoint is of another model size; build the model it saved"
            )
    for name, value in sorted(model_state.items()):
        if torch.is_tensor(value):
            saved_dtype = getattr(getattr(theirs[name], "properties", None), "dtype", None)
            if saved_dtype != value.dtype:  # DCP records the logical dtype: float32 for an int8 weight too
                _dtype_mismatch(path, name, _dtype_str(saved_dtype), _dtype_str(value.dtype))


def _check_same_dtypes(ours: dict[str, str], theirs: dict[str, str], path: pathlib.Path) -> None:
    """Each of the model's tensors is stored as the checkpoint stored it (:func:`_dtypes`)."""
    for name, dtype in sorted(ours.items()):
        if theirs.get(name, dtype) != dtype:
            _dtype_mismatch(path, name, theirs[name], dtype)


def _dtype_mismatch(path: pathlib.Path, name: str, saved: str, ours: str) -> NoReturn:
    raise CheckpointMismatchError(
        f"torch_tp.checkpoint: {path} holds {name} as {saved}, the model's is {ours}: the checkpoint "
        f"was saved from the model in another dtype; build the model as it was saved (its dtype, "
        f"quantized or not), load, then convert it"
    )


def _names(names: list[str], shown: int = 3) -> str:
    listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
    return f"{listed}" if len(names) == 1 else f"{listed} ({len(names)} entries)"


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _fsync_directory(path: pathlib.Path) -> None:
    """Make the rename durable (a crash of the machine right after keeps it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
