"""``torch_tp.checkpoint.load`` loads genuine DCP checkpoints and never runs a tampered pickle.

- Genuine checkpoints round-trip exactly: tensors of many dtypes and memory formats, an int8
  weight, Python values (ints, floats, strings, ``None``, bytes, tuples, lists, nested dicts)
  in one process; on 2 gloo ranks a tensor-parallel MLP with its AdamW state
  (``get_state_dict`` / ``set_state_dict``: step counts, moments, hyperparameters) and a
  quantized, tensor-parallel Llama; float and int8 Llamas saved on 2 ranks and loaded on 4, and
  the reverse, equal the one-process model bit for bit. Every value loaded into differs before
  the load.
- A ``.metadata`` whose pickle calls ``exec``, ``os.system`` or ``pathlib.Path.write_text``
  (to write a marker file) raises ``pickle.UnpicklingError`` naming the global, and the marker
  is not written; plain ``dcp.load`` of the same file writes it. The same for a non-tensor
  value in a data file, also when only ``SafeFileSystemReader`` is given to ``dcp.load``.
- Truncated, corrupted or missing files raise errors naming the file, on every rank.
"""

import builtins
import io
import os
import pathlib
import pickle
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp.checkpoint import SafeFileSystemReader, load, save
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.quant import Int8SymmetricTensor
from torch_tp.testing import on_ranks, quantize_weights, rank, run_on_ranks, small_llama, tp_mesh

DCP_SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# ------------------------------------------------------------------ helpers


def _plain(value):
    """A comparable form: DTensors gathered, int8 weights as (qdata, scale, dtype)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, Int8SymmetricTensor):
        return ("int8", value.qdata, value.scale, value.dtype)
    if isinstance(value, dict):
        return {key: _plain(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value.detach() if isinstance(value, torch.Tensor) else value


def _assert_identical(got, expected, where="state"):
    assert type(got) is type(expected), f"{where}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            _assert_identical(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            _assert_identical(g, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert got.stride() == expected.stride(), f"{where}: strides {got.stride()} != {expected.stride()}"
        assert torch.equal(_bits(got), _bits(expected)), where
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def _bits(tensor):
    """Bitwise-comparable (torch.equal has no float8 kernel)."""
    return tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor


class _Call:
    """Pickles as ``function(*args)``: what a tampered pickle runs on load."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def _payloads(marker):
    """(pickled call that writes ``marker``, the global it names)."""
    return {
        "exec": (_Call(builtins.exec, f"open({str(marker)!r}, 'w').write('ran')"), "builtins.exec"),
        "os.system": (_Call(os.system, f"touch '{marker}'"), f"{os.system.__module__}.system"),
        # a module the allowlist knows (pathlib.PosixPath), a name it does not
        "Path.write_text": (_Call(pathlib.Path.write_text, pathlib.Path(marker), "ran"), "pathlib.Path.write_text"),
    }


def _tamper_metadata(directory, payload):
    path = pathlib.Path(directory) / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own genuine file
    metadata.storage_meta.save_id = payload  # read by nothing on load: plain dcp.load succeeds
    path.write_bytes(pickle.dumps(metadata))


def _item(directory, fqn):
    """(data file, offset, length) of the saved value ``fqn``."""
    metadata = pickle.loads((pathlib.Path(directory) / ".metadata").read_bytes())
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
    return pathlib.Path(directory) / info.relative_path, info.offset, info.length


# ------------------------------------------------------------------ genuine checkpoints, one process


