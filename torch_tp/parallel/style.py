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

from torch_tp._layouts import finish_output, redistribute_to, replace_forward, to_dtensor
from torch_tp.parallel import _overlap, rules

__all__ = [
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "ReplicateParallel",
    "distribute_parameters",
    "name_plain_tensors_on_error",
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


def _plain_tensors(module: nn.Module) -> list[str]:
    """Names of ``module``'s parameters and buffers (its children's included) that are not DTensors."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return [name for name, t in tensors if t is not None and not isinstance(t, DTensor)]


def _forward_naming_plain_tensors(module, *args, inner, module_path, style, plain, **kwargs):
    try:
        return inner(*args, **kwargs)
    except RuntimeError as err:
        if "mixed torch.Tensor and DTensor" not in str(err):
            raise
        raise RuntimeError(
            f"{style} on {rules.describe(module, module_path)}: its forward mixed DTensors with the "
            f"plain tensors {plain} it holds ({err}). Make them DTensors too (e.g. a buffer "
            f"registered as DTensor.from_local(buffer, mesh, [Replicate()])), or parallelize the "
            f"module that uses them with a style that converts its inputs back to local tensors"
        ) from err


def name_plain_tensors_on_error(module: nn.Module, style: str, module_path: str | None) -> None:
    """If ``module`` keeps plain tensors while running on DTensors, make its forward name them on error.

    DTensor refuses an op mixing DTensors and plain tensors without saying whose they are; a
    module whose style hands it DTensors but that owns a plain buffer (or parameter) then gets
    a forward that re-raises that error with the module path and the tensors' names. Modules
    without plain tensors are left untouched (nothing in their forward changes).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> name_plain_tensors_on_error(norm, "SequenceParallel", "layers.0.norm")
    """
    plain = _plain_tensors(module)
    if plain:
        replace_forward(module, _forward_naming_plain_tensors, inner=module.forward, module_path=module_path,
                        style=style, plain=plain)


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
        self.use_local_output = rules.flag(self.use_local_output, "use_local_output", name)
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
        if not isinstance(self.sequence_dim, int) or isinstance(self.sequence_dim, bool):
            raise TypeError(f"SequenceParallel(sequence_dim=...) takes an int, got {self.sequence_dim!r}")
        self.use_local_output = rules.flag(self.use_local_output, "use_local_output", "SequenceParallel")

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
        name_plain_tensors_on_error(module, "SequenceParallel", module_path)
        rules.mark_prepared(module, rules.BOTH_STAGES, "SequenceParallel")
        return module


# ------------------------------------------------------------------- replicate


def _replicated_input(value, layout, desired, device_mesh):
    if layout is None or not isinstance(value, torch.Tensor):
        return value
    x = to_dtensor(value, device_mesh, layout)
    return redistribute_to(x, desired) if desired is not None else x


def _replicated_inputs(module, args, kwargs, *, style, device_mesh, module_path):
    layouts, desired = style.input_layouts, style.desired_input_layouts
    if isinstance(layouts, Placement):  # one layout for every tensor input, keywords included
        args = tuple(_replicated_input(a, layouts, desired, device_mesh) for a in args)
        kwargs = {k: _replicated_input(v, layouts, desired, device_mesh) for k, v in kwargs.items()}
        return args, kwargs
    if len(args) < len(layouts):
        raise ValueError(
            f"ReplicateParallel on {rules.describe(module, module_path)} has {len(layouts)} input "
            f"layouts {layouts} but the module got {len(args)} positional values"
        )
    wanted = desired or (None,) * len(layouts)
    converted = tuple(_replicated_input(a, lay, des, device_mesh) for a, lay, des in zip(args, layouts, wanted))
    return converted + tuple(args[len(layouts):]), kwargs


def _twin_value(value, kept: tuple[Placement, ...]):
    """What a replicated module hands on: what its single-process twin would, never a bare partial.

    A ``Partial`` output is reduced (its local piece is not a value of the twin); an output
    sharded like a declared input stays local (per-head norms hand on their local heads);
    any other sharded output is handed on as the DTensor it is, not as a strip.
    """
    if not isinstance(value, DTensor):
        return value
    placement = value.placements[0]
    if placement.is_partial():
        return value.redistribute(placements=(Replicate(),)).to_local()
    if placement.is_replicate() or any(_same_layout(placement, k, value.ndim) for k in kept):
        return value.to_local()
    return value


def _same_layout(a: Placement, b: Placement | None, ndim: int) -> bool:
    if isinstance(a, Shard) and isinstance(b, Shard):
        return a.dim % ndim == b.dim % ndim
    return a == b


def _twin_outputs(module, inputs, output, *, kept):
    if isinstance(output, (tuple, list)):
        return type(output)(_twin_value(o, kept) for o in output)
    return _twin_value(output, kept)


class ReplicateParallel(ParallelStyle):
    """Run a module with replicated parameters on (possibly sharded) inputs, gradients reduced.

    The module's parameters become ``Replicate()`` DTensors (broadcast from
    ``src_data_rank``). Its plain-tensor inputs are read as DTensors in ``input_layouts``,
    so DTensor computes each rank's part and sums the parameters' gradients over the ranks:
    the gradient a single process would get. This is the style for a module that runs
    between a Colwise and a Rowwise layer on local features, such as Qwen3's per-head
    ``q_norm``/``k_norm`` (``input_layouts=Shard(2)``: the local heads of a
    ``(batch, seq, heads, head_dim)`` tensor); left out of the plan, each rank's norm weight
    would only see its own heads' gradient and the ranks would drift apart. Hugging Face
    calls this ``replicated_with_grad_allreduce``. Function form:
    :func:`torch_tp.functional.replicate_parallel`.

    Keyword Args:
        input_layouts (Placement or tuple of Placement/None): layout of the plain-tensor
            inputs: one Placement for every tensor input (positional and keyword), or one
            entry per positional input (``None`` leaves it alone). Default ``Replicate()``.
        desired_input_layouts (Placement or tuple, optional): redistribute the inputs to
            these layouts first. Default ``None``: compute on the inputs as they are.
        use_local_output (bool): hand back local tensors: an output sharded like an input
            stays local (the local heads), a partial sum is reduced first, and any other
            sharded output stays a DTensor rather than becoming a bare strip. Default ``True``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> parallelize_module(model, mesh, {"layers.*.self_attn.[qk]_norm":
        ...     ReplicateParallel(input_layouts=Shard(2))})
    """

    input_layouts: Placement | tuple[Placement | None, ...] | None = None
    desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None
    use_local_output: bool = True

    def __post_init__(self):
        name = "ReplicateParallel"
        if self.input_layouts is None or isinstance(self.input_layouts, Placement):
            self.input_layouts = rules.single_layout(self.input_layouts, "input_layouts", name, Replicate())
            self.desired_input_layouts = rules.single_layout(
                self.desired_input_layouts, "desired_input_layouts", name, None
            )
        else:
            self.input_layouts = rules.layout_tuple(self.input_layouts, "input_layouts")
            if self.desired_input_layouts is not None:
                self.input_layouts, self.desired_input_layouts = rules.paired_layouts(
                    self.input_layouts, self.desired_input_layouts, ("input_layouts", "desired_input_layouts")
                )
        self.use_local_output = rules.flag(self.use_local_output, "use_local_output", name)

    def param_placements(self, module):
        return rules.replicated_placements(module)

    def check(self, module, device_mesh, module_path=None):
        rules.check_replicate_parallel(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        distribute_parameters(module, rules.replicated_placements(module), device_mesh, src_data_rank)
        _install_replicated_hooks(module, self, device_mesh, module_path)
        name_plain_tensors_on_error(module, "ReplicateParallel", module_path)
        rules.mark_prepared(module, rules.BOTH_STAGES, "ReplicateParallel")
        return module

    def kept_layouts(self) -> tuple[Placement, ...]:
        """The layouts an output may keep when handed back locally: the inputs' layouts."""
        layouts = self.desired_input_layouts or self.input_layouts
        return (layouts,) if isinstance(layouts, Placement) else tuple(p for p in layouts if p is not None)


