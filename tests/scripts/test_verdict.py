"""The verdict line a tutorial ends with (``torch_tp._verdict``): what it says when the parallel
values match one process and when they do not, the exit status 1 on a mismatch, and the switch
that breaks the comparison on purpose (``TORCH_TP_BREAK_VERDICT=1``), in-process and once
through a real tutorial run. Each tutorial's own verdict line: ``tests/scripts/test_tutorials.py``
and the other tutorial tests beside it."""

import pytest
import torch

from torch_tp._verdict import BREAK_VERDICT_ENV, check, compare, conclude, verdict_line
from torch_tp.testing import run_script


@pytest.fixture(autouse=True)
def _unbroken(monkeypatch):
    monkeypatch.delenv(BREAK_VERDICT_ENV, raising=False)


def test_values_within_tolerance_match_and_the_line_states_difference_and_tolerance():
    checks = [compare("loss per step", [4.0, 3.0], [4.0, 3.00001], rtol=1e-5, index_name="step"),
              check("findings", 0, 0)]
    assert all(c.ok for c in checks)
    assert verdict_line(checks) == (
        "matches one process (loss per step: largest difference 1.0e-05, tolerance 1e-05 relative; "
        "findings: largest difference 0.0e+00, tolerance exact)"
    )


def test_a_mismatch_names_what_differs_by_how_much_and_where():
    checks = [compare("loss per step", [4.0, 3.5, 2.0], [4.0, 3.0, 2.0], atol=1e-4, index_name="step"),
              compare("logits", torch.ones(2, 3), torch.ones(2, 3)), check("findings", 2, 0)]
    assert [c.ok for c in checks] == [False, True, False]
    assert verdict_line(checks) == (
        "DOES NOT match one process: loss per step differs by 5.0e-01 (at step 1; tolerance 0.0001); "
        "findings differs by 2.0e+00 (tolerance exact)"
    )
    where = compare("logits", torch.zeros(2, 3), torch.tensor([[0.0, 0, 0], [0, 1e-3, 0]]), rtol=1e-5, atol=1e-5).where
    assert where == "at index (1, 1)"


def test_conclude_prints_the_line_and_exits_1_on_a_mismatch_only(capsys):
    assert conclude([check("error", 1e-7, 1e-5)]).startswith("matches one process")
    with pytest.raises(SystemExit) as exited:
        conclude([check("error", 1e-3, 1e-5)])
    assert exited.value.code == 1
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("matches one process (error:")
    assert printed[1] == "DOES NOT match one process: error differs by 1.0e-03 (tolerance 1e-05)"


def test_values_of_other_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"torch_tp._verdict.compare\('loss'\): parallel values of shape \(3,\) "
                                         r"against single-process ones of shape \(2,\)"):
        compare("loss", [1.0, 2.0, 3.0], [1.0, 2.0])


def test_the_break_switch_fails_every_comparison_whatever_its_tolerance(monkeypatch):
    monkeypatch.setenv(BREAK_VERDICT_ENV, "1")
    checks = [compare("same", [1.0, -2.0], [1.0, -2.0], rtol=0.5, atol=0.5), check("exact", 0, 0),
              check("loose", 0.0, 10.0)]
    assert not any(c.ok for c in checks)
    assert verdict_line(checks).startswith("DOES NOT match one process: same differs by ")
    assert verdict_line(checks).endswith(f"[{BREAK_VERDICT_ENV}=1: broken on purpose]")


@pytest.mark.slow
def test_a_tutorial_whose_comparison_is_broken_prints_does_not_match_and_exits_non_zero():
    result = run_script("tutorials/pattern_plans.py", env={BREAK_VERDICT_ENV: "1"}, check=False)
    assert result.returncode == 1, (result.stdout, result.stderr[-3000:])
    last = result.stdout.rstrip().splitlines()[-1]
    assert last.startswith("DOES NOT match one process: outputs differs by 1.0e+00 (at index (") and last.endswith(
        f"tolerance 1e-05) [{BREAK_VERDICT_ENV}=1: broken on purpose]"), result.stdout
    assert "matches one process" not in result.stdout
