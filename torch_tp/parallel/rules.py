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

from torch_tp.parallel import _checks

__all__ = [
    "check_colwise",
    "check_rowwise",
    "check_sequence_parallel",
    "check_prepare_input",
    "check_prepare_output",
    "colwise_placements",
    "rowwise_placements",
    "sequence_parallel_placements",
]

BOTH_STAGES = ("input", "output")
_SHARDABLE = (nn.Linear, nn.Embedding)


# ---------------------------------------------------------------------------- checks


def check_colwise(module: nn.Module, device_mesh: DeviceMesh, module_path: str | None = None) -> None:
    """Raise if :func:`colwise` cannot shard ``module`` on ``device_mesh`` (changes nothing).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> check_colwise(nn.Linear(16, 2), mesh_of_4, "proj")
        ValueError: ColwiseParallel cannot shard 'proj' (Linear).weight ... smaller than the 4 ranks
    """
    _check_linear_or_embedding(module, device_mesh, "ColwiseParallel", module_path, colwise=True)


def check_rowwise(module: nn.Module, device_mesh: DeviceMesh, module_path: str | None = None) -> None:
    """Raise if :func:`rowwise` cannot shard ``module`` on ``device_mesh`` (changes nothing).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> check_rowwise(nn.LayerNorm(16), mesh, "norm")
        TypeError: RowwiseParallel cannot shard 'norm' (LayerNorm): it handles nn.Linear or nn.Embedding...
    """
    _check_linear_or_embedding(module, device_mesh, "RowwiseParallel", module_path, colwise=False)


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
