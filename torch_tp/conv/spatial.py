"""``SpatialParallel``: run convolutions (and the position-wise modules between them) on an input
sharded along a spatial dim, with replicated weights; its rules and forward hooks.

The halo exchange itself is :mod:`torch_tp.conv.sharded_conv`'s DTensor handlers, and the other
ops' are the other handler sets of :mod:`torch_tp.conv._registry`: a parallelized module holds
the sets it needs while it lives, and they run inside its forward and the backward through it
(nowhere else). This module only decides what a spatial shard can run (:func:`check_spatial`,
:func:`check_spatial_region`: one rule helper for both modes), replicates the parameters, and
converts the module's input to ``Shard(dim)`` and its output to ``output_layouts``. Function
form: :func:`torch_tp.functional.spatial`.

Example::

    >>> SpatialParallel(dim=3)
    SpatialParallel(dim=3, input_layouts=Shard(dim=3), output_layouts=Shard(dim=3), use_local_output=False)
"""

from __future__ import annotations

import sys
import weakref
from functools import partial
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_tp._layouts import finish_output, redistribute_to, shard_sizes, to_dtensor
from torch_tp._module_state import ensure_state
from torch_tp.conv import _registry
from torch_tp.conv._region_ops import RegionGuard
from torch_tp.parallel import rules
from torch_tp.parallel.style import ParallelStyle, distribute_parameters, name_plain_tensors_on_error

__all__ = ["SpatialParallel", "check_spatial", "check_spatial_region", "is_spatial_leaf"]

# What SpatialParallel runs as one layer on a spatial shard: convolutions (halo exchange),
# normalizations and modules that compute each position on its own. Pooling and upsampling
# run inside a region (their handlers are region-only); one such layer alone is refused.
SPATIAL_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
SPATIAL_POINTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Identity, nn.Dropout,
    nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.ELU, nn.CELU, nn.SELU, nn.Softplus, nn.Hardtanh, nn.PReLU,
    nn.Hardshrink, nn.Softshrink, nn.Threshold, nn.Softsign, nn.Tanhshrink,
)
SPATIAL_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
SPATIAL_GROUPNORMS = (nn.GroupNorm,)
_STYLE = "SpatialParallel"


# ---------------------------------------------------------------------------- rules


def _spatial_dim(dim: object, ndim: int | None, where: str) -> int:
    """The one rule for ``dim``: an int naming a spatial dim of an ``ndim``-D (N, C, ...) input.

    ``ndim`` is ``None`` where the input's rank is not known yet (the style's constructor):
    then only batch and channels (0 and 1) are refused.
    """
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{_STYLE}(dim=...) takes an int (a tensor dim such as 3 or -1), got {dim!r}")
    if ndim is None:
        if 0 <= dim < 2:
            raise ValueError(
                f"{_STYLE}(dim={dim}){where}: dims 0 and 1 of an (N, C, ...) input are batch and "
                f"channels; pass a spatial dim such as 2, 3 or -1"
            )
        return dim
    if not -ndim <= dim < ndim or dim % ndim < 2:
        raise ValueError(
            f"{_STYLE}(dim={dim}){where}: dim must be a spatial dim of its {ndim}-D (N, C, ...) "
            f"input, i.e. one of {list(range(2, ndim))} or {list(range(2 - ndim, 0))}"
        )
    return dim % ndim


def _check(module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None, *, dim: int,
           region: bool, until: str | None = None) -> None:
    """The one rule helper of both modes: what ``SpatialParallel`` refuses, before anything changes."""
    rules.require_1d_mesh(device_mesh, _STYLE)
    where = rules.describe(module, module_path)
    if region:
        _spatial_dim(dim, None, "")
        _require_until(module, until, where)
        for path, child in module.named_modules():
            inner = f"{module_path}.{path}" if module_path and path else (path or module_path)
            _require_runs_on_a_strip(child, rules.describe(child, inner), region=True, dim=dim)
    else:
        _spatial_dim(dim, module.weight.ndim if isinstance(module, SPATIAL_CONVS) else None, f" on {where}")
        _require_runs_on_a_strip(module, where, region=False, dim=dim)
    rules.require_plain_parameters(module, _STYLE, module_path)
    rules.require_unprepared(module, rules.BOTH_STAGES, _STYLE, module_path)