def _one_process_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "float32": torch.randn(3, 5, generator=g),
        "float64": torch.randn(4, generator=g, dtype=torch.float64),
        "bfloat16": torch.randn(2, 3, generator=g).bfloat16(),
        "float16": torch.randn(5, generator=g).half(),
        "float8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "complex64": torch.randn(3, generator=g, dtype=torch.complex64),
        "int64": torch.randint(-9, 9, (4,), generator=g),
        "uint8": torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8),
        "bool": torch.randint(0, 2, (5,), generator=g).bool(),
        "scalar": torch.randn((), generator=g),
        "channels_last": torch.randn(1, 2, 3, 3, generator=g).contiguous(memory_format=torch.channels_last),
        "int8_weight": Int8SymmetricTensor.from_hp(torch.randn(6, 4, generator=g)),
        "trainer": {
            "step": seed + 7,
            "lr": 0.1 * (seed + 1),
            "name": f"run-{seed}",
            "resumed": bool(seed),
            "last_error": None if seed else "none",
            "digest": bytes([seed, 1, 2]),
            "betas": (0.9, 0.95 + seed / 100),
            "history": [seed, 2.5, "x", {"deep": seed}],
            "buffers": [torch.full((2,), float(seed)), seed],
        },
    }


@DCP_SINGLE_PROCESS
def test_genuine_checkpoint_of_tensors_int8_and_python_values_round_trips_exactly(tmp_path):
    saved = _one_process_state(0)
    save(saved, tmp_path)
    state = _one_process_state(1)
    assert not torch.equal(state["float32"], saved["float32"])  # the load has to overwrite them
    assert not torch.equal(state["int8_weight"].qdata, saved["int8_weight"].qdata)
    load(state, tmp_path)
    _assert_identical(_plain(state), _plain(saved))
    assert isinstance(state["int8_weight"], Int8SymmetricTensor)

    # the same checkpoint through plain dcp.load gives the same values
    plain = _one_process_state(1)
    dcp.load(plain, checkpoint_id=tmp_path, no_dist=True)
    _assert_identical(_plain(plain), _plain(state))


@DCP_SINGLE_PROCESS
def test_safe_reader_is_a_drop_in_storage_reader_for_dcp_load(tmp_path):
    save({"w": torch.arange(6.0), "epoch": 3}, tmp_path)
    state = {"w": torch.zeros(6), "epoch": 0}
    dcp.load(state, storage_reader=SafeFileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(state["w"], torch.arange(6.0)) and state["epoch"] == 3


# ------------------------------------------------------------------ genuine checkpoints, 2 ranks


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 12), nn.Linear(12, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _trained_tp_mlp(seed, lr, steps):
    torch.manual_seed(seed)
    model = parallelize_module(_MLP(), tp_mesh(), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.9))
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@on_ranks(2)
def test_tensor_parallel_model_and_adamw_state_round_trip_on_2_ranks(tmp_path):
    model, optimizer = _trained_tp_mlp(seed=0, lr=0.05, steps=2)
    model_state, optim_state = get_state_dict(model, optimizer)
    save({"model": model_state, "optim": optim_state, "trainer": {"epoch": 4, "losses": [0.5, 0.25]}}, tmp_path)

    fresh, fresh_optimizer = _trained_tp_mlp(seed=1, lr=0.5, steps=1)
    fresh_model_state, fresh_optim_state = get_state_dict(fresh, fresh_optimizer)
    up = fresh_model_state["up.weight"]
    assert isinstance(up, DTensor) and up.placements == (Shard(0),) and up.to_local().shape == (6, 8)
    assert not torch.equal(up.full_tensor(), model_state["up.weight"].full_tensor())
    assert fresh_optim_state["state"]["up.weight"]["step"].item() == 1
    state = {"model": fresh_model_state, "optim": fresh_optim_state, "trainer": {"epoch": 0, "losses": []}}
    load(state, tmp_path)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    _assert_identical(_plain(get_state_dict(fresh, fresh_optimizer)), _plain((model_state, optim_state)))
    assert fresh_optimizer.state_dict()["state"][0]["step"].item() == 2
    assert fresh_optimizer.param_groups[0]["lr"] == 0.05 and fresh_optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    assert state["trainer"] == {"epoch": 4, "losses": [0.5, 0.25]}
    # both continue identically
    torch.manual_seed(5 + rank())
    x = torch.randn(4, 8)
    for m, opt in ((model, optimizer), (fresh, fresh_optimizer)):
        m(x).square().mean().backward()
        opt.step()
    _assert_identical(_plain(dict(fresh.named_parameters())), _plain(dict(model.named_parameters())))


