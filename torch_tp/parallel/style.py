"""ParallelStyles: small immutable descriptions of how to parallelize one module.

Each style stores its keyword arguments and, when applied, calls the matching function
in :mod:`torch_tp.parallel.functional` — the styles hold no logic of their own. They
subclass upstream's :class:`torch.distributed.tensor.parallel.ParallelStyle`, so
upstream's ``parallelize_module`` accepts them, and they take the same keyword
arguments with the same defaults as upstream's styles.

Applying a style never changes it: ``src_data_rank`` and the module path travel as
arguments (see :meth:`ParallelStyle.apply_to`), not as attributes set on the style.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import style as _upstream
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_tp.parallel import _checks, _overlap, functional, rules
from torch_tp.parallel._layouts import check_same_length, normalize_layouts

__all__ = [
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "SpatialParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
]


class ParallelStyle(_upstream.ParallelStyle):
    """Base class of torch_tp's styles: a description of how to parallelize one module.

    Subclasses list their settings in ``_fields`` and implement :meth:`check` (raise if
    the module cannot be handled, without changing it) and :meth:`apply_to` (do it).
    Equality, hashing and ``repr`` come from ``_fields``.

    Example::

        >>> ColwiseParallel() == ColwiseParallel(input_layouts=Replicate())
        True
    """

    _fields: tuple[str, ...] = ()
    #: torch_tp-only settings (absent upstream), left out of ``repr`` at these defaults
    _additive_defaults: dict[str, Any] = {}

    def check(self, module: nn.Module, device_mesh: DeviceMesh, module_path: str | None = None) -> None:
        """Raise if this style cannot be applied to ``module`` on ``device_mesh``; change nothing."""
        _checks.require_1d_mesh(device_mesh, type(self).__name__)

    def apply_to(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        src_data_rank: int | None = 0,
        module_path: str | None = None,
    ) -> nn.Module:
        """Parallelize ``module`` in place and return it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement apply_to")

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Where applying this style puts each parameter of ``module`` (none by default)."""
        return {}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Upstream's entry point: upstream parallelize_module sets self.src_data_rank first.
        return self.apply_to(module, device_mesh, src_data_rank=self.src_data_rank)

    def _settings(self) -> tuple[tuple[str, Any], ...]:
        return tuple((name, _hashable(getattr(self, name))) for name in self._fields)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._settings() == other._settings()

    def __hash__(self) -> int:
        return hash((type(self), self._settings()))

    def __repr__(self) -> str:
        settings = ", ".join(
            f"{name}={getattr(self, name)!r}"
            for name in self._fields
            if name not in self._additive_defaults or getattr(self, name) != self._additive_defaults[name]
        )
        return f"{type(self).__name__}({settings})"


def _hashable(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    return value


def _flag(value: Any, argument: str, style: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{style}({argument}=...) takes True or False, got {value!r}")
    return value


def _single_layout(layout: Placement | None, argument: str, style: str) -> Placement | None:
    if layout is not None and not isinstance(layout, Placement):
        raise TypeError(f"{style}({argument}=...) takes one Placement such as Shard(1); got {layout!r}")
    return layout


class ColwiseParallel(ParallelStyle):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` column-wise (along its output features).

    Keyword Args:
        input_layouts (Placement, optional): layout of the module's input when it arrives as
            a plain tensor. Default ``Replicate()``; e.g. ``Shard(1)`` under sequence parallelism.
        output_layouts (Placement, optional): layout of the output. Default ``Shard(-1)``.
        use_local_output (bool): return the local shard instead of a DTensor. Default ``True``.
        overlap (bool): torch_tp only. For an ``nn.Linear`` with a sequence-sharded input
            (``input_layouts=Shard(1)``): fuse the input all-gather into the matmul, each
            chunk's transfer overlapping a matmul (:func:`torch_tp.overlap.all_gather_matmul`).
            Overlapped siblings under one module called on the same input (wq/wk/wv) share
            one fused gather. Default ``False``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> parallelize_module(model, mesh, {"layers.*.feed_forward.w[13]": ColwiseParallel()})
        >>> parallelize_module(model, mesh, {"layers.*.feed_forward.w[13]":
        ...     ColwiseParallel(input_layouts=Shard(1), overlap=True)})

    .. note:: The output is sharded on its last dim, so code between this layer and its
        paired :class:`RowwiseParallel` sees local feature counts (e.g. local heads).
    """

    _fields = ("input_layouts", "output_layouts", "use_local_output", "overlap")
    _additive_defaults = {"overlap": False}

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        overlap: bool = False,
    ):
        super().__init__()
        self.input_layouts = _single_layout(input_layouts, "input_layouts", "ColwiseParallel") or Replicate()
        self.output_layouts = _single_layout(output_layouts, "output_layouts", "ColwiseParallel") or Shard(-1)
        self.use_local_output = use_local_output
        self.overlap = _flag(overlap, "overlap", "ColwiseParallel")
        if self.overlap:
            _overlap.check_overlap_layout(self.input_layouts, "input_layouts", "ColwiseParallel", "all-gather")

    def param_placements(self, module):
        return rules.colwise_placements(module)

    def check(self, module, device_mesh, module_path=None):
        rules.check_colwise(module, device_mesh, module_path, overlap=self.overlap)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        return functional.colwise(
            module,
            device_mesh,
            input_layouts=self.input_layouts,
            output_layouts=self.output_layouts,
            use_local_output=self.use_local_output,
            overlap=self.overlap,
            src_data_rank=src_data_rank,
            module_path=module_path,
        )


