"""``SpatialParallel``: run convolutions (and the position-wise modules between them) on an input
sharded along a spatial dim, with replicated weights; its rules and forward hooks.

The halo exchange itself is :mod:`torch_tp.conv.sharded_conv`'s DTensor handlers: applying
the style to a convolution installs them (:func:`torch_tp.conv.install`, once). This module
only decides what a spatial shard can run (:func:`check_spatial`), replicates the
parameters, and converts the module's input to ``Shard(dim)`` and its output to
``output_layouts``. Function form: :func:`torch_tp.functional.spatial`.

Example::

    >>> SpatialParallel(dim=3)
    SpatialParallel(dim=3, input_layouts=Shard(dim=3), output_layouts=Shard(dim=3), use_local_output=False)
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_tp._layouts import finish_output, redistribute_to, shard_sizes, to_dtensor
from torch_tp.conv import batch_norm as sharded_batch_norm
from torch_tp.conv import sharded_conv
from torch_tp.parallel import rules
from torch_tp.parallel.style import ParallelStyle, distribute_parameters, name_plain_tensors_on_error

__all__ = ["SpatialParallel", "check_spatial"]

# What SpatialParallel runs on a spatial shard: convolutions (halo exchange) and modules
# that compute each position on its own. Pooling is refused: its windows cross shard
# borders and there is no halo exchange for it.
SPATIAL_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
SPATIAL_POINTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Identity, nn.Dropout,
)
SPATIAL_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
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


def check_spatial(module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None = None, *, dim: int = -1) -> None:
    """Raise if ``SpatialParallel(dim=dim)`` cannot run ``module`` on a spatial shard (changes nothing).

    Accepted: ``nn.Conv1d/2d/3d`` with ``padding_mode="zeros"`` (sharded along one of their
    spatial dims), ``nn.BatchNorm1d/2d/3d`` in training mode (statistics of the whole batch,
    :mod:`torch_tp.conv.batch_norm`) and eval mode, and position-wise modules (``nn.ReLU``,
    ``nn.GELU``, ``nn.Identity``, ``nn.Dropout`` with ``p=0`` or in eval mode, ...).
    Refused: pooling and everything else.

    Example::

        >>> check_spatial(nn.Conv2d(3, 8, 3, padding=1), 4, "stem", dim=3)
        >>> try:
        ...     check_spatial(nn.MaxPool2d(2), 4, "pool", dim=3)
        ... except TypeError as err:
        ...     print(type(err).__name__, str(err)[:50])
        UnsupportedModuleError SpatialParallel cannot run 'pool' (MaxPool2d) on a
    """
    rules.require_1d_mesh(device_mesh, _STYLE)
    where = rules.describe(module, module_path)
    _spatial_dim(dim, module.weight.ndim if isinstance(module, SPATIAL_CONVS) else None, f" on {where}")
    _require_spatial_module(module, where)
    rules.require_plain_parameters(module, _STYLE, module_path)
    rules.require_unprepared(module, rules.BOTH_STAGES, _STYLE, module_path)


_HANDLED = SPATIAL_CONVS + SPATIAL_BATCHNORMS + SPATIAL_POINTWISE


def _handled_base(module: nn.Module) -> type | None:
    """The first class of ``module``'s MRO this style handles, or ``None``."""
    return next((cls for cls in type(module).__mro__ if cls in _HANDLED), None)


