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

Sibling Colwise layers that read one input (wq/wk/wv, w1/w3) form a :class:`SharedGather`
when they are parallelized together: by one plan entry under one parent in
``parallelize_module``, or passed together to :func:`torch_tp.functional.colwise`. The
group is explicit; the input is only compared to check that a member really reads the
input the group was computed on.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import torch_tp.overlap  # noqa: F401  (registers torch.ops.torch_tp.*)
from torch_tp._layouts import agreed_dtensor, redistribute_to, replace_forward, same_input, to_dtensor
from torch_tp._module_state import ensure_state, state_of
from torch_tp.parallel import rules
from torch_tp.parallel._empty_linear import empty_sequence_linear

__all__ = ["SharedGather", "install_colwise", "install_rowwise", "share_gather"]


# ------------------------------------------------------------------ colwise


def _fused_colwise_outputs(layers: list[nn.Linear], x: DTensor, dim: int, group_name: str) -> list[DTensor]:
    """Each layer's output on ``x`` (sharded on ``dim``), from one fused all-gather + matmul
    (moving int8 tokens for ``comm_dtype=torch.int8``)."""
    weights = [layer.weight.to_local() for layer in layers]
    fused = torch.ops.torch_tp.int8_all_gather_matmul if state_of(layers[0]).int8_comm else torch.ops.torch_tp.all_gather_matmul
    _, ys = fused(x.to_local(), [w.t() for w in weights], dim, group_name)
    outputs = []
    for layer, y in zip(layers, ys):
        if layer.bias is not None:
            y = y + layer.bias.to_local()
        outputs.append(to_dtensor(y, x.device_mesh, Shard(x.ndim - 1), sharded_dim_size=layer.out_features))
    return outputs


class SharedGather:
    """Sibling ``ColwiseParallel(overlap=True)`` layers that read one input share one fused all-gather.

    The first member called computes every member's output with one ``all_gather_matmul``
    (``bs`` = all their weights); each other member called on the same input takes its
    output from there. So the input is gathered once, as in the unfused plan, and the
    backward reduce-scatters the members' input gradients in one fused call too.

    A member called on another input (or twice before its siblings took their outputs)
    computes the group again: correct, but the earlier work for the members not yet served
    was wasted, so it warns. Give layers that read different inputs ``overlap=False`` or
    parallelize them separately.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> torch_tp.functional.colwise([attn.wq, attn.wk, attn.wv], mesh,
        ...                             input_layouts=Shard(1), overlap=True)   # one SharedGather
    """

    def __init__(self, members: list[nn.Linear], where: str):
        self.members = members
        self.where = where
        self.input: torch.Tensor | None = None
        self.pending: list[DTensor | None] | None = None

    def output(self, index: int, raw: torch.Tensor, x: DTensor, dim: int, group_name: str) -> DTensor:
        """Member ``index``'s output on ``x`` (made of ``raw``): taken from the round, or a new round."""
        if self.pending is None or self.pending[index] is None or not same_input(raw, self.input):
            if self.pending is not None:
                self._warn_recomputed()
            self.input, self.pending = raw, _fused_colwise_outputs(self.members, x, dim, group_name)
        output, self.pending[index] = self.pending[index], None
        if all(p is None for p in self.pending):
            self.input = self.pending = None
        return output

    def _warn_recomputed(self) -> None:
        warnings.warn(
            f"torch_tp: the ColwiseParallel(overlap=True) layers under {self.where!r} share one "
            f"fused all-gather, but were not all called on the same input tensor; it was "
            f"computed again. Use overlap=False for layers that read different inputs",
            stacklevel=4,
        )


def share_gather(members: list[nn.Linear], where: str) -> list[SharedGather]:
    """Make overlapped Colwise ``members`` (siblings reading one input) share fused all-gathers.

    Members on one process group with one weight type (float, int8) form one
    :class:`SharedGather`; a member alone of its kind keeps its own gather.
    """
    by_kind: dict[tuple, list[nn.Linear]] = {}
    for member in members:
        by_kind.setdefault(state_of(member).overlap_key, []).append(member)
    groups = [SharedGather(kind, where) for kind in by_kind.values() if len(kind) > 1]
    for group in groups:
        for index, member in enumerate(group.members):
            state_of(member).shared_gather = (group, index)
    return groups


