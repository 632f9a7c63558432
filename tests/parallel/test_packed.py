"""Packed (fused) weights: ``ColwiseParallel(packed=k)`` / ``RowwiseParallel(packed=k)``.

A fused Linear stacks ``k`` equal matrices along its sharded dim (Phi-3's ``gate_up_proj`` is
``[gate; up]``, a fused ``qkv`` is ``[q; k; v]``). Packed, each rank holds its slice of every
part, so a forward that splits the output with ``chunk(k, dim=-1)`` runs on local tensors as
on full ones. Every distributed test compares with the single-process module built from the
same seed, at world sizes 2 and 4; sizes include parts that split unevenly (10 over 4 ranks).
"""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp import ColwiseParallel, RowwiseParallel, explain_plan, init_parameters, parallelize_module, runtime_checks, verify_plan
from torch_tp.parallel.rules import UnsupportedModuleError, packed_shard
from torch_tp.testing import (
    TOL,
    assert_comm_counts,
    assert_params_and_grads_match,
    assert_trains_like,
    assert_training_step_matches,
    comm_counts,
    local_chunk,
    on_ranks,
    tp_mesh,
)

DIM = 16


class PackedMLP(nn.Module):
    """Phi-3's MLP: one fused ``[gate; up]`` projection, split by ``chunk(2, -1)``."""

    def __init__(self, hidden=12, bias=False):
        super().__init__()
        self.gate_up_proj = nn.Linear(DIM, 2 * hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, DIM, bias=bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedQKVAttention(nn.Module):
    """Self-attention with one fused ``[q; k; v]`` projection, split by ``chunk(3, -1)`` into heads."""

    def __init__(self, heads=4, head_dim=4):
        super().__init__()
        self.head_dim = head_dim
        self.qkv = nn.Linear(DIM, 3 * heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, DIM)

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(heads.transpose(1, 2).reshape(batch, seq, -1))


class PackedActivation(nn.Module):
    """A packed activation kept whole: ``act([gate; up])`` into a down projection reading it packed."""

    def __init__(self, hidden=10):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * hidden)
        self.down = nn.Linear(2 * hidden, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


MLP_PLAN = {"gate_up_proj": ColwiseParallel(packed=2), "down_proj": RowwiseParallel()}


def _parallel_copy(module, plan):
    return parallelize_module(copy.deepcopy(module), tp_mesh(), plan)


def _packed_local(tensor, parts, dim):
    """This rank's slice of each of ``parts`` equal parts of ``tensor`` along ``dim``, stacked again."""
    return torch.cat([local_chunk(part, dim) for part in tensor.chunk(parts, dim)], dim)


# ---------------------------------------------------------------------------- the layout


@pytest.mark.parametrize("hidden", [12, 10], ids=["even", "uneven"])
@on_ranks(2, 4)
def test_packed_weight_holds_a_slice_of_every_part_and_its_full_tensor_is_the_fused_weight(hidden):
    reference = PackedMLP(hidden, bias=True)
    sharded = _parallel_copy(reference, {"gate_up_proj": ColwiseParallel(packed=2), "down_proj": RowwiseParallel()})
    weight, bias = sharded.gate_up_proj.weight, sharded.gate_up_proj.bias
    assert weight.placements == (packed_shard(0, 2),) and bias.placements == (packed_shard(0, 2),)
    assert torch.equal(weight.to_local(), _packed_local(reference.gate_up_proj.weight, 2, 0))
    assert torch.equal(bias.to_local(), _packed_local(reference.gate_up_proj.bias, 2, 0))
    assert torch.equal(weight.full_tensor(), reference.gate_up_proj.weight)
    assert torch.equal(bias.full_tensor(), reference.gate_up_proj.bias)


@on_ranks(2, 4)
def test_packed_rowwise_weight_holds_a_slice_of_every_part_of_its_input_features():
    reference = PackedActivation(hidden=10)
    sharded = _parallel_copy(reference, {"down": RowwiseParallel(packed=2)})
    assert sharded.down.weight.placements == (packed_shard(1, 2),)
    assert sharded.down.bias.placements == (Replicate(),)
    assert torch.equal(sharded.down.weight.to_local(), _packed_local(reference.down.weight, 2, 1))
    assert torch.equal(sharded.down.weight.full_tensor(), reference.down.weight)


# ---------------------------------------------------------------------------- models


@pytest.mark.parametrize(("hidden", "bias"), [(12, False), (10, True)], ids=["even", "uneven_bias"])
@on_ranks(2, 4)
def test_packed_mlp_matches_single_process_through_3_sgd_steps(hidden, bias):
    reference = PackedMLP(hidden, bias=bias)
    sharded = _parallel_copy(reference, MLP_PLAN)
    batches = ((torch.randn(2, 5, DIM), torch.randn(2, 5, DIM)) for _ in range(3))
    assert_trains_like(sharded, reference, batches, F.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=0.1), **TOL)
    assert_params_and_grads_match(sharded, reference, **TOL, what="after 3 steps")


