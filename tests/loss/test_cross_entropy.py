"""``torch_tp.loss.cross_entropy`` on vocab-sharded logits equals ``F.cross_entropy`` of the full logits.

Every case runs on real gloo ranks and compares with single-process ``F.cross_entropy`` on the
full logits: the loss and the logits' gradient (the gathered local gradients) to 1e-6 in
float32 and to 1e-12 in float64 (every op computes in the logits' dtype), for label
smoothing, ignored tokens, all three reductions, uneven vocab shards (one rank holding an
empty slice included) and a ("dp", "tp") mesh. A small Llama whose output head
returns vocab-sharded logits trains one step like the single-process model (TP and TP + SP
plans). The forward issues exactly two all-reduces and the backward none, every
tensor-parallel rank gets the same loss bit for bit, and no op on a rank allocates more than
its vocab slice of the logits (or three values per token), far less than the full logits.
"""

import copy

import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel as upstream_loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch_tp import ColwiseParallel, parallelize_module
from torch_tp.loss import cross_entropy, loss_parallel
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.testing import (
    TOL,
    assert_comm_counts,
    assert_params_and_grads_match,
    comm_counts,
    mesh_2x2,
    on_ranks,
    rank,
    run_on_ranks,
    small_llama,
    small_llama_args,
    tp_mesh,
    world_size,
    world_sizes,
)

# float32, one process vs vocab slices: only the order of a few sums differs.
EXACT = dict(rtol=1e-6, atol=1e-6)
# float64: the same sums in another order, each exact to the last few bits
FLOAT64_EXACT = dict(rtol=1e-12, atol=1e-12)
SEQ = 5
VOCAB = small_llama_args().vocab_size

# name -> (vocab, tokens to ignore?, cross_entropy keywords)
CASES = {
    "plain": (VOCAB, False, {}),
    "label_smoothing": (VOCAB, False, dict(label_smoothing=0.1)),
    "ignore_index": (VOCAB, True, {}),
    "ignore_index_in_vocab_with_smoothing": (VOCAB, True, dict(ignore_index=5, label_smoothing=0.2)),
    "uneven_vocab_10": (10, True, dict(label_smoothing=0.1)),  # 5, 5 / 3, 3, 3, 1
    "uneven_vocab_13": (13, False, {}),  # 7, 6 / 4, 4, 4, 1
    "vocab_3_one_empty_slice": (3, True, dict(label_smoothing=0.1)),  # 2, 1 / 1, 1, 1, 0
}
REDUCTIONS = ["mean", "sum", "none"]


def _inputs(vocab, ignored, *, batch=2, ignore_index=-100, seed=0, dtype=torch.float32):
    """Full logits ``(batch, SEQ, vocab)``, targets (some ignored) and weights for a ``"none"`` loss."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(batch, SEQ, vocab, generator=gen, dtype=dtype)
    target = torch.randint(0, vocab, (batch, SEQ), generator=gen)
    if ignored:
        target[0, 1] = target[-1, 3] = target[-1, 4] = ignore_index
    weights = torch.rand(batch, SEQ, generator=gen, dtype=dtype)
    return logits, target, weights


def _backward(loss, weights):
    (loss if loss.ndim == 0 else (loss * weights).sum()).backward()


def _reference(full, target, weights, row_blocks, **kwargs):
    """``F.cross_entropy`` of each block of rows of the full logits; the losses and the full grad."""
    full = full.clone().requires_grad_()
    losses = []
    for rows in row_blocks:
        logits, tgt = full[rows], target[rows]
        loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), **kwargs)
        loss = loss.view(tgt.shape) if loss.ndim else loss
        _backward(loss, weights[rows])
        losses.append(loss.detach())
    return losses, full.grad


# ----------------------------------------------------------------------------- 1-D mesh


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(CASES))
@on_ranks(2, 4)
def test_cross_entropy_equals_full_logits_loss_and_grad(case, reduction):
    vocab, ignored, kwargs = CASES[case]
    full, target, weights = _inputs(vocab, ignored, ignore_index=kwargs.get("ignore_index", -100))
    logits = distribute_tensor(full, tp_mesh(), [Shard(-1)]).requires_grad_()
    loss = cross_entropy(logits, target, reduction=reduction, **kwargs)
    _backward(loss, weights)
    (ref_loss,), ref_grad = _reference(full, target, weights, [slice(None)], reduction=reduction, **kwargs)
    assert type(loss) is torch.Tensor and loss.shape == ref_loss.shape
    torch.testing.assert_close(loss, ref_loss, **EXACT)
    assert logits.grad.placements == logits.placements
    torch.testing.assert_close(logits.grad.full_tensor(), ref_grad, **EXACT)


def _loss_and_comm_counts(label_smoothing):
    full, target, _ = _inputs(10, True)
    logits = distribute_tensor(full, tp_mesh(), [Shard(2)]).requires_grad_()
    with CommDebugMode() as forward:
        loss = cross_entropy(logits, target, label_smoothing=label_smoothing)
    with CommDebugMode() as backward:
        loss.backward()
    return loss.item(), comm_counts(forward), comm_counts(backward)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@world_sizes(2, 4)
def test_every_rank_gets_the_same_loss_from_two_forward_all_reduces_and_no_backward_collective(
    world_size, label_smoothing
):
    results = run_on_ranks(_loss_and_comm_counts, world_size, label_smoothing)
    assert len({loss for loss, _, _ in results}) == 1, results  # bit for bit
    for _, forward, backward in results:
        assert_comm_counts(forward, {"all_gather": 1, "all_reduce": 2},
                           "forward: the targets' agreement (8 bytes per rank), MAX, then one SUM of the stacked sums")
        assert_comm_counts(backward, {}, "backward: local")


# ----------------------------------------------------------------------------- float64


class _FloatDtypes(TorchDispatchMode):
    """Every floating dtype an op outputs on this rank, with the first op that output it."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                self.seen.setdefault(t.dtype, str(func))
        return out


