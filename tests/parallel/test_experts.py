"""Mixture-of-experts: ``ExpertParallel`` (all-to-all token dispatch) and ``ExpertTensorParallel``
(experts split on their hidden dim) match the single-process model, whatever the routing."""

import copy
import functools
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from torch_tp import ExpertParallel, ExpertTensorParallel, ReplicateParallel, UnsupportedModuleError, parallelize_module
from torch_tp.functional import expert_parallel, expert_tensor_parallel
from torch_tp.models.llama import ModelArgs
from torch_tp.models.moe import GroupedExperts, MoE, MoEArgs, MoETransformer, moe_block_plan, tensor_parallel_plan
from torch_tp.parallel import routing_summary
from torch_tp.testing import TOL, assert_params_and_grads_match, assert_trains_like, full_tensor, local_chunk
from torch_tp.testing import on_ranks, rank, tp_mesh, world_size

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16)
MOE = MoEArgs(num_experts=8, top_k=2, expert_hidden=24, shared_expert_hidden=16)
AUX = 0.01


class _WithAuxLoss(nn.Module):
    """The model with its logits and its router's auxiliary loss as output."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return {"logits": self.model(tokens), "aux loss": self.model.aux_loss()}


def _loss(out, targets):
    return F.cross_entropy(out["logits"].flatten(0, 1), targets.flatten()) + AUX * out["aux loss"]


@on_ranks(2, 4)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("experts", ["expert", "tensor"])
def test_the_zoo_moe_decoder_trains_like_one_process(experts, sequence_parallel):
    torch.manual_seed(0)
    reference = MoETransformer(ARGS, MOE)
    plan = tensor_parallel_plan(MOE, experts=experts, sequence_parallel=sequence_parallel)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    batches = (torch.randint(0, ARGS.vocab_size, (2, 2, 8)).unbind() for _ in range(3))
    assert_trains_like(_WithAuxLoss(model), _WithAuxLoss(reference), batches, _loss,
                       optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), **TOL)


# ----------------------------------------------------------------------------- skewed routing


def _routing(case: str, tokens: int, num_experts: int, generator: torch.Generator):
    """``(top_k_index, top_k_weights)`` for one routing case, the same on every rank."""
    if case == "all_to_expert_0":  # one expert (so one rank) takes every token
        index = torch.zeros(tokens, 1, dtype=torch.long)
    elif case == "last_rank_idle":  # the last rank's experts receive nothing
        owned = num_experts // world_size()
        index = torch.randint(0, num_experts - owned, (tokens, 2), generator=generator)
        index[:, 1] = (index[:, 0] + 1) % (num_experts - owned)
    elif case == "top1":
        index = torch.randint(0, num_experts, (tokens, 1), generator=generator)
    elif case == "one_token":  # fewer tokens than ranks: some ranks dispatch nothing at all
        index = torch.tensor([[num_experts - 1, 0]])
    else:  # top2, random
        index = torch.stack([torch.randperm(num_experts, generator=generator)[:2] for _ in range(tokens)])
    weights = torch.rand(index.shape, generator=generator).softmax(-1)
    return index, weights


CASES = ["all_to_expert_0", "last_rank_idle", "top1", "top2", "one_token"]


@on_ranks(2, 4)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tokens_layout", ["replicated", "own"])
@pytest.mark.parametrize("style", ["ExpertParallel", "ExpertTensorParallel"])
def test_grouped_experts_are_exact_under_skewed_routing(style, tokens_layout, case):
    torch.manual_seed(0)
    reference = GroupedExperts(16, 12, num_experts=8)
    experts = copy.deepcopy(reference)
    layout = Replicate() if tokens_layout == "replicated" else Shard(0)
    if style == "ExpertParallel":
        expert_parallel(experts, tp_mesh(), input_layouts=layout)
    else:
        expert_tensor_parallel(experts, tp_mesh(), input_layouts=layout, output_layouts=layout)
    generator = torch.Generator().manual_seed(1)
    tokens = 1 if case == "one_token" else 12
    x = torch.randn(tokens, 16, generator=generator)
    index, weights = _routing(case, tokens, 8, generator)
    ref_x, ref_weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    want = reference(ref_x, index, ref_weights)
    want.pow(2).sum().backward()
    want_grads = ref_x.grad, ref_weights.grad
    if layout == Shard(0):  # each rank brings its own chunk of the tokens
        x, index, weights, want = (local_chunk(t, 0) for t in (x, index, weights, want))
        want_grads = tuple(local_chunk(g, 0) for g in want_grads)
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = experts(x, index, weights)
    torch.testing.assert_close(out, want, **TOL)
    out.pow(2).sum().backward()  # summed over the ranks' own tokens, or each rank's copy of the loss
    torch.testing.assert_close(x.grad, want_grads[0], **TOL)
    torch.testing.assert_close(weights.grad, want_grads[1], **TOL)
    for name in ("gate_up_proj", "down_proj"):
        grad = getattr(experts, name).grad
        assert grad is not None, f"{name} has no gradient on rank {rank()}"
        torch.testing.assert_close(full_tensor(grad), getattr(reference, name).grad, **TOL)


# ------------------------------------------------------------------- a rank's own tokens, router too


@on_ranks(2, 4)
def test_a_block_on_its_own_sequence_shard_with_a_reduced_router_matches_one_process():
    """Tokens sequence-sharded all the way: the router sees only this rank's tokens, so its
    gradient is summed by ReplicateParallel(input_layouts=Shard(0)); nothing is gathered."""
    torch.manual_seed(0)
    reference = MoE(ARGS, MoEArgs(num_experts=8, top_k=2, expert_hidden=24))
    block = parallelize_module(copy.deepcopy(reference), tp_mesh(), {
        "gate": ReplicateParallel(input_layouts=Shard(0)),
        "experts": ExpertParallel(input_layouts=Shard(0)),
    })
    x = torch.randn(2, 4 * world_size(), ARGS.dim)
    want = reference(x)
    want.pow(2).sum().backward()
    mine = local_chunk(x, 1).requires_grad_()
    out = block(mine)
    torch.testing.assert_close(out, local_chunk(want, 1), **TOL)
    out.pow(2).sum().backward()
    assert_params_and_grads_match(block, reference, **TOL)
    routed = routing_summary(block)["experts"]
    assert sum(routed.sent) == mine.shape[0] * mine.shape[1] * 2  # every token copy went somewhere


# ------------------------------------------------------------------------------ memory per rank


@on_ranks(2, 4)
@pytest.mark.parametrize("experts", ["expert", "tensor"])
def test_each_rank_holds_one_world_th_of_the_expert_weights(experts):
    torch.manual_seed(0)
    model = MoETransformer(ARGS, MOE)
    whole = sum(p.nbytes for name, p in model.named_parameters() if ".experts." in name)
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(MOE, experts=experts))
    local = [p.to_local() for name, p in model.named_parameters() if ".experts." in name]
    assert sum(t.untyped_storage().nbytes() for t in local) == whole // world_size()


# ------------------------------------------------------------------------------- bad input


@on_ranks(2, 4)
def test_experts_that_do_not_divide_over_the_mesh_are_refused_on_every_rank():
    model = MoE(ARGS, MoEArgs(num_experts=world_size() + 1, top_k=1))
    with pytest.raises(ValueError, match=rf"cannot spread the {world_size() + 1} experts of 'experts'"):
        parallelize_module(model, tp_mesh(), {"experts": ExpertParallel()})
    assert not any(isinstance(p, DTensor) for p in model.parameters())


@on_ranks(2)
@pytest.mark.parametrize("style", [ExpertParallel(), ExpertTensorParallel()], ids=["ep", "etp"])
def test_a_module_without_a_leading_expert_dim_is_refused_by_name(style):
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(UnsupportedModuleError, match=r"cannot take '0' \(Linear\).*grouped-experts module"):
        parallelize_module(model, tp_mesh(), {"0": style})


class _TransposedExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts, self.is_transposed = 2, True
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 12))
        self.down_proj = nn.Parameter(torch.zeros(2, 6, 8))


def test_expert_tensor_parallel_names_the_layout_it_takes():
    with pytest.raises(UnsupportedModuleError, match=r"gate_up_proj \[E, 2I, H\].*Use ExpertParallel"):
        ExpertTensorParallel().check(_TransposedExperts(), 2, "layers.0.mlp.experts")
    ExpertParallel().check(_TransposedExperts(), 2, "layers.0.mlp.experts")  # any grouped layout


@pytest.mark.parametrize("layout", [Shard(1), Shard(-1)])
def test_tokens_are_rows_so_only_replicate_or_shard_0(layout):
    with pytest.raises(ValueError, match=r"tokens are rows of a \[T, H\] tensor"):
        ExpertParallel(input_layouts=layout)


def test_explain_plan_shows_each_rank_its_expert_bytes():
    from torch_tp import explain_plan

    with torch.device("meta"):
        model = MoETransformer(ARGS, MOE)
    report = explain_plan(model, 4, tensor_parallel_plan(MOE, experts="expert"))
    whole = sum(p.nbytes for name, p in model.named_parameters() if ".experts." in name)
    assert report.expert_bytes_per_rank() == (whole // 4,) * 4
    assert "expert parameter bytes per rank: " in str(report)


# ------------------------------------------------------------------------------ torch.compile


_SKIPPED_EXPERTS = "Skip calling `torch.compiler.disable()`d function"


@on_ranks(2)
@pytest.mark.parametrize("experts", ["expert", "tensor"])
def test_under_compile_the_only_graph_break_is_at_the_experts(experts):
    """Dynamo traces attention, router, load-balancing loss and shared expert; the grouped
    experts (data-dependent token counts) run eagerly, and the compiled blocks match eager."""
    torch.manual_seed(0)
    reference = MoETransformer(ARGS, MOE)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), tensor_parallel_plan(MOE, experts=experts))
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.layers[0])(model.tok_embeddings(tokens), model.rope)
    reasons = {str(b.reason).splitlines()[0] for b in explained.break_reasons}
    assert reasons == {_SKIPPED_EXPERTS}, reasons
    torch._dynamo.reset()
    for layer in model.layers:  # per block, as torchtitan compiles
        layer.compile(backend="eager")
    out = model(tokens)
    torch.testing.assert_close(out, reference(tokens), **TOL)
    out.sum().backward()
    reference(tokens).sum().backward()
    assert_params_and_grads_match(model, reference, **TOL)


# ---------------------------------------------------------------- the routing's agreement, folded


def _routed_twice(experts, corrupt_step_2):
    """Step 1: every rank routes validly. Step 2: the last rank's routing is ``corrupt_step_2``."""
    from torch_tp import _agreement

    outcomes = []
    for step in (1, 2):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(12, 16, generator=generator)
        index = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(12)])
        weights = torch.rand(index.shape, generator=generator)
        if step == 2 and rank() == world_size() - 1:
            index, weights = corrupt_step_2(index, weights)
        before = _agreement.checks_run(), _agreement._AGREEMENTS[0]
        start = time.monotonic()
        try:
            experts(x, index, weights)
            outcomes.append("ran")
        except (ValueError, TypeError) as error:
            outcomes.append(str(error))
        assert time.monotonic() - start < 10, step  # no rank waited for the others' timeout
        outcomes.append((_agreement.checks_run() - before[0], _agreement._AGREEMENTS[0] - before[1]))
    return outcomes


