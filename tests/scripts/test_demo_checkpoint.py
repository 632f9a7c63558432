"""The main job's checkpoints: a run stopped after a save and started again is the run that never
stopped (same mesh: the same parameters' SHA-256 and final loss; another mesh: the same loss
curve within 1e-5), and a directory it cannot use is refused by name with nothing written.

The job's body (``torch_tp.demo._run``, what every rank runs under ``python -m torch_tp.demo``)
runs on the harness's ranks with the options the command line would give; killing ranks under
``torchrun`` is ``tests/scripts/test_demo_restarts.py``.
"""

import pathlib

import pytest
import torch
import torch.nn as nn

from torch_tp import demo
from torch_tp.checkpoint import save_training_state
from torch_tp.testing import RankFailure, run_on_ranks

STEPS = 8


def _job(*argv):
    return demo._run(demo._parse(list(argv)))


def _run(world_size, *argv):
    return run_on_ranks(_job, world_size, *argv)[0]


@pytest.fixture(scope="module")
def uninterrupted():
    """The 2-rank run that never stopped (no checkpoint directory at all)."""
    return _run(2, "--steps", str(STEPS))


def test_a_run_resumed_on_the_same_ranks_ends_with_the_same_parameters_bit_for_bit(uninterrupted, tmp_path):
    first = _run(2, "--steps", "4", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2")
    assert first["losses"] == uninterrupted["losses"][:4]  # checkpointing changes no number
    resumed = _run(2, "--steps", str(STEPS), "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2")
    assert resumed["first_step"] == 5 and resumed["losses"] == uninterrupted["losses"][4:]
    assert (resumed["final_loss"], resumed["sha256"]) == (uninterrupted["final_loss"], uninterrupted["sha256"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-0000000{n}" for n in (2, 4, 6, 8)]
    again = _run(2, "--steps", str(STEPS), "--checkpoint-dir", str(tmp_path))  # nothing left to train
    assert again["losses"] == [] and (again["final_loss"], again["sha256"]) == (resumed["final_loss"], resumed["sha256"])


@pytest.mark.parametrize("saved_on", [("2",), ("4", "--dp", "2")], ids=["tp2-tp4", "dp2xtp2-tp4"])
def test_a_run_resumed_on_another_mesh_continues_the_loss_curve(uninterrupted, saved_on, tmp_path):
    ranks, *layout = saved_on
    _run(int(ranks), *layout, "--steps", "4", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4")
    resumed = _run(4, "--steps", str(STEPS), "--checkpoint-dir", str(tmp_path))  # tp 4: the model the checkpoint pins
    assert resumed["first_step"] == 5
    torch.testing.assert_close(resumed["losses"], uninterrupted["losses"][4:], rtol=1e-5, atol=0)


def test_a_run_prints_each_checkpoint_and_keeps_its_newest_keep_never_deleting_one_it_did_not_save(tmp_path):
    first = _run(2, "--steps", "2", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1")
    assert first["checkpoints"] == [f"saved checkpoint {tmp_path / f'step-0000000{n}'} (step {n})" for n in (1, 2)]
    resumed = _run(2, "--steps", "5", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1")  # --keep 2
    assert resumed["first_step"] == 3
    assert resumed["checkpoints"] == [
        *(f"saved checkpoint {tmp_path / f'step-0000000{n}'} (step {n})" for n in (3, 4)),
        f"saved checkpoint {tmp_path / 'step-00000005'} (step 5)",
        f"deleted checkpoint {tmp_path / 'step-00000003'} (--keep 2: this run's newest 2 stay)",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-0000000{n}" for n in (1, 2, 4, 5)]  # 1, 2: the first run's


def test_keep_below_one_is_refused_with_the_option_named(capsys):
    with pytest.raises(SystemExit):
        demo._parse(["--keep", "0"])
    assert "--keep must be at least 1 (the checkpoint just saved), got 0" in capsys.readouterr().err


def _listing(directory):
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


def _refused(directory):
    try:
        _run(2, "--steps", "2", "--checkpoint-dir", str(directory))
    except RankFailure as failure:
        return str(failure).splitlines()[0]
    raise AssertionError("the demo accepted the directory")


def test_a_checkpoint_dir_that_is_a_file_or_holds_another_model_is_refused_and_left_unchanged(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    assert "CheckpointMismatchError: torch_tp.checkpoint: " in _refused(a_file)
    assert "notes.txt' is a file, not a checkpoint directory" in _refused(a_file)
    assert a_file.read_text() == "not a directory"

    other = tmp_path / "other"  # another program's checkpoint
    model = nn.Linear(4, 3)
    save_training_state(other, 3, model, torch.optim.AdamW(model.parameters()), extra={"epoch": 1})
    before = _listing(other)
    assert "is not a checkpoint of this demo (its saved values are ['epoch'])" in _refused(other)
    assert _listing(other) == before

    resized = tmp_path / "resized"  # the demo's format, another model size (one layer, not two)
    _run(2, "--steps", "2", "--checkpoint-dir", str(resized), "--checkpoint-every", "2")
    extra_args = dict(demo._model_args(2).__dict__, n_layers=1)
    model = demo.Transformer(demo.ModelArgs(**extra_args))
    save_training_state(resized, 3, model, torch.optim.AdamW(model.parameters()),
                        extra={"data_position": 3, "last_loss": 1.0, "model_args": dict(demo._model_args(2).__dict__),
                               "seq_len": 16, "layout": "1 ranks, dp 1 x tp 1"})
    before = _listing(resized)
    message = _refused(resized)
    assert "holds another model: the checkpoint's" not in message  # the model has more, not fewer, layers
    assert "the model's layers.1." in message and "not in the checkpoint" in message, message
    assert _listing(resized) == before
    assert sorted(p.name for p in pathlib.Path(resized).iterdir()) == ["step-00000002", "step-00000003"]
