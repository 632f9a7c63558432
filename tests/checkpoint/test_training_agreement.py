"""Every decision about a training run's files is agreed by every rank before any rank acts on it.

- Loading: ranks whose newest complete checkpoints differ (node-local directories one step
  apart, each rank another path holding another save of the same step), a rank that sees none
  while the others see one, and a rank whose directory is a file make every rank raise
  ``CheckpointError`` at once (well inside the 60 s collective timeout), naming each rank's
  choice and telling the user to share one directory; nothing is loaded. Copies of one
  checkpoint at different paths agree, and load.
- Saving: a directory rank 0 cannot create (a path under a file), ranks passing their own
  paths and ranks passing different steps raise on every rank at once, and no complete
  checkpoint appears. The ranks then still save and load together (step 10**8 included).
- Step names: any non-negative int (``step-100000000`` past 8 digits), compared by value
  (``keep=`` prunes the lowest); a negative step, a bool or a float raises saying what to pass.
"""

import os
import re
import shutil
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torch_tp import ColwiseParallel, parallelize_module
from torch_tp.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    latest_checkpoint,
    load_training_state,
    read_extra,
    save_training_state,
)
from torch_tp.testing import full_tensor, on_ranks, rank, tp_mesh, world_size

#: an agreement answers at once: far below the harness's 60 s collective timeout
PROMPT = 10.0
SHARED = "pass one directory that every rank sees (a shared filesystem, the same path on every rank)"


def _tp_linear(seed):
    torch.manual_seed(seed)
    model = parallelize_module(nn.Linear(4, 8), tp_mesh(), ColwiseParallel())
    return model, torch.optim.AdamW(model.parameters())


def _whole(model):
    return {name: full_tensor(p.detach()).clone() for name, p in model.named_parameters()}


def _refused(call, error=CheckpointError):
    """The error ``call()`` raised on this rank, within ``PROMPT`` seconds."""
    started = time.monotonic()
    with pytest.raises(error) as raised:
        call()
    elapsed = time.monotonic() - started
    assert elapsed < PROMPT, f"rank {rank()} waited {elapsed:.1f} s"
    return str(raised.value)


def _view(tmp_path, case, sources):
    """This rank's own directory for ``case``, holding copies of ``sources`` (what its node sees)."""
    view = tmp_path / f"{case}-rank{rank()}"
    view.mkdir()
    for source in sources:
        shutil.copytree(source, view / source.name)
    return view


@on_ranks(2, 4)
def test_ranks_that_see_different_checkpoints_all_raise_at_once_naming_each_choice(tmp_path):
    r, n = rank(), world_size()
    saved, optimizer = _tp_linear(seed=0)
    shared, other = tmp_path / "shared", tmp_path / "other"
    for step in (3, 5):
        save_training_state(shared, step, saved, optimizer, extra={"step": step})
    save_training_state(other, 5, saved, optimizer)  # another save of step 5
    step3, step5 = shared / "step-00000003", shared / "step-00000005"
    model, fresh = _tp_linear(seed=1)
    untouched = _whole(model)
    views = {
        "one step behind": _view(tmp_path, "behind", [step3] if r % 2 == 0 else [step3, step5]),
        "none on the last rank": _view(tmp_path, "none", [] if r == n - 1 else [step5]),
        "another save of that step": shared if r == 0 else other,
    }
    for case, directory in views.items():
        message = _refused(lambda: load_training_state(directory, model, fresh))
        assert message.startswith("torch_tp.checkpoint.load_training_state: the ranks' newest complete checkpoints "
                                  "differ ["), (case, message)
        assert all(f"rank {i}: " in message for i in range(n)) and SHARED in message, (case, message)
        assert "nothing was loaded" in message, message
    assert re.search(r"rank 0: \S+step-00000003 .*rank 1: \S+step-00000005 ", message := _refused(
        lambda: read_extra(views["one step behind"]))), message
    assert message.startswith("torch_tp.checkpoint.read_extra: ")
    assert f"rank {n - 1}: no complete checkpoint in {tmp_path / f'none-rank{n - 1}'}]" in _refused(
        lambda: load_training_state(views["none on the last rank"], model, fresh))

    a_file = tmp_path / f"a-file-rank{r}"  # rank 0's directory is a file: its own error, the others name it
    if r == 0:
        a_file.write_text("")
    else:
        a_file.mkdir()
    message = _refused(lambda: load_training_state(a_file, model, fresh), CheckpointMismatchError if r == 0 else CheckpointError)
    assert ("is a file, not a checkpoint directory" if r == 0 else "another rank refused its arguments (rank 0: ") in message
    assert all(torch.equal(p, untouched[name]) for name, p in _whole(model).items()), "nothing is loaded"

    copies = _view(tmp_path, "copies", [step5])  # copies of one save at another path on each rank agree
    state = load_training_state(copies, model, fresh)
    assert state.step == 5 and state.extra == {"step": 5} and state.path == copies / "step-00000005"
    loaded, expected = _whole(model), _whole(saved)
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)


