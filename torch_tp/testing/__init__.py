"""Test utilities for torch_tp: the shared distributed harness.

Example::

    from torch_tp.testing import TOL, on_ranks, run_on_ranks, small_llama, tp_mesh, world_sizes

``TOL`` (``dict(rtol=1e-5, atol=1e-5)``) is the float32 tolerance between a parallel result
and its single-process reference: ``torch.testing.assert_close(out, ref, **TOL)``.

A parallel model trains like its single-process reference (rank side)::

    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    losses = assert_trains_like(model, reference, batches, loss_fn, optimizer=sgd)

One layer on a sharded input matches one process, output and input gradient (rank side)::

    step = assert_sharded_step_matches(replicated_copy(bn, mesh), bn, x, dy, mesh, [Shard(3)])

A tutorial or benchmark runs as users run it (in the parent; ``ROOT`` is the repository root)::

    out = run_script("benchmarks/halo_conv.py", "--quick", timeout=180).stdout
"""

from torch_tp.testing._comm import assert_comm_counts, comm_counts, communication_of, record_p2p, sent_bytes, wire_bytes
from torch_tp.testing._dist import RankFailure, run_on_ranks, shutdown_pools, world_sizes
from torch_tp.testing._fake_world import fake_world_memory
from torch_tp.testing._fixtures import TOL, block_linear_fraction, markdown_tables, quantize_weights, small_llama, small_llama_args, tolerance
from torch_tp.testing._on_ranks import on_ranks
from torch_tp.testing._rank import COLLECTIVE_TIMEOUT, mesh_2x2, rank, tp_mesh, world_size
from torch_tp.testing._reference import (
    assert_params_and_grads_match,
    assert_trains_like,
    assert_training_step_matches,
    full_tensor,
    full_tensors,
    local_chunk,
)
from torch_tp.testing._scripts import ROOT, ScriptRun, run_script
from torch_tp.testing._sharded import (
    ShardedStep,
    assert_sharded_step_matches,
    assert_sharded_trains_like,
    replicated_copy,
    shard_locally,
)

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "ROOT",
    "RankFailure",
    "ScriptRun",
    "ShardedStep",
    "TOL",
    "assert_comm_counts",
    "assert_params_and_grads_match",
    "assert_sharded_step_matches",
    "assert_sharded_trains_like",
    "assert_trains_like",
    "assert_training_step_matches",
    "comm_counts",
    "communication_of",
    "fake_world_memory",
    "full_tensor",
    "full_tensors",
    "local_chunk",
    "markdown_tables",
    "block_linear_fraction",
    "mesh_2x2",
    "on_ranks",
    "quantize_weights",
    "rank",
    "record_p2p",
    "replicated_copy",
    "run_on_ranks",
    "run_script",
    "sent_bytes",
    "wire_bytes",
    "shard_locally",
    "shutdown_pools",
    "small_llama",
    "small_llama_args",
    "tolerance",
    "tp_mesh",
    "world_size",
    "world_sizes",
]
