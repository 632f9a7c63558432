"""Plan resolution: exact paths, globs that cross dots, strictness and conflicts (no ranks needed)."""

import pytest
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from torch_tp import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.parallel.plan import match_pattern, resolve_plan
from torch_tp.testing import small_llama


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Linear(8, 8)
        self.key = nn.Linear(8, 8)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = SelfAttention()


def bert_like(n_layers=3):
    model = nn.Module()
    model.encoder = nn.Module()
    model.encoder.layer = nn.ModuleList(Layer() for _ in range(n_layers))
    return model


def paths(entries):
    return [entry.path for entry in entries]


def test_exact_path_matches_one_module():
    entries = resolve_plan(bert_like(), {"encoder.layer.1.attention.self.query": ColwiseParallel()})
    assert paths(entries) == ["encoder.layer.1.attention.self.query"]


def test_leading_star_crosses_dots():
    entries = resolve_plan(bert_like(), {"*self.query": ColwiseParallel()})
    assert paths(entries) == [f"encoder.layer.{i}.attention.self.query" for i in range(3)]


def test_inner_star_and_character_class():
    model = small_llama()
    entries = resolve_plan(model, {"layers.*.feed_forward.w[13]": ColwiseParallel()})
    assert paths(entries) == [
        "layers.0.feed_forward.w1",
        "layers.0.feed_forward.w3",
        "layers.1.feed_forward.w1",
        "layers.1.feed_forward.w3",
    ]
    assert paths(resolve_plan(model, {"*.w[13]": ColwiseParallel()})) == paths(entries)


def test_root_key_selects_the_module_itself():
    entries = resolve_plan(nn.Linear(4, 4), {"": ColwiseParallel()})
    assert paths(entries) == [""]


def test_single_style_plan_applies_to_root():
    style = ColwiseParallel()
    [entry] = resolve_plan(nn.Linear(4, 4), style)
    assert entry.path == "" and entry.style is style


def test_glob_never_selects_the_root():
    assert match_pattern("*", ["", "a", "a.b"]) == ["a", "a.b"]


def test_unmatched_plan_key_raises_with_pattern_and_closest_paths():
    with pytest.raises(ValueError, match=r"'\*self\.qurey' matched no submodule.*self\.query"):
        resolve_plan(bert_like(), {"*self.qurey": ColwiseParallel()})


def test_unmatched_exact_key_raises_with_closest_paths():
    model = small_llama()
    with pytest.raises(ValueError, match=r"'layers\.0\.attention\.wqq'.*layers\.0\.attention\.wq"):
        resolve_plan(model, {"layers.0.attention.wqq": ColwiseParallel()})


def test_conflicting_patterns_raise_naming_both():
    plan = {"*.query": ColwiseParallel(), "encoder.layer.0.*": RowwiseParallel()}
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.attention\.self\.query.*'\*\.query'.*'encoder\.layer\.0\.\*'"):
        resolve_plan(bert_like(), plan)


def test_overlapping_patterns_with_equal_styles_are_merged():
    plan = {"*.query": ColwiseParallel(), "encoder.layer.0.attention.self.query": ColwiseParallel()}
    assert len(resolve_plan(bert_like(), plan)) == 3


def test_non_style_value_and_non_string_key_raise_type_error():
    with pytest.raises(TypeError, match="'encoder' maps to 'colwise'"):
        resolve_plan(bert_like(), {"encoder": "colwise"})
    with pytest.raises(TypeError, match="plan keys must be"):
        resolve_plan(bert_like(), {3: ColwiseParallel()})
    with pytest.raises(TypeError, match="parallelize_plan must be"):
        resolve_plan(bert_like(), ["encoder"])


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_documented_llama_plan_matches_every_key(sequence_parallel):
    entries = resolve_plan(small_llama(), tensor_parallel_plan(sequence_parallel=sequence_parallel))
    assert "layers.1.attention.wk" in paths(entries)
    assert ("layers.1.ffn_norm" in paths(entries)) == sequence_parallel


def test_styles_compare_by_value_and_repr_is_readable():
    assert ColwiseParallel() == ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))
    assert ColwiseParallel() != ColwiseParallel(use_local_output=False)
    assert ColwiseParallel() != RowwiseParallel()
    assert hash(SequenceParallel()) == hash(SequenceParallel(sequence_dim=1))
    assert repr(ColwiseParallel()) == (
        "ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(dim=-1), use_local_output=True)"
    )
    assert repr(PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))) == (
        "PrepareModuleInput(input_layouts=(Shard(dim=1), None), desired_input_layouts=(Replicate(), None), "
        "input_kwarg_layouts={}, desired_input_kwarg_layouts={}, use_local_output=False)"
    )


def test_style_constructor_rejects_bad_layouts():
    with pytest.raises(ValueError, match="same length"):
        PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(),))
    with pytest.raises(ValueError, match="desired_input_layouts"):
        PrepareModuleInput(input_layouts=Shard(0))
    with pytest.raises(TypeError, match="Placement"):
        ColwiseParallel(input_layouts="replicate")
    with pytest.raises(TypeError, match="Placements"):
        PrepareModuleInput(input_layouts=("shard",), desired_input_layouts=(None,))
