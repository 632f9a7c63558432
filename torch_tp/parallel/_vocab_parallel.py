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

The rank-dependent part (which ids fall in this rank's rows) runs under
``maybe_run_for_local_tensor``, as in DTensor's own ``_MaskPartial``: under upstream's
single-process ``LocalTensorMode`` harness the mesh coordinate is one symbolic int standing
for every simulated rank, and the decorator runs it once per simulated rank. Elsewhere the
decorator calls it as it is. The padding row is found by its global id, the same on every rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._local_tensor import maybe_run_for_local_tensor
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
    outside, local_ids = _local_ids(ids, device_mesh.get_local_rank(), module.num_embeddings, device_mesh.size())
    found = F.embedding(local_ids, rows)
    if module.padding_idx is not None:
        # as F.embedding(padding_idx=...): the padding row is looked up but gets no gradient
        padding = (ids == module.padding_idx).unsqueeze(-1)
        found = torch.where(padding, found.detach(), found)
    found = found.masked_fill(outside.unsqueeze(-1), 0)
    return DTensor.from_local(found, device_mesh, [Partial()], run_check=False)


@maybe_run_for_local_tensor
def _local_ids(ids: torch.Tensor, rank: int, num_embeddings: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(outside, ids - start)`` for the rows ``[start, stop)`` of mesh coordinate ``rank``:
    which ids lie outside them, and the local row of each id (``0`` for those outside).

    Under ``LocalTensorMode`` ``rank`` is a symbolic int with one value per simulated rank;
    the decorator calls this once per simulated rank with its own value (and its own ``ids``
    if they differ) and returns ``LocalTensor`` s.
    """
    start, stop = shard_bounds(num_embeddings, num_ranks)[rank]
    outside = (ids < start) | (ids >= stop)
    return outside, (ids - start).masked_fill(outside, 0)
