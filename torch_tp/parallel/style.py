"""ParallelStyles: small immutable descriptions of how to parallelize one module, and the code
that applies them.

A style is a keyword-only dataclass: its constructor normalizes the arguments with the
normalizers of :mod:`torch_tp.parallel.rules` (so a bad layout fails where it is written),
:meth:`ParallelStyle.check` runs the style's rule, and :meth:`ParallelStyle.apply_to`
distributes the parameters the rule places and installs the forward hooks. The function
forms of :mod:`torch_tp.functional` build the style and call these same two methods, so
``torch_tp.functional.colwise(m, mesh, **kw)`` and
``parallelize_module(root, mesh, {path: ColwiseParallel(**kw)})`` run one implementation.

The styles subclass upstream's :class:`torch.distributed.tensor.parallel.ParallelStyle`,
so upstream's ``parallelize_module`` accepts them, and they take the same keyword arguments
with the same defaults as upstream's styles. Applying a style never changes it:
``src_data_rank`` and the module path travel as arguments, not as attributes set on the style.

Example::

    >>> ColwiseParallel(output_layouts=Replicate())
    ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import style as _upstream
from torch.distributed.tensor.placement_types import Placement

from torch_tp._layouts import finish_output, redistribute_to, to_dtensor
from torch_tp.parallel import _overlap, rules

__all__ = [
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "distribute_parameters",
]


class ParallelStyle(_upstream.ParallelStyle):
    """Base class of torch_tp's styles: a description of how to parallelize one module.

    Subclasses become keyword-only dataclasses of their annotated fields, normalize them in
    ``__post_init__`` and implement :meth:`check` (raise if the module cannot be handled,
    without changing it) and :meth:`apply_to` (do it, without checking again). Equality,
    hashing and the upstream-shaped ``repr`` come from the dataclass fields; fields listed
    in ``_additive_defaults`` (torch_tp-only settings) are left out of ``repr`` at their default.

    Example::

        >>> ColwiseParallel() == ColwiseParallel(input_layouts=Replicate())
        True
    """

    #: torch_tp-only settings (absent upstream), left out of ``repr`` at these defaults
    _additive_defaults: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs):
        # Every style is a keyword-only dataclass of its settings; equality, hashing and
        # repr are this class's (a subclass that writes its own __init__ keeps it).
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(kw_only=True, eq=False, repr=False)(cls)

    def check(self, module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None = None) -> None:
        """Raise if this style cannot be applied to ``module`` on ``device_mesh``; change nothing."""
        raise NotImplementedError(f"{type(self).__name__} does not implement check")

    def apply_to(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        src_data_rank: int | None = 0,
        module_path: str | None = None,
    ) -> nn.Module:
        """Parallelize ``module`` in place and return it (call :meth:`check` first)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement apply_to")

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Where applying this style puts each parameter of ``module`` (none by default)."""
        return {}

    def link_siblings(self, modules: Sequence[nn.Module], where: str) -> None:
        """Called once with the sibling modules one plan entry gave this style; nothing by default."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Upstream's entry point: upstream's parallelize_module sets self.src_data_rank first.
        self.check(module, device_mesh)
        return self.apply_to(module, device_mesh, src_data_rank=self.src_data_rank)

    def _settings(self) -> tuple[tuple[str, Any], ...]:
        return tuple((f.name, _hashable(getattr(self, f.name))) for f in dataclasses.fields(self))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._settings() == other._settings()

    def __hash__(self) -> int:
        return hash((type(self), self._settings()))

    def __repr__(self) -> str:
        shown = (
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if self._additive_defaults.get(f.name, _ALWAYS) != getattr(self, f.name)
        )
        return f"{type(self).__name__}({', '.join(shown)})"


_ALWAYS = object()


