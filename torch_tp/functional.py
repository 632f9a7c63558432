"""Tensor-parallel transformations as plain functions, for users who prefer them to styles.

Each function builds the style of the same name from its keyword arguments and runs
exactly what ``parallelize_module(root, mesh, {path: Style(**settings)})`` runs for that
module: the style's check, then its application. So a bad argument fails the same way,
and the parallelized module is the same, in either form; the keyword arguments are the
style's (see each style for their meaning and defaults). Like every ``torch.nn``
transform they change the module in place and return it. ``module_path`` only names the
module in error messages (``parallelize_module`` passes the path the plan matched).

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> import torch_tp.functional as tpf
    >>> tpf.colwise(model.ffn.w1, mesh)
    >>> tpf.rowwise(model.ffn.w2, mesh, output_layouts=Shard(1))
    >>> tpf.prepare_input(model.ffn, mesh, input_layouts=Shard(1), desired_input_layouts=Replicate())
"""

from __future__ import annotations

import dataclasses
import inspect

import torch.nn as nn

from torch_tp.conv.spatial import SpatialParallel
from torch_tp.parallel.experts import ExpertParallel, ExpertTensorParallel
from torch_tp.parallel.prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from torch_tp.parallel.replicate import ReplicateParallel, replicate
from torch_tp.parallel.style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = [
    "colwise",
    "rowwise",
    "sequence_parallel",
    "replicate_parallel",
    "expert_parallel",
    "expert_tensor_parallel",
    "spatial",
    "prepare_input",
    "prepare_output",
    "prepare_input_output",
    "replicate",
]


def _apply(style: ParallelStyle, module, device_mesh, src_data_rank, module_path):
    """Check every module, then apply ``style`` to each: what parallelize_module does per plan entry."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    for target in modules:
        style.check(target, device_mesh, module_path)
    for target in modules:
        style.apply_to(target, device_mesh, src_data_rank=src_data_rank, module_path=module_path)
    style.link_siblings(modules, module_path or "")
    return module


def _signature(style_class: type[ParallelStyle], distributes: bool) -> inspect.Signature:
    """``(module, device_mesh, *, <the style's fields>, [src_data_rank=0,] module_path=None)``."""
    positional = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("module", "device_mesh")]
    settings = [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
            default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
        )
        for f in dataclasses.fields(style_class)
    ]
    settings.sort(key=lambda p: p.default is not inspect.Parameter.empty)  # required first
    extra = [("src_data_rank", 0)] if distributes else []
    extra += [("module_path", None)]
    tail = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in extra]
    return inspect.Signature(positional + settings + tail, return_annotation=nn.Module)


def _function_form(name: str, style_class: type[ParallelStyle], doc: str, *, distributes: bool = True):
    """The function ``name(module, device_mesh, **settings)`` that applies ``style_class(**settings)``."""

    def function(module, device_mesh, *, module_path=None, **settings):
        src_data_rank = settings.pop("src_data_rank", 0) if distributes else None
        return _apply(style_class(**settings), module, device_mesh, src_data_rank, module_path)

    function.__name__ = function.__qualname__ = name
    function.__module__ = __name__
    function.__doc__ = doc
    function.__signature__ = _signature(style_class, distributes)
    return function


colwise = _function_form("colwise", ColwiseParallel, """Shard an ``nn.Linear``'s output features (or an
    ``nn.Embedding``'s embedding dim): :class:`~torch_tp.ColwiseParallel` as a function.

    ``module`` may be a list of sibling layers that read one input (``[wq, wk, wv]``), as one
    plan entry matching them would give: each is sharded, and with ``overlap=True`` they
    share one fused all-gather. ``packed=k`` shards a fused weight of ``k`` stacked parts
    (``gate_up_proj``) part by part.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> colwise(model.w1, mesh)
        >>> model.w1.weight.placements
        (Shard(dim=0),)
        >>> colwise([attn.wq, attn.wk, attn.wv], mesh, input_layouts=Shard(1), overlap=True)
    """)

rowwise = _function_form("rowwise", RowwiseParallel, """Shard an ``nn.Linear``'s input features (or an
    ``nn.Embedding``'s vocabulary): :class:`~torch_tp.RowwiseParallel` as a function.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> rowwise(model.w2, mesh, output_layouts=Shard(1))
    """)

sequence_parallel = _function_form("sequence_parallel", SequenceParallel, """Run a norm/dropout-like module
    on a sequence shard with replicated parameters: :class:`~torch_tp.SequenceParallel` as a function.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> sequence_parallel(model.norm, mesh)   # nn.LayerNorm, nn.RMSNorm, ...
    """)

replicate_parallel = _function_form("replicate_parallel", ReplicateParallel, """Run a module with
    replicated parameters on (possibly sharded) inputs, its parameter gradients reduced over the
    ranks: :class:`~torch_tp.ReplicateParallel` as a function.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> replicate_parallel(attention.q_norm, mesh, input_layouts=Shard(2))   # local heads
    """)

expert_parallel = _function_form("expert_parallel", ExpertParallel, """Spread a grouped-experts
    module's experts over the ranks and dispatch each token to its experts by all-to-all:
    :class:`~torch_tp.ExpertParallel` as a function.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> expert_parallel(model.layers[0].mlp.experts, mesh)
        >>> model.layers[0].mlp.experts.gate_up_proj.placements
        (Shard(dim=0),)
    """)

expert_tensor_parallel = _function_form("expert_tensor_parallel", ExpertTensorParallel, """Split every
    expert of a grouped-experts module on its hidden dim, one reduction per call:
    :class:`~torch_tp.ExpertTensorParallel` as a function.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> expert_tensor_parallel(model.layers[0].mlp.experts, mesh)
    """)

spatial = _function_form("spatial", SpatialParallel, """Run a convolution (or a position-wise module
    between convolutions) on a spatial shard, or a whole CNN (any module with submodules) as a
    spatial region: :class:`~torch_tp.SpatialParallel` as a function.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> spatial(model.stem, mesh, dim=3)                  # width of NCHW
        >>> model.stem(torch.chunk(image, mesh.size(), dim=3)[rank]).placements
        (Shard(dim=3),)
    """)

prepare_input = _function_form("prepare_input", PrepareModuleInput, """Convert a module's inputs to
    DTensors and redistribute them before ``forward`` runs: :class:`~torch_tp.PrepareModuleInput`
    as a function.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> prepare_input(block.attention, mesh,
        ...               input_layouts=(Shard(1), None),
        ...               desired_input_layouts=(Replicate(), None))
    """, distributes=False)

prepare_output = _function_form("prepare_output", PrepareModuleOutput, """Convert a module's outputs to
    DTensors and redistribute them after ``forward`` runs: :class:`~torch_tp.PrepareModuleOutput`
    as a function.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> prepare_output(model.norm, mesh, output_layouts=Shard(1),
        ...                desired_output_layouts=Replicate())
    """, distributes=False)

prepare_input_output = _function_form("prepare_input_output", PrepareModuleInputOutput, """:func:`prepare_input`
    and :func:`prepare_output` on one module: :class:`~torch_tp.PrepareModuleInputOutput` as a function.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> prepare_input_output(block, mesh,
        ...                      input_layouts=Shard(1), desired_input_layouts=Replicate(),
        ...                      output_layouts=Replicate(), desired_output_layouts=Shard(1))
    """, distributes=False)
