"""The fused ops with ``Int8SymmetricTensor`` right operands, on real gloo ranks.

An int8 ``b`` must give what the unfused op gives with the same int8 ``b`` (the quantized
matmul chunk by chunk vs all at once: 1e-5), the input gradient must flow, the weight stays
int8 in the ops the subclass dispatches to, and ``torch.library.opcheck`` passes for those.
"""

import pytest
import torch

from torch_tp import overlap
from torch_tp.quant import Int8SymmetricTensor
from torch_tp.testing import TOL, on_ranks, rank, tp_mesh


def _int8_weight(out_features, in_features):
    return Int8SymmetricTensor.from_hp(torch.randn(out_features, in_features))


@pytest.mark.parametrize("gather_dim", [0, 1])
@on_ranks(2, 4)
def test_int8_weights_give_the_unfused_int8_result_and_input_gradient(gather_dim):
    mesh = tp_mesh()
    torch.manual_seed(0)
    w_col, w_row = _int8_weight(12, 8), _int8_weight(8, 12)  # (out, in) like nn.Linear
    full = torch.randn(2 * mesh.size(), 2 * mesh.size(), 8)
    shard = full.chunk(mesh.size(), gather_dim)[rank()].clone().requires_grad_()
    ref_shard = shard.detach().clone().requires_grad_()

    gathered, (h,) = overlap.all_gather_matmul(shard, [w_col.t()], gather_dim, mesh)
    ref_gathered, (ref_h,) = overlap.all_gather_then_matmul(ref_shard, [w_col.t()], gather_dim, mesh)
    torch.testing.assert_close(h, ref_h, **TOL)
    y = overlap.matmul_reduce_scatter(h, w_row.t(), gather_dim, mesh)
    ref_y = overlap.matmul_then_reduce_scatter(ref_h, w_row.t(), gather_dim, mesh)
    torch.testing.assert_close(y, ref_y, **TOL)
    weight = torch.randn(y.shape)
    (y * weight).sum().backward()
    (ref_y * weight).sum().backward()
    torch.testing.assert_close(shard.grad, ref_shard.grad, **TOL)
    # the int8 matrix stands for exactly its dequantized values
    torch.testing.assert_close(h, full @ w_col.dequantize().t(), **TOL)


@on_ranks(2)
def test_mixing_int8_and_float_matrices_is_refused():
    mesh = tp_mesh()
    x = torch.randn(2, 8)
    with pytest.raises(NotImplementedError, match=r"mix of int8 and float matrices \['Int8SymmetricTensor', 'Tensor'\]"):
        overlap.all_gather_matmul(x, [_int8_weight(4, 8).t(), torch.randn(8, 4)], 0, mesh)


def _int8_opcheck_arguments(op):
    group_name = tp_mesh().get_group().group_name
    w_col, w_row = _int8_weight(6, 8).t(), _int8_weight(8, 6)  # (1, N) and (K, 1) scales
    if op in ("all_gather_int8_matmul", "int8_all_gather_int8_matmul"):
        return (torch.randn(2, 3, 8), [w_col.qdata, w_row.qdata], [w_col.scale, w_row.scale], 1, group_name)
    if op == "int8_matmul_int8_reduce_scatter":
        return (torch.randn(2, 4, 8), w_col.qdata, w_col.scale, 1, group_name)
    return (torch.randn(2, 4, 8), w_col.qdata, w_col.scale, 1, group_name, "sum")


@pytest.mark.parametrize("op", ["all_gather_int8_matmul", "int8_matmul_reduce_scatter",
                                "int8_all_gather_int8_matmul", "int8_matmul_int8_reduce_scatter"])
@on_ranks(2)
def test_opcheck_passes_for_the_int8_ops(op):
    report = torch.library.opcheck(getattr(torch.ops.torch_tp, op).default, _int8_opcheck_arguments(op))
    assert report and all(result == "SUCCESS" for result in report.values()), report


@on_ranks(2, 4)
def test_int8_weights_on_the_int8_ring_give_the_int8_ring_with_their_float_values():
    # comm_dtype=torch.int8 with overlap=True and int8 weights: the ring moves int8 tokens and
    # multiplies the int8 weights; it equals the same ring over the weights' float values
    mesh, group_name = tp_mesh(), tp_mesh().get_group().group_name
    torch.manual_seed(0)
    w_col, w_row = _int8_weight(12, 8), _int8_weight(8, 12)
    shard = torch.randn(2, 2, 8).requires_grad_()
    ref_shard = shard.detach().clone().requires_grad_()
    _, (h,) = torch.ops.torch_tp.int8_all_gather_matmul(shard, [w_col.t()], 1, group_name)
    _, (ref_h,) = torch.ops.torch_tp.int8_all_gather_matmul(ref_shard, [w_col.dequantize().t()], 1, group_name)
    torch.testing.assert_close(h, ref_h, **TOL)
    y = torch.ops.torch_tp.matmul_int8_reduce_scatter(h, w_row.t(), 1, group_name)
    ref_y = torch.ops.torch_tp.matmul_int8_reduce_scatter(ref_h, w_row.dequantize().t(), 1, group_name)
    torch.testing.assert_close(y, ref_y, **TOL)
    y.square().sum().backward()
    ref_y.square().sum().backward()
    torch.testing.assert_close(shard.grad, ref_shard.grad, **TOL)
    assert h.shape == (2, 2 * mesh.size(), 12) and y.shape == (2, 2, 8)
