"""conv_windows: the per-rank halo geometry reproduces the global convolution exactly.

No ranks here: each rank's local input is assembled from the global tensor by index (its
shard, the halos the other ranks would send, the trims and the edge zeros), convolved with
padding 0, and the owned outputs are concatenated and compared with the global ``F.conv1d``.
Inputs and weights are small integers, so the comparison is exact. Halos wider than the
neighbour's shard (multi-hop) are checked piece by piece against the shards that send them.
"""

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch_tp.conv import ShardWindow, conv_windows, resolve_padding

IN_SIZES = (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 30)
NUM_RANKS = (1, 2, 3, 4)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The grid runs ~30k tiny conv1d calls: one thread each, as the ranks use (thread start-up
    dominates them, and on a loaded 2-core box costs ten times the convolution)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _chunks(size, num_ranks):
    chunks = torch.chunk(torch.arange(size), num_ranks)
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
    return bounds + [(size, size)] * (num_ranks - len(bounds))


def _paddings(kernel_size, stride, dilation):
    span = dilation * (kernel_size - 1)
    pads = list(range(span + 1)) + [(0, span), (span, 0)]
    return pads + (["same"] if stride == 1 else [])


def _global_conv(x, weight, *, stride, padding, dilation):
    if isinstance(padding, tuple):
        return F.conv1d(F.pad(x, padding), weight, stride=stride, dilation=dilation)
    return F.conv1d(x, weight, stride=stride, padding=padding, dilation=dilation)


def _reads_only_neighbours(in_size, num_ranks, *, kernel_size, stride, padding, dilation):
    """Independent rule: every real input position a rank's outputs read lies in its shard
    or its immediate neighbours' (computed tap by tap from the definition)."""
    pad_l, pad_r = resolve_padding(padding, kernel_size=kernel_size, stride=stride, dilation=dilation)
    out_total = (in_size + pad_l + pad_r - dilation * (kernel_size - 1) - 1) // stride + 1
    ins, outs = _chunks(in_size, num_ranks), _chunks(out_total, num_ranks)
    for r, (a, b) in enumerate(outs):
        taps = [j * stride - pad_l + i * dilation for j in range(a, b) for i in range(kernel_size)]
        taps = [t for t in taps if 0 <= t < in_size]
        low = ins[r - 1][0] if r > 0 else 0
        high = ins[r + 1][1] if r + 1 < num_ranks else in_size
        if taps and (min(taps) < low or max(taps) >= high):
            return False
    return True


def _hop(hops, h):
    return hops[h] if h < len(hops) else 0


def _check_consistent(windows, in_size, *, neighbours_only):
    chunks = _chunks(in_size, len(windows))
    assert [(w.in_start, w.in_stop) for w in windows] == chunks
    assert windows[0].recv_left == windows[0].send_left == 0  # no ring
    assert windows[-1].recv_right == windows[-1].send_right == 0
    for left, right in zip(windows, windows[1:]):
        assert left.out_stop == right.out_start
        if neighbours_only:
            assert left.recv_right == right.send_left and right.recv_left == left.send_right
    for w in windows:
        assert min(w.recv_left, w.recv_right, w.trim_left, w.trim_right, w.pad_left, w.pad_right) >= 0
        recv_left, recv_right, send_left, send_right = w.hops
        assert sum(recv_left) == w.recv_left and sum(send_right) == w.send_right  # totals
        assert all(c <= w.in_size for c in send_left + send_right)  # each piece a prefix / suffix
        if neighbours_only:  # the old format, unchanged: no per-hop fields
            assert not (w.recv_left_hops or w.recv_right_hops or w.send_left_hops or w.send_right_hops)
        # every piece received is the matching piece the owner sends, and lies in its shard
        for h, count in enumerate(recv_left):
            owner = windows[w.rank - 1 - h]
            assert _hop(owner.hops[3], h) == count
            assert count == owner.in_size or h == len(recv_left) - 1  # whole shards but the farthest
        for h, count in enumerate(recv_right):
            owner = windows[w.rank + 1 + h]
            assert _hop(owner.hops[2], h) == count
            assert count == owner.in_size or h == len(recv_right) - 1
        for peer, start, stop in w.recv_ranges:
            assert chunks[peer][0] <= start < stop <= chunks[peer][1]
        # what travels to w is what its senders pick for it, position by position
        received = _travelling(w.recv_ranges, w.recv_picks)
        sent = set().union(*(_travelling(v.send_ranges, v.send_picks, to=w.rank) for v in windows))
        assert received == sent, (w, received, sent)


