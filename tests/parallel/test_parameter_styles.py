"""Plan keys that name a parameter: ``ShardParameter`` on 3-D expert-style weights, checked, explained
and applied like module entries, matching the single-process module."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from torch_tp import PrepareModuleInput, ShardParameter, explain_plan, parallelize_module
from torch_tp.parallel.plan import resolve_plan
from torch_tp.testing import TOL, assert_params_and_grads_match, on_ranks, tp_mesh


class Experts(nn.Module):
    """Grouped expert weights as 3-D parameters, like transformers' MoE experts (every token
    through every expert here: the routing is the MoE styles' business, not the plan's)."""

    def __init__(self, experts=4, hidden=8, inner=6):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(experts, inner, hidden) / hidden**0.5)
        self.up_proj = nn.Parameter(torch.randn(experts, inner, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner) / inner**0.5)

    def forward(self, x):
        gate = torch.einsum("th,eih->tei", x, self.gate_proj)
        up = torch.einsum("th,eih->tei", x, self.up_proj)
        return torch.einsum("tei,ehi->th", torch.nn.functional.silu(gate) * up, self.down_proj)


PLAN = {
    "experts": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate()),
    "experts.[gu]*_proj": ShardParameter(dim=1),
    "experts.down_proj": ShardParameter(dim=2),
}


@on_ranks(2, 4)
def test_sharded_expert_parameters_compute_like_the_single_process_module():
    torch.manual_seed(0)
    reference = nn.ModuleDict({"experts": Experts(inner=4 * 3)})
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), PLAN)
    gate, down = model["experts"].gate_proj, model["experts"].down_proj
    assert isinstance(down, DTensor) and down.placements == (Shard(2),) and gate.placements == (Shard(1),)
    torch.testing.assert_close(gate.full_tensor(), reference["experts"].gate_proj)
    assert gate.to_local().shape[1] == 12 // tp_mesh().size()
    x = torch.randn(5, 8)
    out = model["experts"](x)
    torch.testing.assert_close(out.full_tensor(), reference["experts"](x), **TOL)
    out.full_tensor().square().sum().backward()
    reference["experts"](x).square().sum().backward()
    assert_params_and_grads_match(model, reference, **TOL)


def test_a_parameter_key_resolves_to_its_owner_with_the_style_bound_to_the_parameter():
    model = nn.ModuleDict({"experts": Experts()})
    entries = resolve_plan(model, {"experts.down_proj": ShardParameter(dim=2)})
    assert [(e.path, repr(e.style)) for e in entries] == [("experts", "ShardParameter(dim=2) on 'down_proj'")]


def test_explain_plan_shows_each_ranks_slice_of_a_sharded_parameter():
    model = nn.ModuleDict({"experts": Experts(inner=6)})
    rows = {row.path: row for row in explain_plan(model, 2, PLAN)}
    assert rows["experts.down_proj"].local_shapes == ((4, 8, 3), (4, 8, 3))
    assert rows["experts.up_proj"].local_shapes[0] == (4, 3, 8)
    packed = nn.ModuleDict({"experts": nn.Module()})
    packed["experts"].gate_up_proj = nn.Parameter(torch.zeros(4, 2 * 6, 8))  # [gate; up] on dim 1
    row = explain_plan(packed, 2, {"experts.gate_up_proj": ShardParameter(dim=1, packed=2)})[0]
    assert row.local_shapes[0] == (4, 6, 8)  # 3 rows of the gate part and 3 of the up part


def test_parameter_keys_that_name_nothing_or_twice_are_refused():
    model = nn.ModuleDict({"experts": Experts()})
    with pytest.raises(ValueError, match="'experts.in_proj' matched no"):
        resolve_plan(model, {"experts.in_proj": ShardParameter(dim=1)})
    with pytest.raises(ValueError, match=r"names a parameter .* parameter style \(ShardParameter"):
        resolve_plan(model, {"experts.down_proj": PrepareModuleInput()})
    with pytest.raises(TypeError, match="takes an int"):
        ShardParameter(dim="inner")
    report = explain_plan(model, 8, {"experts.down_proj": ShardParameter(dim=2)})  # 6 over 8 ranks
    assert "at least one slice per rank" in report.problems()[0]


@on_ranks(2)
def test_a_parameter_placed_by_a_module_style_and_a_parameter_style_is_refused():
    from torch_tp import ColwiseParallel

    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is placed by two plan entries"):
        parallelize_module(model, tp_mesh(), {"0": ColwiseParallel(), "0.weight": ShardParameter(dim=0)})
    assert not isinstance(model[0].weight, DTensor)
