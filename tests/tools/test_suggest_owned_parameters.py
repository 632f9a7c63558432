"""``suggest_plan`` on a parameter owned by the module that holds split layers (issue 35): a learned
scale applied to the split heads in the holder's own forward. Before, the derived plan gave the
holder (or, for the model's own parameter, the parameter's name) ``ReplicateParallel``, and
``parallelize_module`` refused it ("placed by two plan entries", "names a parameter, not a
module"), so ``suggest_plan`` raised. Now the group stays whole with the reason, and the plan
trains like one process; the same scale in a module of its own is split around it."""

import copy
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tp import ColwiseParallel, ReplicateParallel, RowwiseParallel, parallelize_module, suggest_plan
from torch_tp.testing import assert_trains_like, on_ranks, tp_mesh

HEAD_DIM = 2


class _Scale(nn.Module):
    """A learned per-head-dim scale, applied by its own forward."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(HEAD_DIM) + 0.5)

    def forward(self, h):
        return h * self.weight


class _HeadScaled(nn.Module):
    """``up`` to 4 heads of 2, a learned scale on each head's dims, ``down``; ``own=True``: the
    scale is this module's parameter (next to the split layers), else a child module's."""

    def __init__(self, own: bool):
        super().__init__()
        self.up, self.down = nn.Linear(8, 4 * HEAD_DIM), nn.Linear(4 * HEAD_DIM, 8)
        if own:
            self.scale = nn.Parameter(torch.rand(HEAD_DIM) + 0.5)
        else:
            self.scaled = _Scale()

    def forward(self, x):
        h = self.up(x).unflatten(-1, (-1, HEAD_DIM))
        h = h * self.scale if hasattr(self, "scale") else self.scaled(h)
        return self.down(F.gelu(h).flatten(-2))


class _Residual(nn.Module):
    def __init__(self, own: bool):
        super().__init__()
        self.block = _HeadScaled(own)

    def forward(self, x):
        return x + self.block(x)


def _trains_like_one_process(model, plan):
    batches = [(torch.randn(2, 3, 8), None) for _ in range(2)]
    assert_trains_like(parallelize_module(copy.deepcopy(model), tp_mesh(), plan), model, batches,
                       lambda out, _: out.pow(2).mean(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                       rtol=1e-4, atol=1e-5, what=str(plan))


def _kept_whole_with_the_reason(model, prefix):
    plan = suggest_plan(model, tp_mesh(), (torch.randn(2, 3, 8),))
    holder = prefix.rstrip(".")
    assert f"{prefix}up" not in plan and f"{prefix}scale" not in plan and holder not in plan, str(plan)
    assert f"a parameter of {holder or 'the model'} itself ('{prefix}scale')" in plan.reasons[f"{prefix}up"], str(plan)
    _trains_like_one_process(model, plan)


@on_ranks(2, 4)
def test_a_scale_owned_by_the_block_holding_split_layers_keeps_them_whole_with_the_reason_and_trains_like_one_process():
    torch.manual_seed(0)
    _kept_whole_with_the_reason(_Residual(own=True), "block.")


@on_ranks(2)
def test_the_models_own_scale_beside_its_split_layers_keeps_them_whole_with_the_reason_and_trains_like_one_process():
    torch.manual_seed(0)
    _kept_whole_with_the_reason(_HeadScaled(own=True), "")


@on_ranks(2, 4)
def test_the_same_scale_in_a_module_of_its_own_is_replicated_with_the_layers_around_it_split():
    torch.manual_seed(0)
    model = _Residual(own=False)
    plan = suggest_plan(model, tp_mesh(), (torch.randn(2, 3, 8),))
    assert {name: type(style) for name, style in plan.items()} == {
        "block.up": ColwiseParallel, "block.down": RowwiseParallel, "block.scaled": ReplicateParallel}, str(plan)
    _trains_like_one_process(model, plan)
