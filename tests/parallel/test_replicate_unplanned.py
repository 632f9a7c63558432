"""Parameters left out of the plan, replicated as DTensors on request: clip_grad_norm_ and
optimizers then work on the whole model (upstream fails with "mixed torch.Tensor and DTensor")."""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate

from torch_tp import parallelize_module
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import run_on_ranks, tp_mesh, world_sizes

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=48)
MAX_NORM = 0.05


def _backward(model, tokens):
    model(tokens).pow(2).mean().backward()


def _clip_matches_single_process():
    torch.manual_seed(0)
    reference = Transformer(ARGS)
    # Plain TP leaves every RMSNorm out of the plan.
    model = parallelize_module(
        copy.deepcopy(reference), tp_mesh(), tensor_parallel_plan(), replicate_unplanned_params=True
    )
    assert isinstance(model.norm.weight, DTensor) and model.norm.weight.placements == (Replicate(),)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
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
        torch.testing.assert_close(p.full_tensor(), ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@world_sizes(2, 4)
def test_clip_grad_norm_with_unplanned_params_replicated_matches_single_process(world_size):
    run_on_ranks(_clip_matches_single_process, world_size)


def _clip_without_the_option():
    model = parallelize_module(Transformer(ARGS), tp_mesh(), tensor_parallel_plan())
    assert not isinstance(model.norm.weight, DTensor)
    _backward(model, torch.randint(0, ARGS.vocab_size, (2, 8)))
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def test_without_the_option_unplanned_params_stay_plain_as_upstream():
    run_on_ranks(_clip_without_the_option, 2)


def _replicate_broadcasts_from_src_rank():
    model = Transformer(ARGS)
    rank = torch.distributed.get_rank()
    torch.nn.init.constant_(model.norm.weight, float(rank))
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(), replicate_unplanned_params=True)
    return model.norm.weight.to_local()[0].item()


def test_replicated_unplanned_params_are_broadcast_from_src_data_rank():
    assert run_on_ranks(_replicate_broadcasts_from_src_rank, 2) == [0.0, 0.0]
