"""Tensor-parallel transformations as plain functions: the one implementation of every style.

Each function takes a module and a 1-D mesh, turns the module's parameters into DTensors,
installs the forward hooks that convert inputs/outputs, and returns the same module
(like every ``torch.nn`` transform, it works in place). The ``ParallelStyle`` classes in
:mod:`torch_tp.parallel.style` only store these keyword arguments and call these functions.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> from torch_tp.parallel import functional as F_tp
    >>> F_tp.colwise(model.ffn.w1, mesh)        # weight Shard(0), output Shard(-1)
    >>> F_tp.rowwise(model.ffn.w2, mesh)        # weight Shard(1), output Replicate()

``module_path`` is only used in error messages (``parallelize_module`` passes the path the
plan matched).
"""

from __future__ import annotations

import types
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from torch_tp import conv
from torch_tp.parallel import _checks, _overlap
from torch_tp.parallel.rules import (
    BOTH_STAGES,
    check_colwise,
    check_prepare_input,
    check_prepare_output,
    check_rowwise,
    check_sequence_parallel,
    check_spatial,
    colwise_placements,
    rowwise_placements,
    sequence_parallel_placements,
    spatial_placements,
    SPATIAL_BATCHNORMS,
    SPATIAL_CONVS,
)
from torch_tp.parallel._layouts import (
    finish_output,
    normalize_layouts,
    redistribute_to,
    shard_sizes,
    to_dtensor,
)
from torch_tp.parallel._prepare import install_input_hook, install_output_hook

__all__ = [
    "colwise",
    "rowwise",
    "sequence_parallel",
    "spatial",
    "prepare_input",
    "prepare_output",
    "prepare_input_output",
    "replicate",
]

_BOTH = BOTH_STAGES
_TENSOR_INPUT_FIX = _checks.TENSOR_INPUT_FIX


# ------------------------------------------------------------------- colwise / rowwise


def _distribute_parameters(module, placements, device_mesh, src_data_rank) -> None:
    for path, placement in placements.items():
        owner_path, _, name = path.rpartition(".")
        owner = module.get_submodule(owner_path)
        param = getattr(owner, name)
        dparam = distribute_tensor(param, device_mesh, [placement], src_data_rank=src_data_rank)
        owner.register_parameter(name, nn.Parameter(dparam, requires_grad=param.requires_grad))


def _redistribute_output(output_layout, use_local_output, module, inputs, output):
    return finish_output(redistribute_to(output, output_layout), use_local_output)


def _sharded_module_input(
    device_mesh, input_layout, desired_layout, sharded_dim_size, module_path, style, module, args
):
    if args and isinstance(args[0], DTensor) and args[0].placements == (desired_layout,):
        return None  # already in place (e.g. after PrepareModuleInput): leave the args as they are
    if not args:
        raise TypeError(f"{style} on {_checks.describe(module, module_path)} got no input")
    x = _checks.require_tensor_input(args[0], "0", module, module_path, style, _TENSOR_INPUT_FIX)
    size = sharded_dim_size if _shards_last_dim(input_layout, x.ndim) else None
    x = to_dtensor(x, device_mesh, input_layout, sharded_dim_size=size)
    return (redistribute_to(x, desired_layout), *args[1:])


def _shards_last_dim(layout: Placement, ndim: int) -> bool:
    return isinstance(layout, Shard) and layout.dim % ndim == ndim - 1