_STEP_2 = {
    "id_past_last_expert": lambda index, weights: (index.index_fill(0, torch.tensor([0]), 8), weights),
    "another_top_k": lambda index, weights: (index[:, :1], weights[:, :1]),
}


@on_ranks(2, 4)
@pytest.mark.parametrize("case", sorted(_STEP_2))
@pytest.mark.parametrize("style", ["ExpertParallel", "ExpertTensorParallel"])
def test_the_routing_agreement_rides_on_the_count_exchange_and_catches_a_rank_that_changes_at_step_2(style, case):
    """ExpertParallel's count all-to-all (and ExpertTensorParallel's token-count all-gather of
    each rank's own tokens) carries the routing's digest: no all-gather of its own, and ranks that
    agreed at step 1 but not at step 2 still raise a named error on every rank within seconds."""
    experts = GroupedExperts(16, 12, num_experts=8)
    parallelize = expert_parallel if style == "ExpertParallel" else expert_tensor_parallel
    parallelize(experts, tp_mesh(), input_layouts=Shard(0))
    ran, counted_1, refused, counted_2 = _routed_twice(experts, _STEP_2[case])
    assert ran == "ran" and counted_1 == (0, 1), counted_1  # one agreement, no collective of its own
    assert style in refused and counted_2 == (0, 1), (refused, counted_2)
    if case == "id_past_last_expert":
        assert ("outside 0 .. 7" if rank() == world_size() - 1 else "another rank refused") in refused, refused
    else:
        assert "routings have different top-k" in refused, refused


