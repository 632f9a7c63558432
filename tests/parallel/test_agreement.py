"""Bad input fails fast, with a named error on every rank: ranks that disagree, ranks outside the
mesh, wrong argument types and ranges, shards that would cut a head, plan keys that match nothing."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp.models.llama import Attention, ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import rank, run_on_ranks, tp_mesh, world_size, world_sizes


def _error_of(call):
    try:
        call()
    except (TypeError, ValueError) as err:
        return type(err).__name__, str(err)
    return None


def _ranks_build_different_widths():
    width = 16 if rank() == world_size() - 1 else 8  # the last rank's config differs
    model = nn.Sequential(nn.Linear(8, width), nn.Linear(width, 8))
    error = _error_of(lambda: parallelize_module(model, tp_mesh(), {"0": ColwiseParallel(), "1": RowwiseParallel()}))
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    return error


@world_sizes(2, 4)
def test_ranks_that_build_different_models_all_raise_naming_the_parameter_and_the_ranks(world_size):
    errors = run_on_ranks(_ranks_build_different_widths, world_size, timeout=60)
    by_rank = ", ".join(["(8, 8) torch.float32"] * (world_size - 1) + ["(16, 8) torch.float32"])
    for kind, message in errors:  # the values are listed in rank order: the last rank's differs
        assert kind == "ValueError", message
        assert f"parallelize_module: the ranks' models hold parameter '0.weight' as [{by_rank}]; " in message
        assert "build the same model (same config) with the same plan on every rank" in message


def _last_rank_builds_an_extra_layer():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3 if rank() == world_size() - 1 else 2)])
    error = _error_of(lambda: parallelize_module(model, tp_mesh(), {"0": ColwiseParallel()}))
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    return error


def test_a_parameter_only_one_rank_has_is_named_as_missing_on_the_others():
    for kind, message in run_on_ranks(_last_rank_builds_an_extra_layer, 2, timeout=60):
        assert kind == "ValueError", message
        assert "the ranks' models hold parameter '2.weight' as [<missing>, (8, 8) torch.float32]; build" in message


def _one_rank_fails_its_check():
    rows = 1 if rank() == 1 else 8  # rank 1's layer is too small to shard: only it fails the check
    model = nn.Sequential(nn.Linear(8, rows))
    return _error_of(lambda: parallelize_module(model, tp_mesh(), {"0": ColwiseParallel()}))


def test_a_check_failing_on_one_rank_raises_on_every_rank():
    errors = run_on_ranks(_one_rank_fails_its_check, 2, timeout=60)
    assert errors[1][0] == "ValueError" and "smaller than the 2 ranks" in errors[1][1]
    assert errors[0][0] == "ValueError"
    assert "parallelize_module: another rank refused its arguments (rank 1: ValueError: " in errors[0][1]
    assert "smaller than the 2 ranks" in errors[0][1] and "fix the call on the rank named" in errors[0][1]


def _outside_the_mesh():
    mesh = DeviceMesh("cpu", [0, 1])  # every rank builds it; ranks 2 and 3 are not in it
    model = nn.Sequential(nn.Linear(8, 8))
    error = _error_of(lambda: parallelize_module(model, mesh, {"0": ColwiseParallel()}))
    return error, isinstance(model[0].weight, DTensor)


def test_a_rank_outside_the_mesh_raises_and_the_mesh_ranks_parallelize():
    results = run_on_ranks(_outside_the_mesh, 4, timeout=60)
    for r in (0, 1):
        assert results[r] == (None, True)
    for r in (2, 3):
        (kind, message), sharded = results[r]
        assert kind == "ValueError" and f"global rank {r}) is not in the mesh [0, 1]" in message and not sharded


def _argument_errors():
    errors = {}
    model = nn.Sequential(nn.Linear(8, 8))
    errors["src_data_rank"] = _error_of(lambda: parallelize_module(model, tp_mesh(), {"0": ColwiseParallel()}, src_data_rank=2))
    errors["replicate flag"] = _error_of(
        lambda: parallelize_module(model, tp_mesh(), {"0": ColwiseParallel()}, replicate_unplanned_params="yes")
    )
    three_heads = Transformer(ModelArgs(dim=24, n_layers=1, n_heads=3, vocab_size=32, ffn_hidden=32))
    errors["heads"] = _error_of(lambda: parallelize_module(three_heads, tp_mesh(), tensor_parallel_plan()))
    errors["keys"] = _error_of(lambda: parallelize_module(
        three_heads, tp_mesh(), {"layers.*.attn": ColwiseParallel(), "layers.*.attention.wq.weight": ColwiseParallel()}
    ))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unchanged = parallelize_module(model, tp_mesh()) is model
    empty_plan = parallelize_module(model, tp_mesh(), {}) is model
    errors["no plan"] = (unchanged, empty_plan, [str(w.message) for w in caught])
    assert not any(isinstance(p, DTensor) for p in [*model.parameters(), *three_heads.parameters()])
    return errors


def test_bad_arguments_raise_named_errors_on_every_rank():
    for errors in run_on_ranks(_argument_errors, 2, timeout=60):
        kind, message = errors["src_data_rank"]
        assert kind == "ValueError" and "src_data_rank=2" in message and "[0, 2)" in message
        kind, message = errors["replicate flag"]
        assert kind == "TypeError" and "replicate_unplanned_params" in message
        kind, message = errors["heads"]
        assert kind == "ValueError" and "Attention ('layers.0.attention')" in message
        assert "units of 8 elements in 'wq.weight'" in message and "(3 units) as [12, 12]" in message
        kind, message = errors["keys"]
        assert "2 plan keys match no module" in message and "'layers.*.attn' matched no submodule" in message
        assert "'layers.*.attention.wq.weight' names a parameter" in message
        unchanged, empty_plan, warned = errors["no plan"]
        assert unchanged and empty_plan and any("no parallelize_plan" in w for w in warned)


def test_a_mesh_that_is_not_a_device_mesh_raises_type_error():
    with pytest.raises(TypeError, match=r"needs a DeviceMesh .* got int 2"):
        parallelize_module(nn.Linear(4, 4), 2, ColwiseParallel())


def test_boolean_style_arguments_must_be_bool():
    with pytest.raises(TypeError, match=r"ColwiseParallel\(use_local_output=...\) takes True or False"):
        ColwiseParallel(use_local_output="no")


def test_attention_declares_its_heads_as_whole_units():
    attention = Attention(ModelArgs(dim=24, n_heads=3))
    assert attention.tensor_parallel_units["wq.weight"] == 8


class _ScaledNorm(nn.Module):
    """A norm whose forward uses a plain buffer: under SequenceParallel it meets DTensors."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        return x * self.weight * self.scale


