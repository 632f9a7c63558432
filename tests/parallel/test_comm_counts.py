"""Collectives of one forward and one backward, counted with CommDebugMode and pinned with expecttest.

Measured on upstream ``torch.distributed.tensor.parallel`` with the usual Llama block plan
(wq/wk/wv/w1/w3 colwise, wo/w2 rowwise): 2 all-reduces forward and 5 in backward, one per
colwise layer, because each colwise layer makes its own replicated DTensor of the same
input. torch_tp's documented plan makes that DTensor once per attention / feed-forward
module, so backward needs 2. With sequence parallelism both stay at 2 all-gathers and 2
reduce-scatters each way.
"""

import expecttest
import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel as UpstreamColwise
from torch.distributed.tensor.parallel import RowwiseParallel as UpstreamRowwise
from torch.distributed.tensor.parallel import parallelize_module as upstream_parallelize_module

from torch_tp import parallelize_module
from torch_tp.models.llama import TransformerBlock, block_tensor_parallel_plan, rotary_table, tensor_parallel_plan
from torch_tp import runtime_checks
from torch_tp.testing import comm_counts, run_on_ranks, small_llama, small_llama_args, tp_mesh, world_sizes

ARGS = small_llama_args()
SEQ = 8


def _format(forward, backward):
    def line(counts):
        return ", ".join(f"{name}={n}" for name, n in sorted(counts.items())) or "none"

    return f"forward: {line(forward)}\nbackward: {line(backward)}"


def _count_block(module, x, rope):
    with runtime_checks(False):  # the plan's collectives (the checks': tests/parallel/test_runtime_agreement.py)
        with CommDebugMode() as forward_mode:
            out = module(x, rope)
        with CommDebugMode() as backward_mode:
            out.sum().backward()
    return _format(comm_counts(forward_mode), comm_counts(backward_mode))


def _block_input(sequence_parallel):
    world = torch.distributed.get_world_size()
    seq = SEQ // world if sequence_parallel else SEQ
    return torch.randn(2, seq, ARGS.dim, requires_grad=True), rotary_table(ARGS.head_dim, 16, 1e4)


def _torch_tp_block_counts(sequence_parallel):
    block = TransformerBlock(ARGS)
    parallelize_module(block, tp_mesh(), block_tensor_parallel_plan(sequence_parallel=sequence_parallel))
    return _count_block(block, *_block_input(sequence_parallel))


def _upstream_block_counts():
    block = TransformerBlock(ARGS)
    plan = {
        "attention.wq": UpstreamColwise(),
        "attention.wk": UpstreamColwise(),
        "attention.wv": UpstreamColwise(),
        "attention.wo": UpstreamRowwise(),
        "feed_forward.w1": UpstreamColwise(),
        "feed_forward.w3": UpstreamColwise(),
        "feed_forward.w2": UpstreamRowwise(),
    }
    upstream_parallelize_module(block, tp_mesh(), plan)
    return _count_block(block, *_block_input(False))


def _torch_tp_model_counts(sequence_parallel):
    model = small_llama()
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=sequence_parallel))
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ))
    with runtime_checks(False), CommDebugMode() as forward_mode:
        logits = model(tokens)
    with CommDebugMode() as backward_mode:
        logits.sum().backward()
    return _format(comm_counts(forward_mode), comm_counts(backward_mode))


def _assert_counts(task, world_size, *args, expect):
    """Every rank counted the same collectives, and they read ``expect``.

    ``expect`` is the caller's inline literal: EXPECTTEST_ACCEPT=1 rewrites it there (one call
    site per expected text; parametrized cases must all print the same text).
    """
    counts = run_on_ranks(task, world_size, *args)
    assert len(set(counts)) == 1, counts
    expecttest.assert_expected_inline(counts[0], expect, skip=1)


def test_upstream_usual_plan_issues_one_backward_all_reduce_per_colwise_layer():
    _assert_counts(_upstream_block_counts, 2, expect="""\
forward: all_reduce=2
backward: all_reduce=5""")


@world_sizes(2, 4)
def test_torch_tp_plan_issues_two_backward_all_reduces_per_block(world_size):
    _assert_counts(_torch_tp_block_counts, world_size, False, expect="""\
forward: all_reduce=2
backward: all_reduce=2""")


@world_sizes(2, 4)
def test_torch_tp_sequence_parallel_block_gathers_and_scatters_twice_each_way(world_size):
    _assert_counts(_torch_tp_block_counts, world_size, True, expect="""\
forward: all_gather_into_tensor=2, reduce_scatter_tensor=2
backward: all_gather_into_tensor=2, reduce_scatter_tensor=2""")


def test_two_layer_model_tensor_parallel():
    # forward: embedding all-reduce + 2 per block, one gather of the logits;
    # backward: 2 per block + 1 for the output head's (replicated) input.
    _assert_counts(_torch_tp_model_counts, 2, False, expect="""\
forward: all_gather_into_tensor=1, all_reduce=5
backward: all_reduce=5""")


def test_two_layer_model_sequence_parallel():
    # forward: 2 + 2 per block, the head's input gather and logits gather, the
    # embedding's reduce-scatter; backward mirrors them (the logits gather needs none).
    _assert_counts(_torch_tp_model_counts, 2, True, expect="""\
forward: all_gather_into_tensor=6, reduce_scatter_tensor=5
backward: all_gather_into_tensor=5, reduce_scatter_tensor=5""")
