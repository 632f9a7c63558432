"""What each style accepts and where it puts parameters: the data behind the styles.

``check_*`` functions raise (with the module path and the fix) when a style cannot be
applied to a module, and change nothing; ``*_placements`` say where each parameter goes.
:mod:`torch_tp.parallel.functional` applies them; :func:`torch_tp.explain_plan` only
reads them, so the report and the real application cannot disagree.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_tp.parallel import _checks, _overlap

__all__ = [
    "check_colwise",
    "check_rowwise",
    "check_sequence_parallel",
    "check_prepare_input",
    "check_prepare_output",
    "check_spatial",
    "colwise_placements",
    "rowwise_placements",
    "sequence_parallel_placements",
    "spatial_placements",
]

BOTH_STAGES = ("input", "output")
_SHARDABLE = (nn.Linear, nn.Embedding)


# ---------------------------------------------------------------------------- checks


def check_colwise(
    module: nn.Module, device_mesh: DeviceMesh, module_path: str | None = None, *, overlap: bool = False
) -> None:
    """Raise if :func:`colwise` cannot shard ``module`` on ``device_mesh`` (changes nothing).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> check_colwise(nn.Linear(16, 2), mesh_of_4, "proj")
        ValueError: ColwiseParallel cannot shard 'proj' (Linear).weight ... smaller than the 4 ranks
    """
    _check_linear_or_embedding(module, device_mesh, "ColwiseParallel", module_path, colwise=True)
    if overlap:
        _overlap.require_overlap_module(module, "ColwiseParallel", module_path)


def check_rowwise(
    module: nn.Module, device_mesh: DeviceMesh, module_path: str | None = None, *, overlap: bool = False
) -> None:
    """Raise if :func:`rowwise` cannot shard ``module`` on ``device_mesh`` (changes nothing).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> check_rowwise(nn.LayerNorm(16), mesh, "norm")
        TypeError: RowwiseParallel cannot shard 'norm' (LayerNorm): it handles nn.Linear or nn.Embedding...
    """
    _check_linear_or_embedding(module, device_mesh, "RowwiseParallel", module_path, colwise=False)
    if overlap:
        _overlap.require_overlap_module(module, "RowwiseParallel", module_path)


def _check_linear_or_embedding(module, device_mesh, style, module_path, *, colwise: bool) -> None:
    _checks.require_1d_mesh(device_mesh, style)
    _checks.require_module_type(module, _SHARDABLE, style, module_path)
    _checks.require_only_params(module, ("weight", "bias"), style, module_path)
    dim = _weight_shard_dim(module, colwise=colwise)
    _checks.require_shardable(module, "weight", dim, _checks.mesh_size(device_mesh), style, module_path)
    _checks.require_unprepared(module, BOTH_STAGES, style, module_path)


def check_sequence_parallel(
    module: nn.Module, device_mesh: DeviceMesh, module_path: str | None = None
) -> None:
    """Raise if ``module`` is not sequence-local (a norm, dropout, or elementwise module).

    Sequence parallelism runs the module on a slice of the sequence with replicated
    parameters, which is exact only when each position is computed independently with
    1-D (per-feature) parameters. BatchNorm mixes positions through its batch statistics
    and a module with a matrix parameter should be sharded, not replicated.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> check_sequence_parallel(nn.BatchNorm1d(8), mesh, "bn")
        TypeError: SequenceParallel cannot run 'bn' (BatchNorm1d) on a sequence shard: ...
    """
    style = "SequenceParallel"
    _checks.require_1d_mesh(device_mesh, style)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        raise _checks.UnsupportedModuleError(
            f"{style} cannot run {_checks.describe(module, module_path)} on a sequence "
            f"shard: batch statistics would be computed per shard"
        )
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(
                f"{style}: {_checks.describe(module, module_path)}.{name} is already a DTensor"
            )
        if param.ndim > 1:
            raise _checks.UnsupportedModuleError(
                f"{style} replicates the parameters of norm/dropout-like modules, but "
                f"{_checks.describe(module, module_path)}.{name} has shape {tuple(param.shape)}; "
                f"shard it with ColwiseParallel/RowwiseParallel instead"
            )
    _checks.require_unprepared(module, BOTH_STAGES, style, module_path)


def check_prepare_input(module: nn.Module, device_mesh: DeviceMesh, module_path: str | None = None) -> None:
    """Raise if :func:`prepare_input` cannot be applied (N-D mesh, inputs already prepared).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> prepare_input(block, mesh, input_layouts=Shard(1), desired_input_layouts=Replicate())
        >>> check_prepare_input(block, mesh, "block")
        ValueError: PrepareModuleInput would convert the inputs of 'block' (Block), which ...
    """
    _checks.require_1d_mesh(device_mesh, "PrepareModuleInput")
    _checks.require_unprepared(module, ("input",), "PrepareModuleInput", module_path)


def check_prepare_output(module: nn.Module, device_mesh: DeviceMesh, module_path: str | None = None) -> None:
    """Raise if :func:`prepare_output` cannot be applied (N-D mesh, outputs already prepared).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> check_prepare_output(model.norm, mesh_2d, "norm")
        ValueError: PrepareModuleOutput shards over one mesh axis, but the mesh has 2 dims ...
    """
    _checks.require_1d_mesh(device_mesh, "PrepareModuleOutput")
    _checks.require_unprepared(module, ("output",), "PrepareModuleOutput", module_path)


# What SpatialParallel runs on a spatial shard: convolutions (halo exchange) and modules
# that compute each position on its own. Pooling is refused: its windows cross shard
# borders and there is no halo exchange for it.
SPATIAL_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
SPATIAL_POINTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Identity, nn.Dropout,
)
SPATIAL_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def check_spatial(
    module: nn.Module, device_mesh: DeviceMesh, module_path: str | None = None, *, dim: int = -1
) -> None:
    """Raise if :func:`spatial` cannot run ``module`` on an input sharded along tensor dim ``dim``.

    Accepted: ``nn.Conv1d/2d/3d`` with ``padding_mode="zeros"`` (sharded along one of their
    spatial dims), eval-mode ``nn.BatchNorm1d/2d/3d`` with running statistics, and
    position-wise modules (``nn.ReLU``, ``nn.GELU``, ``nn.Identity``, ``nn.Dropout`` with
    ``p=0`` or in eval mode, ...). Refused: training-mode BatchNorm (its batch statistics
    would be per shard), pooling and everything else.

    Example::

        >>> check_spatial(nn.Conv2d(3, 8, 3, padding=1), 4, "stem", dim=3)
        >>> try:
        ...     check_spatial(nn.MaxPool2d(2), 4, "pool", dim=3)
        ... except TypeError as err:
        ...     print(type(err).__name__, str(err)[:50])
        UnsupportedModuleError SpatialParallel cannot run 'pool' (MaxPool2d) on a
    """
    style = "SpatialParallel"
    _checks.require_1d_mesh(device_mesh, style)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{style}(dim=...) takes an int (a tensor dim such as 3 or -1), got {dim!r}")
    where = _checks.describe(module, module_path)
    if isinstance(module, SPATIAL_CONVS):
        ndim = module.weight.ndim  # = the batched input's ndim
        if not -ndim <= dim < ndim or dim % ndim < 2:
            raise ValueError(
                f"{style}(dim={dim}) on {where}: dim must be a spatial dim of its {ndim}-D "
                f"(N, C, ...) input, i.e. one of {list(range(2, ndim))} or "
                f"{list(range(2 - ndim, 0))}"
            )
        if module.padding_mode != "zeros":
            raise _checks.UnsupportedModuleError(
                f"{style} cannot run {where} on a spatial shard: padding_mode="
                f"{module.padding_mode!r} pads with values from the far border; only 'zeros'"
            )
    elif isinstance(module, SPATIAL_BATCHNORMS):
        if module.training or not module.track_running_stats or module.running_mean is None:
            raise _checks.UnsupportedModuleError(
                f"{style} cannot run {where} in training mode (or without running "
                f"statistics): its batch statistics would be computed per shard. Call "
                f".eval() on it before parallelizing (it then normalizes with running stats)"
            )
    elif isinstance(module, SPATIAL_POINTWISE):
        if isinstance(module, nn.Dropout) and module.training and module.p > 0:
            raise _checks.UnsupportedModuleError(
                f"{style} cannot run {where} with p={module.p} in training mode: its mask "
                f"would differ from the unsharded model's. Use p=0 or .eval()"
            )
    else:
        names = ", ".join(
            f"nn.{t.__name__}" for t in SPATIAL_CONVS + SPATIAL_BATCHNORMS + SPATIAL_POINTWISE
        )
        raise _checks.UnsupportedModuleError(
            f"{style} cannot run {where} on a spatial shard: it handles {names} "
            f"(BatchNorm in eval mode). Pooling windows cross shard borders; gather "
            f"the input first (e.g. output_layouts=Replicate() on the module before)"
        )
    if isinstance(dim, int) and not isinstance(module, SPATIAL_CONVS) and 0 <= dim < 2:
        raise ValueError(f"{style}(dim={dim}) on {where}: dims 0 and 1 are batch and channels")
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(f"{style}: {where}.{name} is already a DTensor")
    _checks.require_unprepared(module, BOTH_STAGES, style, module_path)


# ---------------------------------------------------------------------- placements


def _weight_shard_dim(module: nn.Module, *, colwise: bool) -> int:
    # Linear computes x @ W.T with W of shape (out, in): colwise splits out (dim 0),
    # rowwise splits in (dim 1). Embedding's W is (num_embeddings, dim): colwise splits
    # the embedding dim (1), rowwise the vocabulary (0).
    if isinstance(module, nn.Embedding):
        return 1 if colwise else 0
    return 0 if colwise else 1


def colwise_placements(module: nn.Module) -> dict[str, Placement]:
    """Where :func:`colwise` puts each parameter of ``module`` (path relative to ``module``).

    Example::

        >>> colwise_placements(nn.Linear(4, 8))
        {'weight': Shard(dim=0), 'bias': Shard(dim=0)}
        >>> colwise_placements(nn.Embedding(10, 4))
        {'weight': Shard(dim=1)}
    """
    placements = {"weight": Shard(_weight_shard_dim(module, colwise=True))}
    if getattr(module, "bias", None) is not None:
        placements["bias"] = Shard(0)
    return placements


def rowwise_placements(module: nn.Module) -> dict[str, Placement]:
    """Where :func:`rowwise` puts each parameter of ``module`` (path relative to ``module``).

    Example::

        >>> rowwise_placements(nn.Linear(4, 8))
        {'weight': Shard(dim=1), 'bias': Replicate()}
    """
    placements = {"weight": Shard(_weight_shard_dim(module, colwise=False))}
    if getattr(module, "bias", None) is not None:
        placements["bias"] = Replicate()
    return placements


def sequence_parallel_placements(module: nn.Module) -> dict[str, Placement]:
    """Where :func:`sequence_parallel` puts each parameter: replicated, all of them.

    Example::

        >>> sequence_parallel_placements(nn.LayerNorm(8))
        {'weight': Replicate(), 'bias': Replicate()}
    """
    return {name: Replicate() for name, _ in module.named_parameters()}


def spatial_placements(module: nn.Module) -> dict[str, Placement]:
    """Where :func:`spatial` puts each parameter: replicated, all of them.

    Example::

        >>> spatial_placements(nn.Conv2d(3, 8, 3))
        {'weight': Replicate(), 'bias': Replicate()}
    """
    return {name: Replicate() for name, _ in module.named_parameters()}
