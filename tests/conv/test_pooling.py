"""Max and average pooling on a spatially sharded input, on real gloo ranks, against one process.

Every case pools a ``Shard(d)`` DTensor under :func:`sharded_pooling` and a plain copy with
the same ``F.*`` call, then compares the output strip with the reference's ``torch.chunk``
piece (the sharded output must be a true ``Shard(d)``), and the input gradient likewise. The
inputs are a permutation of ``-1 .. -numel`` in float64, so max pooling has no ties (the
tie rule has its own test) and a wrong padding value shows. Widths are uneven at world size
4 (10 or 11 over 4 ranks: some strips short, some ranks without outputs).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp.conv import conv_windows, halo_bytes, sharded_convolution
from torch_tp.conv.pooling import (
    sharded_pooling,
)
from torch_tp.testing import TOL, assert_sharded_step_matches, comm_counts, full_tensor, local_chunk, mesh_2x2
from torch_tp.testing import on_ranks, record_p2p, shard_locally, tp_mesh

aten = torch.ops.aten

# name -> (pool, input shape, sharded dim); at world size 4 the sharded lengths split as
# 11: 3,3,3,2 / 10: 3,3,3,1 / 9: 3,3,3,0 (an empty strip that still owns an output)
WINDOWED = {
    "max2d_resnet_stem_width": (lambda t: F.max_pool2d(t, 3, 2, 1), (2, 3, 5, 11), 3),
    "max2d_resnet_stem_height": (lambda t: F.max_pool2d(t, 3, 2, 1), (2, 3, 10, 4), 2),
    "max2d_ceil_mode": (lambda t: F.max_pool2d(t, 3, 2, 0, ceil_mode=True), (2, 3, 4, 10), 3),
    "max2d_ceil_mode_past_the_padding": (lambda t: F.max_pool2d(t, 2, 3, 1, ceil_mode=True), (1, 2, 3, 13), 3),
    "max2d_dilation": (lambda t: F.max_pool2d(t, 3, 1, 1, dilation=2), (2, 2, 3, 12), 3),
    "max2d_non_overlapping_empty_strip": (lambda t: F.max_pool2d(t, 2), (2, 3, 4, 9), 3),
    "max1d": (nn.MaxPool1d(3, 2, 1, ceil_mode=True), (2, 3, 11), 2),
    "max3d_depth": (nn.MaxPool3d(3, 2, 1), (2, 2, 10, 3, 4), 2),
    "avg2d_count_include_pad": (lambda t: F.avg_pool2d(t, 3, 2, 1), (2, 3, 5, 11), 3),
    "avg2d_exclude_pad_ceil_mode": (
        lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 3, 5, 10), 3),
    "avg2d_include_pad_ceil_mode": (
        lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True, count_include_pad=True), (2, 3, 5, 10), 3),
    "avg2d_divisor_override_height": (lambda t: F.avg_pool2d(t, 3, 1, 1, divisor_override=2), (2, 3, 10, 5), 2),
    "avg2d_stride_1": (nn.AvgPool2d(3, stride=1, padding=1), (2, 3, 4, 10), 3),
    "avg1d": (nn.AvgPool1d(4, 2, 2, ceil_mode=True, count_include_pad=False), (2, 3, 13), 2),
    "avg3d_width": (nn.AvgPool3d(3, 2, 1, count_include_pad=False), (2, 2, 3, 4, 10), 4),
    "lp_pool2d": (nn.LPPool2d(2, 3, stride=2), (2, 3, 4, 11), 3),
}

# name -> (pool, input shape, sharded dim): the output is Replicate() on the sharded mesh dim
GLOBAL_MAX = {
    "adaptive_max2d_1": (nn.AdaptiveMaxPool2d(1), (2, 3, 5, 10), 3),
    "adaptive_max2d_bins_on_height": (nn.AdaptiveMaxPool2d((3, 1)), (2, 3, 5, 10), 3),
    "adaptive_max2d_3_on_the_sharded_dim": (nn.AdaptiveMaxPool2d((2, 3)), (2, 3, 5, 10), 3),
    "adaptive_max1d": (nn.AdaptiveMaxPool1d(1), (2, 3, 10), 2),
    "adaptive_max3d": (nn.AdaptiveMaxPool3d(1), (2, 2, 3, 4, 10), 4),
}


# ---------------------------------------------------------------------------------------------
# Helpers (rank side)
# ---------------------------------------------------------------------------------------------


def _distinct(shape, seed=0):
    """float64 ``-1 .. -numel`` in random order: no two elements equal, so no max ties; all
    negative, so a zero instead of ``-inf`` padding would win at the edges."""
    gen = torch.Generator().manual_seed(seed)
    return -1.0 - torch.randperm(torch.Size(shape).numel(), generator=gen).double().view(shape)


def _piece(t, mesh, placements):
    """This rank's piece of ``t`` under ``placements`` (``torch.chunk`` rule): the reference."""
    if mesh.ndim == 1 and type(placements[0]) is Shard:
        return local_chunk(t, placements[0].dim)
    return shard_locally(t, mesh, placements).to_local()


