"""The transformers tutorial runs as users run it: explains, trains like one process, verifies, generates."""

import importlib.util
import re

import pytest

from torch_tp.testing import ScriptRun, run_script

# a subprocess run of seconds: `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers (the test extra)"
)


TUTORIAL = ScriptRun("tutorials/transformers_tensor_parallel.py")
# the tutorial where transformers is not installed: None in sys.modules makes its import fail
WITHOUT_TRANSFORMERS = (
    "-c",
    "import runpy, sys; sys.modules['transformers'] = None; "
    "runpy.run_path('tutorials/transformers_tensor_parallel.py', run_name='__main__')",
)


def test_without_transformers_the_tutorial_says_how_to_install_it_and_exits_1():
    result = run_script(*WITHOUT_TRANSFORMERS, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "tutorials/transformers_tensor_parallel.py needs the transformers package (import of transformers halted; "
        "None in sys.modules); install torch_tp's transformers extra from the checkout: "
        'pip install -e ".[transformers]"'
    ), result.stderr


@needs_transformers
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
    verdict = re.fullmatch(
        r"matches one process \(loss per step: largest difference (\S+), tolerance 0\.0001; verify_plan findings: "
        r"largest difference 0\.0e\+00, tolerance exact; greedy tokens: largest difference 0\.0e\+00, tolerance exact\)",
        out.rstrip().splitlines()[-1],
    )
    assert verdict and float(verdict.group(1)) <= 1e-4, out
