"""``torch_tp.checkpoint.load`` reads only regular files inside the checkpoint directory.

The names of the data files come from the checkpoint's ``.metadata``, and plain ``dcp.load``
opens whatever those names lead to: a data file replaced by a symlink (to a file outside the
directory, or to another file inside it), a ``.metadata`` that is a symlink, or a folder entry
that is a symlink to a folder outside. ``load`` refuses every symlink under the directory, any
name that resolves outside it, and a file that is not a regular file (a FIFO as ``.metadata``
would block the read forever), with an error naming the file and what to do, before anything
is read, on every rank (2 and 4 ranks: each rank refuses, and no rank's state
changes). The directory itself may be reached through a symlink (a ``latest`` link to the
newest step): the user named it. A genuine checkpoint still loads bit for bit.
"""

import os
import pathlib
import pickle
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Shard, distribute_tensor

from torch_tp.checkpoint import SafeFileSystemReader, load, save
from torch_tp.testing import on_ranks, run_on_ranks, tp_mesh

DCP_SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
REFUSED = r"is a symlink .*refusing to read through it.*nothing was loaded"


def _saved(directory):
    """A one-process checkpoint of two tensors and a step count in ``directory``; what it holds."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.arange(3, dtype=torch.float64), "step": 7}
    save(state, directory)
    return state


def _fresh():
    return {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.float64), "step": 0}


def _data_file(directory):
    (name,) = [p.name for p in pathlib.Path(directory).iterdir() if p.suffix == ".distcp"]
    return pathlib.Path(directory) / name


def _point_metadata_at(directory, relative_path):
    """Rewrite ``.metadata`` so every item is stored at ``relative_path`` (offsets unchanged)."""
    path = pathlib.Path(directory) / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own genuine file
    for info in metadata.storage_data.values():
        info.relative_path = relative_path
    path.write_bytes(pickle.dumps(metadata))


def _link(tmp_path, case):
    """Build the checkpoint of ``case`` under ``tmp_path``; returns (directory, the link refused)."""
    checkpoint, outside = tmp_path / "checkpoint", tmp_path / "outside"
    _saved(checkpoint)
    outside.mkdir()
    data = _data_file(checkpoint)
    if case == "data file -> a file outside":
        target = outside / data.name
        shutil.move(data, target)  # a genuine copy: plain dcp.load reads it without complaint
        data.symlink_to(target)
        return checkpoint, data
    if case == "data file -> a file inside":
        target = checkpoint / "real.bin"
        shutil.move(data, target)
        data.symlink_to(target.name)  # relative, inside the directory: refused all the same
        return checkpoint, data
    if case == ".metadata -> a file outside":
        metadata = checkpoint / ".metadata"
        shutil.move(metadata, outside / ".metadata")
        metadata.symlink_to(outside / ".metadata")
        return checkpoint, metadata
    if case == "folder entry -> a folder outside":
        shutil.move(data, outside / data.name)
        (checkpoint / "shards").symlink_to(outside, target_is_directory=True)
        _point_metadata_at(checkpoint, f"shards/{data.name}")
        return checkpoint, checkpoint / "shards"
    raise AssertionError(case)


LINKS = ["data file -> a file outside", "data file -> a file inside", ".metadata -> a file outside",
         "folder entry -> a folder outside"]


@DCP_SINGLE_PROCESS
@pytest.mark.parametrize("case", LINKS)
def test_a_symlink_in_the_checkpoint_is_refused_naming_it_and_nothing_is_read(case, tmp_path):
    checkpoint, link = _link(tmp_path, case)
    state = _fresh()
    with pytest.raises(RuntimeError, match=re.escape(str(link)) + " " + REFUSED) as raised:
        load(state, checkpoint)
    assert "replace the link with a copy of the file" in str(raised.value)
    assert state["step"] == 0 and not state["w"].any() and not state["b"].any()  # nothing read
    # the reader alone refuses too, before reading a byte
    with pytest.raises(dcp.CheckpointException, match=re.escape(str(link))):
        dcp.load(_fresh(), storage_reader=SafeFileSystemReader(checkpoint), no_dist=True)


@DCP_SINGLE_PROCESS
@pytest.mark.parametrize("case, kind", [(".metadata", "a FIFO"), ("data file", "a directory")])
def test_a_checkpoint_file_that_is_not_a_regular_file_is_refused(case, kind, tmp_path):
    # a FIFO as .metadata would block the read forever
    _saved(tmp_path)
    path = tmp_path / ".metadata" if case == ".metadata" else _data_file(tmp_path)
    path.unlink()
    os.mkfifo(path) if kind == "a FIFO" else path.mkdir()
    state = _fresh()
    with pytest.raises(RuntimeError, match=re.escape(f"{path} is not a regular file ({kind}): refusing to read it")):
        load(state, tmp_path)
    assert state["step"] == 0 and not state["w"].any()


@DCP_SINGLE_PROCESS
def test_plain_dcp_load_reads_through_the_link(tmp_path):
    # the danger the refusal closes: DCP follows the link out of the directory
    checkpoint, _ = _link(tmp_path, "data file -> a file outside")
    state = _fresh()
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3))


@DCP_SINGLE_PROCESS
@pytest.mark.parametrize("name", ["../outside/__0_0.distcp", "/etc/passwd", "a/../../__0_0.distcp"])
def test_metadata_naming_a_path_outside_the_directory_is_refused(name, tmp_path):
    _saved(tmp_path)
    _point_metadata_at(tmp_path, name)
    state = _fresh()
    outside = f"stored at {name!r}, outside the checkpoint directory"
    with pytest.raises(pickle.UnpicklingError, match=re.escape(outside)):
        load(state, tmp_path)
    assert not state["w"].any()


@DCP_SINGLE_PROCESS
def test_a_genuine_checkpoint_loads_bit_for_bit_also_through_a_symlinked_directory(tmp_path):
    saved = _saved(tmp_path / "step-100")
    (tmp_path / "latest").symlink_to(tmp_path / "step-100", target_is_directory=True)
    for directory in (tmp_path / "step-100", tmp_path / "latest"):
        state = _fresh()
        load(state, directory)
        assert state["step"] == 7
        assert torch.equal(state["w"], saved["w"]) and torch.equal(state["b"], saved["b"])
        assert state["b"].dtype == torch.float64


# ------------------------------------------------------------------ several ranks


def _save_sharded(path):
    weight = torch.arange(24.0).reshape(8, 3)
    save({"w": distribute_tensor(weight, tp_mesh(), [Shard(0)]), "step": 3}, path)


@on_ranks(2, 4)
def test_on_every_rank_a_symlinked_data_file_is_refused_before_any_rank_reads(world_size, tmp_path):
    # the ranks save together, then the last rank's data file becomes a link to a copy outside
    _save_sharded(tmp_path / "checkpoint")
    torch.distributed.barrier()
    data = tmp_path / "checkpoint" / f"__{world_size - 1}_0.distcp"
    if torch.distributed.get_rank() == 0:
        (tmp_path / "outside").mkdir()
        shutil.move(data, tmp_path / "outside" / data.name)
        data.symlink_to(tmp_path / "outside" / data.name)
    torch.distributed.barrier()
    state = {"w": distribute_tensor(torch.zeros(8, 3), tp_mesh(), [Shard(0)]), "step": 0}
    with pytest.raises(RuntimeError, match=re.escape(str(data)) + " " + REFUSED):
        load(state, tmp_path / "checkpoint")
    # rank 0 reads only its own, genuine file; it read nothing either
    assert state["step"] == 0 and not state["w"].to_local().any()


def _load_sharded(path):
    state = {"w": distribute_tensor(torch.zeros(8, 3), tp_mesh(), [Shard(0)]), "step": 0}
    load(state, path)
    return state["w"].full_tensor(), state["step"]


@pytest.mark.parametrize("world_size", [2, 4], ids=["ws2", "ws4"])
def test_a_genuine_sharded_checkpoint_loads_bit_for_bit_on_every_rank(world_size, tmp_path):
    run_on_ranks(_save_sharded, world_size, tmp_path)
    assert not any(os.path.islink(p) for p in tmp_path.iterdir())
    for weight, step in run_on_ranks(_load_sharded, world_size, tmp_path):
        assert step == 3 and torch.equal(weight, torch.arange(24.0).reshape(8, 3))