def _quantized_tp_llama(seed):
    model = quantize_weights(small_llama(seed=seed, n_layers=1))
    return parallelize_module(model, tp_mesh(), tensor_parallel_plan())


@on_ranks(2)
def test_quantized_tensor_parallel_llama_round_trips_bit_for_bit_on_2_ranks(tmp_path):
    model = _quantized_tp_llama(seed=0)
    assert isinstance(model.output.weight.to_local(), Int8SymmetricTensor)
    save(model.state_dict(), tmp_path)

    fresh = _quantized_tp_llama(seed=1)
    assert not torch.equal(fresh.output.weight.full_tensor().qdata, model.output.weight.full_tensor().qdata)
    load(fresh.state_dict(), tmp_path)  # in place
    _assert_identical(_plain(fresh.state_dict()), _plain(model.state_dict()))
    assert isinstance(fresh.output.weight.to_local(), Int8SymmetricTensor)
    tokens = torch.arange(16).reshape(2, 8) % 64
    with torch.no_grad():
        assert torch.equal(fresh(tokens), model(tokens))


def _llama_on_ranks(seed, quantized):
    model = small_llama(seed=seed, n_layers=1)
    model = quantize_weights(model) if quantized else model
    return parallelize_module(model, tp_mesh(), tensor_parallel_plan())


def _save_llama(path, quantized):
    save(_llama_on_ranks(0, quantized).state_dict(), path)


def _load_llama(path, quantized):
    fresh = _llama_on_ranks(1, quantized)
    state = fresh.state_dict()
    load(state, path)  # in place, into this world size's shards
    return _plain(state)


def _single_process_state(seed, quantized):
    model = small_llama(seed=seed, n_layers=1)
    return _plain((quantize_weights(model) if quantized else model).state_dict())


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("save_ranks, load_ranks", [(2, 4), (4, 2)], ids=["2to4", "4to2"])
def test_resharding_through_torch_tp_checkpoint_is_bit_exact(save_ranks, load_ranks, quantized, tmp_path):
    run_on_ranks(_save_llama, save_ranks, str(tmp_path), quantized)
    loaded = run_on_ranks(_load_llama, load_ranks, str(tmp_path), quantized)
    expected, before = _single_process_state(0, quantized), _single_process_state(1, quantized)
    weight = (lambda v: v[1]) if quantized else (lambda v: v)  # int8: compare the qdata
    assert not torch.equal(weight(expected["output.weight"]), weight(before["output.weight"]))  # the load overwrites
    for state in loaded:
        _assert_identical(state, expected)  # every rank: the one-process model, bit for bit


# ------------------------------------------------------------------ tampered pickles


@DCP_SINGLE_PROCESS
@pytest.mark.parametrize("call", ["exec", "os.system", "Path.write_text"])
def test_tampered_metadata_is_refused_naming_the_global_and_never_runs(call, tmp_path):
    checkpoint, marker = tmp_path / "checkpoint", tmp_path / "marker"
    save({"w": torch.arange(3.0), "step": 2}, checkpoint)
    payload, name = _payloads(marker)[call]
    _tamper_metadata(checkpoint, payload)

    state = {"w": torch.zeros(3), "step": 0}
    refusal = f"{checkpoint / '.metadata'}: refusing to load the global {name}"
    with pytest.raises(pickle.UnpicklingError, match=re.escape(refusal)):
        load(state, checkpoint)
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match=re.escape(name)):
        SafeFileSystemReader(checkpoint).read_metadata()
    assert not marker.exists() and torch.equal(state["w"], torch.zeros(3))

    # the danger: plain dcp.load runs the call, and then loads as if nothing happened
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    assert marker.exists()
    assert torch.equal(state["w"], torch.arange(3.0))