def _compare(pool, x, mesh, placements, expected_placements, what):
    """Forward and backward of ``pool`` on the sharded ``x`` against one process."""
    with sharded_pooling():
        step = assert_sharded_step_matches(pool, pool, x, None, mesh, placements, params=False, **TOL,
                                           output_placements=expected_placements, what=what)
    return step.output


# ---------------------------------------------------------------------------------------------
# Max and average pooling with windows crossing the strips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(WINDOWED), ids=list(WINDOWED))
@on_ranks(2, 4)
def test_windowed_pooling_matches_single_process(case):
    pool, shape, dim = WINDOWED[case]
    _compare(pool, _distinct(shape), tp_mesh(), [Shard(dim)], [Shard(dim)], case)


@on_ranks(2, 4)
def test_max_pool_indices_are_the_single_process_indices():
    mesh = tp_mesh()
    calls = {
        "2d": (lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True), (2, 3, 5, 11), 3),
        "2d_ceil_dilation": (lambda t: F.max_pool2d(t, 3, 2, 1, dilation=(1, 2), ceil_mode=True,
                                                    return_indices=True), (2, 3, 5, 16), 3),
        "1d": (lambda t: F.max_pool1d(t, 3, 2, 1, return_indices=True), (2, 3, 10), 2),
        "3d_height": (lambda t: F.max_pool3d(t, 3, 2, 1, return_indices=True), (1, 2, 3, 10, 4), 3),
        "adaptive_global": (lambda t: F.adaptive_max_pool2d(t, 1, return_indices=True), (2, 3, 5, 10), 3),
    }
    for name, (pool, shape, dim) in calls.items():
        x = _distinct(shape)
        ref_out, ref_idx = pool(x)
        with sharded_pooling():
            out, idx = pool(shard_locally(x, mesh, [Shard(dim)]))
        assert idx.placements == out.placements and idx.dtype == torch.long, name
        torch.testing.assert_close(out.full_tensor(), ref_out, **TOL, msg=lambda m: f"{name} out: {m}")
        assert torch.equal(idx.to_local(), _piece(ref_idx, mesh, idx.placements)), (name, idx.to_local())


@on_ranks(2, 4)
def test_inference_mode_pools_stay_sharded():
    # under inference_mode the composite max_pool*d / avg_pool1d / *_1d ops reach DTensor whole;
    # without their handlers DTensor would gather the input and return Replicate()
    mesh = tp_mesh()
    pools = {
        "MaxPool1d": (nn.MaxPool1d(3, 2, 1), (2, 3, 11), 2, Shard(2)),
        "MaxPool2d": (nn.MaxPool2d(3, 2, 1), (2, 3, 4, 11), 3, Shard(3)),
        "MaxPool3d": (nn.MaxPool3d(3, 2, 1), (1, 2, 3, 4, 11), 4, Shard(4)),
        "max_pool1d_indices": (lambda t: F.max_pool1d(t, 3, 2, 1, return_indices=True)[1], (2, 3, 11), 2, Shard(2)),
        "AvgPool1d": (nn.AvgPool1d(3, 2, 1), (2, 3, 11), 2, Shard(2)),
        "AdaptiveMaxPool1d": (nn.AdaptiveMaxPool1d(1), (2, 3, 11), 2, Replicate()),
    }
    for name, (pool, shape, dim, expected) in pools.items():
        x = _distinct(shape)
        with torch.inference_mode(), sharded_pooling():
            y = pool(shard_locally(x, mesh, [Shard(dim)]))
        assert y.placements == (expected,), (name, y.placements)
        torch.testing.assert_close(y.full_tensor(), pool(x), **TOL, msg=lambda m: f"{name}: {m}")


