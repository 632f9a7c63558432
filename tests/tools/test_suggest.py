"""``suggest_plan``: a plan derived from the model's dataflow (``torch.export``), applied as it is
and compared with one process: outputs, every gradient, parameters after an SGD step."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tp import parallelize_module
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.tools.suggest import SuggestedPlan, suggest_plan
from torch_tp.testing import assert_trains_like, block_linear_fraction, on_ranks, small_llama, small_llama_args, tp_mesh

VOCAB = small_llama_args().vocab_size
SGD = functools.partial(torch.optim.SGD, lr=0.1)


class Mixer(nn.Module):
    """A hand-written block with names no list knows: separate q/k/v, GELU MLP, LayerNorms."""

    def __init__(self, dim=32, heads=4, hidden=64):
        super().__init__()
        self.heads = heads
        self.ln_a, self.ln_b = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.merge = nn.Linear(dim, dim)
        self.expand, self.squeeze = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln_a(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        attended = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.merge(attended)
        return x + self.squeeze(F.gelu(self.expand(self.ln_b(x))))


class Stack(nn.Module):
    def __init__(self, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(Mixer(heads=heads), Mixer(heads=heads))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.blocks(x))


class FusedMixer(nn.Module):
    """A block with one fused ``[q; k; v]`` projection and a GELU MLP. The projection is cut
    with ``chunk``, or (``cut="reshape"``, timm's way) reshaped to ``(b, t, 3, heads,
    head_dim)`` and unbound."""

    def __init__(self, dim=32, heads=4, hidden=64, cut="chunk"):
        super().__init__()
        self.head_dim, self.cut = dim // heads, cut
        self.norm = nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        b, t, _ = x.shape
        if self.cut == "reshape":
            q, k, v = self.qkv(self.norm(x)).reshape(b, t, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = (part.view(b, t, -1, self.head_dim).transpose(1, 2) for part in self.qkv(self.norm(x)).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        x = x + self.out(attended)
        return x + self.down(F.gelu(self.up(x)))


def _mse(out, target):
    return F.mse_loss(out, target)


def _ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@on_ranks(2)
def test_a_hand_written_transformer_gets_a_plan_from_its_dataflow_and_trains_like_one_process():
    reference = Stack()
    x = torch.randn(2, 8, 32)
    plan = suggest_plan(reference, tp_mesh(), (x,))
    for block in ("blocks.0", "blocks.1"):
        assert {name: type(plan[f"{block}.{name}"]).__name__ for name in ("to_q", "to_k", "to_v", "merge", "expand", "squeeze")} == {
            "to_q": "ColwiseParallel", "to_k": "ColwiseParallel", "to_v": "ColwiseParallel", "merge": "RowwiseParallel",
            "expand": "ColwiseParallel", "squeeze": "RowwiseParallel"}
    assert type(plan["head"]).__name__ == "ColwiseParallel" and plan.reasons["head"].startswith("the output head"), str(plan)
    assert plan.sharded_fraction > 0.5, str(plan)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    batches = [(torch.randn(2, 8, 32), torch.randn(2, 8, 10)) for _ in range(2)]
    assert_trains_like(model, reference, batches, _mse, optimizer=SGD, what="derived plan")


@pytest.mark.parametrize("variant", [{}, {"qk_norm": True}, {"tie_embeddings": True}], ids=["plain", "qk_norm", "tied"])
@on_ranks(2)
def test_the_llamas_derived_plan_covers_its_shipped_plans_linear_layers_and_trains_like_one_process(variant):
    reference = small_llama(seed=0, **variant)
    tokens = torch.randint(0, VOCAB, (2, 8))
    plan = suggest_plan(reference, tp_mesh(), (tokens,))
    shipped = tensor_parallel_plan(qk_norm=variant.get("qk_norm", False))
    linears = {name for name, m in reference.named_modules() if isinstance(m, nn.Linear)}
    covered = 0
    for name in linears:
        style = next((s for pattern, s in shipped.items() if _matches(pattern, name)), None)
        if style is not None:
            assert type(plan.get(name)).__name__ == type(style).__name__, (name, str(plan))
            covered += 1
    assert covered >= 7 * 2, (covered, str(plan))  # wq, wk, wv, wo, w1, w3, w2 in each block
    assert type(plan["tok_embeddings"]).__name__ == "RowwiseParallel", str(plan)  # vocabulary-parallel
    if variant.get("qk_norm"):  # per-head norms: one copy, gradients summed over the heads' ranks
        assert type(plan["layers.0.attention.q_norm"]).__name__ == "ReplicateParallel", str(plan)
    if variant.get("tie_embeddings"):
        assert type(plan["output"]).__name__ == "ColwiseParallel", str(plan)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    batches = [(torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))) for _ in range(2)]
    assert_trains_like(model, reference, batches, _ce, optimizer=SGD, what="derived llama plan")


def _matches(pattern, name):
    from torch_tp.parallel import match_pattern

    return bool(match_pattern(pattern, [name]))


@on_ranks(2)
def test_heads_the_ranks_cannot_split_keep_attention_replicated_with_the_reason():
    reference = Stack(heads=1)  # 1 head over 2 ranks
    plan = suggest_plan(reference, tp_mesh(), (torch.randn(2, 8, 32),))
    assert "blocks.0.to_q" not in plan and "cannot split evenly" in plan.reasons["blocks.0.to_q"], str(plan)
    assert type(plan["blocks.0.expand"]).__name__ == "ColwiseParallel"
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    batches = [(torch.randn(2, 8, 32), torch.randn(2, 8, 10))]
    assert_trains_like(model, reference, batches, _mse, optimizer=SGD, what="heads not split")


@on_ranks(2)
def test_a_model_without_linear_layers_gets_an_empty_plan_that_says_so():
    plan = suggest_plan(nn.Sequential(nn.LayerNorm(8), nn.GELU()), tp_mesh(), (torch.randn(2, 8),))
    assert plan == {} and plan.sharded_fraction == 0.0
    assert "no linear layer" in str(plan)


def test_the_table_lists_every_linear_layer_with_its_style_and_why():
    plan = SuggestedPlan({}, reasons={"a": "the model returns it"}, sharded_fraction=0.0)
    assert str(plan).splitlines()[2].split() == ["a", "replicated", "the", "model", "returns", "it"]


@on_ranks(2)
def test_verify_plan_takes_the_derived_plan_unchanged():
    from torch_tp import verify_plan

    x = torch.randn(2, 8, 32)
    plan = suggest_plan(Stack(), tp_mesh(), (x,))
    report = verify_plan(Stack, tp_mesh(), plan, lambda step: (torch.randn(2, 8, 32),),
                         loss_fn=lambda out: out.square().mean(), steps=2)
    assert report.ok, str(report)


class _GlobalViewAndPlainMask(nn.Module):
    """Heads viewed with the whole model's count (wrong on local slices) and a plain-tensor mask
    added to the scores (DTensors refuse to meet it): neither form runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, 4, 4).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) + torch.zeros(1, 1, t, t)
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


