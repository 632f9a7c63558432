"""``ColwiseParallel(overlap=True)`` / ``RowwiseParallel(overlap=True)`` on real gloo ranks.

The overlapped Llama-style model (TP + SP, float32 and int8 weights) must equal the same
model without overlap, forward and backward, through SGD steps; the overlapped layers must
issue no all-gather / reduce-scatter of their own (their traffic is the fused ops' P2P),
and misuse must fail with errors that name the module.
"""

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module, runtime_checks
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import (
    quantize_weights,
    assert_params_and_grads_match,
    assert_trains_like,
    comm_counts,
    local_chunk,
    rank,
    record_p2p,
    run_on_ranks,
    tp_mesh,
    world_sizes,
)

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=48, max_seq_len=16)
TOL = dict(rtol=1e-5, atol=1e-5)


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _sgd_on_trainable(parameters):
    return torch.optim.SGD([p for p in parameters if p.requires_grad], lr=0.1, momentum=0.9)


def _overlapped_matches_unfused(quantized, steps):
    torch.manual_seed(0)
    reference = Transformer(ARGS)
    if quantized:
        reference = quantize_weights(reference)
    fused, unfused = copy.deepcopy(reference), copy.deepcopy(reference)
    parallelize_module(fused, tp_mesh(), tensor_parallel_plan(sequence_parallel=True, overlap=True))
    parallelize_module(unfused, tp_mesh(), tensor_parallel_plan(sequence_parallel=True))
    trainable = [p for p in fused.parameters() if p.requires_grad]
    batches = ((torch.randint(0, ARGS.vocab_size, (2, 8)), torch.randint(0, ARGS.vocab_size, (2, 8)))
               for _ in range(steps + 1))
    losses = assert_trains_like(fused, unfused, batches, _loss, optimizer=_sgd_on_trainable, **TOL, params=not quantized)
    return losses, len(trainable)


@world_sizes(2, 4)
def test_overlapped_llama_equals_the_unfused_model_through_training_steps(world_size):
    results = run_on_ranks(_overlapped_matches_unfused, world_size, False, 2)
    losses, trainable = results[0]
    assert trainable == 21 and losses[0] != losses[-1]  # every parameter trains
    assert all(rank_losses == losses for rank_losses, _ in results)


def test_overlapped_int8_llama_equals_the_unfused_int8_model():
    # int8 weights are frozen: gradients reach the norms (and the activations) only
    results = run_on_ranks(_overlapped_matches_unfused, 2, True, 1)
    losses, trainable = results[0]
    assert trainable == 5
    assert all(rank_losses == losses for rank_losses, _ in results)


