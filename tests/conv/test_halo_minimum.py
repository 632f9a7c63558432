"""The halo exchange sends the minimum: the bytes every rank sends equal a count made from the op's
own arithmetic, and the results still match one process.

The count is independent of torch_tp's geometry (``conv_windows``, ``halo_bytes``): for each
rank, the input positions along the sharded width that the taps of its outputs read
(``j * stride - padding + i * dilation`` for its ``torch.chunk`` outputs ``j`` and every tap
``i``, inside ``[0, width)``), minus the positions it holds, are what it must receive; a rank
sends each reader the part of that set it holds. For a transposed convolution the set is the
other way round: the outputs its inputs add to (``input * stride - padding + tap *
dilation``) that another rank owns. One position is ``batch * channels * height`` elements.

Forward and backward are counted apart: a convolution's backward exchanges the input again
(the weight gradient reads it) and returns the gradient of every position received; pooling's
returns the gradients only; a transposed convolution's backward gathers the output gradient
over what its inputs reach.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch_tp.conv import sharded_convolution, sharded_pooling
from torch_tp.testing import full_tensor, local_chunk, record_p2p, run_on_ranks, sent_bytes, shard_locally, tp_mesh, \
    world_sizes

WIDTH = 23  # shards 12, 11 on 2 ranks; 6, 6, 6, 5 on 4 (kernel 5, dilation 2 reaches 2 ranks away)
BATCH, CHANNELS, HEIGHT, OUT_CHANNELS = 2, 2, 3, 3
ELEMENT = 8  # float64: the small-integer results are exact


# ---------------------------------------------------------------------------------------------
# The grid: kernel 1/3/5, stride 1/2/3, dilation 1/2, padding 0/1/4 where each op accepts it
# ---------------------------------------------------------------------------------------------


def _grid():
    cases = []
    for k in (1, 3, 5):
        for s in (1, 2, 3):
            for d in ((1,) if k == 1 else (1, 2)):  # kernel 1 has one tap: dilation changes nothing
                span = d * (k - 1)
                cases += [("conv", k, s, d, p, {}) for p in (0, 1, 4) if p <= span]
                cases += [("transposed", k, s, d, p, dict(output_padding=(s - 1) * ((k + p) % 2)))
                          for p in (0, 1, 4)]
                cases += [("max", k, s, d, p, dict(ceil_mode=s == 3)) for p in sorted({0, 1, k // 2}) if p <= k // 2]
                if d == 1:  # average pooling has no dilation
                    cases += [("avg", k, s, 1, p, dict(count_include_pad=p % 2 == 0, ceil_mode=s == 2))
                              for p in sorted({0, 1, k // 2}) if p <= k // 2]
    return cases


CASES = _grid()


def _name(case):
    kind, k, s, d, p, extra = case
    return f"{kind} k{k} s{s} d{d} p{p}" + "".join(f" {key}={value}" for key, value in extra.items())


# ---------------------------------------------------------------------------------------------
# The independent count (plain Python: sets of positions)
# ---------------------------------------------------------------------------------------------


def _chunks(size, ranks):
    """``torch.chunk``'s pieces of ``range(size)``, one per rank (empty past the last)."""
    chunk = -(-size // ranks)
    return [range(min(r * chunk, size), min((r + 1) * chunk, size)) for r in range(ranks)]


def _minimum_bytes(case, out_width, ranks):
    """Per rank, ``(forward, backward)`` bytes it must send, from the index sets of the windows."""
    kind, k, s, d, p, _ = case
    ins = [set(c) for c in _chunks(WIDTH, ranks)]
    outs = [set(c) for c in _chunks(out_width, ranks)]
    if kind == "transposed":  # rank q adds to the outputs its inputs reach; owners receive them
        reach = [{i * s - p + t * d for i in ins[q] for t in range(k)} & set(range(out_width)) for q in range(ranks)]
        fwd = [sum(len(reach[q] & outs[r]) for r in range(ranks) if r != q) for q in range(ranks)]
        bwd = [sum(len(reach[q] & outs[r]) for q in range(ranks) if q != r) for r in range(ranks)]
        slice_bytes = BATCH * OUT_CHANNELS * HEIGHT * ELEMENT
        return [(f * slice_bytes, b * slice_bytes) for f, b in zip(fwd, bwd)]
    reads = [{j * s - p + t * d for j in outs[r] for t in range(k)} & set(range(WIDTH)) for r in range(ranks)]
    fwd = [sum(len(reads[r] & ins[q]) for r in range(ranks) if r != q) for q in range(ranks)]
    returned = [len(reads[q] - ins[q]) for q in range(ranks)]  # the gradients of what it received
    bwd = [f + g for f, g in zip(fwd, returned)] if kind == "conv" else returned
    slice_bytes = BATCH * CHANNELS * HEIGHT * ELEMENT
    return [(f * slice_bytes, b * slice_bytes) for f, b in zip(fwd, bwd)]


def _contiguous_bytes(case, out_width, ranks):
    """Forward bytes per rank if each halo were the whole block between the first and last
    position read (what the exchange sent before it picked positions)."""
    kind, k, s, d, p, _ = case
    ins = [set(c) for c in _chunks(WIDTH, ranks)]
    outs = [set(c) for c in _chunks(out_width, ranks)]
    if kind == "transposed":
        sent = []
        for q in range(ranks):
            reach = {i * s - p + t * d for i in ins[q] for t in range(k)} & set(range(out_width))
            hull = set(range(min(reach), max(reach) + 1)) if reach else set()
            sent.append(sum(len(hull & outs[r]) for r in range(ranks) if r != q))
        return sent
    hulls = []
    for r in range(ranks):
        reads = {j * s - p + t * d for j in outs[r] for t in range(k)} & set(range(WIDTH))
        hulls.append(set(range(min(reads | ins[r]), max(reads | ins[r]) + 1)) if reads else set())
    return [sum(len(hulls[r] & ins[q]) for r in range(ranks) if r != q) for q in range(ranks)]


# ---------------------------------------------------------------------------------------------
# The ops on the ranks
# ---------------------------------------------------------------------------------------------


def _op(case):
    """``(function of (x, weight, bias), needs weights)`` for one case: kernel 3 on the height."""
    kind, k, s, d, p, extra = case
    if kind == "conv":
        return lambda x, w, b: F.conv2d(x, w, b, stride=(1, s), padding=(1, p), dilation=(1, d)), True
    if kind == "transposed":
        return lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(1, s), padding=(1, p), dilation=(1, d),
                                                  output_padding=(0, extra["output_padding"])), True
    if kind == "max":
        return lambda x, w, b: F.max_pool2d(x, (3, k), (1, s), (1, p), (1, d), ceil_mode=extra["ceil_mode"]), False
    return lambda x, w, b: F.avg_pool2d(x, (3, k), (1, s), (1, p), ceil_mode=extra["ceil_mode"],
                                        count_include_pad=extra["count_include_pad"]), False


