"""Upsampling and transposed convolution on spatial shards, on real gloo ranks, against one process.

Every case runs the op on a DTensor sharded ``Shard(d)`` on a spatial dim (uneven strips, and
at world size 4 empty ones) and compares each rank's output strip and input-gradient strip
with the ``torch.chunk`` pieces of the single-process result; transposed convolutions also
compare the (``Partial``) weight and bias gradients as full tensors. Nearest modes only copy,
so their outputs must agree bit for bit; their input gradients and everything of the linear
modes agree to ``TOL`` (the sums are rounded in another order than aten's CPU kernels, whose
own order depends on the layout and sizes), and bit for bit where the arithmetic is exact
(integer values, scale 2).
"""


import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp.conv import sharded_batch_norm, sharded_convolution
from torch_tp.conv.transposed_conv import transposed_convolution_handler
from torch_tp.conv.upsample import (
    _interpolate,
    _interpolate_adjoint,
    _taps,
    sharded_upsampling,
    upsample_handler,
)
from torch_tp.testing import TOL, assert_sharded_step_matches, assert_sharded_trains_like, comm_counts, full_tensor, mesh_2x2, on_ranks, rank
from torch_tp.testing import record_p2p, replicated_copy, sent_bytes, shard_locally, tp_mesh, world_size

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# Helpers (rank side)
# ---------------------------------------------------------------------------------------------


def _pair(model, reference):
    """One callable: ``model`` on DTensors, ``reference`` on plain tensors."""
    return lambda t: (model if isinstance(t, DTensor) else reference)(t)


def _run(fn, x, dy, mesh, placements, what, exact=(), context=sharded_upsampling):
    """``fn`` on ``x`` sharded by ``placements`` against ``fn`` on ``x``: output and input gradient
    strips (bit for bit those named in ``exact``: ``"output"``, ``"grad"``), placements, shapes."""
    with context():
        assert_sharded_step_matches(fn, fn, x, dy, mesh, placements, exact=exact, params=False, **TOL, what=what)


# ---------------------------------------------------------------------------------------------
# Upsampling against one process
# ---------------------------------------------------------------------------------------------

UPSAMPLE_CASES = {
    # name: (input shape, sharded dim, nn.Upsample kwargs). At world size 4: width 10 is held
    # 3, 3, 3, 1 and width 11 as 3, 3, 3, 2; height 6 as 2, 2, 2, 0 and width 2 as 1, 1, 0, 0
    # (the last two ranks' outputs read a rank two positions away).
    "nearest_x2_width": ((2, 3, 4, 10), 3, dict(scale_factor=2, mode="nearest")),
    "nearest_x3_width_11": ((2, 3, 4, 11), 3, dict(scale_factor=3, mode="nearest")),
    "nearest_size_height_empty_strip": ((2, 3, 6, 5), 2, dict(size=(13, 7), mode="nearest")),
    "nearest_exact_x2.5_width": ((2, 3, 4, 11), 3, dict(scale_factor=2.5, mode="nearest-exact")),
    "nearest_x2_two_columns": ((2, 3, 4, 2), 3, dict(scale_factor=2, mode="nearest")),
    "bilinear_x2_width": ((2, 3, 4, 10), 3, dict(scale_factor=2, mode="bilinear")),
    "bilinear_x2_width_11": ((2, 3, 5, 11), 3, dict(scale_factor=2, mode="bilinear")),
    "bilinear_x2_align_corners_height": ((2, 3, 6, 5), 2, dict(scale_factor=2, mode="bilinear",
                                                                align_corners=True)),
    "bilinear_x2_align_corners_width_11": ((2, 3, 4, 11), 3, dict(scale_factor=2, mode="bilinear",
                                                                  align_corners=True)),
    "bilinear_size_downsample_width": ((2, 3, 4, 22), 3, dict(size=(7, 9), mode="bilinear")),
    "bilinear_x2_two_columns": ((2, 3, 4, 2), 3, dict(scale_factor=2, mode="bilinear")),
    "linear_x3_length": ((2, 3, 10), 2, dict(scale_factor=3, mode="linear")),
    "nearest_3d_x2_depth_empty_strip": ((1, 2, 3, 4, 5), 2, dict(scale_factor=2, mode="nearest")),
    "trilinear_x2_width": ((1, 2, 3, 4, 10), 4, dict(scale_factor=2, mode="trilinear",
                                                     align_corners=False)),
}


@pytest.mark.parametrize("case", list(UPSAMPLE_CASES), ids=list(UPSAMPLE_CASES))
@on_ranks(2, 4)
def test_upsample_matches_single_process(case):
    shape, dim, kwargs = UPSAMPLE_CASES[case]
    gen = torch.Generator().manual_seed(0)
    up = nn.Upsample(**kwargs)
    x = torch.randn(shape, generator=gen)
    dy = torch.randn(up(x).shape, generator=gen)
    # nearest copies: the output is bit for bit; each input's gradient sums its copies' in
    # another order than aten's kernel (dim by dim, not output row-major): TOL
    _run(up, x, dy, tp_mesh(), [Shard(dim)], case, exact=("output",) if "nearest" in kwargs["mode"] else ())


