"""``parallelize_module``: apply a tensor-parallel plan to a module tree."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel.style import ParallelStyle as UpstreamParallelStyle

from torch_tp._agreement import Fact, agree_or_raise
from torch_tp.parallel import rules
from torch_tp._order import require_before
from torch_tp.parallel._ties import check_ties, earlier_ties, keep_earlier_ties, owned_parameters, remember_replaced, retie
from torch_tp.parallel.plan import PlanEntry, check_whole_units, planned_placements, resolve_plan
from torch_tp.parallel.replicate import replicate

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
            values and no parameter data moves (unlike upstream's "no communication", the
            8-byte agreement all-gather below still runs). Reaches every style, the ``""``
            key included.
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
        ValueError: ``module`` was already checkpointed or fully sharded: TP comes first, then
            :func:`torch_tp.checkpoint_by_pattern`, then :func:`torch_tp.fully_shard_by_pattern`.

    The whole plan is checked before any module changes, so a rejected plan leaves the
    model untouched. Then one all-gather of an 8-byte digest per rank (of the plan and the
    parameters' shapes, dtypes and ties) makes every rank raise alike if one rejected the
    plan or the ranks' models differ, instead of hanging in the first collective; it runs
    with every ``src_data_rank``, ``None`` included.

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
        warnings.warn(
            "parallelize_module got no parallelize_plan, so it changes nothing (as upstream); pass "
            "a ParallelStyle or a dict {module path or pattern: ParallelStyle}",
            stacklevel=2,
        )
        return module
    require_before(module, "parallelize_module", later=("checkpoint_by_pattern", "fully_shard"))
    mesh = _require_mesh(device_mesh if device_mesh is not None else _current_mesh(), src_data_rank)
    replicate_unplanned_params = rules.flag(replicate_unplanned_params, "replicate_unplanned_params", "parallelize_module")
    try:
        entries, styles, targets, ties, earlier = _checked_plan(module, mesh, parallelize_plan, replicate_unplanned_params)
        problem, facts = None, _facts(module, entries, ties)
    except (TypeError, ValueError, NotImplementedError) as err:
        problem, facts = err, []
    # one all-gather of 8 bytes per rank; raises on every rank if one failed or they differ
    agree_or_raise(mesh.get_group(), problem, facts, what="parallelize_module")
    before = dict(owned_parameters(module))
    for entry, style, target in zip(entries, styles, targets):
        style.apply_to(target, mesh, src_data_rank=src_data_rank, module_path=entry.path)
    for (parent, _), indices in _sibling_groups(entries).items():
        styles[indices[0]].link_siblings([targets[i] for i in indices], parent)
    retie(module, ties)
    keep_earlier_ties(module, earlier)  # ties an earlier call on a submodule split
    if replicate_unplanned_params:
        _replicate_unplanned(module, mesh, src_data_rank)
    remember_replaced(module, before)  # for the ties a later call sees
    return module


def _require_mesh(mesh: object, src_data_rank: object) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"parallelize_module needs a DeviceMesh (e.g. init_device_mesh('cuda', (tp_size,)), or "
            f"mesh['tp'] of a larger one), got {type(mesh).__name__} {mesh!r}"
        )
    rules.require_1d_mesh(mesh, "parallelize_module")
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"parallelize_module: this process (global rank {dist.get_rank()}) is not in the mesh "
            f"{mesh.mesh.tolist()}; call it only on the mesh's ranks (or build the mesh over them)"
        )
    if src_data_rank is not None and (
        isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int) or not 0 <= src_data_rank < mesh.size()
    ):
        raise ValueError(
            f"parallelize_module(src_data_rank={src_data_rank!r}): the source of the values must be a "
            f"rank of the mesh, in [0, {mesh.size()}), or None (every rank keeps its own values)"
        )
    return mesh


def _checked_plan(module, mesh, plan, replicate_unplanned_params):
    """Resolve the plan and run every check; nothing changes. Returns what applying needs."""
    entries = resolve_plan(module, plan)
    styles = [e.checked_style for e in entries]
    targets = [module.get_submodule(entry.path) for entry in entries]
    for entry, style, target in zip(entries, styles, targets):
        style.check(target, mesh, entry.path)
    placements = planned_placements(module, entries, styles, replicate_unplanned=replicate_unplanned_params)
    ties = check_ties(module, placements)
    earlier = earlier_ties(module, placements, mesh)
    check_whole_units(module, placements, mesh.size())
    return entries, styles, targets, ties, earlier


def _facts(module: nn.Module, entries: list[PlanEntry], ties: list[list[str]]) -> list[Fact]:
    """What every rank must hold the same before parameters move: the plan, the parameters'
    shapes and dtypes, and the ties."""
    fix = (
        "build the same model (same config) with the same plan on every rank, or the "
        "parameters cannot be scattered consistently"
    )
    facts = [Fact(f"plans give {entry.path!r} the styles", repr(entry.style), fix) for entry in entries]
    facts += [
        Fact(f"models hold parameter {name!r} as", f"{tuple(p.shape)} {p.dtype}", fix)
        for name, p in module.named_parameters()
    ]
    return facts + [Fact("models tie the parameters", ties, fix)]


def _replicate_unplanned(root: nn.Module, mesh: DeviceMesh, src_data_rank) -> None:
    for path, module in root.named_modules():
        own = module.named_parameters(recurse=False)
        if any(not isinstance(param, DTensor) for _, param in own):
            replicate(module, mesh, src_data_rank=src_data_rank, module_path=path)
