"""W8A8 (``activations="int8"``): int8 weights times per-token int8 activations, ``torch._int_mm``.

- The product is the exact int32 product of the quantized operands, times both scales (checked
  against int64 reference math, bit for bit); it differs from weight-only by the activation
  rounding alone, within ``x_scale / 2 * sum_k |w[n, k]|`` per output.
- cuBLASLt's shapes (``M > 16``, ``K`` and ``N`` multiples of 8) are reached by zero-padding,
  which is exact: checked on CPU with ``torch._int_mm`` wrapped in the CUDA kernel's checks.
- The mode travels with the weight: shape ops, flatten/unflatten, DTensor's Colwise (bit-equal
  to one process) and Rowwise (each rank's K-slice quantized with its own scale: within the
  bound, not bit-equal), FSDP2, checkpoints (a mismatch is refused by name).
- The input gradient is weight-only; the weight is frozen. Inputs it cannot take are refused
  by name. Inductor compiles it with no graph break, reading the int8 weight in ``_int_mm``.
- ``torch_tp.quant.bench.decode_linear_timings`` returns timings on tiny CPU shapes.

Durations on 2 CPU cores: the compile test pays inductor's start-up (~5 s cold) unless another
test of the process paid it; the timing test two compiles (~1-3 s each); the ranks tests share
one pool (its start-up ~2-3 s); the rest ~0.5 s together.
"""

import copy
import io
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import Replicate

