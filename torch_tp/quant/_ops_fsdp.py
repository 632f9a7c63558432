"""FSDP2 of ``Int8SymmetricTensor`` weights: the all-gather moves int8 ``qdata`` and float32 ``scale``.

| what FSDP2 (``torch.distributed.fsdp.fully_shard``) calls | what happens here |
| --- | --- |
| ``torch.chunk`` / ``new_zeros`` / ``narrow`` + ``copy_`` (sharding the weight) | the shape ops of ``_ops_shape.py`` |
| ``view(-1)`` (its flat record of the padded shard) | an :class:`Int8FlatView`: the same bytes, flat, per-row scales kept |
| ``fsdp_pre_all_gather`` (each all-gather) | :func:`pre_all_gather`: the shard's ``qdata`` (and ``scale`` when sharded on rows), no float copy |
| ``fsdp_post_all_gather`` (after it) | :func:`post_all_gather`: the whole ``Int8SymmetricTensor`` around the gathered bytes, no copy, in the shard's activation mode |

FSDP2 shards a parameter on one dim (``Shard(0)`` unless a ``shard_placement_fn`` picks
another) and gathers it before the module's forward. A frozen int8 weight gathered as floats
would move 4 bytes per element; through the two hooks it moves 1 byte per element, plus one
float32 per row when sharded on its rows (dim 0, along which the scales vary). Sharded on its
columns, every data-parallel rank already holds all of its rows' scales, so only ``qdata``
travels and FSDP2 puts the columns in place itself. Either way the whole tensor is built around
FSDP2's own buffers, with no copy. Refused, with the shape and the remedy: a sharded dim that
does not divide by the dp size (FSDP2 would pad the last shard, and the scales cannot be padded
alike), and a transposed weight sharded along its scales' dim other than 0. Gradients: int8
weights are frozen (``requires_grad=False``), so FSDP2 reduce-scatters nothing for them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from torch_tp._tokens import dequantize_rows

from torch_tp.quant._torchao import import_torchao
from torch_tp.quant.int8_tensor import Int8SymmetricTensor, built_from_checked_data

__all__: list[str] = []

aten = torch.ops.aten
TorchAOBaseTensor = import_torchao("torchao.utils").TorchAOBaseTensor


class Int8FlatView(TorchAOBaseTensor):
    """``view(-1)`` of a per-row ``Int8SymmetricTensor``: ``qdata`` flat, ``scale`` still one per
    row (each row ``numel / rows`` consecutive elements). It aliases the original's bytes and
    supports only ``view`` back to a shape that keeps the rows, and ``dequantize()``.

    Example::

        >>> q = Int8SymmetricTensor.from_hp(torch.tensor([[127.0, 2.0], [3.0, -127.0]]))  # scales 1.0
        >>> flat = q.view(-1)
        >>> type(flat).__name__, tuple(flat.shape), torch.equal(flat.view(2, 2).qdata, q.qdata)
        ('Int8FlatView', (4,), True)
        >>> flat.dequantize()
        tensor([ 127.,    2.,    3., -127.])
    """

    tensor_data_names = ["qdata", "scale"]
    tensor_attribute_names = ["dtype"]
    #: the activation mode of the tensor it views (kept when it views back)
    optional_tensor_attribute_names = ["activations"]

    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, activations: str | None = "float"):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device,
                                                   requires_grad=False)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, activations: str | None = "float"):
        super().__init__()
        self.qdata = qdata
        self.scale = scale
        self.activations = "float" if activations is None else activations

    @property
    def rows(self) -> int:
        return self.scale.shape[0]

    def dequantize(self, output_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The flat float tensor this one stands for: the values the weight's own ``dequantize()``
        gives, element by element (the one rule, :func:`torch_tp._tokens.dequantize_rows`: within
        float32's range, where ``127 * (amax / 127)`` may round past ``amax``)."""
        rows = self.qdata.view(self.rows, -1) if self.rows else self.qdata.view(0, 0)
        return dequantize_rows(rows, self.scale.reshape(self.rows, 1), output_dtype or self.dtype).view(-1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(numel={self.numel()}, rows={self.rows}, dtype={self.dtype})"


def flatten(q: Int8SymmetricTensor) -> Int8FlatView:
    """``q.view(-1)`` for a tensor whose scales vary along dim 0 only."""
    return Int8FlatView(q.qdata.view(-1), q.scale, q.dtype, q.activations)


@Int8FlatView.implements([aten.view.default, aten._unsafe_view.default])
def _flat_view(func, types, args, kwargs):
    self, shape = args[0], list(args[1])
    if shape in ([-1], [self.numel()]):
        out = Int8FlatView(self.qdata, self.scale, self.dtype, self.activations)
        return return_and_correct_aliasing(func, args, kwargs, out) if func is aten.view.default else out
    if shape and shape[0] == self.rows and self.rows and _numel(shape) == self.numel():
        scale = self.scale.reshape([self.rows] + [1] * (len(shape) - 1))
        # another class: no aliasing fix
        return Int8SymmetricTensor(func(self.qdata, shape), scale, self.dtype, activations=self.activations)
    raise ValueError(
        f"{type(self).__name__}.view{tuple(shape)}: a flat view of {self.rows} rows views back only to a "
        f"shape whose first dim is the rows"
    )


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


# --------------------------------------------------------------------------------------------
# The FSDP2 all-gather extension
# --------------------------------------------------------------------------------------------


def _fsdp_shard_dim(local: Int8SymmetricTensor, outer_size: torch.Size) -> int:
    """The dim FSDP2 shards: where the shard is shorter than the parameter (0 if none is)."""
    shorter = [d for d in range(local.ndim) if local.shape[d] != outer_size[d]]
    return shorter[0] if shorter else 0


def pre_all_gather(local: Int8SymmetricTensor, mesh: Any, outer_size: torch.Size) -> tuple:
    """``(all-gather inputs, metadata)``: the shard's ``qdata`` and, if the scales vary along the
    sharded dim (rows), its ``scale``; otherwise every rank already holds all the scales, which
    ride in the metadata and are not sent.

    Raises:
        NotImplementedError: the sharded dim does not divide by the dp size, or it is a per-row
            dim other than 0 (a transposed weight sharded on its rows).
    """
    dim = _fsdp_shard_dim(local, outer_size)
    size = mesh.size()
    if outer_size[dim] % size:
        raise NotImplementedError(
            f"FSDP2 of an Int8SymmetricTensor of shape {tuple(outer_size)}: dim {dim} ({outer_size[dim]}) does "
            f"not divide by the {size} data-parallel ranks, so FSDP2 would pad the last shard, and its "
            f"per-row scales cannot be padded alike. Shard a dim that divides (shard_placement_fn), or "
            f"leave this weight out of the FSDP unit"
        )
    if not local.scale_follows(dim):
        return (local.qdata,), (tuple(outer_size), local.scale)
    if dim != 0:
        raise NotImplementedError(
            f"FSDP2 of an Int8SymmetricTensor of shape {tuple(outer_size)} sharded on dim {dim}, along which "
            f"its scales vary (scale {tuple(local.scale.shape)}): FSDP2 reassembles every gathered input as "
            f"if it had the weight's shape. Shard dim 0, or quantize the untransposed weight"
        )
    return (local.qdata, local.scale), (tuple(outer_size), None)


def post_all_gather(local: Int8SymmetricTensor, outputs: tuple, metadata: tuple, param_dtype: torch.dtype,
                    out: Optional[torch.Tensor]) -> Optional[tuple]:
    """The whole tensor: FSDP2 has put the gathered ``qdata`` shards in place (its buffer holds
    the weight's layout); ``scale`` is the gathered one, or the local one from the metadata.

    With ``out`` (FSDP2's later all-gathers, into the tensor the first one returned), the new
    bytes are already in ``out``'s buffers (FSDP2 reallocates and refills the same ones); a
    scale that changed since (a loaded state dict) is copied in.
    """
    outer_size, kept_scale = metadata
    qdata = outputs[0].view(outer_size)
    scale = outputs[1].view(-1, *outputs[1].shape[1:]) if kept_scale is None else kept_scale
    if out is not None:
        target = out.to_local() if hasattr(out, "to_local") else out
        for mine, new in ((target.qdata, qdata), (target.scale, scale)):
            if mine.data_ptr() != new.data_ptr():
                mine.copy_(new)
        return None
    with built_from_checked_data():  # the gathered bytes of checked shards
        return Int8SymmetricTensor(qdata, scale, param_dtype, activations=local.activations), list(outputs)


def _fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) -> tuple:
    """FSDP2's all-gather extension: gather ``qdata`` and ``scale``, not floats (:func:`pre_all_gather`)."""
    return pre_all_gather(self, mesh, outer_size)


def _fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    """FSDP2's all-gather extension: the whole tensor from the gathered bytes (:func:`post_all_gather`)."""
    return post_all_gather(self, all_gather_outputs, metadata, param_dtype, out)


# FSDP2 looks the extension up on the class; it registers onto the class from here, as the op
# tables do (int8_tensor.py imports no op module, so the package has no import cycle)
Int8SymmetricTensor.fsdp_pre_all_gather = _fsdp_pre_all_gather
Int8SymmetricTensor.fsdp_post_all_gather = _fsdp_post_all_gather