def check_spatial(module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None = None, *, dim: int = -1) -> None:
    """Raise if ``SpatialParallel(dim=dim)`` cannot run ``module`` on a spatial shard (changes nothing).

    Accepted: ``nn.Conv1d/2d/3d`` with ``padding_mode="zeros"`` (sharded along one of their
    spatial dims), ``nn.BatchNorm1d/2d/3d`` in training mode (statistics of the whole batch,
    :mod:`torch_tp.conv.batch_norm`) and eval mode, ``nn.GroupNorm`` (statistics of the whole
    image, :mod:`torch_tp.conv.group_norm`), and position-wise modules (``nn.ReLU``, ``nn.Hardswish``,
    ``nn.GELU``, ``nn.Identity``, ``nn.Dropout`` with ``p=0`` or in eval mode, ...).
    Refused: everything else (pooling and upsampling run inside a region, :func:`check_spatial_region`).

    Example::

        >>> check_spatial(nn.Conv2d(3, 8, 3, padding=1), 4, "stem", dim=3)
        >>> try:
        ...     check_spatial(nn.MaxPool2d(2), 4, "pool", dim=3)
        ... except TypeError as err:
        ...     print(type(err).__name__, str(err)[:50])
        UnsupportedModuleError SpatialParallel cannot run 'pool' (MaxPool2d) on a
    """
    _check(module, device_mesh, module_path, dim=dim, region=False)


def check_spatial_region(
    module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None = None, *, dim: int = -1,
    until: str | None = None,
) -> None:
    """Raise if ``SpatialParallel(dim=dim, until=until)`` cannot run the container ``module`` as a
    spatial region (changes nothing).

    Every layer inside runs on the spatial shard through DTensor and torch_tp's op handlers
    (convolution, BatchNorm); refused up front, naming the path: a layer whose result on a
    shard cannot equal the unsharded one (``Dropout`` with ``p > 0`` in training mode, a
    convolution that pads from the far border), and an ``until`` that names no submodule.

    Example::

        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))
        >>> check_spatial_region(net, 4, "", dim=3, until="2")
        >>> try:
        ...     check_spatial_region(net, 4, "", dim=3, until="head")
        ... except ValueError as err:
        ...     print(str(err)[:60])
        SpatialParallel(until='head') on '<root>' (Sequential): no s
    """
    _check(module, device_mesh, module_path, dim=dim, region=True, until=until)


_HANDLED = SPATIAL_CONVS + SPATIAL_BATCHNORMS + SPATIAL_GROUPNORMS + SPATIAL_POINTWISE


def is_spatial_leaf(module: nn.Module) -> bool:
    """Whether ``SpatialParallel`` runs ``module`` as one layer (a convolution, a BatchNorm, a
    position-wise module); a module with submodules (a model, a block) it runs as a *region*.

    Example::

        >>> is_spatial_leaf(nn.Conv2d(3, 8, 3)), is_spatial_leaf(nn.Sequential(nn.Conv2d(3, 8, 3)))
        (True, False)
    """
    return _handled_base(module) is not None


_TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _require_until(module: nn.Module, until: str | None, where: str) -> None:
    paths = [path for path, _ in module.named_modules()]
    if until is not None and (not until or until not in paths):
        raise ValueError(
            f"{_STYLE}(until={until!r}) on {where}: no submodule has that path; name the module "
            f"where the spatial region ends (e.g. the classifier head), one of {sorted(p for p in paths if p)[:8]}"
        )


