"""DCP's ``CheckpointException`` never reaches the user: each refusal is one named error.

On 2 ranks, a tensor-parallel checkpoint loaded with ``load_training_state`` into a model or
state it does not fit (an entry removed from ``.metadata``, a model with an extra key, an
optimizer with an extra key, a model of another shape), and a plain ``load`` of a state dict
with an extra key or another shape, raise on every rank a ``CheckpointMismatchError`` whose
message starts with the function's module path, names the checkpoint and the first key or
shape, and says what to change, with DCP's exception chained as its cause; nothing is loaded.
A ``save`` DCP cannot write raises ``CheckpointError`` the same way.
"""

import pathlib
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor

from torch_tp import ColwiseParallel, parallelize_module
from torch_tp.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    load,
    load_training_state,
    save,
    save_training_state,
)
from torch_tp.testing import full_tensor, on_ranks, rank, tp_mesh


class _WithExtraState(nn.Module):
    """A submodule whose state is a plain value (``get_extra_state``), not a tensor."""

    def get_extra_state(self):
        return {"version": 2}

    def set_extra_state(self, state):
        pass


def _model(out_features=8, extra_state=False, seed=0, amsgrad=False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, out_features), *([_WithExtraState()] if extra_state else []))
    model = parallelize_module(model, tp_mesh(), {"0": ColwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), amsgrad=amsgrad)


def _whole(model):
    return {name: full_tensor(p.detach()).clone() for name, p in model.named_parameters()}


def _remove_entry(checkpoint, key):
    """Delete ``key`` from the checkpoint's ``.metadata`` (rank 0 edits, every rank waits)."""
    if rank() == 0:
        metadata_file = checkpoint / ".metadata"
        metadata = pickle.loads(metadata_file.read_bytes())
        del metadata.state_dict_metadata[key]
        metadata_file.write_bytes(pickle.dumps(metadata))
    dist.barrier()


def _refusal(call, from_dcp=True):
    with pytest.raises(CheckpointMismatchError) as raised:
        call()
    error = raised.value
    assert isinstance(error, CheckpointError) and isinstance(error, ValueError)
    assert isinstance(error.__cause__, dcp.CheckpointException) == from_dcp, repr(error.__cause__)
    assert "Traceback" not in str(error) and "CheckpointException" not in str(error), str(error)
    return str(error)


@on_ranks(2)
def test_dcp_refusals_raise_one_named_error_naming_the_checkpoint_and_the_key_on_every_rank(tmp_path):
    saved, optimizer = _model()
    damaged, intact = tmp_path / "damaged", tmp_path / "intact"
    save_training_state(damaged, 1, saved, optimizer)
    save_training_state(intact, 1, saved, optimizer)
    _remove_entry(damaged / "step-00000001", "step")
    prefix = "torch_tp.checkpoint.load_training_state: "
    cases = {  # the model and optimizer to load into, the directory, what the message says
        "an entry removed from .metadata": (_model(seed=1), damaged,
            f"{prefix}{damaged / 'step-00000001'} holds no 'step', which the state dict to load has; save_training_state "
            f"writes it, so this checkpoint was not written by save_training_state or its .metadata was edited"),
        "a model with an extra key": (_model(extra_state=True, seed=1), intact,
            f"{prefix}{intact / 'step-00000001'} holds no 'model.1._extra_state.version', which the state dict to load "
            f"has; build the model that saved it (the same submodules, buffers and extra state)"),
        "an optimizer with an extra key": (_model(seed=1, amsgrad=True), intact,
            f"{prefix}{intact / 'step-00000001'} holds no 'optimizer.state.0.weight.max_exp_avg_sq', which the state "
            f"dict to load has; resume with the optimizer that saved it (the same class and options"),
    }
    for case, ((model, model_optimizer), directory, expected) in cases.items():
        untouched = _whole(model)
        message = _refusal(lambda: load_training_state(directory, model, model_optimizer))
        assert message.startswith(expected), (case, message)
        assert all(torch.equal(p, untouched[name]) for name, p in _whole(model).items()), f"{case}: nothing is loaded"

    # another shape is refused before DCP runs (the model's names, shapes and dtypes against .metadata)
    resized, resized_optimizer = _model(out_features=6, seed=1)
    message = _refusal(lambda: load_training_state(intact, resized, resized_optimizer), from_dcp=False)
    assert message.startswith(f"{prefix}{intact / 'step-00000001'} holds 0.bias of shape [8], the model's is [6]: "
                              "the checkpoint is of another model size; build the model it saved"), message

    # the same refusals through load, on a sharded state dict DCP checks itself
    plain = tmp_path / "plain"
    save({"w": distribute_tensor(torch.arange(24.0).reshape(4, 6), tp_mesh(), [Shard(0)])}, plain)
    other_shape = {"w": distribute_tensor(torch.zeros(4, 5), tp_mesh(), [Shard(0)])}
    message = _refusal(lambda: load(other_shape, plain))
    assert message.startswith(f"torch_tp.checkpoint.load: {plain} holds 'w' of shape [4, 6], the state dict to load "
                              "has [4, 5]; load into a tensor of the saved shape"), message
    message = _refusal(lambda: load({"w": distribute_tensor(torch.zeros(4, 6), tp_mesh(), [Shard(0)]), "lr": 0.1}, plain))
    assert message.startswith(f"torch_tp.checkpoint.load: {plain} holds no 'lr', which the state dict to load has; "
                              "load into a state dict with only the keys the checkpoint holds"), message
    assert not other_shape["w"].full_tensor().any()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_save_dcp_cannot_write_raises_one_named_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "ckpt"
    with pytest.raises(CheckpointError) as raised:
        save({"w": torch.ones(2)}, target)
    assert str(raised.value).startswith(f"torch_tp.checkpoint.save: {target}: DCP failed on rank 0 (NotADirectoryError: ")
    assert str(raised.value).endswith("pass a directory every rank can write, on a filesystem with room for the checkpoint")
    assert isinstance(raised.value.__cause__, dcp.CheckpointException)
    assert not pathlib.Path(target).exists()
