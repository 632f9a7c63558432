"""Parameter styles: plan entries whose key names a *parameter*, not a module.

Some weights are parameters of a module no module style knows: the 3-D expert weights of a
mixture-of-experts layer (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj``
``[E, H, I]``), a learned position table. A plan may name such a parameter directly
(``"layers.*.mlp.experts.down_proj": ShardParameter(dim=2)``); ``resolve_plan`` binds the
style to the parameter (:class:`OnParameter`), so the plan checks, ``explain_plan``, the tie
and whole-unit rules and the cross-rank check see it like any other placement. A key that
names neither a module nor a parameter still raises.

A parameter style only places the parameter. The module that owns it then computes with a
DTensor, so it must run on DTensor inputs (a ``PrepareModuleInput`` on it) or under a module
style that handles its forward (the mixture-of-experts styles).

Example::

    >>> ShardParameter(dim=2)
    ShardParameter(dim=2)
    >>> ShardParameter(dim=1, packed=2)
    ShardParameter(dim=1, packed=2)
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from torch_tp.parallel import rules
from torch_tp.parallel.style import ParallelStyle, distribute_parameters

__all__ = ["ParameterStyle", "ShardParameter", "OnParameter"]


class ParameterStyle(ParallelStyle):
    """Base class of styles for one parameter: ``check_parameter``, ``apply_to_parameter``, ``placement``.

    Example::

        >>> isinstance(ShardParameter(dim=0), ParameterStyle)
        True
    """

    #: read by ``resolve_plan``: keys of this style name parameters
    targets_parameters: ClassVar[bool] = True

    def placement(self):
        """Where the parameter goes."""
        raise NotImplementedError(f"{type(self).__name__} does not implement placement")

    def check_parameter(self, module: nn.Module, name: str, device_mesh, path: str | None) -> None:
        """Raise if the parameter ``name`` of ``module`` cannot take this style; change nothing."""
        raise NotImplementedError(f"{type(self).__name__} does not implement check_parameter")

    def on(self, name: str) -> "OnParameter":
        """This style bound to the parameter ``name`` of the module it is applied to."""
        return OnParameter(style=self, parameter=name)


class OnParameter(ParallelStyle):
    """A :class:`ParameterStyle` bound to one parameter: a module style for the module that owns it.

    ``resolve_plan`` makes one per parameter a plan key names; ``parallelize_module`` and
    ``explain_plan`` then check, apply and explain it like any module style.

    Example::

        >>> ShardParameter(dim=0).on("down_proj")
        ShardParameter(dim=0) on 'down_proj'
    """

    style: ParameterStyle
    parameter: str

    def param_placements(self, module):
        return {self.parameter: self.style.placement()}

    def check(self, module, device_mesh, module_path=None):
        self.style.check_parameter(module, self.parameter, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        distribute_parameters(module, self.param_placements(module), device_mesh, src_data_rank)
        return module

    def __repr__(self) -> str:
        return f"{self.style!r} on {self.parameter!r}"


class ShardParameter(ParameterStyle):
    """Shard one parameter along ``dim`` (``packed=k``: a weight of ``k`` stacked parts, part by part).

    Keyword Args:
        dim (int): the dim of the parameter to shard, e.g. ``2`` for the ``I`` of an expert
            ``down_proj`` ``[E, H, I]``.
        packed (int): the parameter stacks ``packed`` equal parts along ``dim`` (an expert
            ``gate_up_proj`` ``[E, 2I, H]`` with ``dim=1, packed=2``): each rank holds its
            slice of each part. Default ``1``.

    Returns:
        A :class:`ParameterStyle` for a plan key naming a parameter.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> parallelize_module(model, mesh, {"layers.*.mlp.experts.down_proj": ShardParameter(dim=2)})
    """

    dim: int
    packed: int = 1
    _additive_defaults: ClassVar[dict[str, Any]] = {"packed": 1}

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"ShardParameter(dim=...) takes an int, got {self.dim!r}")
        self.packed = rules.packed_parts(self.packed, "ShardParameter")

    def placement(self):
        return rules.packed_shard(self.dim, self.packed)

    def check_parameter(self, module: nn.Module, name: str, device_mesh: DeviceMesh | int, path: str | None) -> None:
        style = "ShardParameter"
        rules.require_1d_mesh(device_mesh, style)
        param = module._parameters.get(name)
        where = f"{rules.describe(module, path)}.{name}"
        if param is None:
            raise ValueError(f"{style}: {where} is not a parameter of the module")
        rules.require_plain_parameters(module, style, path)
        if not -param.ndim <= self.dim < param.ndim:
            raise ValueError(f"{style}(dim={self.dim}): {where} has {param.ndim} dims {tuple(param.shape)}")
        size = param.shape[self.dim]
        if size % self.packed or size // self.packed < rules.mesh_size(device_mesh):
            raise ValueError(
                f"{style}(dim={self.dim}, packed={self.packed}) cannot shard {where} (shape "
                f"{tuple(param.shape)}): {self.packed} equal parts of at least one slice per rank are "
                f"needed on the {rules.mesh_size(device_mesh)} ranks of the mesh. Leave it out of the "
                f"plan or use a smaller tensor-parallel mesh"
            )
