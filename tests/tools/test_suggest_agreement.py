"""``suggest_plan`` ends alike on every rank, whatever values the ranks hold: one plan, or one
named error (the same class and message), never a rank that returns while another probes on.

Each test gathers every rank's outcome in the parent (:func:`run_on_ranks`) and compares them.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torch_tp.testing import rank, run_on_ranks, tp_mesh, world_sizes


class _Mlp(nn.Module):
    """Every parameter split (no layer kept whole): with different weights on the ranks, rank 0's
    probe matched (the split weights are rank 0's) and rank 1's did not, so rank 1 started a
    second ``parallelize_module`` that rank 0 never joined (a hang)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class _ReadsTheRank(_Mlp):
    """The same parameters and inputs on every rank, but code that reads the rank: rank 1's
    parallelized copy adds an offset, so only rank 1's probe fails."""

    def forward(self, x):
        out = super().forward(x)
        return out + 1 if dist.get_rank() == 1 and isinstance(self.down.weight, DTensor) else out


def _outcome(build_seed, input_seed, model_type=_Mlp):
    """This rank's end of ``suggest_plan``: ``("plan", styles)`` or ``("error", class, message)``."""
    from torch_tp.tools.suggest import suggest_plan

    torch.manual_seed(build_seed)
    model = model_type()
    torch.manual_seed(input_seed)
    example = torch.randn(2, 8, 16)
    try:
        plan = suggest_plan(model, tp_mesh(), (example,))
    except Exception as error:  # noqa: BLE001 - the outcome is what the test compares
        return ("error", type(error).__name__, str(error))
    return ("plan", {name: repr(style) for name, style in plan.items()}, plan.modes)


def _every_case():
    """One task for the pool: each case's outcome on this rank."""
    return {
        "same values": _outcome(0, 0),
        "unseeded models": _outcome(1000 + rank(), 0),  # each rank its own random init
        "unseeded inputs": _outcome(0, 1000 + rank()),
        "code that reads the rank": _outcome(0, 0, _ReadsTheRank),
    }


@world_sizes(2, 4)
def test_ranks_holding_different_values_end_with_one_plan_or_one_named_error_on_every_rank(world_size):
    outcomes = run_on_ranks(_every_case, world_size, timeout=90)  # before: a hang, then the timeout
    for case in outcomes[0]:
        ends = [by_rank[case] for by_rank in outcomes]
        assert all(end == ends[0] for end in ends), (case, ends)
    by_case = outcomes[0]
    kind, styles, modes = by_case["same values"]
    assert kind == "plan" and {n: s.split("(")[0] for n, s in styles.items()} == {
        "up": "ColwiseParallel", "down": "RowwiseParallel"} and modes == ("train", "eval"), by_case
    prefix = "torch_tp.suggest_plan: the ranks' "
    for case, held in (("unseeded models", "models hold 'up.weight' as ["), ("unseeded inputs", "example inputs hold [0] as [")):
        kind, name, message = by_case[case]
        assert (kind, name) == ("error", "RanksDisagreeError") and message.startswith(prefix + held), (case, message)
        assert ("torch.manual_seed" in message) and ("broadcast" in message), message
    kind, name, message = by_case["code that reads the rank"]
    assert (kind, name) == ("error", "RanksDisagreeError"), by_case
    assert message.startswith(prefix + "probes of the candidate plan on local slices ended [matched"), message
    assert "its outputs differ from the model's" in message and "code that reads the rank" in message, message
