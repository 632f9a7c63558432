"""``ReplicateParallel`` and ``replicate``: replicated parameters whose gradients are right, and
outputs that are what the single-process model computes (never a bare partial sum or strip)."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torch_tp import ReplicateParallel, RowwiseParallel, SpatialParallel, parallelize_module
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import (
    assert_params_and_grads_match,
    assert_trains_like,
    full_tensor,
    local_chunk,
    run_on_ranks,
    tp_mesh,
    world_sizes,
)

QWEN_ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=48, max_seq_len=16, qk_norm=True)
TOL = dict(rtol=1e-5, atol=1e-5)


def _mean_square(logits, _):
    return logits.pow(2).mean()


def _qk_norm_llama_matches_single_process(sequence_parallel):
    torch.manual_seed(0)
    reference = Transformer(QWEN_ARGS)
    with torch.no_grad():  # norms away from ones, so a wrong gradient or weight shows
        for name, param in reference.named_parameters():
            if "_norm" in name:
                param.uniform_(0.5, 1.5)
    plan = tensor_parallel_plan(sequence_parallel=sequence_parallel, qk_norm=True)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    assert model.layers[0].attention.q_norm.weight.placements == (Replicate(),)
    batches = ((torch.randint(0, QWEN_ARGS.vocab_size, (2, 8)), None) for _ in range(2))
    assert_trains_like(model, reference, batches, _mean_square, optimizer=functools.partial(torch.optim.SGD, lr=0.1), **TOL)


@world_sizes(2, 4)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_per_head_norms_with_replicate_parallel_match_single_process(world_size, sequence_parallel):
    run_on_ranks(_qk_norm_llama_matches_single_process, world_size, sequence_parallel)


def _partial_output_is_reduced():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    model = parallelize_module(
        copy.deepcopy(reference), tp_mesh(),
        {"0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Partial(), use_local_output=False)},
        replicate_unplanned_params=True,
    )
    x = torch.randn(3, 8)
    out = model(x)
    assert not isinstance(out, DTensor)  # the twin's value, reduced: not an unreduced local sum
    torch.testing.assert_close(out, reference(x), **TOL)
    out.sum().backward()
    reference(x).sum().backward()
    assert_params_and_grads_match(model, reference, **TOL)


@world_sizes(2, 4)
def test_a_replicated_module_fed_a_partial_sum_returns_the_reduced_value(world_size):
    run_on_ranks(_partial_output_is_reduced, world_size)


class _Head(nn.Module):
    """Global average pool + linear: the replicated head of a spatially sharded CNN."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x.mean(dim=(2, 3)))


def _spatial_cnn_with_replicated_head():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), _Head())
    plan = {"0": SpatialParallel(dim=3), "1": SpatialParallel(dim=3)}
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan, replicate_unplanned_params=True)
    image = torch.randn(2, 3, 6, 10)
    out = model(local_chunk(image, 3))
    torch.testing.assert_close(full_tensor(out), reference(image), **TOL)
    full_tensor(out).sum().backward()
    reference(image).sum().backward()
    assert_params_and_grads_match(model, reference, **TOL)


@world_sizes(2, 4)
def test_a_spatially_sharded_cnn_feeding_a_replicated_head_matches_single_process(world_size):
    run_on_ranks(_spatial_cnn_with_replicated_head, world_size)


def _sharded_output_stays_a_dtensor():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8))
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), {}, replicate_unplanned_params=True)
    x = torch.randn(4, 8)
    sharded = DTensor.from_local(local_chunk(x, 0), tp_mesh(), (Shard(0),))
    out = model(sharded)  # a sharded output stays a DTensor: never a bare strip
    assert isinstance(out, DTensor) and out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), reference(x), **TOL)


def test_a_replicated_module_never_hands_out_a_bare_strip():
    run_on_ranks(_sharded_output_stays_a_dtensor, 2)


def test_replicate_parallel_normalizes_and_validates_its_arguments():
    assert ReplicateParallel() == ReplicateParallel(input_layouts=Replicate())
    assert repr(ReplicateParallel(input_layouts=Shard(2))) == (
        "ReplicateParallel(input_layouts=Shard(dim=2), desired_input_layouts=None, use_local_output=True)"
    )
    with pytest.raises(TypeError, match="True or False"):
        ReplicateParallel(use_local_output="no")
    with pytest.raises(ValueError, match="same length"):
        ReplicateParallel(input_layouts=(Shard(2), None), desired_input_layouts=(Replicate(),))


def _gradients_reduced_once_in_backward():
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(0)
    reference = Transformer(QWEN_ARGS)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), tensor_parallel_plan(qk_norm=True))
    for _ in range(2):  # gradient accumulation: two backward passes before the step
        tokens = torch.randint(0, QWEN_ARGS.vocab_size, (2, 8))
        model(tokens).pow(2).mean().backward()
        reference(tokens).pow(2).mean().backward()
    grad = model.layers[0].attention.q_norm.weight.grad
    assert grad.placements == (Replicate(),)  # reduced in the backward, not left Partial
    assert_params_and_grads_match(model, reference, **TOL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CommDebugMode() as mode:
        optimizer.step()
    assert mode.get_total_counts() == 0, mode.get_comm_counts()


@world_sizes(2, 4)
def test_per_head_norm_gradients_are_reduced_once_so_the_optimizer_step_communicates_nothing(world_size):
    run_on_ranks(_gradients_reduced_once_in_backward, world_size)
