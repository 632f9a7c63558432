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