from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp._tokens import dequantize_tokens, quantize_tokens
from torch_tp.quant import Int8SymmetricTensor, Int8SymmetricWeightConfig, quantize_module_weight
from torch_tp.quant import _ops_matmul, bench
from torch_tp.testing import TOL, local_chunk, on_ranks, tp_mesh

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _w8a8_linear(in_features=16, out_features=24, *, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return quantize_module_weight(nn.Linear(in_features, out_features, bias=bias).to(dtype), activations="int8")


def _reference(x2d, q):
    """The W8A8 product in reference math: int64 sums of the int8 operands, then both scales."""
    x_q, x_scale = quantize_tokens(x2d)
    exact = x_q.long() @ q.qdata.long().t()
    return ((exact.float() * x_scale) * q.scale.t()).to(x2d.dtype)


def _rounding_bound(x2d, w_float):
    """Per output: ``x_scale / 2 * sum_k |w[n, k]|``, the most the activation rounding moves it."""
    _, x_scale = quantize_tokens(x2d)
    return x_scale / 2 * w_float.abs().sum(dim=1)


# ------------------------------------------------------------------ the product


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, k, n", [(1, 16, 24), (5, 13, 7), (17, 40, 8)], ids=["decode", "odd", "rows17"])
def test_w8a8_linear_is_the_exact_int32_product_of_the_quantized_operands(m, k, n, dtype):
    torch.manual_seed(0)
    q = Int8SymmetricTensor.from_hp(torch.randn(n, k, dtype=dtype), activations="int8")
    x = torch.randn(m, k, dtype=dtype)
    assert torch.equal(F.linear(x, q), _reference(x, q))
    assert torch.equal(x @ q.t(), _reference(x, q))  # mm, as DTensor's local op calls it


def test_w8a8_linear_with_bias_and_leading_dims_flattens_the_tokens():
    layer = _w8a8_linear()
    x = torch.randn(2, 3, 16)
    expected = _reference(x.reshape(6, 16), layer.weight).reshape(2, 3, 24) + layer.bias
    assert torch.equal(layer(x), expected)


def test_w8a8_differs_from_weight_only_by_at_most_the_activation_rounding():
    torch.manual_seed(0)
    w, x = torch.randn(24, 40), torch.randn(6, 40) * torch.logspace(-2, 1, 40)  # features of mixed size
    q = Int8SymmetricTensor.from_hp(w, activations="int8")
    x_q, x_scale = quantize_tokens(x)
    assert ((dequantize_tokens(x_q, x_scale, torch.float32) - x).abs() <= x_scale / 2 + 1e-7).all()
    w8a8, weight_only = F.linear(x, q), F.linear(x, q.with_activations("float"))
    difference = (w8a8 - weight_only).abs()
    assert (difference <= _rounding_bound(x, q.dequantize()) + 1e-5).all()
    assert difference.max() > 0  # a different function: the activations are rounded


def test_the_input_gradient_stays_weight_only_and_the_weight_is_frozen():
    layer = _w8a8_linear()
    weight_only = copy.deepcopy(layer)
    quantize_module_weight(weight_only, activations="float")
    x = torch.randn(4, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad = torch.randn(4, 24)
    layer(x).backward(grad)
    weight_only(x_ref).backward(grad)
    assert torch.equal(x.grad, x_ref.grad)  # grad @ (q * s): the float grad times the int8 weight
    torch.testing.assert_close(x.grad, grad @ layer.weight.dequantize(), **TOL)
    assert not layer.weight.requires_grad and layer.weight.grad is None and layer.bias.grad is not None


# ------------------------------------------------------------------ cuBLASLt's shapes: padding


def _cublaslt_checked_int_mm(real):
    """``torch._int_mm`` behind the shape checks of ``_int_mm_out_cuda`` (ATen's cuda/Blas.cpp)."""

    def checked(a, b):
        if not a.size(0) > 16:
            raise RuntimeError(f"self.size(0) needs to be greater than 16, but got {a.size(0)}")
        if not (a.size(1) > 0 and a.size(1) % 8 == 0):
            raise RuntimeError(f"self.size(1) needs to be greater than 0 and a multiple of 8, but got {a.size(1)}")
        if not (b.size(1) > 0 and b.size(1) % 8 == 0):
            raise RuntimeError(f"mat2.size(1) needs to be greater than 0 and a multiple of 8, but got {b.size(1)}")
        return real(a, b)

    return checked


@pytest.mark.parametrize("m, k, n", [(1, 16, 24), (16, 13, 7), (17, 8, 8), (20, 1, 30), (3, 0, 5), (0, 8, 8)])
def test_padding_to_cublaslt_shapes_is_exact(m, k, n, monkeypatch):
    torch.manual_seed(0)
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    expected = x_q.long() @ w_q.long().t()
    monkeypatch.setattr(torch, "_int_mm", _cublaslt_checked_int_mm(torch._int_mm))
    got = _ops_matmul._padded_int_mm(x_q, w_q)
    assert got.dtype == torch.int32 and torch.equal(got.long(), expected)
    if (m, k, n) != (17, 8, 8):  # the emulated checks bite on the shapes that needed padding
        with pytest.raises(RuntimeError, match="needs to be"):
            torch._int_mm(x_q, w_q.t())


@pytest.mark.parametrize("in_features, out_features", [(16, 24), (13, 7)], ids=["multiples_of_8", "odd"])
def test_a_w8a8_layer_padded_as_on_cuda_matches_the_unpadded_layer(in_features, out_features, monkeypatch):
    layer = _w8a8_linear(in_features, out_features)
    x = torch.randn(3, in_features)
    unpadded = layer(x)
    real, seen = torch._int_mm, []

    def recording(a, b):
        seen.append((tuple(a.shape), b.untyped_storage().data_ptr()))
        return real(a, b)

    monkeypatch.setattr(_ops_matmul, "_PADDED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "_int_mm", _cublaslt_checked_int_mm(recording))
    assert torch.equal(layer(x), unpadded)
    (rows, _), weight_storage = seen[0]
    assert rows == 17
    same_weight = weight_storage == layer.weight.qdata.untyped_storage().data_ptr()
    assert same_weight == (in_features % 8 == 0 and out_features % 8 == 0)  # padded (int8) only when needed


# ------------------------------------------------------------------ the mode travels with the weight


_OPS = {
    "t": lambda q: q.t(),
    "slice_rows": lambda q: q[2:5],
    "chunk_features": lambda q: torch.chunk(q, 2, dim=1)[1],
    "cat": lambda q: torch.cat(torch.chunk(q, 2, dim=0)),
    "view": lambda q: q.view(6, 2, 8),
    "to_bfloat16": lambda q: q.to(torch.bfloat16),
    "detach": lambda q: q.detach(),
    "clone": lambda q: q.clone(),
    "pad": lambda q: F.pad(q, [0, 0, 0, 2]),
    "empty_like": lambda q: torch.empty_like(q),
    "new_empty": lambda q: q.new_empty((4, 16)),
    "new_zeros": lambda q: q.new_zeros((0, 16)),
    "flat_and_back": lambda q: q.view(-1).view(6, 16),
    "deepcopy": lambda q: copy.deepcopy(q),
    "unflatten": lambda q: Int8SymmetricTensor.__tensor_unflatten__(
        {"qdata": q.qdata, "scale": q.scale}, q.__tensor_flatten__()[1], q.shape, q.stride()),
}


@pytest.mark.parametrize("op", list(_OPS))
def test_every_shape_op_and_copy_keeps_the_activation_mode(op):
    q = Int8SymmetricTensor.from_hp(torch.randn(6, 16), activations="int8")
    out = _OPS[op](q)
    assert isinstance(out, Int8SymmetricTensor) and out.activations == "int8", type(out)


def test_flatten_context_carries_the_mode_and_layout_flags_stay_what_a_gather_moves():
    q = Int8SymmetricTensor.from_hp(torch.randn(6, 16), activations="int8")
    assert q.__tensor_flatten__()[1]["activations"] == "int8"
    assert q.chunk(2, dim=1)[0].layout_flags() == {"whole_rows": True, "shared_scale": True}
    assert "activations=int8" in repr(q)
    with pytest.raises(NotImplementedError, match="activation modes"):
        torch.cat([q, q.with_activations("float")])


def test_quantizing_again_switches_the_mode_and_keeps_the_int8_values():
    from torchao import quantize_

    model = nn.Sequential(nn.Linear(16, 8))
    quantize_(model, Int8SymmetricWeightConfig())
    before = model[0].weight
    quantize_(model, Int8SymmetricWeightConfig(activations="int8"))
    after = model[0].weight
    assert after.activations == "int8" and after.qdata.data_ptr() == before.qdata.data_ptr()  # not re-rounded
    assert before.activations == "float"


# ------------------------------------------------------------------ DTensor styles and FSDP2, 2 ranks


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
@on_ranks(2)
def test_w8a8_colwise_is_bit_equal_and_rowwise_within_its_slice_rounding_of_one_process(style):
    layer = _w8a8_linear(16, 24)  # the same seed on every rank
    x = torch.randn(5, 16) * torch.logspace(-1, 1, 16)
    expected = layer(x)
    if style == "colwise":
        sharded = parallelize_module(copy.deepcopy(layer), tp_mesh(), ColwiseParallel(output_layouts=Replicate()))
        assert sharded.weight.to_local().activations == "int8"
        assert torch.equal(sharded(x), expected)  # whole tokens on every rank: the same rounding
        return
    sharded = parallelize_module(copy.deepcopy(layer), tp_mesh(), RowwiseParallel())
    assert sharded.weight.to_local().activations == "int8" and sharded.weight.full_tensor().activations == "int8"
    x_shard = local_chunk(x, -1)
    got = sharded(x_shard)  # each rank rounds its 8 features with their own per-token scale
    # exactly that: each slice's W8A8 product in reference math, summed over the ranks (so a
    # weight-only product, or a partial left unsummed, fails here)
    q = layer.weight
    per_slice = [_reference(x[:, cols], SimpleNamespace(qdata=q.qdata[:, cols], scale=q.scale)) for cols in (slice(0, 8), slice(8, 16))]
    torch.testing.assert_close(got, sum(per_slice) + layer.bias, rtol=1e-6, atol=1e-6)
    w = layer.weight.dequantize()
    weight_only = F.linear(x, w) + layer.bias
    slices = [(x[:, :8], w[:, :8]), (x[:, 8:], w[:, 8:])]
    sharded_bound = sum(_rounding_bound(xs, ws) for xs, ws in slices)
    assert ((got - weight_only).abs() <= sharded_bound + 1e-5).all()
    # not bit-equal to one process; apart by at most both rounding bounds
    assert ((got - expected).abs() <= sharded_bound + _rounding_bound(x, w) + 1e-5).all()


@on_ranks(2)
def test_fsdp2_gathers_w8a8_weights_in_their_mode_and_matches_one_process():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    for layer in (reference[0], reference[2]):
        quantize_module_weight(layer, activations="int8")
    model = copy.deepcopy(reference)
    weight_only = copy.deepcopy(reference)
    for layer in (weight_only[0], weight_only[2]):
        quantize_module_weight(layer, activations="float")
    fully_shard(model, mesh=tp_mesh())
    assert model[0].weight.to_local().activations == "int8"
    x = torch.randn(4, 16)
    out = model(x)
    assert torch.equal(out, reference(x))
    assert not torch.equal(out, weight_only(x))


# ------------------------------------------------------------------ checkpoints


def test_torch_save_keeps_the_mode_and_loading_into_another_mode_is_refused_by_name():
    saved = _w8a8_linear()
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["weight"].activations == "int8"
    same_mode = _w8a8_linear(seed=1)
    same_mode.load_state_dict(state)
    assert torch.equal(same_mode.weight.qdata, saved.weight.qdata)
    other_mode = quantize_module_weight(nn.Linear(16, 24))
    with pytest.raises(RuntimeError, match=r"activation modes differ .*Int8SymmetricWeightConfig\(activations='int8'\)"):
        other_mode.load_state_dict(state)


def test_a_weight_pickled_before_the_mode_existed_loads_as_weight_only():
    q = Int8SymmetricTensor.from_hp(torch.randn(4, 8))
    del q.activations  # what a tensor pickled by the previous torch_tp holds
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True).activations == "float"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_dcp_checkpoint_refuses_a_model_of_another_mode_by_name(tmp_path):
    dcp.save(_w8a8_linear().state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    weight_only = quantize_module_weight(nn.Linear(16, 24))
    with pytest.raises(CheckpointException, match=r"activation modes differ .*activations='int8'"):
        dcp.load(weight_only.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    same_mode = _w8a8_linear(seed=1)
    dcp.load(same_mode.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(same_mode.weight.qdata, _w8a8_linear().weight.qdata)


# ------------------------------------------------------------------ refusals


def _overlap_gather(q, x):
    import torch_tp.overlap  # noqa: F401  (registers torch.ops.torch_tp)

    return torch.ops.torch_tp.all_gather_matmul(x, [q.t()], 0, "unused")


_REFUSED = {  # what is called on a W8A8 weight q and a float input x, the error and its message
    "float64_input": (lambda q, x: F.linear(x.double(), q), TypeError, r"W8A8 linear .*is torch\.float64"),
    "integer_input": (lambda q, x: torch.mm(x.long(), q.t()), TypeError, r"W8A8 linear .*is torch\.int64"),
    "int8_tensor_input": (lambda q, x: torch.mm(q, q.t()), NotImplementedError, r"torch_tp\.quant: mm with Int8"),
    "overflowing_k": (lambda q, x: F.linear(torch.ones(1, 133145), Int8SymmetricTensor.from_hp(
        torch.ones(2, 133145), activations="int8")), ValueError, r"K = 133145 .*overflow int32 \(exact up to K = 133144\)"),
    "overlap": (_overlap_gather, NotImplementedError, r"overlap=True\) with W8A8 weights"),
    "config": (lambda q, x: Int8SymmetricWeightConfig(activations="fp8"), ValueError,
               r"torch_tp\.quant\.Int8SymmetricWeightConfig\(activations='fp8'\)"),
    "from_hp": (lambda q, x: Int8SymmetricTensor.from_hp(x, activations=True), ValueError, r"from_hp\(activations=True\)"),
}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_what_w8a8_cannot_take_is_refused_by_name(case):
    call, error, message = _REFUSED[case]
    q = Int8SymmetricTensor.from_hp(torch.randn(8, 16), activations="int8")
    with pytest.raises(error, match=message):
        call(q, torch.randn(4, 16))


def test_a_device_without_int_mm_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(_ops_matmul, "_W8A8_DEVICE_TYPES", ("cuda",))
    with pytest.raises(NotImplementedError, match=r"input is on cpu; torch\._int_mm is used on CPU and CUDA only"):
        _w8a8_linear()(torch.randn(2, 16))


# ------------------------------------------------------------------ torch.compile and the timing helper


def test_compiled_w8a8_linear_has_no_graph_break_and_reads_the_int8_weight_in_int_mm():
    # the timing test's W8A8 case (the same graph: inductor's FX graph cache serves it there)
    import torch._functorch.config
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    q = Int8SymmetricTensor.from_hp(torch.randn(24, 16, dtype=torch.bfloat16), activations="int8")
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    counters.clear()
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
        compiled, reads = bench._compiled(q, x)  # torch.compile(F.linear, backend inductor, fullgraph=True)
        torch.testing.assert_close(compiled(x, q), F.linear(x, q), rtol=1.6e-2, atol=1e-2)  # one bfloat16 step
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1
    assert reads["read_by"] == ["extern_kernels._int_mm"] and reads["reads_int8_directly"], reads
    torch._dynamo.reset()


@pytest.mark.cpu_only("on CPU, inductor converts the bfloat16 weight-only weight in a kernel of its own")
def test_decode_linear_timings_on_tiny_cpu_shapes_returns_times_errors_and_weight_reads():
    import torch._functorch.config

    with torch._functorch.config.patch(enable_autograd_cache=False):
        records = bench.decode_linear_timings("cpu", torch.bfloat16, [(2, 16, 24)], min_run_time=0.001)
    torch._dynamo.reset()
    by_mode = {record["mode"]: record for record in records}
    assert list(by_mode) == list(bench.DEFAULT_MODES)
    assert all(record["seconds"] > 0 and record["shape"] == (2, 16, 24) for record in records)
    assert by_mode["float"]["relative_error"] == 0
    assert all(0 < record["relative_error"] < 0.03 for mode, record in by_mode.items() if mode != "float")
    # the weight-only bfloat16 graph converts the int8 weight in a kernel of its own (a full-size
    # bfloat16 copy, what issue 26 is about); W8A8 hands the int8 weight to _int_mm
    assert by_mode["int8-weight-only-compiled"]["weight_reads"]["float_weight_copy"]
    assert not by_mode["int8-weight-only-compiled"]["weight_reads"]["reads_int8_directly"]
    assert by_mode["w8a8-compiled"]["weight_reads"]["reads_int8_directly"]
    assert by_mode["w8a8-eager"]["weight_reads"] is None
