"""GroupNorm and channel LayerNorm on a spatially sharded input, on real gloo ranks, against one process.

GroupNorm cases train an unsharded ``nn.GroupNorm`` and a copy with replicated DTensor
parameters side by side for two SGD steps, the copy's input sharded ``Shard(d)`` on a spatial
dim (uneven and empty strips at world size 4), under :func:`sharded_group_norm`. Outputs and
input gradients are compared strip by strip with the reference's ``torch.chunk`` pieces,
parameters and their gradients as full tensors. Channel LayerNorm is checked in the three
forms CNNs write it (timm's ``LayerNorm2d``, ``F.layer_norm`` on channels-last, ConvNeXt's
channels-first mean/var), mirrored here since the project does not depend on timm.
"""


import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torch_tp.conv import sharded_convolution
from torch_tp.conv.group_norm import (
    group_norm_handler,
    sharded_group_norm,
)
from torch_tp.conv.pointwise import sharded_pointwise
from torch_tp.testing import TOL, assert_comm_counts, assert_sharded_trains_like, mesh_2x2
from torch_tp.testing import on_ranks, replicated_copy, shard_locally, tp_mesh

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# Helpers (rank side)
# ---------------------------------------------------------------------------------------------


def _randomized(module, gen):
    """Non-trivial weight and bias, the same on every rank."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            low = 0.5 if name.endswith("weight") else -1.0
            p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) * 1.5 + low)
    return module


def _comms_are(comms):
    """A ``check`` for :func:`assert_sharded_trains_like`: the collectives of each half of the
    step are ``comms`` = (forward, backward) expected counts (``None``: not checked)."""
    def check(step, what):
        if comms is not None:
            assert_comm_counts(step.forward_comms, comms[0], f"{what} forward")
            assert_comm_counts(step.backward_comms, comms[1], f"{what} backward")
    return check


def _assert_partial_param_grads(model, shape, placement):
    """Weight and bias gradients are the local strips' sums: ``Partial()``, not yet reduced."""
    mesh = tp_mesh()
    y = model(shard_locally(torch.randn(shape), mesh, [placement]).requires_grad_())
    y.backward(shard_locally(torch.randn(shape), mesh, [placement]))
    for name, p in model.named_parameters():
        assert p.grad.placements == (Partial(),), (name, p.grad.placements)


def _train_and_compare(reference, shape, *, placements, mesh=None, steps=2, comms=None, dtype=torch.float32,
                       out_channels=None):
    mesh = mesh or tp_mesh()
    gen = torch.Generator().manual_seed(0)
    reference = _randomized(reference.to(dtype), gen)
    model = replicated_copy(reference, mesh)
    out_shape = (shape[0], out_channels or shape[1], *shape[2:])
    batches = ((torch.randn(shape, generator=gen, dtype=dtype) * 2 + 1, torch.randn(out_shape, generator=gen, dtype=dtype))
               for _ in range(steps))
    sgd = functools.partial(torch.optim.SGD, lr=0.1) if list(reference.parameters()) else None
    assert_sharded_trains_like(model, reference, batches, mesh, placements, **TOL, optimizer=sgd,
                               check=_comms_are(comms))
    return model


# ---------------------------------------------------------------------------------------------
# GroupNorm against one process
# ---------------------------------------------------------------------------------------------

GROUP_NORM_CASES = {
    # (shape, sharded dim, groups, module kwargs); at world size 4: strips 3,3,3,1 / 1,1,1,0 / ...
    "2d_width": ((2, 6, 5, 10), 3, 3, {}),
    "2d_height_with_empty_strip": ((2, 6, 3, 7), 2, 3, {}),
    "1d_length": ((3, 4, 10), 2, 2, {}),
    "3d_width_with_empty_strip": ((2, 4, 3, 4, 3), 4, 2, {}),
    "one_group": ((2, 6, 5, 10), 3, 1, {}),
    "group_per_channel": ((2, 6, 5, 10), 3, 6, {}),
    "affine_false": ((2, 6, 5, 10), 3, 3, {"affine": False}),
}


@pytest.mark.parametrize("case", list(GROUP_NORM_CASES), ids=list(GROUP_NORM_CASES))
@on_ranks(2, 4)
def test_group_norm_trains_like_single_process_with_one_collective_each_way(case):
    shape, dim, groups, kwargs = GROUP_NORM_CASES[case]
    with sharded_group_norm():
        model = _train_and_compare(nn.GroupNorm(groups, shape[1], **kwargs), shape, placements=[Shard(dim)],
                                   comms=({"all_gather": 1}, {"all_reduce": 1}))
        _assert_partial_param_grads(model, shape, Shard(dim))


@on_ranks(2, 4)
def test_statistics_of_an_offset_input_are_exact():
    # mean 1000, std 1: per-rank centred moments merged in float64 agree with a float64 reference
    mesh = tp_mesh()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 6, 22, generator=gen) + 1000
    _, ref_mean, ref_rstd = aten.native_group_norm(x.double(), None, None, 3, 4, 132, 2, 1e-5)
    with sharded_group_norm():
        out, mean, rstd = aten.native_group_norm(shard_locally(x, mesh, [Shard(3)]), None, None, 3, 4, 132, 2, 1e-5)
    assert out.placements == (Shard(3),) and mean.placements == rstd.placements == (Replicate(),)
    assert mean.shape == rstd.shape == (3, 2)
    torch.testing.assert_close(mean.to_local().double(), ref_mean, rtol=1e-7, atol=0)
    torch.testing.assert_close(rstd.to_local().double(), ref_rstd, rtol=1e-5, atol=0)