def _handled_base(module: nn.Module) -> type | None:
    """The first class of ``module``'s MRO this style handles, or ``None``."""
    return next((cls for cls in type(module).__mro__ if cls in _HANDLED), None)


def _require_runs_on_a_strip(module: nn.Module, where: str, *, region: bool, dim: int) -> None:
    """The one rule for a layer on a spatial strip. Both modes refuse a layer whose result would
    differ (padding from the far border, a dropout mask); one layer on its own must also be a
    layer this style knows (inside a region, DTensor and the handler sets run every op)."""
    if isinstance(module, (*SPATIAL_CONVS, *_TRANSPOSED_CONVS)) and module.padding_mode != "zeros":
        raise rules.UnsupportedModuleError(
            f"{_STYLE} cannot run {where} on a spatial shard: padding_mode="
            f"{module.padding_mode!r} pads with values from the far border; only 'zeros'"
        )
    if isinstance(module, _DROPOUTS) and module.training and module.p > 0:
        raise rules.UnsupportedModuleError(
            f"{_STYLE} cannot run {where} with p={module.p} in training mode: its mask "
            f"would differ from the unsharded model's. Use p=0 or .eval()"
        )
    if region:
        return
    base = _handled_base(module)
    if base is not None and type(module).forward is not base.forward:
        raise rules.UnsupportedModuleError(
            f"{_STYLE} cannot run {where} as one layer: {type(module).__qualname__} subclasses "
            f"nn.{base.__name__} but has its own forward, which {_STYLE} does not know (it may do more "
            f"than nn.{base.__name__}, e.g. a BatchNorm that also applies an activation). Apply "
            f"{_STYLE}(dim={dim}) to the model or block that holds it instead (one plan entry for the "
            f"whole CNN, e.g. parallelize_module(model, mesh, {_STYLE}(dim={dim}))): a spatial region "
            f"runs every op of its forward on the strips"
        )
    if base is None:
        names = ", ".join(f"nn.{t.__name__}" for t in _HANDLED)
        raise rules.UnsupportedModuleError(
            f"{_STYLE} cannot run {where} on a spatial shard: it handles {names} "
            f"(BatchNorm in training and eval mode). Apply SpatialParallel to the model or block "
            f"holding it instead (a spatial region runs pooling and upsampling on strips), or gather "
            f"the input first (e.g. output_layouts=Replicate() on the module before)"
        )


# ---------------------------------------------------------------------------- hooks


def _global_size(local: torch.Tensor, d: int, device_mesh, where: str) -> int:
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
            f"{_STYLE} on {where}: the ranks' inputs have sizes {sizes} along dim {d} (global "
            f"{total}), but Shard({d}) over {n} ranks means torch.chunk pieces {expected}; split "
            f"the input with torch.chunk (or pass the full input with input_layouts=Replicate())"
        )
    return total


def _require_runnable_input(module: nn.Module, x: torch.Tensor, where: str, sets: tuple) -> None:
    for handler_set in sets:
        if not handler_set.is_installed():  # someone replaced DTensor's table entries since
            raise RuntimeError(
                f"{_STYLE} on {where}: the handlers of {handler_set.owner} are no longer in DTensor's "
                f"custom op table (something replaced them); without them DTensor would run its "
                f"default rules on a spatial shard. Parallelize the module again"
            )
    if isinstance(module, SPATIAL_CONVS) and x.ndim != module.weight.ndim:
        raise ValueError(
            f"{_STYLE} on {where} needs a batched {module.weight.ndim}-D (N, C, ...) input, "
            f"got {x.ndim} dims {tuple(x.shape)}"
        )


