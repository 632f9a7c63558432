"""The fused ops on real gloo ranks: same values and gradients as the unfused collectives.

``all_gather_matmul`` is compared with ``all_gather_then_matmul`` (functional all-gather,
then matmuls) and ``matmul_reduce_scatter`` with ``matmul_then_reduce_scatter``, float32
at 1e-5, for gathered/scattered dims 0 and 1, one to three right operands and world sizes
2 and 4. The P2P traffic is recorded: neighbours only, ``world - 1`` steps, exactly the
bytes the collective would move. ``torch.library.opcheck`` checks the registrations.
"""

import pytest
import torch
import torch.distributed as dist

from torch_tp import overlap
from torch_tp.testing import mesh_2x2, rank, record_p2p, run_on_ranks, sent_bytes, tp_mesh, world_sizes

TOL = dict(rtol=1e-5, atol=1e-5)
N_OUTS = (5, 7, 3)


def _my_shard(full, dim):
    return full.detach().chunk(tp_mesh().size(), dim)[rank()].clone().requires_grad_()


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _all_gather_matmul_case(gather_dim, n_bs):
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
    return records, shard.numel() * shard.element_size()


@world_sizes(2, 4)
@pytest.mark.parametrize("gather_dim", [0, 1])
@pytest.mark.parametrize("n_bs", [1, 3])
def test_all_gather_matmul_equals_all_gather_then_matmul(world_size, gather_dim, n_bs):
    for r, (records, shard_bytes) in enumerate(run_on_ranks(_all_gather_matmul_case, world_size, gather_dim, n_bs)):
        sends = [(peer, nbytes) for kind, peer, nbytes in records if kind == "send"]
        # world - 1 steps, each handing one shard to the rank before this one
        assert sends == [((r - 1) % world_size, shard_bytes)] * (world_size - 1)
        assert sent_bytes(records) == (world_size - 1) * shard_bytes


def _matmul_reduce_scatter_case(scatter_dim, reduce_op):
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
    return records, out.numel() * out.element_size()


@world_sizes(2, 4)
@pytest.mark.parametrize("scatter_dim", [0, 1])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_matmul_reduce_scatter_equals_matmul_then_reduce_scatter(world_size, scatter_dim, reduce_op):
    results = run_on_ranks(_matmul_reduce_scatter_case, world_size, scatter_dim, reduce_op)
    for r, (records, out_bytes) in enumerate(results):
        sends = [(peer, nbytes) for kind, peer, nbytes in records if kind == "send"]
        assert sends == [((r - 1) % world_size, out_bytes)] * (world_size - 1)


def _sub_mesh_case():
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
    return {peer for _, peer, _ in records} <= set(row) - {dist.get_rank()}


def test_the_ring_runs_over_one_dim_of_a_2x2_mesh_and_talks_only_within_its_row():
    assert run_on_ranks(_sub_mesh_case, 4) == [True] * 4


