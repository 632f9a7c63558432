"""Test utilities for torch_tp: the shared distributed harness.

Example::

    from torch_tp.testing import TOL, on_ranks, run_on_ranks, small_llama, tp_mesh, world_sizes

``TOL`` (``dict(rtol=1e-5, atol=1e-5)``) is the float32 tolerance between a parallel result
and its single-process reference: ``torch.testing.assert_close(out, ref, **TOL)``.
"""

from torch_tp.testing._comm import assert_comm_counts, comm_counts, communication_of, record_p2p, sent_bytes
from torch_tp.testing._dist import RankFailure, run_on_ranks, shutdown_pools, world_sizes
from torch_tp.testing._fixtures import TOL, markdown_tables, quantize_weights, small_llama, small_llama_args, tolerance
from torch_tp.testing._on_ranks import on_ranks
from torch_tp.testing._rank import COLLECTIVE_TIMEOUT, mesh_2x2, rank, tp_mesh, world_size
from torch_tp.testing._reference import (
    assert_params_and_grads_match,
    assert_training_step_matches,
    full_tensor,
    local_chunk,
)

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "RankFailure",
    "TOL",
    "assert_comm_counts",
    "assert_params_and_grads_match",
    "assert_training_step_matches",
    "comm_counts",
    "communication_of",
    "full_tensor",
    "local_chunk",
    "markdown_tables",
    "mesh_2x2",
    "on_ranks",
    "quantize_weights",
    "rank",
    "record_p2p",
    "run_on_ranks",
    "sent_bytes",
    "shutdown_pools",
    "small_llama",
    "small_llama_args",
    "tolerance",
    "tp_mesh",
    "world_size",
    "world_sizes",
]
