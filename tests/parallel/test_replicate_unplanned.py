"""Parameters left out of the plan, replicated as DTensors on request: clip_grad_norm_ and
optimizers then work on the whole model (upstream fails with "mixed torch.Tensor and DTensor")."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from torch_tp import parallelize_module
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.testing import TOL, on_ranks, rank, small_llama, small_llama_args, tp_mesh, world_size

VOCAB = small_llama_args().vocab_size
MAX_NORM = 0.05


def _backward(model, tokens):
    model(tokens).pow(2).mean().backward()


@on_ranks(2, 4)
def test_clip_grad_norm_with_unplanned_params_replicated_matches_single_process():
    reference = small_llama(seed=0)
    # Plain TP leaves every RMSNorm out of the plan.
    model = parallelize_module(
        copy.deepcopy(reference), tp_mesh(), tensor_parallel_plan(), replicate_unplanned_params=True
    )
    assert isinstance(model.norm.weight, DTensor) and model.norm.weight.placements == (Replicate(),)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    tokens = torch.randint(0, VOCAB, (2, 8))
    _backward(model, tokens)
    _backward(reference, tokens)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    assert ref_total > MAX_NORM  # clipping really happens
    torch.testing.assert_close(total.full_tensor(), ref_total, rtol=1e-5, atol=1e-6)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    optimizer, ref_optimizer = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    optimizer.step()
    ref_optimizer.step()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), ref, **TOL, msg=lambda m: f"{name}: {m}")


@on_ranks(2)
def test_without_the_option_unplanned_params_stay_plain_as_upstream():
    model = parallelize_module(small_llama(), tp_mesh(), tensor_parallel_plan())
    assert not isinstance(model.norm.weight, DTensor)
    _backward(model, torch.randint(0, VOCAB, (2, 8)))
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


@on_ranks(2)
def test_replicated_unplanned_params_are_broadcast_from_src_data_rank():
    model = small_llama()
    torch.nn.init.constant_(model.norm.weight, float(rank()))
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(), replicate_unplanned_params=True)
    assert model.norm.weight.to_local()[0].item() == 0.0  # rank 0's value on every rank


@on_ranks(2, 4)
def test_replicate_of_a_container_whose_children_hold_plain_parameters_names_them_on_a_dtensor_input():
    # before: a Partial input reached the plain LayerNorm inside and failed in DTensor's words
    from torch.distributed.tensor import Partial

    from torch_tp.parallel.replicate import replicate

    torch.manual_seed(0)
    block = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
    reference = copy.deepcopy(block)
    replicate(block, tp_mesh(), module_path="head")
    x = torch.randn(2, 4)
    partial = DTensor.from_local(x / world_size(), tp_mesh(), [Partial()])
    with pytest.raises(ValueError, match=r"torch_tp.parallel.replicate on 'head' .*'head.0' still holds plain "
                                         r"parameters \('weight'\).*replicate_unplanned_params=True"):
        block(partial)
    for child in block:  # what the message says to do: replicate each descendant too
        replicate(child, tp_mesh())
    torch.testing.assert_close(block(partial), reference(x), **TOL)
