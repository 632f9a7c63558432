"""SpatialParallel on real gloo ranks: a small CNN sharded on width trains like the unsharded one.

The loss is computed on the gathered output (``full_tensor()``), so every rank computes the
same loss as the single-process model and backpropagates through the gather.

Applying the style makes the model hold the handler sets it needs; their handlers run only
inside it, so other tests sharing the worker pool see DTensor as upstream has it
(``tests/conv/test_registry.py``).
"""

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import torch_tp.conv as tp_conv
import torch_tp.conv.batch_norm as tp_batch_norm
from torch_tp import SpatialParallel, UnsupportedModuleError, parallelize_module
from torch_tp.functional import spatial
from torch_tp.testing import TOL, assert_params_and_grads_match, assert_trains_like, full_tensor, local_chunk
from torch_tp.testing import on_ranks, run_on_ranks, tp_mesh, world_sizes

WIDTH_PLAN = {"*": SpatialParallel(dim=3)}


def _cnn():
    bn = nn.BatchNorm2d(8)
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        bn.eval(),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 4, 5, padding=2),
    )


# ------------------------------------------------------------------ training


# the loss of the gathered output: every rank computes the single-process loss
def _gathered_mse(out, target):
    return nn.functional.mse_loss(full_tensor(out), target)


def _gathered_mean_square(out, _):
    return full_tensor(out).pow(2).mean()


def _train_task(steps):
    torch.manual_seed(0)
    reference = _cnn()
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), WIDTH_PLAN)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.placements == (Replicate(),), name
    image = torch.randn(2, 3, 8, 30)  # same on every rank (seeded); width 30 is uneven on 4
    target = torch.randn(2, 4, 4, 15)

    def sharded_like_the_target(out, _):
        assert isinstance(out, DTensor) and out.placements == (Shard(3),)
        assert out.to_local().shape == local_chunk(target, 3).shape

    sgd, strip = functools.partial(torch.optim.SGD, lr=0.1), functools.partial(local_chunk, dim=3)
    losses = assert_trains_like(model, reference, [(image, target)] * steps, _gathered_mse, optimizer=sgd, **TOL,
                                module_inputs=strip, check=sharded_like_the_target)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, **TOL, msg=lambda m: f"{name}: {m}")
    return losses


@world_sizes(2, 4)
def test_small_cnn_trains_3_sgd_steps_like_single_process(world_size):
    losses = run_on_ranks(_train_task, world_size, 3)
    assert all(rank_losses == losses[0] for rank_losses in losses)
    assert len(losses[0]) == 3 and losses[0][2] < losses[0][0]


# ------------------------------------------------------------------ style arguments


@on_ranks(2, 4)
def test_style_arguments():
    reference = _cnn()
    image = torch.randn(2, 3, 8, 30)
    expected = reference(image).detach()
    out_chunk = functools.partial(local_chunk, expected, 3)

    # input_layouts=Replicate(): every rank passes the full image and keeps its slice
    model = parallelize_module(
        copy.deepcopy(reference), tp_mesh(),
        {"0": SpatialParallel(dim=3, input_layouts=Replicate()), "[1-5]": SpatialParallel(dim=-1)},
    )
    out = model(image)
    assert out.placements == (Shard(3),)
    torch.testing.assert_close(out.to_local(), out_chunk(), **TOL)

    # output_layouts=Replicate(): the last layer gathers the output; dim=-1 is dim 3
    model = parallelize_module(
        copy.deepcopy(reference), tp_mesh(),
        {"[0-4]": SpatialParallel(dim=-1), "5": SpatialParallel(dim=3, output_layouts=Replicate())},
    )
    out = model(local_chunk(image, 3))
    assert out.placements == (Replicate(),)
    torch.testing.assert_close(out.to_local(), expected, **TOL)

    # use_local_output=True on every layer: plain local slices travel between the layers
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), {"*": SpatialParallel(dim=3, use_local_output=True)})
    out = model(local_chunk(image, 3))
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, out_chunk(), **TOL)

    # the function form, on a Conv1d sharded on its length
    conv1d = nn.Conv1d(2, 3, 4, padding=3, dilation=2)
    signal = torch.randn(1, 2, 21)
    sharded = spatial(copy.deepcopy(conv1d), tp_mesh(), dim=2)
    torch.testing.assert_close(sharded(local_chunk(signal, 2)).full_tensor(), conv1d(signal), **TOL)

    # a Conv3d + BatchNorm3d sharded on depth (dim 2)
    model = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.BatchNorm3d(3).eval(), nn.Conv3d(3, 2, 2))
    volume = torch.randn(1, 2, 10, 4, 5, requires_grad=True)
    expected = model(volume)
    sharded = parallelize_module(copy.deepcopy(model), tp_mesh(), {"*": SpatialParallel(dim=2)})
    x = local_chunk(volume.detach(), 2).requires_grad_()
    out = sharded(x)
    torch.testing.assert_close(out.full_tensor(), expected, **TOL)
    out.full_tensor().square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(x.grad, local_chunk(volume.grad, 2), **TOL)
    assert_params_and_grads_match(sharded, model, **TOL)
    assert tp_conv.sharded_conv.is_installed()  # held by the models alive here


