"""Shape ops of ``Int8SymmetricTensor``: each applies to ``qdata`` and, by the scale rule, to ``scale``.

Every result keeps the tensor's logical dtype (unless ``.to(dtype)`` changes it) and its
activation mode (``activations``); ``cat`` refuses pieces whose modes differ.

| op | the DTensor / nn.Module path that reaches it |
| --- | --- |
| ``slice.Tensor`` (``narrow``) | uneven shards (unpadding), ``Shard`` local views |
| ``split.Tensor`` (``chunk``) | ``distribute_tensor`` with ``Shard``; all-gather on dim != 0 |
| ``cat`` | all-gather on dim != 0 (chunk + cat) |
| ``view`` / ``_unsafe_view`` (``reshape``) | ``DTensor.from_local``, flattening; ``view(-1)`` (FSDP2) gives an ``Int8FlatView`` (``_ops_fsdp.py``) |
| ``t`` / ``transpose.int`` | the ``F.linear`` decomposition (``x @ w.t()``) |
| ``expand`` (new leading dims only) | ``F.linear`` on a batched input that cannot fold to 2-D: matmul broadcasts the weight for ``bmm`` (``_ops_matmul.py``) |
| ``as_strided`` (identity only) | ``torch.compile`` returning an input's alias (``detach()``) |
| ``constant_pad_nd`` | padding uneven shards before a scatter / all-gather |
| ``empty_like`` / ``new_empty`` | receive buffers of scatter / broadcast |
| ``new_zeros`` | ``distribute_tensor`` with ``Shard`` when ``torch.chunk`` leaves a rank nothing (5 rows on 4 ranks: 2, 2, 1, 0) |
| ``_to_copy`` | ``.to(device)``, ``.to(dtype)`` (changes the logical dtype only) |
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from torch_tp.quant._ops_fsdp import flatten
from torch_tp.quant.int8_tensor import Int8SymmetricTensor, implements

__all__: list[str] = []

aten = torch.ops.aten


_SLICE_DEFAULTS = (None, 0, None, None, 1)  # slice.Tensor(self, dim=0, start=None, end=None, step=1)


@implements(aten.slice.Tensor)
def _int8_slice(func, types, args, kwargs):
    self, dim, start, end, step = tuple(args) + _SLICE_DEFAULTS[len(args):]
    dim = dim % self.ndim
    qdata = aten.slice.Tensor(self.qdata, dim, start, end, step)
    scale = self.scale
    if self.scale_follows(dim):
        scale = aten.slice.Tensor(self.scale, dim, start, end, step)
    return return_and_correct_aliasing(func, args, kwargs, self.with_data(qdata, scale, **self.piece_flags(dim)))


@implements(aten.split.Tensor)
def _int8_split(func, types, args, kwargs):
    self, split_size = args[0], args[1]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % self.ndim
    pieces = aten.split.Tensor(self.qdata, split_size, dim)
    if self.scale_follows(dim):
        scales = aten.split.Tensor(self.scale, split_size, dim)
    else:
        scales = [self.scale] * len(pieces)
    return [self.with_data(q, s, **self.piece_flags(dim)) for q, s in zip(pieces, scales)]


def _scales_agree(scales: list[torch.Tensor]) -> bool:
    if torch.compiler.is_compiling() or scales[0].device.type == "meta":
        return True
    return all(torch.equal(scales[0], s) for s in scales[1:])


@implements(aten.cat.default)
def _int8_cat(func, types, args, kwargs):
    tensors, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
    first = tensors[0]
    if not all(isinstance(t, Int8SymmetricTensor) and (t.dtype, t.activations) == (first.dtype, first.activations)
               for t in tensors):
        raise NotImplementedError(
            f"cat of {Int8SymmetricTensor.__name__} with other tensors, dtypes or activation modes "
            f"({sorted({getattr(t, 'activations', 'a plain tensor') for t in tensors})}); quantize them alike first"
        )
    dim = dim % first.ndim
    qdata = aten.cat.default([t.qdata for t in tensors], dim)
    if first.scale_follows(dim):
        scale = aten.cat.default([t.scale for t in tensors], dim)
    else:
        scales = [t.scale for t in tensors]
        if not _scales_agree(scales):
            raise ValueError(
                f"cat along dim {dim} joins pieces of the same rows, whose scales must be equal; "
                f"these pieces were quantized separately (re-quantize the joined float tensor)"
            )
        scale = scales[0]
    return first.with_data(qdata, scale)


def _resolve_shape(shape, numel: int) -> list[int]:
    shape = list(shape)
    if -1 in shape:
        known = 1
        for size in shape:
            if size != -1:
                known *= size
        shape[shape.index(-1)] = numel // known if known else 0
    return shape


def _merges_broadcast_dims(q: Int8SymmetricTensor, shape: list[int]) -> bool:
    """Whether ``view(shape)`` only merges or splits leading dims that are broadcast (stride 0 in
    ``qdata`` and ``scale``: an ``expand`` for matmul's batch), keeping the matrix dims."""
    return (q.ndim > 2 and len(shape) >= 2 and list(shape[-2:]) == list(q.shape[-2:])
            and all(t.stride(d) == 0 for t in (q.qdata, q.scale) for d in range(q.ndim - 2)))


def _per_row_on_dim0_only(q: Int8SymmetricTensor) -> bool:
    return q.scale_follows(0) and not any(q.scale_follows(d) for d in range(1, q.ndim) if q.shape[d] != 1)


@implements([aten.view.default, aten._unsafe_view.default])
def _int8_view(func, types, args, kwargs):
    self, shape = args[0], _resolve_shape(args[1], args[0].numel())
    flags = {}
    if list(shape) == list(self.shape):
        qdata, scale, flags = func(self.qdata, shape), self.scale, self.layout_flags()
    elif len(shape) == 1 and self.ndim > 1 and _per_row_on_dim0_only(self):
        # FSDP2's flat record of a shard: the same bytes, per-row scales kept, of another class
        # (return_and_correct_aliasing requires the input's; FSDP2 builds it eagerly, at init)
        return flatten(self)
    elif _merges_broadcast_dims(self, shape):
        # one weight broadcast over a batch (matmul of a batched input): the batch is regrouped
        qdata = func(self.qdata, shape)
        scale = self.scale.reshape(*shape[:-2], *self.scale.shape[-2:])
    elif _per_row_on_dim0_only(self) and shape and shape[0] == self.shape[0]:
        # per-row scale on dim 0: the features of each row may be reshaped freely
        qdata = func(self.qdata, shape)
        scale = self.scale.reshape([self.shape[0]] + [1] * (len(shape) - 1))
    else:
        raise ValueError(
            f"{type(self).__name__}.view{tuple(shape)} from shape {tuple(self.shape)} would mix "
            f"elements of rows that have different scales (scale shape {tuple(self.scale.shape)}); "
            f"only views that keep dim 0 (the rows) are supported — dequantize() first for others"
        )
    out = self.with_data(qdata, scale, **flags)
    return return_and_correct_aliasing(func, args, kwargs, out) if func is aten.view.default else out


@implements(aten.t.default)
def _int8_t(func, types, args, kwargs):
    self = args[0]
    out = self.with_data(self.qdata.t(), self.scale.t())
    return return_and_correct_aliasing(func, args, kwargs, out)


@implements(aten.transpose.int)
def _int8_transpose(func, types, args, kwargs):
    self, dim0, dim1 = args
    out = self.with_data(self.qdata.transpose(dim0, dim1), self.scale.transpose(dim0, dim1))
    return return_and_correct_aliasing(func, args, kwargs, out)


@implements(aten.expand.default)
def _int8_expand(func, types, args, kwargs):
    """New leading (batch) dims, the rows and their scales broadcast together (stride 0)."""
    self, size = args[0], list(args[1])
    new, kept = size[:len(size) - self.ndim], size[len(size) - self.ndim:]
    if any(s not in (-1, d) for s, d in zip(kept, self.shape)) or any(s < 0 for s in new):
        raise NotImplementedError(
            f"torch_tp.quant.{type(self).__name__}: expand{tuple(size)} of shape {tuple(self.shape)} "
            f"would broadcast its own dims (only new leading dims are supported: matmul's batch). "
            f"Use weight.dequantize() for other broadcasts"
        )
    out = self.with_data(self.qdata.expand(*new, *self.shape), self.scale.expand(*new, *self.scale.shape))
    return return_and_correct_aliasing(func, args, kwargs, out)


@implements(aten.as_strided.default)
def _int8_as_strided(func, types, args, kwargs):
    # AOTAutograd rebuilds a compiled function's output that is a view of one of its inputs
    # as ``input.as_strided(out.size(), out.stride(), out.storage_offset())``. Only the
    # identity (``detach()``, ``view`` to the same shape) keeps rows and scales together.
    self, size, stride = args[0], args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if (tuple(size) == tuple(self.shape) and tuple(stride) == tuple(self.stride())
            and offset in (None, self.storage_offset())):
        return aten.alias.default(self)
    raise NotImplementedError(
        f"as_strided{tuple(size), tuple(stride), offset} of {type(self).__name__} "
        f"{tuple(self.shape)}: a strided view cannot carry the per-row scales. Under "
        f"torch.compile this comes from returning a view of an input (w.t(), w[2:5]); "
        f"return a copy (.clone()) instead"
    )


@implements(aten.constant_pad_nd.default)
def _int8_pad(func, types, args, kwargs):
    self, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    if value != 0:
        raise NotImplementedError(f"padding {type(self).__name__} with {value} (only zero padding)")
    qdata = aten.constant_pad_nd.default(self.qdata, pad, 0)
    scale_pad = []
    for i in range(0, len(pad), 2):  # pad lists (left, right) pairs from the last dim backwards
        dim = self.ndim - 1 - i // 2
        scale_pad += pad[i:i + 2] if self.scale_follows(dim) else [0, 0]
    scale = aten.constant_pad_nd.default(self.scale, scale_pad, 1.0)
    # Padding features keeps the rows and their scale: the flags stay, as on the ranks whose
    # uneven shard needs no padding (a gather's size must not depend on the rank).
    rows_padded = any(scale_pad)
    return self.with_data(qdata, scale, **({} if rows_padded else self.layout_flags()))


@implements(aten.empty_like.default)
def _int8_empty_like(func, types, args, kwargs):
    self = args[0]
    device = kwargs.get("device") or self.device
    return self.with_data(torch.empty_like(self.qdata, device=device), torch.empty_like(self.scale, device=device),
                          **self.layout_flags())


@implements(aten.new_empty.default)
def _int8_new_empty(func, types, args, kwargs):
    self, size = args[0], args[1]
    device = kwargs.get("device") or self.device
    qdata = torch.empty(size, dtype=torch.int8, device=device)
    scale = torch.empty(self.scale_shape_for(size), dtype=self.scale.dtype, device=device)
    return self.with_data(qdata, scale)


@implements(aten.new_zeros.default)
def _int8_new_zeros(func, types, args, kwargs):
    # torch's fill_empty_tensor_to_shards builds the empty pieces as shards[0].new_zeros(size).
    # qdata 0 is zero under any scale: a piece of the same rows (an empty feature shard) keeps
    # their scales, so that it joins its siblings (cat along a shared dim needs equal scales);
    # other shapes get scale 1, as zeros quantize to (the all-zero row rule of quantize_per_row).
    self, size = args[0], args[1]
    device = kwargs.get("device") or self.device
    qdata = torch.zeros(size, dtype=torch.int8, device=device)
    scale_shape = self.scale_shape_for(size)
    if scale_shape == self.scale.shape:  # an empty piece of the same rows: the flags of its siblings
        scale, flags = self.scale.to(device, copy=True), self.layout_flags()
    else:
        scale, flags = torch.ones(scale_shape, dtype=self.scale.dtype, device=device), {"whole_rows": False}
    return type(self)(qdata, scale, _logical_dtype(self, kwargs, "new_zeros"), **flags, activations=self.activations)


def _logical_dtype(self: Int8SymmetricTensor, kwargs, op: str) -> torch.dtype:
    dtype = kwargs.get("dtype") or self.dtype
    if not dtype.is_floating_point:
        raise NotImplementedError(
            f"{type(self).__name__}.{op}(dtype={dtype}): the logical dtype must stay floating point; "
            f"read .qdata for the int8 values"
        )
    return dtype


@implements(aten._to_copy.default)
def _int8_to_copy(func, types, args, kwargs):
    self = args[0]
    device = kwargs.get("device") or self.device
    out = type(self)(self.qdata.to(device), self.scale.to(device), _logical_dtype(self, kwargs, "to"),
                     self.whole_rows, self.shared_scale, self.activations)
    return return_and_correct_aliasing(func, args, kwargs, out)
