"""``fully_shard_by_pattern``: FSDP2 over the dp axis of a (dp, tp) mesh, by pattern.

torch_tp drives PyTorch's FSDP2 (:func:`torch.distributed.fsdp.fully_shard`); it does not
re-implement it. What it adds:

* **units by pattern**: ``fully_shard`` on every module the patterns select (torch_tp's glob
  rules, strict; the outermost match only), then on the root;
* **predicted shard dims**: each parameter's dp shard dim follows
  :mod:`torch_tp.tools.predict` (the largest dim TP left free that divides by dp, else the
  TP dim when it divides by ``tp * dp``), handed to FSDP2 as ``shard_placement_fn``, and
  :func:`predict_placements` shows the result on a ``meta`` model first;
* **small parameters replicated**: those under ``min_weight_size`` elements (and those no
  dim of which divides) are FSDP2 ``ignored_params``; a hook averages their gradients over
  dp, as FSDP2 averages the sharded ones. The ones with no divisible dim are reported
  with a warning;
* **order**: TP, then checkpointing, then FSDP; another order raises.

Example::

    >>> # xdoctest: +SKIP("needs 4 ranks")
    >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> parallelize_module(model, mesh["tp"], tensor_parallel_plan())
    >>> fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=1024)
"""

from __future__ import annotations

import logging
import warnings
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from torch_tp._order import require_before
from torch_tp.tools.explain import PlanReport, explain_plan
from torch_tp.parallel.plan import outermost_matches
from torch_tp.tools.predict import DEFAULT_MIN_WEIGHT_SIZE, axis_sizes, check_min_weight_size, predict_dp_placement

__all__ = ["fully_shard_by_pattern", "predict_placements"]

_log = logging.getLogger(__name__)
_CALLER = "fully_shard_by_pattern"


def predict_placements(
    model: nn.Module,
    mesh: DeviceMesh | dict[str, int] | int,
    plan,
    fsdp_patterns: str | list[str],
    *,
    min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
    dp_dim: str = "dp",
    tp_dim: str = "tp",
) -> PlanReport:
    """What ``parallelize_module`` + :func:`fully_shard_by_pattern` will put on every rank.

    Reads shapes only: works on a model built on ``meta``, with no process group.
    ``mesh`` is the 2-D mesh, or its sizes ``{"dp": 2, "tp": 4}``; a 1-D mesh or an int is
    the dp axis alone (FSDP only; ``plan`` must then be ``None``). Same as
    ``explain_plan(model, mesh, plan, fsdp_patterns=...)``.

    Returns:
        a :class:`~torch_tp.parallel.PlanReport` with one row per parameter: its tp
        placement (``placement``), dp placement (``dp_placement``), local shape and bytes on
        every rank (row-major over the mesh), and in ``note`` why it is not sharded over dp;
        ``str(report)`` is a table, ``report.replicated_over_dp()`` lists those left whole.

    Example::

        >>> from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
        >>> with torch.device("meta"):
        ...     model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128))
        >>> report = predict_placements(model, {"dp": 2, "tp": 2}, tensor_parallel_plan(), "layers.*", min_weight_size=1024)
        >>> row = {row.path: row for row in report}["layers.0.attention.wq.weight"]
        >>> row.dp_placement, row.placement, row.local_shapes[0]
        (Shard(dim=1), Shard(dim=0), (32, 32))
        >>> report.replicated_over_dp()[0]
        'layers.0.attention_norm.weight: too small: 64 < min_weight_size 1024 elements'
    """
    axes = axis_sizes(mesh, dp_dim=dp_dim, tp_dim=tp_dim, caller="predict_placements")
    if tp_dim not in axes and plan is not None:
        raise ValueError(
            f"predict_placements: a tensor-parallel plan needs a mesh with a {tp_dim!r} dim; got "
            f"the dims {tuple(axes)} (a 1-D mesh or an int is the dp axis alone)"
        )
    return explain_plan(model, axes, plan, fsdp_patterns=fsdp_patterns, min_weight_size=min_weight_size, dp_dim=dp_dim, tp_dim=tp_dim)


