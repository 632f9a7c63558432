"""A rank of the main job killed under ``torchrun --max-restarts 1``, mid-step or mid-save: torchrun
restarts the ranks, the job resumes from the newest complete checkpoint and ends with the final
loss and the parameters (SHA-256) of the run that was never killed.

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

from torch_tp._orphans import descendants
from torch_tp.testing import ROOT, ScriptRun

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

STEPS = "20"
UNINTERRUPTED = ScriptRun("-m", "torch_tp.demo", "--steps", STEPS)
JOB_TIMEOUT_S = 240


def _final(out):
    loss = re.search(r"^final loss: (\S+)$", out, flags=re.M)
    digest = re.search(r"^final parameters sha256: ([0-9a-f]{64})$", out, flags=re.M)
    assert loss and digest, out
    return loss.group(1), digest.group(1)


def _start(directory, every, logs):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
               "-m", "torch_tp.demo", "--steps", STEPS, "--checkpoint-dir", str(directory), "--checkpoint-every", every]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=open(logs / "out", "w"), stderr=open(logs / "err", "w"),
                            start_new_session=True)


def _rank_pid(job, rank):
    """The pid of the worker running ``rank`` (torchrun's agent is ``job``; it sets RANK for each)."""
    for pid in descendants([job.pid]):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RESTART_COUNT=0" in environ:
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


@pytest.mark.script_runs(UNINTERRUPTED)
def test_a_rank_killed_mid_step_restarts_and_ends_with_the_uninterrupted_parameters(tmp_path):
    directory = tmp_path / "ckpt"
    job = _start(directory, "5", tmp_path)
    _wait_until(lambda: " 12/20 loss" in (tmp_path / "out").read_text(), "step 12", job)
    os.kill(_wait_until(lambda: _rank_pid(job, 1), "rank 1", job), signal.SIGKILL)
    out, err = _finish(job, tmp_path)
    assert f"resumed from {directory}/step-00000010 after step 10" in out, out
    assert _final(out) == _final(UNINTERRUPTED.result().stdout)


@pytest.mark.script_runs(UNINTERRUPTED)
def test_a_rank_killed_while_saving_restarts_from_the_last_complete_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    job = _start(directory, "1", tmp_path)

    def saving():  # a checkpoint being written, after a few complete ones
        found = [p.name for p in directory.glob("step-*.partial")] if directory.exists() else []
        return found[0] if found and found[0] >= "step-00000004" else None

    partial = _wait_until(saving, "save in progress", job)
    os.kill(_rank_pid(job, 1), signal.SIGKILL)
    out, err = _finish(job, tmp_path)
    killed_at = int(partial[len("step-"):-len(".partial")])
    resumed = int(re.search(r"resumed from \S+/step-(\d+) after step", out).group(1))
    assert resumed < killed_at, (resumed, killed_at, out)  # the half-written one was not loaded
    assert _final(out) == _final(UNINTERRUPTED.result().stdout)
