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

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from torch_tp._layouts import shard_sizes

__all__ = ["empty_sequence_linear", "flatten_empty_input", "restore_empty_output"]


# the leading dims of each input the pre-hook flattened, by the flattened tensor it handed on (only
# inputs of no elements are ever here: a layer with real inputs runs its hooks without side effects,
# which torch.compile's checkpointed regions require)
# (by id: set by the pre-hook, popped by the hook of the same call)
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
    if not (isinstance(x, DTensor) and x.numel() == 0 and x.ndim > 2
            and all(p.is_replicate() or p.is_shard(x.ndim - 1) for p in x.placements)):
        return None
    flat = _relabelled(x, (0, x.shape[-1]))
    _LEADING[id(flat)] = tuple(x.shape[:-1])
    return (flat, *args[1:])


def restore_empty_output(module, args, output):
    """Forward hook: the output of an input :func:`flatten_empty_input` flattened, its leading dims back."""
    leading = _LEADING.pop(id(args[0]), None) if args and isinstance(args[0], DTensor) and args[0].numel() == 0 else None
    if leading is None or not isinstance(output, DTensor):
        return None
    return _relabelled(output, (*leading, output.shape[-1]))


def _relabelled(x: DTensor, shape: tuple[int, ...]) -> DTensor:
    """``x`` (no elements, replicated or sharded along its last dim) as ``shape`` (same last dim), by a
    local reshape: DTensor's own view of it may never return."""
    local = x.to_local()
    placements = [Shard(len(shape) - 1) if p.is_shard() else p for p in x.placements]  # the last dim's, moved
    return DTensor.from_local(local.reshape(*shape[:-1], local.shape[-1]), x.device_mesh, placements,
                              run_check=False, shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def empty_sequence_linear(module: nn.Linear, x: DTensor, dim: int, output: str) -> DTensor:
    """The fused forwards' result for an ``x`` of no elements sharded on the sequence ``dim``:
    ``output="sharded features"`` (Colwise: the gathered sequence, this rank's features) or
    ``"sharded sequence"`` (Rowwise: the summed features, this rank's chunk of the sequence).
    Nothing is sent; gradients reach ``x`` (empty ones)."""
    local = x.to_local()
    bias = None if module.bias is None else module.bias.to_local()
    # 0, on the graph of x, the weight and the bias: the empty result's gradients (zeros) reach them
    anchor = F.linear(local, module.weight.to_local(), bias).sum()
    if output == "sharded features":
        shape = (*x.shape[:-1], module.out_features)
        features = module.weight.to_local().shape[0]
        piece = local.new_zeros((*x.shape[:-1], features)) + anchor
        return _labelled(piece, x, Shard(x.ndim - 1), shape)
    shape = (*x.shape[:-1], module.out_features)
    mesh = x.device_mesh
    mine = shard_sizes(x.shape[dim], mesh.size())[mesh.get_local_rank()]  # torch.chunk's piece
    piece = local.new_zeros((*shape[:dim], mine, *shape[dim + 1:])) + anchor
    return _labelled(piece, x, Shard(dim), shape)


def _labelled(local: torch.Tensor, x: DTensor, placement, shape) -> DTensor:
    return DTensor.from_local(local, x.device_mesh, (placement,), run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())