def colwise(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    input_layouts: Placement | None = None,
    output_layouts: Placement | None = None,
    use_local_output: bool = True,
    overlap: bool = False,
    src_data_rank: int | None = 0,
    module_path: str | None = None,
) -> nn.Module:
    """Shard an ``nn.Linear``'s output features (or an ``nn.Embedding``'s embedding dim).

    The weight becomes ``Shard(0)`` (Linear; bias too) or ``Shard(1)`` (Embedding). The
    input, annotated with ``input_layouts`` (default ``Replicate()``), is redistributed to
    ``Replicate()``; the output, sharded on its last dim, is redistributed to
    ``output_layouts`` (default ``Shard(-1)``) and returned as a local tensor when
    ``use_local_output``.

    ``overlap=True`` (an ``nn.Linear`` whose input is sequence-sharded,
    ``input_layouts=Shard(d)``): the input all-gather is fused into the matmul
    (:func:`torch_tp.overlap.all_gather_matmul`), each chunk's transfer overlapping the
    previous chunk's matmul. Same output, same gradients.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> colwise(model.w1, mesh)
        >>> model.w1.weight.placements
        (Shard(dim=0),)
    """
    check_colwise(module, device_mesh, module_path, overlap=overlap)
    input_layout = input_layouts or Replicate()
    output_layout = output_layouts or Shard(-1)
    if overlap:
        _overlap.check_overlap_layout(input_layout, "input_layouts", "ColwiseParallel", "all-gather")
    _distribute_parameters(module, colwise_placements(module), device_mesh, src_data_rank)
    if overlap:
        _overlap.install_colwise_overlap(module, device_mesh, input_layout, module_path)
    else:
        module.register_forward_pre_hook(
            partial(
                _sharded_module_input,
                device_mesh, input_layout, Replicate(), None, module_path, "ColwiseParallel",
            )
        )
    module.register_forward_hook(partial(_redistribute_output, output_layout, use_local_output))
    _checks.mark_prepared(module, _BOTH, "ColwiseParallel")
    return module


def rowwise(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    input_layouts: Placement | None = None,
    output_layouts: Placement | None = None,
    use_local_output: bool = True,
    overlap: bool = False,
    src_data_rank: int | None = 0,
    module_path: str | None = None,
) -> nn.Module:
    """Shard an ``nn.Linear``'s input features (or an ``nn.Embedding``'s vocabulary).

    Linear: the weight becomes ``Shard(1)``, the bias ``Replicate()``, the input is
    expected sharded on its last dim (default ``input_layouts=Shard(-1)``). Embedding: the
    weight becomes ``Shard(0)`` and the token ids are replicated (default
    ``input_layouts=Replicate()``). The partial-sum output is reduced to
    ``output_layouts`` (default ``Replicate()``: an all-reduce; ``Shard(1)``: a
    reduce-scatter, for sequence parallelism).

    A local input whose last dim is unevenly sharded (a Colwise layer with 10 outputs on
    4 ranks hands over 3, 3, 3, 1 columns) is rebuilt with the Linear's true
    ``in_features``, so the global shape is right.

    ``overlap=True`` (an ``nn.Linear`` with ``output_layouts=Shard(d)``, sequence
    parallelism): the reduce-scatter is fused into the matmul
    (:func:`torch_tp.overlap.matmul_reduce_scatter`). Same output, same gradients.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> rowwise(model.w2, mesh, output_layouts=Shard(1))

    .. note:: For ``nn.Embedding`` the default input layout is ``Replicate()``: token ids
        are never split on their last dim. (Upstream applies ``Shard(-1)`` to every module
        type, which concatenates the ranks' sequences.)
    """
    check_rowwise(module, device_mesh, module_path, overlap=overlap)
    is_embedding = isinstance(module, nn.Embedding)
    desired = Replicate() if is_embedding else Shard(-1)
    input_layout = input_layouts or desired
    output_layout = output_layouts or Replicate()
    if overlap:
        _overlap.check_overlap_layout(output_layout, "output_layouts", "RowwiseParallel", "reduce-scatter")
    _distribute_parameters(module, rowwise_placements(module), device_mesh, src_data_rank)
    if overlap:
        _overlap.install_rowwise_overlap(module, device_mesh, output_layout, module_path)
    in_features = None if is_embedding else module.in_features
    module.register_forward_pre_hook(
        partial(
            _sharded_module_input,
            device_mesh, input_layout, desired, in_features, module_path, "RowwiseParallel",
        )
    )
    module.register_forward_hook(partial(_redistribute_output, output_layout, use_local_output))
    _checks.mark_prepared(module, _BOTH, "RowwiseParallel")
    return module


# ------------------------------------------------------------------- sequence parallel


def _sequence_input(layout, device_mesh, module_path, module, args):
    if not args:
        raise TypeError(f"SequenceParallel on {_checks.describe(module, module_path)} got no input")
    x = _checks.require_tensor_input(
        args[0], "0", module, module_path, "SequenceParallel", _TENSOR_INPUT_FIX
    )
    return (redistribute_to(to_dtensor(x, device_mesh, layout), layout), *args[1:])


def _local_output(use_local_output, module, inputs, output):
    return finish_output(output, use_local_output)