@on_ranks(2, 4)
def test_packed_mlp_forward_issues_one_all_reduce_like_the_unpacked_mlp():
    sharded = _parallel_copy(PackedMLP(), MLP_PLAN)
    with runtime_checks(False), CommDebugMode() as mode:  # the plan's collectives, not the input check's
        sharded(torch.randn(2, 5, DIM))
    assert_comm_counts(comm_counts(mode), {"all_reduce": 1}, "packed MLP forward")


@on_ranks(2, 4)
def test_fused_qkv_packed_3_feeds_a_head_split_and_matches_single_process():
    reference = FusedQKVAttention()
    sharded = _parallel_copy(reference, {"qkv": ColwiseParallel(packed=3), "o_proj": RowwiseParallel()})
    x = torch.randn(2, 6, DIM)
    assert_training_step_matches(sharded, reference, x, None, lambda out, _: out.square().sum(), **TOL)


@pytest.mark.parametrize("input_layouts", [None, Replicate()], ids=["packed_input", "replicated_input"])
@on_ranks(2, 4)
def test_packed_rowwise_reads_a_packed_activation_and_matches_single_process(input_layouts):
    reference = PackedActivation(hidden=10)
    plan = {"up": ColwiseParallel(packed=2), "down": RowwiseParallel(packed=2, input_layouts=input_layouts)}
    if input_layouts is not None:  # the whole activation reaches the down projection
        plan["up"] = ColwiseParallel(packed=2, output_layouts=Replicate())
    sharded = _parallel_copy(reference, plan)
    x = torch.randn(2, 5, DIM)
    assert_training_step_matches(sharded, reference, x, None, lambda out, _: out.square().sum(), **TOL)


@on_ranks(2)
def test_packed_colwise_and_rowwise_compile_to_one_graph_matching_eager():
    reference = PackedActivation(hidden=10)
    plan = {"up": ColwiseParallel(packed=2), "down": RowwiseParallel(packed=2)}
    sharded = _parallel_copy(reference, plan)
    x = torch.randn(2, 5, DIM)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(sharded)(x)
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False):
        sharded.compile(backend="aot_eager", fullgraph=True)  # in place: parameter names unchanged
        assert_training_step_matches(sharded, reference, x, None, lambda out, _: out.square().sum(), **TOL)
    torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


# ---------------------------------------------------------------------------- output layouts


@on_ranks(2, 4)
def test_packed_colwise_local_output_is_each_parts_local_slice():
    reference = nn.Linear(DIM, 2 * 10)
    x = torch.randn(2, 5, DIM)
    out = _parallel_copy(reference, ColwiseParallel(packed=2))(x)
    torch.testing.assert_close(out, _packed_local(reference(x), 2, -1).detach(), **TOL)


