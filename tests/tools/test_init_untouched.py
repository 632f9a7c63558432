"""``init_parameters`` leaves every tensor no init function sets exactly as it was, and refuses
a tensor on the meta device that nothing sets, naming its path."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torch_tp import ColwiseParallel, init_parameters, parallelize_module
from torch_tp.tools import module_seed
from torch_tp.testing import full_tensor, run_on_ranks, tp_mesh, world_sizes


class Gain(nn.Module):
    """A module with no ``reset_parameters``: nothing initializes its tensors."""

    def __init__(self, n: int):
        super().__init__()
        self.gain = nn.Parameter(torch.arange(1.0, n + 1))
        self.register_buffer("offset", torch.full((n,), 0.5))

    def forward(self, x):
        return x * self.gain + self.offset


class CountingLinear(nn.Linear):
    """``nn.Linear`` whose ``reset_parameters`` ignores its ``calls`` buffer."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self.register_buffer("calls", torch.tensor([7.0]))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.norm = Gain(6)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(6, 3)


def _seeded_reset(module: nn.Module, path: str, seed: int) -> nn.Module:
    """What ``reset_parameters`` gives for ``module`` at ``path`` under ``init_parameters``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, path))
        module.reset_parameters()
    return module


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict(keep_vars=True).items()}


def test_module_without_reset_parameters_keeps_its_values():
    model = nn.Sequential(nn.Linear(4, 6), Gain(6))
    before = _snapshot(model)

    init_parameters(model, seed=3)

    assert torch.equal(model[1].gain, before["1.gain"])
    assert torch.equal(model[1].offset, before["1.offset"])
    reference = _seeded_reset(nn.Linear(4, 6), "0", seed=3)
    assert torch.equal(model[0].weight, reference.weight)
    assert torch.equal(model[0].bias, reference.bias)


def test_buffer_reset_parameters_ignores_keeps_its_value():
    model = nn.Sequential(CountingLinear(5, 3))
    init_parameters(model, seed=3)

    assert torch.equal(model[0].calls, torch.tensor([7.0]))
    reference = _seeded_reset(nn.Linear(5, 3), "0", seed=3)
    assert torch.equal(model[0].weight, reference.weight)
    assert torch.equal(model[0].bias, reference.bias)


def _zero_weight_in_place(module):
    if isinstance(module, nn.Linear):
        nn.init.zeros_(module.weight)


def _fill_weight_through_data(module):
    # the legacy style: writes through ``.data`` leave ``weight._version`` as it was
    if isinstance(module, nn.Linear):
        module.weight.data.fill_(0.0)


def _assign_weight_data(module):
    if isinstance(module, nn.Linear):
        module.weight.data = torch.zeros_like(module.weight)


@pytest.mark.parametrize("init_fn", [_zero_weight_in_place, _fill_weight_through_data, _assign_weight_data])
def test_init_fn_that_sets_only_weight_leaves_bias_alone(init_fn):
    model = nn.Sequential(nn.Linear(4, 6), Gain(6))
    before = _snapshot(model)
    weight = model[0].weight

    init_parameters(model, init_fn, seed=3)

    assert model[0].weight is weight
    assert torch.equal(model[0].weight, torch.zeros(6, 4))
    for name in ["0.bias", "1.gain", "1.offset"]:
        assert torch.equal(model.state_dict()[name], before[name]), name


class Replacing(nn.Module):
    """``reset_parameters`` assigns new objects instead of writing in place."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3, 2))
        self.register_buffer("table", torch.zeros(4))

    def reset_parameters(self):
        self.weight = nn.Parameter(torch.full((3, 2), 2.0))
        self.table = torch.arange(4.0)


def test_reset_parameters_that_replaces_the_parameter_counts_as_setting_it():
    model = nn.Sequential(Replacing())
    weight, table = model[0].weight, model[0].table

    init_parameters(model)

    assert model[0].weight is weight and model[0].table is table  # filled in place, not replaced
    assert torch.equal(weight, torch.full((3, 2), 2.0))
    assert torch.equal(table, torch.arange(4.0))


