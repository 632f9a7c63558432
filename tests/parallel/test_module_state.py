"""What torch_tp records on a user's module lives in one ``ModuleState`` under one attribute
(``torch_tp/_module_state.py``): after every kind of style, and a forward, no module or
parameter carries another ``_torch_tp_*`` attribute; the state is outside ``state_dict`` and
survives ``copy.deepcopy`` as the attributes it replaced did (sibling groups pointing at the
copied siblings)."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate

from torch_tp import (
    ColwiseParallel,
    ExpertParallel,
    RowwiseParallel,
    SpatialParallel,
    checkpoint_by_pattern,
    parallelize_module,
)
from torch_tp._module_state import STATE_ATTR, ModuleState, ensure_state, state_of
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.models.moe import MoE, MoEArgs
from torch_tp.parallel import rules
from torch_tp.testing import TOL, full_tensor, on_ranks, small_llama, small_llama_args, tp_mesh

# the per-call stacks: empty between calls, so seen during a forward (below)
_IN_FLIGHT = {"spatial_plain_inputs", "region_guards"}


def _loose_attributes(*objects) -> list[str]:
    """``"<type>.<name>"`` for each ``_torch_tp_*`` attribute other than the state on ``objects``."""
    return [f"{type(o).__name__}.{name}" for o in objects for name in vars(o)
            if name.startswith("_torch_tp_") and name != STATE_ATTR]


def _set_fields(state: ModuleState) -> set[str]:
    """The fields of ``state`` that differ from an empty state's."""
    empty = ModuleState()
    return {f.name for f in dataclasses.fields(state) if getattr(state, f.name) != getattr(empty, f.name)}


class _TiedLM(nn.Module):
    """A base holding the embedding, and a head outside it tied to it (a tie split across calls)."""

    def __init__(self):
        super().__init__()
        self.base = nn.ModuleDict({"embed": nn.Embedding(16, 8)})
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.base.embed.weight


def _cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))


def _spatial_region_in_flight():
    """A SpatialParallel region run once; its per-call stacks' depths while the inner layer runs."""
    region = parallelize_module(_cnn(), tp_mesh(), SpatialParallel(dim=3))
    depths = []
    region[0].register_forward_hook(lambda *_: depths.append(
        (len(state_of(region).spatial_plain_inputs), len(state_of(region).region_guards))))
    region(torch.randn(1, 3, 4, 8))
    return region, depths


def _every_style_once():
    """Small models through every style that records something, each run once: ``(modules and
    parameters to inspect, the spatial region's in-flight stack depths)``."""
    tokens = torch.randint(0, 64, (2, 8))
    unfused = parallelize_module(small_llama(seed=0), tp_mesh(), tensor_parallel_plan())
    fused = parallelize_module(small_llama(seed=0), tp_mesh(),  # the int8 ring: int8_comm
                               tensor_parallel_plan(sequence_parallel=True, overlap=True, comm_dtype=torch.int8))
    checkpoint_by_pattern(fused, "layers.*")
    for model in (unfused, fused):
        model(tokens)
    args = small_llama_args()
    moe = parallelize_module(MoE(args, MoEArgs(num_experts=4, top_k=2, expert_hidden=8)), tp_mesh(),
                             {"experts": ExpertParallel()})
    moe(torch.randn(2, 4, args.dim))
    tied = _TiedLM()
    replaced = tied.head.weight  # the Parameter the first call replaces: it carries placed_as
    parallelize_module(tied.base, tp_mesh(), {"embed": RowwiseParallel(input_layouts=Replicate())})
    parallelize_module(tied, tp_mesh(), {"head": ColwiseParallel(output_layouts=Replicate())})
    region, depths = _spatial_region_in_flight()
    objects = [o for m in (unfused, fused, moe, tied, region) for o in (*m.modules(), *m.parameters())]
    return [*objects, replaced], depths


@on_ranks(2)
def test_every_record_is_one_state_and_no_other_torch_tp_attribute_is_left():
    objects, depths = _every_style_once()
    assert _loose_attributes(*objects) == []
    states = [state_of(o) for o in objects if state_of(o) is not None]
    assert all(type(state) is ModuleState for state in states)
    recorded = set().union(*map(_set_fields, states))
    assert recorded == {f.name for f in dataclasses.fields(ModuleState)} - _IN_FLIGHT  # each field in use
    assert depths == [(1, 1)]  # one region call in flight while its layer ran
    assert all(not s.spatial_plain_inputs and not s.region_guards for s in states)  # popped after it


@on_ranks(2)
def test_the_state_is_outside_state_dict_and_deepcopy_copies_it_with_the_siblings_it_names():
    tokens = torch.randint(0, 64, (2, 8))
    model = parallelize_module(small_llama(seed=0), tp_mesh(),
                               tensor_parallel_plan(sequence_parallel=True, overlap=True))
    assert state_of(model.layers[0].attention.wq) is not None
    assert set(model.state_dict()) == set(small_llama(seed=0).state_dict())
    copied = copy.deepcopy(model)
    for before, after in zip(model.modules(), copied.modules()):
        if state_of(before) is not None:
            assert state_of(after) is not state_of(before) and state_of(after).applied == state_of(before).applied
    attention = copied.layers[0].attention
    group, index = state_of(attention.wk).shared_gather
    assert group.members == [attention.wq, attention.wk, attention.wv] and index == 1
    with pytest.raises(ValueError, match="already converts"):  # the copy's layers are still prepared
        rules.require_unprepared(attention.wq, rules.BOTH_STAGES, "ColwiseParallel", "layers.0.attention.wq")
    torch.testing.assert_close(full_tensor(copied(tokens)), full_tensor(model(tokens)), **TOL)


def test_the_state_is_written_past_module_setattr_and_created_once():
    layer = nn.Linear(2, 2)
    assert state_of(layer) is None
    state = ensure_state(layer)
    assert ensure_state(layer) is state and vars(layer)[STATE_ATTR] is state
    rules.mark_prepared(layer, ("input",), "PrepareModuleInput")
    assert state.applied == {"input": "PrepareModuleInput"} and rules.is_prepared(layer)
    assert set(layer.state_dict()) == {"weight", "bias"} and not list(layer.children())
    assert state_of(copy.deepcopy(layer)).applied == {"input": "PrepareModuleInput"}