@on_ranks(4)
def test_batch_and_width_sharded_on_a_2x2_mesh():
    # batch 3 on dp=2 (2, 1) and width 10 on tp=2: statistics merged over tp only
    mesh = mesh_2x2()
    with sharded_group_norm():
        _train_and_compare(nn.GroupNorm(2, 4), (3, 4, 4, 10), mesh=mesh, placements=[Shard(0), Shard(3)],
                           comms=({"all_gather": 1}, {"all_reduce": 1}))
        _train_and_compare(nn.GroupNorm(2, 4), (3, 4, 4, 10), mesh=mesh, placements=[Replicate(), Shard(3)],
                           steps=1)
        # height on dp and width on tp: merged over both, one all_gather each
        _train_and_compare(nn.GroupNorm(2, 4), (2, 4, 5, 10), mesh=mesh, placements=[Shard(2), Shard(3)],
                           steps=1, comms=({"all_gather": 2}, {"all_reduce": 2}))
        # batch only: per-sample statistics need no communication
        _train_and_compare(nn.GroupNorm(2, 4), (3, 4, 4, 10), mesh=mesh, placements=[Shard(0), Replicate()],
                           steps=1, comms=({}, {}))
        x = shard_locally(torch.randn(3, 4, 4, 10), mesh, [Shard(0), Shard(3)])
        out, mean, rstd = aten.native_group_norm(x, None, None, 3, 4, 40, 2, 1e-5)
    assert out.placements == (Shard(0), Shard(3)) and mean.placements == rstd.placements == (Shard(0), Replicate())


def _conv_gn_act():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(4, 8),
        nn.SiLU(),
        nn.Conv2d(8, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.Hardswish(),
    )


@on_ranks(2, 4)
def test_conv_gn_act_conv_gn_act_trains_like_single_process():
    # float64, as test_batch_norm's chain: float32 summation order alone exceeds TOL after a few steps
    torch.manual_seed(0)
    with sharded_convolution(), sharded_group_norm(), sharded_pointwise():
        _train_and_compare(_conv_gn_act(), (2, 3, 6, 10), placements=[Shard(3)], steps=3, dtype=torch.float64,
                           out_channels=4)
        _train_and_compare(_conv_gn_act(), (2, 3, 10, 6), placements=[Shard(2)], steps=1, dtype=torch.float64,
                           out_channels=4)


# ---------------------------------------------------------------------------------------------
# Channel LayerNorm in the forms CNNs write it
# ---------------------------------------------------------------------------------------------


class LayerNorm2d(nn.LayerNorm):
    """timm's ``LayerNorm2d``: LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtLayerNorm(nn.Module):
    """ConvNeXt's official ``LayerNorm`` (``data_format`` ``"channels_first"`` or ``"channels_last"``)."""

    def __init__(self, normalized_shape, eps=1e-6, data_format="channels_last"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))
        self.eps = eps
        self.data_format = data_format
        self.normalized_shape = (normalized_shape,)

    def forward(self, x):
        if self.data_format == "channels_last":
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


LAYER_NORM_FORMS = {
    # (module factory, input shape, sharded dims to try): NCHW width/height or NHWC height/width
    "timm_layer_norm_2d": (lambda: LayerNorm2d(4), (2, 4, 3, 10), (3, 2)),
    "convnext_channels_first": (lambda: ConvNeXtLayerNorm(4, data_format="channels_first"), (2, 4, 3, 10), (3, 2)),
    "convnext_channels_last": (lambda: ConvNeXtLayerNorm(4, data_format="channels_last"), (2, 3, 10, 4), (2, 1)),
}


@pytest.mark.parametrize("form", list(LAYER_NORM_FORMS), ids=list(LAYER_NORM_FORMS))
@on_ranks(2, 4)
def test_channel_layer_norm_runs_locally_and_keeps_theshard_locally(form):
    # the second dim has 3 positions: one rank holds nothing at world size 4
    factory, shape, dims = LAYER_NORM_FORMS[form]
    with sharded_group_norm():
        for dim in dims:
            model = _train_and_compare(factory(), shape, placements=[Shard(dim)], comms=({}, {}))
        _assert_partial_param_grads(model, shape, Shard(dims[0]))


# ---------------------------------------------------------------------------------------------
# Unsupported layouts raise
# ---------------------------------------------------------------------------------------------


@on_ranks(2)
def test_channel_sharding_and_plain_weights_raise():
    mesh = tp_mesh()
    x = torch.randn(2, 4, 5, 6)
    gn = replicated_copy(nn.GroupNorm(2, 4), mesh)
    with sharded_group_norm():
        with pytest.raises(NotImplementedError, match="channel dim"):
            gn(shard_locally(x, mesh, [Shard(1)]))
        with pytest.raises(NotImplementedError, match="weight as a replicated DTensor"):
            group_norm_handler(aten.native_group_norm.default,
                               (shard_locally(x, mesh, [Shard(3)]), torch.ones(4), None, 2, 4, 30, 2, 1e-5), {})
        with pytest.raises(NotImplementedError, match="replicated weight"):
            F.group_norm(shard_locally(x, mesh, [Shard(3)]), 2, shard_locally(torch.ones(4), mesh, [Shard(0)]))
        with pytest.raises(NotImplementedError, match=r"mesh dim 0 of the input is P\(sum\)"):
            gn(DTensor.from_local(x, mesh, [Partial()]))


# ---------------------------------------------------------------------------------------------
# Installation (single process)
# ---------------------------------------------------------------------------------------------

_OPS = (aten.native_group_norm.default, aten.native_group_norm_backward.default)
_LN_OPS = (aten.native_layer_norm.default, aten.native_layer_norm_backward.default)
