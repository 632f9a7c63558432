"""Hugging Face transformers models parallelized by torch_tp, from the plans the models carry.

Every transformers model class carries a tensor-parallel plan in transformers' own vocabulary:
``config.base_model_tp_plan`` (keys relative to the base model) and the task model's
``_tp_plan`` (``{"lm_head": "colwise_gather_output"}``); transformers adds
``{"embed_tokens": "embedding_rowwise"}`` itself. :func:`tp_plan` translates them into a
torch_tp plan (see :data:`STYLES` for the vocabulary) and :func:`parallelize` applies it with
what the model needs around it: the attention modules declare their heads as whole units
(so a head count the mesh cannot split is refused before anything changes), and a tied
``lm_head`` / ``embed_tokens`` pair, sharded alike, stays one Parameter. A model that ships no
plan (GPT-2, BERT and the other encoders, ViT) gets the plan :func:`torch_tp.suggest_plan`
derives from its dataflow, with a :class:`DerivedPlanWarning` that says so. transformers is
imported by the caller, never by torch_tp.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group and transformers")
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
    ...                                      num_attention_heads=4, intermediate_size=128))
    >>> parallelize(model, mesh, sequence_parallel=True)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torch_tp.parallel.api import parallelize_module
from torch_tp.parallel.experts import ExpertParallel, ExpertTensorParallel
from torch_tp.parallel.plan import match_pattern
from torch_tp.parallel.prepare import PrepareModuleInput, PrepareModuleInputOutput
from torch_tp.parallel.replicate import ReplicateParallel
from torch_tp.parallel.style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from torch_tp.tools.suggest import suggest_plan

__all__ = ["STYLES", "EXPERT_STYLES", "DerivedPlanWarning", "tp_plan", "parallelize"]

_SEQ = Shard(1)


def _lm_head(sequence_parallel: bool, vocab_parallel_loss: bool) -> ParallelStyle:
    """The output head: vocab-sharded logits kept as a DTensor for the vocab-parallel loss, else gathered."""
    input_layouts = _SEQ if sequence_parallel else Replicate()
    if vocab_parallel_loss:
        return ColwiseParallel(input_layouts=input_layouts, use_local_output=False)
    return ColwiseParallel(input_layouts=input_layouts, output_layouts=Replicate())


def _rowwise(sequence_parallel: bool, input_layouts=None) -> ParallelStyle:
    """A Rowwise layer: replicated output, or under sequence parallelism sequence shards kept a DTensor."""
    if sequence_parallel:
        return RowwiseParallel(input_layouts=input_layouts, output_layouts=_SEQ, use_local_output=False)
    return RowwiseParallel(input_layouts=input_layouts)


#: transformers' TP vocabulary -> ``style(sequence_parallel, vocab_parallel_loss)``. Inputs of
#: sharded layers come from a ``PrepareModuleInput`` on their parent (see :func:`tp_plan`);
#: ``vocab_parallel_loss`` is passed true only for the output head.
STYLES: dict[str, Callable[[bool, bool], ParallelStyle]] = {
    "colwise": lambda sp, vp: ColwiseParallel(),
    "rowwise": lambda sp, vp: _rowwise(sp),
    "colwise_rep": lambda sp, vp: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda sp, vp: RowwiseParallel(),
    "colwise_gather_output": _lm_head,  # lm_head, and Phi-3's fused qkv_proj / gate_up_proj
    "rowwise_split_input": lambda sp, vp: _rowwise(sp, input_layouts=Replicate()),
    "embedding_rowwise": lambda sp, vp: _rowwise(sp, input_layouts=Replicate()),
    "embedding_colwise": lambda sp, vp: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "sequence_parallel": lambda sp, vp: SequenceParallel(),
    # per-head q_norm/k_norm on (batch, seq, local heads, head_dim): gradients summed over ranks
    "replicated_with_grad_allreduce": lambda sp, vp: ReplicateParallel(input_layouts=Shard(2)),
}

#: ``tp_plan(experts=...)`` -> the style of each grouped-experts module (``layers.*.mlp.experts``)
#: when activations between layers are replicated. The experts' parameter entries
#: (``packed_colwise`` gate_up_proj, ``rowwise`` down_proj) are covered by it.
EXPERT_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "tensor": ExpertTensorParallel,  # transformers' moe_tp_experts: every expert split on its hidden dim
    "expert": ExpertParallel,  # whole experts per rank, tokens dispatched by all-to-all
}

# Strings transformers uses that torch_tp does not translate yet, and what to do instead.
_NOT_YET = {
    "moe_identity_expert": "MoE identity experts",
    "mla_kv_a_proj": "multi-head latent attention",
    "all_reduce": "a module whose output transformers all-reduces",
    "replicate": "a module transformers replicates",
}

# The pre-norms of a decoder layer and the final norm: under sequence parallelism they run on
# sequence shards. transformers names them differently across families.
_NORMS = ("layers.*.input_layernorm", "layers.*.post_attention_layernorm", "layers.*.pre_feedforward_layernorm",
          "layers.*.post_feedforward_layernorm", "norm")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _base_prefix(model: nn.Module) -> str:
    """``"model."`` for a task model (``LlamaForCausalLM.model``), ``""`` for a base model."""
    prefix = getattr(model, "base_model_prefix", "")
    return f"{prefix}." if prefix and hasattr(model, prefix) and getattr(model, prefix) is not model else ""


def _model_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan, keys from ``model``: base model plan (prefixed), embedding, task head.

    transformers (5.x) merges all three into the instance's ``_tp_plan`` when it builds the
    model; the class attributes are read too, for models built another way.
    """
    config = model.config
    prefix = _base_prefix(model)
    plan = {f"{prefix}embed_tokens": "embedding_rowwise"}
    plan.update({f"{prefix}{key}": value for key, value in (getattr(config, "base_model_tp_plan", None) or {}).items()})
    plan.update(getattr(model, "_tp_plan", None) or {})
    # transformers >= 5.2x states the grouped experts in its expert-parallel plan only
    # (``base_model_ep_plan``: ``grouped_gemm``, ``ep_dispatch_experts``); their keys mark the
    # MoE blocks, whatever style the tensor-parallel plan gives (or no longer gives) them
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    plan.update({f"{prefix}{key}": value for key, value in ep_plan.items() if ".experts" in key
                 and f"{prefix}{key}" not in plan})
    return plan