def _tensors(case, seed):
    kind, k = case[0], case[1]
    gen = torch.Generator().manual_seed(seed)
    shape = (BATCH, CHANNELS, HEIGHT, WIDTH)
    if kind == "max":  # distinct values: no ties, one argmax per window
        x = -1.0 - torch.randperm(BATCH * CHANNELS * HEIGHT * WIDTH, generator=gen).double().view(shape)
    else:
        x = torch.randint(-3, 4, shape, generator=gen).double()
    w_shape = (CHANNELS, OUT_CHANNELS, 3, k) if kind == "transposed" else (OUT_CHANNELS, CHANNELS, 3, k)
    w = torch.randint(-3, 4, w_shape, generator=gen).double()
    b = torch.randint(-3, 4, (OUT_CHANNELS,), generator=gen).double()
    return x, w, b


def _run_case(case, seed):
    """This rank's ``(forward, backward)`` bytes sent; output, input gradient (and the weight
    and bias gradients) checked against one process."""
    op, weighted = _op(case)
    x, w, b = _tensors(case, seed)
    rx, rw, rb = (t.clone().requires_grad_() for t in (x, w, b))
    expected = op(rx, rw, rb) if weighted else op(rx, None, None)
    grad = torch.randint(-3, 4, expected.shape, generator=torch.Generator().manual_seed(seed + 1)).double()
    expected.backward(grad)
    mesh = tp_mesh()
    dx = shard_locally(x, mesh, [Shard(3)]).requires_grad_()
    dw, db = (shard_locally(t, mesh, [Replicate()]).requires_grad_() for t in (w, b))
    with sharded_convolution(), sharded_pooling():
        with record_p2p() as forward:
            y = op(dx, dw, db) if weighted else op(dx, None, None)
        with record_p2p() as backward:
            y.backward(shard_locally(grad, mesh, y.placements))
    name = _name(case)
    assert y.placements == (Shard(3),) and y.shape == expected.shape, (name, y.placements, y.shape)
    pairs = [("out", y.to_local(), local_chunk(expected.detach(), 3)), ("grad_input", dx.grad.to_local(),
                                                                          local_chunk(rx.grad, 3))]
    if weighted:
        pairs += [("grad_weight", full_tensor(dw.grad), rw.grad), ("grad_bias", full_tensor(db.grad), rb.grad)]
    for what, got, ref in pairs:
        torch.testing.assert_close(got, ref, msg=lambda m, what=what: f"{name} {what}: {m}")
    return sent_bytes(forward), sent_bytes(backward), expected.shape[3]


