"""The rules upstream's tensor-parallel styles must obey too, and the helpers every style's rules
are made of: what a style accepts and where it puts parameters.

What lives here, and what does not:

* the rules of the styles that exist upstream (``ColwiseParallel``, ``RowwiseParallel``,
  ``SequenceParallel``, ``PrepareModuleInput`` / ``Output``): ``parallelize_module`` applies
  them to torch_tp's styles and to upstream's own style objects alike
  (:mod:`torch_tp.parallel._upstream` reads them from here), so they cannot live beside one
  class;
* the helpers every style builds its rules from (below);
* not the rules of torch_tp's own styles, which upstream lacks: each lives beside its style,
  built from these helpers (``ReplicateParallel``: :mod:`torch_tp.parallel.replicate`;
  ``ExpertParallel`` / ``ExpertTensorParallel``: :mod:`torch_tp.parallel.experts`;
  ``SpatialParallel``: :mod:`torch_tp.conv.spatial`).

Three kinds of rule live here, each once:

* **normalizers** (:func:`flag`, :func:`single_layout`, :func:`layout_tuple`,
  :func:`paired_layouts`, :func:`kwarg_layouts`, :func:`overlap_layout`, :func:`packed_parts`)
  turn a style's keyword arguments into the values it stores, or raise. Style constructors
  call them, and so do the function forms, because those build the style;
* **checks** (``check_*`` and the ``require_*`` helpers they are made of) raise, with the
  module path and the fix, when a style cannot be applied to a module, and change nothing.
  ``parallelize_module`` runs them for every entry before it changes anything;
* **placements** (``*_placements``) say where each parameter goes. Applying a style
  distributes exactly these; :func:`torch_tp.explain_plan` only reads them, so the report
  and the real application cannot disagree. A packed (fused) weight, ``k`` matrices stacked
  along the sharded dim, is placed by :func:`packed_shard`: each rank holds its slice of
  every part.

Example::

    >>> import torch.nn as nn
    >>> colwise_placements(nn.Linear(4, 8))
    {'weight': Shard(dim=0), 'bias': Shard(dim=0)}
    >>> check_colwise(nn.Linear(4, 8), 4, "proj")     # a plain int stands for a 1-D mesh
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from torch_tp._module_state import ensure_state, state_of

__all__ = [
    "UnsupportedModuleError",
    "BOTH_STAGES",
    "describe",
    "flag",
    "single_layout",
    "layout_tuple",
    "paired_layouts",
    "kwarg_layouts",
    "overlap_layout",
    "comm_dtype",
    "packed_parts",
    "require_1d_mesh",
    "require_tensor_input",
    "require_unprepared",
    "mark_prepared",
    "check_colwise",
    "check_rowwise",
    "check_sequence_parallel",
    "check_prepare_input",
    "check_prepare_output",
    "colwise_placements",
    "rowwise_placements",
    "replicated_placements",
    "packed_shard",
    "transposed_linear_types",
    "is_linear_layer",
    "in_features",
]


class UnsupportedModuleError(TypeError, NotImplementedError):
    """A style was given a module type it cannot handle.

    It is a ``TypeError`` (the argument has the wrong type) and, for code written against
    upstream, which raises ``NotImplementedError`` here, also a ``NotImplementedError``.

    Example::

        >>> issubclass(UnsupportedModuleError, NotImplementedError)
        True
    """


#: The forward stages a style that converts both inputs and outputs claims.
BOTH_STAGES = ("input", "output")

#: What a style that converts its module's first positional input says about it.
TENSOR_INPUT_FIX = "this style converts the module's first positional input, which must be a tensor"

_SHARDABLE = (nn.Linear, nn.Embedding)


def transposed_linear_types() -> tuple[type, ...]:
    """The linear layers that keep their weight transposed, ``(in_features, out_features)``:
    transformers' ``Conv1D`` (GPT-2, GPT, ...), when transformers is imported (no instance can
    exist otherwise). Colwise and Rowwise shard them like an ``nn.Linear``, on the other dims.

    Example::

        >>> all(t.__name__ == "Conv1D" for t in transposed_linear_types())
        True
    """
    utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(utils, "Conv1D", None)
    return (conv1d,) if isinstance(conv1d, type) else ()


def is_linear_layer(module: nn.Module) -> bool:
    """Whether Colwise and Rowwise shard ``module`` as a linear layer: an ``nn.Linear`` or a
    transposed one (:func:`transposed_linear_types`).

    Example::

        >>> is_linear_layer(nn.Linear(2, 3)), is_linear_layer(nn.Conv1d(2, 3, 1))
        (True, False)
    """
    return isinstance(module, (nn.Linear, *transposed_linear_types()))


def in_features(module: nn.Module) -> int:
    """A linear layer's input features, whichever way its weight is stored.

    Example::

        >>> in_features(nn.Linear(4, 8))
        4
    """
    transposed = isinstance(module, transposed_linear_types())
    return module.weight.shape[0] if transposed else module.weight.shape[1]


# ------------------------------------------------------------------------ generic helpers


def describe(module: nn.Module, module_path: str | None) -> str:
    """How error messages name a module: its path and type, or its type alone.

    Example::

        >>> describe(nn.Linear(2, 2), "layers.0.wq"), describe(nn.Linear(2, 2), None)
        ("'layers.0.wq' (Linear)", 'a Linear module')
    """
    kind = type(module).__name__
    if module_path is None:
        return f"a {kind} module"
    return f"{module_path or '<root>'!r} ({kind})"


def mesh_size(device_mesh: DeviceMesh | int) -> int:
    """Ranks along the (1-D) mesh; a plain int stands for a 1-D mesh of that size."""
    return device_mesh if isinstance(device_mesh, int) else device_mesh.size()


def require_1d_mesh(device_mesh: DeviceMesh | int, style: str) -> None:
    """Tensor-parallel styles shard over one mesh axis; reject an N-D mesh with the fix.

    A positive int is accepted as "a 1-D mesh of that many ranks" (plan checking and
    :func:`torch_tp.explain_plan` work without a process group).

    Example::

        >>> require_1d_mesh(4, "ColwiseParallel")
        >>> require_1d_mesh(0, "ColwiseParallel")
        Traceback (most recent call last):
        ValueError: ColwiseParallel: a mesh size must be at least 1, got 0
    """
    if isinstance(device_mesh, int) and not isinstance(device_mesh, bool):
        if device_mesh < 1:
            raise ValueError(f"{style}: a mesh size must be at least 1, got {device_mesh}")
        return
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"{style} needs a DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.ndim != 1:
        names = device_mesh.mesh_dim_names
        hint = f'device_mesh["{names[-1]}"]' if names else "a 1-D sub-mesh (name the mesh dims)"
        raise ValueError(
            f"{style} shards over one mesh axis, but the mesh has {device_mesh.ndim} dims "
            f"(shape {tuple(device_mesh.shape)}, names {names}); choose the tensor-parallel "
            f"axis, e.g. pass {hint}"
        )


def require_tensor_input(
    value: object,
    position: str,
    module: nn.Module,
    module_path: str | None,
    style: str,
    fix: str = "use None as the layout for non-tensor inputs",
) -> torch.Tensor:
    """Return ``value`` if it is a tensor; a layout was given for it, so anything else raises.

    Example::

        >>> require_tensor_input(torch.ones(1), "0", nn.Identity(), "x", "SequenceParallel")
        tensor([1.])
    """
    if isinstance(value, torch.Tensor):
        return value
    raise TypeError(
        f"{style} on {describe(module, module_path)} was given a layout for input "
        f"{position}, but the module received {type(value).__name__} there; {fix}"
    )


def require_first_input(args: tuple, module: nn.Module, module_path: str | None, style: str) -> torch.Tensor:
    """The module's first positional input, which a style converting it needs to be a tensor."""
    if not args:
        raise TypeError(f"{style} on {describe(module, module_path)} got no input")
    return require_tensor_input(args[0], "0", module, module_path, style, TENSOR_INPUT_FIX)


