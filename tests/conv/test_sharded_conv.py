"""Sharded convolution handlers on real gloo ranks: exact forward and gradients, no silent mislabels.

Each rank task runs many grid cases (one ``run_on_ranks`` call per group), and every case
compares the DTensor convolution's output, input gradient, weight gradient and bias gradient
with single-process ``F.conv{1,2,3}d``. Inputs are small integers, so the results are exact;
the check is ``atol=1e-5``. Every P2P op is recorded (as in ``test_halo.py``) to pin that
batch-only sharding exchanges nothing and that the halos carry exactly the geometry's bytes.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch_tp.conv import conv_windows, halo_bytes, halo_overlap, sharded_convolution, sharded_padding
from torch_tp.testing import mesh_2x2, on_ranks, record_p2p, run_on_ranks, tp_mesh, world_sizes

aten = torch.ops.aten
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_OTHER = 4  # size of the non-sharded spatial dims (kernel 3, padding 1 there)


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------


def _lengths(num_ranks):
    """Candidate lengths of the sharded dim, shortest first: (uneven, even) per size class."""
    return {
        2: [(13, 16), (23, 24), (41, 40), (61, 64)],
        4: [(30, 32), (45, 48), (77, 80), (125, 128)],
    }[num_ranks]


def grid(num_ranks):
    """Cases ``(ndim, sharded_dim, length, kernel, stride, padding, dilation)``.

    Every kernel (1-7) x dilation (1-3) x stride (1-3) x padding (0, 1, span // 2, span and
    ``"same"`` where stride is 1, deduplicated) appears once; the conv dimensionality, the
    sharded dim and even/uneven shards cycle through the cases. The length is the shortest
    candidate of that parity whose halos fit in the neighbours' shards (``conv_windows``).
    """
    cases = []
    combos = itertools.product((1, 2, 3, 4, 5, 7), (1, 2, 3), (1, 2, 3))
    i = 0
    for k, dilation, stride in combos:
        span = dilation * (k - 1)
        pads = sorted({0, min(1, span), span // 2, span})
        pads = pads + (["same"] if stride == 1 else [])
        for padding in pads:
            ndim = i % 3 + 1
            sharded = 2 + (i // 3) % ndim
            uneven = (i // 2) % 2 == 0
            for pair in _lengths(num_ranks):
                length = pair[0] if uneven else pair[1]
                try:
                    conv_windows(length, num_ranks, kernel_size=k, stride=stride, padding=padding,
                                 dilation=dilation)
                except ValueError:
                    continue
                cases.append((ndim, sharded, length, k, stride, padding, dilation))
                break
            i += 1
    return cases


def _case_tensors(case, batch, seed):
    ndim, sharded, length, k, stride, padding, dilation = case
    gen = torch.Generator().manual_seed(seed)
    spatial = [_OTHER] * ndim
    spatial[sharded - 2] = length
    kernel = [3] * ndim
    kernel[sharded - 2] = k
    x = torch.randint(-3, 4, (batch, 2, *spatial), generator=gen).float()
    w = torch.randint(-3, 4, (3, 2, *kernel), generator=gen).float()
    b = torch.randint(-3, 4, (3,), generator=gen).float()
    strides, dilations = [1] * ndim, [1] * ndim
    strides[sharded - 2], dilations[sharded - 2] = stride, dilation
    if padding == "same":
        pads = "same"
    else:
        pads = [1] * ndim
        pads[sharded - 2] = padding
    kwargs = dict(stride=strides, padding=pads, dilation=dilations)
    return x, w, b, kwargs


def _reference(case, x, w, b, kwargs, seed):
    # float64 on purpose: the small-integer results are exact there, while oneDNN's float32
    # weight gradient is wrong on some CPUs (AMD EPYC: off by 123 for (2, 3, 45, 7, 2, 18, 3))
    rx, rw, rb = (t.double().requires_grad_() for t in (x, w, b))
    y = _CONV[case[0]](rx, rw, rb, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    grad = torch.randint(-3, 4, y.shape, generator=gen).double()
    (y * grad).sum().backward()
    return y.detach().float(), grad.float(), rx.grad.float(), rw.grad.float(), rb.grad.float()


def _local(t, mesh, placements):
    """``t`` as a DTensor, chunked locally (every rank holds all of ``t``: no communication)."""
    return distribute_tensor(t, mesh, placements, src_data_rank=None)


def _run_sharded(mesh, placements, case, x, w, b, kwargs, grad):
    dx = _local(x, mesh, placements).requires_grad_()
    dw = _local(w, mesh, [Replicate()] * mesh.ndim).requires_grad_()
    db = _local(b, mesh, [Replicate()] * mesh.ndim).requires_grad_()
    with sharded_convolution(), sharded_padding():
        y = _CONV[case[0]](dx, dw, db, **kwargs)
        y.backward(_local(grad, mesh, y.placements))
    return y, dx.grad, dw.grad, db.grad


def _grid_task(cases, mesh_kind, start, full=False):
    """Run ``cases`` on this rank; return per case the placements and the four results.

    The output and input gradient are compared shard by shard with the reference's chunks
    (no gather); the weight and bias gradients as full tensors (their Partial sum). With
    ``full`` the four results are returned as full tensors.
    """
    if mesh_kind == "1d":
        mesh, batch = tp_mesh(), 2
    else:
        mesh, batch = mesh_2x2(), 3  # batch 3 on dp=2: uneven batch shards too
    results = []
    for n, case in enumerate(cases):
        seed = start + n
        x, w, b, kwargs = _case_tensors(case, batch, seed)
        y_ref, grad, gx_ref, gw_ref, gb_ref = _reference(case, x, w, b, kwargs, seed)
        sharded = case[1]
        placements = [Shard(sharded)] if mesh_kind == "1d" else [Shard(0), Shard(sharded)]
        y, gx, gw, gb = _run_sharded(mesh, placements, case, x, w, b, kwargs, grad)
        got = [y.to_local(), gx.to_local(), gw.full_tensor(), gb.full_tensor()]
        refs = [_local(y_ref, mesh, y.placements).to_local(), _local(gx_ref, mesh, gx.placements).to_local(),
                gw_ref, gb_ref]
        assert y.shape == y_ref.shape and gx.shape == gx_ref.shape, case
        for name, value, ref in zip(("out", "grad_input", "grad_weight", "grad_bias"), got, refs, strict=True):
            torch.testing.assert_close(value, ref, atol=1e-5, rtol=0, msg=lambda m, what=f"{case} {name}": f"{what}: {m}")
        if full:
            got = [y.full_tensor(), gx.full_tensor(), got[2], got[3]]
        results.append((tuple(y.placements), tuple(gx.placements), *(got if full else ())))
    return results


def _groups(cases, size):
    return [cases[i:i + size] for i in range(0, len(cases), size)]


def _check_placements(cases, results, mesh_kind):
    for case, (out_placements, grad_placements, *_rest) in zip(cases, results, strict=True):
        sharded = case[1]
        expected = (Shard(sharded),) if mesh_kind == "1d" else (Shard(0), Shard(sharded))
        assert out_placements == expected, (case, out_placements)
        assert grad_placements == expected, (case, grad_placements)


@world_sizes(2, 4)
def test_grid_matches_single_process_convolution(world_size):
    cases = grid(world_size)
    assert len(cases) >= 150, len(cases)
    assert {c[0] for c in cases} == {1, 2, 3} and {c[3] for c in cases} == {1, 2, 3, 4, 5, 7}
    for group in _groups(list(enumerate(cases)), 60):
        start = group[0][0]
        chunk = [c for _, c in group]
        per_rank = run_on_ranks(_grid_task, world_size, chunk, "1d", start, timeout=120)
        _check_placements(chunk, per_rank[0], "1d")


def _mesh_compare_cases():
    return grid(2)[::3]


@world_sizes(4)
def test_2x2_mesh_matches_1d_mesh(world_size):
    cases = _mesh_compare_cases()
    on_2x2 = run_on_ranks(_grid_task, 4, cases, "2x2", 0, True, timeout=120)
    _check_placements(cases, on_2x2[0], "2x2")
    # same cases on a 1-D mesh of 2 ranks (the tp size of the 2x2 mesh), batch 3 for equality;
    # the halo overlap is on for the 2x2 runs and off for these
    on_1d = run_on_ranks(_one_d_batch3_task, 2, cases, timeout=120)
    for case, a, b in zip(cases, on_2x2[0], on_1d[0], strict=True):
        for got_2x2, got_1d in zip(a[2:], b, strict=True):
            assert torch.equal(got_2x2, got_1d), case


def _one_d_batch3_task(cases):
    """The 1-D run, with the halo overlap off: the two code paths must agree exactly."""
    with halo_overlap(False):
        return _one_d_batch3_results(cases)


def _one_d_batch3_results(cases):
    out = []
    for n, case in enumerate(cases):
        x, w, b, kwargs = _case_tensors(case, 3, n)
        _y, grad, *_ = _reference(case, x, w, b, kwargs, n)
        out.append([t.full_tensor() for t in _run_sharded(tp_mesh(), [Shard(case[1])], case, x, w, b, kwargs, grad)])
    return out


# ---------------------------------------------------------------------------------------------
# Communication: batch-only does none, spatial sends exactly the halos
# ---------------------------------------------------------------------------------------------


def _comm_task():
    mesh = tp_mesh()
    case = (2, 3, 30, 4, 1, 3, 1)  # Conv2d, width 30 sharded, k=4, padding 3
    x, w, b, kwargs = _case_tensors(case, 4, 0)
    _y, grad, gx_ref, gw_ref, _gb = _reference(case, x, w, b, kwargs, 0)
    with record_p2p() as batch_only:
        y, gx, gw, _ = _run_sharded(mesh, [Shard(0)], case, x, w, b, kwargs, grad)
    assert y.placements == (Shard(0),) and gx.placements == (Shard(0),)
    torch.testing.assert_close(gx.full_tensor(), gx_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(gw.full_tensor(), gw_ref, atol=1e-5, rtol=0)
    with record_p2p() as spatial:
        _run_sharded(mesh, [Shard(3)], case, x, w, b, kwargs, grad)
    sent = sum(nbytes for kind, _, nbytes in spatial if kind == "send")
    # input without grad (output_mask[0] False): no adjoint exchange, weight grad still right
    dx = _local(x, mesh, [Shard(3)])
    dw = _local(w, mesh, [Replicate()]).requires_grad_()
    with record_p2p() as no_input_grad, sharded_convolution():
        y = F.conv2d(dx, dw, None, **kwargs)
        y.backward(_local(grad, mesh, y.placements))
    torch.testing.assert_close(dw.grad.full_tensor(), gw_ref, atol=1e-5, rtol=0)
    sent_no_input_grad = sum(nbytes for kind, _, nbytes in no_input_grad if kind == "send")
    return len(batch_only), sent, sent_no_input_grad


@world_sizes(2, 4)
def test_batch_only_does_no_exchange_and_spatial_sends_exactly_the_halos(world_size):
    results = run_on_ranks(_comm_task, world_size)
    windows = conv_windows(30, world_size, kernel_size=4, padding=3)
    slice_numel = 4 * 2 * _OTHER  # batch * channels * height
    fwd = halo_bytes(windows, slice_numel=slice_numel, element_size=4)
    bwd = halo_bytes(windows, slice_numel=slice_numel, element_size=4, direction="backward")
    # forward exchange, the recompute in the backward (grad_weight needs the data), the adjoint
    expected = [2 * f + b for f, b in zip(fwd, bwd, strict=True)]
    assert [r[0] for r in results] == [0] * world_size
    assert [r[1] for r in results] == expected
    assert [r[2] for r in results] == [2 * f for f in fwd]


@on_ranks(2, 4)
def test_grouped_convolution_is_supported():
    mesh = tp_mesh()
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 4, (2, 4, 5, 30), generator=gen).float()
    w = torch.randint(-3, 4, (6, 2, 3, 4), generator=gen).float()  # groups=2
    b = torch.randint(-3, 4, (6,), generator=gen).float()
    kwargs = dict(stride=(1, 2), padding=(1, 2), dilation=(1, 2), groups=2)
    rx, rw, rb = (t.clone().requires_grad_() for t in (x, w, b))
    y_ref = F.conv2d(rx, rw, rb, **kwargs)
    grad = torch.randint(-3, 4, y_ref.shape, generator=gen).float()
    y_ref.backward(grad)
    dx = _local(x, mesh, [Shard(3)]).requires_grad_()
    dw, db = (_local(t, mesh, [Replicate()]).requires_grad_() for t in (w, b))
    with sharded_convolution():
        y = F.conv2d(dx, dw, db, **kwargs)
        y.backward(_local(grad, mesh, y.placements))
    assert y.placements == (Shard(3),)
    for got, ref in ((y, y_ref), (dx.grad, rx.grad), (dw.grad, rw.grad), (db.grad, rb.grad)):
        torch.testing.assert_close(got.full_tensor(), ref, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Unsupported cases raise, never assert or mislabel
# ---------------------------------------------------------------------------------------------


def _expect(exc, fn, *args, **kwargs):
    with sharded_convolution():
        with pytest.raises(exc) as info:
            fn(*args, **kwargs)
    return str(info.value)


@on_ranks(4)
def test_unsupported_cases_raise_the_named_exception():
    mesh = tp_mesh()
    x = torch.randn(2, 4, 6, 16)
    w = torch.randn(4, 4, 3, 3)
    rep = [Replicate()]
    dw = distribute_tensor(w, mesh, rep)
    messages = {}
    messages["channels"] = _expect(
        NotImplementedError, F.conv2d, distribute_tensor(x, mesh, [Shard(1)]), dw, padding=1)
    messages["weight"] = _expect(
        NotImplementedError, F.conv2d, distribute_tensor(x, mesh, [Shard(3)]),
        distribute_tensor(w, mesh, [Shard(0)]), padding=1)
    x = distribute_tensor(torch.randn(2, 2, 8, 8), mesh_2x2(), [Shard(2), Shard(3)])
    w = distribute_tensor(torch.randn(2, 2, 3, 3), mesh_2x2(), [Replicate(), Replicate()])
    messages["two_spatial"] = _expect(NotImplementedError, F.conv2d, x, w, padding=1)
    assert "channel" in messages["channels"]
    assert "replicated weight" in messages["weight"]
    assert "one spatial dim" in messages["two_spatial"]


# ---------------------------------------------------------------------------------------------
# Installation
# ---------------------------------------------------------------------------------------------

_OPS = (aten.convolution.default, aten.convolution_backward.default)


@on_ranks(2)
def test_a_kernel_failing_while_halos_are_in_flight_raises_and_the_group_keeps_working():
    # dtypes that disagree pass the layout checks and fail in the local kernel, after the
    # overlapped exchange has started: it is waited for before the error leaves the handler
    mesh = tp_mesh()
    x = torch.randn(1, 2, 4, 16)
    w = torch.randn(3, 2, 3, 3)
    dx64 = _local(x.double(), mesh, [Shard(3)])
    dw = _local(w, mesh, [Replicate()])
    with sharded_convolution(), halo_overlap(True):
        with pytest.raises(RuntimeError):
            F.conv2d(dx64, dw, padding=1)
        y = F.conv2d(_local(x, mesh, [Shard(3)]), dw, padding=1)  # the next exchange pairs up as usual
    torch.testing.assert_close(y.full_tensor(), F.conv2d(x, w, padding=1), atol=1e-5, rtol=1e-5)
