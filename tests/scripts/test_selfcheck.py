"""``python -m torch_tp.selfcheck``: its wiring, in process and cheap (its checks' parts are tested
where they live: ``tests/quant/test_w8a8.py`` the decode timings, ``tests/parallel/test_fake_world.py``
the fake 8-rank world, ``tests/overlap/test_overlap_compile.py`` the compiled TP + SP Llama).

A check that raises is a failed row naming the error and the next check still runs; the test
suite's output is read into counts, skip reasons without their numbers, and failed ids, also when
it was stopped at the time limit; bad arguments are refused by name.
"""

import pytest
import torch

from torch_tp import selfcheck

PYTEST_OUTPUT = """\
..s.F.ss                                                                 [ 50%]
........                                                                 [100%]
=========================== short test summary info ============================
SKIPPED [2] tests/parallel/test_styles.py:40: world size 2 needs 2 GPUs; TORCH_TP_TEST_DEVICE=cuda sees 1
SKIPPED [1] tests/parallel/test_llama.py:10: world size 4 needs 4 GPUs; TORCH_TP_TEST_DEVICE=cuda sees 1
FAILED tests/quant/test_w8a8.py::test_something - AssertionError
12 passed, 3 skipped, 1 failed in 9.50s
"""


def test_the_suites_output_becomes_counts_reasons_without_numbers_and_failed_ids():
    rows = selfcheck._test_outcomes(PYTEST_OUTPUT, timed_out=False)
    assert rows[:3] == [{"outcome": "passed", "tests": 12}, {"outcome": "skipped", "tests": 3}, {"outcome": "failed", "tests": 1}]
    assert {"outcome": "skipped: world size N needs N GPUs; TORCH_TP_TEST_DEVICE=cuda sees N", "tests": 3} in rows
    assert rows[-1] == {"outcome": "failed: tests/quant/test_w8a8.py::test_something", "tests": 1}


def test_a_suite_stopped_at_the_time_limit_is_counted_from_its_progress_marks():
    stopped = PYTEST_OUTPUT.split("=====")[0]
    rows = selfcheck._test_outcomes(stopped, timed_out=True)
    assert rows == [{"outcome": "passed (so far)", "tests": 12}, {"outcome": "skipped (so far)", "tests": 3},
                    {"outcome": "failed (so far)", "tests": 1}, {"outcome": "errors (so far)", "tests": 0}]


def test_a_check_that_raises_is_a_failed_row_naming_the_error_and_the_next_still_runs(monkeypatch, capsys):
    def broken(run):
        raise KeyError("no such op on this device")

    def fine(run):
        return selfcheck.CheckResult("fine", True, f"ran on {run.device}", [{"a": 1}])

    monkeypatch.setattr(selfcheck, "CHECKS", {"broken": broken, "fine": fine})
    results = selfcheck.run_checks("cpu", ["broken", "fine"], quick=True)
    assert [(r.name, r.ok) for r in results] == [("broken", False), ("fine", True)]
    assert results[0].summary == "raised KeyError: 'no such op on this device'"
    assert any("no such op" in row["traceback"] for row in results[0].rows)
    printed = capsys.readouterr().out
    assert "## broken: FAILED" in printed and "| a |" in printed and "## fine: ok" in printed


def test_main_prints_a_summary_writes_json_and_exits_nonzero_when_a_check_failed(monkeypatch, tmp_path, capsys):
    import json

    monkeypatch.setattr(selfcheck, "CHECKS", {
        "fine": lambda run: selfcheck.CheckResult("fine", True, "ok"),
        "bad": lambda run: selfcheck.CheckResult("bad", False, "held 8 B, predicted 4 B"),
    })
    assert selfcheck.main(["--device", "cpu", "--only", "fine", "--out", str(tmp_path)]) == 0
    assert selfcheck.main(["--device", "cpu", "--only", "fine,bad", "--out", str(tmp_path)]) == 1
    saved = json.loads((tmp_path / "selfcheck.json").read_text())
    assert [(r["name"], r["ok"]) for r in saved["results"]] == [("fine", True), ("bad", False)]
    assert "| bad | FAILED |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["--only", "decode,nonsense"], "unknown checks ['nonsense']"),
    (["--device", "cuda"], "torch.cuda.is_available() is False"),
])
def test_bad_arguments_are_refused_by_name(argv, says, capsys):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit):
        selfcheck.main(argv)
    assert says in capsys.readouterr().err
