"""The Llama-style transformer under torch_tp's TP and TP + SP plans equals the single-process model.

Each case runs on real gloo ranks: forward output, loss and every parameter gradient
match to 1e-5 (float32), and keep matching through 3 SGD-with-momentum steps.
"""

import copy
import functools

import torch
import torch.nn.functional as F
from torch_tp import parallelize_module
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.testing import (
    TOL,
    assert_trains_like,
    run_on_ranks,
    small_llama,
    small_llama_args,
    tp_mesh,
    world_sizes,
)

VOCAB = small_llama_args().vocab_size


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train_and_compare(sequence_parallel, steps=3):
    reference = small_llama(seed=0)
    model = copy.deepcopy(reference)
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=sequence_parallel))
    # SGD is linear in the gradient, so float32 reduction-order noise (~1e-6) stays that
    # small; Adam divides by sqrt(v) and turns noise on near-zero gradients into lr-sized steps.
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    # steps + 1 batches: the last compares the models after `steps` optimizer steps
    batches = ((torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))) for _ in range(steps + 1))
    return assert_trains_like(model, reference, batches, _loss, optimizer=sgd, **TOL)


@world_sizes(2, 4)
def test_tensor_parallel_llama_matches_single_process_through_3_steps(world_size):
    losses = run_on_ranks(_train_and_compare, world_size, False)
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    assert all(rank_losses == losses[0] for rank_losses in losses)


@world_sizes(2, 4)
def test_sequence_parallel_llama_matches_single_process_through_3_steps(world_size):
    losses = run_on_ranks(_train_and_compare, world_size, True)
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    assert all(rank_losses == losses[0] for rank_losses in losses)


def _parameter_placements(sequence_parallel):
    model = small_llama()
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=sequence_parallel))
    return {
        name: (str(p.placements[0]), tuple(p.to_local().shape))
        for name, p in model.named_parameters()
        if name.startswith(("tok_embeddings", "layers.0.", "norm", "output"))
    }


def test_llama_plan_places_every_parameter_as_documented():
    placements = run_on_ranks(_parameter_placements, 2, True)[0]
    assert placements == {
        "tok_embeddings.weight": ("S(0)", (32, 32)),
        "layers.0.attention_norm.weight": ("R", (32,)),
        "layers.0.attention.wq.weight": ("S(0)", (16, 32)),
        "layers.0.attention.wk.weight": ("S(0)", (16, 32)),
        "layers.0.attention.wv.weight": ("S(0)", (16, 32)),
        "layers.0.attention.wo.weight": ("S(1)", (32, 16)),
        "layers.0.ffn_norm.weight": ("R", (32,)),
        "layers.0.feed_forward.w1.weight": ("S(0)", (24, 32)),
        "layers.0.feed_forward.w2.weight": ("S(1)", (32, 24)),
        "layers.0.feed_forward.w3.weight": ("S(0)", (24, 32)),
        "norm.weight": ("R", (32,)),
        "output.weight": ("S(0)", (32, 32)),
    }