# ----------------------------------------------------------------------- non-finite routing


def _nan_block(experts: str, where: str):
    torch.manual_seed(0)
    reference = MoE(ARGS, MoEArgs(num_experts=8, top_k=2, expert_hidden=24, shared_expert_hidden=16))
    x = torch.randn(2, 8, ARGS.dim)
    if where == "router weight":
        with torch.no_grad():
            reference.gate.weight[2, 5] = float("nan")  # every token's score of expert 2
    block = parallelize_module(copy.deepcopy(reference), tp_mesh(), moe_block_plan(experts=experts, shared_expert=True))
    if where == "one token's routing scores":
        def nan_scores(module, args, out):  # token 3's router logits and top-k weights
            logits, weights, index = out
            token = torch.tensor([3])
            return logits.index_fill(0, token, float("nan")), weights.index_fill(0, token, float("nan")), index

        reference.gate.register_forward_hook(nan_scores)
        block.gate.register_forward_hook(nan_scores)
    return reference, block, x


@on_ranks(2, 4)
def test_nan_routing_gives_every_rank_the_single_process_result():
    for experts in ("expert", "tensor"):
        for where in ("router weight", "one token's routing scores"):
            reference, block, x = _nan_block(experts, where)
            want, got = reference(x), block(x)
            assert not want.isfinite().all(), where
            torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"{experts}, {where}: {m}")
            want.nansum().backward()
            got.nansum().backward()
            assert_params_and_grads_match(block, reference, **TOL)
