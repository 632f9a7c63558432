"""A DTensor handler for ``aten.constant_pad_nd`` that keeps a padded sharded dim sharded.

| op | reached by | the handler |
| --- | --- | --- |
| ``constant_pad_nd.default`` | ``F.pad(mode="constant")``, ``nn.ZeroPad*d`` / ``nn.ConstantPad*d``, a convolution with ``padding="same"`` and an even kernel (and its backward: the same op with the pads negated) | :func:`constant_pad_handler` |

Installed by a ``SpatialParallel`` model that needs it, or for every op by :func:`sharded_padding`
(:mod:`torch_tp.conv._registry`).

Padding a dim that is ``Shard(d)`` moves the ``torch.chunk`` boundaries: width 16 on 2 ranks
is strips ``[0, 8)``, ``[8, 16)``; padded by ``(0, 1)`` it is 17 wide and the strips are
``[0, 9)``, ``[9, 17)``, so rank 0 needs one column of rank 1's. DTensor's own rule for the op
replicates a padded dim (it all-gathers the whole strip). Here each rank receives exactly the
columns its new strip covers from the ranks that hold them (:mod:`torch_tp.conv._ranges`, one
batch of P2P ops, a few columns per rank) and adds the constant where its strip lies in the
padding. Negative pads crop, by the same rule, so the op's autograd (``constant_pad_nd`` with
the pads negated) is exact too. Dims that are not sharded are padded locally.

This is how an even kernel's ``padding="same"`` takes the halo path: aten pads the input by the
one extra column on the right (this op), then convolves with symmetric padding (the halo
handler of :mod:`torch_tp.conv.sharded_conv`). timm's TF-"same" convolutions (``F.pad`` with
computed pads) and ``nn.ZeroPad2d`` go the same way. Reflection and replication padding are
other ops and keep DTensor's behaviour.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from torch_tp.conv import sharded_convolution, sharded_padding
    >>> x = distribute_tensor(torch.randn(1, 3, 8, 16), mesh, [Shard(3)])    # width on 2 ranks
    >>> with sharded_convolution(), sharded_padding():
    ...     y = F.conv2d(x, w, padding="same")                                 # w: [4, 3, 4, 4]
    >>> y.placements                                                           # never gathered
    (Shard(dim=3),)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from torch_tp._layouts import shard_bounds
from torch_tp.conv._core import bind, without_partials, wrap
from torch_tp.conv._ranges import _gather, _ranges
from torch_tp.conv._registry import HandlerSet

__all__ = ["constant_pad_handler", "install", "is_installed", "sharded_padding", "uninstall"]

aten = torch.ops.aten
# an even kernel's padding="same" pads the strip before the convolution: keep it sharded
HANDLERS = HandlerSet("torch_tp.conv.padding", serves=(nn.Conv1d, nn.Conv2d, nn.Conv3d))


def _pads_per_dim(ndim: int, pad: Sequence[int]) -> dict[int, tuple[int, int]]:
    """``F.pad``'s flat ``pad`` (last dim first, ``(left, right)`` pairs) as ``{dim: (left, right)}``.

    Example:
        >>> _pads_per_dim(4, [0, 1, 2, 3])
        {3: (0, 1), 2: (2, 3)}
    """
    return {ndim - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}


def _sharded_mesh_dims(x: DTensor, d: int) -> list[int]:
    return [m for m, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim % x.ndim == d]


def _check_placements(x: DTensor, padded: list[int]) -> None:
    """Refuse what the range exchange cannot express, naming the placements."""
    for m, p in enumerate(x.placements):
        if isinstance(p, Shard) and type(p) is not Shard:
            raise NotImplementedError(
                f"sharded constant_pad_nd supports plain Shard(d), Replicate() and Partial(); mesh dim {m} "
                f"of the input is {p}"
            )
    for d in padded:
        if len(_sharded_mesh_dims(x, d)) > 1:
            raise NotImplementedError(
                f"sharded constant_pad_nd: dim {d} is padded and sharded over mesh dims "
                f"{_sharded_mesh_dims(x, d)} of {x.placements}; shard it over one mesh dim"
            )


def _repad_sharded_dim(local: torch.Tensor, x: DTensor, d: int, mesh_dim: int, pads: tuple[int, int],
                       value: float) -> torch.Tensor:
    """This rank's strip of the padded dim ``d``: the original positions it covers, gathered from
    their holders, with ``value`` where it covers the padding (negative pads: cropped away)."""
    mesh, (left, right) = x.device_mesh, pads
    size, n = x.shape[d], mesh.size(mesh_dim)
    new_bounds = shard_bounds(size + left + right, n)
    needs = [(min(max(a - left, 0), size), max(min(b - left, size), 0)) for a, b in new_bounds]
    needs = [(lo, max(lo, hi)) for lo, hi in needs]
    strip = _gather(local, d, _ranges(mesh, mesh_dim, shard_bounds(size, n), needs))
    a, b = new_bounds[mesh.get_local_rank(mesh_dim)]
    before = min(max(left - a, 0), b - a)  # positions below 0 in original coordinates
    after = b - a - before - strip.shape[d]
    if before == 0 and after == 0:
        return strip
    return F.pad(strip, [0, 0] * (strip.ndim - 1 - d) + [before, after], value=value)


@HANDLERS.implements(aten.constant_pad_nd.default)
def constant_pad_handler(op_call: Any, args: tuple, kwargs: dict) -> DTensor:
    """DTensor handler for ``aten.constant_pad_nd.default``: ``args`` = ``(input, pad, value)``.

    Returns a DTensor with the input's placements (``Partial`` reduced first when ``value`` is
    not 0) and the padded global shape; a padded sharded dim stays sharded, each rank holding
    the ``torch.chunk`` strip of the padded length.

    Raises:
        NotImplementedError: a padded dim sharded over two mesh dims, or a ``Shard`` subclass.

    Example:
        >>> # xdoctest: +SKIP("needs a process group; install() routes F.pad on DTensors here")
        >>> x = distribute_tensor(torch.randn(1, 2, 4, 16), mesh, [Shard(3)])   # 2 ranks: 8 + 8
        >>> y = constant_pad_handler(aten.constant_pad_nd.default, (x, [0, 1]), {})
        >>> y.shape, y.to_local().shape                                      # rank 0: 9 columns
        (torch.Size([1, 2, 4, 17]), torch.Size([1, 2, 4, 9]))
    """
    x, pad, value = bind(args, kwargs, ("input", "pad", "value"))
    value = 0 if value is None else value
    pads = {d: lr for d, lr in _pads_per_dim(x.ndim, pad).items() if lr != (0, 0)}
    _check_placements(x, list(pads))
    if value != 0:  # each rank's partial would add a non-zero constant once more; zeros pad a sum exactly
        x = without_partials(x)
    local, sharded = x.to_local(), {}
    local_pad = list(pad)
    for d, lr in pads.items():
        mesh_dims = _sharded_mesh_dims(x, d)
        if mesh_dims:
            sharded[d] = (mesh_dims[0], lr)
            i = x.ndim - 1 - d
            local_pad[2 * i : 2 * i + 2] = [0, 0]
    for d, (mesh_dim, lr) in sharded.items():
        local = _repad_sharded_dim(local, x, d, mesh_dim, lr, value)
    if any(local_pad):
        local = aten.constant_pad_nd.default(local, local_pad, value)
    out_shape = list(x.shape)
    for d, (left, right) in pads.items():
        out_shape[d] += left + right
    return wrap(local, x.device_mesh, x.placements, out_shape)


# --------------------------------------------------------------------------------------------
# Installation
# --------------------------------------------------------------------------------------------

install, uninstall, is_installed, sharded_padding = HANDLERS.public_functions("sharded_padding", "constant padding")
