"""Smoke tests of ``benchmarks/transformers_tp.py --quick``: torch_tp vs transformers' own TP.

Times are machine noise here and are not asserted; collective counts and bytes are exact,
and both libraries must match the single-process model (the script fails if torch_tp does
not; transformers' differences are printed and checked here).
"""

import os
from pathlib import Path

import pytest

from torch_tp.testing import ScriptRun, markdown_tables

# subprocess runs of seconds to minutes: `pytest -m "not slow"` leaves them out
pytestmark = pytest.mark.slow

COLUMNS = [
    "world", "model", "variant", "fwd comms", "fwd KiB", "f+b comms", "f+b KiB", "opt comms", "param KiB",
    "logits max Δ", "grads max Δ", "step ms", "p25-p75", "CPU ms",
]
RATIO_COLUMNS = ["world", "model", "step ms ratio", "CPU ms ratio", "torch_tp comms", "transformers comms"]

# Per step at 2 ranks, for both models (2 layers). Forward: the vocab-parallel embedding's
# all-reduce, one all-reduce after o_proj and one after down_proj per layer, the logits'
# all-gather: 5AR + 1AG, 320 KiB of (2, 64, 128) float32 activations + 64 KiB of local
# logits. Backward: torch_tp's plan gives each attention and MLP module one input DTensor,
# so q/k/v share one input-gradient all-reduce and gate/up another (4), plus lm_head's (1);
# transformers converts each projection's input on its own: q, k, v, gate, up (10) + lm_head.
# Qwen3's q_norm/k_norm gradients: transformers all-reduces them in the backward (4 more,
# 16 floats each); torch_tp leaves them Partial, so AdamW reduces them (3 reads each, 12).
EXPECTED = {
    # (model, variant): (fwd comms, fwd KiB, f+b comms, f+b KiB, opt comms)
    ("llama", "torch_tp"): ("1AG+5AR", "384.0", "1AG+10AR", "704.0", "0"),
    ("llama", "transformers"): ("1AG+5AR", "384.0", "1AG+16AR", "1088.0", "0"),
    ("qwen3", "torch_tp"): ("1AG+5AR", "384.0", "1AG+14AR", "704.2", "0"),
    ("qwen3", "transformers"): ("1AG+5AR", "384.0", "1AG+20AR", "1088.2", "0"),
}
COUNT_COLUMNS = ("fwd comms", "fwd KiB", "f+b comms", "f+b KiB", "opt comms")


# its sitecustomize.py makes transformers' process group check fail in every process of the run
NO_TRANSFORMERS_TP = Path(__file__).with_name("no_transformers_tp")
QUICK_UNDER_TORCHRUN = ScriptRun("-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "benchmarks/transformers_tp.py", "--quick")
QUICK_WITHOUT_TRANSFORMERS_TP = ScriptRun(
    "benchmarks/transformers_tp.py", "--quick", "--world-sizes", "2", "--models", "llama",
    env={"PYTHONPATH": os.pathsep.join(filter(None, [str(NO_TRANSFORMERS_TP), os.environ.get("PYTHONPATH")]))},
)


def _check_rows(out: str, models: tuple[str, ...]) -> list[dict[str, str]]:
    """The main table holds every (model, variant) at 2 ranks with the exact counts; returns it."""
    main = markdown_tables(out)[0]
    assert main[0]["__header__"] == COLUMNS, out
    assert [(int(r["world"]), r["model"], r["variant"]) for r in main] == [
        (2, model, variant) for model in models for variant in ("torch_tp", "transformers")
    ], out
    for row in main:
        key = (row["model"], row["variant"])
        assert tuple(row[c] for c in COUNT_COLUMNS) == EXPECTED[key], (key, out)
        assert float(row["logits max Δ"]) <= 1e-5 and float(row["grads max Δ"]) <= 1e-5, (key, out)
        assert float(row["step ms"]) > 0 and float(row["CPU ms"]) > 0, (key, out)
    for model in models:  # same parameters held per rank
        assert len({r["param KiB"] for r in main if r["model"] == model}) == 1, out
    assert "could not run" not in out and "differs from" not in out, out
    return main


@pytest.mark.script_runs(QUICK_UNDER_TORCHRUN)
def test_quick_benchmark_under_torchrun_both_libraries_match_one_process_and_torch_tp_issues_fewer_collectives():
    # `torchrun` is `python -m torch.distributed.run`: transformers' TP takes the process group
    # the benchmark initialized (gloo on CPU) there as in spawned ranks (the test below runs
    # the spawned ranks). One run checks the launcher's ranks and both models' counts.
    out = QUICK_UNDER_TORCHRUN.result().stdout
    _check_rows(out, ("llama", "qwen3"))
    ratios = markdown_tables(out)[1]
    assert ratios[0]["__header__"] == RATIO_COLUMNS, out
    assert [(int(r["world"]), r["model"]) for r in ratios] == [(2, "llama"), (2, "qwen3")], out
    for row in ratios:
        assert float(row["step ms ratio"]) > 0 and float(row["CPU ms ratio"]) > 0, out
        ours, theirs = EXPECTED[(row["model"], "torch_tp")], EXPECTED[(row["model"], "transformers")]
        assert row["torch_tp comms"] == f"{ours[2]} / {ours[4]}", out
        assert row["transformers comms"] == f"{theirs[2]} / {theirs[4]}", out


@pytest.mark.script_runs(QUICK_WITHOUT_TRANSFORMERS_TP)
def test_quick_benchmark_says_why_when_transformers_tp_cannot_run():
    out = QUICK_WITHOUT_TRANSFORMERS_TP.result().stdout
    tables = markdown_tables(out)
    assert len(tables) == 1, out  # no ratio table without transformers' numbers
    assert [(r["model"], r["variant"]) for r in tables[0]] == [("llama", "torch_tp")], out
    assert tuple(tables[0][0][c] for c in COUNT_COLUMNS) == EXPECTED[("llama", "torch_tp")], out
    assert (
        "world 2, llama: transformers' TP could not run here: rank 0: OSError: injected by the test: "
        "no process group for transformers (last transformers frame: transformers/distributed/utils.py:"
    ) in out, out
