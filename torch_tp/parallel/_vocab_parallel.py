"""The forward of a vocab-parallel ``nn.Embedding`` (``RowwiseParallel``): a local lookup.

Each rank holds the rows ``[start, stop)`` of the table (``Shard(0)``, ``torch.chunk`` rule).
It looks up the ids that fall in its rows, writes zeros for the others, and returns the sum's
share as a ``Partial`` DTensor, which the style's output hook reduces to its
``output_layouts`` (an all-reduce, or a reduce-scatter onto the sequence). Megatron's
``VocabParallelEmbedding`` does the same.

DTensor's own embedding rule (``MaskPartial``) computes the same forward, but in torch 2.13
its backward returns the table's gradient ``Replicate()``: every rank holds the whole
vocab × dim gradient, and the optimizer keeps it whole. Here the gradient of the local
lookup is the local rows' gradient: it stays ``Shard(0)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from torch_tp._layouts import shard_bounds

__all__ = ["vocab_parallel_lookup"]


def vocab_parallel_lookup(module: nn.Embedding, ids: torch.Tensor, *, device_mesh: DeviceMesh) -> DTensor:
    """Look ``ids`` up in this rank's rows of ``module.weight``; a ``Partial`` DTensor.

    ``ids`` is the replicated DTensor (or plain tensor) of token ids the style's input hook
    hands over. Ids outside this rank's rows contribute zeros, and no gradient.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> replace_forward(embedding, vocab_parallel_lookup, device_mesh=mesh)
    """
    ids = ids.to_local() if isinstance(ids, DTensor) else ids
    weight = module.weight
    rows = weight.to_local() if isinstance(weight, DTensor) else weight
    start, stop = shard_bounds(module.num_embeddings, device_mesh.size())[device_mesh.get_local_rank()]
    outside = (ids < start) | (ids >= stop)
    padding = module.padding_idx
    local_padding = padding - start if padding is not None and start <= padding < stop else None
    found = F.embedding((ids - start).masked_fill(outside, 0), rows, padding_idx=local_padding)
    found = found.masked_fill(outside.unsqueeze(-1), 0)
    return DTensor.from_local(found, device_mesh, [Partial()], run_check=False)
