"""Linear layers on an input of no elements: the empty product on this rank's pieces.

A batch of no sequences is a real input (the last, empty shard of a dataset; a rank with nothing
to score). One process returns an empty output; DTensor's view rule loops forever flattening a
``(0, S, K)`` input with ``S == K`` (``view_groups`` in torch 2.13's
``torch/distributed/tensor/_ops/_view_ops.py``), and the fused overlap rings need rows. So the
linear styles hand such an input to the layer as ``(0, K)``, reshaped on this rank's piece
(:func:`flatten_empty_input`, :func:`restore_empty_output`), and the fused forwards return the empty product without sending
(:func:`empty_sequence_linear`).
Found by ``tests/parallel/test_fuzz_plans.py``.
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from torch_tp._layouts import packed_dtensor, shard_sizes

__all__ = ["empty_sequence_linear", "flatten_empty_input", "restore_empty_output"]


# the leading dims of each input the pre-hook flattened, by the id of the flattened tensor it handed
# on, popped by the hook of the same call. Only inputs of no elements are ever here: a layer with
# real inputs runs its hooks without side effects, which torch.compile's checkpointed regions require
_LEADING: dict[int, tuple[int, ...]] = {}


def flatten_empty_input(module, args):
    """Forward pre-hook: an input of no elements (replicated or sharded along its last dim) handed
    to the layer as ``(0, K)``, this rank's piece reshaped, nothing sent; others pass untouched.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> layer.register_forward_pre_hook(flatten_empty_input)
        >>> layer.register_forward_hook(restore_empty_output)
    """
    x = args[0] if args else None
    if not (isinstance(x, DTensor) and x.numel() == 0 and x.ndim > 2 and len(x.placements) == 1
            and (x.placements[0].is_replicate() or x.placements[0].is_shard(x.ndim - 1))):
        return None
    flat = _relabelled(x, (0, x.shape[-1]))
    _LEADING[id(flat)] = tuple(x.shape[:-1])
    return (flat, *args[1:])


def restore_empty_output(module, args, output):
    """Forward hook: the output of an input :func:`flatten_empty_input` flattened, its leading dims back."""
    flat = args[0] if args else None
    if not (isinstance(flat, DTensor) and flat.numel() == 0 and isinstance(output, DTensor)):
        return None
    leading = _LEADING.pop(id(flat), None)
    if leading is None:
        return None
    return _relabelled(output, (*leading, output.shape[-1]))


def _relabelled(x: DTensor, shape: tuple[int, ...]) -> DTensor:
    """``x`` (no elements, on a 1-D mesh, replicated or sharded along its last dim) as ``shape``
    (same last dim), by a local reshape: DTensor's own view of it may never return."""
    local = x.to_local()
    (placement,) = x.placements
    placement = Shard(len(shape) - 1) if placement.is_shard() else placement  # the last dim's, moved
    return packed_dtensor(local.reshape(*shape[:-1], local.shape[-1]), x.device_mesh, placement, shape)


def empty_sequence_linear(module: nn.Linear, x: DTensor, dim: int, output: str) -> DTensor:
    """The fused forwards' result for an ``x`` of no elements sharded on the sequence ``dim``:
    ``output="sharded features"`` (Colwise: the gathered sequence, this rank's features) or
    ``"sharded sequence"`` (Rowwise: the summed features, this rank's chunk of the sequence).
    Nothing is sent; gradients reach ``x`` (empty ones)."""
    local, weight = x.to_local(), module.weight.to_local()
    bias = None if module.bias is None else module.bias.to_local()
    # 0, on the graph of x, the weight and the bias: the empty result's gradients (zeros) reach them
    anchor = F.linear(local, weight, bias).sum()
    shape = (*x.shape[:-1], module.out_features)
    piece = list(shape)
    if output == "sharded features":
        placement, piece[-1] = Shard(x.ndim - 1), weight.shape[0]
    else:
        mesh = x.device_mesh
        placement, piece[dim] = Shard(dim), shard_sizes(x.shape[dim], mesh.size())[mesh.get_local_rank()]
    return packed_dtensor(local.new_zeros(piece) + anchor, x.device_mesh, placement, shape)
