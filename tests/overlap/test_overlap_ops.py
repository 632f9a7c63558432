"""The fused ops on real gloo ranks: same values and gradients as the unfused collectives.

``all_gather_matmul`` is compared with ``all_gather_then_matmul`` (functional all-gather,
then matmuls) and ``matmul_reduce_scatter`` with ``matmul_then_reduce_scatter``, float32
at 1e-5, for gathered/scattered dims 0 and 1, one to three right operands and world sizes
2 and 4. The P2P traffic is recorded: neighbours only, ``world - 1`` steps, exactly the
bytes the collective would move. ``torch.library.opcheck`` checks the registrations.
"""

import re

import pytest
import torch
import torch.distributed as dist

from torch_tp import overlap
from torch_tp.testing import TOL, mesh_2x2, on_ranks, rank, record_p2p, sent_bytes, tp_mesh, world_size

N_OUTS = (5, 7, 3)


def _my_shard(full, dim):
    return full.detach().chunk(tp_mesh().size(), dim)[rank()].clone().requires_grad_()


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _sends_to_the_previous_rank(records, nbytes):
    """Each of the world - 1 ring steps handed ``nbytes`` to the rank before this one, and only that."""
    sends = [(peer, size) for kind, peer, size in records if kind == "send"]
    assert sends == [((rank() - 1) % world_size(), nbytes)] * (world_size() - 1)


@pytest.mark.parametrize("n_bs", [1, 3])
@pytest.mark.parametrize("gather_dim", [0, 1])
@on_ranks(2, 4)
def test_all_gather_matmul_equals_all_gather_then_matmul(gather_dim, n_bs):
    mesh = tp_mesh()
    torch.manual_seed(0)  # the same full tensors on every rank
    full = torch.randn(2 * mesh.size(), 3 * mesh.size(), 8)
    bs = [torch.randn(8, n, requires_grad=True) for n in N_OUTS[:n_bs]]
    ref_bs = [_leaf(b) for b in bs]
    shard, ref_shard = _my_shard(full, gather_dim), _my_shard(full, gather_dim)

    with record_p2p() as records:
        gathered, outs = overlap.all_gather_matmul(shard, bs, gather_dim, mesh)
    ref_gathered, ref_outs = overlap.all_gather_then_matmul(ref_shard, ref_bs, gather_dim, mesh)
    torch.testing.assert_close(gathered, full)
    torch.testing.assert_close(gathered, ref_gathered, rtol=0, atol=0)
    for out, ref in zip(outs, ref_outs):
        torch.testing.assert_close(out, ref, **TOL)

    weights = [torch.randn(out.shape) for out in outs]  # a loss that weights every element
    sum((out * w).sum() for out, w in zip(outs, weights)).backward()
    sum((out * w).sum() for out, w in zip(ref_outs, weights)).backward()
    torch.testing.assert_close(shard.grad, ref_shard.grad, **TOL)
    for b, ref in zip(bs, ref_bs):
        torch.testing.assert_close(b.grad, ref.grad, **TOL)
    shard_bytes = shard.numel() * shard.element_size()
    _sends_to_the_previous_rank(records, shard_bytes)  # one shard per step
    assert sent_bytes(records) == (world_size() - 1) * shard_bytes


@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
@pytest.mark.parametrize("scatter_dim", [0, 1])
@on_ranks(2, 4)
def test_matmul_reduce_scatter_equals_matmul_then_reduce_scatter(scatter_dim, reduce_op):
    mesh = tp_mesh()
    torch.manual_seed(rank())  # each rank holds its own partial operand
    a = torch.randn(2 * mesh.size(), 3 * mesh.size(), 6, requires_grad=True)
    b = torch.randn(6, 5, requires_grad=True)
    ref_a, ref_b = _leaf(a), _leaf(b)
    with record_p2p() as records:
        out = overlap.matmul_reduce_scatter(a, b, scatter_dim, mesh, reduce_op)
    ref = overlap.matmul_then_reduce_scatter(ref_a, ref_b, scatter_dim, mesh, reduce_op)
    torch.testing.assert_close(out, ref, **TOL)
    weight = torch.randn(out.shape)
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    torch.testing.assert_close(a.grad, ref_a.grad, **TOL)
    torch.testing.assert_close(b.grad, ref_b.grad, **TOL)
    _sends_to_the_previous_rank(records, out.numel() * out.element_size())


