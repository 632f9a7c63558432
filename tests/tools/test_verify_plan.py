"""``verify_plan`` trains a parallelized model beside its single-process twin: correct plans pass,
purpose-built wrong parallelizations are caught and named, and every rank gets the same report."""

import functools
import types

import pytest
import torch
import torch.distributed.tensor.parallel as upstream
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from torch_tp import (
    ColwiseParallel,
    ReplicateParallel,
    RowwiseParallel,
    SequenceParallel,
    SpatialParallel,
    VerificationReport,
    parallelize_module,
    verify_plan,
)
from torch_tp.models.llama import RMSNorm, tensor_parallel_plan
from torch_tp.tools.verify import BUFFER, EVAL, GRADIENT, INPUTS, OUTPUT, PLAIN, RANK_GRADIENT, TIE, UPDATED
from torch_tp.testing import (
    local_chunk,
    on_ranks,
    quantize_weights,
    rank,
    run_on_ranks,
    small_llama,
    tp_mesh,
    world_sizes,
)


def _tokens(step):
    return (torch.randint(0, 64, (2, 8)),)


def _kinds(report):
    return {(f.kind, f.name) for f in report.findings}


# ------------------------------------------------------------------ correct plans pass

LLAMA_CASES = {
    "tp": (dict(), dict()),
    "tp_sp": (dict(), dict(sequence_parallel=True)),
    "tied": (dict(tie_embeddings=True), dict()),
    "qk_norm": (dict(qk_norm=True), dict(qk_norm=True)),
}


@on_ranks(2, 4)
@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_torch_tp_llama_plans_train_like_one_process(case):
    model_args, plan_args = LLAMA_CASES[case]
    report = verify_plan(
        functools.partial(small_llama, **model_args), tp_mesh(), tensor_parallel_plan(**plan_args), _tokens, steps=2
    )
    assert report.ok and isinstance(report, VerificationReport)
    assert report.compared > 50 and report.worst_error <= 1e-4  # outputs, gradients, parameters
    assert str(report).startswith("verify_plan: OK, the parallel model trains like the single-process one (2 steps")


def _int8_llama():
    return quantize_weights(small_llama(), embeddings=False)


@on_ranks(2)
def test_an_int8_llama_verifies_with_its_weights_compared_dequantized():
    report = verify_plan(_int8_llama, tp_mesh(), tensor_parallel_plan(), _tokens, steps=2)
    assert report.ok and report.compared > 50


def _w8a8_llama():
    return quantize_weights(small_llama(), embeddings=False, activations="int8")


@on_ranks(2)
def test_a_right_w8a8_plan_outside_the_default_tolerance_gets_the_hint_and_passes_within_the_rounding():
    # before: the report listed output and gradient differences with no word on W8A8
    report = verify_plan(_w8a8_llama, tp_mesh(), tensor_parallel_plan(), _tokens, steps=1, raise_on_mismatch=False)
    assert not report.ok
    assert "the model holds W8A8 weights" in str(report) and "atol/rtol of about 1e-2" in str(report), str(report)
    assert verify_plan(_w8a8_llama, tp_mesh(), tensor_parallel_plan(), _tokens, steps=1, atol=1e-2, rtol=1e-2).ok


# ------------------------------------------------------------- wrong ones are caught


def _upstream_untied_llama():
    plan = tensor_parallel_plan(styles=upstream)  # upstream registers a new Parameter per module
    report = verify_plan(
        functools.partial(small_llama, tie_embeddings=True), tp_mesh(),
        lambda model, mesh: upstream.parallelize_module(model, mesh, plan), _tokens, raise_on_mismatch=False,
    )
    return _kinds(report), str(report)


@world_sizes(2, 4)
def test_a_tie_broken_by_upstream_parallelize_module_is_flagged_with_its_gradient_mismatch(world_size):
    results = run_on_ranks(_upstream_untied_llama, world_size)
    kinds, text = results[0]
    assert all(result == results[0] for result in results)  # one report on every rank
    assert (TIE, "output.weight") in kinds
    assert {(GRADIENT, "output.weight"), (GRADIENT, "tok_embeddings.weight")} <= kinds
    assert "is tok_embeddings.weight in the single-process model; a separate parameter" in text


def _qk_norm_left_out():
    report = verify_plan(
        functools.partial(small_llama, qk_norm=True), tp_mesh(), tensor_parallel_plan(), _tokens,
        raise_on_mismatch=False, steps=1,
    )
    return _kinds(report), str(report)


@world_sizes(2, 4)
def test_per_head_norms_left_out_of_the_plan_show_gradients_that_differ_across_ranks(world_size):
    results = run_on_ranks(_qk_norm_left_out, world_size)
    kinds, text = results[0]
    assert all(result == results[0] for result in results)
    for layer in range(2):
        for norm in ("q_norm", "k_norm"):
            name = f"layers.{layer}.attention.{norm}.weight"
            assert {(GRADIENT, name), (RANK_GRADIENT, name)} <= kinds
    # the first forward is right; after the wrong update, the eval-mode forward is not
    assert {kind for kind, _ in kinds} == {GRADIENT, RANK_GRADIENT, UPDATED, EVAL}
    assert "ReplicateParallel(input_layouts=Shard(2))" in text  # the fix


