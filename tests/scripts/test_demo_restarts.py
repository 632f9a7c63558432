"""The main job under ``torchrun --max-restarts 2``, killed twice: rank 1 mid-step, then rank 0 while
a checkpoint is being written. torchrun restarts the ranks each time, the job resumes from the
newest complete checkpoint (never the half-written one) and ends with the final loss and the
parameters (SHA-256) of the run that was never killed.

Restarts over gloo also exercise ``torch_tp.launch``'s per-attempt store prefix: without it, a
restarted group reads the previous attempt's addresses ("connectFullMesh failed").
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from torch_tp._supervise.orphans import descendants
from torch_tp.testing import ROOT, run_on_ranks

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

STEPS = "16"
JOB_TIMEOUT_S = 240


def _uninterrupted():
    """The job never killed: its body on the harness's 2 ranks (one thread each, as torchrun's)."""
    from torch_tp import demo

    return demo._run(demo._parse(["--steps", STEPS]))


def _final(out):
    loss = re.search(r"^final loss: (\S+)$", out, flags=re.M)
    digest = re.search(r"^final parameters sha256: ([0-9a-f]{64})$", out, flags=re.M)
    assert loss and digest, out
    return float(loss.group(1)), digest.group(1)


def _start(directory, logs):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2",
               "-m", "torch_tp.demo", "--steps", STEPS, "--checkpoint-dir", str(directory), "--checkpoint-every", "4"]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=open(logs / "out", "w"), stderr=open(logs / "err", "w"),
                            start_new_session=True)


def _rank_pid(job, rank, attempt):
    """The pid of the worker running ``rank`` in restart ``attempt`` (torchrun's agent, ``job``,
    sets RANK and TORCHELASTIC_RESTART_COUNT for each)."""
    for pid in descendants([job.pid]):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and f"TORCHELASTIC_RESTART_COUNT={attempt}".encode() in environ:
            return pid
    return None


def _wait_until(condition, what, job, timeout=120):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.001)
    return found


def _finish(job, logs):
    try:
        job.wait(timeout=JOB_TIMEOUT_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    out, err = (logs / "out").read_text(), (logs / "err").read_text()
    assert job.returncode == 0, f"exit {job.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    return out, err


def test_a_job_killed_mid_step_then_mid_save_ends_with_the_parameters_of_the_job_never_killed(tmp_path):
    directory = tmp_path / "ckpt"
    job = _start(directory, tmp_path)

    # 1. rank 1 killed after step 6 (saved after step 4): the restarted ranks resume from step 4
    _wait_until(lambda: " 6/16 loss" in (tmp_path / "out").read_text(), "step 6", job)
    os.kill(_wait_until(lambda: _rank_pid(job, 1, attempt=0), "rank 1", job), signal.SIGKILL)
    _wait_until(lambda: "after step 4 (saved on" in (tmp_path / "out").read_text(), "resume from step 4", job)

    # 2. rank 0 killed while a checkpoint (step 8 or later) is being written: never loaded
    def saving():
        found = sorted(p.name for p in directory.glob("step-*.partial"))
        return found[0] if found and found[0] >= "step-00000008" else None

    partial = _wait_until(saving, "save in progress", job)
    os.kill(_rank_pid(job, 0, attempt=1), signal.SIGKILL)
    out, err = _finish(job, tmp_path)

    resumed = [int(step) for step in re.findall(r"resumed from \S+/step-(\d+) after step", out)]
    killed_at = int(partial[len("step-"):-len(".partial")])
    assert resumed[0] == 4 and resumed[1] < killed_at and len(resumed) == 2, (resumed, killed_at, out)
    never_killed = run_on_ranks(_uninterrupted, 2)[0]
    assert _final(out) == (never_killed["final_loss"], never_killed["sha256"]), (out, never_killed)
