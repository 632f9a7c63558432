"""Int8 weights on edge inputs: a correct tensor or a clear error, never garbage.

- ``from_hp`` of an empty weight ((4, 0) or (0, 4)) is an empty ``Int8SymmetricTensor``
  (``qdata`` int8, ``scale`` ``(rows, 1)``) instead of an ``IndexError``.
- Loading a value whose ``qdata`` has the wrong shape (broadcast into every row before) or
  dtype (a float ``qdata`` wrapped), or whose ``scale`` is not float32, raises an error naming
  the key and what is wrong: ``load_state_dict`` plain and sharded, and ``dcp.load``.
- ``torch.chunk`` leaves a rank an empty shard (5 rows on 4 ranks: 2, 2, 1, 0):
  ``ColwiseParallel`` / ``RowwiseParallel`` on an int8 layer used to raise
  ``NotImplementedError`` (``aten.new_zeros``) mid-plan; a one-column shard hung the
  rowwise scatter, and a one-row weight's input gradient failed in the int8 kernel. The sharded
  layers now match the single-process int8 layer (outputs and input gradients).
"""

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp.quant import Int8SymmetricTensor, quantize_module_weight
from torch_tp.testing import TOL, local_chunk, rank, run_on_ranks, tp_mesh


def _quantized_linear(in_features, out_features, seed=0):
    torch.manual_seed(seed)
    return quantize_module_weight(nn.Linear(in_features, out_features))


# ------------------------------------------------------------------ empty weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 0), (0, 4)])
def test_from_hp_of_an_empty_weight_is_an_empty_int8_tensor(shape, dtype):
    q = Int8SymmetricTensor.from_float(torch.empty(shape, dtype=dtype))
    assert q.shape == shape and q.dtype == dtype
    assert q.qdata.dtype == torch.int8 and q.qdata.shape == shape
    assert q.scale.dtype == torch.float32 and q.scale.shape == (shape[0], 1)
    assert torch.equal(q.scale, torch.ones(shape[0], 1))  # a row of no elements: scale 1, like zeros
    assert q.layout_problem() is None
    assert q.dequantize().shape == shape and q.dequantize().dtype == dtype


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")
@pytest.mark.parametrize("in_features, out_features", [(0, 4), (4, 0)])
def test_a_quantized_layer_with_an_empty_weight_computes_like_the_float_layer(in_features, out_features):
    layer = nn.Linear(in_features, out_features)
    quantized = quantize_module_weight(copy.deepcopy(layer))
    x = torch.randn(3, in_features)
    assert torch.equal(quantized(x), layer(x))  # (3, 4): the bias alone; (3, 0): nothing


def test_the_input_gradient_through_a_one_row_int8_weight_is_exact():
    # grad @ w with w (1, 8): its (1, 1) scale lies along the summed dim, not the output one
    layer = _quantized_linear(8, 1)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()
    expected = torch.ones(3, 1) @ layer.weight.dequantize()
    torch.testing.assert_close(x.grad, expected, **TOL)


# ------------------------------------------------------------------ loading a bad int8 value


def _with_qdata_rows(q):
    q.qdata = q.qdata[:1]


def _with_float_qdata(q):
    q.qdata = q.qdata.float()


def _with_float64_scale(q):
    q.scale = q.scale.double()


def _with_minus_128(q):
    q.qdata = q.qdata.clone()
    q.qdata[2, 3] = -128  # outside the symmetric range: W8A8's int32 sums are exact only within it


def _with_zero_scale(q):
    q.scale = q.scale.clone()
    q.scale[1] = 0.0


_TAMPERED = {  # how the saved value is broken, and what the error must say
    "qdata_rows": (_with_qdata_rows, "qdata has shape (1, 8), not the tensor's (4, 8)"),
    "float_qdata": (_with_float_qdata, "qdata is torch.float32, not torch.int8"),
    "float64_scale": (_with_float64_scale, "scale is torch.float64, not torch.float32"),
    "minus_128": (_with_minus_128, "qdata holds -128, outside the symmetric range [-127, 127]"),
    "zero_scale": (_with_zero_scale, "scale holds a value that is not finite and positive"),
}


def _tampered(weight, case):
    """A copy of ``weight`` broken as ``case`` says, with the tensor's shape kept (as a saved
    checkpoint keeps it: ``torch.load`` restores the recorded shape and the stored parts)."""
    bad = Int8SymmetricTensor(weight.qdata.clone(), weight.scale.clone(), weight.dtype)
    _TAMPERED[case][0](bad)
    return bad


@pytest.mark.parametrize("case", list(_TAMPERED))
def test_load_state_dict_refuses_an_int8_value_with_a_bad_qdata_or_scale(case):
    model, source = _quantized_linear(8, 4, seed=1), _quantized_linear(8, 4, seed=0)
    before = model.weight.qdata.clone()
    state = {"weight": _tampered(source.weight, case), "bias": source.bias}
    with pytest.raises(RuntimeError) as raised:
        model.load_state_dict(state)
    message = str(raised.value)
    assert 'While copying the parameter named "weight"' in message, message
    assert f"in the source (the state dict's or checkpoint's value), {_TAMPERED[case][1]}" in message, message
    assert torch.equal(model.weight.qdata, before), "nothing is copied before the check"


@pytest.mark.parametrize("case", ["minus_128", "zero_scale"])
def test_int8_data_out_of_range_is_refused_by_the_constructor_and_by_torch_load(case, tmp_path):
    weight = _quantized_linear(8, 4).weight
    bad = _tampered(weight, case)
    with pytest.raises(ValueError, match=r"torch_tp.quant.Int8SymmetricTensor \(constructor\): " +
                       _TAMPERED[case][1].replace("[", r"\[").replace("]", r"\]")):
        Int8SymmetricTensor(bad.qdata, bad.scale, torch.float32)
    torch.save(bad, tmp_path / "w.pt")
    with pytest.raises(ValueError, match=r"Int8SymmetricTensor \(torch.load\)"):
        torch.load(tmp_path / "w.pt", weights_only=True)
    # what ops build from checked data is not scanned again, and stays right
    torch.testing.assert_close(weight.t().t().dequantize(), weight.dequantize(), rtol=0, atol=0)