@on_ranks(2)
def test_a_plan_that_runs_in_neither_form_is_refused_by_name_on_every_rank():
    from torch_tp.tools.suggest import PlanDerivationError

    with pytest.raises(PlanDerivationError, match="on local slices: .*; on DTensors: "):
        suggest_plan(_GlobalViewAndPlainMask(), tp_mesh(), (torch.randn(2, 8, 16),))


class _StoppedThenJoined(nn.Module):
    """``a``'s features are summed whole (its group stops), then ``a`` meets ``b``'s slices: the
    union of the two groups must stay stopped."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        a = self.a(x)
        total = a.sum(-1, keepdim=True)
        return self.c(self.b(x) * a) + total


@on_ranks(2)
def test_a_group_that_stopped_stops_the_group_it_later_joins():
    plan = suggest_plan(_StoppedThenJoined(), tp_mesh(), (torch.randn(2, 8, 16),))
    assert "a" not in plan and "b" not in plan, str(plan)  # (c's own output is returned: an output head)
    assert "sums over the split dim" in plan.reasons["a"] and "sums over the split dim" in plan.reasons["b"], str(plan)


@pytest.mark.parametrize("cut", ["chunk", "reshape"])
@on_ranks(2, 4)
def test_a_fused_qkv_projection_is_split_part_by_part_and_trains_like_one_process(cut):
    torch.manual_seed(0)
    reference = nn.Sequential(FusedMixer(cut=cut), FusedMixer(cut=cut))
    plan = suggest_plan(reference, tp_mesh(), (torch.randn(2, 8, 32),))
    for block in ("0", "1"):
        assert plan[f"{block}.qkv"].packed == 3 and "a fused projection of 3 parts" in plan.reasons[f"{block}.qkv"], str(plan)
        assert type(plan[f"{block}.out"]).__name__ == "RowwiseParallel" and plan[f"{block}.up"].packed == 1, str(plan)
    assert plan.sharded_fraction > 0.9, str(plan)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    batches = [(torch.randn(2, 8, 32), torch.randn(2, 8, 32)) for _ in range(2)]
    assert_trains_like(model, reference, batches, _mse, optimizer=SGD, what=f"fused qkv, {cut}")


class _UnequalSplit(nn.Module):
    """A projection cut into parts of different sizes (8 + 24): not a fused projection's parts."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.back = nn.Linear(16, 32), nn.Linear(24, 16)

    def forward(self, x):
        gate, value = self.proj(x).split([8, 24], dim=-1)
        return self.back(value * gate.mean(-1, keepdim=True))


