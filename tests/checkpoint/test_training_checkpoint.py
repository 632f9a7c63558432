"""``torch_tp.checkpoint``'s training state: a run saved and resumed is the run that never stopped.

The zoo Llama trains 4 AdamW steps. The interrupted run trains 2, saves
(``save_training_state``), and a fresh model and optimizer, on the same mesh or another, load
the newest checkpoint (``load_training_state``) and train steps 3 and 4. On the same mesh the
losses and the parameters are the uninterrupted run's bit for bit; on another mesh (2 -> 4
ranks, (dp 2, tp 2) -> tp 4) within float32 tolerance; every run is compared with one process.
An int8-weight Llama (``torch_tp.quant``) resumes the same way, its int8 bit for bit. A
checkpoint of another model, size or dtype (bfloat16, int8) is refused before anything is
loaded; ``keep=`` leaves the newest checkpoints.
"""

import os
import pathlib
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tp import fully_shard_by_pattern, parallelize_module
from torch_tp.checkpoint import (
    CheckpointMismatchError,
    latest_checkpoint,
    load_training_state,
    read_extra,
    save_training_state,
)
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.testing import (
    TOL,
    full_tensor,
    mesh_2x2,
    quantize_weights,
    run_on_ranks,
    small_llama,
    tp_mesh,
)

STEPS, SAVED_AFTER = 4, 2


def _batches():
    generator = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 64, (2, 16), generator=generator), torch.randint(0, 64, (2, 16), generator=generator))
            for _ in range(STEPS)]


def _model(layout):
    model = small_llama(seed=0)
    if layout == "tp":
        return parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=True))
    mesh = mesh_2x2()
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=True))
    return fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=256)


def _train(model, optimizer, first, last):
    losses = []
    for tokens, targets in _batches()[first - 1:last]:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(full_tensor(loss.detach()).item())
    return losses


def _whole(model):
    return {name: full_tensor(p.detach()).clone() for name, p in model.named_parameters()}


def _uninterrupted(layout):
    model = _model(layout)
    losses = _train(model, torch.optim.AdamW(model.parameters()), 1, STEPS)
    return losses, _whole(model)


def _saved_after(layout, directory):
    model = _model(layout)
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer, 1, SAVED_AFTER)
    save_training_state(directory, SAVED_AFTER, model, optimizer, extra={"data_position": SAVED_AFTER})


def _resumed(layout, directory):
    model = _model(layout)
    optimizer = torch.optim.AdamW(model.parameters())
    state = load_training_state(directory, model, optimizer)
    assert state.step == SAVED_AFTER and state.extra == {"data_position": SAVED_AFTER}
    return _train(model, optimizer, state.step + 1, STEPS), _whole(model), state.rng_restored


def _one_process():
    model = small_llama(seed=0)
    return _train(model, torch.optim.AdamW(model.parameters()), 1, STEPS), _whole(model)


@pytest.mark.parametrize("saved_on, resumed_on", [(("tp", 2), ("tp", 2)), (("tp", 2), ("tp", 4)), (("2d", 4), ("tp", 4))],
                         ids=["tp2-tp2", "tp2-tp4", "dp2xtp2-tp4"])
def test_a_resumed_run_continues_the_run_that_never_stopped(saved_on, resumed_on, tmp_path):
    directory = str(tmp_path / "ckpt")
    full_losses, full_params = run_on_ranks(_uninterrupted, saved_on[1], saved_on[0])[0]
    run_on_ranks(_saved_after, saved_on[1], saved_on[0], directory)
    losses, params, rng_restored = run_on_ranks(_resumed, resumed_on[1], resumed_on[0], directory)[0]
    ref_losses, ref_params = _one_process()
    torch.testing.assert_close(full_losses, ref_losses, **TOL)
    if saved_on == resumed_on:  # the same ranks: the same bits
        assert rng_restored and losses == full_losses[SAVED_AFTER:], (losses, full_losses)
        assert all(torch.equal(params[name], full_params[name]) for name in full_params)
    else:  # resharded by DCP: the same values, summed in another order from there on
        assert rng_restored == (saved_on[1] == resumed_on[1])  # each rank's RNG: same world size only
        torch.testing.assert_close(losses, full_losses[SAVED_AFTER:], rtol=1e-5, atol=0)
    torch.testing.assert_close(params, ref_params, **TOL)
    assert sorted(p.name for p in pathlib.Path(directory).iterdir()) == ["step-00000002"]


def _linear_run(directory, steps, width=3):
    torch.manual_seed(0)
    model = nn.Linear(4, width)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(1, steps + 1):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        save_training_state(directory, step, model, optimizer, extra={"data_position": step})
    return model


def _listing(directory):
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in pathlib.Path(directory).rglob("*")}


def _params_whole(model):
    """Each parameter made whole (a copy): ``(qdata, scale)`` of an int8 weight, else the tensor."""
    wholes = {name: full_tensor(p.detach()) for name, p in model.named_parameters()}
    return {name: (w.qdata.clone(), w.scale.clone()) if hasattr(w, "qdata") else w.clone() for name, w in wholes.items()}


def _assert_same_params(got, expected):
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        pairs = zip(got[name], value) if isinstance(value, tuple) else [(got[name], value)]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs), name


