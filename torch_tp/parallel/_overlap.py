"""``ColwiseParallel(overlap=True)`` / ``RowwiseParallel(overlap=True)``: fused forwards for nn.Linear.

A sequence-parallel Colwise layer normally all-gathers its input (a redistribution in its
pre-hook) and then runs ``F.linear`` on the replicated input; with ``overlap=True`` its
``forward`` calls :func:`torch.ops.torch_tp.all_gather_matmul` on the local shards instead.
A Rowwise layer whose output is sequence-sharded normally multiplies and then
reduce-scatters in its post-hook; with ``overlap=True`` its ``forward`` calls
:func:`torch.ops.torch_tp.matmul_reduce_scatter`. Either way the result is the DTensor the
unfused layer would produce (same placements, same global shape), so the hooks after it,
gradients and ``torch.compile`` see no difference. Weights may be
:class:`~torch_tp.quant.Int8SymmetricTensor`.

The new ``forward`` is set on the instance (``module.forward``), which ``nn.Module``
calls in place of the class's.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

import torch_tp.overlap  # noqa: F401  (registers torch.ops.torch_tp.*)
from torch_tp.parallel import _checks
from torch_tp.parallel._layouts import redistribute_to, to_dtensor

__all__ = [
    "check_overlap_layout",
    "install_colwise_overlap",
    "install_rowwise_overlap",
    "require_overlap_module",
]


def check_overlap_layout(layout: Placement | None, argument: str, style: str, what: str) -> None:
    """Raise ``ValueError`` unless ``layout`` is ``Shard(d)`` on a dim other than the last (-1)."""
    if type(layout) is Shard and layout.dim != -1:
        return
    raise ValueError(
        f"{style}(overlap=True) fuses the {what} of a sequence-sharded activation into the "
        f"matmul, so it needs {argument}=Shard(d) on a leading dim (e.g. Shard(1), the "
        f"sequence); got {argument}={layout!r}. Use overlap=False for other layouts"
    )


def require_overlap_module(module: nn.Module, style: str, module_path: str | None) -> None:
    """Raise ``UnsupportedModuleError`` unless ``module`` is an ``nn.Linear`` (what overlap fuses)."""
    if not isinstance(module, nn.Linear):
        raise _checks.UnsupportedModuleError(
            f"{style}(overlap=True) cannot handle {_checks.describe(module, module_path)}: it fuses "
            f"an nn.Linear's matmul with its communication; use overlap=False for this module"
        )


def _leading_dim(layout: Shard, x: DTensor, style: str, module, module_path) -> int:
    dim = layout.dim % x.ndim
    if dim == x.ndim - 1:
        raise ValueError(
            f"{style}(overlap=True) on {_checks.describe(module, module_path)}: dim {layout.dim} of "
            f"the {x.ndim}-D activation is its feature dim; shard a leading dim (the sequence)"
        )
    world = x.device_mesh.size()
    if x.shape[dim] % world:
        raise ValueError(
            f"{style}(overlap=True) on {_checks.describe(module, module_path)}: dim {dim} of the "
            f"activation has size {x.shape[dim]}, which does not split evenly over {world} ranks; "
            f"the fused ops exchange equal chunks. Pad it to a multiple of {world}, or use overlap=False"
        )
    return dim


# ------------------------------------------------------------------ colwise


def _colwise_overlapped_forward(module, layout: Shard, group_name: str, module_path, x):
    if not isinstance(x, DTensor):
        raise TypeError(
            f"ColwiseParallel(overlap=True) on {_checks.describe(module, module_path)} expected its "
            f"pre-hook to hand it a DTensor, got {type(x).__name__}"
        )
    if tuple(x.placements) == (Replicate(),):  # already gathered upstream: nothing left to fuse
        return F.linear(x, module.weight, module.bias)
    dim = _leading_dim(layout, x, "ColwiseParallel", module, module_path)
    x = redistribute_to(x, Shard(dim))
    weight = module.weight.to_local()
    _, (y,) = torch.ops.torch_tp.all_gather_matmul(x.to_local(), [weight.t()], dim, group_name)
    if module.bias is not None:
        y = y + module.bias.to_local()
    return to_dtensor(y, x.device_mesh, Shard(x.ndim - 1), sharded_dim_size=module.out_features)


def _keep_dtensor_input(device_mesh, input_layout, module_path, module, args):
    if not args:
        raise TypeError(f"ColwiseParallel on {_checks.describe(module, module_path)} got no input")
    x = _checks.require_tensor_input(
        args[0], "0", module, module_path, "ColwiseParallel", _checks.TENSOR_INPUT_FIX
    )
    if isinstance(x, DTensor):
        return None
    return (DTensor.from_local(x, device_mesh, (input_layout,), run_check=False), *args[1:])


def install_colwise_overlap(module: nn.Linear, device_mesh: DeviceMesh, input_layout: Shard, module_path) -> None:
    """Install the input pre-hook and the fused ``forward`` of ``ColwiseParallel(overlap=True)``.

    The pre-hook only annotates a plain input as ``input_layout`` (no redistribution:
    the gather happens inside the fused op).
    """
    module.register_forward_pre_hook(partial(_keep_dtensor_input, device_mesh, input_layout, module_path))
    group_name = device_mesh.get_group().group_name
    module.forward = partial(_colwise_overlapped_forward, module, input_layout, group_name, module_path)


# ------------------------------------------------------------------ rowwise


def _rowwise_overlapped_forward(module, layout: Shard, group_name: str, module_path, x):
    dim = _leading_dim(layout, x, "RowwiseParallel", module, module_path)
    weight = module.weight.to_local()
    y = torch.ops.torch_tp.matmul_reduce_scatter(x.to_local(), weight.t(), dim, group_name, "sum")
    if module.bias is not None:
        # the bias is added once, after the reduction: each rank's gradient is a partial sum
        y = y + module.bias.to_local(grad_placements=(Partial(),))
    return to_dtensor(y, x.device_mesh, Shard(dim), sharded_dim_size=x.shape[dim])


def install_rowwise_overlap(module: nn.Linear, device_mesh: DeviceMesh, output_layout: Shard, module_path) -> None:
    """Install the fused ``forward`` of ``RowwiseParallel(overlap=True)`` (the input pre-hook is the usual one)."""
    group_name = device_mesh.get_group().group_name
    module.forward = partial(_rowwise_overlapped_forward, module, output_layout, group_name, module_path)