@on_ranks(4)
def test_batch_channel_and_partial_placements_on_a_2x2_mesh():
    # batch 3 on dp=2 (2, 1); width 10 on tp=2; a Partial input is reduced first
    mesh = mesh_2x2()
    x = _distinct((3, 4, 5, 10))
    pools = {
        "max": lambda t: F.max_pool2d(t, 3, 2, 1),
        "avg": lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True, count_include_pad=False),
    }
    for name, pool in pools.items():
        for placements in ([Shard(0), Shard(3)], [Shard(1), Shard(3)], [Replicate(), Shard(2)]):
            _compare(pool, x, mesh, placements, placements, f"{name} {placements}")
        _compare(nn.AdaptiveMaxPool2d(1), x, mesh, [Shard(0), Shard(3)], [Shard(0), Replicate()], "global max")
        part = DTensor.from_local(torch.chunk(x, 2, 3)[mesh.get_local_rank(1)] / 2, mesh, [Partial(), Shard(3)],
                                  shape=x.shape, stride=x.stride())
        with sharded_pooling():
            y = pool(part)
        assert y.placements == (Replicate(), Shard(3)), (name, y.placements)
        torch.testing.assert_close(y.full_tensor(), pool(x), **TOL)


@on_ranks(2, 4)
def test_resnet_stem_conv_max_pool_avg_pool_global_mean_chain():
    # conv 3x3 stride 2 -> max pool 3x3 stride 2 -> avg pool 3x3 stride 1 -> global mean, the
    # width (22 -> 11 -> 6 -> 6) sharded throughout; the conv and pool handlers side by side
    mesh = tp_mesh()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 8, 22, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 3, 3, 3, generator=gen, dtype=torch.float64)

    def stem(t, weight):
        t = F.max_pool2d(F.conv2d(t, weight, stride=2, padding=1), 3, 2, 1)
        return F.avg_pool2d(t, 3, 1, 1, count_include_pad=False)

    rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = stem(rx, rw)
    ref.mean((2, 3)).pow(2).sum().backward()
    dx, dw = shard_locally(x, mesh, [Shard(3)]).requires_grad_(), shard_locally(w, mesh, [Replicate()]).requires_grad_()
    with sharded_convolution(), sharded_pooling():
        y = stem(dx, dw)
        y.mean((2, 3)).pow(2).sum().backward()
    assert y.placements == (Shard(3),) and dx.grad.placements == (Shard(3),)
    torch.testing.assert_close(y.to_local(), local_chunk(ref.detach(), 3), **TOL)
    torch.testing.assert_close(dx.grad.to_local(), local_chunk(rx.grad, 3), **TOL)
    torch.testing.assert_close(dw.grad.full_tensor(), rw.grad, **TOL)


# ---------------------------------------------------------------------------------------------
# Global pooling
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(GLOBAL_MAX), ids=list(GLOBAL_MAX))
@on_ranks(2, 4)
def test_global_max_pooling_matches_single_process(case):
    pool, shape, dim = GLOBAL_MAX[case]
    _compare(pool, _distinct(shape), tp_mesh(), [Shard(dim)], [Replicate()], case)


@on_ranks(2, 4)
def test_global_max_ties_go_to_the_lowest_global_index():
    # the maximum 1 appears on the first and on the last strip; one process scans rows first,
    # so (h=0, w=9) on the last strip wins over (h=1, w=0) on the first, and gets the gradient
    mesh = tp_mesh()
    x = torch.zeros(1, 2, 3, 10, dtype=torch.float64)
    x[0, :, 1, 0] = 1
    x[0, :, 0, 9] = 1
    x[0, 1, 2, 5] = 1  # channel 1: a third one, later in the scan
    ref_out, ref_idx = F.adaptive_max_pool2d(x, 1, return_indices=True)
    assert ref_idx.flatten().tolist() == [9, 9]
    _compare(nn.AdaptiveMaxPool2d(1), x, mesh, [Shard(3)], [Replicate()], "ties")
    with sharded_pooling():
        out, idx = F.adaptive_max_pool2d(shard_locally(x, mesh, [Shard(3)]), 1, return_indices=True)
    assert torch.equal(idx.to_local(), ref_idx) and torch.equal(out.to_local(), ref_out)


