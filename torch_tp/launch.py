"""Run a function on every rank: spawned CPU ranks by default, or the ranks ``torchrun`` made.

Scripts (the demo, the tutorials) call :func:`launch` so that ``python script.py`` spawns
``nproc`` CPU processes talking over gloo, while ``torchrun --nproc-per-node N script.py``
uses the launcher's ranks, with NCCL when CUDA is available.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["launch", "launched_by_torchrun", "rank_device"]

DEFAULT_TIMEOUT = timedelta(seconds=120)


def launched_by_torchrun() -> bool:
    """True when the launcher already set this process's rank (``torchrun``, ``torch.distributed.run``).

    Example::

        >>> import os
        >>> launched_by_torchrun() == ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
        True
    """
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_device() -> torch.device:
    """The device this rank computes on: its CUDA device under torchrun with CUDA, else CPU.

    Example::

        >>> rank_device().type in ("cpu", "cuda")
        True
    """
    if launched_by_torchrun() and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _run_rank(fn: Callable[..., Any], args: tuple, timeout: timedelta) -> None:
    device = rank_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timeout)
    try:
        fn(*args)
        # No rank may tear its process group down while a peer still talks to it: gloo
        # aborts the process ("terminate called without an active exception") otherwise.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned_rank(rank: int, nproc: int, port: int, fn, args, timeout) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    _run_rank(fn, args, timeout)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int = 2,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Call ``fn(*args)`` on every rank with the default process group initialized.

    Under ``torchrun`` this process is one rank (``nproc`` is ignored). Otherwise ``nproc``
    CPU processes are spawned on this machine with the gloo backend; an exception on any
    rank is raised here. Every collective times out after ``timeout``.

    Example::

        >>> # xdoctest: +SKIP("spawns processes")
        >>> def hello():
        ...     print(f"rank {dist.get_rank()} of {dist.get_world_size()}")
        >>> launch(hello, nproc=2)
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if launched_by_torchrun():
        _run_rank(fn, args, timeout)
        return
    import torch.multiprocessing as mp

    mp.spawn(_spawned_rank, args=(nproc, _free_port(), fn, args, timeout), nprocs=nproc)