@on_ranks(2, 4)
def test_a_save_rank_0_cannot_write_or_ranks_do_not_share_raises_on_every_rank_at_once(tmp_path):
    r, n = rank(), world_size()
    model, optimizer = _tp_linear(seed=0)
    if r == 0:
        (tmp_path / "a-file").write_text("")
    dist.barrier()
    under_a_file = tmp_path / "a-file" / "ckpt"
    message = _refused(lambda: save_training_state(under_a_file, 1, model, optimizer))
    assert message.startswith("torch_tp.checkpoint.save_training_state: " + ("" if r == 0 else "another rank refused"))
    assert f"rank 0 cannot create {under_a_file / 'step-00000001.partial'} (NotADirectoryError" in message, message
    if os.geteuid() != 0:  # root writes a directory of mode 0o500 anyway
        read_only = tmp_path / "read-only"
        if r == 0:
            read_only.mkdir(mode=0o500)
        dist.barrier()
        assert "rank 0 cannot create" in _refused(lambda: save_training_state(read_only, 1, model, optimizer))

    own = tmp_path / f"own-rank{r}"  # each rank its own path: rank 0 creates the .partial only in its own
    message = _refused(lambda: save_training_state(own, 1, model, optimizer))
    assert message.startswith("torch_tp.checkpoint.save_training_state: the ranks' views of the new checkpoint's "
                              "directory differ [rank 0: "), message
    assert all(f"rank {i}: {tmp_path / f'own-rank{i}' / 'step-00000001.partial'} (not there)" in message
               for i in range(1, n)) and SHARED in message and "nothing was saved" in message, message

    shared = tmp_path / "shared"
    message = _refused(lambda: save_training_state(shared, 5 + r, model, optimizer))
    assert message.startswith("torch_tp.checkpoint.save_training_state: the ranks' steps differ "
                              f"[{', '.join(str(5 + i) for i in range(n))}]; pass the same step on every rank"), message
    assert latest_checkpoint(shared) is None and latest_checkpoint(own) is None  # no complete checkpoint anywhere

    path = save_training_state(shared, 10**8, model, optimizer)  # the ranks still save and load together
    assert path == shared / "step-100000000" and latest_checkpoint(shared) == path
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(".")) == [".metadata"]  # no marker left
    fresh_model, fresh = _tp_linear(seed=1)
    assert load_training_state(shared, fresh_model, fresh).step == 10**8


def _linear():
    model = nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters())


def test_steps_past_eight_digits_are_named_found_and_pruned_by_value(tmp_path):
    model, optimizer = _linear()
    (tmp_path / "step-000000009").mkdir()  # not a name save writes (9 digits, a leading zero): never loaded
    for step in (5, 99_999_999, 10**8, 10**9 + 7):
        save_training_state(tmp_path, step, model, optimizer, extra={"step": step}, keep=3)
    assert set(os.listdir(tmp_path)) == {"step-000000009", "step-99999999", "step-100000000", "step-1000000007"}
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1000000007"
    state = load_training_state(tmp_path, *_linear())
    assert state.step == 10**9 + 7 and state.extra == {"step": 10**9 + 7}
    assert save_training_state(tmp_path, torch.tensor(12), model, optimizer).name == "step-00000012"  # an int tensor


@pytest.mark.parametrize("step, error, expected", [
    (-1, ValueError, r"step=-1 is negative; pass the number of steps trained so far, 0 or more"),
    (True, TypeError, r"step=True \(bool\) is not an integer; pass the number of steps trained so far as an int"),
    (5.0, TypeError, r"step=5\.0 \(float\) is not an integer; pass .* as an int, 0 or more \(here step=5\)"),
    ("5", TypeError, r"step='5' \(str\) is not an integer"),
], ids=["negative", "bool", "float", "str"])
def test_a_step_that_is_not_a_non_negative_int_is_refused_and_nothing_is_written(step, error, expected, tmp_path):
    with pytest.raises(error, match=r"^torch_tp\.checkpoint\.save_training_state: " + expected):
        save_training_state(tmp_path / "ckpt", step, *_linear())
    assert not (tmp_path / "ckpt").exists()
