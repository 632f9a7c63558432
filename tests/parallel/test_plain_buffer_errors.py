"""A module that runs on DTensors but holds a plain buffer gets an error naming the module and the buffer.

DTensor refuses an op that mixes DTensors and plain tensors ("got mixed torch.Tensor and
DTensor"), naming neither the module nor the tensor. Every style that hands its module
DTensors re-raises that error with the style, the module path and the plain tensors' names,
and says what to change: here an ``nn.Linear`` / ``nn.Embedding`` subclass whose own forward
multiplies by a plain per-feature buffer, under ``ColwiseParallel`` and ``RowwiseParallel``,
and a norm with a plain buffer under ``SequenceParallel`` and ``ReplicateParallel``. On 2
ranks every rank raises the same error. Following the advice (the buffer made a replicated
DTensor) gives the single-process output and gradients; a module with no plain tensor keeps
its own forward (nothing wraps it).
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from torch_tp import ColwiseParallel, ReplicateParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch_tp.testing import TOL, assert_params_and_grads_match, on_ranks, run_on_ranks, tp_mesh


class _ScaledLinear(nn.Linear):
    """A Linear whose forward scales each output feature by a plain buffer."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, out_features))

    def forward(self, x):
        return super().forward(x) * self.scale


class _ScaledEmbedding(nn.Embedding):
    """An Embedding whose forward scales each embedding dim by a plain buffer."""

    def __init__(self, num_embeddings, embedding_dim):
        super().__init__(num_embeddings, embedding_dim)
        self.register_buffer("gain", torch.linspace(0.5, 2.0, embedding_dim))

    def forward(self, ids):
        return super().forward(ids) * self.gain


class _ShiftedNorm(nn.LayerNorm):
    """A LayerNorm whose forward adds a plain per-feature buffer."""

    def __init__(self, dim):
        super().__init__(dim)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, dim))

    def forward(self, x):
        return super().forward(x) + self.shift


class _Block(nn.Module):
    def __init__(self, up, down):
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Model(nn.Module):
    def __init__(self, up, down):
        super().__init__()
        self.block = _Block(up, down)

    def forward(self, x):
        return self.block(x)


def _linears(case):
    """(model, plan, input); the module holding the plain buffer is at ``block.up`` or ``block.down``."""
    x = torch.randn(3, 4, 8)
    if case == "colwise_linear":
        model = _Model(_ScaledLinear(8, 12), nn.Linear(12, 8))
        return model, {"block.up": ColwiseParallel(), "block.down": RowwiseParallel()}, x
    if case == "rowwise_linear":
        model = _Model(nn.Linear(8, 12), _ScaledLinear(12, 8))
        return model, {"block.up": ColwiseParallel(), "block.down": RowwiseParallel()}, x
    ids = torch.randint(0, 16, (3, 4))
    if case == "colwise_embedding":
        model = _Model(_ScaledEmbedding(16, 8), nn.Linear(8, 8))
        return model, {"block.up": ColwiseParallel(output_layouts=Replicate())}, ids
    if case == "rowwise_embedding":
        model = _Model(_ScaledEmbedding(16, 8), nn.Linear(8, 8))
        return model, {"block.up": RowwiseParallel()}, ids
    if case == "sequence_parallel_norm":
        model = _Model(_ShiftedNorm(8), nn.Linear(8, 8))
        return model, {"block.up": SequenceParallel(use_local_output=True)}, x
    if case == "replicate_parallel_norm":
        model = _Model(_ShiftedNorm(8), nn.Linear(8, 8))
        return model, {"block.up": ReplicateParallel(input_layouts=Shard(1))}, x
    raise AssertionError(case)


# case -> (module path, its type, the style named, the plain tensor named)
CASES = {
    "colwise_linear": ("block.up", "_ScaledLinear", "ColwiseParallel", "scale"),
    "rowwise_linear": ("block.down", "_ScaledLinear", "RowwiseParallel", "scale"),
    "colwise_embedding": ("block.up", "_ScaledEmbedding", "ColwiseParallel", "gain"),
    "rowwise_embedding": ("block.up", "_ScaledEmbedding", "RowwiseParallel", "gain"),
    "sequence_parallel_norm": ("block.up", "_ShiftedNorm", "SequenceParallel", "shift"),
    "replicate_parallel_norm": ("block.up", "_ShiftedNorm", "ReplicateParallel", "shift"),
}


def _forward_error(case):
    model, plan, x = _linears(case)
    parallelize_module(model, tp_mesh(), plan)
    try:
        model(x)
    except Exception as error:  # noqa: BLE001 - the parent checks its type and text
        return type(error).__name__, str(error)
    return None


@pytest.mark.parametrize("case", list(CASES))
def test_plain_buffer_in_forward_raises_on_every_rank_naming_module_buffer_and_fix(case):
    path, kind, style, buffer = CASES[case]
    errors = run_on_ranks(_forward_error, 2, case)
    assert errors[0] is not None, "the forward did not fail"
    assert errors == [errors[0]] * 2, errors  # every rank, the same error
    kind_name, message = errors[0]
    assert kind_name == "RuntimeError", errors[0]
    assert f"{style} on '{path}' ({kind})" in message, message
    assert f"the plain tensors ['{buffer}']" in message, message
    assert "mixed torch.Tensor and DTensor" in message, message  # DTensor's own words stay
    # what to change, with the module's own path and buffer
    assert f"model.{path}.{buffer} = DTensor.from_local(model.{path}.{buffer}, mesh, [Replicate()])" in message


LINEAR_FIXES = ["colwise_linear", "rowwise_linear", "colwise_embedding", "rowwise_embedding"]


@pytest.mark.parametrize("case", LINEAR_FIXES)
@on_ranks(2, 4)
def test_following_the_advice_gives_the_single_process_result(case):
    path = CASES[case][0]
    reference, plan, x = _linears(case)
    model = copy.deepcopy(reference)
    parallelize_module(model, tp_mesh(), plan)
    owner, name = model.get_submodule(path), CASES[case][3]
    setattr(owner, name, DTensor.from_local(getattr(owner, name), tp_mesh(), [Replicate()]))
    out, ref_out = model(x), reference(x)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    torch.testing.assert_close(out, ref_out, **TOL)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    assert_params_and_grads_match(model, reference, **TOL, what=case)


@on_ranks(2)
def test_a_module_without_plain_tensors_keeps_its_own_forward():
    model, plan, _ = _linears("colwise_linear")
    parallelize_module(model, tp_mesh(), plan)
    assert "forward" in vars(model.block.up)  # holds the plain buffer: wrapped to name it
    assert "forward" not in vars(model.block.down)  # a plain nn.Linear: its class's forward runs