@on_ranks(2, 4)
def test_bilinear_x2_of_integers_is_bitwise_exact():
    # weights 1/4 and 3/4 and small integers: every product and sum is exact, in any order
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-8, 9, (2, 3, 5, 11), generator=gen).float()
    dy = torch.randint(-8, 9, (2, 3, 10, 22), generator=gen).float()
    for dim in (2, 3):
        _run(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), x, dy, tp_mesh(), [Shard(dim)],
             f"dim {dim}", exact=("output", "grad"))


@on_ranks(4)
def test_batch_and_width_sharded_on_a_2x2_mesh():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 4, 10, generator=gen)
    dy = torch.randn(3, 4, 8, 20, generator=gen)
    up = nn.Upsample(scale_factor=2, mode="bilinear")
    for placements in ([Shard(0), Shard(3)], [Replicate(), Shard(3)], [Shard(1), Shard(2)]):
        _run(up, x, dy, mesh_2x2(), placements, str(placements))


@on_ranks(2)
def test_unsharded_spatial_dims_run_the_local_op():
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(4, 3, 4, 5, generator=gen), torch.randn(4, 3, 8, 10, generator=gen)
    up = lambda t: F.interpolate(t, scale_factor=2, mode="nearest")  # noqa: E731 (no module hooks)
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        with record_p2p() as p2p, CommDebugMode() as mode:
            _run(up, x, dy, tp_mesh(), placements, str(placements), exact=("output", "grad"))
        assert not p2p and comm_counts(mode) == {}, (placements, p2p, comm_counts(mode))


@on_ranks(2, 4)
def test_exchange_moves_exactly_the_columns_read_and_no_collective():
    # width 16: even strips and even output chunks. Nearest x2 reads only its own columns;
    # bilinear x2 (half-pixel) reads one column across each inner boundary, both ways.
    mesh, n = tp_mesh(), world_size()
    x = torch.randn(2, 3, 4, 16)
    column = 2 * 3 * 4 * 4  # bytes of one column: batch * channels * height * float32
    inner_neighbours = (rank() > 0) + (rank() < n - 1)
    for mode, expected in (("nearest", 0), ("bilinear", inner_neighbours * column)):
        dx = shard_locally(x, mesh, [Shard(3)]).requires_grad_()
        with sharded_upsampling(), CommDebugMode() as comm:
            with record_p2p() as forward:
                y = F.interpolate(dx, scale_factor=2, mode=mode)
            with record_p2p() as backward:
                y.backward(torch.ones_like(y))
        assert comm_counts(comm) == {}, comm_counts(comm)
        assert (sent_bytes(forward), sent_bytes(backward)) == (expected, expected), (mode, forward, backward)
        torch.testing.assert_close(dx.grad.full_tensor(), torch.full_like(x, 4.0))


@on_ranks(4)
def test_partial_sum_input_passes_through_upsampling_and_is_reduced_before_a_transposed_conv():
    # [Partial(), Shard(3)] on the 2x2 mesh: the two dp rows hold addends of the same image,
    # each width-sharded over tp (the exchange runs inside the tp sub-group)
    mesh = mesh_2x2()
    gen = torch.Generator().manual_seed(7)
    whole, other = torch.randn(2, 4, 3, 10, generator=gen), torch.randn(2, 4, 3, 10, generator=gen)
    addend = whole - other if mesh.get_local_rank("dp") == 0 else other
    local = torch.chunk(addend, 2, dim=3)[mesh.get_local_rank("tp")]
    x = DTensor.from_local(local, mesh, [Partial(), Shard(3)])
    with sharded_upsampling(), CommDebugMode() as comm:
        y = F.interpolate(x, scale_factor=2, mode="bilinear")
    assert y.placements == (Partial(), Shard(3)) and comm_counts(comm) == {}, (y.placements, comm_counts(comm))
    torch.testing.assert_close(y.full_tensor(), F.interpolate(whole, scale_factor=2, mode="bilinear"), **TOL)
    reference = nn.ConvTranspose2d(4, 3, 2, stride=2)
    model = replicated_copy(reference, mesh)
    with sharded_convolution():
        z = model(x)
    assert z.placements == (Replicate(), Shard(3))
    torch.testing.assert_close(z.full_tensor(), reference(whole), **TOL)