def _spatial_input(module, args, *, device_mesh, input_layout, dim, module_path, sets, region=False):
    if not region:
        _watch_left_out_norms(module, module_path, dim)
    x = rules.require_first_input(args, module, module_path, _STYLE)
    where = rules.describe(module, module_path)
    _require_runnable_input(module, x, where, sets)
    desired = Shard(_spatial_dim(dim, x.ndim, f" on {where}"))
    if isinstance(x, DTensor):
        return None if tuple(x.placements) == (desired,) else (redistribute_to(x, desired), *args[1:])
    layout = input_layout or desired
    if type(layout) is Shard:
        layout = Shard(layout.dim % x.ndim)
        x = to_dtensor(x, device_mesh, layout, sharded_dim_size=_global_size(x, layout.dim, device_mesh, where))
    else:
        x = to_dtensor(x, device_mesh, layout)
    return (redistribute_to(x, desired), *args[1:])


# ---------------------------------------------------------------------------- norms left out of a plan

# A per-layer plan ({"0": SpatialParallel(dim=3), "2": ...}) hands each layer's Shard(dim) output to
# the next module. A normalization the plan left out between them would run on the strips without
# the spatial handlers: DTensor refuses its plain weight or running statistics without naming the
# module (or a norm without them computes the statistics of its strip). So the first forward of a
# layer finds the module the plan was applied to (on the call stack: the module whose submodule at
# the layer's path is the layer) and gives each normalization under it that no style prepared a
# forward pre-hook refusing a sharded input it cannot run on (see _strips_break), naming its path and
# the plan entry to add.

_NORM_STATISTICS = (*SPATIAL_BATCHNORMS, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
                    nn.InstanceNorm3d, nn.GroupNorm)  # statistics over the spatial dims
_NORMS = (*_NORM_STATISTICS, nn.LayerNorm, nn.RMSNorm)
_LOOKED: weakref.WeakSet = weakref.WeakSet()  # layers whose plan root was looked for
_WATCHED: weakref.WeakSet = weakref.WeakSet()  # plan roots whose left-out norms are watched


@torch._dynamo.disable(reason="torch_tp.conv: looking for the plan's module on the call stack")
def _watch_left_out_norms(layer: nn.Module, module_path: str | None, dim: int) -> None:
    if not module_path or layer in _LOOKED:
        return
    _LOOKED.add(layer)
    root = _plan_root(layer, module_path)
    if root is None or root in _WATCHED:
        return
    _WATCHED.add(root)
    prepared: list[str] = []
    for path, module in root.named_modules():
        if rules.is_prepared(module) or any(path.startswith(f"{p}.") for p in prepared):
            prepared.append(path)
        elif isinstance(module, _NORMS):
            module.register_forward_pre_hook(partial(_refuse_left_out_norm, path=path, dim=dim))


def _plan_root(layer: nn.Module, module_path: str) -> nn.Module | None:
    """The innermost module being called whose submodule ``module_path`` is ``layer``."""
    call = nn.Module._call_impl.__code__
    frame = sys._getframe(1)
    while frame is not None:
        caller = frame.f_locals.get("self") if frame.f_code is call else None
        if isinstance(caller, nn.Module) and caller is not layer:
            try:
                if caller.get_submodule(module_path) is layer:
                    return caller
            except AttributeError:
                pass
        frame = frame.f_back
    return None


def _strips_break(module: nn.Module, x: DTensor) -> bool:
    """Whether ``module`` (a norm) cannot run on ``x``'s strips with DTensor's own rules: it holds plain
    tensors (refused, unnamed), or its statistics span the sharded dim (BatchNorm, InstanceNorm and
    GroupNorm always span the spatial dims; a LayerNorm or RMSNorm its ``normalized_shape``)."""
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    if any(not isinstance(t, DTensor) for t in own) or isinstance(module, _NORM_STATISTICS):
        return True
    sharded = [p.dim % x.ndim for p in x.placements if isinstance(p, Shard)]
    return any(d >= x.ndim - len(module.normalized_shape) for d in sharded)


