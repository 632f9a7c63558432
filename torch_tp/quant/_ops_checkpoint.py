"""Checkpoints of ``Int8SymmetricTensor`` weights: ``torch.save`` and ``torch.distributed.checkpoint``.

A quantized model saves and loads with the standard calls; the checkpoint holds the int8
``qdata`` and float32 ``scale`` (about a quarter of the float32 bytes), never floats:

| call | what happens to a quantized weight |
| --- | --- |
| ``torch.save(model.state_dict(), f)`` | pickled as the subclass: its two storages plus the logical dtype and the activation mode |
| ``torch.load(f, weights_only=True)`` | rebuilt bit for bit (``Int8SymmetricTensor`` is a safe global once ``torch_tp.quant`` is imported) |
| ``model.load_state_dict(sd)`` | ``copy_`` of ``qdata`` and ``scale`` into the model's quantized weight |
| ``dcp.save(model.state_dict(), checkpoint_id=dir)`` | DTensor hands DCP its local shard (an ``Int8SymmetricTensor``); DCP records the shard's logical offsets/sizes and writes it with ``torch.save`` |
| ``dcp.load(model.state_dict(), checkpoint_id=dir)`` | for each overlap of a saved shard and this rank's shard, DCP ``narrow``s both (``aten.slice``: slicing rows slices the scales, slicing columns keeps them whole) and ``copy_``s, in place |

So a checkpoint saved on one world size or placement loads on another (2 ranks to 4, 4 to
2, uneven shards, ``Shard(0)`` to ``Shard(1)`` or ``Replicate()``, an unsharded
``dcp.save`` into a sharded model): resharding is done by DCP on the logical tensor, with the
same slice rule DTensor uses for sharding.

Two ops here serve checkpoints: ``aten.is_pinned`` (DCP records it in each shard's
``TensorProperties``), and ``aten.copy_``, which ``load_state_dict`` and ``dcp.load`` use to
fill the model's weights. ``copy_`` replaces torchao's generic one to keep the destination's
logical dtype (as a plain ``copy_`` does) and to turn a quantized/float mismatch into a clear
``ValueError`` instead of an ``AttributeError`` from deep inside torchao. It also refuses a
source whose ``qdata`` is not int8 of the tensor's shape or whose ``scale`` is not float32
under the scale rule (:meth:`Int8SymmetricTensor.layout_problem`): a plain ``copy_`` would
broadcast the wrong-shaped ``qdata`` into every row or wrap a float one. ``load_state_dict``
reports the error under the parameter's key (``While copying the parameter named "..."``).

Why not a helper that saves ``qdata`` and ``scale`` as two separate DTensors: that needs a
torch_tp call on both sides and a scale DTensor whose placement must be derived from the
weight's (``Shard(1)`` weights keep whole scales, replicated on every rank), while DTensor
and DCP already reshard the subclass correctly through the ops it implements. Keeping the
subclass in the checkpoint also keeps the logical dtype and the scale layout with the data.

The activation mode (``activations``: ``"float"`` weight-only, ``"int8"`` W8A8) is saved
with each weight (DCP's shard files too: each is the pickled subclass) and is part of what
``copy_`` checks: loading into a weight of another mode raises ``ValueError`` naming both
modes, since the loaded model would otherwise compute differently from the saved one. The
int8 values do not depend on the mode, so to switch, load into a model quantized with the
checkpoint's mode, then ``quantize_`` it again with the other mode (it keeps the int8 values
and takes the new mode). A checkpoint saved before the mode existed loads as ``"float"``.

Limits: reading a checkpoint needs ``torch_tp.quant`` importable (the class is pickled by
name); a quantized checkpoint does not load into a float model, nor a float checkpoint into
a quantized one (``copy_`` between the two raises ``ValueError``: quantize the float model
before loading, or load floats then quantize); DCP's ``.metadata`` records the logical dtype
(float32 / bfloat16) of each weight, not int8.

Example::

    >>> import io
    >>> import torch.nn as nn
    >>> from torch_tp.quant import quantize_module_weight
    >>> layer = quantize_module_weight(nn.Linear(4, 3))
    >>> buffer = io.BytesIO()
    >>> torch.save(layer.state_dict(), buffer)
    >>> _ = buffer.seek(0)
    >>> loaded = torch.load(buffer, weights_only=True)["weight"]
    >>> type(loaded).__name__, torch.equal(loaded.qdata, layer.weight.qdata)
    ('Int8SymmetricTensor', True)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_tp.quant.int8_tensor import Int8SymmetricTensor, implements, int8_values_problem

__all__: list[str] = []

aten = torch.ops.aten


@implements(aten.is_pinned.default)
def _int8_is_pinned(func, types, args, kwargs):
    # Called by DCP for each tensor it saves (TensorProperties.pin_memory).
    self = args[0]
    return self.qdata.is_pinned() and self.scale.is_pinned()


def _describe(t: torch.Tensor) -> str:
    if isinstance(t, Int8SymmetricTensor):
        return (f"{type(t).__name__} of shape {tuple(t.shape)} (scale {tuple(t.scale.shape)}, "
                f"activations={t.activations!r})")
    return f"a plain {t.dtype} tensor of shape {tuple(t.shape)}"


def _fake_world() -> bool:
    """Under PyTorch's fake process group no collective fills a buffer: values are not data."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


