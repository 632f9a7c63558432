"""Multi-hop halos: a halo wider than the neighbour's strip is gathered from as many ranks as needed.

Small maps on many ranks give strips narrower than a kernel's halo (a 7x7 kernel needs 3
columns each side; width 5 on 4 ranks is strips 2, 2, 1, 0). The geometry then records, per
rank, the range it needs from every other rank, and the exchange moves each piece directly
between its owner and its reader in one batch of P2P ops. Here: the geometry on its own (no
ranks), ``halo_exchange`` against slicing / scattering the global tensor, and the sharded
convolution and max pooling against one process. Values are small integers: exact.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from torch_tp._layouts import shard_bounds
from torch_tp.conv import ShardWindow, conv_windows, halo_bytes, halo_exchange, sharded_convolution
from torch_tp.conv import pooling
from torch_tp.testing import TOL, full_tensor, local_chunk, on_ranks, rank, record_p2p, tp_mesh

# ---------------------------------------------------------------------------------------------
# Geometry (pure)
# ---------------------------------------------------------------------------------------------


def test_a_7x7_kernel_on_width_5_over_4_ranks_reads_across_two_ranks():
    windows = conv_windows(5, 4, kernel_size=7, padding=3)  # strips 2, 2, 1, 0
    assert [(w.in_start, w.in_stop, w.out_start, w.out_stop) for w in windows] == [
        (0, 2, 0, 2), (2, 4, 2, 4), (4, 5, 4, 5), (5, 5, 5, 5)]
    # (rank, start, stop): rank 0 reads [0, 5) = own + [2, 4) of rank 1 + [4, 5) of rank 2
    assert [w.recv_ranges for w in windows] == [
        ((1, 2, 4), (2, 4, 5)), ((0, 0, 2), (2, 4, 5)), ((0, 1, 2), (1, 2, 4)), ()]
    assert [w.send_ranges for w in windows] == [
        ((1, 0, 2), (2, 1, 2)), ((0, 2, 4), (2, 2, 4)), ((0, 4, 5), (1, 4, 5)), ()]
    assert [(w.recv_left, w.recv_right, w.send_left, w.send_right) for w in windows] == [
        (0, 3, 0, 3), (2, 1, 2, 2), (3, 0, 2, 0), (0, 0, 0, 0)]
    assert windows[0].recv_right_hops == (2, 1)
    assert windows[1].recv_right_hops == ()  # rank 1 only talks to its neighbours: unchanged format
    assert windows[3] == ShardWindow(rank=3, in_start=5, in_stop=5, out_start=5, out_stop=5, need_start=5,
                                     need_stop=5, recv_left=0, recv_right=0, send_left=0, send_right=0,
                                     trim_left=0, trim_right=0, pad_left=0, pad_right=0)
    assert halo_bytes(windows, slice_numel=1, element_size=1) == [3, 4, 2, 0]
    assert halo_bytes(windows, slice_numel=1, element_size=1, direction="backward") == [3, 3, 3, 0]


@pytest.mark.parametrize("in_size", [5, 6, 7, 8, 10])
@pytest.mark.parametrize("conv", [dict(kernel_size=7, padding=3), dict(kernel_size=4, stride=3),
                                  dict(kernel_size=3, dilation=3, padding=6), dict(kernel_size=5, stride=2)],
                         ids=["k7p3", "k4s3_drift", "k3d3p6", "k5s2"])
def test_every_received_range_lies_in_its_owners_shard_and_is_what_that_rank_sends(in_size, conv):
    windows = conv_windows(in_size, 4, **conv)
    chunks = shard_bounds(in_size, 4)
    for w in windows:
        ranges = w.recv_ranges
        covered = sorted([(a, b) for _, a, b in ranges] + [(w.in_start, w.in_stop)])
        positions = [p for a, b in covered for p in range(a, b)]
        assert positions == list(range(w.in_start - w.recv_left, w.in_stop + w.recv_right)), w
        for peer, a, b in ranges:
            assert chunks[peer][0] <= a < b <= chunks[peer][1], (w, peer)
            assert (w.rank, a, b) in windows[peer].send_ranges, (w, peer)
    sent = sorted((src.rank, *r) for src in windows for r in src.send_ranges)
    received = sorted((peer, w.rank, a, b) for w in windows for peer, a, b in w.recv_ranges)
    assert sent == received


def test_inconsistent_hops_are_refused():
    fields = dict(rank=0, in_start=0, in_stop=2, out_start=0, out_stop=2, need_start=0, need_stop=5,
                  recv_left=0, recv_right=3, send_left=0, send_right=0, trim_left=0, trim_right=0,
                  pad_left=0, pad_right=0)
    with pytest.raises(ValueError, match=r"recv_right_hops=\(2, 2\) must be ints >= 0 summing to recv_right=3"):
        ShardWindow(**fields, recv_right_hops=(2, 2))


# ---------------------------------------------------------------------------------------------
# halo_exchange: 2-3 hops, uneven and empty strips (world size 4)
# ---------------------------------------------------------------------------------------------

# global length, recv_left and recv_right per position. Strips: 5 -> 2, 2, 1, 0 (an empty one);
# 7 -> 2, 2, 2, 1; 10 -> 3, 3, 3, 1.
_HALOS = {
    "two_hops_empty_strip": (5, [0, 2, 3, 3], [3, 1, 0, 0]),
    "three_hops": (7, [0, 1, 4, 5], [5, 3, 1, 0]),
    "uneven": (10, [0, 3, 6, 4], [7, 2, 1, 0]),
}


def _per_hop(count, sizes):
    """Split ``count`` over shards of ``sizes`` (nearest first), by walking position by position."""
    hops = [0] * len(sizes)
    for i in range(count):  # the i-th slice beyond the own shard
        owner, seen = 0, sizes[0]
        while i >= seen:
            owner += 1
            seen += sizes[owner]
        hops[owner] += 1
    while hops and hops[-1] == 0:
        hops.pop()
    return tuple(hops)


def _all_counts(length, recv_left, recv_right):
    """Every position's (recv_left, recv_right, send_left, send_right) per hop."""
    sizes = [b - a for a, b in shard_bounds(length, 4)]
    recv_l = [_per_hop(recv_left[p], sizes[:p][::-1]) for p in range(4)]
    recv_r = [_per_hop(recv_right[p], sizes[p + 1:]) for p in range(4)]

    def column(peers):
        hops = [r[h] if h < len(r) else 0 for h, r in enumerate(peers)]
        while hops and hops[-1] == 0:
            hops.pop()
        return tuple(hops)

    return [dict(recv_left=recv_l[p], recv_right=recv_r[p], send_left=column(recv_r[:p][::-1]),
                 send_right=column(recv_l[p + 1:])) for p in range(4)]


