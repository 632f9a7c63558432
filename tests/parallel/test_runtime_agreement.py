"""Collectives whose sizes come from data: one rank's bad data is a named error on every rank.

The mechanism (``torch_tp._agreement.check_on_every_rank`` before the data-dependent collectives
of a forward pass), fed corrupted inputs on the last rank only: MoE routes (ids past the last
expert, negative, fractional, another top-k, mismatched weights, another hidden width, fewer
replicated tokens, random ids) and a Rowwise layer's local width. Every outcome is the same
error on every rank within seconds: no abort (gloo's size check), no wait until the timeout.
"""

import time

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from torch_tp import RowwiseParallel, parallelize_module
from torch_tp._agreement import runtime_checks
from torch_tp.functional import expert_parallel, expert_tensor_parallel
from torch_tp.models.moe import GroupedExperts
from torch_tp.testing import on_ranks, rank, tp_mesh, world_size

E, T, H = 8, 12, 16


def _corrupt(case: str, x, index, weights, generator):
    """The last rank's inputs for ``case``."""
    index = index.clone()
    if case == "id_past_last_expert":
        index[0, 0] = E
    elif case == "negative_id":
        index[-1, -1] = -1
    elif case == "fractional_ids":
        index = index.double()
    elif case == "another_top_k":
        index, weights = torch.cat([index, index[:, :1]], 1), torch.cat([weights, weights[:, :1]], 1)
    elif case == "weights_of_another_shape":
        weights = weights[:, :1]
    elif case == "another_hidden_width":
        x = x[:, : H // 2]
    elif case == "fewer_replicated_tokens":
        x, index, weights = x[:-1], index[:-1], weights[:-1]
    elif case.startswith("random_ids"):
        index = torch.randint(-2 * E, 2 * E, index.shape, generator=generator)
    return x, index, weights


CASES = ["id_past_last_expert", "negative_id", "fractional_ids", "another_top_k", "weights_of_another_shape",
         "another_hidden_width", "fewer_replicated_tokens", "random_ids_1", "random_ids_2", "random_ids_3"]


@on_ranks(2, 4)
@pytest.mark.parametrize("layout", [Replicate(), Shard(0)], ids=["replicated", "own"])
def test_bad_routing_on_one_rank_is_a_named_error_on_every_rank_within_seconds(layout):
    outcomes = {}
    for style, parallelize in (("ExpertParallel", expert_parallel), ("ExpertTensorParallel", expert_tensor_parallel)):
        experts = parallelize(GroupedExperts(H, 12, num_experts=E), tp_mesh(), input_layouts=layout)
        for case in CASES:
            if case == "fewer_replicated_tokens" and layout == Shard(0):
                continue  # each rank's own tokens may differ in number
            generator = torch.Generator().manual_seed(hash(case) % 1000)
            x = torch.randn(T, H, generator=generator)
            index = torch.stack([torch.randperm(E, generator=generator)[:2] for _ in range(T)])
            weights = torch.rand(index.shape, generator=generator)
            if rank() == world_size() - 1:
                x, index, weights = _corrupt(case, x, index, weights, generator)
            start = time.monotonic()
            try:
                experts(x, index, weights)
                outcomes[style, case] = "ran"
            except (ValueError, TypeError) as error:
                assert style in str(error), str(error)
                outcomes[style, case] = "refused"
            assert time.monotonic() - start < 10, (style, case)
    assert set(outcomes.values()) == {"refused"}, outcomes  # on this rank; a rank that ran would hang the others


@on_ranks(2, 4)
def test_a_rowwise_layer_fed_another_width_on_one_rank_is_refused_on_every_rank():
    torch.manual_seed(0)
    layer = parallelize_module(nn.Linear(8 * world_size(), 4), tp_mesh(), RowwiseParallel())
    width = 8 + (1 if rank() == world_size() - 1 else 0)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"RowwiseParallel.*size 9 along its sharded dim 1.*is 8"):
        layer(torch.ones(2, width))
    assert time.monotonic() - start < 10


@on_ranks(2)
def test_runtime_checks_can_be_turned_off_for_known_good_inputs():
    experts = expert_parallel(GroupedExperts(H, 12, num_experts=E), tp_mesh())
    index = torch.stack([torch.arange(2) + i % (E - 1) for i in range(T)])
    with runtime_checks(False):
        out = experts(torch.ones(T, H), index, torch.ones(T, 2))
    assert out.shape == (T, H)