def _grid_on_rank(cases):
    return [_run_case(case, seed) for seed, case in enumerate(cases)]


@world_sizes(2, 4)
@pytest.mark.parametrize("kind", ["conv", "max", "avg", "transposed"])
def test_halo_bytes_equal_the_index_set_count_and_results_match_one_process(world_size, kind):
    cases = [c for c in CASES if c[0] == kind]
    per_rank = run_on_ranks(_grid_on_rank, world_size, cases, timeout=300)
    wrong, sparser = [], 0
    for n, case in enumerate(cases):
        out_width = per_rank[0][n][2]
        measured = [tuple(per_rank[r][n][:2]) for r in range(world_size)]
        minimum = _minimum_bytes(case, out_width, world_size)
        if measured != minimum:
            wrong.append(f"{_name(case)}: measured {measured}, index sets {minimum}")
        contiguous = _contiguous_bytes(case, out_width, world_size)
        sparser += any(m[0] < c * _slice_bytes(case) for m, c in zip(minimum, contiguous))
    assert not wrong, "\n".join(wrong)
    # the grid has cases where the minimum is below the whole border block (stride / dilation);
    # average pooling has no dilation, and on this grid its halos are read whole
    assert sparser >= {"conv": 5, "max": 5, "avg": 0, "transposed": 5}[kind], sparser
    assert len(cases) >= 15, len(cases)


def _slice_bytes(case):
    return BATCH * (OUT_CHANNELS if case[0] == "transposed" else CHANNELS) * HEIGHT * ELEMENT


def test_kernel_5_stride_2_dilation_2_counts_every_other_column():
    # the case, from the index sets alone: 2 ranks, width 23 -> 12 outputs (6 / 6)
    case = ("conv", 5, 2, 2, 4, {})
    out_width = (WIDTH + 2 * 4 - 2 * 4 - 1) // 2 + 1
    minimum = [f // _slice_bytes(case) for f, _ in _minimum_bytes(case, out_width, 2)]
    contiguous = _contiguous_bytes(case, out_width, 2)
    assert (minimum, contiguous) == ([2, 2], [4, 3]), (minimum, contiguous)
