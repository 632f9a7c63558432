"""What the two plan fuzzers share (``test_fuzz_plans.py``, ``test_fuzz_suggest.py``): the
tolerances against one process, the output's non-finite values as NaN, what counts as a refusal
by name, and running one case on its ranks."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn as nn

from torch_tp.testing import RankFailure, run_on_ranks

#: against one process in the same dtype; bfloat16's: the split sums round at the output's scale
#: (2**-8 of it), grown by two SGD steps (test_fuzz_suggest.py's docstring says why not float64)
TOLERANCE = {"float32": dict(rtol=1e-4, atol=1e-5), "float64": dict(rtol=1e-10, atol=1e-10),
             "bfloat16": dict(rtol=2e-2, atol=2e-2)}


class NonFiniteAsNaN(nn.Module):
    """Every NaN and +-inf of the output as NaN. CPU kernels disagree with themselves on which
    non-finite value they give (``gelu(inf)`` is NaN on a vector of 2, inf on one element), and a
    rank's piece has another length than the whole: "non-finite where one process is" is the claim."""

    def forward(self, x):
        return x.masked_fill(~torch.isfinite(x), float("nan"))


def named_refusal(error: Exception, *, also: tuple[str, ...] = ()) -> bool:
    """A refusal by name: ``ValueError`` / ``TypeError`` / ``NotImplementedError`` (or a type
    named in ``also``) whose message names a torch_tp style or module."""
    message = str(error)
    kinds = (ValueError, TypeError, NotImplementedError)
    return (isinstance(error, kinds) or type(error).__name__ in also) and ("Parallel" in message or "torch_tp" in message)


def outcomes_on_ranks(train_case: Callable, case, *, timeout: float) -> list[str]:
    """``train_case(case)`` on ``case.world`` ranks: every rank's outcome, asserted the same."""
    try:
        outcomes = run_on_ranks(train_case, case.world, case, timeout=timeout)
    except RankFailure as failure:
        pytest.fail(f"{case}: {failure}")
    assert len(set(outcomes)) == 1, f"{case}: the ranks ended differently: {outcomes}"
    return outcomes