def _hashable(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


def distribute_parameters(
    module: nn.Module, placements: dict[str, Placement], device_mesh: DeviceMesh, src_data_rank: int | None
) -> None:
    """Turn the parameters named in ``placements`` (paths relative to ``module``) into DTensors.

    Values come from ``src_data_rank`` (scattered or broadcast, so the sharded module equals
    the single-device one) or, with ``None``, from each rank's own tensor.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> distribute_parameters(norm, {"weight": Replicate()}, mesh, src_data_rank=0)
    """
    for path, placement in placements.items():
        owner_path, _, name = path.rpartition(".")
        owner = module.get_submodule(owner_path)
        param = getattr(owner, name)
        dparam = distribute_tensor(param, device_mesh, [placement], src_data_rank=src_data_rank)
        owner.register_parameter(name, nn.Parameter(dparam, requires_grad=param.requires_grad))


# ------------------------------------------------------------------- forward hooks


def _sharded_input(module, args, *, device_mesh, layout, desired, sharded_dim_size, module_path, style):
    if args and isinstance(args[0], DTensor) and args[0].placements == (desired,):
        return None  # already in place (e.g. after PrepareModuleInput): leave the args as they are
    x = rules.require_first_input(args, module, module_path, style)
    size = sharded_dim_size if _shards_last_dim(layout, x.ndim) else None
    x = to_dtensor(x, device_mesh, layout, sharded_dim_size=size)
    return (redistribute_to(x, desired), *args[1:])


def _shards_last_dim(layout: Placement, ndim: int) -> bool:
    return isinstance(layout, Shard) and layout.dim % ndim == ndim - 1


def _sequence_input(module, args, *, device_mesh, layout, module_path):
    x = rules.require_first_input(args, module, module_path, "SequenceParallel")
    return (redistribute_to(to_dtensor(x, device_mesh, layout), layout), *args[1:])


def _output_to(module, inputs, output, *, layout, use_local_output):
    if layout is not None:
        output = redistribute_to(output, layout)
    return finish_output(output, use_local_output)


# ------------------------------------------------------------------- colwise / rowwise


class _LinearStyle(ParallelStyle):
    """The settings Colwise and Rowwise share, normalized by one rule each."""

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True
    overlap: bool = False
    _additive_defaults: ClassVar[dict[str, Any]] = {"overlap": False}
    #: (input_layouts, output_layouts) defaults; the layout overlap=True fuses, and what it fuses
    _defaults: ClassVar[tuple[Placement | None, Placement]]
    _overlapped: ClassVar[tuple[str, str]]

    def __post_init__(self):
        name = type(self).__name__
        self.input_layouts = rules.single_layout(self.input_layouts, "input_layouts", name, self._defaults[0])
        self.output_layouts = rules.single_layout(self.output_layouts, "output_layouts", name, self._defaults[1])
        self.overlap = rules.flag(self.overlap, "overlap", name)
        if self.overlap:
            argument, what = self._overlapped
            rules.overlap_layout(getattr(self, argument), argument, name, what)


class ColwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` column-wise (along its output features).

    Linear: the weight (and bias) become ``Shard(0)``; Embedding: the weight becomes
    ``Shard(1)``. The input, annotated with ``input_layouts``, is redistributed to
    ``Replicate()``; the output, sharded on its last dim, is redistributed to
    ``output_layouts`` and returned as a local tensor when ``use_local_output``.
    Function form: :func:`torch_tp.functional.colwise`.

    Keyword Args:
        input_layouts (Placement, optional): layout of the module's input when it arrives as
            a plain tensor. Default ``Replicate()``; e.g. ``Shard(1)`` under sequence parallelism.
        output_layouts (Placement, optional): layout of the output. Default ``Shard(-1)``.
        use_local_output (bool): return the local shard instead of a DTensor. Default ``True``.
        overlap (bool): torch_tp only. For an ``nn.Linear`` with a sequence-sharded input
            (``input_layouts=Shard(1)``): fuse the input all-gather into the matmul, each
            chunk's transfer overlapping a matmul (:func:`torch_tp.overlap.all_gather_matmul`).
            Siblings one plan entry matches under one parent (``"attention.w[kqv]"``), or
            passed together to :func:`torch_tp.functional.colwise`, share one fused gather.
            Default ``False``.

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

    _defaults = (Replicate(), Shard(-1))
    _overlapped = ("input_layouts", "all-gather")

    def param_placements(self, module):
        return rules.colwise_placements(module)

    def check(self, module, device_mesh, module_path=None):
        rules.check_colwise(module, device_mesh, module_path, overlap=self.overlap)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        distribute_parameters(module, rules.colwise_placements(module), device_mesh, src_data_rank)
        if self.overlap:
            _overlap.install_colwise(module, device_mesh, layout=self.input_layouts, module_path=module_path)
        else:
            module.register_forward_pre_hook(partial(
                _sharded_input, device_mesh=device_mesh, layout=self.input_layouts, desired=Replicate(),
                sharded_dim_size=None, module_path=module_path, style="ColwiseParallel",
            ))
        module.register_forward_hook(
            partial(_output_to, layout=self.output_layouts, use_local_output=self.use_local_output)
        )
        rules.mark_prepared(module, rules.BOTH_STAGES, "ColwiseParallel")
        return module

    def link_siblings(self, modules, where):
        if self.overlap and len(modules) > 1:
            _overlap.share_gather(modules, where)


class RowwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` row-wise (along its input features / vocabulary).

    Linear: the weight becomes ``Shard(1)``, the bias ``Replicate()``, and the input is
    expected sharded on its last dim. Embedding: the weight becomes ``Shard(0)`` and the token
    ids are replicated. The partial-sum output is reduced to ``output_layouts``. A local
    input whose last dim is unevenly sharded (a Colwise layer with 10 outputs on 4 ranks
    hands over 3, 3, 3, 1 columns) is rebuilt with the Linear's true ``in_features``.
    Function form: :func:`torch_tp.functional.rowwise`.

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

    .. note:: For ``nn.Embedding`` the default input layout is ``Replicate()``: token ids
        are never split on their last dim. (Upstream applies ``Shard(-1)`` to every module
        type, which concatenates the ranks' sequences.)
    """

    # input None: chosen by module type when applied (Shard(-1) for Linear, Replicate() for ids)
    _defaults = (None, Replicate())
    _overlapped = ("output_layouts", "reduce-scatter")

    def param_placements(self, module):
        return rules.rowwise_placements(module)

    def check(self, module, device_mesh, module_path=None):
        rules.check_rowwise(module, device_mesh, module_path, overlap=self.overlap)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        is_embedding = isinstance(module, nn.Embedding)
        desired = Replicate() if is_embedding else Shard(-1)
        distribute_parameters(module, rules.rowwise_placements(module), device_mesh, src_data_rank)
        module.register_forward_pre_hook(partial(
            _sharded_input, device_mesh=device_mesh, layout=self.input_layouts or desired, desired=desired,
            sharded_dim_size=None if is_embedding else module.in_features, module_path=module_path,
            style="RowwiseParallel",
        ))
        if self.overlap:
            _overlap.install_rowwise(module, device_mesh, layout=self.output_layouts, module_path=module_path)
        module.register_forward_hook(
            partial(_output_to, layout=self.output_layouts, use_local_output=self.use_local_output)
        )
        rules.mark_prepared(module, rules.BOTH_STAGES, "RowwiseParallel")
        return module


# ------------------------------------------------------------------- sequence parallel


class SequenceParallel(ParallelStyle):
    """Run a norm or dropout on a sequence shard, with replicated parameters.

    Handles ``nn.LayerNorm``, ``nn.RMSNorm``, user-written norms whose parameters are 1-D
    (e.g. a Llama ``RMSNorm`` with a ``weight``) and ``nn.Dropout``. A plain-tensor input is
    taken to be this rank's slice of the sequence; a DTensor input in another layout is
    redistributed to it. Parameter gradients are summed over ranks by DTensor.
    Function form: :func:`torch_tp.functional.sequence_parallel`.

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

    sequence_dim: int = 1
    use_local_output: bool = False

    def __post_init__(self):
        if not isinstance(self.sequence_dim, int):
            raise TypeError(f"SequenceParallel(sequence_dim=...) takes an int, got {self.sequence_dim!r}")

    def param_placements(self, module):
        return rules.replicated_placements(module)

    def check(self, module, device_mesh, module_path=None):
        rules.check_sequence_parallel(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        distribute_parameters(module, rules.replicated_placements(module), device_mesh, src_data_rank)
        module.register_forward_pre_hook(partial(
            _sequence_input, device_mesh=device_mesh, layout=Shard(self.sequence_dim), module_path=module_path
        ))
        module.register_forward_hook(partial(_output_to, layout=None, use_local_output=self.use_local_output))
        rules.mark_prepared(module, rules.BOTH_STAGES, "SequenceParallel")
        return module


# ------------------------------------------------------------------- replicate


def _replicated_inputs(module, args, kwargs, *, device_mesh):
    def convert(value):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return DTensor.from_local(value, device_mesh, (Replicate(),), run_check=False)
        return value

    return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}


def _local_outputs(module, inputs, output):
    if isinstance(output, DTensor):
        return output.to_local()
    if isinstance(output, tuple):
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in output)
    return output


def replicate(
    module: nn.Module, device_mesh: DeviceMesh, *, src_data_rank: int | None = 0, module_path: str | None = None
) -> nn.Module:
    """Replicate ``module``'s own parameters as DTensors and run it on replicated inputs.

    This is what ``parallelize_module(..., replicate_unplanned_params=True)`` does to each
    module the plan leaves out, so every parameter of the model is a DTensor and
    ``clip_grad_norm_`` / optimizers see one kind of tensor. Plain-tensor inputs are taken
    to be identical on every rank (``Replicate()``); DTensor inputs pass through; DTensor
    outputs are handed back as local tensors. Only direct parameters are touched
    (children are left to their own styles). If another style already converts this
    module's inputs/outputs, only the parameters are replicated.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> replicate(model.norm, mesh)
        >>> model.norm.weight.placements
        (Replicate(),)
    """
    rules.require_1d_mesh(device_mesh, "replicate")
    placements = {
        name: Replicate()
        for name, param in module.named_parameters(recurse=False)
        if not isinstance(param, DTensor)
    }
    distribute_parameters(module, placements, device_mesh, src_data_rank)
    if rules.is_prepared(module):
        return module  # its inputs/outputs are already converted by its style
    module.register_forward_pre_hook(partial(_replicated_inputs, device_mesh=device_mesh), with_kwargs=True)
    module.register_forward_hook(_local_outputs)
    rules.mark_prepared(module, rules.BOTH_STAGES, "replicate")
    return module
