"""Training-mode BatchNorm on a spatially sharded input, on real gloo ranks, against one process.

Every case trains an unsharded ``nn.BatchNorm{1,2,3}d`` and a copy with replicated DTensor
parameters side by side for a few SGD steps, the copy's input sharded ``Shard(d)`` on a
spatial dim (uneven and empty strips at world size 4), under :func:`sharded_batch_norm`.
Outputs and input gradients are compared strip by strip with the reference's
``torch.chunk`` pieces; parameters, their gradients and the running statistics as full
tensors; the running statistics must also be the same bits on every rank.
"""


import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp.conv import sharded_convolution
from torch_tp.conv.batch_norm import (
    sharded_batch_norm,
)
from torch_tp.testing import TOL, assert_comm_counts, assert_params_and_grads_match, assert_sharded_step_matches, \
    assert_sharded_trains_like
from torch_tp.testing import comm_counts, full_tensor, mesh_2x2, on_ranks, replicated_copy, shard_locally, tp_mesh

aten = torch.ops.aten
_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_SGD = functools.partial(torch.optim.SGD, lr=0.1)


# ---------------------------------------------------------------------------------------------
# Helpers (rank side)
# ---------------------------------------------------------------------------------------------


def _randomized(module, gen):
    """Non-trivial weight, bias and running statistics, the same on every rank."""
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith("num_batches_tracked"):
                continue
            low = 0.5 if name.endswith(("weight", "running_var")) else -1.0
            t.copy_(torch.rand(t.shape, generator=gen) * 1.5 + low)
    return module


def _assert_same_on_every_rank(t, what):
    t = t.to_local() if isinstance(t, DTensor) else t
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"{what} differs between ranks: {gathered}"


def _assert_buffers_match(model, reference, what):
    pairs = zip(model.named_buffers(), reference.named_buffers(), strict=True)
    for (name, buf), (_, ref) in pairs:
        torch.testing.assert_close(full_tensor(buf), ref, **TOL, msg=lambda m: f"{what} {name}: {m}")
        _assert_same_on_every_rank(buf, f"{what} {name}")


def _train_and_compare(ndim, shape, dim, *, steps=3, dtensor_buffers=False, mesh=None, placements=None,
                       **bn_kwargs):
    mesh = mesh or tp_mesh()
    gen = torch.Generator().manual_seed(0)
    reference = _randomized(_BN[ndim](shape[1], **bn_kwargs), gen)
    model = replicated_copy(reference, mesh, buffers=dtensor_buffers)
    batches = ((torch.randn(shape, generator=gen) * 2 + 1, torch.randn(shape, generator=gen)) for _ in range(steps))
    with sharded_batch_norm():
        assert_sharded_trains_like(model, reference, batches, mesh, placements or [Shard(dim)], **TOL,
                                   optimizer=_SGD if list(reference.parameters()) else None,
                                   check=lambda _, what: _assert_buffers_match(model, reference, what))
    return model, reference


# ---------------------------------------------------------------------------------------------
# BatchNorm1d/2d/3d in training mode against one process
# ---------------------------------------------------------------------------------------------

