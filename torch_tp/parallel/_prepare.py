"""Forward hooks of PrepareModuleInput / PrepareModuleOutput.

A layout tuple has one entry per positional input (or output): ``None`` leaves that
value alone, a Placement annotates it (plain tensor -> DTensor) and the matching
*desired* placement is what the module (or its caller) receives.
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from torch_tp.parallel import _checks
from torch_tp.parallel._layouts import (
    check_same_length,
    finish_output,
    redistribute_to,
    to_dtensor,
)

__all__: list[str] = []


def _prepare_value(value, device_mesh, layout, desired, use_local, position, module, module_path, style):
    if layout is None:
        return value
    tensor = _checks.require_tensor_input(value, position, module, module_path, style)
    dvalue = to_dtensor(tensor, device_mesh, layout)
    if desired is not None:
        dvalue = redistribute_to(dvalue, desired)
    return finish_output(dvalue, use_local)


def _prepare_positional(args, device_mesh, layouts, desired, use_local, module, module_path, style):
    if layouts is None:
        return tuple(args)
    if len(args) != len(layouts):
        raise ValueError(
            f"{style} on {_checks.describe(module, module_path)} has {len(layouts)} "
            f"layouts {layouts} but the module got {len(args)} positional values; give one "
            f"entry per value (None for those to leave alone)"
        )
    return tuple(
        _prepare_value(a, device_mesh, lay, des, use_local, str(i), module, module_path, style)
        for i, (a, lay, des) in enumerate(zip(args, layouts, desired))
    )


def _input_hook(device_mesh, layouts, desired, kw_layouts, kw_desired, use_local, module_path, module, args, kwargs):
    style = "PrepareModuleInput"
    args = _prepare_positional(args, device_mesh, layouts, desired, use_local, module, module_path, style)
    if kw_layouts:
        kwargs = {
            key: _prepare_value(
                value, device_mesh, kw_layouts.get(key), kw_desired.get(key), use_local,
                repr(key), module, module_path, style,
            )
            for key, value in kwargs.items()
        }
    return args, kwargs


def _check_kwarg_layouts(kw_layouts: dict | None, kw_desired: dict | None) -> None:
    for name, mapping in (("input_kwarg_layouts", kw_layouts), ("desired_input_kwarg_layouts", kw_desired)):
        for key, layout in (mapping or {}).items():
            if not isinstance(key, str) or not isinstance(layout, Placement):
                raise TypeError(f"{name} maps keyword names to Placements; got {key!r}: {layout!r}")
    extra = set(kw_desired or {}) - set(kw_layouts or {})
    if extra:
        raise ValueError(
            f"desired_input_kwarg_layouts names {sorted(extra)} that input_kwarg_layouts does "
            f"not annotate; add their current layouts to input_kwarg_layouts"
        )


def install_input_hook(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    input_layouts: tuple[Placement | None, ...] | None,
    desired_input_layouts: tuple[Placement | None, ...] | None,
    input_kwarg_layouts: dict[str, Placement] | None,
    desired_input_kwarg_layouts: dict[str, Placement] | None,
    use_local_output: bool,
    module_path: str | None,
) -> None:
    """Register the forward pre-hook that prepares ``module``'s inputs."""
    check_same_length(input_layouts, desired_input_layouts, ("input_layouts", "desired_input_layouts"))
    _check_kwarg_layouts(input_kwarg_layouts, desired_input_kwarg_layouts)
    hook = partial(
        _input_hook,
        device_mesh,
        input_layouts,
        desired_input_layouts,
        dict(input_kwarg_layouts or {}),
        dict(desired_input_kwarg_layouts or {}),
        use_local_output,
        module_path,
    )
    module.register_forward_pre_hook(hook, with_kwargs=True)


def _output_hook(device_mesh, layouts, desired, use_local, module_path, module, inputs, outputs):
    style = "PrepareModuleOutput"
    single = not isinstance(outputs, tuple)
    values = (outputs,) if single else outputs
    prepared = _prepare_positional(values, device_mesh, layouts, desired, use_local, module, module_path, style)
    return prepared[0] if single else prepared


def install_output_hook(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    output_layouts: tuple[Placement | None, ...] | None,
    desired_output_layouts: tuple[Placement | None, ...] | None,
    use_local_output: bool,
    module_path: str | None,
) -> None:
    """Register the forward hook that prepares ``module``'s outputs."""
    if output_layouts is None:
        raise ValueError("PrepareModuleOutput needs output_layouts (one entry per output)")
    check_same_length(output_layouts, desired_output_layouts, ("output_layouts", "desired_output_layouts"))
    hook = partial(_output_hook, device_mesh, output_layouts, desired_output_layouts, use_local_output, module_path)
    module.register_forward_hook(hook)