@on_ranks(4)
def test_the_ring_runs_over_one_dim_of_a_2x2_mesh_and_talks_only_within_its_row():
    tp = mesh_2x2()["tp"]  # rows {0, 1} and {2, 3}
    row = dist.get_process_group_ranks(tp.get_group())
    torch.manual_seed(dist.get_rank() // 2)  # one full tensor per row
    full, b = torch.randn(2, 4, 8), torch.randn(8, 3)
    shard = full.chunk(2, 1)[tp.get_local_rank()].clone()
    with record_p2p() as records:
        gathered, (y,) = overlap.all_gather_matmul(shard, [b], 1, tp)
        scattered = overlap.matmul_reduce_scatter(y, torch.randn(3, 5), 1, tp)
    torch.testing.assert_close(gathered, full, rtol=0, atol=0)
    torch.testing.assert_close(y, full @ b, **TOL)
    assert scattered.shape == (2, 2, 5)
    assert {peer for _, peer, _ in records} <= set(row) - {dist.get_rank()}


@on_ranks(1)
def test_one_rank_is_a_plain_matmul():
    x, b = torch.randn(2, 3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    gathered, (y,) = overlap.all_gather_matmul(x, [b], 1, tp_mesh())
    z = overlap.matmul_reduce_scatter(y, b.t(), 0, tp_mesh(), "avg")
    z.sum().backward()
    torch.testing.assert_close(z, x @ b @ b.t(), **TOL)
    assert torch.equal(gathered, x)


@on_ranks(2, 4)
def test_bfloat16_inputs_stay_bfloat16():
    mesh = tp_mesh()
    torch.manual_seed(0)
    full = torch.randn(2, 4 * mesh.size(), 16, dtype=torch.bfloat16)
    b = torch.randn(16, 8, dtype=torch.bfloat16)
    shard = full.chunk(mesh.size(), 1)[rank()]
    _, (y,) = overlap.all_gather_matmul(shard, [b], 1, mesh)
    _, (want,) = overlap.all_gather_then_matmul(shard, [b], 1, mesh)
    z = overlap.matmul_reduce_scatter(y, b.t(), 1, mesh)
    z_want = overlap.matmul_then_reduce_scatter(want, b.t(), 1, mesh)
    assert y.dtype == z.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, rtol=0, atol=0)  # no sum across ranks: the same products
    # the partial sums are added in a different order (ring vs gloo's reduce-scatter)
    torch.testing.assert_close(z, z_want, rtol=1.6e-2, atol=1e-2)


@on_ranks(2)
def test_an_unused_output_costs_nothing_in_the_backward():
    mesh = tp_mesh()
    shard = torch.randn(2, 4, requires_grad=True)
    b_used, b_unused = torch.randn(4, 3, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    _, (used, _unused) = overlap.all_gather_matmul(shard, [b_used, b_unused], 0, mesh)
    with record_p2p() as records:
        used.sum().backward()
    # the backward reduce-scatters grad @ b_used.T only: one (2, 4) partial per step
    assert sent_bytes(records) == 2 * 4 * 4 and b_unused.grad is None


@pytest.mark.parametrize("b_requires_grad", [False, True], ids=["frozen", "trainable"])
@on_ranks(2)
def test_frozen_weights_keep_no_activation_alive_for_the_backward(b_requires_grad):
    mesh = tp_mesh()
    shard = torch.randn(2, 3, 8, requires_grad=True)
    b = torch.randn(8, 5, requires_grad=b_requires_grad)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gathered, (y,) = overlap.all_gather_matmul(shard, [b], 1, mesh)
        overlap.matmul_reduce_scatter(y, torch.randn(5, 4, requires_grad=b_requires_grad), 1, mesh)
    if b_requires_grad:
        # the gathered input of the first op and the input of the second, for the weight gradients
        assert sorted(saved) == sorted([tuple(gathered.shape), (8, 5), tuple(y.shape), (5, 4)]), saved
    else:
        # only the matrices are kept (their transposes give the input gradients)
        assert saved == [(8, 5), (5, 4)], saved


# ------------------------------------------------------------------ errors


_X = (3, 4, 8)  # the input of the bad calls below
# case: (the call, given the input and the mesh; what its error must say, as "Type: message")
_BAD_CALLS = {
    "contracted_gather": (
        lambda x, mesh: overlap.all_gather_matmul(x, [torch.randn(8, 2)], 2, mesh),
        r"ValueError: all_gather_matmul: gather_dim=2 .* leading dims 0..1 .*contracts",
    ),
    "wrong_rows": (
        lambda x, mesh: overlap.all_gather_matmul(x, [torch.randn(6, 2)], 0, mesh),
        r"ValueError: .*bs\[0\] has 6 rows but the input's last .* dim is 8.*weight.t\(\)",
    ),
    "single_b": (
        lambda x, mesh: overlap.all_gather_matmul(x, torch.randn(8, 2), 0, mesh),
        r"TypeError: .*wrap a single one as \[b\]",
    ),
    "empty_bs": (lambda x, mesh: overlap.all_gather_matmul(x, [], 0, mesh), r"ValueError: .*bs is empty"),
    "dtype": (
        lambda x, mesh: overlap.all_gather_matmul(x, [torch.randn(8, 2, dtype=torch.float64)], 0, mesh),
        r"TypeError: .*torch.float64 but the input is torch.float32",
    ),
    "uneven_scatter": (
        lambda x, mesh: overlap.matmul_reduce_scatter(x, torch.randn(8, 2), 0, mesh),
        r"ValueError: .*size 3, which does not split evenly over 2 ranks.*pad it",
    ),
    "reduce_op": (
        lambda x, mesh: overlap.matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 2), 0, mesh, "max"),
        r"ValueError: .*reduce_op='max' is not supported",
    ),
}