def _refuse_left_out_norm(module: nn.Module, args: Any, *, path: str, dim: int) -> None:
    x = args[0] if args else None
    if not isinstance(x, DTensor) or not any(isinstance(p, Shard) for p in x.placements) or not _strips_break(module, x):
        return
    where = rules.describe(module, path)
    if isinstance(module, SPATIAL_BATCHNORMS + SPATIAL_GROUPNORMS):
        fix = (f"Add {path!r}: {_STYLE}(dim={dim}) to the plan (BatchNorm and GroupNorm take the "
               f"statistics of the whole image there)")
    else:
        parent = path.rpartition(".")[0]
        fix = (f"{_STYLE} runs nn.{type(module).__name__} only inside a region: give the block that holds "
               f"it one entry, {parent!r}: {_STYLE}(dim={dim}), instead of entries for its layers")
    raise ValueError(
        f"torch_tp.conv.spatial: {where} is not in the plan, but its input is the spatially sharded "
        f"{tuple(x.placements)} output of the {_STYLE} layers beside it; without the spatial handlers it "
        f"cannot normalize strips like the whole image. {fix}, or make the whole model one region: "
        f"parallelize_module(model, mesh, {_STYLE}(dim={dim}))"
    )


def _spatial_output(module, inputs, output, *, layout, use_local_output):
    return finish_output(redistribute_to(output, layout), use_local_output)


# A region records, per call, whether its input came as a plain tensor (its output goes back
# in the same form): its ModuleState.spatial_plain_inputs, a stack, since a module may re-enter.


def _region_input(module, args, **where):
    x = args[0] if args else None
    ensure_state(module).spatial_plain_inputs.append((not isinstance(x, DTensor), getattr(x, "ndim", 0)))
    return _spatial_input(module, args, region=True, **where)


#: Dtypes gloo's collectives cannot move ("Invalid scalar type"): gathered as the wider one, exactly.
_GLOO_WIDENED = {torch.int16: torch.int32}


def _whole(value: DTensor) -> DTensor:
    """``value`` with every mesh dim ``Replicate()``: the spatial dims reduced (pooled) or gathered
    (an int16 map, ``x.short()``, travels as int32 over gloo, which has no int16)."""
    whole = [Replicate()] * value.device_mesh.ndim
    wider = _GLOO_WIDENED.get(value.dtype)
    if wider is not None and value.device.type == "cpu" and any(not p.is_replicate() for p in value.placements):
        return value.to(wider).redistribute(placements=whole).to(value.dtype)
    return value.redistribute(placements=whole)


def _region_output(module, inputs, output, *, layout, dim, use_local_output):
    """A region hands back what its input was: strips of a map that is still spatial (a U-Net's
    logits), whole values once the spatial dim is pooled away (a classifier's), or the whole
    tensor when ``output_layouts`` asks for it; a plain tensor for a plain input."""
    plain, ndim = ensure_state(module).spatial_plain_inputs.pop()
    if not isinstance(output, DTensor):
        return output
    d = dim % ndim
    still_spatial = output.ndim == ndim and output.shape[d] > 1
    output = redistribute_to(output, Shard(d)) if layout == Shard(dim) and still_spatial else _whole(output)
    return output.to_local() if plain or use_local_output else output


def _head_input(module, args):
    """The module where a region ends (``until``) reads whole tensors, as the unsharded model's head."""
    return tuple(_whole(a) if isinstance(a, DTensor) else a for a in args)


# ---------------------------------------------------------------------------- style