def test_a_checkpoint_left_half_written_is_never_loaded(tmp_path):
    # a job killed while saving step 3 leaves step-00000003.partial: files without .metadata
    _linear_run(tmp_path, 2)
    partial = tmp_path / "step-00000003.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 100)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    model = nn.Linear(4, 3)
    state = load_training_state(tmp_path, model, torch.optim.AdamW(model.parameters()))
    assert state.step == 2 and state.extra == {"data_position": 2} and read_extra(tmp_path) == state.extra
    assert latest_checkpoint(tmp_path / "nothing here") is None


@pytest.mark.parametrize("case", ["another model", "another size", "another dtype", "int8 weights", "a file"])
def test_a_checkpoint_of_another_model_is_refused_by_name_and_nothing_is_written(case, tmp_path):
    _linear_run(tmp_path, 1)
    before = _listing(tmp_path)
    directory, model = tmp_path, {
        "another model": lambda: nn.Sequential(nn.Linear(4, 3)),
        "another size": lambda: nn.Linear(4, 5),
        "another dtype": lambda: nn.Linear(4, 3).to(torch.bfloat16),
        "int8 weights": lambda: quantize_weights(nn.Linear(4, 3)),
        "a file": lambda: nn.Linear(4, 3),
    }[case]()
    if case == "a file":
        directory = tmp_path / "step-00000001" / ".metadata"
    untouched = _params_whole(model)
    expected = {
        "another model": r"holds another model: the model's 0\.bias, 0\.weight \(2 entries\) not in the checkpoint",
        "another size": r"holds bias of shape \[3\], the model's is \[5\]: the checkpoint is of another model size",
        "another dtype": r"holds bias as float32, the model's is bfloat16: the checkpoint was saved from the model "
                         r"in another dtype",
        "int8 weights": r"holds weight as float32, the model's is int8 \(Int8SymmetricTensor, logical float32\): "
                        r"the checkpoint was saved from the model in another dtype",
        "a file": r"\.metadata' is a file, not a checkpoint directory",
    }[case]
    with pytest.raises(CheckpointMismatchError, match=expected):
        load_training_state(directory, model, torch.optim.AdamW(model.parameters()))
    if case == "a file":  # nor is anything saved there
        with pytest.raises(CheckpointMismatchError, match="is a file"):
            save_training_state(directory, 2, model, torch.optim.AdamW(model.parameters()))
    assert _listing(tmp_path) == before
    assert os.listdir(tmp_path) == ["step-00000001"]
    _assert_same_params(_params_whole(model), untouched)  # nothing loaded


def test_keep_leaves_the_newest_checkpoints(tmp_path):
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(1, 5):
        save_training_state(tmp_path, step, model, optimizer, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000004"
    with pytest.raises(ValueError, match=r"torch_tp\.checkpoint: save_training_state\(keep=0\) would keep no checkpoint"):
        save_training_state(tmp_path, 5, model, optimizer, keep=0)
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004"]


# An int8-weight Llama (torch_tp.quant, frozen int8 weights, trained norms) on tp 2: saved after
# 2 steps and resumed into a model of another seed, it holds the saved int8 bit for bit and
# trains steps 3 and 4 as the run that never stopped; a float model refuses its checkpoint.


def _int8_llama(seed, quantized=True):
    model = small_llama(seed=seed, n_layers=1)
    model = quantize_weights(model) if quantized else model
    return parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=True))


def _trainable(model):
    return torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)  # the norms


def _int8_resumed(directory):
    model = _int8_llama(0)
    optimizer = _trainable(model)
    _train(model, optimizer, 1, SAVED_AFTER)
    save_training_state(directory, SAVED_AFTER, model, optimizer)
    saved = _params_whole(model)
    never_stopped = _train(model, optimizer, SAVED_AFTER + 1, STEPS)
    resumed = _int8_llama(1)
    before = _params_whole(resumed)
    resumed_optimizer = _trainable(resumed)
    state = load_training_state(directory, resumed, resumed_optimizer)
    loaded = _params_whole(resumed)
    losses = _train(resumed, resumed_optimizer, state.step + 1, STEPS)
    float_model = _int8_llama(1, quantized=False)
    with pytest.raises(CheckpointMismatchError) as refused:
        load_training_state(directory, float_model, torch.optim.AdamW(float_model.parameters()))
    return {"saved": saved, "before": before, "loaded": loaded, "never_stopped": never_stopped, "losses": losses,
            "final": _params_whole(model), "resumed_final": _params_whole(resumed), "refused": str(refused.value)}


def test_an_int8_tensor_parallel_model_resumes_bit_for_bit(tmp_path):
    for run in run_on_ranks(_int8_resumed, 2, str(tmp_path)):
        int8 = sorted(name for name, value in run["saved"].items() if isinstance(value, tuple))
        assert "output.weight" in int8 and "layers.0.attention.wq.weight" in int8, int8
        assert all(run["saved"][name][0].dtype == torch.int8 for name in int8)
        assert not any(torch.equal(run["before"][name][0], run["saved"][name][0]) for name in int8)
        _assert_same_params(run["loaded"], run["saved"])
        assert run["losses"] == run["never_stopped"], (run["losses"], run["never_stopped"])
        _assert_same_params(run["resumed_final"], run["final"])
        assert re.search(r"holds \S+\.weight as int8 \(Int8SymmetricTensor, logical float32\), the model's is float32: "
                         r"the checkpoint was saved from the model in another dtype", run["refused"]), run["refused"]
