"""ParallelStyles: small immutable descriptions of how to parallelize one module, and the code
that applies them.

A style is a keyword-only dataclass: its constructor normalizes the arguments with the
normalizers of :mod:`torch_tp.parallel.rules` (so a bad layout fails where it is written),
:meth:`ParallelStyle.check` runs the style's rule, and :meth:`ParallelStyle.apply_to`
distributes the parameters the rule places and installs the forward hooks. Colwise and
Rowwise read the forward they install (or the refusal they raise) off one table,
:mod:`torch_tp.parallel._forward_kinds`: ``apply_to`` is "distribute, install, record". The function
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

from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from torch_tp._layouts import agreed_dtensor, inner_tensors, packed_dtensor, redistribute_to, replace_forward
from torch_tp.parallel import _overlap, rules
from torch_tp.parallel._forward_kinds import kinds_of, output_to
from torch_tp.parallel._shared_input import share_input
from torch_tp.parallel._style_base import ParallelStyle

# upstream defines these in its style.py, and upstream code imports them from ``.style``
from torch_tp.parallel.prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput

__all__ = [
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "distribute_parameters",
    "name_plain_tensors_on_error",
]


def distribute_parameters(
    module: nn.Module, placements: dict[str, Placement], device_mesh: DeviceMesh, src_data_rank: int | None
) -> None:
    """Turn the parameters named in ``placements`` (paths relative to ``module``) into DTensors.

    Values come from ``src_data_rank`` (scattered or broadcast, so the sharded module equals
    the single-device one) or, with ``None``, from each rank's own tensor. A packed placement
    (:func:`torch_tp.parallel.rules.packed_shard`) gives each rank its slice of every part.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> distribute_parameters(norm, {"weight": Replicate()}, mesh, src_data_rank=0)
    """
    for path, placement in placements.items():
        owner_path, _, name = path.rpartition(".")
        owner = module.get_submodule(owner_path)
        param = getattr(owner, name)
        if rules.parts_of(placement) > 1:
            dparam = _distribute_packed(param, device_mesh, placement, src_data_rank)
        else:
            dparam = _without_padding(distribute_tensor(param, device_mesh, [placement], src_data_rank=src_data_rank))
        owner.register_parameter(name, nn.Parameter(dparam, requires_grad=param.requires_grad))


def _without_padding(dparam: DTensor) -> DTensor:
    """``dparam`` with a local shard that holds only itself. torch's ``distribute_tensor`` scatters an
    uneven ``Shard`` into buffers padded to the largest shard and keeps a ``narrow`` view of its
    own: a short shard would keep the padding allocated (memory ``predict_placements`` does not
    count, for the life of the model). A copy of the view is exactly the shard."""
    local = dparam.to_local().detach()
    if not any(_is_a_smaller_view(inner) for inner in inner_tensors(local)):
        return dparam
    return DTensor.from_local(local.clone(), dparam.device_mesh, dparam.placements, run_check=False,
                              shape=dparam.shape, stride=dparam.stride())


def _is_a_smaller_view(tensor: torch.Tensor) -> bool:
    if tensor.device.type == "meta" or type(tensor) is not torch.Tensor:  # a storage of its own to read
        return False
    return tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()


def _distribute_packed(tensor: torch.Tensor, device_mesh: DeviceMesh, placement: Placement, src_data_rank):
    """Each rank's slice of every part of a packed ``tensor``, as one DTensor with ``placement``.

    Each of the ``parts`` matrices stacked along ``dim`` is scattered with an ordinary
    ``Shard(dim)`` (uneven slices included); this rank's slices, stacked again, are
    ``[part_0 slice r; part_1 slice r; ...]``. (torch 2.13's ``distribute_tensor`` with the
    packed placement asserts on uneven slices; chunks and cats also keep an int8 weight's
    per-row scales, which a reshape into parts would mix.)
    """
    dim, parts = placement.dim, rules.parts_of(placement)
    slices = [
        distribute_tensor(part, device_mesh, [Shard(dim)], src_data_rank=src_data_rank).to_local()
        for part in tensor.detach().chunk(parts, dim)
    ]
    return packed_dtensor(torch.cat(slices, dim), device_mesh, placement, tensor.shape)


def _plain_tensors(module: nn.Module) -> list[str]:
    """Names of ``module``'s parameters and buffers (its children's included) that are not DTensors."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return [name for name, t in tensors if t is not None and not isinstance(t, DTensor)]


#: the second fix the error offers, by default: the module sees local tensors instead
_CONVERT_INPUTS = "parallelize the module that uses them with a style that converts its inputs back to local tensors"