def _require_spatial_module(module: nn.Module, where: str) -> None:
    base = _handled_base(module)
    if base is not None and type(module).forward is not base.forward:
        raise rules.UnsupportedModuleError(
            f"{_STYLE} cannot run {where}: {type(module).__qualname__} subclasses nn.{base.__name__} "
            f"but has its own forward, which {_STYLE} does not know (it may do more than "
            f"nn.{base.__name__}, e.g. a BatchNorm that also applies an activation); "
            f"parallelize its parts, or leave it out of the plan"
        )
    if isinstance(module, SPATIAL_CONVS) and module.padding_mode != "zeros":
        raise rules.UnsupportedModuleError(
            f"{_STYLE} cannot run {where} on a spatial shard: padding_mode="
            f"{module.padding_mode!r} pads with values from the far border; only 'zeros'"
        )
    if isinstance(module, nn.Dropout) and module.training and module.p > 0:
        raise rules.UnsupportedModuleError(
            f"{_STYLE} cannot run {where} with p={module.p} in training mode: its mask "
            f"would differ from the unsharded model's. Use p=0 or .eval()"
        )
    if base is None:
        names = ", ".join(f"nn.{t.__name__}" for t in _HANDLED)
        raise rules.UnsupportedModuleError(
            f"{_STYLE} cannot run {where} on a spatial shard: it handles {names} "
            f"(BatchNorm in training and eval mode). Pooling windows cross shard borders; gather "
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


def _require_runnable_input(module: nn.Module, x: torch.Tensor, where: str) -> None:
    if isinstance(module, SPATIAL_BATCHNORMS) and not sharded_batch_norm.is_installed():
        raise RuntimeError(
            f"{_STYLE} on {where}: the sharded BatchNorm handlers were uninstalled "
            f"(torch_tp.conv.batch_norm.uninstall()); without them DTensor cannot normalize a "
            f"spatial shard with the module's plain running statistics. Call "
            f"torch_tp.conv.batch_norm.install()"
        )
    if not isinstance(module, SPATIAL_CONVS):
        return
    if not sharded_conv.is_installed():
        raise RuntimeError(
            f"{_STYLE} on {where}: the sharded convolution handlers were uninstalled "
            f"(torch_tp.conv.uninstall()); without them DTensor would mislabel a padded "
            f"convolution's output. Call torch_tp.conv.install()"
        )
    if x.ndim != module.weight.ndim:
        raise ValueError(
            f"{_STYLE} on {where} needs a batched {module.weight.ndim}-D (N, C, ...) input, "
            f"got {x.ndim} dims {tuple(x.shape)}"
        )


def _spatial_input(module, args, *, device_mesh, input_layout, dim, module_path):
    x = rules.require_first_input(args, module, module_path, _STYLE)
    where = rules.describe(module, module_path)
    _require_runnable_input(module, x, where)
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


def _spatial_output(module, inputs, output, *, layout, use_local_output):
    return finish_output(redistribute_to(output, layout), use_local_output)


# ---------------------------------------------------------------------------- style


class SpatialParallel(ParallelStyle):
    """Run a convolution on an input sharded along a spatial dim (halo exchange), weights replicated.

    Handles ``nn.Conv1d/2d/3d`` and the modules between them: ``nn.BatchNorm1d/2d/3d`` in
    training mode (the statistics of the whole batch: one small all-gather forward, one
    all-reduce backward) and eval mode, ``nn.ReLU`` (and ``GELU``, ``SiLU``, ...), ``nn.Identity`` and
    ``nn.Dropout`` with ``p=0`` or in eval mode, and subclasses that keep their ``forward``;
a subclass with its own ``forward`` (timm's ``BatchNormAct2d``) is refused, since this style
would run the base class's computation in its place.
    Pooling (windows crossing shard borders) is refused with
    :class:`~torch_tp.UnsupportedModuleError` naming the module path.
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
        output_layouts (Placement, optional): layout of the output. Default ``Shard(dim)``.
        use_local_output (bool): return the local shard instead of a DTensor. Default ``False``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> parallelize_module(cnn, mesh, {"*": SpatialParallel(dim=3)})   # every layer
        >>> cnn(my_width_slice).placements
        (Shard(dim=3),)

    .. note:: Applying it to a convolution installs the halo-exchange convolution handlers
        of :mod:`torch_tp.conv` (:func:`torch_tp.conv.install`, once), to a BatchNorm the
        handlers of :mod:`torch_tp.conv.batch_norm`, and leaves them installed; importing
        torch_tp alone changes no DTensor behaviour.
    """

    dim: int
    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = False

    def __post_init__(self):
        _spatial_dim(self.dim, None, "")
        self.input_layouts = rules.single_layout(self.input_layouts, "input_layouts", _STYLE, Shard(self.dim))
        self.output_layouts = rules.single_layout(self.output_layouts, "output_layouts", _STYLE, Shard(self.dim))
        self.use_local_output = rules.flag(self.use_local_output, "use_local_output", _STYLE)

    def param_placements(self, module):
        return rules.replicated_placements(module)

    def check(self, module, device_mesh, module_path=None):
        check_spatial(module, device_mesh, module_path, dim=self.dim)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        distribute_parameters(module, rules.replicated_placements(module), device_mesh, src_data_rank)
        if isinstance(module, SPATIAL_CONVS) and not sharded_conv.is_installed():
            sharded_conv.install()
        if isinstance(module, SPATIAL_BATCHNORMS) and not sharded_batch_norm.is_installed():
            sharded_batch_norm.install()  # its handlers read the module's plain running statistics
        else:
            name_plain_tensors_on_error(module, _STYLE, module_path)
        module.register_forward_pre_hook(partial(
            _spatial_input, device_mesh=device_mesh, input_layout=self.input_layouts, dim=self.dim,
            module_path=module_path,
        ))
        module.register_forward_hook(
            partial(_spatial_output, layout=self.output_layouts, use_local_output=self.use_local_output)
        )
        rules.mark_prepared(module, rules.BOTH_STAGES, _STYLE)
        return module