@on_ranks(2)
def test_without_the_handlers_dtensor_gathers_and_replicates():
    # what the handlers replace: DTensor's own upsample all-gathers the input
    dx = shard_locally(torch.randn(2, 3, 4, 10), tp_mesh(), [Shard(3)])
    with CommDebugMode() as comm:
        y = F.interpolate(dx, scale_factor=2, mode="nearest")
    assert y.placements == (Replicate(),) and comm_counts(comm) == {"all_gather_into_tensor": 1}
    with sharded_upsampling():
        assert F.interpolate(dx, scale_factor=2, mode="nearest").placements == (Shard(3),)


def test_source_indices_and_weights_match_aten():
    # single process: the per-dim taps applied to a whole tensor reproduce aten's kernels
    # (nearest bit for bit, forward and backward; linear to a few float32 ulps)
    gen = torch.Generator().manual_seed(4)
    sizes = [dict(scale_factor=2), dict(scale_factor=3), dict(scale_factor=2.7), dict(scale_factor=0.37),
             dict(size=1), dict(size=13), dict(scale_factor=1.3, recompute_scale_factor=True)]
    for dtype in (torch.float32, torch.float64):
        for n_in, kw, mode in ((n, kw, m) for n in (1, 5, 11, 33) for kw in sizes
                               for m in ("nearest", "nearest-exact", "linear", "linear-ac")):
            kind, ac = mode.replace("-ac", ""), mode.endswith("-ac")
            if int(n_in * kw.get("scale_factor", 1)) == 0:
                continue  # no output
            x = torch.randn(2, 3, n_in, generator=gen, dtype=dtype, requires_grad=True)
            ref = F.interpolate(x, mode=kind, align_corners=ac if kind == "linear" else None, **kw)
            g = torch.randn(ref.shape, generator=gen, dtype=dtype)
            (ref_grad,) = torch.autograd.grad(ref, x, g)
            scale = None if "size" in kw or kw.get("recompute_scale_factor") else kw["scale_factor"]
            tol = dict(rtol=0, atol=0) if kind != "linear" else dict(rtol=1e-6, atol=1e-6)
            index, weight = _taps(kind, n_in, ref.shape[-1], ac, scale, dtype)
            torch.testing.assert_close(_interpolate(x.detach(), 2, index, weight), ref, **tol)
            index, weight = _taps(kind, n_in, ref.shape[-1], ac, scale, dtype, legacy=True)
            torch.testing.assert_close(_interpolate_adjoint(g, 2, index, weight, n_in), ref_grad, **tol)


# ---------------------------------------------------------------------------------------------
# Transposed convolution against one process
# ---------------------------------------------------------------------------------------------

TRANSPOSED_CASES = {
    # name: (module, input shape, sharded dim)
    "k2s2_width_10": (lambda: nn.ConvTranspose2d(4, 3, 2, stride=2), (2, 4, 5, 10), 3),
    "k2s2_width_11": (lambda: nn.ConvTranspose2d(4, 3, 2, stride=2), (2, 4, 5, 11), 3),
    "k3s2p1_output_padding_height": (lambda: nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1),
                                     (2, 4, 10, 5), 2),
    "k3s2p1_output_padding_width_empty_strip": (
        lambda: nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1), (2, 4, 5, 3), 3),
    "k4s3p2_dilation2_groups2_no_bias": (
        lambda: nn.ConvTranspose2d(4, 6, 4, stride=3, padding=2, dilation=2, groups=2, bias=False),
        (2, 4, 5, 11), 3),
    "k5s1p2_width": (lambda: nn.ConvTranspose2d(4, 3, 5, padding=2), (2, 4, 5, 10), 3),
    "1d_k3s2_length": (lambda: nn.ConvTranspose1d(4, 3, 3, stride=2), (2, 4, 10), 2),
    "3d_k2s2_depth": (lambda: nn.ConvTranspose3d(4, 3, 2, stride=2), (1, 4, 6, 3, 4), 2),
}


@pytest.mark.parametrize("case", list(TRANSPOSED_CASES), ids=list(TRANSPOSED_CASES))
@on_ranks(2, 4)
def test_transposed_convolution_matches_single_process(case):
    make, shape, dim = TRANSPOSED_CASES[case]
    mesh = tp_mesh()
    torch.manual_seed(0)
    reference = make()
    model = replicated_copy(reference, mesh)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen)
    dy = torch.randn(reference(x).shape, generator=gen)
    _run(_pair(model, reference), x, dy, mesh, [Shard(dim)], case, context=sharded_convolution)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad.placements == (Partial(),), (name, p.grad.placements)
        torch.testing.assert_close(full_tensor(p.grad), q.grad, **TOL, msg=lambda m: f"{case} grad of {name}: {m}")