def _travelling(ranges, picks, to=None):
    """The global positions of ``ranges`` ((rank, start, stop), with their picks) that travel."""
    chosen = picks or [range(start, stop) for _, start, stop in ranges]
    return {p for (q, _, _), positions in zip(ranges, chosen) if to is None or q == to for p in positions}


def _simulate(x, weight, windows, *, stride, dilation):
    """Concatenated owned outputs, each computed from its own assembled local input."""
    pieces = []
    for w in windows:
        strip = x[..., w.in_start - w.recv_left : w.in_stop + w.recv_right].clone()
        assert strip.shape[-1] == w.strip_size
        # halo positions that do not travel arrive as zero: poison them, no owned output may read them
        unpicked = set(range(w.in_start - w.recv_left, w.in_start)) | set(range(w.in_stop, w.in_stop + w.recv_right))
        for p in unpicked - _travelling(w.recv_ranges, w.recv_picks):
            strip[..., p - (w.in_start - w.recv_left)] = float("nan")
        local = F.pad(strip[..., w.trim_left : w.strip_size - w.trim_right], (w.pad_left, w.pad_right))
        assert local.shape[-1] == w.local_size
        if w.out_size == 0:
            continue
        piece = F.conv1d(local, weight, stride=stride, dilation=dilation)
        assert piece.shape[-1] == w.out_size, (w, piece.shape)
        _check_interior(local, weight, piece, w, stride=stride, dilation=dilation)
        pieces.append(piece)
    return torch.cat(pieces, dim=-1)


def _check_interior(local, weight, piece, w, *, stride, dilation):
    """The interior outputs, computed with every halo position poisoned (NaN), equal the
    strip's; and the interior is maximal: the outputs just outside it span a halo position."""
    span = dilation * (weight.shape[-1] - 1)
    a, b = w.halo_free_span()
    j0, j1 = w.interior_outputs(stride, span)
    poisoned = local.clone()
    poisoned[..., :a] = float("nan")
    poisoned[..., b:] = float("nan")
    if j1 > j0:
        window = poisoned[..., j0 * stride : (j1 - 1) * stride + span + 1]
        assert torch.equal(F.conv1d(window, weight, stride=stride, dilation=dilation), piece[..., j0:j1]), w
    if j0 > 0:
        assert (j0 - 1) * stride < a, w
    if j1 < w.out_size:
        assert j1 * stride + span >= b, w