F64_CASES = ["plain", "label_smoothing", "ignore_index_in_vocab_with_smoothing", "uneven_vocab_10",
             "vocab_3_one_empty_slice"]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", F64_CASES)
@on_ranks(2, 4)
def test_float64_loss_and_grad_equal_full_logits_loss_to_float64_precision(case, reduction):
    vocab, ignored, kwargs = CASES[case]
    full, target, weights = _inputs(vocab, ignored, ignore_index=kwargs.get("ignore_index", -100),
                                    dtype=torch.float64)
    logits = distribute_tensor(full, tp_mesh(), [Shard(-1)]).requires_grad_()
    loss = cross_entropy(logits, target, reduction=reduction, **kwargs)
    _backward(loss, weights)
    (ref_loss,), ref_grad = _reference(full, target, weights, [slice(None)], reduction=reduction, **kwargs)
    assert loss.dtype == logits.grad.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, **FLOAT64_EXACT)
    # a float32 piece anywhere (e.g. torch.where on two Python floats) leaves errors of ~1e-9 here
    torch.testing.assert_close(logits.grad.full_tensor(), ref_grad, **FLOAT64_EXACT)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@on_ranks(2, 4)
def test_every_op_computes_in_the_logits_dtype(dtype):
    # the mechanism behind the test above: no op, forward or backward, outputs another
    # floating dtype (a Python scalar or a factory without dtype= gives float32; an upcast float64)
    full, target, weights = _inputs(10, True, dtype=dtype)
    logits = distribute_tensor(full, tp_mesh(), [Shard(-1)]).requires_grad_()
    for reduction in REDUCTIONS:
        with _FloatDtypes() as mode:
            _backward(cross_entropy(logits, target, label_smoothing=0.1, reduction=reduction), weights)
        assert set(mode.seen) == {dtype}, (reduction, mode.seen)


# ----------------------------------------------------------------------------- ("dp", "tp") mesh


