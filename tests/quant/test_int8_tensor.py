"""Int8SymmetricTensor on one process: quantization math, every shape/matmul op, config, errors."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tp.quant import Int8SymmetricTensor, Int8SymmetricWeightConfig
from torch_tp.testing import TOL, run_script

DTYPES = [torch.float32, torch.bfloat16]
# bfloat16 keeps 8 bits: outputs of magnitude ~4 are 0.03 apart, and addmm rounds twice.
MATMUL_TOL = {torch.float32: TOL, torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


def _weight(rows=10, cols=16, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.randn(rows, cols).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_hp_is_symmetric_per_row_and_keeps_the_logical_dtype(dtype):
    w = _weight(dtype=dtype)
    q = Int8SymmetricTensor.from_hp(w)
    assert (q.dtype, q.qdata.dtype, q.scale.dtype) == (dtype, torch.int8, torch.float32)
    assert q.qdata.shape == w.shape and q.scale.shape == (10, 1)
    torch.testing.assert_close(q.scale.flatten(), w.float().abs().amax(dim=1) / 127)
    assert q.qdata.abs().amax(dim=1).eq(127).all()  # each row's largest magnitude maps to 127
    err = (q.dequantize().float() - w.float()).abs()
    assert (err <= q.scale / 2 + 1e-6 + (0.01 if dtype == torch.bfloat16 else 0)).all()
    assert q.dequantize().dtype == dtype and q.dequantize(torch.float32).dtype == torch.float32
    assert q.dequantize(dtype=torch.float16).dtype == torch.float16
    assert q.dequantize(output_dtype=torch.float16).dtype == torch.float16


def test_all_zero_row_gets_a_finite_scale_and_dequantizes_to_zero():
    w = _weight()
    w[3] = 0
    q = Int8SymmetricTensor.from_hp(w)
    assert torch.isfinite(q.scale).all() and q.scale[3].item() > 0
    assert q.dequantize()[3].eq(0).all()


def test_repr_shows_shape_dtype_and_int8():
    q = Int8SymmetricTensor.from_hp(_weight(dtype=torch.bfloat16))
    assert repr(q) == (
        "Int8SymmetricTensor(shape=(10, 16), dtype=torch.bfloat16, qdata=int8, "
        "scale=(10, 1) float32, device=cpu)"
    )


@pytest.mark.parametrize("bad, error, match", [
    (torch.ones(4, 4, dtype=torch.int32), TypeError, "float32/bfloat16/float16 weight, got torch.int32"),
    (torch.ones(4), ValueError, "2-D weight .*shape \\(4,\\)"),
    (torch.ones(2, 3, 4), ValueError, "2-D weight .*shape \\(2, 3, 4\\)"),
    (torch.tensor([[1.0, float("nan")]]), ValueError, "NaN or inf"),
])
def test_bad_inputs_raise_clear_errors(bad, error, match):
    with pytest.raises(error, match=match):
        Int8SymmetricTensor.from_hp(bad)


def test_unimplemented_op_raises_naming_the_op_and_the_class():
    q = Int8SymmetricTensor.from_hp(_weight())
    with pytest.raises(NotImplementedError, match="Int8SymmetricTensor.*aten.sin"):
        torch.sin(q)
    with pytest.raises(NotImplementedError, match="Int8SymmetricTensor.*aten.add"):
        q + 1


# ------------------------------------------------------------------ shape ops follow the scale rule


def test_split_chunk_slice_cat_on_rows_carry_the_scales():
    q = Int8SymmetricTensor.from_hp(_weight())
    full = q.dequantize()
    pieces = torch.chunk(q, 4, dim=0)  # 3, 3, 3, 1 rows
    assert [p.scale.shape[0] for p in pieces] == [3, 3, 3, 1]
    assert all(isinstance(p, Int8SymmetricTensor) for p in pieces)
    torch.testing.assert_close(torch.cat([p.dequantize() for p in pieces]), full, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(pieces, dim=0).dequantize(), full, rtol=0, atol=0)
    torch.testing.assert_close(q[2:7].dequantize(), full[2:7], rtol=0, atol=0)
    torch.testing.assert_close(q.narrow(0, 1, 4).dequantize(), full[1:5], rtol=0, atol=0)


def test_split_and_slice_on_features_leave_the_scales_whole():
    q = Int8SymmetricTensor.from_hp(_weight())
    full = q.dequantize()
    pieces = torch.split(q, 6, dim=1)  # 6, 6, 4 features
    assert [tuple(p.scale.shape) for p in pieces] == [(10, 1)] * 3
    torch.testing.assert_close(torch.cat(pieces, dim=1).dequantize(), full, rtol=0, atol=0)
    torch.testing.assert_close(q[:, 3:9].dequantize(), full[:, 3:9], rtol=0, atol=0)


def test_cat_on_features_refuses_pieces_quantized_separately():
    a = Int8SymmetricTensor.from_hp(_weight())
    b = Int8SymmetricTensor.from_hp(_weight() * 2)
    with pytest.raises(ValueError, match="quantized separately"):
        torch.cat([a, b], dim=1)


def test_transpose_view_reshape_and_pad():
    q = Int8SymmetricTensor.from_hp(_weight())
    full = q.dequantize()
    assert q.t().scale.shape == (1, 10) and torch.equal(q.t().dequantize(), full.t())
    assert torch.equal(q.transpose(0, 1).dequantize(), full.t())
    assert torch.equal(q.view(10, 4, 4).dequantize(), full.view(10, 4, 4))
    assert torch.equal(q.reshape(10, -1).dequantize(), full)
    flat = q.view(-1)  # FSDP2's flat record: an exact flat view, per-row scales kept
    assert type(flat).__name__ == "Int8FlatView" and torch.equal(flat.dequantize(), q.dequantize().view(-1))
    assert torch.equal(flat.view(q.shape).qdata, q.qdata)
    with pytest.raises(ValueError, match="views back only to a shape whose first dim is the rows"):
        flat.view(5, 32)
    with pytest.raises(ValueError, match="would mix elements of rows"):
        q.view(5, 32)
    padded = F.pad(q, [0, 0, 0, 2])
    assert padded.shape == (12, 16) and torch.equal(padded.dequantize()[:10], full)


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_copy_clone_detach_empty_like_and_copy(dtype):
    q = Int8SymmetricTensor.from_hp(_weight(dtype=torch.float32))
    moved = q.to(dtype)
    assert moved.dtype == dtype and moved.qdata.dtype == torch.int8 and torch.equal(moved.qdata, q.qdata)
    clone = q.clone()
    assert torch.equal(clone.qdata, q.qdata) and clone.qdata.data_ptr() != q.qdata.data_ptr()
    assert torch.equal(q.detach().scale, q.scale)
    empty = torch.empty_like(q)
    assert isinstance(empty, Int8SymmetricTensor) and empty.scale.shape == q.scale.shape
    empty.copy_(q)
    assert torch.equal(empty.qdata, q.qdata) and torch.equal(empty.scale, q.scale)
    assert q.new_empty((4, 16)).scale.shape == (4, 1)
    with pytest.raises(NotImplementedError, match="floating point"):
        q.to(torch.int32)


# ------------------------------------------------------------------ matmul ops


def _linear(x, w, bias):
    return F.linear(x, w, bias)


# form: (computed with the int8 weight q, the same computed with its dequantized values w)
_MATMUL_FORMS = {
    "F.linear": (_linear, _linear),
    "aten.linear": (lambda x, q, bias: torch.ops.aten.linear(x, q, bias), _linear),
    "matmul": (lambda x, q, bias: x @ q.t() + bias, _linear),
    "addmm": (lambda x, q, bias: torch.addmm(bias, x.flatten(0, 1), q.t()).view(2, 5, 10), _linear),
    "mm": (lambda x, q, bias: torch.mm(x[0], q.t()), lambda x, w, bias: x[0] @ w.t()),
}


@pytest.mark.parametrize("form", list(_MATMUL_FORMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_mm_addmm_matmul_compute_in_the_input_dtype(dtype, form):
    q = Int8SymmetricTensor.from_hp(_weight(dtype=dtype))
    x = torch.randn(2, 5, 16).to(dtype)
    bias = torch.randn(10).to(dtype)
    with_int8, reference = _MATMUL_FORMS[form]
    got = with_int8(x, q, bias)
    assert got.dtype == dtype
    torch.testing.assert_close(got, reference(x, q.dequantize(), bias), **MATMUL_TOL[dtype])


def test_matmul_with_scales_along_the_summed_dim_folds_them_into_the_input():
    q = Int8SymmetricTensor.from_hp(_weight(16, 10))  # scales per row = per summed index
    x = torch.randn(3, 16)
    torch.testing.assert_close(torch.mm(x, q), x @ q.dequantize(), **TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_flow_to_the_activations_through_a_quantized_linear(dtype):
    torch.manual_seed(0)
    layer = nn.Linear(16, 10).to(dtype)
    reference = nn.Linear(16, 10).to(dtype)
    reference.load_state_dict(layer.state_dict())
    from torch_tp.quant import quantize_module_weight

    quantize_module_weight(layer)
    with torch.no_grad():
        reference.weight.copy_(layer.weight.dequantize())
    x = torch.randn(4, 16, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    layer(x).pow(2).sum().backward()
    reference(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **MATMUL_TOL[dtype])
    assert layer.weight.grad is None and layer.bias.grad is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_gathers_rows_and_their_scales(dtype):
    q = Int8SymmetricTensor.from_hp(_weight(dtype=dtype))
    ids = torch.tensor([[1, 9, 3], [0, 0, 7]])
    out = F.embedding(ids, q)
    assert out.dtype == dtype
    torch.testing.assert_close(out, F.embedding(ids, q.dequantize()), rtol=0, atol=0)


# ------------------------------------------------------------------ torchao config


def test_quantize_with_the_torchao_config_swaps_linear_and_embedding_weights():
    from torchao import quantize_

    model = nn.Sequential(nn.Embedding(12, 8), nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 4, bias=False))
    reference = [p.detach().clone() for p in model.parameters()]
    quantize_(model, Int8SymmetricWeightConfig())  # default filter: Linear only
    assert [type(m.weight).__name__ for m in (model[0], model[1], model[3])] == [
        "Parameter", "Int8SymmetricTensor", "Int8SymmetricTensor"]
    assert not model[1].weight.requires_grad and model[1].bias.dtype == torch.float32
    quantize_(model, Int8SymmetricWeightConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
    assert isinstance(model[0].weight, Int8SymmetricTensor)
    torch.testing.assert_close(model[0].weight.dequantize(), reference[0], atol=0.02, rtol=0)
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 4)


def test_importing_torch_tp_quant_prints_nothing():
    done = run_script("-c", "import torch_tp.quant", check=False)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == ""