def _translated(key: str, value: str, sequence_parallel: bool, vocab_parallel_loss: bool) -> ParallelStyle:
    if value in STYLES:
        return STYLES[value](sequence_parallel, vocab_parallel_loss)
    if value in _NOT_YET:
        raise NotImplementedError(
            f"tp_plan: {key!r} is {value!r} in the model's plan ({_NOT_YET[value]}), which torch_tp "
            f"does not translate yet (transformers {_transformers_version()}); pass experts=None to "
            f"leave such modules unsharded, or give them a style in your own plan"
        )
    raise ValueError(
        f"tp_plan: {key!r} is {value!r} in the model's plan, a string torch_tp does not know "
        f"(transformers {_transformers_version()}); known: {sorted(STYLES) + sorted(_NOT_YET)}"
    )


def _input_preparation(model: nn.Module, plan: dict[str, ParallelStyle], sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A ``PrepareModuleInput`` on every parent of sharded Colwise layers (attention, MLP).

    The parent turns its input into one DTensor, so sibling projections (q/k/v, gate/up)
    share it: their input gradients are summed before one collective. Under sequence
    parallelism this is also where the sequence shards are gathered.
    """
    between = _SEQ if sequence_parallel else Replicate()
    paths = [path for path, _ in model.named_modules()]
    sharded = [key for key, style in plan.items() if type(style) is ColwiseParallel and style.output_layouts != Replicate()]
    parents = sorted({path.rpartition(".")[0] for key in sharded for path in match_pattern(key, paths)})
    prepared = {}
    for parent in filter(None, parents):
        if _called_by_keyword(parent):
            prepared[parent] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": between}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
            )
        else:
            prepared[parent] = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))
    return prepared


def _called_by_keyword(path: str) -> bool:
    """transformers' decoder layers call ``self_attn(hidden_states=...)`` by keyword, ``mlp(x)`` positionally."""
    return path.rpartition(".")[2] in ("self_attn", "attn", "attention", "cross_attn")


def tp_plan(
    model: nn.Module,
    *,
    sequence_parallel: bool = False,
    vocab_parallel_loss: bool = False,
    experts: str | None = "tensor",
) -> dict[str, ParallelStyle]:
    """The torch_tp plan for a transformers ``PreTrainedModel`` (task or base model), from its own plan.

    Translates ``config.base_model_tp_plan``, the task model's ``_tp_plan`` and the
    ``embed_tokens`` entry transformers adds (vocabulary: :data:`STYLES`). Keys for modules
    this instance does not build (a dense-MLP key in an all-MoE model) are dropped here, by the
    translator; a plan you write yourself stays strict. The attention and MLP modules get a
    ``PrepareModuleInput``, so their projections share one input DTensor.

    Keyword Args:
        sequence_parallel (bool): shard activations between layers on the sequence dim; the
            decoder norms run on sequence shards (``SequenceParallel``).
        vocab_parallel_loss (bool): keep the logits sharded on the vocab as a DTensor, for
            :func:`torch_tp.loss.cross_entropy`. Default: gathered logits, as transformers.
        experts (str or None): the MoE experts' layout (Mixtral, Qwen3-MoE): ``"tensor"``
            (default, transformers' ``moe_tp_experts``: every expert split on its hidden dim,
            :class:`~torch_tp.parallel.ExpertTensorParallel`), ``"expert"`` (whole experts
            per rank, tokens sent to them by all-to-all,
            :class:`~torch_tp.parallel.ExpertParallel`) or ``None`` (experts left whole
            on every rank). The router stays replicated and sees every token.

    Returns:
        ``{pattern: style}`` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs transformers")
        >>> tp_plan(LlamaForCausalLM(config))["model.layers.*.self_attn.q_proj"]
        ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(dim=-1), use_local_output=True)
    """
    if experts not in (*EXPERT_STYLES, None):
        raise ValueError(f"tp_plan(experts={experts!r}): pass one of {[*EXPERT_STYLES, None]}")
    paths = [path for path, _ in model.named_modules()]
    head = _output_head_path(model)
    plan: dict[str, ParallelStyle] = {}
    blocks: list[str] = []  # patterns of the MoE blocks (parents of grouped experts)
    whole: list[str] = []  # modules of untranslated strings, left unsharded (experts=None)
    for key, value in _model_plan(model).items():
        if ".experts" in key:
            blocks.append(key.partition(".experts")[0])
            continue  # the experts module's style covers its parameters
        if experts is None and value in _NOT_YET:
            whole.append(key)
            continue
        if not match_pattern(key, paths):
            continue  # a module this config does not build
        sharded_logits = vocab_parallel_loss and head in match_pattern(key, paths)
        plan[key] = _translated(key, value, sequence_parallel, sharded_logits)
    plan.update(_input_preparation(model, plan, sequence_parallel))
    plan.update(_moe_blocks(_built_moe_blocks(blocks, paths), experts, sequence_parallel))
    if sequence_parallel:
        plan.update({key: _block_on_the_full_sequence(Replicate()) for key in whole if match_pattern(key, paths)})
        prefix = _base_prefix(model)
        plan.update({f"{prefix}{norm}": SequenceParallel() for norm in _NORMS if match_pattern(f"{prefix}{norm}", paths)})
    return plan


def _output_head_path(model: nn.Module) -> str | None:
    """The path of the module that computes the logits (``lm_head``), if the model has one."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return next((path for path, module in model.named_modules() if module is head), None)


def _built_moe_blocks(patterns: list[str], paths: list[str]) -> list[str]:
    """The paths of the modules ``patterns`` match that hold grouped experts (Qwen3-MoE's
    ``mlp_only_layers`` are dense MLPs under the same pattern)."""
    built = set(paths)
    matched = (path for pattern in dict.fromkeys(patterns) for path in match_pattern(pattern, paths))
    return [path for path in dict.fromkeys(matched) if f"{path}.experts" in built]


def _moe_blocks(blocks: list[str], experts: str | None, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The experts' style, and under sequence parallelism the block's gather and scatter.

    The block (router + experts) runs on every token, so the router, its routing and the
    auxiliary loss transformers computes from its logits are the single-process ones.
    Under sequence parallelism the block gathers the sequence; expert-TP's partial sums are
    reduce-scattered once onto the sequence shards, expert parallelism's replicated output
    is split back onto them. ``experts=None`` leaves the experts whole.
    """
    plan: dict[str, ParallelStyle] = {}
    partial = experts == "tensor" and sequence_parallel
    for block in blocks:
        if experts is not None:
            style = ExpertTensorParallel(output_layouts=Partial(), use_local_output=False) if partial \
                else EXPERT_STYLES[experts]()
            plan[f"{block}.experts"] = style
        if sequence_parallel:
            plan[block] = _block_on_the_full_sequence(Partial() if partial else Replicate())
    return plan


def _block_on_the_full_sequence(output: Placement) -> ParallelStyle:
    """A block under sequence parallelism that needs every token (an MoE block, a module left
    whole): it runs on the gathered sequence, and its output (replicated, or partial sums)
    goes back onto sequence shards."""
    return PrepareModuleInputOutput(
        input_layouts=(_SEQ,), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(output,), desired_output_layouts=(_SEQ,), use_local_output=False,
    )


def _declare_heads(model: nn.Module) -> None:
    """Tell torch_tp's plan check that the q/k/v/o projections are made of whole heads."""
    for module in model.modules():
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or not hasattr(module, "q_proj"):
            continue
        units = {f"{name}.weight": head_dim for name in ("q_proj", "k_proj", "v_proj", "o_proj") if hasattr(module, name)}
        units.update({f"{name}.bias": head_dim for name in ("q_proj", "k_proj", "v_proj")
                      if getattr(getattr(module, name, None), "bias", None) is not None})
        module.tensor_parallel_units = units


class DerivedPlanWarning(UserWarning):
    """:func:`parallelize` applied the plan :func:`torch_tp.suggest_plan` derived, as the model
    ships none; the message gives the share of parameter bytes it splits.

    Example::

        >>> issubclass(DerivedPlanWarning, UserWarning)
        True
    """


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    vocab_parallel_loss: bool = False,
    experts: str | None = "tensor",
    src_data_rank: int | None = 0,
    example_inputs: tuple[Any, ...] | None = None,
) -> nn.Module:
    """``parallelize_module(model, mesh, tp_plan(model, ...))`` plus what the model needs around it.

    A model whose config ships no plan for the modules it builds (GPT-2, BERT, ViT) gets the plan
    :func:`torch_tp.suggest_plan` derives from its dataflow on ``example_inputs`` (default: the
    model's own ``dummy_inputs`` for its main input, token ids for text models), with a
    :class:`DerivedPlanWarning` naming the share of bytes it splits; ``print(suggest_plan(model,
    mesh, example_inputs))`` lists it module by module. ``sequence_parallel=True`` derives the
    sequence-parallel stream too (``PlanDerivationError`` naming the op where the model does not
    allow it: an encoder returns its hidden states); a derived plan has no vocabulary-parallel
    loss yet (``NotImplementedError``), and one that splits nothing raises ``ValueError`` rather
    than returning the model unchanged. A plan that
    leaves more than half the parameter bytes whole on every rank warns, naming the share and
    the largest whole modules.
    ``model.save_pretrained(dir)``, called on every rank, writes the whole tensors (rank 0
    writes), so ``from_pretrained(dir)`` loads the single-process model.
    The attention modules declare their heads as whole units (a head count the mesh cannot
    split raises before anything changes); a tied ``lm_head`` / ``embed_tokens`` pair is
    placed alike by the plan (both ``Shard(0)``) and stays one Parameter. Generation with a
    KV cache works (each rank caches its own heads); keep ``sequence_parallel=False`` there,
    since one new token does not split over the ranks.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group and transformers")
        >>> model = parallelize(Qwen3ForCausalLM(config), mesh)
        >>> model(input_ids).logits.shape   # replicated logits, as one process computes them
    """
    _declare_heads(model)
    plan = tp_plan(model, sequence_parallel=sequence_parallel, vocab_parallel_loss=vocab_parallel_loss, experts=experts)
    if not _shards_anything(plan):
        plan = _derived_plan(model, mesh, example_inputs, sequence_parallel=sequence_parallel,
                             vocab_parallel_loss=vocab_parallel_loss)
    parallelize_module(model, mesh, plan, src_data_rank=src_data_rank)
    _warn_if_mostly_replicated(model)
    _save_whole_tensors(model)
    return model


