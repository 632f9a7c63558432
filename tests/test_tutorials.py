"""The tutorials and the main job run as users run them, and print what they promise."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*argv, timeout=240):
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )
    assert done.returncode == 0, f"{argv} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_pattern_plans_tutorial_matches_single_process_and_shows_the_typo_error():
    out = _run("tutorials/pattern_plans.py")
    assert "typo in a plan key -> ValueError" in out and "layer.0.self.query" in out
    assert "layer.0.self.out.weight      (Shard(dim=1),)" in out
    diff = float(re.search(r"max \|parallel - single process\| = (\S+)", out).group(1))
    assert diff < 1e-5, out


def test_main_job_explains_trains_with_progress_and_matches_single_process():
    out = _run("-m", "torch_tp.demo")  # exactly the README's main job
    assert "2 ranks (gloo), tensor + sequence parallel, 30 steps" in out
    assert re.search(r"^parameter +style +global +placement", out, flags=re.M)
    assert "layers.1.feed_forward.w2.weight  RowwiseParallel" in out
    assert "[##############################]  30/30 loss" in out  # the progress bar, finished
    worst = float(re.search(r"max relative difference (\S+) over 30 steps", out).group(1))
    assert "loss curve matches the single-process run" in out and worst <= 1e-3, out
    first, last = map(float, re.search(r"loss (\S+) -> (\S+);", out).groups())
    assert last < first / 2, out  # it actually learns
    per_rank = re.search(r"parameter bytes per rank: rank 0: (\d+), rank 1: (\d+)", out).groups()
    assert per_rank[0] == per_rank[1]
    assert "collectives per training step (forward + backward): 11 all_gather_into_tensor, 10 reduce_scatter_tensor" in out


def test_llama_tutorial_runs_from_meta_device_to_training():
    out = _run("tutorials/llama_tensor_parallel.py")
    assert "output.weight" in out and "step 9: loss" in out
    losses = [float(x) for x in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 10 and losses[-1] < losses[0]
    held = {int(n) for n in re.findall(r"rank \d holds (\d+) parameter bytes", out)}
    assert len(held) == 1
