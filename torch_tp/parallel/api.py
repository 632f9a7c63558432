"""``parallelize_module``: apply a tensor-parallel plan to a module tree."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel.style import ParallelStyle as UpstreamParallelStyle

from torch_tp.parallel import rules
from torch_tp.parallel._upstream import UpstreamStyle
from torch_tp.parallel.plan import PlanEntry, resolve_plan
from torch_tp.parallel.style import ParallelStyle, replicate

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


def _sibling_groups(entries: list[PlanEntry]) -> dict[tuple, list[int]]:
    """Indices of the entries that one style gives to children of one parent (e.g. wq/wk/wv)."""
    groups: dict[tuple, list[int]] = {}
    for index, entry in enumerate(entries):
        parent = entry.path.rpartition(".")[0]
        groups.setdefault((parent, entry.style), []).append(index)
    return groups


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: UpstreamParallelStyle | dict[str, UpstreamParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
    replicate_unplanned_params: bool = False,
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
        replicate_unplanned_params (bool): also turn every parameter the plan leaves out
            (e.g. norms under plain TP) into a ``Replicate()`` DTensor, broadcast from
            ``src_data_rank``, and run its module on replicated inputs
            (:func:`torch_tp.functional.replicate`). Then every parameter is a
            DTensor, so ``torch.nn.utils.clip_grad_norm_`` and optimizers work on the whole
            model instead of failing on mixed ``torch.Tensor`` and ``DTensor``. Default ``False``
            (upstream behaviour: such parameters stay plain tensors).

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
    rules.require_1d_mesh(mesh, "parallelize_module")
    entries = resolve_plan(module, parallelize_plan)
    styles = [e.style if isinstance(e.style, ParallelStyle) else UpstreamStyle(e.style) for e in entries]
    targets = [module.get_submodule(entry.path) for entry in entries]
    for entry, style, target in zip(entries, styles, targets):
        style.check(target, mesh, entry.path)
    for entry, style, target in zip(entries, styles, targets):
        style.apply_to(target, mesh, src_data_rank=src_data_rank, module_path=entry.path)
    for (parent, _), indices in _sibling_groups(entries).items():
        styles[indices[0]].link_siblings([targets[i] for i in indices], parent)
    if replicate_unplanned_params:
        _replicate_unplanned(module, mesh, src_data_rank)
    return module


def _replicate_unplanned(root: nn.Module, mesh: DeviceMesh, src_data_rank) -> None:
    for path, module in root.named_modules():
        own = module.named_parameters(recurse=False)
        if any(not isinstance(param, DTensor) for _, param in own):
            replicate(module, mesh, src_data_rank=src_data_rank, module_path=path)
