"""Tied parameters stay tied: a tied-embedding Llama trains like one process; a plan that would
untie a shared parameter is refused before anything changes."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import assert_trains_like, run_on_ranks, tp_mesh, world_sizes

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=48, max_seq_len=16, tie_embeddings=True)


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _tied_llama_trains_like_one_process(sequence_parallel):
    torch.manual_seed(0)
    reference = Transformer(ARGS)
    assert reference.output.weight is reference.tok_embeddings.weight
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), tensor_parallel_plan(sequence_parallel=sequence_parallel))
    assert model.output.weight is model.tok_embeddings.weight
    assert isinstance(model.output.weight, DTensor)
    assert len(list(model.parameters())) == len(list(reference.parameters()))
    batches = ((torch.randint(0, ARGS.vocab_size, (2, 8)), torch.randint(0, ARGS.vocab_size, (2, 8))) for _ in range(3))
    losses = assert_trains_like(model, reference, batches, _loss, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    assert model.output.weight is model.tok_embeddings.weight
    return losses


@world_sizes(2, 4)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tied_embedding_llama_keeps_its_tie_and_matches_single_process_through_3_adamw_steps(world_size, sequence_parallel):
    losses = run_on_ranks(_tied_llama_trains_like_one_process, world_size, sequence_parallel)
    assert losses[0][0] != losses[0][-1] and all(rank_losses == losses[0] for rank_losses in losses)


def _tied_pair():
    model = nn.ModuleDict({"embed": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False)})
    model["head"].weight = model["embed"].weight
    return model


def _refusals():
    messages = {}
    for name, plan in {
        "different placements": {"embed": ColwiseParallel(), "head": ColwiseParallel()},
        "one sharer unplanned": {"embed": RowwiseParallel()},
    }.items():
        model = _tied_pair()
        with pytest.raises(ValueError) as info:
            parallelize_module(model, tp_mesh(), plan)
        assert model["head"].weight is model["embed"].weight and not isinstance(model["head"].weight, DTensor)
        messages[name] = str(info.value)
    model = parallelize_module(_tied_pair(), tp_mesh(), {"embed": RowwiseParallel(), "head": ColwiseParallel()})
    assert model["head"].weight is model["embed"].weight
    return messages


def test_a_plan_that_would_untie_a_shared_parameter_raises_naming_both_modules_and_a_fix():
    messages = run_on_ranks(_refusals, 2)[0]
    different = messages["different placements"]
    assert "'embed.weight' -> Shard(dim=1)" in different and "'head.weight' -> Shard(dim=0)" in different
    assert "RowwiseParallel()" in different  # the embedding style that would place it as Shard(0)
    unplanned = messages["one sharer unplanned"]
    assert "'head.weight' -> left plain (not in the plan)" in unplanned
    assert "'head': ColwiseParallel()" in unplanned


# ----------------------------------------------------------------- a tie split across two calls


class _TiedLM(nn.Module):
    """A base model holding the embedding, and a head outside it tied to the embedding (how
    transformers lays out a causal LM: its base-model plan and its ``lm_head`` are applied apart)."""

    def __init__(self):
        super().__init__()
        self.base = nn.ModuleDict({"embed": nn.Embedding(16, 8), "proj": nn.Linear(8, 8)})
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.base.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.base.proj(self.base.embed(tokens))))


_BASE_PLAN = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}


def _two_calls_train_like_one_process(user_reties):
    torch.manual_seed(0)
    reference = _TiedLM()
    model = copy.deepcopy(reference)
    parallelize_module(model.base, tp_mesh(), _BASE_PLAN)  # the head, outside, still holds the old tensor
    parallelize_module(model, tp_mesh(), {"head": ColwiseParallel(output_layouts=Replicate())})
    assert model.head.weight is model.base.embed.weight  # tied again by torch_tp
    if user_reties:  # upstream's recipe re-ties by hand: harmless
        model.head.weight = model.base.embed.weight
    batches = ((torch.randint(0, 16, (2, 5)), torch.randint(0, 16, (2, 5))) for _ in range(3))
    assert_trains_like(model, reference, batches, _loss, optimizer=functools.partial(torch.optim.SGD, lr=0.5))
    return len(list(model.parameters())) == len(list(reference.parameters()))


@world_sizes(2, 4)
@pytest.mark.parametrize("user_reties", [False, True], ids=["torch_tp_reties", "user_reties_too"])
def test_a_tie_split_across_two_calls_is_kept_and_trains_like_one_process(world_size, user_reties):
    assert run_on_ranks(_two_calls_train_like_one_process, world_size, user_reties) == [True] * world_size


def _split_tie_refusals():
    messages = {}
    for name, second_plan in (("placed differently", {"head": RowwiseParallel()}),
                              ("left plain", {"base.proj": ColwiseParallel()})):
        model = _TiedLM()
        parallelize_module(model.base, tp_mesh(), _BASE_PLAN)
        with pytest.raises(ValueError) as info:
            parallelize_module(model, tp_mesh(), second_plan)
        assert not isinstance(model.head.weight, DTensor)  # refused before anything moved
        messages[name] = str(info.value)
    return messages


def test_a_second_call_that_would_leave_a_split_tie_placed_differently_is_refused():
    messages = run_on_ranks(_split_tie_refusals, 2)[0]
    for message in messages.values():
        assert "'head.weight' is tied to the one an earlier parallelize_module call placed as Shard(dim=0)" in message
        assert "Place 'head' with ColwiseParallel()" in message, message
    assert "places it as Shard(dim=1)" in messages["placed differently"]
    assert "leaves it plain" in messages["left plain"]