class RowwiseParallel(ParallelStyle):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` row-wise (along its input features / vocabulary).

    Keyword Args:
        input_layouts (Placement, optional): layout of the input when it arrives as a plain
            tensor. Default ``Shard(-1)`` for Linear, ``Replicate()`` for Embedding ids.
        output_layouts (Placement, optional): layout of the output. Default ``Replicate()``
            (an all-reduce); ``Shard(1)`` reduce-scatters onto the sequence dim.
        use_local_output (bool): return the local tensor instead of a DTensor. Default ``True``.
        overlap (bool): torch_tp only. For an ``nn.Linear`` whose output is sequence-sharded
            (``output_layouts=Shard(1)``): fuse the reduce-scatter into the matmul
            (:func:`torch_tp.overlap.matmul_reduce_scatter`). Default ``False``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> parallelize_module(model, mesh, {"layers.*.attention.wo": RowwiseParallel()})
        >>> parallelize_module(model, mesh, {"layers.*.attention.wo":
        ...     RowwiseParallel(output_layouts=Shard(1), overlap=True)})
    """

    _fields = ("input_layouts", "output_layouts", "use_local_output", "overlap")
    _additive_defaults = {"overlap": False}

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        overlap: bool = False,
    ):
        super().__init__()
        # None: chosen by module type when applied (Shard(-1) for Linear, Replicate() for ids).
        self.input_layouts = _single_layout(input_layouts, "input_layouts", "RowwiseParallel")
        self.output_layouts = _single_layout(output_layouts, "output_layouts", "RowwiseParallel") or Replicate()
        self.use_local_output = use_local_output
        self.overlap = _flag(overlap, "overlap", "RowwiseParallel")
        if self.overlap:
            _overlap.check_overlap_layout(self.output_layouts, "output_layouts", "RowwiseParallel", "reduce-scatter")

    def param_placements(self, module):
        return rules.rowwise_placements(module)

    def check(self, module, device_mesh, module_path=None):
        rules.check_rowwise(module, device_mesh, module_path, overlap=self.overlap)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        return functional.rowwise(
            module,
            device_mesh,
            input_layouts=self.input_layouts,
            output_layouts=self.output_layouts,
            use_local_output=self.use_local_output,
            overlap=self.overlap,
            src_data_rank=src_data_rank,
            module_path=module_path,
        )


class SequenceParallel(ParallelStyle):
    """Run a norm or dropout on a sequence shard, with replicated parameters.

    Handles ``nn.LayerNorm``, ``nn.RMSNorm``, user-written norms whose parameters are 1-D
    (e.g. a Llama ``RMSNorm`` with a ``weight``) and ``nn.Dropout``.

    Keyword Args:
        sequence_dim (int): the sequence dim of the input. Default ``1``.
        use_local_output (bool): return the local shard instead of a DTensor. Default ``False``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> parallelize_module(model, mesh, {"layers.*.attention_norm": SequenceParallel()})

    .. note:: Parameters are broadcast from ``src_data_rank`` rather than assumed to be
        ones, so a custom norm init is kept.
    """

    _fields = ("sequence_dim", "use_local_output")

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        super().__init__()
        if not isinstance(sequence_dim, int):
            raise TypeError(f"SequenceParallel(sequence_dim=...) takes an int, got {sequence_dim!r}")
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def param_placements(self, module):
        return rules.sequence_parallel_placements(module)

    def check(self, module, device_mesh, module_path=None):
        rules.check_sequence_parallel(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        return functional.sequence_parallel(
            module,
            device_mesh,
            sequence_dim=self.sequence_dim,
            use_local_output=self.use_local_output,
            src_data_rank=src_data_rank,
            module_path=module_path,
        )


class SpatialParallel(ParallelStyle):
    """Run a convolution on an input sharded along a spatial dim (halo exchange), weights replicated.

    Handles ``nn.Conv1d/2d/3d`` and the position-wise modules between them: eval-mode
    ``nn.BatchNorm1d/2d/3d``, ``nn.ReLU`` (and ``GELU``, ``SiLU``, ...), ``nn.Identity`` and
    ``nn.Dropout`` with ``p=0`` or in eval mode. Training-mode BatchNorm (per-shard batch
    statistics) and pooling (windows crossing shard borders) are refused with
    :class:`~torch_tp.parallel._checks.UnsupportedModuleError` naming the module path.

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
        of :mod:`torch_tp.conv` (:func:`torch_tp.conv.install`, once) and leaves them
        installed; importing torch_tp alone changes no DTensor behaviour.
    """

    _fields = ("dim", "input_layouts", "output_layouts", "use_local_output")

    def __init__(
        self,
        *,
        dim: int,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = False,
    ):
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"SpatialParallel(dim=...) takes an int (e.g. 3 or -1), got {dim!r}")
        if 0 <= dim < 2:
            raise ValueError(
                f"SpatialParallel(dim={dim}): dims 0 and 1 of an (N, C, ...) input are batch and "
                f"channels; pass a spatial dim such as 2, 3 or -1"
            )
        self.dim = dim
        self.input_layouts = _single_layout(input_layouts, "input_layouts", "SpatialParallel") or Shard(dim)
        self.output_layouts = _single_layout(output_layouts, "output_layouts", "SpatialParallel") or Shard(dim)
        self.use_local_output = use_local_output

    def param_placements(self, module):
        return rules.spatial_placements(module)

    def check(self, module, device_mesh, module_path=None):
        rules.check_spatial(module, device_mesh, module_path, dim=self.dim)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        return functional.spatial(
            module,
            device_mesh,
            dim=self.dim,
            input_layouts=self.input_layouts,
            output_layouts=self.output_layouts,
            use_local_output=self.use_local_output,
            src_data_rank=src_data_rank,
            module_path=module_path,
        )


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs to DTensors (``input_layouts``) and redistribute them
    (``desired_input_layouts``) before its ``forward``.

    Keyword Args:
        input_layouts (Placement or tuple of Placement/None): one entry per positional input;
            ``None`` leaves a value (e.g. a non-tensor) alone.
        desired_input_layouts (Placement or tuple of Placement/None): same length; the layouts
            ``forward`` receives.
        input_kwarg_layouts (dict[str, Placement]): layouts of keyword inputs.
        desired_input_kwarg_layouts (dict[str, Placement]): desired layouts of keyword inputs.
        use_local_output (bool): hand ``forward`` local tensors instead of DTensors. Default ``False``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> PrepareModuleInput(input_layouts=(Shard(1), None),
        ...                    desired_input_layouts=(Replicate(), None))
    """

    _fields = (
        "input_layouts",
        "desired_input_layouts",
        "input_kwarg_layouts",
        "desired_input_kwarg_layouts",
        "use_local_output",
    )

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ):
        super().__init__()
        self.input_layouts = normalize_layouts(input_layouts, "input_layouts")
        self.desired_input_layouts = normalize_layouts(desired_input_layouts, "desired_input_layouts")
        check_same_length(
            self.input_layouts, self.desired_input_layouts, ("input_layouts", "desired_input_layouts")
        )
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        self.use_local_output = use_local_output

    def check(self, module, device_mesh, module_path=None):
        rules.check_prepare_input(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        return functional.prepare_input(
            module,
            device_mesh,
            input_layouts=self.input_layouts,
            desired_input_layouts=self.desired_input_layouts,
            input_kwarg_layouts=self.input_kwarg_layouts,
            desired_input_kwarg_layouts=self.desired_input_kwarg_layouts,
            use_local_output=self.use_local_output,
            module_path=module_path,
        )


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs to DTensors (``output_layouts``) and redistribute them
    (``desired_output_layouts``) after its ``forward``.

    Keyword Args:
        output_layouts (Placement or tuple of Placement/None): one entry per output.
        desired_output_layouts (Placement or tuple of Placement/None): same length.
        use_local_output (bool): return local tensors instead of DTensors. Default ``True``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
    """

    _fields = ("output_layouts", "desired_output_layouts", "use_local_output")

    def __init__(
        self,
        *,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement | None, ...],
        use_local_output: bool = True,
    ):
        super().__init__()
        self.output_layouts = normalize_layouts(output_layouts, "output_layouts")
        self.desired_output_layouts = normalize_layouts(desired_output_layouts, "desired_output_layouts")
        check_same_length(
            self.output_layouts, self.desired_output_layouts, ("output_layouts", "desired_output_layouts")
        )
        self.use_local_output = use_local_output

    def check(self, module, device_mesh, module_path=None):
        rules.check_prepare_output(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        return functional.prepare_output(
            module,
            device_mesh,
            output_layouts=self.output_layouts,
            desired_output_layouts=self.desired_output_layouts,
            use_local_output=self.use_local_output,
            module_path=module_path,
        )


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module.

    Keyword Args:
        input_layouts, desired_input_layouts, input_kwarg_layouts,
        desired_input_kwarg_layouts: as :class:`PrepareModuleInput`.
        use_local_input (bool): hand ``forward`` local tensors. Default ``False``.
        output_layouts, desired_output_layouts: as :class:`PrepareModuleOutput`.
        use_local_output (bool): return local tensors. Default ``True``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
        ...                          output_layouts=Replicate(), desired_output_layouts=Shard(1))
    """

    _fields = (
        "input_layouts",
        "desired_input_layouts",
        "input_kwarg_layouts",
        "desired_input_kwarg_layouts",
        "use_local_input",
        "output_layouts",
        "desired_output_layouts",
        "use_local_output",
    )

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement | None, ...],
        use_local_output: bool = True,
    ):
        super().__init__()
        inputs = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
        )
        outputs = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts
        )
        self.input_layouts = inputs.input_layouts
        self.desired_input_layouts = inputs.desired_input_layouts
        self.input_kwarg_layouts = inputs.input_kwarg_layouts
        self.desired_input_kwarg_layouts = inputs.desired_input_kwarg_layouts
        self.use_local_input = use_local_input
        self.output_layouts = outputs.output_layouts
        self.desired_output_layouts = outputs.desired_output_layouts
        self.use_local_output = use_local_output

    def check(self, module, device_mesh, module_path=None):
        rules.check_prepare_input(module, device_mesh, module_path)
        rules.check_prepare_output(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        return functional.prepare_input_output(
            module,
            device_mesh,
            input_layouts=self.input_layouts,
            desired_input_layouts=self.desired_input_layouts,
            input_kwarg_layouts=self.input_kwarg_layouts,
            desired_input_kwarg_layouts=self.desired_input_kwarg_layouts,
            use_local_input=self.use_local_input,
            output_layouts=self.output_layouts,
            desired_output_layouts=self.desired_output_layouts,
            use_local_output=self.use_local_output,
            module_path=module_path,
        )