def fully_shard_by_pattern(
    model: nn.Module,
    mesh: DeviceMesh,
    patterns: str | list[str],
    *,
    min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    dp_dim: str = "dp",
    tp_dim: str = "tp",
) -> nn.Module:
    """Apply FSDP2 to every module ``patterns`` select and to ``model``, over the dp axis of ``mesh``.

    Call it after ``parallelize_module(model, mesh[tp_dim], plan)`` (and after
    :func:`checkpoint_by_pattern`, if used). Each parameter is sharded over dp on the dim
    :func:`predict_placements` reports; the rest stay replicated over dp with their
    gradients averaged over dp. Changes ``model`` in place and returns it.

    Args:
        model: the (tensor-parallel) model.
        mesh: the 2-D mesh with dims ``dp_dim`` and ``tp_dim``; a 1-D mesh means FSDP only
            (no tensor parallelism).
        patterns: module paths or globs (``*`` crosses dots) of the FSDP units, e.g.
            ``"layers.*"``: each block is one unit (all-gathered and freed together); a
            match inside another match is skipped. Every pattern must match.

    Keyword Args:
        min_weight_size (int): parameters with fewer elements stay replicated over dp.
        reshard_after_forward (bool or int): FSDP2's (free the gathered parameters after
            forward, gather again in backward).
        mp_policy (MixedPrecisionPolicy, optional): FSDP2's mixed precision.
        dp_dim, tp_dim (str): the names of the mesh dims.

    Returns:
        ``model``, whose parameters are DTensors on the (dp, tp) mesh (or on the dp mesh, for
        those TP left plain), and whose ignored small parameters keep their type.

    Raises:
        ValueError: a pattern matches nothing, the mesh has no ``dp_dim``, ``min_weight_size``
            is not a positive int, the TP parameters are not on ``mesh[tp_dim]`` (or a 2-D mesh
            has no TP parameters), a module is already fully sharded, a tied parameter's
            modules fall in different units, or ``mp_policy`` casts parameters while some
            stay replicated (FSDP2 does not cast those).

    .. note:: Gradients of the replicated parameters are averaged over dp after every
       backward (also under FSDP2's ``set_requires_gradient_sync(False)``): correct with
       gradient accumulation, at the cost of one small all-reduce each per backward.

    Example::

        >>> # xdoctest: +SKIP("needs 4 ranks")
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> parallelize_module(model, mesh["tp"], tensor_parallel_plan())
        >>> checkpoint_by_pattern(model, "layers.*")
        >>> fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=2**16)
    """
    dp_mesh, tp_mesh = _dp_and_tp_meshes(mesh, dp_dim, tp_dim)
    min_weight_size = check_min_weight_size(min_weight_size, _CALLER)
    mp_policy = _mixed_precision(mp_policy)
    require_before(model, _CALLER, later=("fully_shard",))
    _require_tp_params_on(model, tp_mesh, mesh, tp_dim)
    units = outermost_matches(model, patterns, what=f"{_CALLER} pattern")
    _require_shared_params_in_one_unit(model, units)
    predictions = _predicted(model, dp_mesh.size(), tp_mesh.size() if tp_mesh is not None else 1, min_weight_size)
    _require_one_dtype_under_mixed_precision(predictions, mp_policy)
    _report_unsharded(predictions)
    _report_whole_units(model, units, predictions, min_weight_size)
    ignored = {param for param, placement, _ in predictions.values() if placement == Replicate()}
    by_id = {id(param): placement for param, placement, _ in predictions.values()}
    shard_fn = partial(_shard_placement, by_id=by_id)
    options = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward, shard_placement_fn=shard_fn, mp_policy=mp_policy, ignored_params=ignored)
    for path in units:
        if path:
            fully_shard(model.get_submodule(path), **options)
    fully_shard(model, **options)
    if dp_mesh.size() > 1:
        names = [name for name, (param, placement, _) in predictions.items() if placement == Replicate()]
        _average_grads_over_dp(model, names, dp_mesh.get_group())
    return model


