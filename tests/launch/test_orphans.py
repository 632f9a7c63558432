"""No orphans: when the process that started a run dies, everything it started ends.

``tests/launch/fault_job.py`` starts two ranks with ``torch_tp.launch`` (torch's elastic agent, a fork
server, the ranks) or with ``run_on_ranks`` (a fork server and a pool), one rank blocked inside
an all_reduce. The job is then killed with SIGKILL (no cleanup at all), SIGTERM or SIGINT
(Ctrl-C); within 5 s none of its descendants may be running (a zombie, already ended and waiting
for its new parent to reap it, counts as gone). The six jobs start together (their start is
seconds of imports each; blocked, they wait idle) and each test stops its own.

A torchrun agent killed with its workers blocked: ``tests/launch/test_multinode.py`` (a lost node).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_tp.testing import ROOT

pytestmark = pytest.mark.slow

JOB = Path(__file__).with_name("fault_job.py")
GRACE_S = 5.0


def _children_of() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat:
                children.setdefault(int(stat[1]), []).append(int(entry))
    return children


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # [state, ppid, ...]


def _descendants(pid: int) -> set[int]:
    children, found, todo = _children_of(), set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pids: set[int]) -> set[int]:
    return {pid for pid in pids if (stat := _stat(pid)) is not None and stat[0] != "Z"}


def _wait_or_show_stacks(job, timeout):
    """Wait for ``job``; one that has not ended by then fails with its threads' stacks."""
    try:
        job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.send_signal(signal.SIGUSR1)  # fault_job.py dumps every thread's stack to stderr
        time.sleep(2)
        job.kill()
        job.wait(timeout=30)
        raise AssertionError(f"the job did not end within {timeout} s of the signal:\n{job.stderr.read()[-8000:]}") from None


MODES = ["launch", "pool"]
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}


@pytest.fixture(scope="module")
def blocked_jobs(tmp_path_factory):
    """A run of ``fault_job.py`` per (mode, signal), all started now, each with the flag file its
    rank 1 writes once the ranks are in place. Whatever a test left running ends here."""
    jobs = {}
    for mode in MODES:
        for name in SIGNALS:
            flag = tmp_path_factory.mktemp(f"{mode}-{name}") / "ranks_in_place"
            job = subprocess.Popen([sys.executable, str(JOB), mode, str(flag)], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            jobs[mode, name] = job, flag
    yield jobs
    for job, _ in jobs.values():
        _end_everything(job, set())


def _end_everything(job, started):
    for pid in _running(started | _descendants(job.pid)) | ({job.pid} if job.poll() is None else set()):
        os.kill(pid, signal.SIGKILL)
    job.wait(timeout=30)
    job.stderr.close()


def _stopped_job_leaves_nothing(job, flag, stop):
    """Once ``job`` (a run of ``fault_job.py``) wrote ``flag`` (its ranks are in place),
    ``stop(job)`` it and check that none of its descendants runs ``GRACE_S`` later."""
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while not flag.exists():
            assert job.poll() is None, f"the job ended early: {job.stderr.read()}"
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        time.sleep(0.5)  # rank 0 is inside its all_reduce
        started = _descendants(job.pid)
        assert len(started) >= 2, started  # at least the two ranks
        stop(job)
        deadline = time.monotonic() + GRACE_S
        while (left := _running(started)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left}
    finally:  # whatever is left (a failed check) must not outlive the test
        _end_everything(job, started)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", list(SIGNALS))
@pytest.mark.parametrize("mode", MODES)
def test_killing_the_parent_leaves_no_process_of_the_run(blocked_jobs, mode, sig):
    def stop(job):
        job.send_signal(SIGNALS[sig])
        _wait_or_show_stacks(job, timeout=30)

    _stopped_job_leaves_nothing(*blocked_jobs[mode, sig], stop)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_in_the_demo_ends_every_rank_promptly():
    started: set[int] = set()
    demo = subprocess.Popen(
        [sys.executable, "-m", "torch_tp.demo", "--steps", "2000"], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        for line in demo.stdout:  # the ranks are training once the progress bar starts
            if "training:" in line:
                break
        time.sleep(1.0)
        started = _descendants(demo.pid)
        assert len(started) >= 2, started
        interrupted = time.monotonic()
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=GRACE_S) == 130, demo.stderr.read()
        assert "torch_tp demo: interrupted" in demo.stderr.read()
        while (left := _running(started)) and time.monotonic() < interrupted + GRACE_S:
            time.sleep(0.1)
        assert not left, left
    finally:
        for pid in _running(started | _descendants(demo.pid)) | ({demo.pid} if demo.poll() is None else set()):
            os.kill(pid, signal.SIGKILL)
        demo.wait(timeout=30)