def require_unprepared(
    module: nn.Module, stages: tuple[str, ...], style: str, module_path: str | None
) -> None:
    """Raise if torch_tp already converts ``module``'s inputs or outputs (``stages``).

    Example::

        >>> layer = nn.Linear(2, 2)
        >>> mark_prepared(layer, ("input",), "PrepareModuleInput")
        >>> require_unprepared(layer, ("output",), "PrepareModuleOutput", "layer")
        >>> require_unprepared(layer, BOTH_STAGES, "ColwiseParallel", "layer")
        Traceback (most recent call last):
        ValueError: ColwiseParallel would convert the inputs of 'layer' (Linear), which PrepareModuleInput already converts; ...
    """
    state = state_of(module)
    applied = state.applied if state is not None else {}
    for stage in stages:
        if stage in applied:
            raise ValueError(
                f"{style} would convert the {stage}s of {describe(module, module_path)}, "
                f"which {applied[stage]} already converts; a module's {stage}s can be "
                f"prepared once (use PrepareModuleInputOutput to prepare both sides)"
            )


def mark_prepared(module: nn.Module, stages: tuple[str, ...], style: str) -> None:
    """Record that ``style`` now converts ``module``'s ``stages`` (``"input"``, ``"output"``).

    Example::

        >>> layer = nn.Linear(2, 2)
        >>> mark_prepared(layer, BOTH_STAGES, "ColwiseParallel")
        >>> is_prepared(layer)
        True
    """
    # the stages a module's ModuleState.applied records: a second style cannot stack conversions
    ensure_state(module).applied.update((stage, style) for stage in stages)


