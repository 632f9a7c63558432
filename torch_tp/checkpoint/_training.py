"""A training run saved and resumed: model, optimizer, step, the caller's values and the RNG.

Built on PyTorch's engines: ``get_state_dict``/``set_state_dict``
(``torch.distributed.checkpoint.state_dict``) give the model's and the optimizer's state as
DTensors of whatever mesh the model is on (tensor parallel, FSDP2 x TP), and DCP writes and
reshards them (through :func:`torch_tp.checkpoint.save` and the pickle-safe
:func:`torch_tp.checkpoint.load`). What torch_tp adds is the directory discipline that makes a
run resumable after a rank died at any moment:

============================  ==================================================================
``DIR/step-00000012/``        a complete checkpoint: renamed from ``.partial`` once every rank
                              had written its files (``os.rename``, atomic on one filesystem);
                              the step zero-padded to 8 digits, longer past 99,999,999
                              (``step-100000000``), the newest the highest step
``DIR/step-00000015.partial`` being written, or left by a job that died mid-save: never loaded,
                              removed by the next save of that step
============================  ==================================================================

:func:`latest_checkpoint` is the newest complete one; :func:`save_training_state` writes one and
:func:`load_training_state` resumes from the newest (``keep=`` prunes the oldest). Every decision
about the files is taken by every rank, compared, and agreed before any rank acts on it
(``_directory.py``): ranks whose newest checkpoints differ (each passed another path, or
node-local directories), a rank that sees none while others do, a directory rank 0 cannot write,
or ranks saving different steps raise :class:`CheckpointError` on every rank at once, naming each
rank's view; DCP's own refusals (a key missing, another shape) are raised as one named error
too, never as DCP's traceback dump. Before anything
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
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from torch_tp._agreement import Fact
from torch_tp.checkpoint._directory import (
    PARTIAL,
    agree,
    agree_on_partial,
    agreed_newest,
    checkpoint_root,
    complete_checkpoints,
    create_partial,
    publish,
    rank_of,
    require_keep,
    require_step,
    step_name,
)
from torch_tp.checkpoint._errors import CheckpointError, CheckpointMismatchError
from torch_tp.checkpoint._safe import _load, _save

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "TrainingState",
    "latest_checkpoint",
    "load_training_state",
    "read_extra",
    "save_training_state",
]

_SAVE, _LOAD, _READ = (f"torch_tp.checkpoint.{name}" for name in ("save_training_state", "load_training_state", "read_extra"))
_DTYPES = "parameter_dtypes"  # each model tensor's dtype, with its storage (int8 weights): JSON


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
    """The newest complete checkpoint in ``directory`` (``step-<step>``, the highest step), or ``None``.

    Checkpoints still being written (``*.partial``) are never returned. A ``directory`` that does
    not exist holds none; one that is a file raises :class:`CheckpointMismatchError`. This is one
    process's view: :func:`load_training_state` and :func:`read_extra` compare every rank's.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     os.makedirs(f"{d}/step-99999999"); os.makedirs(f"{d}/step-100000000")
        ...     os.makedirs(f"{d}/step-100000005.partial")
        ...     latest_checkpoint(d).name
        'step-100000000'
    """
    steps = complete_checkpoints(checkpoint_root(directory))
    return steps[-1] if steps else None


def read_extra(directory: str | os.PathLike, *, process_group: dist.ProcessGroup | None = None) -> dict[str, Any] | None:
    """The ``extra`` values of the newest complete checkpoint in ``directory``, or ``None``.

    Reads nothing else: what a script needs before it can build the model the checkpoint holds
    (its sizes, saved in ``extra``). Call it on every rank, as DCP's load is collective; the
    ranks agree on the checkpoint first, as in :func:`load_training_state`.

    Raises:
        CheckpointError: the ranks' newest checkpoints differ, or DCP refused the load.

    Example::

        >>> # xdoctest: +SKIP("every rank of a training job")
        >>> read_extra("ckpt")
        {'data_position': 12, 'model_args': {'dim': 64, 'n_layers': 2}}
    """
    path, _ = agreed_newest(directory, process_group, what=_READ)
    if path is None:
        return None
    state = {"extra": ""}
    _load(state, path, process_group=process_group, what=_READ, fix=_training_fix)
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
    Before any rank writes, the ranks agree that they save the same step, that rank 0 created
    the ``.partial`` and that every rank sees it (one shared directory).

    Args:
        directory: where checkpoints live (created if missing).
        step: the number of steps trained so far: an ``int``, 0 or more (no upper bound).
        model: the (parallelized) model; its state dict holds DTensors of its mesh.
        optimizer: its optimizer.

    Keyword Args:
        extra: plain values to keep with the step (data position, configuration), JSON-encodable.
        keep: how many complete checkpoints to leave in ``directory`` (at least 1; ``None``: all).
        process_group: the ranks that save together.

    Returns:
        the complete checkpoint's directory.

    Raises:
        TypeError: ``step`` is not an integer (``5.0``, ``True``, ``"5"``).
        ValueError: ``step`` is negative or ``keep`` below 1.
        CheckpointError: rank 0 cannot create the directory, the ranks see different
            directories or pass different steps, or DCP's save failed.
        All are raised on every rank before anything is written.

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
    rank, problem = rank_of(process_group), None
    try:  # this rank's checks and its state (local work), agreed before any rank writes
        step = require_step(step, what=_SAVE)
        require_keep(keep)
        final = checkpoint_root(directory) / step_name(step)
        partial = final.with_name(final.name + PARTIAL)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {
            "model": model_state,
            "optimizer": optim_state,
            "step": step,
            "extra": json.dumps(extra or {}, sort_keys=True),
            _DTYPES: json.dumps(_dtypes(model_state), sort_keys=True),
            "world_size": _world_size(process_group),
            "rng": {f"rank{rank}": _rng_states()},
        }
        if rank == 0:
            create_partial(partial, what=_SAVE)
    except Exception as error:
        problem = error
    same_step = Fact("steps differ", step, "pass the same step on every rank (the steps trained so far); nothing was saved")
    agree(process_group, problem, [same_step], what=_SAVE)
    agree_on_partial(partial, process_group, what=_SAVE)
    _save(state, partial, process_group=process_group, what=_SAVE)
    _barrier(process_group)  # every rank's files are written (dcp.save wrote .metadata last)
    problem = None
    if rank == 0:
        try:
            publish(partial, final, keep, what=_SAVE)
        except Exception as error:
            problem = error
    agree(process_group, problem, [], what=_SAVE)
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
    are restored only on the world size that saved them (``rng_restored``). Call it on every
    rank of ``process_group``: each rank picks its newest complete checkpoint, and the ranks
    compare their choices (the step and the save that wrote it) before anything is loaded.

    Raises:
        CheckpointMismatchError: the checkpoint's parameters differ from the model's (a name
            missing on either side, another global shape, another dtype: float32 saved and
            bfloat16 in the model, int8 weights saved and float ones in the model, or the
            reverse), DCP finds a key the checkpoint lacks (the model's extra state, another
            optimizer's state) or another shape, or ``directory`` is a file.
        CheckpointError: the ranks' newest checkpoints differ, or one rank sees none while the
            others see one (each rank passed another path, or node-local directories): every
            rank raises at once, naming each rank's choice. DCP's other failures.

    Example::

        >>> # xdoctest: +SKIP("every rank of a training job")
        >>> state = load_training_state("ckpt", model, optimizer)
        >>> state.step, state.extra
        (12, {'data_position': 12})
    """
    path, saved = agreed_newest(directory, process_group, what=_LOAD)
    if path is None:
        return None
    model_state, optim_state = _agree_locally(process_group, lambda: _checked_state(model, optimizer, saved, path))
    rank, world = rank_of(process_group), _world_size(process_group)
    header = {"world_size": 0, **({_DTYPES: ""} if _DTYPES in saved.state_dict_metadata else {})}  # older: none
    _load(header, path, process_group=process_group, what=_LOAD, fix=_training_fix)
    if _DTYPES in header:
        _agree_locally(process_group, lambda: _check_same_dtypes(_dtypes(model_state), json.loads(header[_DTYPES]), path))
    same_world = header["world_size"] == world
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state, "step": 0, "extra": ""}
    if same_world:
        state["rng"] = {f"rank{rank}": _rng_states()}
    _load(state, path, process_group=process_group, what=_LOAD, fix=_training_fix)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if same_world:
        _set_rng_states(state["rng"][f"rank{rank}"])
    return TrainingState(step=int(state["step"]), extra=json.loads(state["extra"]), path=path,
                         rng_restored=same_world)


