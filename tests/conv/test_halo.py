"""halo_exchange on real gloo ranks: right halos, neighbours only, exact adjoint, pinned bytes.

Every P2P op the exchange issues is recorded (kind, global peer, bytes) by wrapping
``torch.distributed.batch_isend_irecv`` inside the rank, so the tests see exactly which
ranks talk and how many bytes each one sends. Values are small integers, so comparisons
with the single-process reference are exact.
"""


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch_tp.conv import conv_windows, halo_bytes, halo_exchange
from torch_tp.testing import mesh_2x2, on_ranks, rank, record_p2p, run_on_ranks, tp_mesh, world_size, world_sizes


def _counts(window):
    return dict(recv_left=window.recv_left, recv_right=window.recv_right,
                send_left=window.send_left, send_right=window.send_right)


def _bounds(size, num_ranks):
    chunk = -(-size // num_ranks)
    return [(min(r * chunk, size), min((r + 1) * chunk, size)) for r in range(num_ranks)]


def _exchange_on(mesh, global_x, *, dim, recv_left, recv_right, how):
    """Run the exchange for this rank's shard of ``global_x`` over ``mesh["tp"]``; check the
    values, the adjoint and that it only talks to its neighbours on that mesh dim.

    ``recv_left``/``recv_right`` list every position's counts; the sends follow from them.
    ``how`` says whether the exchange gets ``group=`` (the "tp" sub-group) or ``mesh=``.
    """
    group = mesh.get_group("tp")
    position, size = mesh.get_local_rank("tp"), mesh.size(mesh.mesh_dim_names.index("tp"))
    group_ranks = dist.get_process_group_ranks(group)
    bounds = _bounds(global_x.shape[dim], size)
    counts = dict(
        recv_left=recv_left[position], recv_right=recv_right[position],
        send_left=recv_right[position - 1] if position > 0 else 0,
        send_right=recv_left[position + 1] if position + 1 < size else 0,
    )
    start, stop = bounds[position]
    x = global_x.narrow(dim, start, stop - start).clone().requires_grad_()
    where = dict(group=group) if how == "group" else dict(mesh=mesh, mesh_dim="tp")
    with record_p2p() as records:
        strip = halo_exchange(x, dim=dim, **counts, **where)
    lo, hi = start - counts["recv_left"], stop + counts["recv_right"]
    assert torch.equal(strip, global_x.narrow(dim, lo, hi - lo)), (position, strip, lo, hi)
    _check_adjoint(x, strip, global_x, dim=dim, bounds=bounds, recv_left=recv_left, recv_right=recv_right,
                   position=position, group=group)
    peers = {peer for _, peer, _ in records}
    neighbours = {group_ranks[p] for p in (position - 1, position + 1) if 0 <= p < size}
    assert peers <= neighbours, (position, peers, neighbours)  # no ring, no other row
    return sorted(records)


def _check_adjoint(x, strip, global_x, *, dim, bounds, recv_left, recv_right, position, group):
    """x.grad from the exchange's backward equals the gradient computed on the gathered tensor."""
    gen = torch.Generator().manual_seed(7)
    size = len(bounds)
    lows = [bounds[p][0] - recv_left[p] for p in range(size)]
    highs = [bounds[p][1] + recv_right[p] for p in range(size)]
    shapes = [global_x.narrow(dim, lows[p], highs[p] - lows[p]).shape for p in range(size)]
    grads = [torch.randint(-4, 5, shape, generator=gen).float() for shape in shapes]  # same on every rank
    (strip * grads[position]).sum().backward()
    reference = global_x.clone().requires_grad_()
    sum((reference.narrow(dim, lows[p], highs[p] - lows[p]) * grads[p]).sum() for p in range(size)).backward()
    start, stop = bounds[position]
    assert torch.equal(x.grad, reference.grad.narrow(dim, start, stop - start)), position
    # <A x, g> == <x, A^T g>, summed over the group
    dots = torch.stack([(strip.detach() * grads[position]).sum(), (x.detach() * x.grad).sum()])
    dist.all_reduce(dots, group=group)
    assert dots[0] == dots[1], dots


# Per case and world size: global length along the sharded dim, recv_left and recv_right per
# position. The shards of 7 on 2 are [4, 3] and of 10 on 4 [3, 3, 3, 1]; of 1 on 2 [1, 0] and
# of 5 on 4 [2, 2, 1, 0] (an empty one).
_ASYMMETRIC = {
    "uneven": {2: (7, [0, 3], [2, 0]), 4: (10, [0, 3, 1, 1], [2, 1, 1, 0])},
    "with_empty_shard": {2: (1, [0, 1], [0, 0]), 4: (5, [0, 2, 1, 1], [1, 0, 0, 0])},
}
_GROUP_OR_MESH = pytest.mark.parametrize("how", ["group", "mesh"])


@pytest.mark.parametrize("case", list(_ASYMMETRIC))
@_GROUP_OR_MESH
@on_ranks(2, 4)
def test_forward_returns_neighbour_halos_and_backward_is_the_exact_adjoint(how, case):
    size = world_size()
    length, recv_left, recv_right = _ASYMMETRIC[case][size]
    global_x = torch.arange(2 * length * 3, dtype=torch.float32).view(2, length, 3)
    records = _exchange_on(tp_mesh(), global_x, dim=1, recv_left=recv_left, recv_right=recv_right, how=how)
    if case == "uneven" and rank() == 0:
        # rank 0 sends its right neighbour recv_left[1] slices and receives its recv_right[0];
        # it never talks to anyone else.
        assert records == sorted([("recv", 1, recv_right[0] * 2 * 3 * 4), ("send", 1, recv_left[1] * 2 * 3 * 4)])
    if case == "uneven" and rank() == size - 1:
        assert {peer for _, peer, _ in records} == {size - 2}


@_GROUP_OR_MESH
@on_ranks(4)
def test_on_a_2x2_mesh_only_ranks_of_the_same_tp_row_exchange(how):
    row = mesh_2x2().get_local_rank("dp")
    global_x = torch.arange(2 * 7 * 3, dtype=torch.float32).view(2, 3, 7) + 1000 * row  # rows differ
    records = _exchange_on(mesh_2x2(), global_x, dim=-1, recv_left=[0, 3], recv_right=[2, 0], how=how)
    row_partner = {0: 1, 1: 0, 2: 3, 3: 2}[rank()]  # rows are ranks {0, 1} and {2, 3}
    assert {peer for _, peer, _ in records} == {row_partner}


def _bytes_sent(case):
    """Forward and backward isend bytes of this rank for a conv geometry, and its send count."""
    in_size, conv = case
    windows = conv_windows(in_size, world_size(), **conv)
    w = windows[rank()]
    global_x = torch.arange(2 * 3 * in_size, dtype=torch.float32).view(2, 3, in_size)
    x = global_x[..., w.in_start : w.in_stop].clone().requires_grad_()
    with record_p2p() as forward:
        strip = halo_exchange(x, dim=-1, window=w, mesh=tp_mesh())  # only the positions read travel
    with record_p2p() as backward:
        strip.sum().backward()
    sent = [sum(b for kind, _, b in records if kind == "send") for records in (forward, backward)]
    expected = [halo_bytes(windows, slice_numel=6, element_size=4, direction=d)[rank()]
                for d in ("forward", "backward")]
    assert sent == expected, (case, sent, expected)
    return sum(kind == "send" for kind, _, _ in forward)


_BYTES_CASES = [
    (30, dict(kernel_size=5, padding=2)),
    (30, dict(kernel_size=4, padding="same", dilation=2)),
    (30, dict(kernel_size=3, stride=2, padding=1)),
    (9, dict(kernel_size=2, stride=2)),
]


@world_sizes(2, 4)
@pytest.mark.parametrize("case", _BYTES_CASES, ids=["k5p2", "k4same-d2", "k3s2p1", "w9k2s2"])
def test_bytes_each_rank_sends_equal_the_halo_formula(world_size, case):
    sends = run_on_ranks(_bytes_sent, world_size, case)
    if case == _BYTES_CASES[0]:  # symmetric halos: edge ranks send one, inner ranks two
        assert sends == [1] + [2] * (world_size - 2) + [1]
    assert sends[0] <= 1 and sends[-1] <= 1


def _conv_through_halos(case):
    """Local conv1d on the exchanged, trimmed, padded strip equals the global conv (and grads)."""
    in_size, conv = case
    windows = conv_windows(in_size, world_size(), **conv)
    w = windows[rank()]
    gen = torch.Generator().manual_seed(3)
    global_x = torch.randint(-3, 4, (2, 3, in_size), generator=gen).float()
    weight = torch.randint(-2, 3, (4, 3, conv["kernel_size"]), generator=gen).float().requires_grad_()
    reference_x = global_x.clone().requires_grad_()
    expected = F.conv1d(reference_x, weight, stride=conv.get("stride", 1), padding=conv.get("padding", 0),
                        dilation=conv.get("dilation", 1))
    grad_out = torch.randint(-2, 3, expected.shape, generator=gen).float()
    reference_grads = torch.autograd.grad(expected, [reference_x, weight], grad_out)
    x = global_x[..., w.in_start : w.in_stop].clone().requires_grad_()
    strip = halo_exchange(x, dim=-1, window=w, mesh=tp_mesh())
    local = F.pad(strip[..., w.trim_left : w.strip_size - w.trim_right], (w.pad_left, w.pad_right))
    if w.out_size:
        out = F.conv1d(local, weight, stride=conv.get("stride", 1), dilation=conv.get("dilation", 1))
    else:  # nothing to compute here, but the rank still takes part in the backward exchange
        out = local.new_zeros(2, 4, 0)
    assert torch.equal(out, expected[..., w.out_start : w.out_stop].detach())
    # strip.sum() * 0 keeps every rank (also one without outputs) in the backward exchange
    loss = (out * grad_out[..., w.out_start : w.out_stop]).sum() + strip.sum() * 0
    loss.backward()
    weight_grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    dist.all_reduce(weight_grad)
    assert torch.equal(x.grad, reference_grads[0][..., w.in_start : w.in_stop])
    assert torch.equal(weight_grad, reference_grads[1])
    return w.out_size


@world_sizes(2, 4)
@pytest.mark.parametrize("case", _BYTES_CASES, ids=["k5p2", "k4same-d2", "k3s2p1", "w9k2s2"])
def test_local_conv_on_exchanged_halos_matches_the_global_conv_and_its_gradients(world_size, case):
    out_sizes = run_on_ranks(_conv_through_halos, world_size, case)
    assert sum(out_sizes) > 0


_NO_HALO = dict(recv_left=0, recv_right=0, send_left=0, send_right=0)


@pytest.mark.parametrize(
    "counts, match",
    [
        (dict(_NO_HALO, send_left=4), "send_left=4 but this rank's shard holds only 3 slices along dim 1"),
        (dict(_NO_HALO, recv_right=-1), "recv_right must be an int >= 0, got -1"),
        (dict(_NO_HALO, send_right=1.0), "send_right must be an int >= 0, got 1.0"),
    ],
    ids=["send_past_the_shard", "negative", "float"],
)
@on_ranks(2, 4)
def test_invalid_halo_counts_raise_value_error_before_any_message(counts, match):
    with pytest.raises(ValueError, match=match):
        halo_exchange(torch.zeros(2, 3), dim=-1, **counts, mesh=tp_mesh())


@on_ranks(2, 4)
def test_invalid_arguments_raise_value_error_before_any_message():
    x = torch.zeros(2, 3)
    mesh = tp_mesh()
    counts = _NO_HALO
    with pytest.raises(ValueError, match="exactly one of group= or mesh="):
        halo_exchange(x, dim=1, **counts, group=mesh.get_group(), mesh=mesh)
    with pytest.raises(ValueError, match="dim=2 is out of range for a 2-D shard"):
        halo_exchange(x, dim=2, **counts, mesh=mesh)
    from torch.distributed.tensor import Shard, distribute_tensor

    with pytest.raises(ValueError, match=r"takes the local shard \(x.to_local\(\)\)"):
        halo_exchange(distribute_tensor(torch.zeros(2, 4), mesh, [Shard(1)]), dim=1, **counts, mesh=mesh)
    # window= carries the counts: not both, not neither, and the window of this position and length
    windows = conv_windows(3 * world_size(), world_size(), kernel_size=3, padding=1)  # shards of 3
    with pytest.raises(ValueError, match="takes window= or the counts, not both"):
        halo_exchange(x, dim=1, window=windows[rank()], recv_left=0, mesh=mesh)
    with pytest.raises(ValueError, match="needs the four counts or window=; missing send_left=, send_right="):
        halo_exchange(x, dim=1, recv_left=0, recv_right=0, mesh=mesh)
    other = (rank() + 1) % world_size()
    with pytest.raises(ValueError, match=rf"window= is position {other}'s, .* pass conv_windows\(...\)\[{rank()}\]"):
        halo_exchange(x, dim=1, window=windows[other], mesh=mesh)
    with pytest.raises(ValueError, match=r"the window is for a shard of 5 slices .* holds 3 along dim 1"):
        halo_exchange(x, dim=1, window=conv_windows(5 * world_size(), world_size(), kernel_size=3)[rank()], mesh=mesh)
    # Edge ranks have one neighbour; called only where it must raise, so no rank waits.
    if rank() == 0:
        with pytest.raises(ValueError, match="position 0 of .* has no left neighbour .*nothing wraps around"):
            halo_exchange(x, dim=1, **dict(counts, recv_left=1), mesh=mesh)
    if rank() == world_size() - 1:
        with pytest.raises(ValueError, match="has no right neighbour .* send_right must be 0, got 0 and 2"):
            halo_exchange(x, dim=1, **dict(counts, send_right=2), mesh=mesh)


def test_an_exchange_without_group_or_mesh_is_refused():
    # refused before any communication: no ranks needed
    with pytest.raises(ValueError, match="exactly one of group= or mesh="):
        halo_exchange(torch.zeros(2, 3), dim=1, **_NO_HALO)


@on_ranks(4)
def test_a_2d_mesh_needs_mesh_dim():
    with pytest.raises(ValueError, match="on a 2-D mesh needs mesh_dim="):
        halo_exchange(torch.zeros(3), dim=0, **_counts(conv_windows(3, 1, kernel_size=1)[0]), mesh=mesh_2x2())
