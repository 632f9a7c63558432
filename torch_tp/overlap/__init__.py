"""Communication/computation-overlapped tensor parallelism on any backend (gloo on CPU included).

A sequence-parallel ``ColwiseParallel`` layer all-gathers its input and then multiplies;
a sequence-parallel ``RowwiseParallel`` layer multiplies and then reduce-scatters. The fused
ops here split that work into one step per rank: while the chunk a rank already holds is
multiplied, the next chunk (or the running partial sum) travels to the neighbouring rank
by P2P. See ``docs/overlap.md`` for the schedule and its timeline.

- :func:`all_gather_matmul`: ``(all_gather(a_shard), [all_gather(a_shard) @ b for b in bs])``
- :func:`matmul_reduce_scatter`: ``reduce_scatter(a @ b)``
- :func:`all_gather_then_matmul`, :func:`matmul_then_reduce_scatter`: the same results
  computed the unfused way (one collective, then one matmul), for comparison.

The fused ops are ``torch.library`` custom ops (``torch.ops.torch_tp.all_gather_matmul`` /
``matmul_reduce_scatter``) with fake implementations and autograd, so they trace under
``torch.compile(fullgraph=True)`` as single nodes and train. ``b`` may be an
:class:`~torch_tp.quant.Int8SymmetricTensor`: the int8 bytes are consumed chunk by chunk.
In a model, use ``ColwiseParallel(overlap=True)`` / ``RowwiseParallel(overlap=True)``.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> from torch_tp.overlap import all_gather_matmul, matmul_reduce_scatter
    >>> x = torch.randn(2, 8, 64)                        # this rank's 8 tokens of the sequence
    >>> gathered, (h,) = all_gather_matmul(x, [w1.t()], gather_dim=1, group=mesh)
    >>> y = matmul_reduce_scatter(h, w2.t(), scatter_dim=1, group=mesh)   # back to 8 tokens
"""

from torch_tp.overlap import _int8_comm  # noqa: F401  (registers torch.ops.torch_tp.int8_* and the fused int8 ops)
from torch_tp.overlap.ops import *  # noqa: F401,F403  (the public functions; see ops.__all__)
from torch_tp.overlap.ops import __all__  # noqa: F401