@pytest.mark.parametrize("case", list(_BAD_CALLS))
@on_ranks(2)
def test_bad_arguments_raise_errors_that_say_what_to_change(case):
    call, pattern = _BAD_CALLS[case]
    with pytest.raises((ValueError, TypeError)) as raised:
        call(torch.randn(*_X), tp_mesh())
    error = f"{raised.type.__name__}: {raised.value}"
    assert re.match(pattern, error), error


def test_a_group_that_is_neither_a_process_group_nor_a_mesh_is_refused():
    # refused before any communication: no ranks needed
    with pytest.raises(TypeError, match="^group must be a ProcessGroup"):
        overlap.matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 2), 0, 3)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@on_ranks(2, 4)
def test_ranks_with_different_shapes_all_get_a_clear_error(op):
    # without the check, gloo aborts the process when a received chunk has the wrong size
    x = torch.randn(3 if rank() == 0 else 2, 8)
    with pytest.raises(ValueError) as raised:
        if op == "all_gather_matmul":
            overlap.all_gather_matmul(x, [torch.randn(8, 2)], 0, tp_mesh())
        else:
            overlap.matmul_reduce_scatter(x, torch.randn(8, 2), 0, tp_mesh())
    sizes = [(3, 8)] + [(2, 8)] * (world_size() - 1)
    assert str(raised.value) == (
        f"{op}: the ranks' inputs have different shapes {sizes}; every rank must pass the same "
        f"shape (shard the gathered dim evenly, e.g. pad the sequence to a multiple of {world_size()})"
    )


# ------------------------------------------------------------------ registrations


def _opcheck_arguments(op):
    group_name = tp_mesh().get_group().group_name
    if op == "all_gather_matmul":
        shard = torch.randn(2, 3, 8, requires_grad=True)
        bs = [torch.randn(8, 4, requires_grad=True), torch.randn(8, 2)]
        return (shard, bs, 1, group_name)
    a = torch.randn(2, 4, 8, requires_grad=True)
    b = torch.randn(8, 6, requires_grad=True)
    return (a, b, 1, group_name, "sum")


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@on_ranks(2)
def test_opcheck_passes_for_both_ops(op):
    report = torch.library.opcheck(getattr(torch.ops.torch_tp, op).default, _opcheck_arguments(op))
    assert report and all(result == "SUCCESS" for result in report.values()), report