def _colwise_forward(module, x, *, device_mesh: DeviceMesh, layout: Shard, group_name: str, module_path):
    raw = rules.require_first_input((x,), module, module_path, "ColwiseParallel")
    # a plain input is this rank's shard: the ranks agree on the whole tensor's shape before the
    # ring sends pieces whose sizes come from it (different sizes abort gloo mid-ring)
    what = f"ColwiseParallel(overlap=True) on {rules.describe(module, module_path)}"
    x = raw if isinstance(raw, DTensor) else agreed_dtensor(raw, device_mesh, layout, what=what)
    if tuple(x.placements) == (Replicate(),):  # already gathered upstream: nothing left to fuse
        return F.linear(x, module.weight, module.bias)
    dim = rules.overlap_leading_dim(layout, x, "ColwiseParallel", module, module_path)
    x = redistribute_to(x, Shard(dim))
    if x.numel() == 0:  # the ring needs rows: no sequences give the empty product, nothing sent
        return empty_sequence_linear(module, x, dim, "sharded features")
    shared = state_of(module).shared_gather
    if shared is not None:
        group, index = shared
        return group.output(index, raw, x, dim, group_name)
    return _fused_colwise_outputs([module], x, dim, group_name)[0]


def install_colwise(module: nn.Linear, device_mesh: DeviceMesh, *, layout: Shard, module_path,
                    int8_comm: bool = False) -> None:
    """Install the fused ``forward`` of ``ColwiseParallel(overlap=True)`` (``int8_comm``: its
    ``comm_dtype=torch.int8``, the ring moving int8 tokens).

    No input pre-hook: the forward annotates a plain input as ``layout`` itself (the gather
    happens inside the fused op), so siblings can compare the very inputs they were given.
    """
    group_name = device_mesh.get_group().group_name
    replace_forward(module, _colwise_forward, device_mesh=device_mesh, layout=layout,
                    group_name=group_name, module_path=module_path)
    state = ensure_state(module)
    state.overlap_key = (group_name, layout, type(module.weight.to_local()), int8_comm)
    state.shared_gather = None
    state.int8_comm = int8_comm


# ------------------------------------------------------------------ rowwise


def _rowwise_forward(module, x, *, layout: Shard, group_name: str, module_path, int8_comm: bool = False):
    dim = rules.overlap_leading_dim(layout, x, "RowwiseParallel", module, module_path)
    if x.numel() == 0:  # as in _colwise_forward
        return empty_sequence_linear(module, x, dim, "sharded sequence")
    weight = module.weight.to_local()
    if int8_comm:
        y = torch.ops.torch_tp.matmul_int8_reduce_scatter(x.to_local(), weight.t(), dim, group_name)
    else:
        y = torch.ops.torch_tp.matmul_reduce_scatter(x.to_local(), weight.t(), dim, group_name, "sum")
    if module.bias is not None:
        # the bias is added once, after the reduction: each rank's gradient is a partial sum
        y = y + module.bias.to_local(grad_placements=(Partial(),))
    return to_dtensor(y, x.device_mesh, Shard(dim), sharded_dim_size=x.shape[dim])


def install_rowwise(module: nn.Linear, device_mesh: DeviceMesh, *, layout: Shard, module_path,
                    int8_comm: bool = False) -> None:
    """Install the fused ``forward`` of ``RowwiseParallel(overlap=True)`` (the input pre-hook is the
    usual one; ``int8_comm``: its ``comm_dtype=torch.int8``, the partial sums travel as int8)."""
    group_name = device_mesh.get_group().group_name
    replace_forward(module, _rowwise_forward, layout=layout, group_name=group_name, module_path=module_path,
                    int8_comm=int8_comm)