def _require_valid_layouts(self: Int8SymmetricTensor, src: Int8SymmetricTensor) -> None:
    # copy_ would broadcast a qdata of the wrong shape into every row, and cast a float
    # qdata to int8 (wrapping): a tampered or foreign checkpoint must fail here instead.
    for tensor, role in ((src, "the source (the state dict's or checkpoint's value)"), (self, "the destination")):
        problem = tensor.layout_problem()
        if problem is None and tensor is src and not _fake_world():  # int8 data entering from a file: its values too
            problem = int8_values_problem(src.qdata, src.scale)
        if problem is not None:
            raise ValueError(
                f"copy_ into {_describe(self)} from {_describe(src)}: in {role}, {problem}. "
                f"It is not a valid {type(tensor).__name__}: save it again from a quantized model "
                f"(Int8SymmetricTensor.from_hp), or check the checkpoint's origin"
            )


@implements(aten.copy_.default)
def _int8_copy_(func, types, args, kwargs):
    # load_state_dict and dcp.load copy a saved weight (or a narrowed piece of one) into the
    # model's weight (or the matching view of its local shard).
    self, src = args[0], args[1]
    if not isinstance(self, Int8SymmetricTensor) or not isinstance(src, Int8SymmetricTensor):
        raise ValueError(
            f"copy_ into {_describe(self)} from {_describe(src)}: a quantized weight only copies "
            f"to and from a quantized weight. Loading a float state dict or checkpoint? Load it "
            f"into the float model, then quantize. Loading a quantized one into a float model? "
            f"Quantize the model first (Int8SymmetricWeightConfig), or copy src.dequantize()"
        )
    _require_valid_layouts(self, src)
    if self.activations != src.activations:
        raise ValueError(
            f"copy_ into {_describe(self)} from {_describe(src)}: the activation modes differ "
            f"(the source, e.g. a checkpoint, was quantized with activations={src.activations!r}). "
            f"Quantize the model with torch_tp.quant.Int8SymmetricWeightConfig(activations="
            f"{src.activations!r}) before loading; to switch modes afterwards, quantize_ it again "
            f"with the other mode (the int8 values are the same)"
        )
    if self.shape != src.shape or self.scale.shape != src.scale.shape:
        raise ValueError(
            f"copy_ into {_describe(self)} from {_describe(src)}: shapes or scale layouts differ"
        )
    self.qdata.copy_(src.qdata)
    self.scale.copy_(src.scale)
    return self