def is_prepared(module: nn.Module) -> bool:
    """Whether a torch_tp style already converts some forward stage of ``module``."""
    state = state_of(module)
    return state is not None and bool(state.applied)


def _require_module_type(module: nn.Module, allowed: tuple[type, ...], style: str, module_path) -> None:
    if isinstance(module, allowed):
        return
    names = " or ".join(f"nn.{t.__name__}" if t.__module__.startswith("torch.nn") else t.__name__ for t in allowed)
    raise UnsupportedModuleError(
        f"{style} cannot shard {describe(module, module_path)}: it handles {names}. "
        f"Apply it to the Linear/Embedding submodules instead, or use PrepareModuleInput/"
        f"PrepareModuleOutput on a container module"
    )


def require_plain_parameters(module: nn.Module, style: str, module_path: str | None) -> None:
    """Raise if a parameter of ``module`` is already a DTensor: a module is parallelized once."""
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(
                f"{style}: {describe(module, module_path)}.{name} is already a DTensor "
                f"with placements {param.placements}; a module can be parallelized once"
            )


def _require_shardable(module: nn.Module, dim: int, num_ranks: int, style: str, module_path, parts: int = 1) -> None:
    # Uneven shards are fine (10 rows on 4 ranks become 3, 3, 3, 1); a dim smaller than the
    # mesh would leave ranks with nothing, which is always a plan mistake. A packed weight
    # is sharded part by part, so each part must be that large.
    size = module.weight.shape[dim] // parts
    if size < num_ranks:
        what = f"size {size} is" if parts == 1 else f"each of its {parts} packed parts has size {size},"
        raise ValueError(
            f"{style} cannot shard {describe(module, module_path)}.weight "
            f"(shape {tuple(module.weight.shape)}) on dim {dim}: {what} smaller than the "
            f"{num_ranks} ranks of the mesh, so some ranks would hold nothing. Leave this "
            f"module out of the plan or use a smaller tensor-parallel mesh"
        )