def _save_whole_tensors(model: nn.Module) -> None:
    """Make ``model.save_pretrained(dir)`` write the whole tensors, as transformers' own TP does.

    Called on every rank (transformers writes on rank 0 only): each DTensor of the state dict is
    gathered whole, once per tensor however many keys share it (ties stay ties), so
    ``from_pretrained(dir)`` builds the single-process model. An explicit ``state_dict=`` passes
    through unchanged.
    """
    original = model.save_pretrained

    def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
        if state_dict is None:
            state_dict = _whole_state_dict(model)
        return original(save_directory, *args, state_dict=state_dict, **kwargs)

    save_pretrained.__doc__ = original.__doc__
    model.save_pretrained = save_pretrained


def _whole_state_dict(model: nn.Module) -> dict:
    whole: dict[int, object] = {}
    state = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            if id(value) not in whole:
                whole[id(value)] = value.full_tensor()  # a collective: every rank, same order
            value = whole[id(value)]
        state[key] = value
    return state


#: Above this share of the parameter bytes left whole on every rank, parallelize warns.
MOSTLY_REPLICATED = 0.5

_ONLY_MOVE_ACTIVATIONS = (PrepareModuleInput, PrepareModuleInputOutput, SequenceParallel)


def _shards_anything(plan: dict[str, ParallelStyle]) -> bool:
    return any(not isinstance(style, _ONLY_MOVE_ACTIVATIONS) for style in plan.values())


