"""Validation shared by the styles: what a style can handle, and whether a shape can be sharded.

Every check raises an exception whose message names the module path (when known),
the rule that failed and what to change. They run before any parameter is touched,
so a rejected plan leaves the model exactly as it was.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["UnsupportedModuleError"]


class UnsupportedModuleError(TypeError, NotImplementedError):
    """A style was given a module type it cannot handle.

    It is a ``TypeError`` (the argument has the wrong type) and, for code written against
    upstream, which raises ``NotImplementedError`` here, also a ``NotImplementedError``.

    Example::

        >>> issubclass(UnsupportedModuleError, NotImplementedError)
        True
    """


# A module records which of its forward stages torch_tp has wired, so a second style
# (or the same one twice) cannot stack conversions on top of each other.
APPLIED_ATTR = "_torch_tp_applied"


#: What a style that converts its module's first positional input says about it.
TENSOR_INPUT_FIX = "this style converts the module's first positional input, which must be a tensor"


def describe(module: nn.Module, module_path: str | None) -> str:
    """``"'layers.0.attention.wq' (Linear)"``, or ``"a Linear module"`` without a path."""
    kind = type(module).__name__
    if module_path is None:
        return f"a {kind} module"
    return f"{module_path or '<root>'!r} ({kind})"


def mesh_size(device_mesh: DeviceMesh | int) -> int:
    """Ranks along the (1-D) mesh; a plain int stands for a 1-D mesh of that size."""
    return device_mesh if isinstance(device_mesh, int) else device_mesh.size()


def require_1d_mesh(device_mesh: DeviceMesh | int, style: str) -> None:
    """Tensor-parallel styles shard over one mesh axis; reject an N-D mesh with the fix.

    A positive int is accepted as "a 1-D mesh of that many ranks" (plan checking and
    :func:`torch_tp.explain_plan` work without a process group).
    """
    if isinstance(device_mesh, int) and not isinstance(device_mesh, bool):
        if device_mesh < 1:
            raise ValueError(f"{style}: a mesh size must be at least 1, got {device_mesh}")
        return
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"{style} needs a DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.ndim != 1:
        names = device_mesh.mesh_dim_names
        hint = f'device_mesh["{names[-1]}"]' if names else "a 1-D sub-mesh (name the mesh dims)"
        raise ValueError(
            f"{style} shards over one mesh axis, but the mesh has {device_mesh.ndim} dims "
            f"(shape {tuple(device_mesh.shape)}, names {names}); choose the tensor-parallel "
            f"axis, e.g. pass {hint}"
        )


def require_module_type(
    module: nn.Module, allowed: tuple[type, ...], style: str, module_path: str | None
) -> None:
    """Raise ``TypeError`` if ``module`` is not one of the types ``style`` knows how to shard."""
    if isinstance(module, allowed):
        return
    names = " or ".join(f"nn.{t.__name__}" for t in allowed)
    raise UnsupportedModuleError(
        f"{style} cannot shard {describe(module, module_path)}: it handles {names}. "
        f"Apply it to the Linear/Embedding submodules instead, or use PrepareModuleInput/"
        f"PrepareModuleOutput on a container module"
    )


def require_shardable(
    module: nn.Module,
    param_name: str,
    dim: int,
    mesh_size: int,
    style: str,
    module_path: str | None,
) -> None:
    """Every rank must own at least one slice of ``param_name`` along ``dim``.

    Uneven shards are fine (10 rows on 4 ranks become 3, 3, 3, 1); a dim smaller than
    the mesh would leave ranks with nothing, which is always a plan mistake.
    """
    param = getattr(module, param_name)
    if isinstance(param, DTensor):
        raise ValueError(
            f"{style}: {describe(module, module_path)}.{param_name} is already a DTensor "
            f"with placements {param.placements}; a module can be parallelized once"
        )
    size = param.shape[dim]
    if size < mesh_size:
        raise ValueError(
            f"{style} cannot shard {describe(module, module_path)}.{param_name} "
            f"(shape {tuple(param.shape)}) on dim {dim}: size {size} is smaller than the "
            f"{mesh_size} ranks of the mesh, so some ranks would hold nothing. Leave this "
            f"module out of the plan or use a smaller tensor-parallel mesh"
        )


def require_only_params(
    module: nn.Module, allowed: tuple[str, ...], style: str, module_path: str | None
) -> None:
    """Reject modules carrying parameters the style would not know how to place."""
    extra = [n for n, _ in module.named_parameters(recurse=False) if n not in allowed]
    extra += [f"{n}.*" for n, child in module.named_children() if any(child.parameters())]
    if extra:
        raise TypeError(
            f"{style} shards only {allowed} of {describe(module, module_path)}, which also "
            f"has parameters {extra}; shard those explicitly or wrap them in a separate module"
        )


def require_tensor_input(
    value: object,
    position: str,
    module: nn.Module,
    module_path: str | None,
    style: str,
    fix: str = "use None as the layout for non-tensor inputs",
) -> torch.Tensor:
    """A layout was given for ``value``: it must be a tensor."""
    if isinstance(value, torch.Tensor):
        return value
    raise TypeError(
        f"{style} on {describe(module, module_path)} was given a layout for input "
        f"{position}, but the module received {type(value).__name__} there; {fix}"
    )


def require_unprepared(
    module: nn.Module, stages: tuple[str, ...], style: str, module_path: str | None
) -> None:
    """Raise if torch_tp already converts ``module``'s inputs or outputs (``stages``)."""
    applied = getattr(module, APPLIED_ATTR, {})
    for stage in stages:
        if stage in applied:
            raise ValueError(
                f"{style} would convert the {stage}s of {describe(module, module_path)}, "
                f"which {applied[stage]} already converts; a module's {stage}s can be "
                f"prepared once (use PrepareModuleInputOutput to prepare both sides)"
            )


def mark_prepared(module: nn.Module, stages: tuple[str, ...], style: str) -> None:
    """Record that ``style`` now converts ``module``'s ``stages`` ("input", "output")."""
    applied = dict(getattr(module, APPLIED_ATTR, {}))
    applied.update((stage, style) for stage in stages)
    module.__dict__[APPLIED_ATTR] = applied
