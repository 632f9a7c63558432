"""``full_tensors``: every DTensor made whole in one collective per group and dtype, as ``full_tensor`` would."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp.testing import comm_counts, full_tensors, mesh_2x2, on_ranks, rank, tp_mesh, world_size


def _uneven_partial_replicated_and_plain():
    mesh = tp_mesh()
    whole = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)  # 7 rows: uneven on 2 and 4 ranks
    ints = torch.arange(3 * 2).reshape(3, 2)  # 3 rows: on 4 ranks the last holds none
    partial = DTensor.from_local(torch.full((2, 3), float(rank() + 1)), mesh, [Partial()], run_check=False)
    averaged = DTensor.from_local(torch.full((2,), float(rank() + 1)), mesh, [Partial("avg")], run_check=False)
    values = [
        distribute_tensor(whole, mesh, [Shard(0)]),
        distribute_tensor(whole, mesh, [Shard(1)]),
        None,
        distribute_tensor(ints, mesh, [Shard(0)]),
        partial,
        distribute_tensor(whole, mesh, [Replicate()]),
        whole,
        averaged,
    ]
    one_by_one = [v.full_tensor() if isinstance(v, DTensor) else v for v in values]
    with CommDebugMode() as mode:
        batched = full_tensors(values)
    for got, want in zip(batched, one_by_one):
        if want is None:
            assert got is None
        else:
            assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
    ranks = world_size()
    assert torch.equal(batched[4], torch.full((2, 3), float(ranks * (ranks + 1) // 2)))
    return comm_counts(mode)


@on_ranks(2, 4)
def test_full_tensors_equal_full_tensor_with_one_all_gather_per_dtype():
    counts = _uneven_partial_replicated_and_plain()
    assert counts == {"all_gather_into_tensor": 2}, counts  # float32 and int64; Replicate none


@on_ranks(4)
def test_full_tensors_on_a_2d_mesh_fall_back_to_full_tensor():
    mesh = mesh_2x2()
    whole = torch.arange(16.0).reshape(4, 4)
    value = distribute_tensor(whole, mesh, [Shard(0), Shard(1)])
    (got,) = full_tensors([value])
    assert torch.equal(got, whole) and not got.requires_grad
    dist.barrier()


@on_ranks(2)
def test_assert_sharded_trains_like_trains_and_names_the_step_that_diverges():
    # a pointwise layer on a width-sharded input: plain DTensor ops, no torch_tp handler needed
    import functools

    import pytest
    import torch.nn as nn

    from torch_tp.testing import TOL, assert_sharded_trains_like, replicated_copy

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return x * self.weight

    mesh = tp_mesh()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen)) for _ in range(3)]
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    reference = Scale()
    model = replicated_copy(reference, mesh)
    steps = assert_sharded_trains_like(model, reference, batches, mesh, [Shard(1)], **TOL, optimizer=sgd)
    assert len(steps) == 3 and steps[-1].output.placements == (Shard(1),)
    torch.testing.assert_close(model.weight.full_tensor(), reference.weight.detach(), **TOL)
    assert reference.weight.item() != 1.5  # it trained

    # the parallel model's optimizer runs at another learning rate: steps 0 agree, step 1 must not
    class TwiceTheStep(torch.optim.SGD):
        def __init__(self, params):
            params = list(params)
            super().__init__(params, lr=0.2 if isinstance(params[0], DTensor) else 0.1)

    reference = Scale()
    with pytest.raises(AssertionError, match="step 1"):
        assert_sharded_trains_like(replicated_copy(reference, mesh), reference, batches, mesh, [Shard(1)], **TOL,
                                   optimizer=TwiceTheStep)
