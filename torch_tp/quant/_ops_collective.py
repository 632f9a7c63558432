"""Collectives of ``Int8SymmetricTensor``: int8 ``qdata`` and float32 ``scale`` travel separately.

| op | the DTensor path that reaches it |
| --- | --- |
| ``_c10d_functional.all_gather_into_tensor`` | ``redistribute(Shard -> Replicate)``, ``full_tensor()`` |
| ``_c10d_functional.wait_tensor`` | waiting on the functional collective above |
| ``_c10d_functional._wrap_tensor_autograd`` | the async wrapper funcol puts around results |
| ``c10d.scatter_`` | ``distribute_tensor(..., [Shard(d)], src_data_rank=r)`` |
| ``c10d.broadcast_`` | ``distribute_tensor(..., [Replicate()], src_data_rank=r)`` |
| ``all_reduce`` / ``reduce_scatter_tensor`` | not supported: they need int8 arithmetic |

Gathering bytes instead of floats is the point: a gathered weight moves
``numel`` int8 bytes plus one float32 per row, about a quarter of the float32 traffic.
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
    qdata = func(self.qdata, group_size, group_name)
    scale = func(self.scale, group_size, group_name)
    return self.with_data(qdata, scale)


@implements(funcol.wait_tensor.default)
def _int8_wait(func, types, args, kwargs):
    self = args[0]
    return self.with_data(func(self.qdata), func(self.scale))


@implements(funcol._wrap_tensor_autograd.default)
def _int8_wrap_async(func, types, args, kwargs):
    # As for plain tensors: wrap the not-yet-waited result; its first use waits on it
    # (wait_tensor above), so communication can overlap the code in between.
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