@pytest.mark.parametrize("target_as", ["tensor", "dtensor"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("batch_layout", ["Shard(0)", "Replicate()"])
@on_ranks(4)
def test_on_dp_tp_mesh_each_dp_rank_gets_the_loss_of_its_batch_shard(batch_layout, reduction, target_as):
    mesh = mesh_2x2()
    full, target, weights = _inputs(VOCAB, True, batch=4)
    sharded = batch_layout == "Shard(0)"
    dp_layout = Shard(0) if sharded else Replicate()
    logits = distribute_tensor(full, mesh, [dp_layout, Shard(2)]).requires_grad_()
    # the reference: F.cross_entropy of each dp rank's batch, and the gradient of each of those
    blocks = [slice(0, 2), slice(2, 4)] if sharded else [slice(None)]
    ref_losses, ref_grad = _reference(full, target, weights, blocks, label_smoothing=0.1, reduction=reduction)
    mine = mesh.get_local_rank("dp") if sharded else 0
    if target_as == "tensor":
        my_target = target[blocks[mine]]
    else:  # read as its local value: this dp rank's batch
        my_target = distribute_tensor(target, mesh, [dp_layout, Replicate()])
    loss = cross_entropy(logits, my_target, label_smoothing=0.1, reduction=reduction)
    _backward(loss, weights[blocks[mine]])
    torch.testing.assert_close(loss, ref_losses[mine], **EXACT)
    torch.testing.assert_close(logits.grad.full_tensor(), ref_grad, **EXACT)


def _loss_on_2x2():
    full, target, _ = _inputs(VOCAB, False, batch=4)
    mesh = mesh_2x2()
    logits = distribute_tensor(full, mesh, [Shard(0), Shard(2)])
    dp = mesh.get_local_rank("dp")
    return cross_entropy(logits, target[2 * dp : 2 * dp + 2]).item()


def test_on_dp_tp_mesh_the_ranks_of_a_tp_group_agree_and_dp_groups_differ():
    losses = run_on_ranks(_loss_on_2x2, 4)
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2], losses


# ----------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@on_ranks(2, 4)
def test_llama_with_vocab_sharded_output_trains_one_step_like_single_process(sequence_parallel):
    reference = small_llama(seed=0)
    model = copy.deepcopy(reference)
    plan = tensor_parallel_plan(sequence_parallel=sequence_parallel)
    between = Shard(1) if sequence_parallel else Replicate()
    plan["output"] = ColwiseParallel(input_layouts=between, use_local_output=False)
    parallelize_module(model, tp_mesh(), plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    tokens = torch.randint(0, VOCAB, (2, 8))
    targets = torch.randint(0, VOCAB, (2, 8))
    targets[1, -2:] = -100

    logits = model(tokens)
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    loss = cross_entropy(logits, targets, label_smoothing=0.1)
    loss.backward()
    ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten(), label_smoothing=0.1)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, **EXACT)
    assert_params_and_grads_match(model, reference, **TOL, what="after backward")
    optimizer.step()
    ref_optimizer.step()
    assert_params_and_grads_match(model, reference, **TOL, what="after the step")


# ----------------------------------------------------------------------------- memory