def _check_case(x, weight, *, num_ranks, stride, padding, dilation):
    in_size, kernel_size = x.shape[-1], weight.shape[-1]
    conv = dict(kernel_size=kernel_size, stride=stride, padding=padding, dilation=dilation)
    neighbours_only = _reads_only_neighbours(in_size, num_ranks, **conv)
    windows = conv_windows(in_size, num_ranks, **conv)
    _check_consistent(windows, in_size, neighbours_only=neighbours_only)
    expected = _global_conv(x, weight, stride=stride, padding=padding, dilation=dilation)
    assert windows[-1].out_stop == expected.shape[-1]
    got = _simulate(x, weight, windows, stride=stride, dilation=dilation)
    assert torch.equal(got, expected), (in_size, num_ranks, conv)
    return "ok" if neighbours_only else "multi-hop"


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("kernel_size", range(1, 8))
def test_owned_outputs_of_every_rank_concatenate_to_the_global_conv(kernel_size):
    gen = torch.Generator().manual_seed(kernel_size)
    weight = torch.randint(-2, 3, (2, 3, kernel_size), generator=gen).double()
    seen = {"ok": 0, "multi-hop": 0, "too short": 0}
    for in_size, stride, dilation in itertools.product(IN_SIZES, (1, 2, 3), (1, 2, 3)):
        x = torch.randint(-3, 4, (1, 3, in_size), generator=gen).double()
        for padding in _paddings(kernel_size, stride, dilation):
            conv = dict(stride=stride, padding=padding, dilation=dilation)
            pad_l, pad_r = resolve_padding(padding, kernel_size=kernel_size, stride=stride, dilation=dilation)
            if in_size + pad_l + pad_r < dilation * (kernel_size - 1) + 1:  # torch has no output either
                with pytest.raises(ValueError, match="is shorter than the dilated kernel span"):
                    conv_windows(in_size, 2, kernel_size=kernel_size, **conv)
                seen["too short"] += 1
                continue
            for num_ranks in NUM_RANKS:
                seen[_check_case(x, weight, num_ranks=num_ranks, **conv)] += 1
    assert seen["ok"] > 500, seen  # the grid mostly runs, and multi-hop halos are checked too
    if kernel_size > 1:
        assert seen["multi-hop"] > 0, seen


def test_same_padding_matches_torch_including_even_kernels():
    assert resolve_padding("same", kernel_size=4, dilation=1) == (1, 2)
    assert resolve_padding("same", kernel_size=4, dilation=3) == (4, 5)
    assert resolve_padding("valid", kernel_size=4) == (0, 0)
    x, weight = torch.arange(30.0).view(1, 1, 30), torch.tensor([[[1.0, -2.0, 3.0, 5.0]]])
    windows = conv_windows(30, 4, kernel_size=4, padding="same", dilation=2)
    got = _simulate(x, weight, windows, stride=1, dilation=2)
    assert torch.equal(got, F.conv1d(x, weight, padding="same", dilation=2))


def test_uneven_width_30_on_4_ranks_exchanges_only_neighbour_halos():
    windows = conv_windows(30, 4, kernel_size=3, stride=2, padding=1)
    assert [(w.in_start, w.in_stop) for w in windows] == [(0, 8), (8, 16), (16, 24), (24, 30)]
    assert [(w.out_start, w.out_stop) for w in windows] == [(0, 4), (4, 8), (8, 12), (12, 15)]
    assert [(w.recv_left, w.recv_right) for w in windows] == [(0, 0), (1, 0), (1, 0), (1, 0)]
    assert [(w.send_left, w.send_right) for w in windows] == [(0, 1), (0, 1), (0, 1), (0, 0)]
    assert [(w.pad_left, w.pad_right, w.trim_left, w.trim_right) for w in windows][0] == (1, 0, 0, 0)


def test_rank_without_outputs_still_sends_its_halo():
    # 7 inputs, kernel 1, stride 2 -> 4 outputs over 3 ranks: [0, 2), [2, 4), [] ; rank 1 reads 6.
    windows = conv_windows(7, 3, kernel_size=1, stride=2)
    last = windows[2]
    assert (last.out_size, last.in_size, last.send_left, last.recv_left, last.recv_right) == (0, 1, 1, 0, 0)
    assert last.trim_left + last.trim_right == last.strip_size and last.local_size == 0
    assert (windows[1].recv_right, windows[1].trim_left) == (1, 1)  # its own element 3 is unused


