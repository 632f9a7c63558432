"""Constant padding of a spatially sharded dim, and even kernels with ``padding="same"``, against one process.

``F.pad`` on a ``Shard(d)`` DTensor under :func:`sharded_padding` must give a true ``Shard(d)``
of the padded tensor (each rank the ``torch.chunk`` strip of the padded length) and the exact
input gradient, moving only the few columns whose owner changes: no all-gather. An even
kernel's ``padding="same"`` (aten pads one extra column, then convolves) then stays on strips
end to end. Float64 inputs; widths uneven at world size 4 (some strips short or empty).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp import parallelize_module
from torch_tp.conv import SpatialParallel, sharded_convolution, sharded_padding
from torch_tp.testing import TOL, assert_comm_counts, assert_params_and_grads_match, comm_counts, local_chunk
from torch_tp.testing import mesh_2x2, on_ranks, record_p2p, shard_locally, tp_mesh


def _input(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# F.pad on the sharded dim
# ---------------------------------------------------------------------------------------------

_PADS = {  # F.pad's flat pad, last dim first
    "right_1": [0, 1],
    "left_3": [3, 0],
    "both_wide": [5, 7],  # wider than a strip at world size 4
    "crop": [-2, -3],
    "crop_and_pad": [-4, 2],
    "height_too": [1, 2, 2, 1],
}


@pytest.mark.parametrize("width", [13, 16])
@pytest.mark.parametrize("case", list(_PADS))
@on_ranks(2, 4)
def test_pad_keeps_the_width_sharded_and_matches_one_process(case, width):
    x = _input((2, 3, 5, width), seed=width)
    pad, value = _PADS[case], 0.0 if case != "left_3" else 1.5
    rx = x.clone().requires_grad_()
    ref = F.pad(rx, pad, value=value)
    grad = _input(ref.shape, seed=1)
    ref.backward(grad)
    dx = shard_locally(x, tp_mesh(), [Shard(3)]).requires_grad_()
    with sharded_padding(), CommDebugMode() as comm:
        y = F.pad(dx, pad, value=value)
        y.backward(shard_locally(grad, tp_mesh(), [Shard(3)]))
    assert y.placements == (Shard(3),) and y.shape == ref.shape
    torch.testing.assert_close(y.to_local(), local_chunk(ref.detach(), 3), **TOL)
    torch.testing.assert_close(dx.grad.to_local(), local_chunk(rx.grad, 3), **TOL)
    assert_comm_counts(comm_counts(comm), {}, f"F.pad {pad}")  # P2P only, no collective


@on_ranks(2)
def test_only_the_columns_that_change_owner_move():
    x = _input((1, 2, 3, 16))  # strips [0, 8), [8, 16); padded (0, 1): [0, 9), [9, 17)
    with sharded_padding(), record_p2p() as records:
        F.pad(shard_locally(x, tp_mesh(), [Shard(3)]), [0, 1])
    sent = sum(n for kind, _, n in records if kind == "send")
    assert sent == (2 * 3 * 8 if torch.distributed.get_rank() == 1 else 0)  # one column of 2x3 doubles


@on_ranks(4)
def test_batch_and_width_on_a_2x2_mesh_and_a_partial_input():
    mesh = mesh_2x2()
    x = _input((4, 2, 3, 10))
    with sharded_padding():
        y = F.pad(shard_locally(x, mesh, [Shard(0), Shard(3)]), [1, 2], value=0.5)
        assert y.placements == (Shard(0), Shard(3))
        torch.testing.assert_close(y.full_tensor(), F.pad(x, [1, 2], value=0.5), **TOL)
        half = shard_locally(x / 2, mesh, [Replicate(), Shard(3)]).to_local()
        halves = DTensor.from_local(half, mesh, [Partial(), Shard(3)])  # sums to x over the first dim
        for value in (0.0, 0.5):  # zeros pad a partial sum exactly; a constant needs the sum first
            y = F.pad(halves, [2, 1], value=value)
            torch.testing.assert_close(y.full_tensor(), F.pad(x, [2, 1], value=value), **TOL)
        with pytest.raises(NotImplementedError, match="padded and sharded over mesh dims"):
            F.pad(shard_locally(x, mesh, [Shard(3), Shard(3)]), [1, 1])


# ---------------------------------------------------------------------------------------------
# Even kernels, padding="same": the halo path end to end
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel,dilation", [((2, 4), 1), ((4, 2), 1), ((3, 4), 1), ((2, 2), 3)])
@on_ranks(2, 4)
def test_even_kernel_same_padding_stays_sharded_and_matches_one_process(kernel, dilation):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, kernel, padding="same", dilation=dilation).double()
    x = _input((2, 3, 6, 15))
    ref = conv(x.clone().requires_grad_())
    mesh = tp_mesh()
    dx = shard_locally(x, mesh, [Shard(3)]).requires_grad_()
    w = distribute_tensor(conv.weight.detach(), mesh, [Replicate()]).requires_grad_()
    b = distribute_tensor(conv.bias.detach(), mesh, [Replicate()]).requires_grad_()
    with sharded_convolution(), sharded_padding(), CommDebugMode() as comm:
        y = F.conv2d(dx, w, b, padding="same", dilation=dilation)
        y.backward(shard_locally(torch.ones_like(ref), mesh, [Shard(3)]))
    ref.sum().backward()
    assert y.placements == (Shard(3),)
    torch.testing.assert_close(y.to_local(), local_chunk(ref.detach(), 3), **TOL)
    torch.testing.assert_close(w.grad.full_tensor(), conv.weight.grad, **TOL)
    torch.testing.assert_close(b.grad.full_tensor(), conv.bias.grad, **TOL)
    assert "all_gather_into_tensor" not in comm_counts(comm), comm_counts(comm)  # never gathered


class _SameNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 6, 4, padding="same"), nn.ReLU(), nn.ZeroPad2d((1, 0, 0, 1)),
                                  nn.Conv2d(6, 4, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.body(x))


@on_ranks(2, 4)
def test_a_one_line_spatial_plan_with_even_same_convs_and_zero_pad_matches_one_process():
    torch.manual_seed(0)
    ref = _SameNet().double()
    net = _SameNet().double()
    net.load_state_dict(ref.state_dict())
    x = _input((2, 3, 8, 16))  # even strips at the global pool (uneven ones gather there), uneven after the pad
    ref(x).square().sum().backward()
    with CommDebugMode() as comm:
        parallelize_module(net, tp_mesh(), SpatialParallel(dim=3))
        net(local_chunk(x, 3)).square().sum().backward()
    assert "all_gather_into_tensor" not in comm_counts(comm), comm_counts(comm)  # padded strips stay strips
    assert_params_and_grads_match(net, ref)
