"""The fault matrix (``tests/launch/fault_matrix.py``): a training loop's collective sites and
file operations times a rank killed (SIGKILL), stopped (SIGSTOP), terminated from outside
(SIGTERM), raising, or disagreeing on a path, a step, a shape or a dtype. Each cell must end in a
named error within its bound, and the run resumed from its directory must end with the
parameters of the run never interrupted. CI runs ``SAMPLE`` (every site and every fault);
``TORCH_TP_FAULT_MATRIX=all`` runs every cell. The table in ``docs/fault_matrix.md`` must be the
matrix's (``python3 tests/launch/fault_matrix.py --write`` rewrites it).
"""

import os
import pathlib
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torch_tp.launch import LaunchFailure, launch
from fault_matrix import CELLS, FAULTS, MATRIX_DOC, SITES, cells_to_run, documented_table, matrix_table, run_cell


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fault_matrix")  # the uninterrupted reference run, made once


@pytest.mark.parametrize("cell", cells_to_run(), ids=lambda cell: cell.name)
def test_the_fault_is_named_within_its_bound_and_the_resumed_run_loses_nothing(cell, work):
    result = run_cell(cell, work)
    assert not result.problems, f"{cell.name} ({result.seconds:.1f} s): {result.problems}\n{result.first_line}"


def test_the_sample_covers_every_site_and_every_fault():
    sample = cells_to_run("sample")
    assert {c.site for c in sample} == set(SITES) and {c.fault for c in sample} == set(FAULTS), sample


def test_the_docs_fault_matrix_is_the_generators():
    assert documented_table() == matrix_table(), (
        f"{MATRIX_DOC} is not the matrix's table: run python3 tests/launch/fault_matrix.py --write")
    assert len(matrix_table().splitlines()) == len(CELLS) + 2


def _sleeps_then_all_reduce(pid_file):
    if dist.get_rank() == 1:
        pathlib.Path(pid_file).write_text(str(os.getpid()))
        time.sleep(60)  # killed from outside while its peer waits in the all_reduce
    dist.all_reduce(torch.ones(4))


def test_a_rank_sent_sigterm_from_outside_is_named_as_terminated_not_as_the_rank_that_never_reached_a_collective(tmp_path):
    # the agent listed the peer whose all_reduce lost its connection first (5 runs in 6), and its own
    # SIGTERMs look the same: the report said "rank 0 waited in all_reduce ..., which rank 1 never reached"
    pid_file = tmp_path / "rank1.pid"

    def kill_rank_1():
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # rank 0 is in the all_reduce
        os.kill(int(pid_file.read_text()), signal.SIGTERM)

    for _ in range(3):
        pid_file.unlink(missing_ok=True)
        killer = threading.Thread(target=kill_rank_1, daemon=True)
        killer.start()
        with pytest.raises(LaunchFailure) as info:
            launch(_sleeps_then_all_reduce, str(pid_file), nproc=2, timeout=timedelta(seconds=20))
        killer.join()
        message = str(info.value)
        assert info.value.root_cause_rank == 1 and info.value.exit_codes[1] == -signal.SIGTERM, message
        cause = message.splitlines()[0].split(" ranks: ", 1)[1]
        assert cause.startswith("rank 1 was killed by SIGTERM, sent from outside the launcher"), message
        assert "never reached" not in message and "in _sleeps_then_all_reduce" in message, message  # its stack