class _LargestOutput(TorchDispatchMode):
    """The most elements any op's output holds on this rank (a DTensor counts its local shard)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                local = t._local_tensor if isinstance(t, DTensor) else t
                self.largest = max(self.largest, local.numel())
        return out


def _largest_allocations(vocab):
    full, target, _ = _inputs(vocab, True, batch=4)
    logits = distribute_tensor(full, tp_mesh(), [Shard(2)]).requires_grad_()
    with _LargestOutput() as sharded:
        cross_entropy(logits, target, label_smoothing=0.1).backward()
    reference = full.clone().requires_grad_()
    with _LargestOutput() as unsharded:
        F.cross_entropy(reference.flatten(0, 1), target.flatten(), label_smoothing=0.1).backward()
    return sharded.largest, unsharded.largest, logits.to_local().numel()


@pytest.mark.parametrize("vocab", [VOCAB, 13])
@world_sizes(2, 4)
def test_no_op_allocates_more_than_one_vocab_slice_of_the_logits(world_size, vocab):
    tokens = 4 * SEQ
    full_logits = tokens * vocab
    for largest, unsharded, local_slice in run_on_ranks(_largest_allocations, world_size, vocab):
        assert unsharded >= full_logits  # the counter sees F.cross_entropy's full-size tensors
        # the largest: exp(x - max) and the gradient, one vocab slice each; or the 3 sums per
        # token of the SUM all-reduce, on a rank whose slice is narrower than 3 columns
        assert largest <= max(local_slice, 3 * tokens) < full_logits, (largest, local_slice, full_logits)


# ----------------------------------------------------------------------------- errors


def test_plain_tensor_logits_raise_type_error_naming_the_style():
    with pytest.raises(TypeError, match=r"got Tensor.*ColwiseParallel\(use_local_output=False\)"):
        cross_entropy(torch.randn(2, 5, 8), torch.zeros(2, 5, dtype=torch.long))


def test_loss_parallel_is_upstreams():
    assert loss_parallel is upstream_loss_parallel


def _bad_call(case):
    full, target, _ = _inputs(8, False)
    sharded = distribute_tensor(full, tp_mesh(), [Shard(2)])
    if case == "replicated_logits":
        return cross_entropy(distribute_tensor(full, tp_mesh(), [Replicate()]), target)
    if case == "batch_sharded_logits":
        return cross_entropy(distribute_tensor(full, tp_mesh(), [Shard(0)]), target)
    if case == "vocab_sharded_on_both_mesh_dims":
        return cross_entropy(distribute_tensor(full, mesh_2x2(), [Shard(2), Shard(2)]), target)
    if case == "partial_on_dp":
        local = distribute_tensor(full, mesh_2x2(), [Replicate(), Shard(2)]).to_local()
        return cross_entropy(DTensor.from_local(local, mesh_2x2(), [Partial(), Shard(2)]), target)
    if case == "target_shape":
        return cross_entropy(sharded, target[0])
    if case == "target_probabilities":
        return cross_entropy(sharded, torch.rand(2, SEQ))
    if case == "target_out_of_vocab":
        return cross_entropy(sharded, torch.full((2, SEQ), 8))
    if case == "target_sharded_on_tp":
        return cross_entropy(sharded, distribute_tensor(target, tp_mesh(), [Shard(0)]))
    if case == "reduction":
        return cross_entropy(sharded, target, reduction="avg")
    if case == "label_smoothing":
        return cross_entropy(sharded, target, label_smoothing=1.5)
    raise AssertionError(case)


# name -> (world size, exception, pattern)
BAD_INPUTS = {
    "replicated_logits": (2, ValueError, r"placements \(Replicate\(\),\).*ColwiseParallel\(use_local_output=False\)"),
    "batch_sharded_logits": (2, ValueError, r"placements \(Shard\(dim=0\),\) \(sharded on no mesh dim\)"),
    "vocab_sharded_on_both_mesh_dims": (4, ValueError, r"sharded on 2 mesh dims"),
    "partial_on_dp": (4, ValueError, r"got Partial\(sum\) on mesh dim 0"),
    "target_shape": (2, ValueError, r"target of shape \(2, 5\) .*got \(5,\)"),
    "target_probabilities": (2, ValueError, r"class indices .*got torch.float32"),
    "target_out_of_vocab": (2, ValueError, r"target index 8, outside the vocab \[0, 8\)"),
    "target_sharded_on_tp": (2, ValueError, r"Replicate\(\) on the tensor-parallel mesh dim 0"),
    "reduction": (2, ValueError, r"reduction must be one of .*'avg'"),
    "label_smoothing": (2, ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
}


def _on_one_rank(case):
    """The last rank alone passes a bad target or other options; returns what this rank raised."""
    full, target = torch.randn(2, SEQ, 8), torch.randint(0, 8, (2, SEQ))
    sharded = distribute_tensor(full, tp_mesh(), [Shard(2)])
    options = {}
    if rank() == world_size() - 1:
        if case == "out_of_vocab":
            target[0, 0] = 8
        elif case == "other_targets":
            target = (target + 1) % 8
        elif case == "other_smoothing":
            options["label_smoothing"] = 0.1
    try:
        cross_entropy(sharded, target, **options)
    except ValueError as error:
        return str(error)
    return None


# name -> what every rank's error says
ONE_RANK = {
    "out_of_vocab": r"target index 8, outside the vocab \[0, 8\)",
    "other_targets": r"targets differ \(a checksum of their values\).*pass each the same targets",
    "other_smoothing": r"calls pass different options.*\('mean', 0.1, -100\)",
}


@pytest.mark.parametrize("world_size", [2, 4], ids=["ws2", "ws4"])
def test_targets_or_options_bad_on_one_rank_raise_on_every_rank(world_size):
    # before: a wrong loss with no error (other targets), or one rank raising while the others
    # waited in the all-reduce (a bad index)
    for case, pattern in ONE_RANK.items():
        messages = run_on_ranks(_on_one_rank, world_size, case)
        assert all(m is not None and re.search(pattern, m) for m in messages), (case, messages)


def _raised(case):
    try:
        _bad_call(case)
    except Exception as error:  # noqa: BLE001 - the parent checks its type
        return type(error), str(error)
    return None


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_on_every_rank_with_the_fix(case):
    world_size, error_type, pattern = BAD_INPUTS[case]
    results = run_on_ranks(_raised, world_size, case)
    assert all(result == results[0] for result in results), results
    assert results[0] is not None and results[0][0] is error_type, results[0]
    with pytest.raises(error_type, match=pattern):
        raise results[0][0](results[0][1])
