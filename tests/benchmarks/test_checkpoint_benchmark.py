"""Smoke test of ``benchmarks/checkpoint.py --quick``: the step with and without saves, the save's
cost and the checkpoint's size. Times are machine noise here and are not asserted."""

import pytest

from torch_tp.testing import ScriptRun, markdown_tables

# a subprocess run of seconds: `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

COLUMNS = ["step ms", "save ms", "checkpoint KiB", "per step ms (no saves)", "per step ms (saves)", "overhead"]
QUICK = ScriptRun("benchmarks/checkpoint.py", "--quick")


@pytest.mark.script_runs(QUICK)
def test_quick_checkpoint_benchmark_prints_the_cost_of_saving():
    out = QUICK.result().stdout
    (row,) = markdown_tables(out)[0]
    assert row["__header__"] == COLUMNS, out
    assert "2 ranks" in out and "10 steps, a checkpoint every 5" in out, out
    assert all(float(row[c]) > 0 for c in COLUMNS[:5]), out
    # every rank's shards of the model and AdamW's two moments: ~3x the parameters' float32 bytes
    assert 1000 < float(row["checkpoint KiB"]) < 2000, out
    assert row["overhead"].endswith("%"), out
