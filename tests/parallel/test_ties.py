"""Tied parameters stay tied: a tied-embedding Llama trains like one process; a plan that would
untie a shared parameter is refused before anything changes."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

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
