"""Collectives of ``Int8SymmetricTensor``: int8 ``qdata`` and float32 ``scale`` travel separately.

| op | the DTensor path that reaches it |
| --- | --- |
| ``_c10d_functional.all_gather_into_tensor`` | ``redistribute(Shard -> Replicate)``, ``full_tensor()`` |
| ``_c10d_functional.wait_tensor`` | waiting on the functional collective above (already done) |
| ``_c10d_functional._wrap_tensor_autograd`` | the async wrapper funcol puts around results |
| ``c10d.scatter_`` | ``distribute_tensor(..., [Shard(d)], src_data_rank=r)`` |
| ``c10d.broadcast_`` | ``distribute_tensor(..., [Replicate()], src_data_rank=r)`` |
| ``all_reduce`` / ``reduce_scatter_tensor`` | not supported: they need int8 arithmetic |

Gathering bytes instead of floats is the point: a weight sharded by rows (``Shard(0)``: a
Colwise weight) moves ``numel`` int8 bytes plus one float32 per row, about a quarter of the
float32 traffic; one sharded by features (``Shard(1)``: a Rowwise weight) moves only its
``numel`` int8 bytes, because every rank already holds every row's scale
(``Int8SymmetricTensor.layout_flags``: its pieces were cut from one tensor with whole rows).

The all-gather is one collective, waited before it returns: each rank's ``qdata`` and the
bytes of its ``scale`` travel packed in one int8 buffer, unpacked on arrival. In torch 2.13,
two functional all-gathers in flight at once over gloo corrupt the heap (glibc's ``malloc():
unaligned tcache chunk detected``, or SIGSEGV, within seconds of back-to-back gathers;
``tests/launch/gloo_gathers_in_flight.py`` shows it without torch_tp), and the int8 gather used to be
two of them (``qdata``, then ``scale``, waited later through an ``AsyncCollectiveTensor``):
the suite's rare aborts at an int8 ``full_tensor()``. One waited collective leaves nothing in
flight past this function.
"""

from __future__ import annotations

import torch

from torch_tp.quant.int8_tensor import Int8SymmetricTensor, implements

__all__: list[str] = []

funcol = torch.ops._c10d_functional
c10d = torch.ops.c10d


@implements(funcol.all_gather_into_tensor.default)
def _int8_all_gather(func, types, args, kwargs):
    self, group_size, group_name = args
    if not self.scale_follows(0):
        raise NotImplementedError(
            f"all-gather along dim 0 of an {type(self).__name__} whose scales broadcast over "
            f"dim 0 (scale {tuple(self.scale.shape)}): shard the untransposed weight instead"
        )
    if self.shared_scale:  # a feature shard (Rowwise): every rank holds this scale, only qdata travels
        gathered = funcol.wait_tensor(func(self.qdata.contiguous(), group_size, group_name))
        return self.with_data(gathered, self.scale.repeat(group_size, *[1] * (self.scale.ndim - 1)))
    packed = torch.cat([self.qdata.reshape(-1), self.scale.reshape(-1).view(torch.int8)])
    gathered = funcol.wait_tensor(func(packed, group_size, group_name)).view(group_size, -1)
    return self.with_data(*_unpacked(gathered, self.qdata.shape, self.scale.shape))


def _unpacked(gathered: torch.Tensor, qdata_shape: torch.Size, scale_shape: torch.Size):
    """``(qdata, scale)`` stacked on dim 0 in rank order, from the ``(ranks, bytes)`` rows that
    :func:`_int8_all_gather` packed (each row: one rank's ``qdata``, then its ``scale`` bytes)."""
    ranks, split = gathered.shape[0], qdata_shape.numel()
    qdata = gathered[:, :split].reshape(ranks * qdata_shape[0], *qdata_shape[1:])
    scale = gathered[:, split:].contiguous().view(torch.float32)
    return qdata, scale.reshape(ranks * scale_shape[0], *scale_shape[1:])


@implements(funcol.wait_tensor.default)
def _int8_wait(func, types, args, kwargs):
    # The gather above waited already; a wait on its result (funcol's wrapper) is a no-op.
    return args[0]


@implements(funcol._wrap_tensor_autograd.default)
def _int8_wrap_async(func, types, args, kwargs):
    # As for plain tensors, funcol wraps the result; it is complete, so its first use waits
    # on nothing.
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return AsyncCollectiveTensor(args[0])


def _unsupported_reduction(func, types, args, kwargs):
    raise NotImplementedError(
        f"{func} on {Int8SymmetricTensor.__name__}: reductions would need int8 arithmetic. "
        f"Reduce float activations or gradients instead, or dequantize() explicitly"
    )


for _op in (funcol.all_reduce.default, funcol.reduce_scatter_tensor.default):
    implements(_op)(_unsupported_reduction)


def _parts(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [t.qdata for t in tensors], [t.scale for t in tensors]


@implements(c10d.broadcast_.default)
def _int8_broadcast_(func, types, args, kwargs):
    tensors, group, root_rank, root_tensor = args[:4]
    qdatas, scales = _parts(tensors)
    _, work = func(qdatas, group, root_rank, root_tensor, False, *args[5:])
    work.wait()
    _, work = func(scales, group, root_rank, root_tensor, False, *args[5:])
    return tensors, work


@implements(c10d.scatter_.default)
def _int8_scatter_(func, types, args, kwargs):
    outputs, inputs, group, root_rank = args[:4]
    out_q, out_s = _parts(outputs)
    in_q = [[t.qdata for t in row] for row in inputs]
    in_s = [[t.scale for t in row] for row in inputs]
    _, work = func(out_q, in_q, group, root_rank, False, *args[5:])
    work.wait()
    _, work = func(out_s, in_s, group, root_rank, False, *args[5:])
    return outputs, work