class SpatialParallel(ParallelStyle):
    """Run a whole CNN (or one layer of it) on an input sharded along a spatial dim, weights replicated.

    **On a model or block** (any module that is not one of the layers below), the module is a
    *spatial region*: ``parallelize_module(model, mesh, SpatialParallel(dim=3))``. Every
    parameter inside is replicated, the input becomes ``Shard(dim)``, and every op runs on the
    rank's strip through DTensor and torch_tp's op handlers (convolution with halo exchange,
    BatchNorm with the statistics of the whole batch), so third-party modules that call
    these ops work unchanged (a BatchNorm subclass that applies its activation in its own
    ``forward``, a channels-last LayerNorm, squeeze-excite's spatial mean). Where the spatial
    dims are pooled away, what follows (a classifier head) computes on the whole value. The
    region returns what its input was: a plain tensor for a plain input (this rank's strip
    of a map that is still spatial, such as a U-Net's logits; the whole value once pooled), a
    DTensor for a DTensor. ``until="head"`` ends the region at that submodule, which reads
    whole tensors. Layers whose result on a strip would differ (``Dropout`` with ``p > 0`` in
    training, a convolution or transposed convolution padding from the far border) are
    refused naming their path.

    **On one layer**: ``nn.Conv1d/2d/3d``, ``nn.BatchNorm1d/2d/3d`` (training and eval mode),
    ``nn.ReLU`` (and ``GELU``, ``SiLU``, ...), ``nn.Identity`` and ``nn.Dropout`` with ``p=0``
    or in eval mode, and subclasses that keep their ``forward`` (a subclass with its own
    ``forward``, timm's ``BatchNormAct2d``, is refused there: run it inside a region). The
    output stays a ``Shard(dim)`` DTensor for the next layer. Other layers (pooling,
    upsampling: a region runs them) are refused with :class:`~torch_tp.UnsupportedModuleError`
    naming the module path. A normalization that such a per-layer plan leaves out, between its
    layers, is refused at its first sharded input, naming its path and the plan entry to add.

    A plain-tensor input is this rank's ``torch.chunk`` slice (the global size is gathered,
    so uneven slices work) or, with ``input_layouts=Replicate()``, the full input. The
    gradients of the replicated parameters come back summed over the ranks.
    Function form: :func:`torch_tp.functional.spatial`.

    Keyword Args:
        dim (int): the sharded tensor dim of the (N, C, ...) input, e.g. ``3`` or ``-1``
            for the width of NCHW. Required.
        input_layouts (Placement, optional): layout of a plain-tensor input. Default
            ``Shard(dim)``: this rank's ``torch.chunk`` slice (uneven slices are fine);
            ``Replicate()``: the full input, of which each rank keeps its slice.
        output_layouts (Placement, optional): layout of the output. Default ``Shard(dim)``
            (a region: the strip of a map, the whole of a pooled value); ``Replicate()``: whole.
        use_local_output (bool): return the local shard instead of a DTensor. Default ``False``.
        until (str, optional): torch_tp only; for a region, the path of the submodule where
            it ends (it and what follows read whole tensors). Default ``None``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> parallelize_module(resnet, mesh, SpatialParallel(dim=3))   # the whole model, one line
        >>> resnet(my_width_strip).shape                                # whole logits
        torch.Size([2, 10])
        >>> parallelize_module(cnn, mesh, {"*": SpatialParallel(dim=3)})  # layer by layer
        >>> cnn(my_width_strip).placements
        (Shard(dim=3),)

    .. note:: The parallelized module holds the op handler sets it needs (convolution,
        BatchNorm, ...; every set for a region) while it lives, and their handlers run only
        inside its forward and the backward through it: DTensor code beside it behaves as
        if torch_tp were not there (:mod:`torch_tp.conv._registry`).
    """

    dim: int
    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = False
    until: str | None = None
    _additive_defaults: ClassVar[dict[str, Any]] = {"until": None}

    def __post_init__(self):
        _spatial_dim(self.dim, None, "")
        self.input_layouts = rules.single_layout(self.input_layouts, "input_layouts", _STYLE, Shard(self.dim))
        self.output_layouts = rules.single_layout(self.output_layouts, "output_layouts", _STYLE, Shard(self.dim))
        self.use_local_output = rules.flag(self.use_local_output, "use_local_output", _STYLE)
        if self.until is not None and not isinstance(self.until, str):
            raise TypeError(f"{_STYLE}(until=...) takes a submodule path such as 'head', got {self.until!r}")

    def param_placements(self, module):
        return rules.replicated_placements(module)

    def _is_region(self, module: nn.Module) -> bool:
        """A module with submodules (a model, a block) is a region; a layer is one layer."""
        return self.until is not None or (not is_spatial_leaf(module) and any(True for _ in module.children()))

    def check(self, module, device_mesh, module_path=None):
        if self._is_region(module):
            check_spatial_region(module, device_mesh, module_path, dim=self.dim, until=self.until)
        else:
            check_spatial(module, device_mesh, module_path, dim=self.dim)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        plain = {name: p for name, p in rules.replicated_placements(module).items()
                 if not isinstance(module.get_parameter(name), DTensor)}  # a region inside a region
        distribute_parameters(module, plain, device_mesh, src_data_rank)
        if self._is_region(module):
            return self._apply_to_region(module, device_mesh, module_path)
        name_plain_tensors_on_error(module, _STYLE, module_path)
        module.register_forward_pre_hook(partial(
            _spatial_input, device_mesh=device_mesh, input_layout=self.input_layouts, dim=self.dim,
            module_path=module_path, sets=_registry.sets_for(module),
        ))
        module.register_forward_hook(
            partial(_spatial_output, layout=self.output_layouts, use_local_output=self.use_local_output)
        )
        _run_in_scope(module, _registry.sets_for(module), rules.describe(module, module_path))
        rules.mark_prepared(module, rules.BOTH_STAGES, _STYLE)
        return module

    def _apply_to_region(self, module, device_mesh, module_path):
        module.register_forward_pre_hook(partial(
            _region_input, device_mesh=device_mesh, input_layout=self.input_layouts, dim=self.dim,
            module_path=module_path, sets=_registry.sets_for(None),
        ))
        module.register_forward_hook(partial(
            _region_output, layout=self.output_layouts, dim=self.dim, use_local_output=self.use_local_output,
        ))
        if self.until is not None:
            module.get_submodule(self.until).register_forward_pre_hook(_head_input)
        _run_in_scope(module, _registry.sets_for(None), rules.describe(module, module_path))
        rules.mark_prepared(module, rules.BOTH_STAGES, _STYLE)
        return module