@on_ranks(2)
def test_a_projection_cut_into_unequal_parts_stays_whole_with_the_reason():
    plan = suggest_plan(_UnequalSplit(), tp_mesh(), (torch.randn(2, 8, 16),))
    assert "proj" not in plan and "not equal parts of a fused projection" in plan.reasons["proj"], str(plan)


@on_ranks(2)
def test_example_inputs_the_model_cannot_take_raise_a_named_error():
    from torch_tp.tools.suggest import PlanDerivationError

    with pytest.raises(PlanDerivationError, match=r"could not trace Stack on the example inputs \(RuntimeError"):
        suggest_plan(Stack(), tp_mesh(), (torch.randn(2, 8, 7),))  # 7 features where the model takes 32


@on_ranks(2)
def test_an_mlp_mixer_splits_its_token_and_channel_mlps_and_trains_like_one_process():
    from torch_tp.models.mixer import mlp_mixer

    torch.manual_seed(0)
    reference = mlp_mixer()
    plan = suggest_plan(reference, tp_mesh(), (torch.randn(2, 3, 16, 16),))
    for block in ("blocks.0", "blocks.1"):
        for first, second in (("token_fc1", "token_fc2"), ("channel_fc1", "channel_fc2")):
            assert type(plan[f"{block}.{first}"]).__name__ == "ColwiseParallel", str(plan)
            assert type(plan[f"{block}.{second}"]).__name__ == "RowwiseParallel", str(plan)
    assert "Conv2d" in plan.reasons["stem"], str(plan)  # listed, kept whole, with the reason
    assert plan.sharded_fraction > 0.5, str(plan)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    batches = [(torch.randn(2, 3, 16, 16), torch.randn(2, 10)) for _ in range(2)]
    assert_trains_like(model, reference, batches, _mse, optimizer=SGD, what="mlp-mixer")