def _require_equal_parts(module: nn.Module, dim: int, parts: int, style: str, module_path) -> None:
    size = module.weight.shape[dim]
    if size % parts:
        raise ValueError(
            f"{style}(packed={parts}) cannot split {describe(module, module_path)}.weight "
            f"(shape {tuple(module.weight.shape)}) into {parts} equal parts on dim {dim}: "
            f"{size} is not a multiple of {parts}. Set packed= to the number of equal matrices "
            f"the weight stacks (2 for [gate; up], 3 for [q; k; v] with as many key/value heads "
            f"as query heads), or leave it at 1 for an ordinary weight"
        )


def _require_only_weight_and_bias(module: nn.Module, style: str, module_path) -> None:
    allowed = ("weight", "bias")
    extra = [n for n, _ in module.named_parameters(recurse=False) if n not in allowed]
    extra += [f"{n}.*" for n, child in module.named_children() if any(child.parameters())]
    if extra:
        raise TypeError(
            f"{style} shards only {allowed} of {describe(module, module_path)}, which also "
            f"has parameters {extra}; shard those explicitly or wrap them in a separate module"
        )


# ---------------------------------------------------------------------------- normalizers


def flag(value: object, argument: str, style: str) -> bool:
    """``value`` if it is a bool, else ``TypeError`` naming the argument.

    Example::

        >>> flag(True, "overlap", "ColwiseParallel")
        True
    """
    if not isinstance(value, bool):
        raise TypeError(f"{style}({argument}=...) takes True or False, got {value!r}")
    return value


def single_layout(layout: object, argument: str, style: str, default: Placement | None) -> Placement | None:
    """One ``Placement`` (or ``default`` for ``None``); anything else raises ``TypeError``.

    Example::

        >>> single_layout(None, "output_layouts", "ColwiseParallel", Shard(-1))
        Shard(dim=-1)
    """
    if layout is None:
        return default
    if not isinstance(layout, Placement):
        raise TypeError(f"{style}({argument}=...) takes one Placement such as Shard(1); got {layout!r}")
    return layout


def layout_tuple(layouts: object, argument: str) -> tuple[Placement | None, ...] | None:
    """``layouts`` as a tuple with one entry per input or output, or ``None``.

    A single :class:`Placement` means "one tensor"; otherwise a sequence of placements and
    ``None`` placeholders (values to leave alone).

    Example::

        >>> layout_tuple(Shard(1), "input_layouts"), layout_tuple([Shard(1), None], "input_layouts")
        ((Shard(dim=1),), (Shard(dim=1), None))
    """
    if layouts is None:
        return None
    if isinstance(layouts, Placement):
        return (layouts,)
    if isinstance(layouts, Sequence) and not isinstance(layouts, str):
        layouts = tuple(layouts)
        for layout in layouts:
            if layout is not None and not isinstance(layout, Placement):
                raise TypeError(
                    f"{argument} entries must be Placements (Shard(d), Replicate(), ...) "
                    f"or None placeholders; got {layout!r} in {layouts!r}"
                )
        return layouts
    raise TypeError(f"{argument} must be a Placement or a tuple of Placements/None; got {layouts!r}")


def paired_layouts(layouts: object, desired: object, names: tuple[str, str]) -> tuple[tuple | None, tuple | None]:
    """Two :func:`layout_tuple` s that describe the same tensors: both or neither, equal lengths.

    Example::

        >>> paired_layouts(Shard(1), Replicate(), ("input_layouts", "desired_input_layouts"))
        ((Shard(dim=1),), (Replicate(),))
    """
    layouts, desired = layout_tuple(layouts, names[0]), layout_tuple(desired, names[1])
    if layouts is None and desired is None:
        return None, None
    if layouts is None or desired is None:
        given, missing = names if desired is None else names[::-1]
        raise ValueError(f"{given} is set but {missing} is not; pass both, one entry per tensor")
    if len(layouts) != len(desired):
        raise ValueError(
            f"{names[0]} has {len(layouts)} entries but {names[1]} has {len(desired)}: "
            f"they describe the same tensors and need the same length "
            f"(use None for an entry to leave alone)"
        )
    return layouts, desired


