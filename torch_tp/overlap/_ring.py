"""The ring schedules behind the fused ops: P2P steps interleaved with chunk matmuls.

Both schedules work on plain tensors whose dim 0 is the gathered / scattered dim
(callers ``movedim`` it to the front), split into one chunk per rank, and on a
``chunk_matmul`` callback that multiplies one 2-D chunk by the right operand(s). Nothing
here knows what the right operand is (a float matrix, an int8 matrix with scales, ...).

Ring direction: every rank sends to the rank before it and receives from the rank after
it (positions in the group, modulo the group size), one batched ``isend``/``irecv`` pair
per step. The matmul of the chunk a rank already holds runs while that pair is in flight,
so a step costs ``max(transfer, matmul)`` instead of their sum; the ``world - 1``
transfers of one op are the same bytes an all-gather / reduce-scatter moves.

all-gather + matmul (rank ``r`` of ``n``; chunk ``c`` is rank ``c``'s shard)::

    step k:  hold chunk (r + k) % n   --send it to r-1-->   --receive (r + k + 1) % n from r+1-->
             matmul chunk (r + k) % n   (overlaps the transfer)

matmul + reduce-scatter (the partial sum for chunk ``c`` travels the ring, each rank adds
its own ``chunk c @ b`` and passes it on; it arrives complete at rank ``c``)::

    step k:  partial(c) = chunk c @ b  with c = (r + k + 1) % n   (overlaps the transfer)
             acc = partial(c) + what rank r+1 sent (its sum for c, ranks r+1 .. r+k)
             send acc to r-1   (at the last step c == r: acc is this rank's output)

matmul + reduce-scatter, pairwise (each partial sum travels once, straight to its owner, so it
can travel encoded, e.g. as int8, and be decoded once)::

    step k:  send encode(chunk (r + k) @ b) to r+k,  receive rank r-k's for chunk r
             encode(chunk (r + k + 1) @ b)   (overlaps the transfer)
             out += decode(what arrived)     (out starts as chunk r @ b, never encoded)
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["pairwise_matmul_reduce_scatter", "ring_all_gather_matmul", "ring_matmul_reduce_scatter"]

ChunkMatmul = Callable[[torch.Tensor], Sequence[torch.Tensor]]


def _neighbours(group: dist.ProcessGroup) -> tuple[int, int, int, int]:
    """(this rank's position, group size, global rank before it, global rank after it)."""
    position, size = group.rank(), group.size()
    before = dist.get_global_rank(group, (position - 1) % size)
    after = dist.get_global_rank(group, (position + 1) % size)
    return position, size, before, after


def _start_exchange(send: torch.Tensor, to: int, recv: torch.Tensor, src: int, group) -> list:
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, peer=to, group=group),
        dist.P2POp(dist.irecv, recv, peer=src, group=group),
    ])


def _finish(works: list) -> None:
    for work in works:
        work.wait()


def _matmul_rows(chunk: torch.Tensor, chunk_matmul: ChunkMatmul) -> list[torch.Tensor]:
    """``chunk_matmul`` of ``chunk`` (any leading dims, contracted last dim), leading dims kept."""
    outs = chunk_matmul(chunk.reshape(-1, chunk.shape[-1]))
    return [out.reshape(*chunk.shape[:-1], out.shape[-1]) for out in outs]


def _matmul_rows_while(works: list, chunk: torch.Tensor, chunk_matmul: ChunkMatmul) -> list[torch.Tensor]:
    """:func:`_matmul_rows` while ``works`` are in flight, then wait for them, even if the
    matmul raises: a transfer left unwaited would block the group's next collective."""
    try:
        return _matmul_rows(chunk, chunk_matmul)
    finally:
        _finish(works)


def ring_all_gather_matmul(
    shard: torch.Tensor, chunk_matmul: ChunkMatmul, group: dist.ProcessGroup
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All-gather ``shard`` on dim 0 over ``group`` and multiply every chunk as it arrives.

    Returns ``(gathered, outputs)``: ``gathered`` is every rank's ``shard`` stacked on
    dim 0 in rank order, ``outputs[i]`` is ``chunk_matmul(gathered)[i]`` (same row order).
    Every rank must pass a ``shard`` of the same shape.
    """
    position, size, before, after = _neighbours(group)
    gathered = shard.new_empty((size, *shard.shape))
    gathered[position].copy_(shard)
    per_chunk: list[list[torch.Tensor]] = [[] for _ in range(size)]
    for step in range(size):
        held = (position + step) % size
        works = []
        if step < size - 1:
            works = _start_exchange(gathered[held], before, gathered[(held + 1) % size], after, group)
        per_chunk[held] = _matmul_rows_while(works, gathered[held], chunk_matmul)
    outputs = [torch.cat([chunk[i] for chunk in per_chunk]) for i in range(len(per_chunk[0]))]
    return gathered.flatten(0, 1), outputs


def ring_matmul_reduce_scatter(
    full: torch.Tensor, chunk_matmul: ChunkMatmul, group: dist.ProcessGroup
) -> torch.Tensor:
    """``reduce_scatter(sum over ranks of chunk_matmul(full)[0])`` on dim 0, pipelined.

    ``full``'s dim 0 is split into ``group.size()`` equal chunks (the caller checks it
    divides); rank ``c`` returns the sum over ranks of ``chunk c @ b``.
    """
    position, size, before, after = _neighbours(group)
    chunks = full.chunk(size)
    acc = _matmul_rows(chunks[(position + 1) % size], chunk_matmul)[0]
    for step in range(1, size):
        incoming = torch.empty_like(acc)
        works = _start_exchange(acc.contiguous(), before, incoming, after, group)
        partial = _matmul_rows_while(works, chunks[(position + step + 1) % size], chunk_matmul)[0]
        acc = partial + incoming
    return acc


def pairwise_matmul_reduce_scatter(
    full: torch.Tensor, chunk_matmul: ChunkMatmul, group: dist.ProcessGroup,
    encode: Callable[[torch.Tensor], torch.Tensor], decode: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``reduce_scatter(sum over ranks of chunk_matmul(full)[0])`` on dim 0, pairwise (the module
    docstring's third schedule): each partial sum is ``encode``-d once, sent to the rank that
    owns its chunk, and ``decode``-d there (to the dtype of the sum), while the next is
    multiplied. This rank's own partial sum is never encoded. ``full``'s dim 0 must divide by the
    group size."""
    position, size = group.rank(), group.size()
    chunks = full.chunk(size)

    def partial(rank: int) -> torch.Tensor:
        return _matmul_rows(chunks[rank], chunk_matmul)[0]

    total = partial(position)
    outgoing = encode(partial((position + 1) % size)) if size > 1 else None
    for step in range(1, size):
        to, source = (dist.get_global_rank(group, (position + delta) % size) for delta in (step, -step))
        incoming = torch.empty_like(outgoing)
        works = _start_exchange(outgoing, to, incoming, source, group)
        try:  # the next step's partial sum while this one travels
            upcoming = encode(partial((position + step + 1) % size)) if step + 1 < size else None
        finally:
            _finish(works)
        total = total + decode(incoming)
        outgoing = upcoming
    return total