def _dp_and_tp_meshes(mesh: object, dp_dim: str, tp_dim: str) -> tuple[DeviceMesh, DeviceMesh | None]:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{_CALLER} needs a DeviceMesh: the 2-D (dp, tp) mesh, or a 1-D mesh for FSDP only; got {mesh!r}"
        )
    axes = axis_sizes(mesh, dp_dim=dp_dim, tp_dim=tp_dim, caller=_CALLER)
    if mesh.ndim == 1:
        return mesh, None
    return mesh[dp_dim], mesh[tp_dim] if tp_dim in axes else None


def _mixed_precision(mp_policy: object) -> MixedPrecisionPolicy:
    if mp_policy is None:
        return MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"{_CALLER}(mp_policy=...) must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got {mp_policy!r}")
    return mp_policy


def _require_tp_params_on(model: nn.Module, tp_mesh: DeviceMesh | None, mesh: DeviceMesh, tp_dim: str) -> None:
    """TP must already have run on ``mesh[tp_dim]``: FSDP2 composes its dp placement with theirs."""
    tp_params = [(name, p) for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if tp_mesh is None:
        if tp_params:
            raise ValueError(
                f"{_CALLER}: parameter {tp_params[0][0]!r} is a DTensor on {tp_params[0][1].device_mesh}, "
                f"but the mesh is 1-D (FSDP only); pass the 2-D (dp, tp) mesh whose {tp_dim!r} dim the "
                f"plan was applied on"
            )
        return
    if not tp_params:
        raise ValueError(
            f"{_CALLER}: the mesh has a {tp_dim!r} dim but no parameter of {type(model).__name__} is "
            f"tensor-parallel; call parallelize_module(model, mesh[{tp_dim!r}], plan) first (TP, then "
            f"checkpoint_by_pattern, then FSDP), or pass mesh[dp_dim] for FSDP only"
        )
    for name, param in tp_params:
        if param.device_mesh != tp_mesh:
            raise ValueError(
                f"{_CALLER}: parameter {name!r} is a DTensor on {param.device_mesh}, not on "
                f"mesh[{tp_dim!r}] of the given mesh {mesh}; apply the TP plan with "
                f"parallelize_module(model, mesh[{tp_dim!r}], plan) on the same 2-D mesh"
            )


def _unit_of(path: str, units: list[str]) -> str:
    """The FSDP unit that holds the module at ``path``: the matched unit above it, else the root."""
    return next((unit for unit in units if unit and (path == unit or path.startswith(unit + "."))), "")


def _require_shared_params_in_one_unit(model: nn.Module, units: list[str]) -> None:
    """A parameter shared by several modules (tied embeddings) must fall in one FSDP unit."""
    seen: dict[int, tuple[str, str]] = {}
    for module_path, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            path = f"{module_path}.{name}" if module_path else name
            unit = _unit_of(module_path, units)
            first = seen.setdefault(id(param), (path, unit))
            if first[1] != unit:
                raise ValueError(
                    f"{_CALLER}: parameter {first[0]!r} is shared (tied) with {path!r}, but the patterns put "
                    f"them in different FSDP units ({first[1] or '<root>'!r} and {unit or '<root>'!r}); FSDP2 "
                    f"shards a parameter in one unit: choose patterns that keep both modules in one unit "
                    f"(e.g. leave both to the root)"
                )


def _predicted(model: nn.Module, dp: int, tp: int, min_weight_size: int) -> dict[str, tuple[nn.Parameter, object, str]]:
    """``{name: (param, dp placement, why)}`` for every parameter (a shared one once)."""
    predictions = {}
    for name, param in model.named_parameters():
        tp_placement = param.placements[0] if isinstance(param, DTensor) else None
        placement, why = predict_dp_placement(tuple(param.shape), tp_placement, dp_size=dp, tp_size=tp, min_weight_size=min_weight_size)
        predictions[name] = (param, placement, why)
    return predictions


def _report_unsharded(predictions: dict) -> None:
    no_dim = [f"{name}: {why}" for name, (_, _, why) in predictions.items() if why.startswith("no divisible dim")]
    small = [name for name, (_, _, why) in predictions.items() if why.startswith("too small")]
    if no_dim:
        warnings.warn(
            f"{_CALLER}: {len(no_dim)} parameter(s) have no dim FSDP can shard evenly over dp and stay "
            f"replicated (their gradients averaged over dp): " + "; ".join(no_dim),
            stacklevel=3,
        )
    if small:
        _log.info("%s: %d parameter(s) under min_weight_size stay replicated over dp: %s", _CALLER, len(small), small)


def _report_whole_units(model: nn.Module, units: list[str], predictions: dict, min_weight_size: int) -> None:
    """Warn about matched units that shard nothing over dp: every parameter of theirs stays
    replicated (a small model under the default ``min_weight_size``), so FSDP saves nothing there."""
    replicated_names = {name for name, (_, placement, _) in predictions.items() if placement == Replicate()}
    whole = []
    for unit in filter(None, units):
        names = [f"{unit}.{name}" for name, _ in model.get_submodule(unit).named_parameters()]
        if names and all(name in replicated_names for name in names):
            whole.append(unit)
    if whole:
        shown = ", ".join(repr(u) for u in whole[:4]) + (", ..." if len(whole) > 4 else "")
        warnings.warn(
            f"{_CALLER}: {len(whole)} of the {len([u for u in units if u])} matched units ({shown}) shard "
            f"nothing over dp: each of their parameters is under min_weight_size={min_weight_size} elements "
            f"or has no dim that splits evenly, so every dp rank holds them whole. Lower min_weight_size "
            f"(min_weight_size=1 shards every parameter with an even dim) if their memory matters",
            stacklevel=3,
        )


def _require_one_dtype_under_mixed_precision(predictions: dict, mp_policy: MixedPrecisionPolicy) -> None:
    """FSDP2 casts the parameters it manages to ``param_dtype``, not its ``ignored_params``: a
    replicated float32 norm weight would promote a bfloat16 block's activations to float32."""
    dtype = mp_policy.param_dtype
    if dtype is None:
        return
    stuck = [
        f"{name} ({why})"
        for name, (param, placement, why) in predictions.items()
        if placement == Replicate() and param.is_floating_point() and param.dtype != dtype
    ]
    if stuck:
        raise ValueError(
            f"{_CALLER}(mp_policy=MixedPrecisionPolicy(param_dtype={dtype})): FSDP2 casts only the parameters "
            f"it shards, and {len(stuck)} stay replicated over dp in their own dtype, which would mix dtypes "
            f"in forward: {', '.join(stuck[:3])}{', ...' if len(stuck) > 3 else ''}; lower min_weight_size "
            f"(min_weight_size=1 shards every parameter with a dim divisible by dp) or leave mp_policy out"
        )


def _shard_placement(param: nn.Parameter, *, by_id: dict) -> Shard:
    return by_id[id(param)]


def _average_grad_hook(param: torch.Tensor, *, group: dist.ProcessGroup, size: int) -> None:
    grad = param.grad
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    dist.all_reduce(local, group=group)
    local.div_(size)


def _average_grads_over_dp(model: nn.Module, names: list[str], group: dist.ProcessGroup) -> None:
    """After each backward, average the gradients of the replicated parameters over dp.

    The hooks are put on the parameters the model holds at each forward (the old ones
    removed): ``model.to_empty(...)`` (the ``meta`` flow) and ``load_state_dict(assign=True)``
    replace or swap the parameter tensors after ``fully_shard_by_pattern``, and a hook left on
    the old tensor would leave the new one's gradient un-averaged, each dp rank then training
    its own copy (found on the demo's ``meta`` flow).
    """
    size = dist.get_world_size(group)
    hook = partial(_average_grad_hook, group=group, size=size)
    handles: dict[str, object] = {}

    def hook_current_parameters(module: nn.Module, args: tuple) -> None:
        for name in names:
            param = module.get_parameter(name)
            if name in handles:
                handles.pop(name).remove()
            if param.requires_grad:
                handles[name] = param.register_post_accumulate_grad_hook(hook)

    model.register_forward_pre_hook(hook_current_parameters)