def test_meta_tensor_nobody_sets_raises_naming_its_path_and_the_fix():
    with torch.device("meta"):
        model = Stack()

    with pytest.raises(ValueError) as raised:
        init_parameters(model)

    message = str(raised.value)
    for path in ["layers.0.norm.gain", "layers.0.norm.offset", "layers.1.norm.gain", "layers.1.norm.offset"]:
        assert path in message, path
    assert "proj" not in message and "out." not in message  # reset_parameters sets those
    for fix in ["reset_parameters", "init_fn", "to_empty"]:
        assert fix in message, fix


def test_meta_error_is_raised_before_anything_is_written():
    model = Stack()
    with torch.device("meta"):
        model.layers[1].norm = Gain(6)
    before = _snapshot(model)

    with pytest.raises(ValueError, match=r"layers\.1\.norm\.gain, layers\.1\.norm\.offset"):
        init_parameters(model, seed=3)

    for name, value in _snapshot(model).items():
        if not value.is_meta:
            assert torch.equal(value, before[name]), name


def _set_everything(module):
    if isinstance(module, Gain):
        nn.init.ones_(module.gain)
        nn.init.zeros_(module.offset)
    else:
        module.reset_parameters()


def test_meta_model_with_an_init_fn_that_sets_every_tensor_materializes():
    with torch.device("meta"):
        model = Stack()
    model.to_empty(device="cpu")
    init_parameters(model, _set_everything, seed=1)

    assert torch.equal(model.layers[0].norm.gain, torch.ones(6))
    assert torch.equal(model.layers[1].norm.offset, torch.zeros(6))
    reference = _seeded_reset(nn.Linear(6, 3), "out", seed=1)
    assert torch.equal(model.out.weight, reference.weight)


def _sharded_model() -> nn.Module:
    # 10 rows: uneven on 4 ranks (3, 3, 3, 1)
    model = nn.Sequential(nn.Linear(4, 10), Gain(10), CountingLinear(10, 3))
    parallelize_module(model, tp_mesh(), {"0": ColwiseParallel()})
    gain = model[1].gain
    model[1].gain = nn.Parameter(distribute_tensor(gain.detach(), tp_mesh(), [Shard(0)]))
    return model


def _init_sharded(seed):
    model = _sharded_model()
    gain_before = model[1].gain.full_tensor()
    init_parameters(model, seed=seed)

    assert isinstance(model[0].weight, DTensor) and isinstance(model[1].gain, DTensor)
    return gain_before, {name: full_tensor(t).detach().clone() for name, t in model.state_dict(keep_vars=True).items()}


def _refuse_meta_sharded():
    with torch.device("meta"):
        model = _sharded_model()
    assert model[1].gain.is_meta
    try:
        init_parameters(model)
    except ValueError as err:
        return str(err)
    return None


@world_sizes(2, 4)
def test_sharded_module_without_reset_parameters_keeps_its_shards(world_size):
    reference = nn.Sequential(nn.Linear(4, 10), Gain(10), CountingLinear(10, 3))
    expected = {name: t.detach().clone() for name, t in reference.state_dict().items()}
    init_parameters(reference, seed=11)
    assert torch.equal(reference[1].gain, expected["1.gain"])
    assert torch.equal(reference[1].offset, expected["1.offset"])
    assert torch.equal(reference[2].calls, expected["2.calls"])

    for gain_before, after in run_on_ranks(_init_sharded, world_size, 11):
        assert torch.equal(gain_before, expected["1.gain"])
        for name, value in reference.state_dict().items():
            assert torch.equal(after[name], value), name


@world_sizes(2, 4)
def test_sharded_meta_tensor_nobody_sets_raises_naming_its_path(world_size):
    for message in run_on_ranks(_refuse_meta_sharded, world_size):
        assert message is not None and "1.gain, 1.offset" in message
        assert "0.weight" not in message and "2.calls" in message