def _collectives_of_one_block_forward():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=True, overlap=True))
    h = torch.randn(2, 8 // tp_mesh().size(), ARGS.dim)
    sends = []
    # CommDebugMode's full backward hooks hand every module call an alias of its input:
    # the siblings still share their gather (no warning, the same P2P steps)
    for tracker in (contextlib.nullcontext(), CommDebugMode()):
        with record_p2p() as records, warnings.catch_warnings(), runtime_checks(False), tracker:
            warnings.simplefilter("error")  # no sibling falls back to its own gather
            model.layers[0](h, model.rope)
        sends.append(len([r for r in records if r[0] == "send"]))
    return comm_counts(tracker), sends


def test_an_overlapped_block_shares_gathers_and_issues_no_collectives():
    counts, sends = run_on_ranks(_collectives_of_one_block_forward, 2)[0]
    # one fused gather for wq/wk/wv, one for w1/w3, and the wo, w2 reduce-scatters: one P2P step each
    assert sends == [4, 4]
    assert counts == {}, counts


def _siblings_on_different_inputs():
    torch.manual_seed(0)
    mesh = tp_mesh()
    reference = nn.ModuleDict({"q": nn.Linear(8, 6), "k": nn.Linear(8, 6)})
    fused = copy.deepcopy(reference)
    parallelize_module(fused, mesh, {"[qk]": ColwiseParallel(input_layouts=Shard(0), overlap=True)})
    x, memory = torch.randn(4 * mesh.size(), 8), torch.randn(4 * mesh.size(), 8)  # e.g. cross-attention
    local_x, local_memory = local_chunk(x, 0), local_chunk(memory, 0)
    with record_p2p() as shared, warnings.catch_warnings():
        warnings.simplefilter("error")
        q, k = fused["q"](local_x), fused["k"](local_x)  # one plain tensor: one gather
    with record_p2p() as separate, pytest.warns(UserWarning, match=r"under '' share one fused all-gather"):
        q2, k2 = fused["q"](local_x), fused["k"](local_memory)
    torch.testing.assert_close(q2, local_chunk(reference["q"](x), 1), **TOL)
    torch.testing.assert_close(k2, local_chunk(reference["k"](memory), 1), **TOL)
    torch.testing.assert_close(q, local_chunk(reference["q"](x), 1), **TOL)
    torch.testing.assert_close(k, local_chunk(reference["k"](x), 1), **TOL)
    return len(shared), len(separate)


def test_siblings_share_a_gather_on_one_input_and_stay_correct_on_two():
    for shared, separate in run_on_ranks(_siblings_on_different_inputs, 2):
        # P2P ops (a send and a receive per ring step, one step at world size 2): one fused
        # gather for q and k on the same input; on different inputs k gathers again
        assert (shared, separate) == (2, 4)


# ------------------------------------------------------------------ single layers


def _mlp_case(bias):
    torch.manual_seed(0)
    mesh = tp_mesh()
    reference = nn.Sequential(nn.Linear(16, 24, bias=bias), nn.GELU(), nn.Linear(24, 16, bias=bias))
    fused = copy.deepcopy(reference)
    parallelize_module(fused, mesh, {
        "0": ColwiseParallel(input_layouts=Shard(1), overlap=True),
        "2": RowwiseParallel(output_layouts=Shard(1), overlap=True),
    })
    x = torch.randn(3, 4 * mesh.size(), 16)
    local_x = local_chunk(x, 1).clone().requires_grad_()  # this rank's tokens, as a plain tensor
    x.requires_grad_()
    y, want = fused(local_x), reference(x)
    assert not isinstance(y, DTensor)
    torch.testing.assert_close(y, local_chunk(want, 1), **TOL)
    y.pow(2).sum().backward()
    want.pow(2).sum().backward()
    torch.testing.assert_close(local_x.grad, local_chunk(x.grad, 1), **TOL)
    assert_params_and_grads_match(fused, reference, **TOL, what="MLP")
    return True


@world_sizes(2, 4)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_overlapped_colwise_rowwise_pair_equals_the_single_process_mlp(world_size, bias):
    assert all(run_on_ranks(_mlp_case, world_size, bias))


def _replicated_input_case():
    torch.manual_seed(0)
    mesh = tp_mesh()
    layer = nn.Linear(8, 12)
    fused = copy.deepcopy(layer)
    parallelize_module(fused, mesh, ColwiseParallel(input_layouts=Shard(1), overlap=True, use_local_output=False))
    x = torch.randn(2, 4, 8)
    replicated = DTensor.from_local(x, mesh, [Replicate()])
    with CommDebugMode() as mode:
        y = fused(replicated)
    torch.testing.assert_close(y.full_tensor(), layer(x), **TOL)
    return comm_counts(mode), y.placements


def test_an_already_replicated_input_is_not_gathered_again():
    counts, placements = run_on_ranks(_replicated_input_case, 2)[0]
    assert counts == {} and placements == (Shard(2),)


def _uneven_sequence_case():
    mesh = tp_mesh()
    model = nn.Sequential(nn.Linear(8, 12))
    parallelize_module(model, mesh, {"0": ColwiseParallel(input_layouts=Shard(1), overlap=True)})
    # 3 + 3 + 3 + 1 tokens: a DTensor that knows its global sequence length of 10
    x = DTensor.from_local(
        torch.randn(2, 3 if rank() < 3 else 1, 8), mesh, [Shard(1)], shape=torch.Size([2, 10, 8]),
        stride=(80, 8, 1),
    )
    with pytest.raises(ValueError) as raised:
        model(x)
    return str(raised.value)


def test_an_uneven_sequence_is_rejected_with_the_module_path_and_a_fix():
    message = run_on_ranks(_uneven_sequence_case, 4)[0]
    assert "ColwiseParallel(overlap=True) on '0' (Linear): dim 1 of the activation has size 10" in message
    assert "does not split evenly over 4 ranks" in message and "overlap=False" in message


def _misuse_case():
    mesh = tp_mesh()
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    with pytest.raises(TypeError, match=r"RowwiseParallel\(overlap=True\) cannot handle '0' \(Embedding\)"):
        parallelize_module(model, mesh, {
            "1": ColwiseParallel(input_layouts=Shard(1), overlap=True),
            "0": RowwiseParallel(output_layouts=Shard(1), overlap=True),
        })
    # the whole plan is checked first: the valid entry was not applied either
    return isinstance(model[1].weight, DTensor)


def test_overlap_on_an_embedding_is_refused_before_anything_changes():
    assert run_on_ranks(_misuse_case, 2) == [False, False]


class _ScaledLinear(nn.Linear):
    """A Linear whose forward does more than the matmul: the fused ops would drop the scale."""

    def forward(self, x):
        return super().forward(x) * 2.0


@pytest.mark.parametrize("style", [ColwiseParallel(input_layouts=Shard(1), overlap=True),
                                   RowwiseParallel(output_layouts=Shard(1), overlap=True)], ids=["colwise", "rowwise"])
def test_overlap_on_a_linear_with_its_own_forward_is_refused_naming_it(style):
    # the fused forward runs F.linear: the subclass's scale would be lost silently (1.19 off before)
    with pytest.raises(TypeError, match=r"\(overlap=True\) cannot handle 'up' \(_ScaledLinear\): _ScaledLinear has"):
        style.check(_ScaledLinear(8, 8), 2, "up")
    style.check(nn.Linear(8, 8), 2, "up")  # a plain Linear still passes


def test_overlap_needs_a_sequence_sharded_layout():
    with pytest.raises(ValueError, match=r"ColwiseParallel\(overlap=True\) .* needs input_layouts=Shard\(d\)"):
        ColwiseParallel(overlap=True)
    with pytest.raises(ValueError, match=r"RowwiseParallel\(overlap=True\) .* got output_layouts=Replicate\(\)"):
        RowwiseParallel(overlap=True)
    with pytest.raises(ValueError, match=r"got input_layouts=Shard\(dim=-1\)"):
        ColwiseParallel(input_layouts=Shard(-1), overlap=True)
    with pytest.raises(TypeError, match=r"takes True or False"):
        RowwiseParallel(output_layouts=Shard(1), overlap="yes")
    with pytest.raises(ValueError, match=r"pass sequence_parallel=True"):
        tensor_parallel_plan(overlap=True)


def test_overlap_is_part_of_equality_and_shown_in_repr_only_when_set():
    fused = ColwiseParallel(input_layouts=Shard(1), overlap=True)
    assert fused != ColwiseParallel(input_layouts=Shard(1))
    assert repr(fused).endswith("overlap=True)")
    assert "overlap" not in repr(ColwiseParallel(input_layouts=Shard(1)))