def sequence_parallel(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    sequence_dim: int = 1,
    use_local_output: bool = False,
    src_data_rank: int | None = 0,
    module_path: str | None = None,
) -> nn.Module:
    """Run a norm/dropout-like module on a sequence shard with replicated parameters.

    A plain-tensor input is taken to be this rank's slice of the sequence
    (``Shard(sequence_dim)``); a DTensor input in another layout is redistributed to it.
    Parameters are replicated by broadcasting from ``src_data_rank`` (so a custom init
    survives; with ``None`` each rank keeps its own values). Parameter gradients are
    summed over ranks by DTensor.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> sequence_parallel(model.norm, mesh)   # nn.LayerNorm, nn.RMSNorm, ...
    """
    check_sequence_parallel(module, device_mesh, module_path)
    _distribute_parameters(module, sequence_parallel_placements(module), device_mesh, src_data_rank)
    layout = Shard(sequence_dim)
    module.register_forward_pre_hook(partial(_sequence_input, layout, device_mesh, module_path))
    module.register_forward_hook(partial(_local_output, use_local_output))
    _checks.mark_prepared(module, _BOTH, "SequenceParallel")
    return module


# ------------------------------------------------------------------- spatial


def _spatial_dim(dim: int, ndim: int, module, module_path) -> int:
    if not -ndim <= dim < ndim or dim % ndim < 2:
        raise ValueError(
            f"SpatialParallel(dim={dim}) on {_checks.describe(module, module_path)}: the input has "
            f"{ndim} dims (N, C, ...), so dim must be a spatial dim, one of {list(range(2, ndim))}"
        )
    return dim % ndim


def _global_size(local: torch.Tensor, d: int, device_mesh, module, module_path) -> int:
    """Global size of dim ``d`` from every rank's local size; they must be ``torch.chunk`` pieces."""
    n = device_mesh.size()
    if n == 1:
        return local.shape[d]
    mine = torch.tensor([local.shape[d]], dtype=torch.int64, device=local.device)
    sizes = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(sizes, mine, group=device_mesh.get_group(0))
    sizes = [int(s.item()) for s in sizes]
    total = sum(sizes)
    expected = list(shard_sizes(total, n))
    if sizes != expected:
        raise ValueError(
            f"SpatialParallel on {_checks.describe(module, module_path)}: the ranks' inputs have "
            f"sizes {sizes} along dim {d} (global {total}), but Shard({d}) over {n} ranks means "
            f"torch.chunk pieces {expected}; split the input with torch.chunk (or pass the full "
            f"input with input_layouts=Replicate())"
        )
    return total


def _spatial_input(device_mesh, input_layout, dim, module_path, module, args):
    if not args:
        raise TypeError(f"SpatialParallel on {_checks.describe(module, module_path)} got no input")
    x = _checks.require_tensor_input(
        args[0], "0", module, module_path, "SpatialParallel", _TENSOR_INPUT_FIX
    )
    if isinstance(module, SPATIAL_CONVS) and not conv.is_installed():
        raise RuntimeError(
            f"SpatialParallel on {_checks.describe(module, module_path)}: the sharded convolution "
            f"handlers were uninstalled (torch_tp.conv.uninstall()); without them DTensor would "
            f"mislabel a padded convolution's output. Call torch_tp.conv.install()"
        )
    if isinstance(module, SPATIAL_CONVS) and x.ndim != module.weight.ndim:
        raise ValueError(
            f"SpatialParallel on {_checks.describe(module, module_path)} needs a batched "
            f"{module.weight.ndim}-D (N, C, ...) input, got {x.ndim} dims {tuple(x.shape)}"
        )
    desired = Shard(_spatial_dim(dim, x.ndim, module, module_path))
    if isinstance(x, DTensor):
        if tuple(x.placements) == (desired,):
            return None
        return (redistribute_to(x, desired), *args[1:])
    layout = input_layout or desired
    if type(layout) is Shard:
        layout = Shard(layout.dim % x.ndim)
        size = _global_size(x, layout.dim, device_mesh, module, module_path)
        x = to_dtensor(x, device_mesh, layout, sharded_dim_size=size)
    else:
        x = to_dtensor(x, device_mesh, layout)
    return (redistribute_to(x, desired), *args[1:])