@pytest.mark.parametrize("case", list(_HALOS))
@on_ranks(4)
def test_multi_hop_exchange_equals_slicing_and_its_backward_scatters_to_the_owners(case):
    length, recv_left, recv_right = _HALOS[case]
    global_x = torch.arange(2 * length * 3, dtype=torch.float32).view(2, length, 3)
    bounds, counts = shard_bounds(length, 4), _all_counts(length, recv_left, recv_right)
    assert max(len(c) for p in counts for c in p.values()) >= 2  # the case is really multi-hop
    start, stop = bounds[rank()]
    x = global_x[:, start:stop].clone().requires_grad_()
    with record_p2p() as forward:
        strip = halo_exchange(x, dim=1, **counts[rank()], mesh=tp_mesh())
    lows = [bounds[p][0] - recv_left[p] for p in range(4)]
    highs = [bounds[p][1] + recv_right[p] for p in range(4)]
    assert torch.equal(strip, global_x[:, lows[rank()]:highs[rank()]]), (strip, lows, highs)
    # backward: each rank's strip gradient scattered (added) onto the global tensor
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randint(-4, 5, (2, highs[p] - lows[p], 3), generator=gen).float() for p in range(4)]
    with record_p2p() as backward:
        (strip * grads[rank()]).sum().backward()
    reference = torch.zeros_like(global_x)
    for p in range(4):
        reference[:, lows[p]:highs[p]] += grads[p]
    assert torch.equal(x.grad, reference[:, start:stop]), (x.grad, reference)
    # each piece goes directly to its reader: a message per (owner, reader) pair, exact bytes
    slice_bytes = 2 * 3 * 4
    me = counts[rank()]
    wanted = {-1 - h: c for h, c in enumerate(me["send_left"]) if c}
    wanted.update({1 + h: c for h, c in enumerate(me["send_right"]) if c})
    assert sorted((peer, n) for kind, peer, n in forward if kind == "send") == sorted(
        (rank() + o, c * slice_bytes) for o, c in wanted.items())
    assert sum(n for kind, _, n in backward if kind == "send") == (recv_left[rank()] + recv_right[rank()]) * slice_bytes


@on_ranks(4)
def test_hop_counts_that_do_not_fit_raise_before_any_message():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"send_left=\(1, 4\) but this rank's shard holds only 3"):
        halo_exchange(x, dim=1, recv_left=0, recv_right=0, send_left=(1, 4), send_right=0, mesh=tp_mesh())
    with pytest.raises(ValueError, match=r"recv_left must be an int >= 0, got \(1, -1\)"):
        halo_exchange(x, dim=1, recv_left=(1, -1), recv_right=0, send_left=0, send_right=0, mesh=tp_mesh())
    if rank() == 1:
        with pytest.raises(ValueError, match=r"recv_left=\(1, 1\) reaches 2 ranks to the left, but the rank at "
                                             r"position 1 of 4 has only 1 there"):
            halo_exchange(x, dim=1, recv_left=(1, 1), recv_right=0, send_left=0, send_right=0, mesh=tp_mesh())