def _forward_naming_plain_tensors(module, *args, inner, module_path, style, plain, alternative, **kwargs):
    try:
        return inner(*args, **kwargs)
    except RuntimeError as err:
        if "mixed torch.Tensor and DTensor" not in str(err):
            raise
        owner = "module" if module_path is None else f"model.{module_path}" if module_path else "model"
        example = f"{owner}.{plain[0]}"
        fix = (
            f"Make them DTensors too: after parallelizing, e.g. {example} = DTensor.from_local("
            f"{example}, mesh, [Replicate()]) (each rank's copy must hold the same values; DTensor "
            f"then slices or combines it with the sharded activations as each op needs)"
        )
        raise RuntimeError(
            f"{style} on {rules.describe(module, module_path)}: its forward mixed DTensors with the "
            f"plain tensors {plain} it holds ({err}). {fix}{f', or {alternative}' if alternative else ''}"
        ) from err


def name_plain_tensors_on_error(
    module: nn.Module, style: str, module_path: str | None, *, alternative: str | None = _CONVERT_INPUTS
) -> None:
    """If ``module`` keeps plain tensors while running on DTensors, make its forward name them on error.

    DTensor refuses an op mixing DTensors and plain tensors without saying whose they are; a
    module whose style hands it DTensors but that owns a plain buffer (or parameter) then gets
    a forward that re-raises that error with the style, the module path and the tensors'
    names, and how to make them DTensors (``alternative``, when given, is a second fix the
    message offers). Modules without plain tensors are left untouched (nothing in their
    forward changes). Every style whose module computes on DTensors calls it: Colwise and
    Rowwise (an ``nn.Linear`` subclass that scales its output by a buffer), SequenceParallel,
    ReplicateParallel and SpatialParallel.

    Keyword Args:
        alternative (str, optional): the fix offered besides making the tensors DTensors;
            ``None`` offers none. Default: parallelize the module with a style that converts
            its inputs back to local tensors.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> name_plain_tensors_on_error(norm, "SequenceParallel", "layers.0.norm")
    """
    plain = _plain_tensors(module)
    if plain:
        replace_forward(module, _forward_naming_plain_tensors, inner=module.forward, module_path=module_path,
                        style=style, plain=plain, alternative=alternative)


# ------------------------------------------------------------------- forward hooks


def _sequence_input(module, args, *, device_mesh, layout, module_path):
    x = rules.require_first_input(args, module, module_path, "SequenceParallel")
    what = f"SequenceParallel on {rules.describe(module, module_path)}"
    return (redistribute_to(agreed_dtensor(x, device_mesh, layout, what=what), layout), *args[1:])


# ------------------------------------------------------------------- colwise / rowwise