@on_ranks(2, 4)
def test_dtensor_already_pools_averages_globally_and_is_left_alone():
    # nn.AdaptiveAvgPool2d(1) and x.mean((2, 3)) reach aten.mean.dim (Partial(avg) on even strips,
    # gathered on uneven ones), other adaptive averages _adaptive_avg_pool2d (gathered): correct
    # forward and backward, so pooling installs no handler for them
    mesh = tp_mesh()
    even = dist.get_world_size() == 2  # width 10: 5, 5 / 3, 3, 3, 1
    pools = {
        "AdaptiveAvgPool2d(1)": (nn.AdaptiveAvgPool2d(1), Partial("avg") if even else Replicate()),
        "mean((2, 3))": (lambda t: t.mean((2, 3)), Partial("avg") if even else Replicate()),
        "adaptive_avg_pool2d((2, 2))": (lambda t: F.adaptive_avg_pool2d(t, (2, 2)), Replicate()),
    }
    x = _distinct((2, 3, 5, 10))
    for name, (pool, expected) in pools.items():
        rx = x.clone().requires_grad_()
        ref = pool(rx)
        ref.backward(torch.ones_like(ref))
        dx = shard_locally(x, mesh, [Shard(3)]).requires_grad_()
        with sharded_pooling():
            y = pool(dx)
            y.full_tensor().backward(torch.ones_like(ref))
        assert y.placements == (expected,), (name, y.placements)
        torch.testing.assert_close(y.full_tensor(), ref.detach(), **TOL, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(full_tensor(dx.grad), rx.grad, **TOL, msg=lambda m: f"{name} grad: {m}")


# ---------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------


@on_ranks(2, 4)
def test_max_pool_sends_only_the_halos_and_global_max_one_all_gather():
    mesh = tp_mesh()
    x = _distinct((2, 3, 4, 11))
    dx = shard_locally(x, mesh, [Shard(3)]).requires_grad_()
    with sharded_pooling(), CommDebugMode() as mode:
        with record_p2p() as forward:
            y = F.max_pool2d(dx, 3, 2, 1)
        with record_p2p() as backward:
            y.backward(shard_locally(torch.ones(y.shape, dtype=x.dtype), mesh, y.placements))
    assert comm_counts(mode) == {}, comm_counts(mode)
    windows = conv_windows(11, dist.get_world_size(), kernel_size=3, stride=2, padding=1)
    r = dist.get_rank()
    for records, direction in ((forward, "forward"), (backward, "backward")):
        sent = sum(n for kind, _, n in records if kind == "send")
        assert sent == halo_bytes(windows, slice_numel=2 * 3 * 4, element_size=8, direction=direction)[r]
    dx = shard_locally(x, mesh, [Shard(3)]).requires_grad_()
    with sharded_pooling(), CommDebugMode() as forward:
        y = nn.AdaptiveMaxPool2d(1)(dx)
    with sharded_pooling(), CommDebugMode() as backward:
        y.backward(shard_locally(torch.ones(y.shape, dtype=x.dtype), mesh, y.placements))
    assert comm_counts(forward) == {"all_gather": 1}, comm_counts(forward)
    assert comm_counts(backward) == {}, comm_counts(backward)


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


@on_ranks(4)
def test_wide_halos_read_across_ranks_and_bad_arguments_raise():
    mesh = tp_mesh()
    x = torch.randn(1, 2, 3, 6)
    dx = shard_locally(x, mesh, [Shard(3)])  # strips 2, 2, 2, 0
    with sharded_pooling():
        for pool in (F.max_pool2d, F.avg_pool2d):  # a halo of 3 from strips of 2: multi-hop
            torch.testing.assert_close(pool(dx, 7, 1, 3).full_tensor(), pool(x, 7, 1, 3), **TOL)
        with pytest.raises(RuntimeError, match="pad should be at most half"):
            F.max_pool2d(dx, 3, 1, 2)  # torch's own check, on the global shape
        x2 = shard_locally(torch.randn(1, 2, 8, 8), mesh_2x2(), [Shard(2), Shard(3)])
        with pytest.raises(NotImplementedError, match="one spatial dim"):
            F.max_pool2d(x2, 3, 1, 1)
        with pytest.raises(NotImplementedError, match="one spatial dim"):
            F.adaptive_max_pool2d(x2, 1)


# ---------------------------------------------------------------------------------------------
# Installation (single process)
# ---------------------------------------------------------------------------------------------

_OPS = (aten.max_pool2d_with_indices.default, aten.avg_pool2d.default, aten.adaptive_max_pool2d.default,
        aten.max_pool3d_with_indices_backward.default)
