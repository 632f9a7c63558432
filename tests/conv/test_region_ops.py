"""The allowlist of a spatial region, tested against the mechanism rather than its examples.

A table of ops runs along (and across) the sharded width inside a ``SpatialParallel`` region:
each one either equals one process or raises ``UnsupportedSpatialOpError`` naming the op and the
region, on every rank; none gives a different answer. Random ops are refused in training (each
rank would draw its own strip's numbers) and run in eval, where they are the identity.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate

from torch_tp import SpatialParallel, parallelize_module
from torch_tp.conv import UnsupportedSpatialOpError, _registry
from torch_tp.conv._region_ops import allowed_reason
from torch_tp.testing import TOL, local_chunk, on_ranks, tp_mesh

# name -> what the region runs after its 1x1 convolution, on an (N, C, H, W) map sharded on W
OPS = {
    "cumsum_negative_dim": lambda x: x.cumsum(-1),
    "cumsum_dim_3": lambda x: x.cumsum(3),
    "cumsum_height": lambda x: x.cumsum(-2),
    "cumprod_negative_dim": lambda x: (x * 0.1 + 1).cumprod(-1),
    "sum_width": lambda x: x.sum(-1, keepdim=True),
    "amax_width": lambda x: x.amax(dim=-1, keepdim=True),
    "max_width": lambda x: x.max(-1, keepdim=True).values,
    "var_width": lambda x: x.var(-1, keepdim=True),
    "elementwise": lambda x: torch.sigmoid(x) * 2 + x.relu(),
    "transpose": lambda x: x.transpose(-1, -2).contiguous(),
    "cat_width": lambda x: torch.cat([x, x * 2], dim=-1),
    "stack_last": lambda x: torch.stack([x, x], dim=-1).sum(-1),
    "slice_step": lambda x: x[..., ::2],
    "matmul_over_width": lambda x: x @ x.transpose(-1, -2),  # contracts the sharded width
    "flip_width": lambda x: x.flip(-1),
    "roll_width": lambda x: x.roll(1, -1),
    "sort_width": lambda x: x.sort(-1).values,
    "softmax_width": lambda x: x.softmax(-1),
    "dropout": lambda x: F.dropout(x, 0.5, training=True),
    "rand_like": lambda x: x + torch.rand_like(x),
}
REFUSED = {"flip_width", "roll_width", "sort_width", "softmax_width", "dropout", "rand_like"}


class _OpNet(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.op = op

    def forward(self, x):
        return self.op(self.conv(x))


@on_ranks(2, 4)
def test_every_op_along_the_sharded_width_equals_one_process_or_is_refused_by_name():
    image = torch.randn(1, 2, 4, 12)
    outcomes = {}
    for name, op in OPS.items():
        reference = _OpNet(op)
        model = parallelize_module(copy.deepcopy(reference), tp_mesh(), SpatialParallel(dim=-1, output_layouts=Replicate()))
        try:
            out = model(local_chunk(image, 3))
        except UnsupportedSpatialOpError as error:
            assert "'<root>' (_OpNet)" in str(error) and "aten." in str(error), str(error)
            outcomes[name] = "refused"
        else:
            torch.testing.assert_close(out, reference(image), **TOL, msg=lambda m, name=name: f"{name}: {m}")
            outcomes[name] = "equal"
        assert not _registry.scope_active()  # a refusal leaves the scope and the guard
    assert {name for name, outcome in outcomes.items() if outcome == "refused"} == REFUSED, outcomes
    assert torch.ones(3).cumsum(-1).flip(-1).tolist() == [3.0, 2.0, 1.0]  # outside the region: no guard


@on_ranks(2, 4)
def test_dropout_is_refused_in_training_after_eval_and_runs_as_the_identity_in_eval():
    # parallelized in eval (where dropout is the identity), then switched to train: refused at
    # forward time, not silently drawing a mask per strip
    reference = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.Dropout(0.5)).eval()
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), SpatialParallel(dim=-1, output_layouts=Replicate()))
    image = torch.randn(1, 2, 5, 8)
    torch.testing.assert_close(model(local_chunk(image, 3)), reference(image), **TOL)
    model.train()
    with pytest.raises(UnsupportedSpatialOpError, match="random op aten.*Sequential.*eval"):
        model(local_chunk(image, 3))


def test_the_allowlist_names_its_reason_and_refuses_what_it_cannot_prove():
    aten = torch.ops.aten
    assert allowed_reason(aten.cumsum.default) == "scan"
    assert allowed_reason(aten.mul.Tensor) == "elementwise"
    assert allowed_reason(aten.addmm.default) == "matmul"
    assert allowed_reason(aten.native_dropout.default) is None  # random: never on strips
    assert allowed_reason(aten.flip.default) is None
