"""``parallelize_module``: apply a tensor-parallel plan to a module tree."""

from __future__ import annotations

import copy

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import style as upstream
from torch.distributed.tensor.parallel.style import ParallelStyle as UpstreamParallelStyle

from torch_tp.parallel import _checks, functional
from torch_tp.parallel.plan import PlanEntry, resolve_plan
from torch_tp.parallel.style import ParallelStyle

__all__ = ["parallelize_module"]


def _current_mesh() -> DeviceMesh:
    from torch.distributed.device_mesh import _mesh_resources

    try:
        mesh = _mesh_resources.get_current_mesh()
    except RuntimeError as err:
        mesh, cause = None, err
    else:
        cause = None
    if mesh is None:
        raise ValueError(
            "parallelize_module got device_mesh=None and no mesh is active; pass a mesh "
            "(e.g. init_device_mesh('cuda', (world_size,))) or call it inside `with mesh:`"
        ) from cause
    return mesh


_BOTH = ("input", "output")

# Upstream styles: the torch_tp check that matches what their _apply would reject, and
# which forward stages they convert. Checked up front so a plan mixing upstream and
# torch_tp styles is still all-or-nothing.
_UPSTREAM_RULES: dict[type, tuple] = {
    upstream.ColwiseParallel: (functional.check_colwise, _BOTH),
    upstream.RowwiseParallel: (functional.check_rowwise, _BOTH),
    upstream.SequenceParallel: (None, _BOTH),
    upstream.PrepareModuleInput: (functional.check_prepare_input, ("input",)),
    upstream.PrepareModuleOutput: (functional.check_prepare_output, ("output",)),
    upstream.PrepareModuleInputOutput: (None, _BOTH),
}


def _upstream_rule(style: UpstreamParallelStyle) -> tuple:
    for cls in type(style).__mro__:
        if cls in _UPSTREAM_RULES:
            return _UPSTREAM_RULES[cls]
    return (None, ())


def _check_entry(root: nn.Module, entry: PlanEntry, mesh: DeviceMesh) -> None:
    module = root.get_submodule(entry.path)
    if isinstance(entry.style, ParallelStyle):
        entry.style.check(module, mesh, entry.path)
        return
    name = type(entry.style).__name__
    _checks.require_1d_mesh(mesh, name)
    check, stages = _upstream_rule(entry.style)
    _checks.require_unprepared(module, stages, name, entry.path)
    if check is not None:
        check(module, mesh, entry.path)


def _apply_upstream_style(style: UpstreamParallelStyle, module, mesh, src_data_rank, path):
    # Upstream styles read src_data_rank from an attribute (and some set attributes in
    # _apply); work on a copy so the user's style object is never changed.
    applied = copy.copy(style)
    applied.src_data_rank = src_data_rank
    try:
        applied._apply(module, mesh)
    except (NotImplementedError, ValueError, TypeError) as err:
        raise type(err)(f"{_checks.describe(module, path)}: {err}") from err
    _checks.mark_prepared(module, _upstream_rule(style)[1], type(style).__name__)


def _apply_entry(root: nn.Module, entry: PlanEntry, mesh: DeviceMesh, src_data_rank) -> None:
    module = root.get_submodule(entry.path)
    if isinstance(entry.style, ParallelStyle):
        entry.style.apply_to(module, mesh, src_data_rank=src_data_rank, module_path=entry.path)
    else:
        _apply_upstream_style(entry.style, module, mesh, src_data_rank, entry.path)


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: UpstreamParallelStyle | dict[str, UpstreamParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Parallelize ``module`` in place according to a plan, and return it.

    Args:
        module (nn.Module): the model (or block) to parallelize.
        device_mesh (DeviceMesh, optional): a 1-D mesh (slice an N-D mesh: ``mesh["tp"]``).
            Default: the mesh of the enclosing ``with mesh:`` block.
        parallelize_plan (ParallelStyle or dict[str, ParallelStyle]): one style applied to
            ``module`` itself, or a dict from module paths / glob patterns to styles.
            ``""`` is ``module``; ``*`` matches across dots (``"layers.*.attention.wq"``,
            ``"*self.query"``, ``"*.w[13]"``). Upstream ``torch.distributed.tensor.parallel``
            styles are accepted too.

    Keyword Args:
        src_data_rank (int or None): the rank whose values are scattered/broadcast so the
            sharded model equals the single-device one. ``None``: every rank keeps its own
            values (no communication). Reaches every style, the ``""`` key included.

    Returns:
        ``module``, parallelized.

    Raises:
        ValueError: a pattern matches no module (the message lists the closest paths), two
            patterns give one module different styles, the mesh is not 1-D, or a parameter
            is too small to shard over the mesh.
        TypeError: a style is given a module type it cannot handle (the message names the path).

    The whole plan is checked before any module changes, so a rejected plan leaves the
    model untouched.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> from torch_tp import parallelize_module, ColwiseParallel, RowwiseParallel
        >>> mesh = init_device_mesh("cpu", (2,))
        >>> parallelize_module(model, mesh, {
        ...     "layers.*.feed_forward.w[13]": ColwiseParallel(),
        ...     "layers.*.feed_forward.w2": RowwiseParallel(),
        ... })
    """
    if parallelize_plan is None:
        raise ValueError(
            "parallelize_module needs a parallelize_plan: a ParallelStyle or a dict "
            "{module path or pattern: ParallelStyle}"
        )
    mesh = device_mesh if device_mesh is not None else _current_mesh()
    _checks.require_1d_mesh(mesh, "parallelize_module")
    entries = resolve_plan(module, parallelize_plan)
    for entry in entries:
        _check_entry(module, entry, mesh)
    for entry in entries:
        _apply_entry(module, entry, mesh, src_data_rank)
    return module