def _batch_norm_eval_forward(self, x):
    # Eval-mode BatchNorm is a per-channel affine map: run it as pointwise DTensor ops so the
    # input stays sharded (DTensor's batch_norm rule would all-gather it) and the
    # replicated weight/bias get Partial gradients that DTensor sums over the ranks.
    if self.training:
        raise RuntimeError(
            f"SpatialParallel: {type(self).__name__} was switched to training mode after it was "
            f"parallelized; its batch statistics would be computed per shard. Keep it in eval mode"
        )
    shape = [1, -1] + [1] * (x.ndim - 2)
    mesh = x.device_mesh
    inv_std = torch.rsqrt(self.running_var.to(x.dtype) + self.eps)
    shift = -self.running_mean.to(x.dtype) * inv_std

    def replicated(t):
        return DTensor.from_local(t.reshape(shape), mesh, [Replicate()] * mesh.ndim, run_check=False)

    y = x * replicated(inv_std) + replicated(shift)
    if self.weight is not None:
        y = y * self.weight.reshape(shape)
    if self.bias is not None:
        y = y + self.bias.reshape(shape)
    return y


def spatial(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    dim: int,
    input_layouts: Placement | None = None,
    output_layouts: Placement | None = None,
    use_local_output: bool = False,
    src_data_rank: int | None = 0,
    module_path: str | None = None,
) -> nn.Module:
    """Run a convolution (or a position-wise module between convolutions) on a spatial shard.

    ``dim`` is the tensor dim of the (N, C, ...) input that is sharded, e.g. ``3`` or ``-1``
    for the width of NCHW. Parameters are replicated (broadcast from ``src_data_rank``);
    a plain-tensor input is taken as this rank's slice along ``dim`` (default
    ``input_layouts=Shard(dim)``; the global size is gathered, so uneven ``torch.chunk``
    pieces work) or as the full input (``input_layouts=Replicate()``: each rank keeps its
    slice). The output stays ``Shard(dim)`` (or is redistributed to ``output_layouts``)
    and is returned as a DTensor unless ``use_local_output``. The gradients of the
    replicated parameters come back summed over the ranks.

    Applying it to a convolution installs :mod:`torch_tp.conv`'s halo-exchange handlers
    (:func:`torch_tp.conv.install`, once; they stay installed), which compute each rank's
    exact part of the output. An eval-mode BatchNorm runs as a per-channel affine map on the
    shard; switching it back to training mode makes its forward raise.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> spatial(model.stem, mesh, dim=3)                  # width of NCHW
        >>> model.stem(torch.chunk(image, mesh.size(), dim=3)[rank]).placements
        (Shard(dim=3),)
    """
    check_spatial(module, device_mesh, module_path, dim=dim)
    _distribute_parameters(module, spatial_placements(module), device_mesh, src_data_rank)
    if isinstance(module, SPATIAL_CONVS) and not conv.is_installed():
        conv.install()
    if isinstance(module, SPATIAL_BATCHNORMS):
        module.forward = types.MethodType(_batch_norm_eval_forward, module)
    module.register_forward_pre_hook(
        partial(_spatial_input, device_mesh, input_layouts, dim, module_path)
    )
    module.register_forward_hook(
        partial(_redistribute_output, output_layouts or Shard(dim), use_local_output)
    )
    _checks.mark_prepared(module, _BOTH, "SpatialParallel")
    return module


# ------------------------------------------------------------------- replicate


def _replicated_inputs(device_mesh, module, args, kwargs):
    def convert(value):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return DTensor.from_local(value, device_mesh, (Replicate(),), run_check=False)
        return value

    return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}


def _local_outputs(module, inputs, output):
    if isinstance(output, DTensor):
        return output.to_local()
    if isinstance(output, tuple):
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in output)
    return output


def replicate(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    src_data_rank: int | None = 0,
    module_path: str | None = None,
) -> nn.Module:
    """Replicate ``module``'s own parameters as DTensors and run it on replicated inputs.

    This is what ``parallelize_module(..., replicate_unplanned_params=True)`` does to each
    module the plan leaves out, so every parameter of the model is a DTensor and
    ``clip_grad_norm_`` / optimizers see one kind of tensor. Plain-tensor inputs are taken
    to be identical on every rank (``Replicate()``); DTensor inputs pass through; DTensor
    outputs are handed back as local tensors. Only direct parameters are touched
    (children are left to their own styles). If another style already converts this
    module's inputs/outputs, only the parameters are replicated.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> replicate(model.norm, mesh)
        >>> model.norm.weight.placements
        (Replicate(),)
    """
    _checks.require_1d_mesh(device_mesh, "replicate")
    placements = {
        name: Replicate()
        for name, param in module.named_parameters(recurse=False)
        if not isinstance(param, DTensor)
    }
    _distribute_parameters(module, placements, device_mesh, src_data_rank)
    if getattr(module, _checks.APPLIED_ATTR, None):
        return module  # its inputs/outputs are already converted by its style
    module.register_forward_pre_hook(partial(_replicated_inputs, device_mesh), with_kwargs=True)
    module.register_forward_hook(_local_outputs)
    _checks.mark_prepared(module, _BOTH, "replicate")
    return module