def _bare_local_piece(module, inputs, output):
    assert output.placements == (Partial(),)
    return output.to_local()  # a partial sum's local piece is not the twin's value


def _hand_on_a_partial_sum(model, mesh):
    """What torch_tp's old ``replicate`` did: a replicated Linear fed a partial sum hands on its local piece."""
    rowwise = RowwiseParallel(input_layouts=Replicate(), output_layouts=Partial(), use_local_output=False)
    parallelize_module(model, mesh, {"0": rowwise})
    head = model[1]
    for name, param in list(head.named_parameters()):
        setattr(head, name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()])))
    head.register_forward_hook(_bare_local_piece)
    return model


def _partial_sum_handed_on():
    report = verify_plan(
        lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), tp_mesh(), _hand_on_a_partial_sum,
        (torch.randn(3, 8),), raise_on_mismatch=False,
    )
    return report


@world_sizes(2, 4)
def test_a_bare_local_piece_of_a_partial_output_is_an_output_mismatch_reported_alike_on_every_rank(world_size):
    reports = run_on_ranks(_partial_sum_handed_on, world_size)
    assert all(report == reports[0] for report in reports)
    mismatch = next(f for f in reports[0].findings if (f.kind, f.name) == (OUTPUT, "output"))
    assert mismatch.ranks == tuple(range(world_size)) and mismatch.error > 1e-2


class BatchNormAct2d(nn.BatchNorm2d):
    """timm-style: BatchNorm followed by its activation, in its own forward."""

    def forward(self, x):
        return F.relu(super().forward(x))


def _conv_net():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), BatchNormAct2d(4), nn.Conv2d(4, 2, 3, padding=1))


def _forward_of_plain_batchnorm(model, mesh):
    """What the old SpatialParallel did to a BatchNorm: run nn.BatchNorm2d's forward, losing the subclass's ReLU."""
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.forward = types.MethodType(nn.BatchNorm2d.forward, module)
    return model


@on_ranks(2)
def test_a_batchnorm_subclass_whose_forward_is_replaced_is_an_output_mismatch():
    report = verify_plan(_conv_net, tp_mesh(), _forward_of_plain_batchnorm, (torch.randn(2, 3, 6, 6),),
                         raise_on_mismatch=False)
    assert (OUTPUT, "output") in _kinds(report)
    assert "a forward replaced by a base class's" in str(report)


class _Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return x * self.gain  # a 0-dim plain tensor mixes with a DTensor; its gradient becomes one


@on_ranks(2, 4)
def test_a_plain_parameter_whose_module_ran_on_dtensor_inputs_is_flagged():
    report = verify_plan(
        lambda: nn.Sequential(nn.Linear(4, 8), _Gain()), tp_mesh(), {"0": ColwiseParallel(use_local_output=False)},
        (torch.randn(3, 4),), raise_on_mismatch=False,
    )
    assert _kinds(report) == {(PLAIN, "1.gain")}  # values agree; the optimizer would fail on its gradient
    assert "module '1' (_Gain) ran on DTensor inputs" in str(report) and "replicate_unplanned_params=True" in str(report)


@on_ranks(2)
def test_a_mismatch_raises_assertion_error_with_the_report():
    with pytest.raises(AssertionError) as info:
        verify_plan(
            lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), tp_mesh(), _hand_on_a_partial_sum,
            (torch.randn(3, 8),),
        )
    text = str(info.value)
    assert text.startswith("verify_plan: ") and "step 0  output" in text and "what to change" in text


@on_ranks(2)
def test_inputs_that_differ_across_ranks_are_flagged():
    report = verify_plan(
        lambda: nn.Sequential(nn.Linear(4, 8)), tp_mesh(), {"0": ColwiseParallel(output_layouts=Replicate())},
        lambda step: (torch.full((2, 4), float(rank())),), raise_on_mismatch=False,
    )
    finding = next(f for f in report.findings if f.kind == INPUTS)
    assert finding.ranks == (1,) and finding.step == 0


# --------------------------------------------------------------- outputs and hooks


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.body(x)
        return {"logits": self.head(h), "extra": (h, x.argmax(-1))}


@on_ranks(2, 4)
def test_a_dict_and_tuple_output_passes_with_the_default_loss():
    plan = {"body": ColwiseParallel(output_layouts=Replicate()), "head": RowwiseParallel(input_layouts=Replicate())}
    report = verify_plan(_TwoHeads, tp_mesh(), plan, (torch.randn(3, 8),), steps=2)
    assert report.ok  # logits, the hidden state, the integer argmax and the loss all compared
    # initial parameters; per step 3 outputs + loss, 4 grads, 4 parameters; 3 outputs in eval mode
    assert report.compared == 4 + 2 * (4 + 4 + 4) + 3


def _sequence_norm():
    return nn.Sequential(RMSNorm(8))


def _gather_sequence(output):
    return DTensor.from_local(output, tp_mesh(), [Shard(1)]).full_tensor()


def _sequence_shard(args):
    return (local_chunk(args[0], 1),)