class _LinearStyle(ParallelStyle):
    """The settings Colwise and Rowwise share, normalized by one rule each."""

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True
    overlap: bool = False
    packed: int = 1
    comm_dtype: torch.dtype | None = None
    _additive_defaults: ClassVar[dict[str, Any]] = {"overlap": False, "packed": 1, "comm_dtype": None}
    #: (input_layouts, output_layouts) defaults; the layout overlap=True fuses, and what it fuses
    _defaults: ClassVar[tuple[Placement | None, Placement]]
    _overlapped: ClassVar[tuple[str, str]]
    #: the style column of :data:`torch_tp.parallel._forward_kinds.TABLE`
    table_key: ClassVar[str]

    def __post_init__(self):
        name = type(self).__name__
        self.input_layouts = rules.single_layout(self.input_layouts, "input_layouts", name, self._defaults[0])
        self.output_layouts = rules.single_layout(self.output_layouts, "output_layouts", name, self._defaults[1])
        self.use_local_output = rules.flag(self.use_local_output, "use_local_output", name)
        self.overlap = rules.flag(self.overlap, "overlap", name)
        if self.overlap:
            argument, what = self._overlapped
            rules.overlap_layout(getattr(self, argument), argument, name, what)
        self.packed = rules.packed_parts(self.packed, name)
        argument = self._overlapped[0]
        self.comm_dtype = rules.comm_dtype(self.comm_dtype, getattr(self, argument), argument, name)
        self._kinds = kinds_of(self)  # this style's rows of the forward-kind table (raises a refusal for all modules)

    def check(self, module, device_mesh, module_path=None):
        self._check_module(module, device_mesh, module_path)
        self._kinds.forward_for(module, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        forward = self._kinds.forward_for(module, module_path)  # read before distributing: the weight kind
        distribute_parameters(module, self.param_placements(module), device_mesh, src_data_rank)
        forward.install(self, module, device_mesh, module_path)
        # a subclass's own forward (output * buffer) runs on DTensors: name its plain buffers on error
        name_plain_tensors_on_error(module, type(self).__name__, module_path, alternative=None)
        rules.mark_prepared(module, rules.BOTH_STAGES, type(self).__name__)
        return module


class ColwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` column-wise (along its output features).

    Linear: the weight (and bias) become ``Shard(0)``; Embedding: the weight becomes
    ``Shard(1)``; transformers' ``Conv1D`` (GPT-2's linear, weight stored ``(in, out)``;
    torch_tp only): the weight becomes ``Shard(1)``, the bias ``Shard(0)``. The input, annotated with ``input_layouts``, is redistributed to
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
        packed (int): torch_tp only. The weight stacks this many equal matrices along its
            output features (Phi-3's ``gate_up_proj`` is ``[gate; up]``: ``packed=2``; a fused
            ``[q; k; v]`` with as many key/value heads as query heads: ``packed=3``). Each
            rank holds its slice of every part, so the local output is
            ``[gate local, up local]`` and a forward that splits it with ``chunk(k, dim=-1)``
            works unchanged. Linear only; not with ``overlap``. Default ``1``.
        comm_dtype (torch.dtype, optional): torch_tp only. ``torch.int8``, with a
            sequence-sharded input (``input_layouts=Shard(1)``): the input all-gather moves
            each token as int8 with one float32 scale (and the input gradient's
            reduce-scatter too; :mod:`torch_tp.overlap._int8_comm`), about a quarter of the
            float32 bytes, within half a quantization step per element. ``nn.Linear`` only;
            with ``overlap=True`` the fused ring moves the int8 tokens (float or int8
            weight-only weights).
            Default ``None`` (the activation's dtype).

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> parallelize_module(model, mesh, {"layers.*.feed_forward.w[13]": ColwiseParallel()})
        >>> parallelize_module(model, mesh, {"layers.*.feed_forward.w[13]":
        ...     ColwiseParallel(input_layouts=Shard(1), overlap=True)})
        >>> parallelize_module(model, mesh, {"layers.*.mlp.gate_up_proj": ColwiseParallel(packed=2)})

    .. note:: The output is sharded on its last dim, so code between this layer and its
        paired :class:`RowwiseParallel` sees local feature counts (e.g. local heads). With
        ``packed=k`` that shard is the packed one (each part's slice, in part order), and
        ``output_layouts=Shard(-1)`` (the default) means it; any other layout is gathered
        or moved from it exactly.
    """

    _defaults = (Replicate(), Shard(-1))
    _overlapped = ("input_layouts", "all-gather")
    table_key = "colwise"

    def param_placements(self, module):
        return rules.colwise_placements(module, self.packed)

    def _check_module(self, module, device_mesh, module_path):
        rules.check_colwise(module, device_mesh, module_path, packed=self.packed)

    def link_siblings(self, modules, where):
        if self.overlap and len(modules) > 1:
            _overlap.share_gather(modules, where)
        elif len(modules) > 1:  # one input conversion (or int8 gather), one reduction back
            share_input(modules)


class RowwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` row-wise (along its input features / vocabulary).

    Linear: the weight becomes ``Shard(1)``, the bias ``Replicate()``, and the input is
    expected sharded on its last dim (transformers' ``Conv1D``, torch_tp only: the weight
    ``Shard(0)``). Embedding: the weight becomes ``Shard(0)`` and the token
    ids are replicated; each rank looks up the ids in its rows (a local lookup, Megatron's
    vocab-parallel embedding), so the weight's gradient stays ``Shard(0)`` (a subclass with its
    own ``forward`` runs it on DTensor's embedding rule instead). The partial-sum output is
    reduced to ``output_layouts``. A local
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
        packed (int): torch_tp only. The weight stacks this many equal matrices along its
            input features, and its input is the matching packed activation: each rank's
            local input is ``[part_0 local, ..., part_k local]`` on the last dim, as a
            ``ColwiseParallel(packed=k)`` layer hands it on. The bias stays replicated.
            Linear only; not with ``overlap``. Default ``1``.
        comm_dtype (torch.dtype, optional): torch_tp only. ``torch.int8``, with a
            sequence-sharded output (``output_layouts=Shard(1)``): the reduce-scatter moves
            each rank's partial sums as int8 with one float32 scale per token (an all-to-all,
            summed in float32 on arrival), and the output gradient's all-gather moves int8
            too (:mod:`torch_tp.overlap._int8_comm`). Linear and Embedding; with
            ``overlap=True`` the fused op sends each partial sum as int8 while the next is
            multiplied (float or int8 weight-only weights). Default ``None`` (the activation's dtype).

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
    table_key = "rowwise"

    def param_placements(self, module):
        return rules.rowwise_placements(module, self.packed)

    def _check_module(self, module, device_mesh, module_path):
        rules.check_rowwise(module, device_mesh, module_path, packed=self.packed)


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
        module.register_forward_hook(partial(output_to, layout=None, use_local_output=self.use_local_output))
        name_plain_tensors_on_error(module, "SequenceParallel", module_path)
        rules.mark_prepared(module, rules.BOTH_STAGES, "SequenceParallel")
        return module
