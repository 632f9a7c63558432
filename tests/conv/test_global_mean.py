"""``mean`` over a spatially sharded dim, even and uneven strips, against one process.

DTensor's own ``mean`` gathers the input when the strips are uneven; under
:func:`sharded_mean` it is ``sum / count``, partial on the sharded mesh dim, with no message in
the forward. Values, gradients, dtypes and the collectives are checked; squeeze-excite (a mean
inside a block) runs on uneven strips without a gather.
"""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp import SpatialParallel, parallelize_module
from torch_tp.conv import sharded_mean
from torch_tp.models.cnn import SqueezeExcite
from torch_tp.testing import (
    TOL,
    assert_params_and_grads_match,
    comm_counts,
    local_chunk,
    mesh_2x2,
    on_ranks,
    tp_mesh,
)

_MEANS = {  # name: (dim, keepdim)
    "spatial": ((2, 3), False),
    "spatial_keepdim": ((2, 3), True),
    "width_only": ((-1,), False),
    "height_only": ((2,), True),  # the sharded width survives: no reduction over the mesh
    "everything": (None, False),
}


@pytest.mark.parametrize("width", [8, 11])
@pytest.mark.parametrize("case", list(_MEANS))
@on_ranks(2, 4)
def test_mean_over_strips_matches_one_process_with_no_message_in_the_forward(case, width):
    dim, keepdim = _MEANS[case]
    x = torch.randn(2, 3, 5, width, dtype=torch.float64)
    rx = x.clone().requires_grad_()
    ref = rx.mean(dim, keepdim=keepdim) if dim is not None else rx.mean()
    ref.square().sum().backward()
    dx = distribute_tensor(x, tp_mesh(), [Shard(3)], src_data_rank=None).requires_grad_()
    with sharded_mean(), CommDebugMode() as forward:
        y = dx.mean(dim, keepdim=keepdim) if dim is not None else dx.mean()
    assert comm_counts(forward) == {}, comm_counts(forward)
    reduces_width = dim is None or 3 in [d % 4 for d in dim]
    assert y.placements == ((Partial(),) if reduces_width else (Shard(3),)), y.placements
    with sharded_mean():
        y.full_tensor().square().sum().backward()
    torch.testing.assert_close(y.full_tensor(), ref.detach(), **TOL)
    torch.testing.assert_close(dx.grad.full_tensor(), rx.grad, **TOL)


# each rank's partial mean is rounded to the half type before the partials are summed
_HALF_TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=3e-3, atol=3e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@on_ranks(4)
def test_half_types_accumulate_in_float32_and_keep_their_dtype(dtype):
    x = torch.randn(2, 4, 3, 10)  # strips 3, 3, 3, 1
    dx = distribute_tensor(x.to(dtype), tp_mesh(), [Shard(3)], src_data_rank=None)
    with sharded_mean():
        y = dx.mean((2, 3))
        as_float = dx.mean((2, 3), dtype=torch.float32)
    assert y.dtype == dtype and as_float.dtype == torch.float32
    torch.testing.assert_close(y.full_tensor().float(), x.to(dtype).float().mean((2, 3)), **_HALF_TOL[dtype])
    torch.testing.assert_close(as_float.full_tensor(), x.to(dtype).float().mean((2, 3)), **TOL)


@on_ranks(4)
def test_batch_and_width_on_a_2x2_mesh():
    x = torch.randn(4, 3, 5, 9, dtype=torch.float64)
    dx = distribute_tensor(x, mesh_2x2(), [Shard(0), Shard(3)], src_data_rank=None)
    with sharded_mean():
        y = dx.mean((2, 3))
    assert y.placements == (Shard(0), Partial())
    torch.testing.assert_close(y.full_tensor(), x.mean((2, 3)), **TOL)
    with sharded_mean():
        assert dx.redistribute(mesh_2x2(), [Replicate(), Shard(3)]).mean().full_tensor().item() == pytest.approx(
            x.mean().item())


@on_ranks(4)
def test_squeeze_excite_on_uneven_strips_gathers_nothing_and_matches_one_process():
    torch.manual_seed(0)
    ref = SqueezeExcite(8).double()
    block = SqueezeExcite(8).double()
    block.load_state_dict(ref.state_dict())
    x = torch.randn(2, 8, 6, 14, dtype=torch.float64)  # width 14 on 4 ranks: strips 4, 4, 4, 2
    ref(x).square().sum().backward()
    parallelize_module(block, tp_mesh(), SpatialParallel(dim=3))
    with CommDebugMode() as comm:
        out = block(local_chunk(x, 3))
        out.square().sum().backward()
    torch.testing.assert_close(out, local_chunk(ref(x).detach(), 3), **TOL)
    assert "all_gather_into_tensor" not in comm_counts(comm), comm_counts(comm)
    assert_params_and_grads_match(block, ref)


@on_ranks(2)
def test_integer_input_is_refused_as_aten_refuses_it():
    ids = distribute_tensor(torch.arange(12).view(2, 6), tp_mesh(), [Shard(1)], src_data_rank=None)
    with pytest.raises(RuntimeError) as plain:
        torch.arange(12).view(2, 6).mean(1)
    with sharded_mean(), pytest.raises(RuntimeError) as sharded:
        ids.mean(1)
    assert str(sharded.value) == str(plain.value)