def _run_in_scope(module: nn.Module, sets: tuple, where: str) -> None:
    """Hold ``sets`` in DTensor's table while ``module`` lives, and run its forward (all its hooks
    included: registered last, entered first) and the backward through it in the scope where
    their handlers apply (:mod:`torch_tp.conv._registry`); its forward runs only the ops
    :mod:`torch_tp.conv._region_ops` allows on strips (``where`` names it in a refusal)."""
    _registry.hold(module, sets)
    module.register_forward_pre_hook(partial(_enter_scope, where=where), prepend=True)
    module.register_forward_hook(_scope_output, always_call=True)
    # torch.compile runs a spatial model eagerly (a graph break; fullgraph=True refuses at compile
    # time): traced, its scope hooks would be deferred side effects and its handlers would meet
    # fake strips, so the halo exchange must not be traced
    module.forward = torch._dynamo.disable(module.forward, reason=_NOT_TRACED)


_NOT_TRACED = ("torch_tp.conv: a SpatialParallel model runs eagerly under torch.compile (its halo exchange "
               "and scope are not traceable yet); compile the modules around it, or use fullgraph=False")


@torch._dynamo.disable(reason=_NOT_TRACED)
def _enter_scope(module: nn.Module, args: Any, *, where: str) -> None:
    _registry.enter_scope()
    guard = RegionGuard(where)
    guard.__enter__()
    ensure_state(module).region_guards.append(guard)  # one per call in flight (a module may re-enter)


@torch._dynamo.disable(reason=_NOT_TRACED)
def _scope_output(module: nn.Module, inputs: Any, output: Any) -> None:
    guards = ensure_state(module).region_guards
    if guards:
        guards.pop().__exit__(None, None, None)
    _registry.exit_scope()
    _registry.scope_backward(output)