# ---------------------------------------------------------------------------------------------
# Sharded convolution and pooling end to end
# ---------------------------------------------------------------------------------------------


def _conv_case(width, kernel, *, groups, channels=4, **kwargs):
    """Single-process F.conv2d and its grads vs the sharded one on Shard(3); returns the P2P records."""
    gen = torch.Generator().manual_seed(width * 10 + kernel)
    x = torch.randint(-3, 4, (2, channels, 3, width), generator=gen).double()
    w = torch.randint(-3, 4, (channels, channels // groups, kernel, kernel), generator=gen).double()
    b = torch.randint(-3, 4, (channels,), generator=gen).double()
    kwargs = dict(kwargs, groups=groups)
    rx, rw, rb = (t.clone().requires_grad_() for t in (x, w, b))
    y_ref = F.conv2d(rx, rw, rb, **kwargs)
    grad = torch.randint(-3, 4, y_ref.shape, generator=gen).double()
    y_ref.backward(grad)
    mesh = tp_mesh()
    dx = distribute_tensor(x, mesh, [Shard(3)]).requires_grad_()
    dw, db = (distribute_tensor(t, mesh, [Replicate()]).requires_grad_() for t in (w, b))
    with sharded_convolution(), record_p2p() as records:
        y = F.conv2d(dx, dw, db, **kwargs)
        y.backward(distribute_tensor(grad, mesh, y.placements))
    assert y.placements == (Shard(3),) and dx.grad.placements == (Shard(3),)
    assert torch.equal(y.to_local(), local_chunk(y_ref.detach(), 3))
    assert torch.equal(dx.grad.to_local(), local_chunk(rx.grad, 3))
    torch.testing.assert_close(full_tensor(dw.grad), rw.grad, **TOL)
    torch.testing.assert_close(full_tensor(db.grad), rb.grad, **TOL)
    return records


@pytest.mark.parametrize("width", [5, 6])
@on_ranks(4)
def test_depthwise_7x7_on_strips_narrower_than_its_halo_matches_one_process(width):
    records = _conv_case(width, 7, groups=4, padding=3)
    windows = conv_windows(width, 4, kernel_size=7, padding=3)
    fwd = halo_bytes(windows, slice_numel=2 * 4 * 3, element_size=8)[rank()]
    bwd = halo_bytes(windows, slice_numel=2 * 4 * 3, element_size=8, direction="backward")[rank()]
    # forward exchange, the recompute for the weight gradient, the adjoint
    assert sum(n for kind, _, n in records if kind == "send") == 2 * fwd + bwd
    if rank() == 0:  # its right halo of 3 spans ranks 1 and 2
        assert {peer for _, peer, _ in records} == {1, 2}


@on_ranks(4)
def test_the_old_refusals_now_match_one_process():
    # width 8 on 4 ranks, kernel 7 (strips of 2, halos of 3), and stride 3 drifting past the neighbour
    _conv_case(8, 7, groups=1, channels=2, padding=3)
    _conv_case(8, 4, groups=1, channels=2, stride=3, padding=(1, 0))


_POOLS = {
    "max": lambda t: F.max_pool2d(t, 5, 1, 2),
    "avg_exclude_pad": lambda t: F.avg_pool2d(t, 5, 1, 2, count_include_pad=False),
}


@pytest.mark.parametrize("pool", list(_POOLS))
@pytest.mark.parametrize("width", [3, 4])
@on_ranks(4)
def test_pooling_kernel_5_on_narrow_strips_matches_one_process(width, pool):
    gen = torch.Generator().manual_seed(width)
    x = -1.0 - torch.randperm(2 * 3 * 4 * width, generator=gen).double().view(2, 3, 4, width)  # no ties
    rx = x.clone().requires_grad_()
    y_ref = _POOLS[pool](rx)
    grad = torch.randint(-3, 4, y_ref.shape, generator=gen).double()
    y_ref.backward(grad)
    mesh = tp_mesh()
    dx = distribute_tensor(x, mesh, [Shard(3)]).requires_grad_()
    with pooling.sharded_pooling(), record_p2p() as records:
        y = _POOLS[pool](dx)
        y.backward(distribute_tensor(grad, mesh, y.placements))
    assert y.placements == (Shard(3),)
    torch.testing.assert_close(y.to_local(), local_chunk(y_ref.detach(), 3), **TOL)
    torch.testing.assert_close(dx.grad.to_local(), local_chunk(rx.grad, 3), **TOL)
    if rank() == 0:  # strips of 1 (and an empty one at width 3): its right halo of 2 spans ranks 1 and 2
        assert {peer for _, peer, _ in records} == {1, 2}