class _FusedReadWhole(nn.Module):
    """A projection cut into two equal parts (a gate and a value) whose whole output a second
    layer also reads: that layer would read the packed layout as one slice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.down, self.side = nn.Linear(16, 32), nn.Linear(16, 16), nn.Linear(32, 16)

    def forward(self, x):
        y = self.proj(x)
        gate, value = y.chunk(2, dim=-1)
        return self.down(F.silu(gate) * value) + self.side(y)


@on_ranks(2)
def test_a_fused_output_also_read_whole_stays_whole_with_the_reason():
    reference = _FusedReadWhole()
    plan = suggest_plan(reference, tp_mesh(), (torch.randn(2, 8, 16),))
    assert "proj" not in plan and "read whole before" in plan.reasons["proj"], str(plan)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    batches = [(torch.randn(2, 8, 16), torch.randn(2, 8, 16))]
    assert_trains_like(model, reference, batches, _mse, optimizer=SGD, what="fused output read whole")


@on_ranks(2)
def test_timms_vit_splits_its_mlps_keeps_attention_sized_by_the_whole_model_whole_and_trains_like_one_process():
    from torch_tp.models.vit import vit

    torch.manual_seed(0)
    reference = vit(qk_norm=True)
    plan = suggest_plan(reference, tp_mesh(), (torch.randn(2, 3, 16, 16),))
    for block in ("blocks.0", "blocks.1"):
        assert type(plan[f"{block}.mlp.fc1"]).__name__ == "ColwiseParallel", str(plan)
        assert type(plan[f"{block}.mlp.fc2"]).__name__ == "RowwiseParallel", str(plan)
        for layer in ("qkv", "proj"):  # reshaped to (b, t, 3, num_heads, head_dim): the whole model's head count
            why = plan.reasons[f"{block}.attn.{layer}"]
            assert f"{block}.attn.{layer}" not in plan and "Attention's forward does not run on each rank's slice" in why, why
    assert "Conv2d" in plan.reasons["patch_embed"], str(plan)
    assert block_linear_fraction(reference, plan, "blocks.") > 0.5, str(plan)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    batches = [(torch.randn(2, 3, 16, 16), torch.randn(2, 10)) for _ in range(2)]
    assert_trains_like(model, reference, batches, _mse, optimizer=SGD, what="vit")


@on_ranks(2, 4)
def test_sequence_parallel_derives_the_zoo_llamas_shipped_sequence_parallel_plan_and_trains_like_one_process():
    from torch.distributed.tensor import Shard

    from torch_tp.parallel import SequenceParallel

    reference = small_llama(seed=0)
    plan = suggest_plan(reference, tp_mesh(), (torch.randint(0, VOCAB, (2, 8)),), sequence_parallel=True)
    shipped = tensor_parallel_plan(sequence_parallel=True)
    norms = 0
    for name, module in reference.named_modules():
        style = next((s for p, s in shipped.items() if _matches(p, name)), None)
        if isinstance(style, (SequenceParallel, type(plan["output"]), type(plan["tok_embeddings"]))):
            assert type(plan.get(name)) is type(style), (name, str(plan))
            norms += isinstance(style, SequenceParallel)
    assert norms == 2 * 2 + 1, str(plan)  # attention_norm, ffn_norm per block; the final norm
    assert plan["layers.0.attention.wo"].output_layouts == Shard(1) and plan["tok_embeddings"].output_layouts == Shard(1)
    assert plan["layers.0.feed_forward.w1"].input_layouts == Shard(1) and plan["output"].input_layouts == Shard(1)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    batches = [(torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))) for _ in range(2)]
    assert_trains_like(model, reference, batches, _ce, optimizer=SGD, what="derived sequence parallel")


class _Encoder(nn.Module):
    """An embedding and two hand-written blocks that return the hidden states (an encoder): the
    stream the model returns is whole."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.blocks = nn.Embedding(64, 32), nn.Sequential(Mixer(), Mixer())

    def forward(self, tokens):
        return self.blocks(self.embed(tokens))


@pytest.mark.parametrize("case", ["returned", "mixes the positions"])
@on_ranks(2)
def test_sequence_parallel_where_the_stream_cannot_be_split_raises_naming_why(case):
    from torch_tp.models.mixer import mlp_mixer
    from torch_tp.tools.suggest import PlanDerivationError

    model, example, why = (_Encoder(), torch.randint(0, 64, (2, 8)), "the model returns it") if case == "returned" else \
        (mlp_mixer(), torch.randn(2, 3, 16, 16), "combines it with a tensor not split like it")
    with pytest.raises(PlanDerivationError, match=rf"sequence_parallel=True\): the residual stream cannot be split along the sequence: .*{why}"):
        suggest_plan(model, tp_mesh(), (example,), sequence_parallel=True)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@on_ranks(2)
def test_layers_that_read_one_input_convert_it_once_so_the_derived_plan_communicates_as_the_shipped_one(sequence_parallel):
    from torch_tp.testing import communication_of

    reference, tokens = small_llama(seed=0), torch.randint(0, VOCAB, (2, 8))
    counts = {}
    for name, plan in (("derived", suggest_plan(reference, tp_mesh(), (tokens,), sequence_parallel=sequence_parallel)),
                       ("shipped", tensor_parallel_plan(sequence_parallel=sequence_parallel))):
        model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
        counts[name] = communication_of(lambda: model(tokens).square().mean().backward())[1]
        counts[name].pop("agreement checks", None)  # forward-time checks of plain inputs: the derived plan has more
    assert counts["derived"] == counts["shipped"], counts


