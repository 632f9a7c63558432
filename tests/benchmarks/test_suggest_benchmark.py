"""Smoke test of ``benchmarks/suggest_plan.py --quick``: every model's derived plan splits most of
its bytes, covers the shipped plan's layers with the same styles, and is timed beside the
replicated model. Times are machine noise here and are not asserted."""

import pytest

from torch_tp.testing import ScriptRun, markdown_tables

# a subprocess run of seconds: `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

COLUMNS = ["model", "plan", "bytes split", "derive ms", "step ms", "vs replicated", "same layers"]
QUICK = ScriptRun("benchmarks/suggest_plan.py", "--quick")


@pytest.mark.script_runs(QUICK)
def test_quick_suggest_plan_benchmark_reports_coverage_and_step_time_per_plan():
    out = QUICK.result().stdout
    rows = markdown_tables(out)[0]
    assert rows[0]["__header__"] == COLUMNS, out
    plans = {(row["model"], row["plan"]): row for row in rows}
    models = ["zoo Llama", "zoo MLP-Mixer", "transformers BERT", "transformers Qwen3"]  # --quick's four
    assert {model for model, _ in plans} == set(models), out
    for model in models:
        derived = plans[model, "derived"]
        assert float(derived["bytes split"].rstrip("%")) > 50, out
        assert float(derived["step ms"]) > 0 and float(derived["derive ms"]) > 0, out
        assert plans[model, "replicated"]["bytes split"] == "0.0%", out
    for model in ("zoo Llama", "transformers Qwen3"):  # the ones that ship a plan
        assert plans[model, "shipped"]["same layers"].startswith("yes ("), out
        assert int(plans[model, "shipped"]["same layers"].split("(")[1].split()[0]) >= 14, out
