"""Faulty runs in a process of their own, for the tests that need one.

``python tests/launch/fault_job.py launch|pool FLAG_FILE``: a run to kill. Rank 1 writes ``FLAG_FILE``
and sleeps; rank 0 waits for it inside an all_reduce (a collective that would outlive a killed
parent). ``tests/launch/test_orphans.py`` kills this process and checks that every process it started
is gone.

``torchrun --nproc-per-node 2 tests/launch/fault_job.py torchrun -``: rank 1 raises while rank 0 waits
in an all_reduce; ``tests/launch/test_faults.py`` checks that torchrun names rank 1 as the root cause.

(A killed torchrun agent's workers: ``tests/launch/test_multinode.py``, a lost node.)
"""

import faulthandler
import pathlib
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def raises_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom under torchrun")
    dist.all_reduce(torch.ones(1))


def blocked(flag_file):
    if dist.get_rank() == 1:
        pathlib.Path(flag_file).write_text("ranks in place")
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a job that will not end: its stacks
    # Ctrl-C as at a terminal: a suite started in the background (`cmd &` in a script) hands its
    # processes SIGINT ignored, and Python then leaves it ignored (the pool mode would never stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mode, flag = sys.argv[1], sys.argv[2]
    if mode == "launch":
        from torch_tp.launch import launch

        launch(blocked, flag, nproc=2, timeout=timedelta(seconds=600))
    elif mode == "torchrun":
        from torch_tp.launch import launch

        launch(raises_on_rank_1, timeout=timedelta(seconds=600))
    else:
        from torch_tp.testing import run_on_ranks

        run_on_ranks(blocked, 2, flag, timeout=600)