@on_ranks(2, 4)
def test_packed_colwise_dtensor_output_is_packed_and_its_full_tensor_is_the_output():
    reference = nn.Linear(DIM, 3 * 10)
    x = torch.randn(2, 5, DIM)
    out = _parallel_copy(reference, ColwiseParallel(packed=3, use_local_output=False))(x)
    assert isinstance(out, DTensor) and out.placements == (packed_shard(2, 3),)
    torch.testing.assert_close(out.full_tensor(), reference(x).detach(), **TOL)


@pytest.mark.parametrize("layout", [Replicate(), Shard(1)], ids=["replicate", "sequence"])
@on_ranks(2, 4)
def test_packed_colwise_output_moved_to_another_layout_equals_the_unsharded_output(layout):
    reference = nn.Linear(DIM, 2 * 10)
    x = torch.randn(2, 8, DIM)
    sharded = _parallel_copy(reference, ColwiseParallel(packed=2, output_layouts=layout))
    out, expected = sharded(x), reference(x)
    torch.testing.assert_close(out, expected if layout == Replicate() else local_chunk(expected, 1), **TOL)
    out.square().sum().backward()  # a sequence shard's losses add up to the whole loss over the ranks
    expected.square().sum().backward()
    assert_params_and_grads_match(sharded, reference, **TOL, params=False)


# ---------------------------------------------------------------------------- plan tools


def test_explain_plan_shows_each_ranks_slice_of_every_part():
    report = explain_plan(PackedMLP(hidden=10, bias=True), 4, MLP_PLAN)
    rows = {row.path: row for row in report}
    weight = rows["gate_up_proj.weight"]
    assert weight.placement == packed_shard(0, 2)
    assert weight.local_shapes == ((6, DIM), (6, DIM), (6, DIM), (2, DIM))  # 2 parts of 3, 3, 3, 1 rows
    assert rows["gate_up_proj.bias"].local_shapes == ((6,), (6,), (6,), (2,))
    assert weight.note == "uneven: each of 2 parts of 10 over 4 ranks -> 3, 3, 3, 1"
    assert "Shard(0) packed=2" in str(report)


def _tiny_packed_mlp():
    return PackedMLP(hidden=10, bias=True)


@on_ranks(2, 4)
def test_verify_plan_finds_a_packed_mlp_trains_like_one_process():
    report = verify_plan(_tiny_packed_mlp, tp_mesh(), MLP_PLAN, (torch.randn(2, 5, DIM),), steps=3)
    assert report.ok


@on_ranks(2, 4)
def test_meta_built_packed_mlp_initializes_to_the_single_process_values():
    reference = init_parameters(_tiny_packed_mlp(), seed=7)
    with torch.device("meta"):
        model = _tiny_packed_mlp()
    parallelize_module(model, tp_mesh(), MLP_PLAN)
    model.to_empty(device="cpu")
    init_parameters(model, seed=7)
    assert model.gate_up_proj.weight.to_local().shape[0] == 2 * local_chunk(torch.empty(10), 0).numel()
    assert_params_and_grads_match(model, reference, rtol=0, atol=0)


# ---------------------------------------------------------------------------- validation


def test_packed_1_is_the_plain_style_with_the_same_repr():
    assert ColwiseParallel(packed=1) == ColwiseParallel()
    assert RowwiseParallel(packed=1) == RowwiseParallel()
    assert repr(ColwiseParallel(packed=1)) == repr(ColwiseParallel())
    assert "packed" not in repr(RowwiseParallel())
    assert repr(ColwiseParallel(packed=2)).endswith("use_local_output=True, packed=2)")


@pytest.mark.parametrize(
    ("packed", "error", "phrase"),
    [(0, ValueError, "must be at least 1"), (2.0, TypeError, "takes an int"), (True, TypeError, "takes an int")],
    ids=["zero", "float", "bool"],
)
def test_packed_must_be_an_int_of_at_least_1(packed, error, phrase):
    with pytest.raises(error, match=phrase):
        ColwiseParallel(packed=packed)


def test_packed_with_overlap_is_refused_where_the_style_is_built():
    with pytest.raises(ValueError, match=r"RowwiseParallel\(packed=2, overlap=True\) is not supported"):
        RowwiseParallel(packed=2, overlap=True, output_layouts=Shard(1))