@on_ranks(4)
def test_transposed_convolution_batch_and_width_sharded_on_a_2x2_mesh():
    mesh = mesh_2x2()
    torch.manual_seed(0)
    reference = nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)
    model = replicated_copy(reference, mesh)
    x = torch.randn(3, 4, 5, 10)
    dy = torch.randn(reference(x).shape)
    _run(_pair(model, reference), x, dy, mesh, [Shard(0), Shard(3)], "2x2", context=sharded_convolution)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad.placements == (Partial(), Partial())
        torch.testing.assert_close(full_tensor(p.grad), q.grad, **TOL)


@on_ranks(2, 4)
def test_transposed_k2s2_sends_nothing_when_chunks_line_up():
    # width 8 on 2 or 4 ranks: each rank's output chunk is exactly its inputs' reach
    mesh = tp_mesh()
    model = replicated_copy(nn.ConvTranspose2d(4, 3, 2, stride=2), mesh)
    dx = shard_locally(torch.randn(2, 4, 3, 8), mesh, [Shard(3)]).requires_grad_()
    with sharded_convolution(), record_p2p() as p2p, CommDebugMode() as comm:
        y = model(dx)
        y.backward(torch.ones_like(y))
    assert y.placements == (Shard(3),) and y.to_local().shape[3] == 16 // world_size()
    assert not p2p and comm_counts(comm) == {}, (p2p, comm_counts(comm))


# ---------------------------------------------------------------------------------------------
# A small U-Net: strided conv down, transposed conv and bilinear up, skip connection
# ---------------------------------------------------------------------------------------------


class _TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU())
        self.up_t = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.up_b = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(6, 2, 1))
        self.head = nn.Conv2d(10, 2, 3, padding=1)

    def forward(self, x):
        skip = self.enc(x)
        low = self.down(skip)
        return self.head(torch.cat([skip, self.up_t(low), self.up_b(low)], dim=1))


@on_ranks(2, 4)
def test_tiny_unet_trains_like_single_process():
    # float64, width 16 (even) and height 12 sharded: 3, 3, 3, 3 / after the stride-2 conv 2, 2, 1, 1
    torch.manual_seed(0)
    reference = _TinyUNet().double()
    gen = torch.Generator().manual_seed(6)
    batches = [(torch.randn(shape, generator=gen, dtype=torch.float64),
                torch.randn(shape[0], 2, *shape[2:], generator=gen, dtype=torch.float64), [Shard(dim)])
               for dim, shape in ((3, (2, 3, 6, 16)), (2, (2, 3, 12, 8)))]
    mesh = tp_mesh()
    with sharded_convolution(), sharded_batch_norm(), sharded_upsampling():
        assert_sharded_trains_like(replicated_copy(reference, mesh), reference, batches, mesh, None, **TOL,
                                   optimizer=functools.partial(torch.optim.SGD, lr=0.1))


# ---------------------------------------------------------------------------------------------
# Unsupported layouts raise
# ---------------------------------------------------------------------------------------------


@on_ranks(4)
def test_unsupported_cases_raise():
    mesh = tp_mesh()
    x = torch.randn(2, 4, 6, 16)
    with sharded_upsampling():
        partial = DTensor.from_local(torch.randn(2, 4, 6, 16), mesh, [Partial("max")])
        with pytest.raises(NotImplementedError, match="Partial"):
            F.interpolate(partial, scale_factor=2)
        two = shard_locally(torch.randn(2, 2, 8, 8), mesh_2x2(), [Shard(2), Shard(3)])
        with pytest.raises(NotImplementedError, match="one spatial dim"):
            F.interpolate(two, scale_factor=2, mode="bilinear")
    with pytest.raises(NotImplementedError, match="as a DTensor"):
        upsample_handler(aten.upsample_nearest2d.default, (x, [12, 32], 2.0, 2.0), {})
    w = shard_locally(torch.randn(4, 4, 2, 2), mesh, [Replicate()])
    args = (shard_locally(x, mesh, [Shard(3)]), w, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1)
    with pytest.raises(ValueError, match="transposed=True calls only"):
        transposed_convolution_handler(aten.convolution.default, args, {})
    args = (shard_locally(x, mesh, [Shard(1)]), w, None, [2, 2], [0, 0], [1, 1], True, [0, 0], 1)
    with pytest.raises(NotImplementedError, match="channel dim"):
        transposed_convolution_handler(aten.convolution.default, args, {})
    args = (shard_locally(x, mesh, [Shard(3)]), shard_locally(torch.randn(4, 4, 2, 2), mesh, [Shard(0)]), None, [2, 2],
            [0, 0], [1, 1], True, [0, 0], 1)
    with pytest.raises(NotImplementedError, match="replicated weight"):
        transposed_convolution_handler(aten.convolution.default, args, {})


# ---------------------------------------------------------------------------------------------
# Installation (single process)
# ---------------------------------------------------------------------------------------------

_OPS = (aten.upsample_nearest2d.default, aten.upsample_bilinear2d_backward.default,
        aten._upsample_nearest_exact3d.default, aten.upsample_linear1d.default)