# ------------------------------------------------------------------- prepare input/output


def prepare_input(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    input_layouts: Placement | tuple[Placement | None, ...] | None = None,
    desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
    input_kwarg_layouts: dict[str, Placement] | None = None,
    desired_input_kwarg_layouts: dict[str, Placement] | None = None,
    use_local_output: bool = False,
    module_path: str | None = None,
) -> nn.Module:
    """Convert a module's inputs to DTensors and redistribute them before ``forward`` runs.

    ``input_layouts[i]`` annotates positional input ``i`` (``None`` leaves it alone),
    ``desired_input_layouts[i]`` is the layout ``forward`` sees; the kwarg variants do the
    same by keyword. With ``use_local_output`` the module receives local tensors.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> prepare_input(block.attention, mesh,
        ...               input_layouts=(Shard(1), None),
        ...               desired_input_layouts=(Replicate(), None))
    """
    check_prepare_input(module, device_mesh, module_path)
    install_input_hook(
        module,
        device_mesh,
        input_layouts=normalize_layouts(input_layouts, "input_layouts"),
        desired_input_layouts=normalize_layouts(desired_input_layouts, "desired_input_layouts"),
        input_kwarg_layouts=input_kwarg_layouts,
        desired_input_kwarg_layouts=desired_input_kwarg_layouts,
        use_local_output=use_local_output,
        module_path=module_path,
    )
    _checks.mark_prepared(module, ("input",), "PrepareModuleInput")
    return module


def prepare_output(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    output_layouts: Placement | tuple[Placement | None, ...],
    desired_output_layouts: Placement | tuple[Placement | None, ...],
    use_local_output: bool = True,
    module_path: str | None = None,
) -> nn.Module:
    """Convert a module's outputs to DTensors and redistribute them after ``forward`` runs.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> prepare_output(model.norm, mesh, output_layouts=Shard(1),
        ...                desired_output_layouts=Replicate())
    """
    check_prepare_output(module, device_mesh, module_path)
    install_output_hook(
        module,
        device_mesh,
        output_layouts=normalize_layouts(output_layouts, "output_layouts"),
        desired_output_layouts=normalize_layouts(desired_output_layouts, "desired_output_layouts"),
        use_local_output=use_local_output,
        module_path=module_path,
    )
    _checks.mark_prepared(module, ("output",), "PrepareModuleOutput")
    return module


def prepare_input_output(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    output_layouts: Placement | tuple[Placement | None, ...],
    desired_output_layouts: Placement | tuple[Placement | None, ...],
    input_layouts: Placement | tuple[Placement | None, ...] | None = None,
    desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
    input_kwarg_layouts: dict[str, Placement] | None = None,
    desired_input_kwarg_layouts: dict[str, Placement] | None = None,
    use_local_input: bool = False,
    use_local_output: bool = True,
    module_path: str | None = None,
) -> nn.Module:
    """:func:`prepare_input` and :func:`prepare_output` on one module.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> prepare_input_output(block, mesh,
        ...                      input_layouts=Shard(1), desired_input_layouts=Replicate(),
        ...                      output_layouts=Replicate(), desired_output_layouts=Shard(1))
    """
    check_prepare_input(module, device_mesh, module_path)
    check_prepare_output(module, device_mesh, module_path)
    prepare_input(
        module,
        device_mesh,
        input_layouts=input_layouts,
        desired_input_layouts=desired_input_layouts,
        input_kwarg_layouts=input_kwarg_layouts,
        desired_input_kwarg_layouts=desired_input_kwarg_layouts,
        use_local_output=use_local_input,
        module_path=module_path,
    )
    return prepare_output(
        module,
        device_mesh,
        output_layouts=output_layouts,
        desired_output_layouts=desired_output_layouts,
        use_local_output=use_local_output,
        module_path=module_path,
    )
