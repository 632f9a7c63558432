"""Test utilities for torch_tp: the shared distributed harness.

Example::

    from torch_tp.testing import run_on_ranks, tp_mesh, world_sizes
"""

from torch_tp.testing._comm import assert_comm_counts, comm_counts, communication_of, record_p2p, sent_bytes
from torch_tp.testing._dist import RankFailure, run_on_ranks, shutdown_pools, world_sizes
from torch_tp.testing._rank import COLLECTIVE_TIMEOUT, mesh_2x2, rank, tp_mesh, world_size
from torch_tp.testing._reference import assert_params_and_grads_match, full_tensor, local_chunk

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "RankFailure",
    "assert_comm_counts",
    "assert_params_and_grads_match",
    "comm_counts",
    "communication_of",
    "full_tensor",
    "local_chunk",
    "mesh_2x2",
    "rank",
    "record_p2p",
    "run_on_ranks",
    "sent_bytes",
    "shutdown_pools",
    "tp_mesh",
    "world_size",
    "world_sizes",
]
