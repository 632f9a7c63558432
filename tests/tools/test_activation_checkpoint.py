"""checkpoint_by_pattern: same values and names as without it; the selective policy re-runs no collective.

Under the sequence-parallel Llama plan each block's forward all-gathers its attention and
feed-forward inputs and reduce-scatters their outputs. A plain recompute re-issues 3 of
those collectives per block in backward (the last reduce-scatter is not needed, and the
non-reentrant recompute stops before it); ``save_collectives_and_matmuls`` keeps their results, so
the backward communicates exactly what it does without checkpointing (counted with
``CommDebugMode``).
"""

import copy
import warnings

import pytest
import torch
import torch._dynamo
import torch._functorch.config
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.flop_counter import FlopCounterMode

from torch_tp import checkpoint_by_pattern, parallelize_module, save_collectives_and_matmuls
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.testing import TOL, assert_comm_counts, assert_params_and_grads_match, comm_counts, on_ranks, small_llama, small_llama_args, tp_mesh

ARGS = small_llama_args()
POLICIES = {"full": None, "selective": save_collectives_and_matmuls}


def _loss(model, tokens):
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_checkpointed_model_keeps_names_values_and_gradients(policy):
    reference = small_llama(seed=0)
    model = checkpoint_by_pattern(copy.deepcopy(reference), "layers.*", policy=POLICIES[policy])
    assert list(model.state_dict()) == list(reference.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    loss, ref_loss = _loss(model, tokens), _loss(reference, tokens)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert_params_and_grads_match(model, reference, rtol=0, atol=0)


def _backward_flops(policy):
    model = small_llama(seed=0)
    if policy != "none":
        checkpoint_by_pattern(model, "layers.*", policy=POLICIES[policy])
    loss = _loss(model, torch.randint(0, ARGS.vocab_size, (2, 8)))
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return flops.get_total_flops()


def test_full_checkpoint_recomputes_the_matmuls_and_selective_keeps_them():
    plain, full, selective = (_backward_flops(policy) for policy in ("none", "full", "selective"))
    assert selective == plain
    assert full > plain


def _step_comm_counts(policy):
    """Collectives of one forward + backward (CommDebugMode's module tracker must see the
    forward for the recompute's modules); the forward's are the same under every policy."""
    model = small_llama(seed=0)
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=True))
    if policy != "none":
        checkpoint_by_pattern(model, "layers.*", policy=POLICIES[policy])
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    with CommDebugMode() as mode, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        _loss(model, tokens).backward()
    return comm_counts(mode)


@on_ranks(2)
def test_selective_policy_recomputes_no_collective_in_backward():
    plain = _step_comm_counts("none")
    full = _step_comm_counts("full")
    selective = _step_comm_counts("selective")
    assert_comm_counts(selective, plain, "step with save_collectives_and_matmuls vs without checkpointing")
    # a plain recompute re-runs each block's 2 input all-gathers and the attention output's
    # reduce-scatter; it stops before the feed-forward's (nothing saved depends on it)
    recompute = {"all_gather_into_tensor": 2 * ARGS.n_layers, "reduce_scatter_tensor": ARGS.n_layers}
    expected = {name: plain.get(name, 0) + recompute.get(name, 0) for name in set(plain) | set(recompute)}
    assert_comm_counts(full, expected, "step with full recompute")


@on_ranks(2)
def test_checkpointed_sequence_parallel_llama_matches_single_process():
    reference = small_llama(seed=0)
    model = copy.deepcopy(reference)
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=True))
    checkpoint_by_pattern(model, "layers.*", policy=save_collectives_and_matmuls)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    loss, ref_loss = _loss(model, tokens), _loss(reference, tokens)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_params_and_grads_match(model, reference, **TOL)


@on_ranks(2)
def test_selectively_checkpointed_sequence_parallel_llama_compiles_with_no_graph_break():
    # Full recompute does not compile on a tensor-parallel model in torch 2.13: AOTAutograd's
    # save_from_forward finds a DeviceMesh among the values it saves for backward (the
    # recomputed redistributes); the selective policy saves the collectives and compiles.
    torch._dynamo.reset()
    counters.clear()
    reference = small_llama(seed=0)
    model = copy.deepcopy(reference)
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=True))
    checkpoint_by_pattern(model, "layers.*", policy=save_collectives_and_matmuls)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        for step in range(2):
            tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
            loss, ref_loss = _loss(compiled, tokens), _loss(reference, tokens)
            loss.backward()
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, **TOL)
            assert_params_and_grads_match(model, reference, **TOL, what=f"step {step}")
    assert not counters["graph_break"]
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in reference.named_parameters()]
    torch._dynamo.reset()


# ---------------------------------------------------------------------- bad input


def test_unmatched_pattern_raises_naming_it():
    with pytest.raises(ValueError, match=r"checkpoint_by_pattern pattern 'blocks\.\*' matched no submodule of Transformer; closest"):
        checkpoint_by_pattern(small_llama(), ["layers.*", "blocks.*"])


def test_a_policy_that_is_not_one_raises():
    with pytest.raises(TypeError, match=r"checkpoint_by_pattern\(policy='selective'\): give None"):
        checkpoint_by_pattern(small_llama(), "layers.*", policy="selective")


def test_tensor_parallel_after_checkpointing_raises_naming_the_order():
    model = checkpoint_by_pattern(small_llama(), "layers.*")
    with pytest.raises(ValueError, match=r"parallelize_module: module 'layers\.0' \(TransformerBlock\) already went through checkpoint_by_pattern; apply the transforms in the order parallelize_module \(TP\), then checkpoint_by_pattern, then fully_shard_by_pattern"):
        parallelize_module(model, None, tensor_parallel_plan())


def test_checkpointing_twice_raises():
    model = checkpoint_by_pattern(small_llama(), "layers.0")
    with pytest.raises(ValueError, match=r"module 'layers\.0' .* already went through checkpoint_by_pattern"):
        checkpoint_by_pattern(model, "layers.1")