def _derived_plan(model: nn.Module, mesh: DeviceMesh, example_inputs: tuple[Any, ...] | None, *,
                  sequence_parallel: bool, vocab_parallel_loss: bool) -> dict[str, ParallelStyle]:
    """The plan :func:`suggest_plan` derives for a model that ships none, announced by a warning."""
    name, shipped = type(model).__name__, getattr(model.config, "base_model_tp_plan", None)
    where = f"torch_tp.integrations.transformers.parallelize: {name} ships no tensor-parallel plan for the modules it builds"
    if vocab_parallel_loss:
        raise NotImplementedError(f"{where}, and a plan derived from its dataflow has no vocab_parallel_loss yet: "
                                  f"pass vocab_parallel_loss=False, or write a plan for torch_tp.parallelize_module")
    with _without_cache(model):  # a returned KV cache is not traceable; the derived plan is the same
        plan = suggest_plan(model, mesh, _example_inputs(model, example_inputs, where), sequence_parallel=sequence_parallel)
    if not _shards_anything(plan):
        raise ValueError(
            f"{where} (config.base_model_tp_plan is {shipped!r}, and no _tp_plan entry matches), and none derived "
            f"from its dataflow splits anything, so nothing would be sharded:\n{plan}\nWrite a plan for "
            f"torch_tp.parallelize_module (docs/plans_and_styles.md), and check it with torch_tp.verify_plan"
        )
    warnings.warn(
        f"{where}: using the plan torch_tp.suggest_plan derived from its dataflow, which splits "
        f"{plan.sharded_fraction:.1%} of the parameter bytes (print(torch_tp.suggest_plan(model, mesh, example_inputs)) "
        f"lists it module by module, with why)",
        DerivedPlanWarning, stacklevel=3,
    )
    return plan