def test_outputs_reading_no_own_element_trim_into_the_received_halo():
    # width 9 on 4 ranks (shards 3, 3, 3, 0), kernel 2, stride 2: rank 3 holds nothing and owns
    # output 3, which reads [6, 8): its halo is the left neighbour's whole shard, of which only
    # 6 and 7 travel (recv_picks), and it drops 8.
    windows = conv_windows(9, 4, kernel_size=2, stride=2)
    assert windows[3] == ShardWindow(
        rank=3, in_start=9, in_stop=9, out_start=3, out_stop=4, need_start=6, need_stop=8,
        recv_left=3, recv_right=0, send_left=0, send_right=0,
        trim_left=0, trim_right=1, pad_left=0, pad_right=0, recv_picks=((6, 7),),
    )
    assert (windows[3].recv_total, windows[2].send_picks, windows[2].send_total) == (2, ((6, 7),), 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        windows[3].rank = 0


def test_dilation_skipping_the_only_real_element_needs_no_distant_halo():
    # width 1 on 3 ranks (shards 1, 0, 0), kernel 3, dilation 2, padding 3: outputs 0 and 2 read
    # positions -3, -1, 1 and -1, 1, 3 -- all padding -- so ranks 0 and 2 compute from zeros only
    # and rank 2 needs nothing, although its span [-1, 4) covers rank 0's element.
    windows = conv_windows(1, 3, kernel_size=3, dilation=2, padding=3)
    assert [(w.recv_left, w.recv_right, w.pad_left, w.pad_right) for w in windows] == [
        (0, 0, 5, 0), (1, 0, 2, 2), (0, 0, 5, 0)
    ]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(in_size=0, num_ranks=2, kernel_size=3), "positive int in_size, got 0"),
        (dict(in_size=8, num_ranks=0, kernel_size=3), "positive int num_ranks, got 0"),
        (dict(in_size=8, num_ranks=2, kernel_size=0), "positive int kernel_size, got 0"),
        (dict(in_size=8, num_ranks=2, kernel_size=3, stride=0), "positive int stride, got 0"),
        (dict(in_size=8, num_ranks=2, kernel_size=3, dilation=-1), "positive int dilation, got -1"),
        (dict(in_size=8.0, num_ranks=2, kernel_size=3), "positive int in_size, got 8.0"),
        (dict(in_size=8, num_ranks=True, kernel_size=3), "positive int num_ranks, got True"),
        (dict(in_size=8, num_ranks=2, kernel_size=3, padding=3),
         r"padding 0..dilation\*\(kernel_size-1\) = 0..2 .* got \(3, 3\)"),
        (dict(in_size=8, num_ranks=2, kernel_size=3, dilation=2, padding=(0, 5)), r"= 0..4 .*got \(0, 5\)"),
        (dict(in_size=8, num_ranks=2, kernel_size=3, padding=-1), r"got \(-1, -1\)"),
        (dict(in_size=8, num_ranks=2, kernel_size=3, padding=(1, 1, 1)), "a \\(left, right\\) pair"),
        (dict(in_size=8, num_ranks=2, kernel_size=3, padding="full"), "'valid' or 'same', got 'full'"),
        (dict(in_size=8, num_ranks=2, kernel_size=3, stride=2, padding="same"),
         "'same' needs stride 1.*stride=2"),
        (dict(in_size=2, num_ranks=2, kernel_size=5),
         r"input of length 2 padded by \(0, 0\) is shorter .* = 5"),
    ],
)
def test_unsupported_geometry_raises_value_error_naming_the_constraint(kwargs, match):
    in_size, num_ranks = kwargs.pop("in_size"), kwargs.pop("num_ranks")
    with pytest.raises(ValueError, match=match):
        conv_windows(in_size, num_ranks, **kwargs)


def test_halos_wider_than_the_neighbours_shard_continue_into_the_next_ranks():
    # once refused: shards of 2 and halos of 3 ...
    windows = conv_windows(8, 4, kernel_size=7, padding=3)
    assert [w.recv_ranges for w in windows] == [
        ((1, 2, 4), (2, 4, 5)), ((0, 0, 2), (2, 4, 6), (3, 6, 7)),
        ((0, 1, 2), (1, 2, 4), (3, 6, 8)), ((1, 3, 4), (2, 4, 6))]
    # ... and stride 3 drifting past the neighbour: rank 1 reads [3, 7), from ranks 2 and 3
    windows = conv_windows(8, 4, kernel_size=4, stride=3)
    assert windows[1].recv_ranges == ((2, 4, 6), (3, 6, 7)) and windows[1].trim_left == 1
    assert windows[3].send_ranges == ((1, 6, 7),)