@DCP_SINGLE_PROCESS
def test_a_refused_metadata_is_not_replaced_by_a_rank_local_one(tmp_path):
    save({"w": torch.arange(3.0)}, tmp_path)
    shutil.copy(tmp_path / ".metadata", tmp_path / "__0.metadata")  # genuine
    _tamper_metadata(tmp_path, _payloads(tmp_path / "marker")["exec"][0])
    with pytest.raises(pickle.UnpicklingError, match=r"\.metadata: refusing to load the global builtins\.exec"):
        load({"w": torch.zeros(3)}, tmp_path)
    assert not (tmp_path / "marker").exists()


@DCP_SINGLE_PROCESS
def test_tampered_non_tensor_value_is_refused_naming_the_global_and_never_runs(tmp_path):
    checkpoint, marker = tmp_path / "checkpoint", tmp_path / "marker"
    payload, name = _payloads(marker)["exec"]
    # dcp.save pickles non-tensor values into the data file (torch.save): nothing runs yet
    save({"w": torch.arange(3.0), "config": payload}, checkpoint)
    assert not marker.exists()
    data_file = checkpoint / "__0_0.distcp"

    refusal = f"{data_file}: refusing to unpickle the value of 'config': it names the global {name}"
    with pytest.raises(pickle.UnpicklingError, match=re.escape(refusal)):
        load({"w": torch.zeros(3), "config": None}, checkpoint)
    assert not marker.exists()
    # the reader alone protects dcp.load's default planner, which unpickles with weights_only=False
    with pytest.raises(dcp.CheckpointException, match=re.escape(name)):
        dcp.load({"w": torch.zeros(3), "config": None}, storage_reader=SafeFileSystemReader(checkpoint), no_dist=True)
    assert not marker.exists()

    dcp.load({"w": torch.zeros(3), "config": None}, checkpoint_id=checkpoint, no_dist=True)
    assert marker.exists()


@DCP_SINGLE_PROCESS
def test_tensor_item_whose_pickle_names_a_global_is_refused_naming_it(tmp_path):
    # DCP itself reads tensors with weights_only=True: safe, and load names the global
    save({"w": torch.arange(3.0)}, tmp_path)
    data_file, _, _ = _item(tmp_path, "w")
    payload = io.BytesIO()
    torch.save(_payloads(tmp_path / "marker")["exec"][0], payload)
    offset = data_file.stat().st_size
    data_file.write_bytes(data_file.read_bytes() + payload.getvalue())
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    info = next(iter(metadata.storage_data.values()))
    info.offset, info.length = offset, len(payload.getvalue())
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))

    refusal = f"{data_file}: reading the item at offset {offset} failed: it names the global builtins.exec"
    with pytest.raises(pickle.UnpicklingError, match=re.escape(refusal)):
        load({"w": torch.zeros(3)}, tmp_path)
    with pytest.raises(dcp.CheckpointException, match="GLOBAL exec was not an allowed global"):
        dcp.load({"w": torch.zeros(3)}, checkpoint_id=tmp_path, no_dist=True)
    assert not (tmp_path / "marker").exists()


# ------------------------------------------------------------------ damaged files


def _metadata_damages():
    return {
        "truncated": lambda data: data[: len(data) // 2],
        "empty": lambda data: b"",
        "garbage": lambda data: bytes(range(256)) * 4,
        "not metadata": lambda data: pickle.dumps({"state_dict_metadata": {}}),
    }


@DCP_SINGLE_PROCESS
@pytest.mark.parametrize("damage, message", [
    ("truncated", r"is truncated or corrupted \("),
    ("empty", r"is truncated or corrupted \("),
    ("garbage", r"(is truncated or corrupted|refusing to load the global)"),
    ("not metadata", r"holds a dict, not a torch\.distributed\.checkpoint Metadata"),
])
def test_damaged_metadata_raises_naming_the_file(damage, message, tmp_path):
    save({"w": torch.arange(3.0)}, tmp_path)
    path = tmp_path / ".metadata"
    path.write_bytes(_metadata_damages()[damage](path.read_bytes()))
    with pytest.raises(pickle.UnpicklingError, match=re.escape(str(path)) + r":? " + message):
        load({"w": torch.zeros(3)}, tmp_path)


@DCP_SINGLE_PROCESS
def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    save({"w": torch.arange(3.0)}, tmp_path)
    path = tmp_path / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    next(iter(metadata.storage_data.values())).relative_path = "../elsewhere/__0_0.distcp"
    path.write_bytes(pickle.dumps(metadata))
    outside = r"stored at '\.\./elsewhere/__0_0\.distcp', outside the checkpoint directory"
    with pytest.raises(pickle.UnpicklingError, match=outside):
        load({"w": torch.zeros(3)}, tmp_path)


@DCP_SINGLE_PROCESS
def test_missing_checkpoint_raises_naming_the_metadata_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'nothing' / '.metadata'} does not exist")):
        load({"w": torch.zeros(3)}, tmp_path / "nothing")


