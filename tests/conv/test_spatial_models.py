"""Whole CNNs spatially parallel in one line, in training mode: ``parallelize_module(model, mesh,
SpatialParallel(dim=...))`` on the root module, every op on the rank's strip of the image.

Whole-network comparisons run in float64 (in float32 a max-pool or ReLU decision near a tie may
flip between two correct programs); each compares with the single-process model through 3 SGD
steps: outputs, loss, every gradient, BatchNorm running statistics, then eval mode.
"""

import copy
import functools
import re

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from torch_tp import SpatialParallel, UnsupportedModuleError, parallelize_module
from torch_tp.models import cnn
from torch_tp.testing import assert_trains_like, local_chunk, on_ranks, tp_mesh

F64 = dict(rtol=1e-7, atol=1e-9)  # float64: summation order only
CLASSIFIERS = ["resnet", "convnext", "efficientnet"]


def _mean_square(out, numel=None):
    """The mean of ``out`` squared; of a whole map of ``numel`` elements when ``out`` is a rank's
    strip of it (the strips' losses then sum to the whole map's)."""
    return out.pow(2).mean() if numel is None else out.pow(2).sum() / numel


def _is_plain(out, reference_out):
    assert not isinstance(out, DTensor)


def _train_like_one_process(reference, model, image, dim, *, spatial_output):
    strip = functools.partial(local_chunk, dim=dim)
    numel = image[:, :1].numel() * reference.out.out_channels if spatial_output else None  # the whole map's
    sgd = functools.partial(torch.optim.SGD, lr=0.05)
    batches = [(image, numel)] * 3  # one forward each per step: BN statistics
    # a map: each rank its strip (and its loss on it), compared with the reference's strip
    assert_trains_like(model, reference, batches, _mean_square, optimizer=sgd, **F64, module_inputs=strip,
                       expected_output=strip if spatial_output else None, check=_is_plain)
    buffers = dict(model.named_buffers())
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(buffers[name], buffer, **F64, msg=lambda m: f"{name}: {m}")
    model.eval(), reference.eval()
    want = reference(image)
    torch.testing.assert_close(model(local_chunk(image, dim)), local_chunk(want, dim) if spatial_output else want, **F64)


@on_ranks(2, 4)
@pytest.mark.parametrize("dim", [3, 2], ids=["width", "height"])
@pytest.mark.parametrize("name", CLASSIFIERS)
def test_a_classifier_trains_spatially_parallel_in_one_line(name, dim):
    torch.manual_seed(0)
    reference = getattr(cnn, name)(num_classes=5).double()
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), SpatialParallel(dim=dim))
    image = torch.randn(2, 3, 72, 88, dtype=torch.float64)  # uneven strips deeper in (88 / 4 / 2 = 11 over 4)
    _train_like_one_process(reference, model, image, dim, spatial_output=False)


@on_ranks(2, 4)
@pytest.mark.parametrize("transposed", [False, True], ids=["bilinear", "transposed_conv"])
def test_a_unet_returns_each_rank_its_strip_of_the_logits_and_trains_like_one_process(transposed):
    torch.manual_seed(0)
    reference = cnn.unet(width=4, transposed=transposed).double()
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), SpatialParallel(dim=3))
    image = torch.randn(1, 3, 16, 48, dtype=torch.float64)
    _train_like_one_process(reference, model, image, 3, spatial_output=True)


@on_ranks(2)
def test_until_ends_the_region_at_the_head_which_reads_whole_features():
    torch.manual_seed(0)
    reference = cnn.resnet(num_classes=5).double()
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), SpatialParallel(dim=3, until="head"))
    seen = []
    model.head.register_forward_pre_hook(lambda module, args: seen.append(args[0].placements))
    image = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    torch.testing.assert_close(model(local_chunk(image, 3)), reference(image), **F64)
    assert seen == [(Replicate(),)]


@on_ranks(2)
def test_output_layouts_replicate_returns_the_whole_map():
    torch.manual_seed(0)
    reference = cnn.unet(width=4).double()
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), SpatialParallel(dim=3, output_layouts=Replicate()))
    image = torch.randn(1, 3, 16, 32, dtype=torch.float64)
    torch.testing.assert_close(model(local_chunk(image, 3)), reference(image), **F64)


# name: (the model, the path its error names)
_REFUSED = {
    "dropout": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(nn.Dropout2d(0.1))), "'1.0' (Dropout2d)"),
    "circular": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular")), "'0' (Conv2d)"),
}


@pytest.mark.parametrize("name", list(_REFUSED))
def test_layers_whose_result_on_a_strip_would_differ_are_refused_naming_their_path(name):
    build, where = _REFUSED[name]
    model = build()
    with pytest.raises(UnsupportedModuleError, match=re.escape(f"SpatialParallel cannot run {where}")):
        SpatialParallel(dim=3).check(model, 4, "")


def _conv_bn_act():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), cnn.BatchNormAct2d(4), nn.Conv2d(4, 2, 3, padding=1))


@on_ranks(2)
def test_a_layer_with_its_own_forward_is_refused_with_advice_that_works():
    # timm's BatchNormAct2d in a layer-by-layer plan: the error advises the whole-model form, which trains
    torch.manual_seed(0)
    reference = _conv_bn_act().double()
    with pytest.raises(UnsupportedModuleError) as refused:
        parallelize_module(copy.deepcopy(reference), tp_mesh(), {"*": SpatialParallel(dim=3)})
    advice = "parallelize_module(model, mesh, SpatialParallel(dim=3))"
    assert "'1' (BatchNormAct2d)" in str(refused.value) and advice in str(refused.value), str(refused.value)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), SpatialParallel(dim=3))  # the advice
    image = torch.randn(2, 3, 6, 10, dtype=torch.float64)
    strip = functools.partial(local_chunk, dim=3)
    numel = 2 * 2 * 6 * 10  # the whole output map's: the strips' losses sum to the reference's
    assert_trains_like(model, reference, [(image, numel)] * 2, _mean_square, optimizer=functools.partial(
        torch.optim.SGD, lr=0.05), **F64, module_inputs=strip, expected_output=strip, check=_is_plain)


def test_until_must_name_a_submodule():
    with pytest.raises(ValueError, match=r"until='fc'.*no submodule has that path"):
        SpatialParallel(dim=3, until="fc").check(cnn.resnet(), 2, "")


@on_ranks(2)
@pytest.mark.parametrize("name", [*CLASSIFIERS, "unet"])
def test_verify_plan_passes_on_each_zoo_model(name):
    from torch_tp import verify_plan

    def build():
        return (cnn.unet(width=4) if name == "unet" else getattr(cnn, name)(num_classes=5)).double()

    style = SpatialParallel(dim=3, output_layouts=Replicate())  # whole outputs to compare
    report = verify_plan(
        build, tp_mesh(), style, lambda step: (torch.randn(2, 3, 32, 64, dtype=torch.float64),),
        loss_fn=lambda out: out.pow(2).mean(), steps=2, atol=1e-9, rtol=1e-7, raise_on_mismatch=False,
        shard_inputs=lambda args: (local_chunk(args[0], 3),),
    )
    assert report.ok, str(report)
