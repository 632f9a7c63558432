"""The derive-verify-train tutorial runs as users run it: a plan from the dataflow (the fused
projection split part by part), verified, then trained beside one process."""

import re

import pytest

from torch_tp.testing import ScriptRun

# a subprocess run of seconds: `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

TUTORIAL = ScriptRun("tutorials/derive_plan.py")


@pytest.mark.script_runs(TUTORIAL)
def test_derive_tutorial_derives_verifies_and_trains_like_one_process():
    out = TUTORIAL.result().stdout
    plan, rest = re.split(r"^== .*$", out, flags=re.M)[1:]  # the plan; the report, then the training
    for block in (0, 1):
        assert re.search(rf"^blocks\.{block}\.mix +ColwiseParallel +its output features \(a fused projection of 3 parts", plan, re.M)
        for name, style in (("fold", "RowwiseParallel"), ("widen", "ColwiseParallel"), ("narrow", "RowwiseParallel")):
            assert re.search(rf"^blocks\.{block}\.{name} +{style} ", plan, re.M), plan
    assert "getitem" not in plan
    assert re.search(r"^embed +RowwiseParallel +vocabulary-parallel", plan, re.M)
    assert re.search(r"^9\d\.\d% of the parameter bytes split$", plan, re.M)
    assert rest.strip().startswith("verify_plan: OK, the parallel model trains like the single-process one (2 steps on 2 ranks")
    losses = re.findall(r"^step \d: loss ([\d.]+) \(one process: ([\d.]+)\)$", rest, re.M)
    assert len(losses) == 5 and all(abs(float(a) - float(b)) < 1e-5 for a, b in losses), rest
    assert "trains like one process: largest loss difference" in rest
    verdict = re.fullmatch(r"matches one process \(loss per step: largest difference (\S+), tolerance 1e-05\)",
                           out.rstrip().splitlines()[-1])  # the last line, and the only verdict
    assert verdict and float(verdict.group(1)) < 1e-5 and len(re.findall("match(es)? one process", out)) == 1, out