def _example_inputs(model: nn.Module, given: tuple[Any, ...] | None, where: str) -> tuple[Any, ...]:
    """``given``, else the model's own dummy batch for its main input (token ids for text models)."""
    if given is not None:
        return tuple(given)
    dummy = getattr(model, "dummy_inputs", None) or {}
    main = getattr(model, "main_input_name", "input_ids")
    if main not in dummy:
        raise ValueError(f"{where}, and the plan derived from its dataflow needs an example batch: pass "
                         f"example_inputs=(a {main} batch,) (the model has no dummy {main})")
    return (dummy[main],)


@contextlib.contextmanager
def _without_cache(model: nn.Module) -> Iterator[None]:
    config = model.config
    saved = getattr(config, "use_cache", None)
    if saved:
        config.use_cache = False
    try:
        yield
    finally:
        if saved:
            config.use_cache = saved


def _warn_if_mostly_replicated(model: nn.Module) -> None:
    """Warn, with the share and the largest whole modules, when most parameter bytes stay whole."""
    whole: dict[str, int] = {}
    total = 0
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        total += nbytes
        if not (isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)):
            owner = name.rpartition(".")[0] or "<root>"
            whole[owner] = whole.get(owner, 0) + nbytes
    share = sum(whole.values()) / total if total else 0.0
    if share <= MOSTLY_REPLICATED:
        return
    largest = sorted(whole.items(), key=lambda item: -item[1])[:3]
    shown = ", ".join(f"{path!r} {nbytes / 2**20:.2f} MiB" for path, nbytes in largest)
    warnings.warn(
        f"torch_tp.integrations.transformers.parallelize: {type(model).__name__}'s plan leaves {share:.0%} of "
        f"its parameter bytes whole on every rank (largest: {shown}); tensor parallelism saves little memory "
        f"or compute here. Add entries for those modules (torch_tp.parallelize_module with your own plan)",
        stacklevel=3,
    )
