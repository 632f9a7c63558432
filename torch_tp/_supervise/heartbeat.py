"""Which peers are gone: each rank of a ``torchrun`` job beats a counter in the job's store.

A rank whose collective fails ("Connection closed by peer") knows that *some* peer is gone, not
which: the error names an address, and in a multi-node job the lost ranks are another node's,
whose agent (killed, preempted) took its workers with it. torchrun's agent notices a lost node
only through its rendezvous keep-alive, tens of seconds later, and its report names this node's
ranks, which merely lost their connection.

So every rank started under torchrun runs a daemon thread that adds 1 to its own counter in the
job's store (``heartbeat/<rank>``) every :data:`INTERVAL_S` seconds. After a failed collective,
:meth:`Heartbeat.lost_ranks` reads every counter twice, :data:`PROBE_S` seconds apart: a rank
whose counter did not move has no process beating for it. Counters, not timestamps: the nodes'
clocks need not agree. A rank that hangs still beats (its thread runs): it is not lost, and the
collective timeout names it.

If the store itself is gone (the agent that hosted it, the one at ``--rdzv-endpoint``, was the
one lost), the probe says so instead: no rank can be read.

Imports nothing from torch_tp.
"""

from __future__ import annotations

import threading
import time

__all__ = ["INTERVAL_S", "PROBE_S", "Heartbeat", "lost_ranks_line"]

#: Seconds between two beats of a rank.
INTERVAL_S = 0.5
#: Seconds between the two readings of the counters (several beats of a live rank).
PROBE_S = 2.0


class Heartbeat:
    """This rank's beat in ``store`` (a ``torch.distributed.Store``), and the probe of its peers'.

    Example::

        >>> import torch.distributed as dist
        >>> store = dist.HashStore()
        >>> beat = Heartbeat(store, rank=0, world_size=2)
        >>> beat.start()
        >>> beat.lost_ranks(probe_s=1.2)  # rank 1 never beat
        [1]
        >>> beat.stop()
    """

    def __init__(self, store, rank: int, world_size: int, interval_s: float = INTERVAL_S) -> None:
        self.store, self.rank, self.world_size, self.interval_s = store, rank, world_size, interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="torch_tp-heartbeat", daemon=True)

    def start(self) -> None:
        """Beat once now, then every ``interval_s`` seconds on a daemon thread."""
        self.store.add(_key(self.rank), 1)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating (before the store goes away: the process group's end)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def lost_ranks(self, probe_s: float = PROBE_S) -> list[int] | None:
        """The peers whose counter did not move in ``probe_s`` seconds, in rank order; ``None``
        when the store cannot be read (its host is gone)."""
        try:
            before = self._counters()
            time.sleep(probe_s)
            after = self._counters()
        except Exception:  # noqa: BLE001 - a store that cannot be read is the answer
            return None
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]

    def _counters(self) -> list[int]:
        return [self.store.add(_key(r), 0) for r in range(self.world_size)]

    def _beat(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self.store.add(_key(self.rank), 1)
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to beat into
                return


def lost_ranks_line(rank: int, world_size: int, lost: list[int] | None, probe_s: float = PROBE_S) -> str:
    """The line a rank prints after a failed collective, naming the peers that are gone.

    Example::

        >>> lost_ranks_line(0, 4, [2, 3])
        'torch_tp.launch: rank 0 lost ranks 2, 3: no heartbeat from them for 2.0 s (their processes, or their node, are gone); ranks 0, 1 are alive'
        >>> lost_ranks_line(1, 2, None)[:71]
        "torch_tp.launch: rank 1 cannot read the job's store: the torchrun agent"
    """
    if lost is None:
        return (f"torch_tp.launch: rank {rank} cannot read the job's store: the torchrun agent that hosted it "
                "(the one at --rdzv-endpoint) is gone, and with it its node's ranks (python -m torch_tp.run names them)")
    if not lost:
        return (f"torch_tp.launch: rank {rank}: every peer still beats (a collective failed, but no rank "
                f"is gone: see the root cause's traceback)")
    alive = [r for r in range(world_size) if r not in lost]
    return (f"torch_tp.launch: rank {rank} lost {_ranks(lost)}: no heartbeat from them for {probe_s:.1f} s "
            f"(their processes, or their node, are gone); {_ranks(alive)} {'is' if len(alive) == 1 else 'are'} alive")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _key(rank: int) -> str:
    return f"heartbeat/{rank}"