def _agree_locally(group: dist.ProcessGroup | None, check: Callable[[], Any]) -> Any:
    """``check()`` on this rank (local work: no collective), then raise on every rank if it
    raised on any; its value."""
    try:
        value, problem = check(), None
    except Exception as error:
        value, problem = None, error
    agree(group, problem, [], what=_LOAD)
    return value


def _checked_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: Any, path: pathlib.Path) -> tuple:
    """The model's and the optimizer's state dicts, once the model is the checkpoint's (names, shapes, dtypes)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    _check_same_model(model_state, saved.state_dict_metadata, path)
    return model_state, optim_state


def _training_fix(kind: str, key: str) -> str:
    """What to change when DCP refuses to load a training checkpoint (``_errors.dcp_error``)."""
    if kind == "shape":
        return "build the model (and its optimizer) at the size that saved it, or use another checkpoint directory"
    if kind == "other":
        return "resume with the model and optimizer that saved it, or save the checkpoint again"
    if key.startswith("model."):
        return ("build the model that saved it (the same submodules, buffers and extra state), "
                "or use another checkpoint directory")
    if key.startswith("optimizer."):
        return ("resume with the optimizer that saved it (the same class and options: amsgrad=True adds "
                "max_exp_avg_sq), or use another checkpoint directory")
    return ("save_training_state writes it, so this checkpoint was not written by save_training_state or "
            "its .metadata was edited: save it again, or use another checkpoint directory")


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
            f"{_LOAD}: {path} holds another model: "
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
                f"{_LOAD}: {path} holds {name} of shape {list(saved_shape)}, the model's is "
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
        f"{_LOAD}: {path} holds {name} as {saved}, the model's is {ours}: the checkpoint "
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


def _world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)
