"""``python -m torch_tp.run``: ``torchrun`` with the same arguments, naming a lost rendezvous store.

A drop-in for ``torchrun`` (``python -m torch.distributed.run``): it parses the same arguments
and runs torch's own agent (``torch.distributed.run.run``), so everything torchrun does happens
unchanged, a failed worker's ``ChildFailedError`` report included. One thing torchrun's agent
cannot say or do, this front end does:

=====================================  ======================================================
``torchrun``                           ``python -m torch_tp.run``
=====================================  ======================================================
the node whose agent hosts the c10d    one line, no traceback, exit code 1: the store that
store (``--rdzv-endpoint``) is lost:   was lost, this node's ranks that were stopped, the
every other agent ends at once in a    ranks that are gone (the world minus this node's, from
``RendezvousConnectionError``          the agent's worker group), and what to do
traceback, naming no rank              (:class:`StoreLost`)
a worker outlives its killed agent     each worker gets the parent-death signal before it
until it ties itself to it (torch_tp's runs: a lost node's workers end with its agent even
``launch`` does, once it runs)         while they import torch
=====================================  ======================================================

A lost node that did *not* host the store is named by the surviving workers' heartbeats
(:mod:`torch_tp._supervise.heartbeat`), under either launcher. The store host's loss leaves
nothing to read them from, and the surviving agent sees it first (its store check, every
``--monitor-interval``): only the agent, so only a front end around it, knows which ranks it ran.

Example (two nodes)::

    python -m torch_tp.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint node0:29500 -m torch_tp.demo --dp 2 --checkpoint-dir ckpt
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["StoreLost", "main", "run"]


class StoreLost(RuntimeError):
    """Raised by :func:`run` when this node's agent lost the job's rendezvous store.

    ``endpoint`` is the store's address (``--rdzv-endpoint``); ``node_ranks`` the global ranks
    this node ran, which its agent stopped; ``lost_ranks`` the other nodes' ranks (the store's
    host among them: every agent ends without the store); ``max_restarts`` the job's
    ``--max-restarts``, which a lost store leaves unused. With no ranks assigned yet (the store
    was lost, or never reached, at the rendezvous) both rank lists are empty.

    Example::

        >>> print(StoreLost("10.0.0.1:29500", node_ranks=[2, 3], world_size=4, nnodes=2))  # doctest: +ELLIPSIS
        torch_tp.run: this node (ranks 2, 3) lost the job's rendezvous store at 10.0.0.1:29500: the agent that hosted it is gone, and with it the other node's ranks 0, 1; this node's ranks were stopped. Restart the job ...
    """

    def __init__(
        self, endpoint: str, node_ranks: list[int], world_size: int, nnodes: int, max_restarts: int = 0
    ) -> None:
        self.endpoint, self.node_ranks, self.max_restarts = endpoint, list(node_ranks), max_restarts
        self.lost_ranks = [r for r in range(world_size) if r not in self.node_ranks]
        super().__init__(_message(endpoint, self.node_ranks, self.lost_ranks, nnodes, max_restarts))


def _message(endpoint: str, node_ranks: list[int], lost: list[int], nnodes: int, max_restarts: int) -> str:
    todo = ("Restart the job on every node from its newest checkpoint (the same command, e.g. the demo's "
            "--checkpoint-dir: it resumes from the newest complete one)")
    restarts = (f"; --max-restarts {max_restarts} cannot restart it, as every agent's rendezvous lived in that store"
                if max_restarts > 0 else "")
    elastic = ("; for torchrun's elastic restarts to outlive a node, host the store on a machine that is not a node "
               "and start every agent with --rdzv-conf is_host=false (see docs/launch.md, 'Several nodes')")
    if not node_ranks:
        return (f"torch_tp.run: this node lost, or never reached, the job's rendezvous store at {endpoint} before its "
                f"workers were given ranks: start the agent at that address (the first node's) if it is not running, "
                f"then this command again on every node{elastic}")
    others = "the other node's" if nnodes == 2 else "the other nodes'"
    return (f"torch_tp.run: this node ({_ranks(node_ranks)}) lost the job's rendezvous store at {endpoint}: the agent "
            f"that hosted it is gone, and with it {others} {_ranks(lost)}; this node's ranks were stopped. "
            f"{todo}{restarts}{elastic}")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def run(argv: list[str] | None = None) -> None:
    """Run torchrun's agent with ``argv`` (``sys.argv[1:]`` by default), as ``torchrun`` does.

    A failed worker raises torch's ``ChildFailedError``, untouched. The agent's
    ``RendezvousConnectionError`` once its workers ran (the store's host is gone) is raised as
    :class:`StoreLost`, naming the ranks.

    Example::

        >>> # xdoctest: +SKIP("starts an agent and its workers")
        >>> run(["--nproc-per-node", "2", "-m", "torch_tp.demo"])
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    args = parse_args(sys.argv[1:] if argv is None else argv)
    with _agents_noted() as agents, _workers_die_with_agent():
        try:
            torchrun(args)
        except RendezvousConnectionError as exc:
            raise _store_lost(args, agents) from exc


def main(argv: list[str] | None = None) -> None:
    """The command line: :func:`run`, a :class:`StoreLost` printed as one line, exit code 1.

    Errors are recorded as torchrun records them (its ``@record``: the error file an outer
    launcher reads, a failed worker's copied into it).

    Example::

        >>> # xdoctest: +SKIP("starts an agent and its workers")
        >>> main(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29500", "-m", "torch_tp.demo"])
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        record(run)(argv)
    except StoreLost as lost:
        sys.exit(str(lost))


def _store_lost(args: Any, agents: list[Any]) -> StoreLost:
    """:class:`StoreLost` from the agent's worker group: its workers' global ranks and world size
    (``-1`` before the rendezvous gave them)."""
    from torch.distributed.run import parse_min_max_nnodes

    workers = agents[-1].get_worker_group().workers if agents else []
    node_ranks = sorted(w.global_rank for w in workers if w.global_rank >= 0)
    world_size = max((w.world_size for w in workers), default=0) if node_ranks else 0
    _, nnodes = parse_min_max_nnodes(args.nnodes)
    return StoreLost(args.rdzv_endpoint or "?", node_ranks, world_size, nnodes, max_restarts=args.max_restarts)


@contextlib.contextmanager
def _agents_noted() -> Iterator[list[Any]]:
    """The agents torchrun's launcher makes while inside (``launch_agent`` keeps its agent in a
    local variable): a subclass of its ``LocalElasticAgent`` that notes each instance."""
    from torch.distributed.launcher import api

    original, agents = api.LocalElasticAgent, []

    class NotedAgent(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            agents.append(self)

    api.LocalElasticAgent = NotedAgent
    try:
        yield agents
    finally:
        api.LocalElasticAgent = original


@contextlib.contextmanager
def _workers_die_with_agent() -> Iterator[None]:
    """Each worker the agent starts (``subprocess.Popen``) gets the parent-death signal before it
    runs anything: a lost node's workers end with its agent even while they import (torch_tp's
    own tie, :func:`torch_tp._supervise.orphans.exit_with`, comes only once the worker runs
    :func:`torch_tp.launch.launch`). Linux only; elsewhere nothing changes."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    if not sys.platform.startswith("linux"):
        yield
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child loads nothing
    original = subprocess_handler.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        agent = os.getpid()

        def die_with_agent() -> None:  # in the child, between fork and exec
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != agent:  # the agent died before the signal was set
                os._exit(1)

        return original(*args, preexec_fn=die_with_agent, **kwargs)

    subprocess_handler.Popen = popen
    try:
        yield
    finally:
        subprocess_handler.Popen = original


_PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


if __name__ == "__main__":
    main()