def _install_replicated_hooks(module, style: ReplicateParallel, device_mesh, module_path) -> None:
    module.register_forward_pre_hook(
        partial(_replicated_inputs, style=style, device_mesh=device_mesh, module_path=module_path), with_kwargs=True
    )
    if style.use_local_output:
        module.register_forward_hook(partial(_twin_outputs, kept=style.kept_layouts()))


def replicate(
    module: nn.Module, device_mesh: DeviceMesh, *, src_data_rank: int | None = 0, module_path: str | None = None
) -> nn.Module:
    """Replicate ``module``'s own parameters as DTensors and run it on replicated inputs.

    This is what ``parallelize_module(..., replicate_unplanned_params=True)`` does to each
    module the plan leaves out, so every parameter of the model is a DTensor and
    ``clip_grad_norm_`` / optimizers see one kind of tensor. It is
    :class:`ReplicateParallel` with ``input_layouts=Replicate()`` restricted to the module's
    own parameters (children are left to their own styles): plain-tensor inputs are taken
    to be identical on every rank, DTensor inputs pass through, and outputs are what the
    module's single-process twin returns (a partial sum is reduced; a sharded DTensor output
    stays a DTensor, never a bare strip). If another style already converts this module's
    inputs/outputs, only the parameters are replicated.

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
    _install_replicated_hooks(module, ReplicateParallel(), device_mesh, module_path)
    rules.mark_prepared(module, rules.BOTH_STAGES, "replicate")
    return module