# ------------------------------------------------------------------ refusals


# name: (the refused module, phrases its error must hold besides the quoted path)
_REFUSED = {
    "head": (lambda: nn.Linear(4, 4), ("nn.Conv2d",)),
    "pool": (lambda: nn.MaxPool2d(2), ()),
    "drop": (lambda: nn.Dropout(0.5), ()),
    "wrap": (lambda: nn.Conv2d(3, 3, 3, padding=1, padding_mode="circular"), ()),
}


@pytest.mark.parametrize("name", list(_REFUSED))
@on_ranks(2)
def test_unsupported_modules_are_refused_naming_the_path(name):
    build, phrases = _REFUSED[name]
    model = nn.Sequential()
    model.add_module(name, build())
    untouched = copy.deepcopy(model)
    with pytest.raises(UnsupportedModuleError) as err:
        parallelize_module(model, tp_mesh(), {name: SpatialParallel(dim=3)})
    for phrase in (f"'{name}'", *phrases):
        assert phrase in str(err.value), str(err.value)
    for (_, p), (_, q) in zip(model.named_parameters(), untouched.named_parameters()):
        assert not isinstance(p, DTensor) and torch.equal(p, q)


@on_ranks(2)
def test_a_dim_that_is_not_spatial_is_refused():
    with pytest.raises(ValueError, match="spatial dim"):
        parallelize_module(nn.Conv1d(2, 2, 3), tp_mesh(), {"": SpatialParallel(dim=3)})


@on_ranks(2)
def test_inputs_and_modes_the_sharded_convolution_cannot_run_are_refused_at_forward():
    # an unbatched input would put dim=-1 on the wrong spatial dim
    conv = parallelize_module(nn.Conv2d(3, 3, 3), tp_mesh(), {"": SpatialParallel(dim=-1)})
    with pytest.raises(ValueError, match="batched 4-D"):
        conv(torch.randn(3, 8, 8))

    # without the BatchNorm handlers a BatchNorm cannot use its plain running statistics: entries
    # something else replaced in DTensor's table since the model was parallelized are named
    model = parallelize_module(_cnn(), tp_mesh(), WIDTH_PLAN)
    table = DTensor._op_dispatcher._custom_op_handlers
    saved = {op: table.pop(op) for op in tp_batch_norm.HANDLERS.handlers}
    try:
        with pytest.raises(RuntimeError, match=r"handlers of torch_tp.conv.batch_norm are no longer"):
            model(torch.randn(2, 3, 8, 8))
    finally:
        table.update(saved)
    # a whole-model region needs every set, the pooling one too
    region = parallelize_module(nn.Sequential(nn.Conv2d(3, 3, 3), nn.MaxPool2d(2)), tp_mesh(), SpatialParallel(dim=3))
    saved = {op: table.pop(op) for op in tp_conv.pooling.HANDLERS.handlers}
    try:
        with pytest.raises(RuntimeError, match=r"handlers of torch_tp.conv.pooling are no longer"):
            region(torch.randn(2, 3, 8, 8))
    finally:
        table.update(saved)


def test_style_is_immutable_hashable_and_validates_its_arguments():
    style = SpatialParallel(dim=-1)
    assert repr(style) == (
        "SpatialParallel(dim=-1, input_layouts=Shard(dim=-1), output_layouts=Shard(dim=-1), "
        "use_local_output=False)"
    )
    assert style == SpatialParallel(dim=-1, input_layouts=Shard(-1))
    assert style != SpatialParallel(dim=3) and hash(style) == hash(SpatialParallel(dim=-1))
    assert SpatialParallel(dim=3, output_layouts=Replicate()).output_layouts == Replicate()
    before = repr(style)
    check = style.check
    check(nn.Conv2d(1, 1, 3), 4, "c")
    assert repr(style) == before
    with pytest.raises(TypeError):
        SpatialParallel()
    with pytest.raises(TypeError, match="takes an int"):
        SpatialParallel(dim="width")
    with pytest.raises(ValueError, match="batch and channels"):
        SpatialParallel(dim=1)
    with pytest.raises(TypeError, match="one Placement"):
        SpatialParallel(dim=3, input_layouts=(Shard(3),))


@on_ranks(2, 4)
def test_a_cnn_with_batch_norm_in_training_mode_trains_like_one_process():
    """Batch statistics of the whole image (not of a strip), running statistics identical on
    every rank and equal to one process's, through training and then eval."""
    torch.manual_seed(0)
    reference = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None),
    )
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), WIDTH_PLAN)
    image = torch.randn(2, 3, 6, 10)  # width 10: strips 3, 3, 3, 1 on 4 ranks
    assert_trains_like(model, reference, [(image, None)] * 3, _gathered_mean_square,
                       optimizer=functools.partial(torch.optim.SGD, lr=0.1), **TOL,
                       module_inputs=functools.partial(local_chunk, dim=3))
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, **TOL, msg=lambda m: f"{name}: {m}")
    model.eval(), reference.eval()
    torch.testing.assert_close(model(local_chunk(image, 3)).full_tensor(), reference(image), **TOL)