def kwarg_layouts(layouts: Mapping | None, desired: Mapping | None) -> tuple[dict, dict]:
    """Keyword-input layouts as two dicts ``{name: Placement}``; every desired name is annotated.

    Example::

        >>> kwarg_layouts({"mask": Shard(0)}, {"mask": Replicate()})
        ({'mask': Shard(dim=0)}, {'mask': Replicate()})
    """
    for name, mapping in (("input_kwarg_layouts", layouts), ("desired_input_kwarg_layouts", desired)):
        for key, layout in (mapping or {}).items():
            if not isinstance(key, str) or not isinstance(layout, Placement):
                raise TypeError(f"{name} maps keyword names to Placements; got {key!r}: {layout!r}")
    extra = set(desired or {}) - set(layouts or {})
    if extra:
        raise ValueError(
            f"desired_input_kwarg_layouts names {sorted(extra)} that input_kwarg_layouts does "
            f"not annotate; add their current layouts to input_kwarg_layouts"
        )
    return dict(layouts or {}), dict(desired or {})


#: The ``comm_dtype`` values the styles take besides ``None`` (the activation's own dtype).
COMM_DTYPES = (torch.int8,)


def comm_dtype(value: object, layout: Placement | None, argument: str, style: str) -> torch.dtype | None:
    """``comm_dtype`` of a style: ``None`` (the activation's dtype) or ``torch.int8``, and only
    on a style whose ``argument`` layout makes a sequence-parallel collective (``Shard(d)`` of
    a leading dim), with or without ``overlap``.

    Example::

        >>> comm_dtype(torch.int8, Shard(1), "input_layouts", "ColwiseParallel")
        torch.int8
        >>> comm_dtype(torch.float16, Shard(1), "input_layouts", "ColwiseParallel")
        Traceback (most recent call last):
        TypeError: ColwiseParallel(comm_dtype=torch.float16): comm_dtype takes torch.int8 or None ...
    """
    if value is None:
        return None
    if not any(value is dtype for dtype in COMM_DTYPES):
        raise TypeError(
            f"{style}(comm_dtype={value!r}): comm_dtype takes torch.int8 or None (the activation's own "
            f"dtype); the sequence-parallel collectives move int8 values with one float32 scale per token"
        )
    if not isinstance(layout, Shard) or layout.dim == -1:
        raise ValueError(
            f"{style}(comm_dtype=torch.int8, {argument}={layout}): comm_dtype quantizes a sequence-parallel "
            f"collective, and {argument}={layout} makes none; set {argument}=Shard(1) (the sequence) or "
            f"leave comm_dtype=None"
        )
    return value


def overlap_layout(layout: Placement | None, argument: str, style: str, what: str) -> None:
    """``overlap=True`` needs a sequence-sharded activation: ``Shard(d)`` on a leading dim.

    Example::

        >>> overlap_layout(Shard(1), "input_layouts", "ColwiseParallel", "all-gather")
        >>> overlap_layout(Replicate(), "input_layouts", "ColwiseParallel", "all-gather")
        Traceback (most recent call last):
        ValueError: ColwiseParallel(overlap=True) fuses the all-gather of a sequence-sharded activation ...
    """
    if type(layout) is Shard and layout.dim != -1:
        return
    raise ValueError(
        f"{style}(overlap=True) fuses the {what} of a sequence-sharded activation into the "
        f"matmul, so it needs {argument}=Shard(d) on a leading dim (e.g. Shard(1), the "
        f"sequence); got {argument}={layout!r}. Use overlap=False for other layouts"
    )


