"""The edges of a ``SpatialParallel`` model: in-place writes through views along the sharded dim,
reductions and scans along it (forward and backward), and normalizations a per-layer plan left out.

Every case runs at world sizes 2 and 4 on widths 12 (even), 10 (ws4: strips 3, 3, 3, 1) and 3
(ws4: a rank holding nothing), and either equals the single-process model, output and every
gradient, or raises a named torch_tp error on every rank. One spawned test per table, parametrized
over its cases.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate

from torch_tp import SpatialParallel, parallelize_module
from torch_tp.conv import UnsupportedSpatialOpError
from torch_tp.testing import TOL, assert_params_and_grads_match, local_chunk, on_ranks, tp_mesh

WIDTHS = (12, 10, 3)


class _Net(nn.Module):
    """A 1x1 convolution, then ``op`` on its (N, C, H, W) output, sharded on W in the region."""

    def __init__(self, op):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.op = op

    def forward(self, x):
        return self.op(self.conv(x) * 1.0)  # * 1.0: a non-leaf to write into


def _assert_region_matches_one_process(op, what):
    for width in WIDTHS:
        torch.manual_seed(0)
        image = torch.randn(1, 2, 4, width)
        reference = _Net(op)
        model = parallelize_module(copy.deepcopy(reference), tp_mesh(), SpatialParallel(dim=-1, output_layouts=Replicate()))
        out = model(local_chunk(image, 3))
        expected = reference(image)
        torch.testing.assert_close(out, expected, **TOL, msg=lambda m: f"{what} width {width}: {m}")
        dy = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
        (out * dy).sum().backward()
        (expected * dy).sum().backward()
        assert_params_and_grads_match(model, reference, **TOL, what=f"{what} width {width}")


# ------------------------------------------------------------------ writes through views of the width


def _zero_left(y):
    y[..., :2].zero_()  # masking an image border in place
    return y


def _narrow_mul(y):
    y.narrow(-1, 0, 2).mul_(0)
    return y


def _add_right(y):
    y[..., 3:].add_(1)
    return y


def _step_iadd(y):
    y[..., ::2] += 1
    return y


def _copy_column(y):
    y[..., 0] = y[..., 1]
    return y


def _set_plain_value(y):
    y[..., -1] = torch.tensor([2.0, 3.0]).view(1, 2, 1)
    return y


def _view_used_after_the_write(y):
    m = y[..., 1:4]
    m.mul_(2)
    return y + m.sum(-1, keepdim=True)


def _view_read_after_its_base_changed(y):
    m = y[..., :3]
    y.mul_(3)
    return m * 1.0


def _views_read_in_a_list_after_their_base_changed(y):
    left, right = y[..., :2], y[..., -2:]
    y.add_(1)
    return torch.cat([right, y, left], dim=-1)


def _view_of_a_view(y):
    y[:, :, 1:, 2:][..., ::3].zero_()
    return y


def _functional_inplace(y):
    F.relu(y[..., -4:], inplace=True)
    return y


def _out_of_place_slicing(y):
    columns = torch.stack(y.unbind(-1), dim=-1) + torch.stack(y.unbind(2), dim=2)  # width: gathered; height: local
    return torch.cat([y[..., 1:], y[..., :1] * 2], dim=-1) + y[..., ::2].sum(-1, keepdim=True) + columns


WRITES = {
    "zero_left": _zero_left, "narrow_mul": _narrow_mul, "add_right": _add_right, "step_iadd": _step_iadd,
    "copy_column": _copy_column, "set_plain_value": _set_plain_value, "view_used_after": _view_used_after_the_write,
    "view_read_after_base_changed": _view_read_after_its_base_changed,
    "views_in_a_list_after_base_changed": _views_read_in_a_list_after_their_base_changed, "view_of_a_view": _view_of_a_view,
    "functional_inplace": _functional_inplace, "out_of_place_slicing": _out_of_place_slicing,
}


@pytest.mark.parametrize("name", list(WRITES))
@on_ranks(2, 4)
def test_inplace_writes_through_slices_of_the_sharded_dim_equal_one_process(name):
    _assert_region_matches_one_process(WRITES[name], name)


def _out_argument(y):
    with torch.no_grad():  # (autograd refuses out= on tensors that need a gradient, as in one process)
        return torch.mul(y[..., :2], 0, out=y[..., :2])


# name: (what the region runs, what its error names)
REFUSED_WRITES = {
    "out_argument": (_out_argument, ("aten.mul.out", "aten.slice.Tensor", "sharded dim 3")),
    "through_unbind": (lambda y: y.unbind(-1)[0].zero_(), ("zero_", "aten.unbind.int", "sharded dim 3")),
    # flattening (H, W) keeps strided strips (_StridedShard): a slice of those is not carried back
    "through_flatten": (lambda y: y.flatten(2)[..., :3].zero_(), ("zero_", "aten.slice.Tensor", "sharded dim 2")),
}


@pytest.mark.parametrize("name", list(REFUSED_WRITES))
@on_ranks(2, 4)
def test_writes_it_cannot_carry_to_the_strips_are_refused_naming_the_op_and_dim(name):
    op, named = REFUSED_WRITES[name]
    model = parallelize_module(_Net(op), tp_mesh(), SpatialParallel(dim=-1, output_layouts=Replicate()))
    with pytest.raises(UnsupportedSpatialOpError) as err:
        model(local_chunk(torch.randn(1, 2, 4, 10), 3))
    message = str(err.value)
    assert message.startswith("torch_tp.conv: "), message
    for phrase in (*named, "'<root>' (_Net)", "torch.where"):
        assert phrase in message, message


# ------------------------------------------------------------------ reductions and scans of the width


def _positive(x):
    return x * 0.1 + 1


# most of them scale the input by the result (x * r), so the gradient reaching the reduction is a
# partial sum over the strips, as in squeeze-excite
REDUCTIONS = {
    "cumprod_width": lambda x: _positive(x).cumprod(-1), "cumprod_height": lambda x: torch.cumprod(_positive(x), 2),
    "cummax_width": lambda x: x.cummax(-1).values, "cummin_width": lambda x: torch.cummin(x, 3)[0],
    "prod_width": lambda x: _positive(x).prod(-1, keepdim=True) * x, "prod_height": lambda x: torch.prod(_positive(x), 2),
    "prod_all": lambda x: _positive(x).prod() * x,
    "std_mean_width": lambda x: torch.std_mean(x, -1, keepdim=True)[0] * x,
    "std_mean_spatial": lambda x: sum(torch.std_mean(x, (2, 3), keepdim=True)) * x,
    "std_width": lambda x: x.std(-1, keepdim=True) * x,
    "var_mean_width": lambda x: torch.var_mean(x, -1, keepdim=True)[0] * x,
    "norm3_width": lambda x: torch.linalg.vector_norm(x, 3, dim=-1, keepdim=True) * x,
    "norm3_all": lambda x: torch.linalg.vector_norm(x, 3) * x,
    "norm1_width": lambda x: torch.linalg.vector_norm(x, 1, dim=-1, keepdim=True) * x,
    "norm_inf_width": lambda x: torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True) * x,
    "norm_inf_all": lambda x: torch.linalg.vector_norm(x, float("inf")) * x,
    "norm_minus_inf_all": lambda x: torch.linalg.vector_norm(x, -float("inf")) + x,
    "norm_minus1_width": lambda x: torch.linalg.vector_norm(x, -1, dim=-1, keepdim=True) * x,
    "tensor_norm_p3": lambda x: x.norm(p=3, dim=-1, keepdim=True) * x,
    "normalize_p3": lambda x: F.normalize(x, p=3, dim=-1),
    "amax_width": lambda x: x.amax(-1, keepdim=True) * x, "amin_spatial": lambda x: x.amin((2, 3), keepdim=True) * x,
    "amax_all": lambda x: x.amax() * x, "amax_empty_dims": lambda x: x.amax(dim=[]) * x,
    "sum_empty_dims": lambda x: x.sum(dim=[]) * x, "mean_empty_dims": lambda x: x.mean(dim=[]) + x,
    "any_empty_dims": lambda x: x * x.gt(0.5).any(dim=[]),
    "max_width": lambda x: x.max(-1, keepdim=True).values * x, "min_all": lambda x: x.min() * x,
    "argmax_width": lambda x: x * x.argmax(-1, keepdim=True), "logsumexp_width": lambda x: x.logsumexp(-1, keepdim=True) * x,
    "any_width": lambda x: x * x.gt(0.5).any(-1, keepdim=True), "all_width": lambda x: x * x.gt(-0.5).all(-1, keepdim=True),
    "mean_spatial": lambda x: x.mean((2, 3), keepdim=True) * x, "cumsum_width": lambda x: x.cumsum(-1),
    "logcumsumexp_width": lambda x: x.logcumsumexp(-1),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
@on_ranks(2, 4)
def test_reductions_and_scans_along_the_sharded_dim_equal_one_process_forward_and_backward(name):
    _assert_region_matches_one_process(REDUCTIONS[name], name)


@on_ranks(2, 4)
def test_a_scan_whose_derivative_dtensor_cannot_run_is_refused_when_reached_indirectly():
    # torch_tp runs torch.cumprod / x.cumprod on the whole value; the aten op reached any other way
    # while a gradient is needed is refused by name, not left to fail in DTensor's backward
    model = parallelize_module(_Net(lambda x: torch.ops.aten.cumprod.default(x, 3)), tp_mesh(),
                               SpatialParallel(dim=-1, output_layouts=Replicate()))
    x = local_chunk(torch.randn(1, 2, 4, 10), 3)
    with pytest.raises(UnsupportedSpatialOpError, match=r"^torch_tp.conv: aten.cumprod.default .*'<root>' \(_Net\)"):
        model(x)
    with torch.no_grad():  # no derivative: DTensor's scan rule
        model(x)


# ------------------------------------------------------------------ normalizations a per-layer plan left out


class _ChannelsLastNorm(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.ln = nn.LayerNorm(4, **kwargs)

    def forward(self, x):
        return self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


# name: (the norm, its path in the model below, the plan entry its error asks for; None: it runs)
LEFT_OUT_NORMS = {
    "batch_norm": (lambda: nn.BatchNorm2d(4), "1.0", "1.0"),
    "batch_norm_eval": (lambda: nn.BatchNorm2d(4).eval(), "1.0", "1.0"),
    "group_norm": (lambda: nn.GroupNorm(2, 4), "1.0", "1.0"),
    "layer_norm": (lambda: nn.LayerNorm(10), "1.0", "1"),
    "instance_norm": (lambda: nn.InstanceNorm2d(4, affine=True), "1.0", "1"),
    "channels_last_layer_norm": (_ChannelsLastNorm, "1.0.ln", "1.0"),
    # over the channels only and without weights: DTensor's own rule runs it right on the strips
    "channels_last_without_weights": (lambda: _ChannelsLastNorm(elementwise_affine=False), "1.0.ln", None),
}


def _model_with(norm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Sequential(norm), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))


@pytest.mark.parametrize("name", list(LEFT_OUT_NORMS))
@on_ranks(2, 4)
def test_a_norm_left_out_of_a_per_layer_plan_is_refused_naming_it_and_the_entry_to_add(name):
    build, path, entry = LEFT_OUT_NORMS[name]
    plan = {"0": SpatialParallel(dim=3), "2": SpatialParallel(dim=3), "3": SpatialParallel(dim=3)}
    image = torch.randn(2, 3, 5, 10)
    if entry is not None:
        model = parallelize_module(_model_with(build()), tp_mesh(), plan)
        with pytest.raises(ValueError) as err:
            model(local_chunk(image, 3))
        message = str(err.value)
        assert message.startswith("torch_tp.conv.spatial: ") and f"'{path}' (" in message, message
        assert f"{entry!r}: SpatialParallel(dim=3)" in message, message
        plan = {**plan, entry: SpatialParallel(dim=3)}
    # the entry it asks for makes the model equal one process
    reference = _model_with(build())
    fixed = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    out = fixed(local_chunk(image, 3))
    expected = reference(image)
    torch.testing.assert_close(out.full_tensor(), expected, **TOL)
    out.full_tensor().square().mean().backward()
    expected.square().mean().backward()
    assert_params_and_grads_match(fixed, reference, **TOL, what=name)