@on_ranks(2, 4)
def test_a_sequence_sharded_model_passes_with_shard_inputs_and_gather_outputs():
    report = verify_plan(
        _sequence_norm, tp_mesh(), {"0": SequenceParallel(use_local_output=True)}, (torch.randn(2, 8, 8),),
        shard_inputs=_sequence_shard, gather_outputs=_gather_sequence, steps=2,
    )
    assert report.ok


@on_ranks(2)
def test_a_local_shard_compared_without_gather_outputs_is_a_shape_mismatch():
    report = verify_plan(
        _sequence_norm, tp_mesh(), {"0": SequenceParallel(use_local_output=True)}, (torch.randn(2, 8, 8),),
        shard_inputs=_sequence_shard, raise_on_mismatch=False,
    )
    mismatch = next(f for f in report.findings if (f.kind, f.name) == (OUTPUT, "output"))
    assert mismatch.detail == "shape (2, 4, 8), single process (2, 8, 8)"


@on_ranks(2, 4)
def test_a_spatially_sharded_cnn_passes_with_its_dtensor_output_compared_whole():
    report = verify_plan(
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)),
        tp_mesh(), {"*": SpatialParallel(dim=3)}, (torch.randn(2, 3, 6, 10),),
        shard_inputs=lambda args: (local_chunk(args[0], 3),), steps=2,
    )
    assert report.ok


# ------------------------------------------------------------------ arguments


@on_ranks(1)
def test_bad_arguments_raise_errors_that_say_what_to_pass():
    model = lambda: nn.Linear(4, 4)  # noqa: E731
    with pytest.raises(TypeError, match=r"plan\(model, mesh\) -> model, got int"):
        verify_plan(model, tp_mesh(), 42, (torch.randn(2, 4),))
    with pytest.raises(ValueError, match="steps must be a positive int or None .*, got 0"):
        verify_plan(model, tp_mesh(), {}, (torch.randn(2, 4),), steps=0)
    with pytest.raises(ValueError, match="a callable plan parallelizes the model itself"):
        verify_plan(model, tp_mesh(), lambda m, mesh: m, (torch.randn(2, 4),), replicate_unplanned_params=True)


def test_a_mesh_that_is_not_a_device_mesh_raises_type_error():
    with pytest.raises(TypeError, match=r"verify_plan needs a DeviceMesh .* got int"):
        verify_plan(lambda: nn.Linear(4, 4), 2, {}, (torch.randn(2, 4),))


# --------------------------------------------------- buffers, eval mode, and how many steps


class _LocalRunningMean(nn.Module):
    """Keeps a running mean of its output in a buffer, from the local piece it sees (the bug), and
    subtracts it in eval mode: training agrees with one process, the buffer and eval do not."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x):
        h = self.lin(x)
        if not self.training:
            mean = DTensor.from_local(self.mean, h.device_mesh, [Replicate()]) if isinstance(h, DTensor) else self.mean
            return h - mean
        with torch.no_grad():
            self.mean.mul_(0.5).add_(0.5 * (h.to_local() if isinstance(h, DTensor) else h).mean(0))
        return h


@on_ranks(2, 4)
def test_a_buffer_updated_from_a_local_piece_is_found_with_the_eval_forward_it_breaks():
    report = verify_plan(
        _LocalRunningMean, tp_mesh(), ReplicateParallel(input_layouts=Shard(0)), (torch.randn(8, 4),),
        shard_inputs=lambda args: (local_chunk(args[0], 0),),
        gather_outputs=lambda out: DTensor.from_local(out, tp_mesh(), [Shard(0)]).full_tensor(),
        raise_on_mismatch=False,
    )
    kinds = {(f.kind, f.name) for f in report.findings}
    assert kinds == {(BUFFER, "mean"), (EVAL, "output")}, str(report)  # training itself agrees


class _HeadsBeforeAZeroProjection(nn.Module):
    """Per-head norm between a Colwise and a Rowwise layer, the Rowwise one zero-initialized (a
    common init for output projections): until it moves, no gradient reaches the norm."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 8), nn.RMSNorm(2), nn.Linear(8, 4)
        nn.init.zeros_(self.b.weight)
        nn.init.zeros_(self.b.bias)

    def forward(self, x):
        return self.b(self.norm(self.a(x).unflatten(-1, (-1, 2))).flatten(-2))


@on_ranks(2, 4)
def test_the_default_steps_find_an_error_the_first_update_uncovers():
    # the norm is left out of the plan: its gradient misses the other ranks' heads, which shows
    # only once the zero projection moved (step 1); one step passes the wrong plan
    run = functools.partial(verify_plan, _HeadsBeforeAZeroProjection, tp_mesh(),
                            {"a": ColwiseParallel(), "b": RowwiseParallel()}, (torch.randn(3, 8),),
                            raise_on_mismatch=False)
    assert run(steps=1).ok
    report = run()
    assert report.steps == 3  # step 0 moves b, step 1 a and the norm, step 2 nothing new
    assert (RANK_GRADIENT, "norm.weight", 1) in {(f.kind, f.name, f.step) for f in report.findings}, str(report)