def packed_parts(value: object, style: str) -> int:
    """``packed=k``: how many equal matrices a fused weight stacks along its sharded dim.

    An int ``>= 1``; ``1`` is an ordinary weight. (Which settings a packed weight combines
    with is the forward-kind table's: :mod:`torch_tp.parallel._forward_kinds`.)

    Example::

        >>> packed_parts(2, "ColwiseParallel")
        2
        >>> packed_parts(0, "ColwiseParallel")
        Traceback (most recent call last):
        ValueError: ColwiseParallel(packed=...) must be at least 1 (1: an ordinary weight); got 0
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(
            f"{style}(packed=...) takes an int, the number of matrices a fused weight stacks "
            f"(2 for gate_up_proj, 3 for qkv); got {value!r}"
        )
    if value < 1:
        raise ValueError(f"{style}(packed=...) must be at least 1 (1: an ordinary weight); got {value}")
    return value


def overlap_leading_dim(layout: Shard, x: DTensor, style: str, module: nn.Module, module_path) -> int:
    """The activation dim an overlapped layer exchanges; it must be a leading dim split evenly."""
    dim = layout.dim % x.ndim
    if dim == x.ndim - 1:
        raise ValueError(
            f"{style}(overlap=True) on {describe(module, module_path)}: dim {layout.dim} of "
            f"the {x.ndim}-D activation is its feature dim; shard a leading dim (the sequence)"
        )
    world = x.device_mesh.size()
    if x.shape[dim] % world:
        raise ValueError(
            f"{style}(overlap=True) on {describe(module, module_path)}: dim {dim} of the "
            f"activation has size {x.shape[dim]}, which does not split evenly over {world} ranks; "
            f"the fused ops exchange equal chunks. Pad it to a multiple of {world}, or use overlap=False"
        )
    return dim


# ---------------------------------------------------------------------------- checks


def check_colwise(module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None = None, *,
                  packed: int = 1) -> None:
    """Raise if ``ColwiseParallel`` cannot shard ``module`` on ``device_mesh`` (changes nothing).

    It splits an ``nn.Linear``'s output features (weight dim 0) or an ``nn.Embedding``'s
    embedding dim (weight dim 1); each rank must get at least one of them, of every part of
    a ``packed`` weight. (What ``overlap``, ``comm_dtype`` and ``packed`` take besides is the
    forward-kind table's: :mod:`torch_tp.parallel._forward_kinds`.)

    Example::

        >>> check_colwise(nn.Linear(16, 2), 4, "proj")
        Traceback (most recent call last):
        ValueError: ColwiseParallel cannot shard 'proj' (Linear).weight (shape (2, 16)) on dim 0: ...
        >>> check_colwise(nn.Linear(16, 12), 2, "qkv", packed=3)
    """
    _check_linear_or_embedding(module, device_mesh, "ColwiseParallel", module_path, colwise=True, packed=packed)


def check_rowwise(module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None = None, *,
                  packed: int = 1) -> None:
    """Raise if ``RowwiseParallel`` cannot shard ``module`` on ``device_mesh`` (changes nothing).

    It splits an ``nn.Linear``'s input features (weight dim 1) or an ``nn.Embedding``'s
    vocabulary (weight dim 0). A vocabulary shard looks up only its own rows, so the
    embedding options that need the whole table (``max_norm``, ``scale_grad_by_freq``,
    ``sparse``) are refused.

    Example::

        >>> check_rowwise(nn.LayerNorm(16), 2, "norm")
        Traceback (most recent call last):
        torch_tp.parallel.rules.UnsupportedModuleError: RowwiseParallel cannot shard 'norm' (LayerNorm): ...
    """
    _check_linear_or_embedding(module, device_mesh, "RowwiseParallel", module_path, colwise=False, packed=packed)


def _check_linear_or_embedding(module, device_mesh, style, module_path, *, colwise: bool, packed: int) -> None:
    require_1d_mesh(device_mesh, style)
    _require_module_type(module, (*_SHARDABLE, *transposed_linear_types()), style, module_path)
    _require_only_weight_and_bias(module, style, module_path)
    require_plain_parameters(module, style, module_path)
    dim = _weight_shard_dim(module, colwise=colwise)
    _require_equal_parts(module, dim, packed, style, module_path)
    _require_shardable(module, dim, mesh_size(device_mesh), style, module_path, parts=packed)
    require_unprepared(module, BOTH_STAGES, style, module_path)
    if not colwise and isinstance(module, nn.Embedding):
        _require_local_lookup(module, style, module_path)


def _require_local_lookup(module: nn.Embedding, style: str, module_path) -> None:
    """A vocab-parallel lookup sees only its rows: options that need the whole table are refused."""
    options = {"max_norm": module.max_norm is not None, "scale_grad_by_freq": module.scale_grad_by_freq,
               "sparse": module.sparse}
    unsupported = [name for name, on in options.items() if on]
    if unsupported:
        raise UnsupportedModuleError(
            f"{style} cannot shard {describe(module, module_path)} by vocabulary with {unsupported} set: "
            f"each rank looks up only its own rows (renorming, frequency scaling and sparse gradients "
            f"need the whole table); turn them off, or use ColwiseParallel (shards the embedding dim)"
        )


def check_sequence_parallel(
    module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None = None
) -> None:
    """Raise if ``module`` is not sequence-local (a norm, dropout, or elementwise module).

    Sequence parallelism runs the module on a slice of the sequence with replicated
    parameters, which is exact only when each position is computed independently with
    1-D (per-feature) parameters. BatchNorm mixes positions through its batch statistics
    and a module with a matrix parameter should be sharded, not replicated.

    Example::

        >>> check_sequence_parallel(nn.BatchNorm1d(8), 2, "bn")
        Traceback (most recent call last):
        torch_tp.parallel.rules.UnsupportedModuleError: SequenceParallel cannot run 'bn' (BatchNorm1d) on a sequence shard: ...
    """
    style = "SequenceParallel"
    require_1d_mesh(device_mesh, style)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        raise UnsupportedModuleError(
            f"{style} cannot run {describe(module, module_path)} on a sequence "
            f"shard: batch statistics would be computed per shard"
        )
    require_plain_parameters(module, style, module_path)
    for name, param in module.named_parameters():
        if param.ndim > 1:
            raise UnsupportedModuleError(
                f"{style} replicates the parameters of norm/dropout-like modules, but "
                f"{describe(module, module_path)}.{name} has shape {tuple(param.shape)}; "
                f"shard it with ColwiseParallel/RowwiseParallel instead"
            )
    require_unprepared(module, BOTH_STAGES, style, module_path)


def check_prepare_input(module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None = None) -> None:
    """Raise if ``PrepareModuleInput`` cannot be applied (N-D mesh, inputs already prepared).

    Example::

        >>> block = nn.Linear(2, 2)
        >>> mark_prepared(block, ("input",), "PrepareModuleInput")
        >>> check_prepare_input(block, 2, "block")
        Traceback (most recent call last):
        ValueError: PrepareModuleInput would convert the inputs of 'block' (Linear), which ...
    """
    require_1d_mesh(device_mesh, "PrepareModuleInput")
    require_unprepared(module, ("input",), "PrepareModuleInput", module_path)


def check_prepare_output(module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None = None) -> None:
    """Raise if ``PrepareModuleOutput`` cannot be applied (N-D mesh, outputs already prepared).

    Example::

        >>> check_prepare_output(nn.Linear(2, 2), 2, "norm")
    """
    require_1d_mesh(device_mesh, "PrepareModuleOutput")
    require_unprepared(module, ("output",), "PrepareModuleOutput", module_path)


# ---------------------------------------------------------------------- placements


def _weight_shard_dim(module: nn.Module, *, colwise: bool) -> int:
    # Linear computes x @ W.T with W of shape (out, in): colwise splits out (dim 0),
    # rowwise splits in (dim 1). Embedding's W is (num_embeddings, dim): colwise splits
    # the embedding dim (1), rowwise the vocabulary (0). transformers' Conv1D computes
    # x @ W with W of shape (in, out): colwise splits out (dim 1), rowwise in (dim 0).
    if isinstance(module, (nn.Embedding, *transposed_linear_types())):
        return 1 if colwise else 0
    return 0 if colwise else 1


def packed_shard(dim: int, parts: int = 1) -> Placement:
    """The placement of a weight that stacks ``parts`` equal matrices along ``dim``, sharded part by part.

    ``Shard(dim)`` for ``parts == 1``; otherwise torch's ``_StridedShard(dim,
    split_factor=parts)``: rank ``r`` holds ``[part_0 slice r; part_1 slice r; ...]``
    (each slice by ``torch.chunk``'s rule), and ``full_tensor()`` is the fused weight. A
    Linear's packed output and a Rowwise layer's packed input carry the same placement on
    their last dim.

    Example::

        >>> packed_shard(0)
        Shard(dim=0)
        >>> packed_shard(0, 2)
        _StridedShard(dim=0, sf=2)
    """
    return Shard(dim) if parts == 1 else _StridedShard(dim, split_factor=parts)


def parts_of(placement: Placement | None) -> int:
    """How many packed parts ``placement`` shards one by one: its split factor, else 1."""
    return placement.split_factor if isinstance(placement, _StridedShard) else 1


def sharded_dim(placement: Placement | None) -> int | None:
    """The tensor dim a ``Shard`` or packed shard splits; ``None`` for other placements."""
    return placement.dim if isinstance(placement, (Shard, _StridedShard)) else None


def colwise_placements(module: nn.Module, packed: int = 1) -> dict[str, Placement]:
    """Where ``ColwiseParallel`` puts each parameter of ``module`` (path relative to ``module``).

    With ``packed=k`` the weight and bias stack ``k`` parts along the output features
    and are sharded part by part (:func:`packed_shard`).

    Example::

        >>> colwise_placements(nn.Linear(4, 8))
        {'weight': Shard(dim=0), 'bias': Shard(dim=0)}
        >>> colwise_placements(nn.Embedding(10, 4))
        {'weight': Shard(dim=1)}
        >>> colwise_placements(nn.Linear(4, 8), packed=2)
        {'weight': _StridedShard(dim=0, sf=2), 'bias': _StridedShard(dim=0, sf=2)}
    """
    placements = {"weight": packed_shard(_weight_shard_dim(module, colwise=True), packed)}
    if getattr(module, "bias", None) is not None:
        placements["bias"] = packed_shard(0, packed)
    return placements


def rowwise_placements(module: nn.Module, packed: int = 1) -> dict[str, Placement]:
    """Where ``RowwiseParallel`` puts each parameter of ``module`` (path relative to ``module``).

    With ``packed=k`` the weight stacks ``k`` parts along the input features and is sharded
    part by part (:func:`packed_shard`); the bias stays replicated.

    Example::

        >>> rowwise_placements(nn.Linear(4, 8))
        {'weight': Shard(dim=1), 'bias': Replicate()}
        >>> rowwise_placements(nn.Linear(4, 8), packed=2)
        {'weight': _StridedShard(dim=1, sf=2), 'bias': Replicate()}
    """
    placements = {"weight": packed_shard(_weight_shard_dim(module, colwise=False), packed)}
    if getattr(module, "bias", None) is not None:
        placements["bias"] = Replicate()
    return placements


def replicated_placements(module: nn.Module) -> dict[str, Placement]:
    """Every parameter of ``module`` replicated: ``SequenceParallel``, ``ReplicateParallel``, ``SpatialParallel``.

    Example::

        >>> replicated_placements(nn.LayerNorm(8))
        {'weight': Replicate(), 'bias': Replicate()}
    """
    return {name: Replicate() for name, _ in module.named_parameters()}