CASES = {
    # (ndim, shape, sharded dim, module kwargs); at world size 4: strips 3,3,3,1 / 2,2,1,0 / ...
    "1d_length": (1, (4, 3, 10), 2, {}),
    "2d_width": (2, (2, 3, 5, 10), 3, {}),
    "2d_height_with_empty_strip": (2, (2, 3, 5, 10), 2, {}),
    "3d_width": (3, (2, 3, 3, 4, 6), 4, {}),
    "3d_depth_with_empty_strip": (3, (2, 3, 3, 4, 6), 2, {}),
    "momentum_none": (2, (2, 3, 5, 10), 3, {"momentum": None}),
    "no_running_stats": (2, (2, 3, 5, 10), 3, {"track_running_stats": False}),
    "affine_false": (1, (4, 3, 10), 2, {"affine": False}),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@on_ranks(2, 4)
def test_training_matches_single_process(case):
    ndim, shape, dim, kwargs = CASES[case]
    model, reference = _train_and_compare(ndim, shape, dim, **kwargs)
    if reference.track_running_stats:
        assert int(model.num_batches_tracked) == int(reference.num_batches_tracked) == 3


@on_ranks(2, 4)
def test_replicated_dtensor_running_stats_are_updated_in_place():
    model, _ = _train_and_compare(2, (2, 3, 5, 10), 3, dtensor_buffers=True)
    assert isinstance(model.running_mean, DTensor) and model.running_mean.placements == (Replicate(),)


@on_ranks(4)
def test_batch_and_width_sharded_on_a_2x2_mesh():
    # batch 3 on dp=2 (2, 1) and width 10 on tp=2: the statistics span both mesh dims
    _train_and_compare(2, (3, 3, 4, 10), 3, steps=2, mesh=mesh_2x2(), placements=[Shard(0), Shard(3)])
    _train_and_compare(2, (3, 3, 4, 10), 3, steps=1, mesh=mesh_2x2(), placements=[Replicate(), Shard(3)])


@on_ranks(2, 4)
def test_variance_of_an_offset_input_is_exact():
    # mean 1000, std 1: the variance from float32 sums of squares would be off by ~5e-2;
    # per-rank centred moments merged in float64 agree with a float64 reference to 1e-5
    mesh = tp_mesh()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 6, 22, generator=gen) + 1000
    reference = nn.BatchNorm2d(3, momentum=1.0).double()
    reference(x.double())
    model = replicated_copy(nn.BatchNorm2d(3, momentum=1.0), mesh)
    with sharded_batch_norm():
        model(shard_locally(x, mesh, [Shard(3)]))
    torch.testing.assert_close(model.running_var.double(), reference.running_var, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.running_mean.double(), reference.running_mean, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# Eval mode, communication
# ---------------------------------------------------------------------------------------------


@on_ranks(2, 4)
def test_train_mode_communicates_once_each_way_and_eval_mode_not_at_all():
    mesh = tp_mesh()
    gen = torch.Generator().manual_seed(2)
    reference = _randomized(nn.BatchNorm2d(3), gen)
    model = replicated_copy(reference, mesh)
    x, dy = torch.randn(2, 3, 5, 10, generator=gen), torch.randn(2, 3, 5, 10, generator=gen)
    dx = shard_locally(x, mesh, [Shard(3)]).requires_grad_()
    with sharded_batch_norm():
        with CommDebugMode() as forward:
            y = model(dx)
        with CommDebugMode() as backward:
            y.backward(shard_locally(dy, mesh, y.placements))
    assert_comm_counts(comm_counts(forward), {"all_gather": 1}, "train forward")
    assert_comm_counts(comm_counts(backward), {"all_reduce": 1}, "train backward")
    assert model.weight.grad.placements == (Partial(),) and model.bias.grad.placements == (Partial(),)
    reference(x).backward(dy)
    assert_params_and_grads_match(model, reference, **TOL, what="train")
    _assert_buffers_match(model, reference, "train")

    model.eval()
    reference.eval()
    model.zero_grad()
    reference.zero_grad()
    dx = shard_locally(x, mesh, [Shard(3)]).requires_grad_()
    with sharded_batch_norm(), CommDebugMode() as mode:
        model(dx).backward(shard_locally(dy, mesh, [Shard(3)]))
    assert_comm_counts(comm_counts(mode), {}, "eval forward + backward")
    model.zero_grad()
    with sharded_batch_norm():
        assert_sharded_step_matches(model, reference, x, dy, mesh, [Shard(3)], **TOL, what="eval")
    _assert_buffers_match(model, reference, "eval")


# ---------------------------------------------------------------------------------------------
# conv -> BN -> ReLU -> conv on a width-sharded input
# ---------------------------------------------------------------------------------------------


def _chain():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 2, 3, padding=1),
    )


@on_ranks(2, 4)
def test_conv_bn_relu_conv_trains_like_single_process():
    # float64: after a few SGD steps the float32 single-process gradients of this chain are
    # themselves ~4e-5 off the exact ones (summation order), more than TOL
    mesh = tp_mesh()
    torch.manual_seed(0)
    reference = _chain().double()
    model = replicated_copy(reference, mesh)
    gen = torch.Generator().manual_seed(3)
    batches = ((torch.randn(2, 3, 6, 10, generator=gen, dtype=torch.float64),  # width 10: 3, 3, 3, 1 on 4 ranks
                torch.randn(2, 2, 6, 10, generator=gen, dtype=torch.float64)) for _ in range(3))
    with sharded_convolution(), sharded_batch_norm():
        assert_sharded_trains_like(model, reference, batches, mesh, [Shard(3)], **TOL, optimizer=_SGD,
                                   check=lambda _, what: _assert_buffers_match(model, reference, what))
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, **TOL, msg=lambda m: f"{name} after 3 steps: {m}")


# ---------------------------------------------------------------------------------------------
# Unsupported layouts raise
# ---------------------------------------------------------------------------------------------


@on_ranks(2)
def test_channel_sharding_and_plain_weights_raise():
    mesh = tp_mesh()
    x = torch.randn(2, 4, 5, 6)
    bn = replicated_copy(nn.BatchNorm2d(4), mesh)
    with sharded_batch_norm():
        with pytest.raises(NotImplementedError, match="channel dim"):
            bn(shard_locally(x, mesh, [Shard(1)]))
        with pytest.raises(NotImplementedError, match="weight as a replicated DTensor"):
            nn.BatchNorm2d(4)(shard_locally(x, mesh, [Shard(3)]))
        with pytest.raises(NotImplementedError, match="replicated weight"):
            F.batch_norm(shard_locally(x, mesh, [Shard(3)]), None, None, shard_locally(torch.ones(4), mesh, [Shard(0)]),
                         None, training=True)


# ---------------------------------------------------------------------------------------------
# Installation (single process)
# ---------------------------------------------------------------------------------------------

_OPS = (aten.native_batch_norm.default, aten.native_batch_norm_backward.default)