def _plain_buffer_in_forward():
    from torch_tp import SequenceParallel

    model = nn.Sequential(_ScaledNorm())
    parallelize_module(model, tp_mesh(), {"0": SequenceParallel()})
    return _error_of_runtime(lambda: model(torch.randn(2, 4, 8)))


def _error_of_runtime(call):
    try:
        call()
    except RuntimeError as err:
        return str(err)
    return None


def test_a_plain_buffer_met_by_a_dtensor_names_the_module_and_the_buffer():
    message = run_on_ranks(_plain_buffer_in_forward, 2)[0]
    assert "SequenceParallel on '0' (_ScaledNorm)" in message and "['scale']" in message


@pytest.mark.parametrize("config, device", [
    ("cpu:gloo,cuda:gloo", torch.device("cpu")),          # gloo
    ("cpu:gloo,cuda:nccl", torch.device("cpu")),          # torch's default on a GPU machine: host memory, no GPU wait
    ("cuda:nccl", torch.device("cuda", 3)),               # NCCL alone: the rank's own GPU, never cuda:0 or the CPU
])
def test_the_digest_travels_on_the_groups_own_device_whatever_the_data(monkeypatch, config, device):
    from torch_tp import _agreement

    monkeypatch.setattr(_agreement.dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _agreement.digest_device(object()) == device


def _uneven_strips_of_a_plain_sequence():
    from torch_tp import SequenceParallel

    norm = parallelize_module(nn.LayerNorm(4), tp_mesh(), SequenceParallel())
    whole = torch.randn(2, 2 * world_size() + 1, 4)  # a length the ranks do not divide
    strip = whole.tensor_split(world_size(), dim=1)[rank()]  # 3, 2 (, 2, 2) tokens
    return _error_of(lambda: norm(strip))


@world_sizes(2, 4)
def test_uneven_plain_strips_are_refused_on_every_rank_saying_to_pad_or_pass_a_dtensor(world_size):
    for kind, message in run_on_ranks(_uneven_strips_of_a_plain_sequence, world_size, timeout=60):
        assert kind == "ValueError", message
        assert "SequenceParallel" in message and "inputs, as one sharded tensor, have different shapes" in message
        assert f"pad dim 1 to a multiple of {world_size}, or pass a DTensor" in message, message
