"""Reproduces, without torch_tp, the heap corruption behind the int8 all-gather's old flake.

Two functional all-gathers in flight at once over gloo (issued back to back, waited after)
corrupt the heap in torch 2.13: within seconds a rank aborts with glibc's ``malloc():
unaligned tcache chunk detected`` (or dies of SIGSEGV). Issued and waited one at a time, the
same gathers run clean. torch_tp's int8 gather used to be two of them (``qdata``, then
``scale``); it is one waited collective now (``torch_tp/quant/_ops_collective.py``).

Not a test (it crashes on purpose); run by hand::

    python3 tests/launch/gloo_gathers_in_flight.py two      # aborts within ~30 s on 4 CPU ranks
    python3 tests/launch/gloo_gathers_in_flight.py serial   # 1000 rounds, clean
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = [(32, 32), (48, 32), (32, 48), (64, 32), (8, 32)]


def _rank(rank: int, world: int, mode: str, rounds: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    funcol, name = torch.ops._c10d_functional, dist.group.WORLD.group_name
    for _ in range(rounds):
        for rows, cols in SHAPES:
            rows_here = max(rows // world, 1)
            values, scales = torch.randint(-127, 127, (rows_here, cols), dtype=torch.int8), torch.rand(rows_here, 1)
            if mode == "two":  # both in flight, then both waited: the heap breaks
                first = funcol.all_gather_into_tensor(values, world, name)
                second = funcol.all_gather_into_tensor(scales, world, name)
                funcol.wait_tensor(first), funcol.wait_tensor(second)
            else:  # each waited before the next is issued: clean
                funcol.wait_tensor(funcol.all_gather_into_tensor(values, world, name))
                funcol.wait_tensor(funcol.all_gather_into_tensor(scales, world, name))
    dist.destroy_process_group()


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "two"
    store = f"/tmp/gloo_gathers_in_flight.{os.getpid()}"
    mp.spawn(_rank, args=(4, mode, 1000, store), nprocs=4)
    print(f"{mode}: 1000 rounds, no rank died")
