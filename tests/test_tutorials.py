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


def test_main_job_trains_and_its_loss_matches_single_process():
    out = _run("-m", "torch_tp.demo", "--steps", "3")
    assert "2 ranks (gloo), tensor + sequence parallel, 3 steps" in out
    worst = float(re.search(r"max \|diff\| (\S+)\)", out).group(1))
    assert "loss matches the single-process run" in out and worst < 1e-4, out