class _ModeBranches(nn.Module):
    """Three MLPs: the first sums its split features in training mode only, the second in eval
    mode only (a plan proven on one branch computes the other one wrong), the third never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.w1, self.w2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.norm = nn.BatchNorm1d(8)  # batch statistics in training, running ones in eval

    def forward(self, x):
        h = F.gelu(self.up(x))
        if self.training:
            h = h + 0.1 * h.sum(-1, keepdim=True)
        x = self.norm(x + self.down(h))
        g = F.relu(self.fc1(x))
        if not self.training:
            g = g * g.mean(-1, keepdim=True)
        x = x + self.fc2(g)
        return x + self.w2(F.silu(self.w1(x)))


@on_ranks(2)
def test_a_model_in_eval_with_mode_dependent_code_gets_a_plan_proven_in_both_modes_that_trains_like_one_process():
    reference = _ModeBranches().eval()
    plan = suggest_plan(reference, tp_mesh(), (torch.randn(2, 8, 16),))
    assert plan.modes == ("train", "eval") and "\nproven in train and eval mode\n" in str(plan), str(plan)
    assert plan.shapes == ("input 0 dim 1 == 8",), plan.shapes  # BatchNorm1d(8) reads dim 1 as its channels
    assert not reference.training and not any(m.training for m in reference.modules())  # its modes restored
    for layer, mode in (("up", "train"), ("down", "train"), ("fc1", "eval"), ("fc2", "eval")):
        assert layer not in plan and plan.reasons[layer].startswith(f"in {mode} mode: "), str(plan)
    assert type(plan["w1"]).__name__ == "ColwiseParallel" and type(plan["w2"]).__name__ == "RowwiseParallel", str(plan)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    model.train(), reference.train()
    batches = [(torch.randn(2, 8, 16), torch.randn(2, 8, 16)) for _ in range(2)]
    assert_trains_like(model, reference, batches, _mse, optimizer=SGD, what="trained after deriving in eval")
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), reference.eval()(x), rtol=1e-5, atol=1e-5)


@on_ranks(2)
def test_a_half_precision_mlp_gets_a_plan_compared_within_its_dtypes_tolerance():
    from torch_tp.tools._suggest_probe import tolerance

    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).to(dtype)
        x = torch.randn(4, 8, 16, dtype=dtype)
        plan = suggest_plan(reference, tp_mesh(), (x,))
        assert [type(plan[n]).__name__ for n in ("0", "2")] == ["ColwiseParallel", "RowwiseParallel"], (dtype, str(plan))
        with torch.no_grad():
            want = reference(x)
            got = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)(x)
        rtol, atol = tolerance(dtype, scale=want.abs().max().item())
        assert not torch.allclose(got, want, rtol=1e-4, atol=1e-5), "the split sums round apart: float32's tolerance refuses"
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


class _SizeBranch(nn.Module):
    """An MLP that sums its split features only for sequences longer than 8."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = F.gelu(self.up(x))
        if x.shape[1] > 8:
            h = h + 0.1 * h.sum(-1, keepdim=True)
        return self.down(h)


@on_ranks(2, 4)
def test_a_plan_derived_on_one_side_of_a_size_branch_states_the_sizes_it_is_proven_for_and_trains_there():
    reference = _SizeBranch()
    short = suggest_plan(reference, tp_mesh(), (torch.randn(2, 4, 16),))
    assert short.shapes == ("input 0 dim 1 in [2, 8]",), short.shapes
    assert "proven for input 0 dim 1 in [2, 8] only" in str(short) and "derive the plan again" in str(short), str(short)
    assert type(short["up"]).__name__ == "ColwiseParallel", str(short)  # the branch not taken sums nothing
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), short)
    assert_trains_like(model, reference, [(torch.randn(2, 4, 16), torch.randn(2, 4, 16))] * 2, _mse, optimizer=SGD,
                       what="derived on 4 tokens, trained on 4")
    long = suggest_plan(reference, tp_mesh(), (torch.randn(2, 12, 16),))
    assert long.shapes == ("input 0 dim 1 in [9, oo]",) and "up" not in long, str(long)  # the sum keeps them whole
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), long)
    assert_trains_like(model, reference, [(torch.randn(2, 12, 16), torch.randn(2, 12, 16))] * 2, _mse, optimizer=SGD,
                       what="derived on 12 tokens, trained on 12")
    assert suggest_plan(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)), tp_mesh(), (torch.randn(2, 4, 16),)).shapes == ()