def _single_rank_case():
    x, b = torch.randn(2, 3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    gathered, (y,) = overlap.all_gather_matmul(x, [b], 1, tp_mesh())
    z = overlap.matmul_reduce_scatter(y, b.t(), 0, tp_mesh(), "avg")
    z.sum().backward()
    torch.testing.assert_close(z, x @ b @ b.t(), **TOL)
    return torch.equal(gathered, x)


def test_one_rank_is_a_plain_matmul():
    assert run_on_ranks(_single_rank_case, 1) == [True]


def _bfloat16_case():
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
    return True


@world_sizes(2, 4)
def test_bfloat16_inputs_stay_bfloat16(world_size):
    assert all(run_on_ranks(_bfloat16_case, world_size))


def _unused_output_case():
    mesh = tp_mesh()
    shard = torch.randn(2, 4, requires_grad=True)
    b_used, b_unused = torch.randn(4, 3, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    _, (used, _unused) = overlap.all_gather_matmul(shard, [b_used, b_unused], 0, mesh)
    with record_p2p() as records:
        used.sum().backward()
    # the backward reduce-scatters grad @ b_used.T only: one (2, 4) partial per step
    return sent_bytes(records), b_unused.grad


def test_an_unused_output_costs_nothing_in_the_backward():
    for sent, unused_grad in run_on_ranks(_unused_output_case, 2):
        assert sent == 2 * 4 * 4 and unused_grad is None


def _saved_shapes_case(b_requires_grad):
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
    return saved, tuple(gathered.shape), tuple(y.shape)


def test_frozen_weights_keep_no_activation_alive_for_the_backward():
    frozen, gathered, y = run_on_ranks(_saved_shapes_case, 2, False)[0]
    # only the matrices are kept (their transposes give the input gradients)
    assert frozen == [(8, 5), (5, 4)], frozen
    trainable, _, _ = run_on_ranks(_saved_shapes_case, 2, True)[0]
    # trainable: the gathered input of the first op and the input of the second, for the weight gradients
    assert sorted(trainable) == sorted([gathered, (8, 5), y, (5, 4)]), trainable


# ------------------------------------------------------------------ errors


def _errors_case():
    mesh = tp_mesh()
    x = torch.randn(3, 4, 8)
    errors = {}
    attempts = {
        "contracted_gather": lambda: overlap.all_gather_matmul(x, [torch.randn(8, 2)], 2, mesh),
        "wrong_rows": lambda: overlap.all_gather_matmul(x, [torch.randn(6, 2)], 0, mesh),
        "single_b": lambda: overlap.all_gather_matmul(x, torch.randn(8, 2), 0, mesh),
        "empty_bs": lambda: overlap.all_gather_matmul(x, [], 0, mesh),
        "dtype": lambda: overlap.all_gather_matmul(x, [torch.randn(8, 2, dtype=torch.float64)], 0, mesh),
        "uneven_scatter": lambda: overlap.matmul_reduce_scatter(x, torch.randn(8, 2), 0, mesh),
        "reduce_op": lambda: overlap.matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 2), 0, mesh, "max"),
        "bad_group": lambda: overlap.matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 2), 0, 3),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except (ValueError, TypeError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
    dist.barrier()
    return errors


def test_bad_arguments_raise_errors_that_say_what_to_change():
    errors = run_on_ranks(_errors_case, 2)[0]
    expected = {
        "contracted_gather": r"ValueError: all_gather_matmul: gather_dim=2 .* leading dims 0..1 .*contracts",
        "wrong_rows": r"ValueError: .*bs\[0\] has 6 rows but the input's last .* dim is 8.*weight.t\(\)",
        "single_b": r"TypeError: .*wrap a single one as \[b\]",
        "empty_bs": r"ValueError: .*bs is empty",
        "dtype": r"TypeError: .*torch.float64 but the input is torch.float32",
        "uneven_scatter": r"ValueError: .*size 3, which does not split evenly over 2 ranks.*pad it",
        "reduce_op": r"ValueError: .*reduce_op='max' is not supported",
        "bad_group": r"TypeError: group must be a ProcessGroup",
    }
    assert set(errors) == set(expected), errors
    for name, pattern in expected.items():
        assert pytest.importorskip("re").match(pattern, errors[name]), (name, errors[name])


def _uneven_shards_case(op):
    x = torch.randn(3 if rank() == 0 else 2, 8)
    with pytest.raises(ValueError) as raised:
        if op == "all_gather_matmul":
            overlap.all_gather_matmul(x, [torch.randn(8, 2)], 0, tp_mesh())
        else:
            overlap.matmul_reduce_scatter(x, torch.randn(8, 2), 0, tp_mesh())
    return str(raised.value)


@world_sizes(2, 4)
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_ranks_with_different_shapes_all_get_a_clear_error(world_size, op):
    # without the check, gloo aborts the process when a received chunk has the wrong size
    messages = run_on_ranks(_uneven_shards_case, world_size, op)
    sizes = [(3, 8)] + [(2, 8)] * (world_size - 1)
    assert messages == [
        f"{op}: the ranks' inputs have different shapes {sizes}; every rank must pass the same "
        f"shape (shard the gathered dim evenly, e.g. pad the sequence to a multiple of {world_size})"
    ] * world_size


# ------------------------------------------------------------------ registrations


def _opcheck_case():
    group_name = tp_mesh().get_group().group_name
    shard = torch.randn(2, 3, 8, requires_grad=True)
    bs = [torch.randn(8, 4, requires_grad=True), torch.randn(8, 2)]
    a = torch.randn(2, 4, 8, requires_grad=True)
    b = torch.randn(8, 6, requires_grad=True)
    reports = {
        "all_gather_matmul": torch.library.opcheck(
            torch.ops.torch_tp.all_gather_matmul.default, (shard, bs, 1, group_name)
        ),
        "matmul_reduce_scatter": torch.library.opcheck(
            torch.ops.torch_tp.matmul_reduce_scatter.default, (a, b, 1, group_name, "sum")
        ),
    }
    return {op: {check: result for check, result in report.items()} for op, report in reports.items()}


def test_opcheck_passes_for_both_ops():
    reports = run_on_ranks(_opcheck_case, 2)[0]
    for op, report in reports.items():
        assert report and all(result == "SUCCESS" for result in report.values()), (op, report)