_BAD_PLANS = {
    "not_a_multiple": (
        lambda: nn.Linear(DIM, 10), ColwiseParallel(packed=3), ValueError,
        "into 3 equal parts on dim 0: 10 is not a multiple of 3",
    ),
    "rowwise_not_a_multiple": (
        lambda: nn.Linear(9, DIM), RowwiseParallel(packed=2), ValueError,
        "into 2 equal parts on dim 1: 9 is not a multiple of 2",
    ),
    "part_smaller_than_mesh": (
        lambda: nn.Linear(DIM, 6), ColwiseParallel(packed=6), ValueError,
        "each of its 6 packed parts has size 1, smaller than the",
    ),
    "embedding": (
        lambda: nn.Embedding(8, 4), ColwiseParallel(packed=2), UnsupportedModuleError,
        "ColwiseParallel(packed=2) cannot handle",
    ),
}


@pytest.mark.parametrize("case", list(_BAD_PLANS))
@on_ranks(2)
def test_unshardable_packed_module_raises_naming_its_path_and_is_left_untouched(case):
    build, style, error, phrase = _BAD_PLANS[case]
    model = nn.ModuleDict({"fused": build()})
    before = copy.deepcopy(model.fused.weight)
    with pytest.raises(error, match=r"'fused' \(") as info:
        parallelize_module(model, tp_mesh(), {"fused": style})
    assert phrase in str(info.value)
    assert not isinstance(model.fused.weight, DTensor) and torch.equal(model.fused.weight, before)


# ---------------------------------------------------------------------------- Phi-3


def _tiny_phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False, attn_implementation="eager",
    )
    return Phi3ForCausalLM(config).eval()


# Phi3Attention slices qkv at the global sizes (num_attention_heads * head_dim), not with
# chunk(3), so its qkv output is gathered whole and o_proj splits it again (what Hugging
# Face's own Phi-3 plan does); the MLP runs on the packed local slices.
PHI3_PLAN = {
    "model.layers.*.mlp.gate_up_proj": ColwiseParallel(packed=2),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
    "model.layers.*.self_attn.qkv_proj": ColwiseParallel(packed=3, output_layouts=Replicate()),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(input_layouts=Replicate()),
}


@on_ranks(2)
def test_tiny_phi3_with_packed_gate_up_and_qkv_matches_single_process_logits_and_grads():
    torch.manual_seed(0)
    reference = _tiny_phi3()
    sharded = _parallel_copy(reference, PHI3_PLAN)
    ids = torch.randint(0, 128, (2, 12))
    logits, ref_logits = sharded(ids).logits, reference(ids).logits
    torch.testing.assert_close(logits, ref_logits, **TOL)
    loss_fn = functools.partial(F.cross_entropy, target=ids[:, 1:].reshape(-1))
    loss_fn(logits[:, :-1].reshape(-1, 128)).backward()
    loss_fn(ref_logits[:, :-1].reshape(-1, 128)).backward()
    assert_params_and_grads_match(sharded, reference, **TOL)
    layer = sharded.model.layers[0]
    assert layer.mlp.gate_up_proj.weight.to_local().shape == (256 // 2, 64)


def test_a_packed_weight_must_split_each_part_into_whole_declared_units():
    from torch_tp.parallel.plan import check_whole_units, planned_placements, resolve_plan

    attention = nn.ModuleDict({"qkv": nn.Linear(24, 3 * 24)})  # 3 parts of 3 heads of 8
    attention.tensor_parallel_units = {"qkv.weight": 8}
    entries = resolve_plan(attention, {"qkv": ColwiseParallel(packed=3)})
    placements = planned_placements(attention, entries, [e.style for e in entries])
    check_whole_units(attention, placements, 3)  # one head of each part per rank
    with pytest.raises(ValueError, match=r"splits each part of 24 elements \(3 units\) as \[12, 12\]"):
        check_whole_units(attention, placements, 2)
