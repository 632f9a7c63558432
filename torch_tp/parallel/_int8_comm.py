"""``comm_dtype=torch.int8`` on the styles: their sequence-parallel collectives move int8.

``ColwiseParallel(input_layouts=Shard(1), comm_dtype=torch.int8)`` gathers its input with
``torch.ops.torch_tp.int8_all_gather`` and runs ``nn.Linear``'s matmul on the local weight shard
(siblings reading one input share the gather: :mod:`torch_tp.parallel._shared_input`);
``RowwiseParallel(output_layouts=Shard(1), comm_dtype=torch.int8)`` reduce-scatters its partial
sums with ``torch.ops.torch_tp.int8_reduce_scatter`` in its output hook. With ``overlap=True``
the fused forwards of :mod:`torch_tp.parallel._overlap` call the fused int8 ops instead. The ops,
what they move and their error: :mod:`torch_tp.overlap._int8_comm`.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> parallelize_module(model, mesh, tensor_parallel_plan(sequence_parallel=True, comm_dtype=torch.int8))
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import torch_tp.overlap  # noqa: F401  (registers torch.ops.torch_tp.int8_*)
from torch_tp._layouts import agreed_dtensor, finish_output, packed_dtensor, redistribute_to, replace_forward, to_dtensor
from torch_tp.parallel import rules
from torch_tp.parallel._shared_input import shared_input_of

__all__ = ["install_colwise", "install_rowwise_output"]


# ------------------------------------------------------------------ the styles' forwards


def _colwise_forward(module: nn.Linear, x, *, device_mesh: DeviceMesh, layout: Shard, group_name: str, module_path,
                     packed: int = 1):
    """``ColwiseParallel(comm_dtype=torch.int8)``: the sequence-sharded input gathered as int8,
    then ``nn.Linear``'s matmul on the local weight shard; the output is the DTensor the float
    layer gives (``Shard(-1)``; with ``packed=k`` the packed shard, each part's slice)."""
    raw = rules.require_first_input((x,), module, module_path, "ColwiseParallel")
    what = f"ColwiseParallel(comm_dtype=torch.int8) on {rules.describe(module, module_path)}"
    x = redistribute_to(raw, layout) if isinstance(raw, DTensor) else agreed_dtensor(raw, device_mesh, layout, what=what)
    dim = layout.dim % x.ndim
    _require_even(x, dim, device_mesh.size(), what)
    shared = shared_input_of(module)  # wq/wk/wv (w1/w3): one int8 gather, one reduce-scatter back
    gather = lambda: torch.ops.torch_tp.int8_all_gather(x.to_local(), dim, group_name)  # noqa: E731
    whole = gather() if shared is None else shared.converted(module, raw, gather)
    bias = None if module.bias is None else module.bias.to_local()
    y = F.linear(whole, module.weight.to_local(), bias)
    if packed > 1:
        return packed_dtensor(y, device_mesh, rules.packed_shard(y.ndim - 1, packed), (*y.shape[:-1], module.out_features))
    return to_dtensor(y, device_mesh, Shard(y.ndim - 1), sharded_dim_size=module.out_features)


def install_colwise(module: nn.Linear, device_mesh: DeviceMesh, *, layout: Shard, module_path, packed: int = 1) -> None:
    """Install the forward of ``ColwiseParallel(comm_dtype=torch.int8)`` (no input pre-hook:
    the forward annotates a plain input as ``layout`` itself; ``packed``: the weight's parts)."""
    replace_forward(module, _colwise_forward, device_mesh=device_mesh, layout=layout,
                    group_name=device_mesh.get_group().group_name, module_path=module_path, packed=packed)


def _rowwise_output(module, inputs, output, *, device_mesh: DeviceMesh, layout: Shard, use_local_output: bool,
                    group_name: str, module_path):
    """``RowwiseParallel(comm_dtype=torch.int8)``'s output hook: the partial sums reduce-scattered
    as int8 along the sequence; the output gradient arrives whole on every rank (its int8
    all-gather), which is each rank's partial sum's gradient."""
    what = f"RowwiseParallel(comm_dtype=torch.int8) on {rules.describe(module, module_path)}"
    if tuple(output.placements) != (Partial(),):
        raise RuntimeError(
            f"torch_tp.parallel._int8_comm: {what}: the layer's output is {output.placements}, not the partial "
            f"sums the int8 reduce-scatter takes; use comm_dtype=None for this module"
        )
    dim = layout.dim % output.ndim
    _require_even(output, dim, device_mesh.size(), what)
    y = torch.ops.torch_tp.int8_reduce_scatter(output.to_local(grad_placements=(Replicate(),)), dim, group_name)
    return finish_output(to_dtensor(y, device_mesh, Shard(dim), sharded_dim_size=output.shape[dim]), use_local_output)


def install_rowwise_output(module: nn.Module, device_mesh: DeviceMesh, *, layout: Shard, use_local_output: bool,
                           module_path) -> None:
    """Register the output hook of ``RowwiseParallel(comm_dtype=torch.int8)``."""
    module.register_forward_hook(partial(
        _rowwise_output, device_mesh=device_mesh, layout=layout, use_local_output=use_local_output,
        group_name=device_mesh.get_group().group_name, module_path=module_path,
    ))


def _require_even(x: DTensor, dim: int, ranks: int, what: str) -> None:
    """The int8 collectives move equal pieces: a sequence the ranks cannot split evenly is
    refused on every rank alike (the global shape is agreed) before anything is sent."""
    if x.shape[dim] % ranks:
        raise ValueError(
            f"{what}: the sequence (dim {dim}) has {x.shape[dim]} positions, which {ranks} ranks cannot split "
            f"evenly; the int8 collectives move equal pieces: pad the sequence to a multiple of {ranks}, "
            f"or use comm_dtype=None"
        )