def _sharded_float_qdata(source, mesh):
    local = local_chunk(source.weight, 0)
    local = Int8SymmetricTensor(local.qdata.float(), local.scale, local.dtype)
    return DTensor.from_local(local, mesh, [Shard(0)], shape=source.weight.shape, stride=source.weight.stride())


def _sharded_loads_of_a_float_qdata(path):
    mesh = tp_mesh()
    model = parallelize_module(_quantized_linear(8, 6, seed=1), mesh, ColwiseParallel())
    before = model.weight.to_local().qdata.clone()
    bad = _sharded_float_qdata(_quantized_linear(8, 6, seed=0), mesh)
    what = "in the source (the state dict's or checkpoint's value), qdata is torch.float32, not torch.int8"

    with pytest.raises(RuntimeError) as raised:
        model.load_state_dict({"weight": bad, "bias": model.bias})
    assert 'While copying the parameter named "weight"' in str(raised.value) and what in str(raised.value)

    dcp.save({"weight": bad}, checkpoint_id=path)
    with pytest.raises(CheckpointException) as raised:
        dcp.load({"weight": model.weight}, checkpoint_id=path)
    assert f"copy_ into Int8SymmetricTensor of shape ({6 // mesh.size()}, 8)" in str(raised.value)
    assert what in str(raised.value)
    assert torch.equal(model.weight.to_local().qdata, before)


def test_sharded_load_state_dict_and_dcp_load_refuse_a_float_qdata_on_every_rank(tmp_path):
    run_on_ranks(_sharded_loads_of_a_float_qdata, 2, str(tmp_path))


# ------------------------------------------------------------------ empty shards


def _assert_same_int8(got, expected, what):
    assert isinstance(got, Int8SymmetricTensor), what
    assert torch.equal(got.qdata, expected.qdata) and torch.equal(got.scale, expected.scale), what


def _layers_with_an_empty_shard():
    """(5, 8) colwise and (8, 5) rowwise int8 weights on 4 ranks: 2, 2, 1 and 0 rows / features."""
    mesh = tp_mesh()
    colwise, rowwise = _quantized_linear(8, 5), _quantized_linear(5, 8)
    sharded_col = parallelize_module(copy.deepcopy(colwise), mesh, ColwiseParallel(output_layouts=Replicate()))
    sharded_row = parallelize_module(copy.deepcopy(rowwise), mesh, RowwiseParallel())

    x_ref = torch.randn(3, 8, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    h_ref, h = colwise(x_ref), sharded_col(x)
    assert torch.equal(h, h_ref), "colwise: no sum across ranks, bit for bit"
    h_ref, h = h_ref.detach().requires_grad_(), local_chunk(h.detach(), -1).requires_grad_()
    y_ref, y = rowwise(h_ref), sharded_row(h)
    torch.testing.assert_close(y, y_ref, **TOL)
    grad = torch.randn(y.shape)  # the same on every rank (same seed)
    (y_ref * grad).sum().backward()
    (y * grad).sum().backward()
    torch.testing.assert_close(h.grad, local_chunk(h_ref.grad, -1), **TOL)
    (colwise(x_ref) * h_ref.grad).sum().backward()
    (sharded_col(x) * h_ref.grad).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)

    rows = 2, 2, 1, 0
    col_local, row_local = sharded_col.weight.to_local(), sharded_row.weight.to_local()
    assert col_local.qdata.shape == (rows[rank()], 8) and col_local.scale.shape == (rows[rank()], 1)
    assert row_local.qdata.shape == (8, rows[rank()]) and row_local.scale.shape == (8, 1)
    assert col_local.qdata.dtype == row_local.qdata.dtype == torch.int8
    _assert_same_int8(sharded_col.weight.full_tensor(), colwise.weight, "colwise full_tensor")
    _assert_same_int8(sharded_row.weight.full_tensor(), rowwise.weight, "rowwise full_tensor")

    for shape, dim in [((3, 8), 0), ((8, 3), 1)]:  # fewer rows / features than ranks
        q = Int8SymmetricTensor.from_hp(torch.randn(shape))
        for src in (0, None):
            d = distribute_tensor(q, mesh, [Shard(dim)], src_data_rank=src)
            _assert_same_int8(d.full_tensor(), q, f"{shape} on Shard({dim}), src_data_rank={src}")


def test_int8_layers_with_an_empty_shard_match_the_single_process_layers():
    run_on_ranks(_layers_with_an_empty_shard, 4)


@pytest.mark.parametrize("how", ["requires_grad_", "attribute", "parameter"])
def test_an_int8_weight_refuses_to_require_grad_by_name(how):
    # before: requires_grad_() succeeded and backward wrote a float gradient for the int8 weight
    lin = _quantized_linear(8, 4)
    turn_on = {
        "requires_grad_": lambda: lin.weight.requires_grad_(),
        "attribute": lambda: setattr(lin.weight, "requires_grad", True),
        "parameter": lambda: nn.Parameter(Int8SymmetricTensor.from_hp(torch.ones(2, 2))),
    }[how]
    with pytest.raises(TypeError, match=r"torch_tp.quant.Int8SymmetricTensor: an int8 weight is frozen"):
        turn_on()
    assert not lin.weight.requires_grad
    lin.weight.requires_grad_(False)  # keeping it frozen is fine
