"""The transformers tutorial runs as users run it: explains, trains like one process, verifies, generates."""

import importlib.util
import re

import pytest

from torch_tp.testing import ScriptRun

# a subprocess run of seconds: `pytest -m "not slow"` leaves it out
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (the test extra)"),
]


TUTORIAL = ScriptRun("tutorials/transformers_tensor_parallel.py")


@pytest.mark.script_runs(TUTORIAL)
def test_transformers_tutorial_trains_like_one_process_passes_verify_plan_and_generates_its_tokens():
    out = TUTORIAL.result().stdout
    # explain_plan of the translated Qwen3 plan, per-head norms included
    assert re.search(r"^model\.layers\.0\.self_attn\.q_norm\.weight +ReplicateParallel", out, flags=re.M), out
    assert re.search(r"^lm_head\.weight +ColwiseParallel +\(128, 64\) +Shard\(0\) +\(64, 64\) x2", out, flags=re.M), out
    # vocab-parallel cross_entropy vs F.cross_entropy, label smoothing 0.1, every AdamW step
    pairs = [tuple(map(float, p)) for p in re.findall(r"^step \d: loss (\S+) \(single process (\S+)\)$", out, flags=re.M)]
    assert len(pairs) == 5, out
    for parallel, single in pairs:
        assert abs(parallel - single) <= 1e-4, out
    assert pairs[-1][1] < pairs[0][1], out  # it learns
    assert re.search(
        r"^verify_plan: OK, the parallel model trains like the single-process one \(2 steps on 2 ranks", out, flags=re.M
    ), out
    ours, theirs = re.search(r"^greedy tokens: (\[[\d, ]+\]) \(single process (\[[\d, ]+\])\)$", out, flags=re.M).groups()
    assert ours == theirs and len(ours.split(",")) == 5 + 8, out