@DCP_SINGLE_PROCESS
@pytest.mark.parametrize("damage", ["truncated", "tensor header zeroed", "tensor cut", "value zeroed", "missing"])
def test_damaged_data_file_raises_naming_the_file(damage, tmp_path):
    save({"a": torch.arange(4.0), "b": torch.arange(5.0), "step": 3}, tmp_path)
    data_file, offset, length = _item(tmp_path, "b" if damage != "value zeroed" else "step")
    data = bytearray(data_file.read_bytes())
    expected = {
        "truncated": (RuntimeError, r" is truncated: it has \d+ bytes, but the checkpoint's \.metadata stores "
                                    r"'(a|b|step)' up to byte \d+"),
        "tensor header zeroed": (pickle.UnpicklingError, r": reading the item at offset \d+ failed: .*corrupted"),
        "tensor cut": (RuntimeError, r": reading the item at offset \d+ failed \(RuntimeError: PytorchStreamReader"),
        "value zeroed": (pickle.UnpicklingError, r": refusing to unpickle the value of 'step': .*corrupted"),
        "missing": (FileNotFoundError, r" does not exist, but the checkpoint's \.metadata stores"),
    }[damage]
    if damage == "truncated":
        del data[-10:]
    elif damage == "missing":
        data_file.unlink()
    elif damage == "tensor cut":  # the zip's directory at its end
        data[offset + length - 64 : offset + length] = bytes(64)
    else:
        data[offset : offset + 64] = bytes(64)
    if damage != "missing":
        data_file.write_bytes(bytes(data))

    state = {"a": torch.zeros(4), "b": torch.zeros(5), "step": 0}
    with pytest.raises(expected[0], match=re.escape(str(data_file)) + expected[1]):
        load(state, tmp_path)


def _save_sharded(path):
    save({"w": distribute_tensor(torch.arange(8.0).reshape(4, 2), tp_mesh(), [Shard(0)]), "step": 3}, path)


def _load_sharded(path):
    state = {"w": distribute_tensor(torch.zeros(4, 2), tp_mesh(), [Shard(0)]), "step": 0}
    try:
        load(state, path)
    except pickle.UnpicklingError as error:
        return "UnpicklingError", str(error)
    except RuntimeError as error:
        return "RuntimeError", str(error)
    return None


@pytest.mark.parametrize("damage", ["rank 1's data file truncated", "metadata tampered"])
def test_on_2_ranks_every_rank_raises_the_error_naming_the_file(damage, tmp_path):
    run_on_ranks(_save_sharded, 2, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    if damage == "metadata tampered":
        _tamper_metadata(tmp_path, _payloads(tmp_path / "marker")["exec"][0])
        refusal = f"{tmp_path / '.metadata'}: refusing to load the global builtins.exec"
        expected = [("UnpicklingError", f"rank {r}: {refusal}") for r in (0, 1)]
    else:
        data_file = tmp_path / "__1_0.distcp"
        data_file.write_bytes(data_file.read_bytes()[:-10])
        expected = [("RuntimeError", f"rank 1: {data_file} is truncated")] * 2  # rank 0 raises rank 1's error
    for (kind, message), got in zip(expected, run_on_ranks(_load_sharded, 2, tmp_path)):
        assert got is not None and got[0] == kind and got[1].startswith(message), got
    assert not (tmp_path / "marker").exists()
