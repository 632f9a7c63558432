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

import warnings
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
    "SharedGather",
    "check_overlap_layout",
    "link_shared_gathers",
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


def _fused_colwise_outputs(layers: list[nn.Linear], x: DTensor, dim: int, group_name: str) -> list[DTensor]:
    """Each layer's output on ``x`` (sharded on ``dim``), from one fused all-gather + matmul."""
    weights = [layer.weight.to_local() for layer in layers]
    _, ys = torch.ops.torch_tp.all_gather_matmul(x.to_local(), [w.t() for w in weights], dim, group_name)
    outputs = []
    for layer, y in zip(layers, ys):
        if layer.bias is not None:
            y = y + layer.bias.to_local()
        outputs.append(to_dtensor(y, x.device_mesh, Shard(x.ndim - 1), sharded_dim_size=layer.out_features))
    return outputs


class SharedGather:
    """Sibling ``ColwiseParallel(overlap=True)`` layers that read one input share one fused all-gather.

    ``parallelize_module`` links the overlapped Colwise children of one module that have the
    same mesh, input layout and weight type (wq/wk/wv, w1/w3). The first of them called on a DTensor
    computes every member's output with one ``all_gather_matmul`` (``bs`` = all their
    weights); a member later called on the *same* DTensor object takes its output from
    there. So the input is gathered once, as in the unfused plan, and the backward
    reduce-scatters the members' input gradients in one fused call too.

    A member called on another tensor (or before its siblings' outputs were all taken)
    computes the group again: correct, but the earlier work for the members not yet served
    was wasted, so it warns. Give layers that read different inputs ``overlap=False``
    or different parents.
    """

    def __init__(self, members: list[nn.Linear], where: str):
        self.members = members
        self.where = where
        self.key: DTensor | None = None
        self.pending: list[DTensor | None] | None = None
        self.plain_input: torch.Tensor | None = None  # a plain input and the DTensor made of it

    def annotate(self, x: torch.Tensor, device_mesh: DeviceMesh, layout: Shard) -> DTensor:
        """``x`` as a DTensor with ``layout``; the same DTensor for the same plain ``x`` within a round."""
        if self.pending is not None and self.plain_input is x:
            return self.key
        self.plain_input = x
        return DTensor.from_local(x, device_mesh, (layout,), run_check=False)

    def output(self, index: int, x: DTensor, dim: int, group_name: str) -> DTensor:
        """Member ``index``'s output on ``x``: computed for the whole group, or taken from it."""
        if self.pending is None or self.key is not x or self.pending[index] is None:
            if self.pending is not None:
                self._warn_recomputed()
            self.key, self.pending = x, _fused_colwise_outputs(self.members, x, dim, group_name)
        output, self.pending[index] = self.pending[index], None
        if all(p is None for p in self.pending):
            self.key = self.pending = self.plain_input = None
        return output

    def _warn_recomputed(self) -> None:
        warnings.warn(
            f"torch_tp: the ColwiseParallel(overlap=True) layers under {self.where!r} share one "
            f"fused all-gather, but were not all called on the same input tensor; it was "
            f"computed again. Use overlap=False for layers that read different inputs",
            stacklevel=3,
        )


def link_shared_gathers(root: nn.Module) -> list[SharedGather]:
    """Group the overlapped Colwise children of each module of ``root`` (see :class:`SharedGather`)."""
    groups = []
    for path, parent in root.named_modules():
        by_key: dict[tuple, list[nn.Linear]] = {}
        for child in parent.children():
            key = getattr(child, "_torch_tp_overlap_colwise", None)
            if key is not None:
                by_key.setdefault(key, []).append(child)
        for members in by_key.values():
            group = SharedGather(members, path) if len(members) > 1 else None
            for index, member in enumerate(members):
                member._torch_tp_shared_gather = None if group is None else (group, index)
            if group is not None:
                groups.append(group)
    return groups


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
    shared = module._torch_tp_shared_gather
    if shared is not None:
        group, index = shared
        return group.output(index, x, dim, group_name)
    return _fused_colwise_outputs([module], x, dim, group_name)[0]


def _keep_dtensor_input(device_mesh, input_layout, module_path, module, args):
    if not args:
        raise TypeError(f"ColwiseParallel on {_checks.describe(module, module_path)} got no input")
    x = _checks.require_tensor_input(
        args[0], "0", module, module_path, "ColwiseParallel", _checks.TENSOR_INPUT_FIX
    )
    if isinstance(x, DTensor):
        return None
    shared = module._torch_tp_shared_gather
    if shared is not None:  # siblings given the same plain tensor must see the same DTensor
        return (shared[0].annotate(x, device_mesh, input_layout), *args[1:])
    return (DTensor.from_local(x, device_mesh, (input_layout,), run_check=False), *args[1:])


def install_colwise_overlap(module: nn.Linear, device_mesh: DeviceMesh, input_layout: Shard, module_path) -> None:
    """Install the input pre-hook and the fused ``forward`` of ``ColwiseParallel(overlap=True)``.

    The pre-hook only annotates a plain input as ``input_layout`` (no redistribution:
    the gather happens inside the fused op).
    """
    module.register_forward_pre_hook(partial(_keep_dtensor_input, device_mesh, input_layout, module_path))
    group_name = device_mesh.get_group().group_name
    module.forward = partial(_colwise_overlapped_forward, module, input_layout, group_name, module_path)
    # siblings with the same key may share one fused gather (link_shared_gathers)
    module._torch_tp_overlap_colwise = (group_name, input_layout, type(module.weight.to_local()))
    module._torch_tp_shared_gather = None


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
