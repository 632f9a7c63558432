"""The verify_plan tutorial runs as users run it: a correct plan passes, two wrong ones are named."""

import re

import pytest

from torch_tp.testing import ScriptRun

# a subprocess run of seconds: `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow


TUTORIAL = ScriptRun("tutorials/verify_plan.py")


@pytest.mark.script_runs(TUTORIAL)
def test_verify_plan_tutorial_passes_the_right_plan_and_names_what_the_wrong_ones_break():
    out = TUTORIAL.result().stdout
    right, no_norms, untied = re.split(r"^== .*$", out, flags=re.M)[1:]
    assert right.strip().startswith("verify_plan: OK, the parallel model trains like the single-process one (3 steps on 2 ranks")
    assert no_norms.strip().startswith("verify_plan: 13 findings")  # 12 in training, 1 in eval mode
    for layer in (0, 1):
        for norm in ("q_norm", "k_norm"):
            assert re.search(rf"step 0  gradient differs across ranks +layers\.{layer}\.attention\.{norm}\.weight", no_norms)
    assert "ReplicateParallel(input_layouts=Shard(2))" in no_norms
    assert re.search(r"model +tie broken +output\.weight .* is tok_embeddings\.weight in the single-process model", untied)
    assert re.search(r"step 0 +gradient +output\.weight", untied)
    assert out.rstrip().splitlines()[-1] == (  # the right plan has no finding; each wrong one has some
        "matches one process (verify_plan findings for torch_tp's plan: largest difference 0.0e+00, tolerance exact; "
        "wrong plans verify_plan let through: largest difference 0.0e+00, tolerance exact)"
    ), out
    assert out.count("match one process") + out.count("matches one process") == 1, out
