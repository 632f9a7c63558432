"""Mixture-of-experts styles: :class:`ExpertParallel` (experts spread over the ranks, tokens
travel to them) and :class:`ExpertTensorParallel` (every expert split on its hidden dim).

Both take a *grouped-experts* module, the layout of transformers' Mixtral / Qwen3-MoE experts
and of :class:`torch_tp.models.moe.GroupedExperts`:

* every parameter has a leading expert dim ``[E, ...]`` and the module has an int ``num_experts``;
* it is called as ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` and
  returns ``[T, H]``: for each token, the sum over its ``k`` experts of weight x expert(token).

*Dense* experts (Llama-4's ``Llama4TextExperts``) are called as ``experts(hidden_states
[E * T, H])``: every token once per expert, expert-major, pre-scaled by its routing weight.
``ExpertParallel`` runs each rank's experts on their rows and all-gathers the results;
``ExpertTensorParallel`` shards ``gate_up_proj [E, H, 2I]`` on ``2I`` (packed) and
``down_proj [E, I, H]`` on ``I`` and reduces the partial sums.

The styles run the module's *own* forward on this rank's shards of the weights (its
parameters are swapped for their local tensors while it runs), so any module keeping that
contract works, whatever its expert math.

==========================  =======================================  ===========================
                            ``ExpertParallel``                        ``ExpertTensorParallel``
==========================  =======================================  ===========================
weights per rank            ``E / world`` whole experts (``Shard(0)``)  every expert, ``I / world``
                                                                     of its hidden dim
communication per layer     2 all-to-alls of the routed tokens       1 all-reduce of ``[T, H]``
                            (+ split sizes, a host sync)             (reduce-scatter under SP)
compute per rank            the tokens routed to local experts       every token, 1/world of each
==========================  =======================================  ===========================

The router stays replicated. Fed the same tokens on every rank it needs nothing; fed a
rank's own tokens, give it ``ReplicateParallel(input_layouts=Shard(0))`` so its gradient is
summed. Under ``torch.compile`` the grouped experts run eagerly (their token counts are data
dependent: one graph break per MoE layer, at the experts); everything around them compiles.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> parallelize_module(model, mesh, {"layers.*.mlp.experts": ExpertParallel()})
    >>> parallelize_module(model, mesh, {"layers.*.mlp.experts": ExpertTensorParallel()})
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_tp._agreement import Fact, check_on_every_rank, runtime_verdict, settle
from torch_tp._layouts import finish_output, redistribute_to, replace_forward, shard_sizes, to_dtensor
from torch_tp._module_state import ensure_state, state_of
from torch_tp.parallel import _dispatch, rules
from torch_tp.parallel.style import ParallelStyle, distribute_parameters

__all__ = ["ExpertParallel", "ExpertTensorParallel", "Routing", "routing_summary"]

_TOKENS = (Replicate(), Shard(0))
_CONTRACT = (
    "a grouped-experts module: an int `num_experts`, every parameter shaped [num_experts, ...], "
    "called as experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])"
)
#: ExpertTensorParallel's layout: parameter -> (sharded dim, packed parts). gate_up_proj is
#: [E, 2I, H] ([gate; up] along dim 1), down_proj is [E, H, I]: transformers' Mixtral/Qwen3-MoE.
_HIDDEN_DIM_SHARDS = {"gate_up_proj": (1, 2), "down_proj": (2, 1)}
#: The same for *dense* experts (Llama-4's ``Llama4TextExperts``): gate_up_proj [E, H, 2I], down_proj [E, I, H].
_DENSE_HIDDEN_DIM_SHARDS = {"gate_up_proj": (2, 2), "down_proj": (1, 1)}


def _takes_routing(module: nn.Module) -> bool:
    """Grouped experts take ``(hidden_states, top_k_index, top_k_weights)``; *dense* experts
    (Llama-4's) take ``hidden_states`` alone: ``[E * T, H]``, every token once per expert,
    expert-major, already scaled by its routing weight (zero where not routed)."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional for p in inspect.signature(module.forward).parameters.values()) >= 3


def _hidden_dim_shards(module: nn.Module) -> dict[str, tuple[int, int]] | None:
    """``{parameter: (sharded dim, packed parts)}`` for the module's layout, or ``None``."""
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    if set(shapes) != set(_HIDDEN_DIM_SHARDS) or getattr(module, "is_transposed", False):
        return None
    gate_up, down = shapes["gate_up_proj"], shapes["down_proj"]
    if len(gate_up) != 3 or len(down) != 3:
        return None
    if gate_up[1] == 2 * down[2] and gate_up[2] == down[1]:
        return _HIDDEN_DIM_SHARDS
    if not _takes_routing(module) and gate_up[2] == 2 * down[1] and gate_up[1] == down[2]:
        return _DENSE_HIDDEN_DIM_SHARDS
    return None


# ----------------------------------------------------------------------------------- rules


def _require_grouped_experts(module: nn.Module, style: str, module_path: str | None) -> int:
    """``module``'s expert count, or an error saying what the style takes."""
    num_experts = getattr(module, "num_experts", None)
    params = dict(module.named_parameters())
    leading = {name: tuple(p.shape) for name, p in params.items() if p.ndim < 2 or p.shape[0] != num_experts}
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or not params or leading:
        found = f"num_experts={num_experts!r}, parameters {({n: tuple(p.shape) for n, p in params.items()})}"
        raise rules.UnsupportedModuleError(
            f"{style} cannot take {rules.describe(module, module_path)} ({found}): it takes {_CONTRACT}. "
            f"Give it the experts module (e.g. 'layers.*.mlp.experts'), or shard a dense MLP with "
            f"ColwiseParallel / RowwiseParallel"
        )
    rules.require_plain_parameters(module, style, module_path)
    return num_experts


def _require_token_layout(layout: Placement, argument: str, style: str, allowed=_TOKENS) -> Placement:
    if layout not in allowed:
        raise ValueError(
            f"{style}({argument}={layout!r}): tokens are rows of a [T, H] tensor, so the layout is one "
            f"of {list(allowed)} (Replicate(): the same tokens on every rank; Shard(0): each rank's own)"
        )
    return layout


def _token_layout_argument(value, argument: str, style: str, allowed=_TOKENS) -> Placement:
    """A style's layout argument for the tokens, normalized (default ``Replicate()``) and checked."""
    return _require_token_layout(rules.single_layout(value, argument, style, Replicate()), argument, style, allowed)


def _check_expert_parallel(module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None) -> None:
    style = "ExpertParallel"
    rules.require_1d_mesh(device_mesh, style)
    num_experts = _require_grouped_experts(module, style, module_path)
    world = rules.mesh_size(device_mesh)
    if num_experts % world:
        raise ValueError(
            f"{style} cannot spread the {num_experts} experts of {rules.describe(module, module_path)} over "
            f"the {world} ranks of the mesh: each rank owns whole experts, so num_experts must be a "
            f"multiple of the mesh size. Use a mesh of {_divisors(num_experts)} ranks, or "
            f"ExpertTensorParallel (every rank holds a slice of every expert)"
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_expert_tensor_parallel(module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None) -> None:
    style = "ExpertTensorParallel"
    rules.require_1d_mesh(device_mesh, style)
    _require_grouped_experts(module, style, module_path)
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    where = rules.describe(module, module_path)
    shards = _hidden_dim_shards(module)
    if shards is None:
        raise rules.UnsupportedModuleError(
            f"{style} cannot split {where} (parameters {shapes}, is_transposed="
            f"{getattr(module, 'is_transposed', False)}): it takes gate_up_proj [E, 2I, H] and down_proj "
            f"[E, H, I] (transformers' Mixtral / Qwen3-MoE experts, torch_tp.models.moe.GroupedExperts), or "
            f"dense experts gate_up_proj [E, H, 2I] and down_proj [E, I, H] (Llama-4). Use ExpertParallel, "
            f"which takes any grouped-experts module"
        )
    dim, _ = shards["down_proj"]
    hidden, world = shapes["down_proj"][dim], rules.mesh_size(device_mesh)
    if hidden < world:
        raise ValueError(
            f"{style} cannot split the expert hidden size {hidden} of {where} over {world} ranks; "
            f"use a smaller tensor-parallel mesh or ExpertParallel"
        )


# ------------------------------------------------------------------------- the forwards


@contextmanager
def _local_parameters(module: nn.Module):
    """Run ``module`` on this rank's shards: its DTensor parameters read as their local
    tensors (differentiably, so gradients reach the DTensor parameters), and its
    ``num_experts`` is the number of experts it holds here (transformers' grouped-mm path
    sizes its offsets by it)."""
    held, num_experts = dict(module._parameters), module.num_experts
    local = {name: p.to_local() if isinstance(p, DTensor) else p for name, p in held.items()}
    module._parameters.update(local)
    module.num_experts = next(iter(local.values())).shape[0]
    try:
        yield local
    finally:
        module._parameters.update(held)
        module.num_experts = num_experts


def _as_tokens(value: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> DTensor:
    return value if isinstance(value, DTensor) else to_dtensor(value, mesh, layout)


def _own_tokens(value: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> torch.Tensor:
    """This rank's rows: its chunk of replicated tokens (gradients gathered back), or its own."""
    return redistribute_to(_as_tokens(value, mesh, layout), Shard(0)).to_local()


def _run_local_experts(module: nn.Module, inner, rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
    """The module's own forward on the received rows, one expert each, weight 1."""
    with _local_parameters(module) as local:
        out = inner(rows, local_expert.unsqueeze(1), rows.new_ones(rows.shape[0], 1))
    if rows.shape[0] == 0:
        # No token here. Keep the received rows in the graph (the backward all-to-all is a
        # collective every rank must join) and give the expert shards a zero gradient, as the
        # whole weight gets in one process.
        out = out + (rows.sum() + sum(p.sum() for p in local.values() if p.requires_grad)) * 0
    return out


def _home(out: torch.Tensor, hidden_states: torch.Tensor, mesh: DeviceMesh, layout: Placement, use_local_output: bool):
    """The combined rows back in the tokens' layout: replicated tokens are gathered again."""
    if layout == Shard(0) and isinstance(hidden_states, DTensor):
        shape, stride = hidden_states.shape, hidden_states.stride()
        out = DTensor.from_local(out, mesh, (layout,), run_check=False, shape=shape, stride=stride)
    elif layout == Shard(0):
        return out if use_local_output else DTensor.from_local(out, mesh, (layout,), run_check=False)
    else:
        sharded = to_dtensor(out, mesh, Shard(0), sharded_dim_size=hidden_states.shape[0])
        out = redistribute_to(sharded, Replicate())
    return finish_output(out, use_local_output)


def _routing_facts(module, hidden_states, top_k_index, top_k_weights, layout: Placement, style: str) -> list[Fact]:
    """This rank's checks of one routing (the ids, their shapes), and what every rank must share.

    The all-to-all split sizes and the gathered token counts come from these tensors: an id past
    ``num_experts`` on one rank would abort another (gloo's size check), a negative one leave the
    others waiting, replicated tokens of different counts misalign every exchange.
    """
    tokens = hidden_states.shape[0]
    where = f"{style} on {type(module).__name__}"
    if top_k_index.ndim != 2 or top_k_index.shape[0] != tokens or tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(
            f"torch_tp.parallel.experts: {where} needs top_k_index and top_k_weights shaped [tokens, k] "
            f"for hidden_states [tokens, hidden]; this rank got {tuple(top_k_index.shape)} and "
            f"{tuple(top_k_weights.shape)} for {tuple(hidden_states.shape)}"
        )
    if top_k_index.is_floating_point() or top_k_index.is_complex():
        raise TypeError(f"torch_tp.parallel.experts: {where}: top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    ids = top_k_index.to_local() if isinstance(top_k_index, DTensor) else top_k_index
    if ids.numel() and bool(((ids < 0) | (ids >= module.num_experts)).any()):
        raise ValueError(
            f"torch_tp.parallel.experts: {where}: this rank routes to expert ids from {int(ids.min())} to "
            f"{int(ids.max())}, outside 0 .. {module.num_experts - 1} (num_experts={module.num_experts}); "
            f"check the router's top-k (an id past the last expert would abort another rank's all-to-all)"
        )
    facts = [
        Fact("routings have different top-k", top_k_index.shape[1], "every rank's router must pick the same k"),
        Fact("tokens have different hidden shapes and dtypes", (tuple(hidden_states.shape[1:]), str(hidden_states.dtype)),
             "feed every rank tokens of the same width and dtype"),
    ]
    if layout == Replicate() and not isinstance(hidden_states, DTensor):
        facts.append(Fact("replicated tokens differ in number", tokens,
                          "with input_layouts=Replicate() every rank must hold the same tokens; for each "
                          "rank's own tokens pass input_layouts=Shard(0)"))
    return facts


def _agree_on_routing(module, hidden_states, top_k_index, top_k_weights, *, mesh, layout, style) -> None:
    """One agreement (8 bytes per rank) before the routing's collectives: a bad id, shape or token
    count on any rank raises a named error on every rank, not an abort or a hang."""
    check_on_every_rank(
        mesh.get_group(), lambda: _routing_facts(module, hidden_states, top_k_index, top_k_weights, layout, style),
        what=style, at_runtime=True,
    )


def _tokens_layout(hidden_states: torch.Tensor, declared: Placement, style: str) -> Placement:
    if isinstance(hidden_states, DTensor):
        return _require_token_layout(hidden_states.placements[0], "input DTensor placements", style)
    return declared


@torch.compiler.disable  # split sizes are data dependent; the dense parts around still compile
def _expert_parallel_forward(
    module, hidden_states, top_k_index, top_k_weights, *, inner, mesh, input_layouts, use_local_output
):
    style = "ExpertParallel"
    layout = _tokens_layout(hidden_states, input_layouts, style)
    group, world = mesh.get_group(), mesh.size()
    # The routing's agreement rides on the count exchange every rank runs anyway (no collective
    # of its own); a rank that refused its routing sends zero counts there, and every rank raises.
    verdict = runtime_verdict(
        lambda: _routing_facts(module, hidden_states, top_k_index, top_k_weights, layout, style), what=style
    )
    carried = {} if verdict is None else dict(digest=verdict.digest, settle=partial(settle, group, verdict, what=style))
    if verdict is not None and verdict.problem is not None:  # join the exchange, then raise (settle does)
        _dispatch.plan_route(None, module.num_experts, group, world, device=hidden_states.device, **carried)
    tokens, index, weights = (_own_tokens(v, mesh, layout) for v in (hidden_states, top_k_index, top_k_weights))
    route = _dispatch.plan_route(index, module.num_experts, group, world, **carried)
    received = _dispatch.dispatch(tokens, route, index.shape[1], group)
    out = _dispatch.combine(_run_local_experts(module, inner, received, route.local_expert), route, weights, group)
    ensure_state(module).route = Routing(sent=route.sent, received=route.received)
    return _home(out, hidden_states, mesh, layout, use_local_output)


def _token_count(hidden_states: torch.Tensor, mesh: DeviceMesh, layout: Placement, verdict=None) -> int | None:
    """The number of tokens over the group, for plain inputs holding each rank's own tokens.

    One small all-gather; the counts must follow ``torch.chunk`` (as sequence parallelism
    gives), the layout a ``Shard(0)`` DTensor of them has. With ``verdict`` (the routing's,
    :func:`torch_tp._agreement.runtime_verdict`) its digest travels beside the count and the
    ranks settle the routing first.
    """
    if layout != Shard(0) or isinstance(hidden_states, DTensor):
        return None
    mine = [hidden_states.shape[0] if verdict is None or verdict.problem is None else 0]
    if verdict is not None:
        mine.append(verdict.digest)
    gathered = torch.tensor(mine, dtype=torch.int64, device=hidden_states.device)
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(gathered, 0, mesh.get_group()))
    gathered = gathered.view(mesh.size(), -1).tolist()  # [rank][count (, digest)]
    if verdict is not None:
        settle(mesh.get_group(), verdict, [row[1] for row in gathered], what="ExpertTensorParallel")
    counts = [row[0] for row in gathered]
    if tuple(counts) != shard_sizes(sum(counts), len(counts)):
        raise ValueError(
            f"ExpertTensorParallel(input_layouts=Shard(0)): the ranks hold {counts} tokens, which is not "
            f"how a sharded dim of {sum(counts)} splits ({list(shard_sizes(sum(counts), len(counts)))}); "
            f"gather the tokens first and pass input_layouts=Replicate()"
        )
    return sum(counts)


def _all_tokens(value: torch.Tensor, mesh: DeviceMesh, layout: Placement, count: int | None) -> torch.Tensor:
    """Every token, on every rank; the gradient each rank computes from it is a partial sum."""
    tokens = value if isinstance(value, DTensor) else to_dtensor(value, mesh, layout, sharded_dim_size=count)
    return redistribute_to(tokens, Replicate()).to_local(grad_placements=(Partial(),))


@torch.compiler.disable  # the experts' own loop over experts is data dependent
def _expert_tensor_parallel_forward(
    module, hidden_states, top_k_index, top_k_weights, *, inner, mesh, input_layouts, output_layouts, use_local_output
):
    style = "ExpertTensorParallel"
    layout = _tokens_layout(hidden_states, input_layouts, style)
    if layout == Shard(0) and not isinstance(hidden_states, DTensor):
        # each rank's own tokens: the routing's agreement rides on the token-count all-gather
        verdict = runtime_verdict(
            lambda: _routing_facts(module, hidden_states, top_k_index, top_k_weights, layout, style), what=style
        )
        count = _token_count(hidden_states, mesh, layout, verdict)
    else:
        _agree_on_routing(module, hidden_states, top_k_index, top_k_weights, mesh=mesh, layout=layout, style=style)
        count = None
    tokens, weights, index = (_all_tokens(v, mesh, layout, count) for v in (hidden_states, top_k_weights, top_k_index))
    with _local_parameters(module):
        partial_sums = inner(tokens, index, weights)
    out = DTensor.from_local(partial_sums, mesh, (Partial(),), run_check=False)
    return finish_output(redistribute_to(out, output_layouts), use_local_output)


# ------------------------------------------------------------------ dense experts (Llama-4)


def _dense_facts(module, hidden_states, style: str) -> list[Fact]:
    rows, experts = hidden_states.shape[0], module.num_experts
    if hidden_states.ndim != 2 or rows % experts:
        raise ValueError(
            f"torch_tp.parallel.experts: {style} on {type(module).__name__} (dense experts) needs hidden_states "
            f"[num_experts * tokens, hidden] = [{experts} * T, H]; this rank got {tuple(hidden_states.shape)}"
        )
    return [Fact("dense experts' inputs have different shapes and dtypes", (tuple(hidden_states.shape), str(hidden_states.dtype)),
                 "every rank must feed the dense experts the same [num_experts * tokens, hidden] rows")]


def _agree_on_dense_input(module, hidden_states, mesh, style: str) -> None:
    check_on_every_rank(mesh.get_group(), lambda: _dense_facts(module, hidden_states, style), what=style,
                        at_runtime=True)


@torch.compiler.disable
def _dense_expert_parallel_forward(module, hidden_states, *, inner, mesh, input_layouts, use_local_output):
    """Each rank runs its experts' rows (expert-major ``[E, T, H]``: a ``Shard(0)`` of the
    replicated input, no communication), then one all-gather makes every row whole again."""
    _agree_on_dense_input(module, hidden_states, mesh, "ExpertParallel")
    rows = hidden_states.to_local() if isinstance(hidden_states, DTensor) else hidden_states
    experts, width = module.num_experts, rows.shape[-1]
    per_expert = rows.reshape(experts, -1, width)
    mine = redistribute_to(to_dtensor(per_expert, mesh, Replicate()), Shard(0)).to_local()
    with _local_parameters(module):
        out = inner(mine.reshape(-1, width)).reshape(mine.shape)
    shape = per_expert.shape
    sharded = DTensor.from_local(out, mesh, (Shard(0),), run_check=False, shape=shape,
                                 stride=(shape[1] * shape[2], shape[2], 1))
    whole = redistribute_to(sharded, Replicate())
    return finish_output(whole, True).reshape(-1, width) if use_local_output else whole


@torch.compiler.disable
def _dense_expert_tensor_parallel_forward(
    module, hidden_states, *, inner, mesh, input_layouts, output_layouts, use_local_output
):
    """Every rank runs every row through its slice of every expert; the partial sums are reduced."""
    _agree_on_dense_input(module, hidden_states, mesh, "ExpertTensorParallel")
    rows = _all_tokens(hidden_states, mesh, Replicate(), None)
    with _local_parameters(module):
        partial = inner(rows)
    out = DTensor.from_local(partial, mesh, (Partial(),), run_check=False)
    return finish_output(redistribute_to(out, output_layouts), use_local_output)


def _require_replicated_dense_input(module: nn.Module, layouts: dict, style: str) -> None:
    if not _takes_routing(module) and any(layout != Replicate() for layout in layouts.values()):
        raise ValueError(
            f"{style}({', '.join(f'{k}={v!r}' for k, v in layouts.items())}) on {type(module).__name__}: dense "
            f"experts (every token once per expert, Llama-4's) take and return every row on every rank: "
            f"leave the layouts at Replicate()"
        )


# ----------------------------------------------------------------------------------- styles


class ExpertParallel(ParallelStyle):
    """Spread a grouped-experts module's experts over the ranks; send each token to its experts.

    Every parameter becomes ``Shard(0)`` on its expert dim: rank ``r`` owns experts
    ``[r * E / world, (r + 1) * E / world)`` (``E % world`` must be 0). In the forward each
    token copy (a token and one of its top-k experts) travels to the rank owning that expert
    with one all-to-all (split sizes exchanged first), runs there, and comes back with the
    inverse all-to-all; then the copies are weighted and summed. Dropless: no capacity
    factor, no token dropped, so the result is the single-process one. Autograd runs both
    all-to-alls in reverse. Function form: :func:`torch_tp.functional.expert_parallel`.

    Keyword Args:
        input_layouts (Placement, optional): the tokens' layout (rows of ``hidden_states``;
            ``top_k_index`` and ``top_k_weights`` follow it). ``Replicate()`` (default): every
            rank holds the same tokens, as after attention under plain TP; each rank
            dispatches its ``1/world`` chunk and the results are gathered back.
            ``Shard(0)``: each rank holds its own tokens (sequence parallelism, data
            parallelism over the group); nothing is gathered. A DTensor input brings its own.
        use_local_output (bool): return a plain tensor (default ``True``) or a DTensor in the
            tokens' layout.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> parallelize_module(model, mesh, {"layers.*.mlp.experts": ExpertParallel()})
        >>> routing_summary(model)["layers.0.mlp.experts"].received  # token copies per source rank
        (37, 27)
    """

    input_layouts: Placement | None = None
    use_local_output: bool = True

    def __post_init__(self):
        name = "ExpertParallel"
        self.input_layouts = _token_layout_argument(self.input_layouts, "input_layouts", name)
        self.use_local_output = rules.flag(self.use_local_output, "use_local_output", name)

    def param_placements(self, module):
        return {name: Shard(0) for name, _ in module.named_parameters()}

    def check(self, module, device_mesh, module_path=None):
        _check_expert_parallel(module, device_mesh, module_path)
        _require_replicated_dense_input(module, {"input_layouts": self.input_layouts}, "ExpertParallel")

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        forward = _expert_parallel_forward if _takes_routing(module) else _dense_expert_parallel_forward
        return _apply_expert_style(
            self, "ExpertParallel", module, device_mesh, src_data_rank, forward, input_layouts=self.input_layouts,
        )


class ExpertTensorParallel(ParallelStyle):
    """Split every expert of a grouped-experts module on its hidden dim, as a Colwise/Rowwise pair.

    ``gate_up_proj`` ``[E, 2I, H]`` is sharded on ``2I`` part by part (each rank holds its
    slice of gate and of up, so the module's ``chunk(2, dim=-1)`` still splits them) and
    ``down_proj`` ``[E, H, I]`` on ``I``: transformers' ``moe_tp_experts`` layout. Every rank
    runs every token through its slice of its experts; the partial sums are reduced once.
    The gradients of the tokens and of the routing weights are partial sums too and are
    summed in the backward, so the router's gradient is the single-process one.
    Function form: :func:`torch_tp.functional.expert_tensor_parallel`.

    Keyword Args:
        input_layouts (Placement, optional): the tokens' layout: ``Replicate()`` (default) or
            ``Shard(0)`` (each rank's own tokens, gathered first; the ranks' token counts must
            split as ``torch.chunk`` splits, as sequence parallelism gives: one small
            all-gather of the counts checks it).
        output_layouts (Placement, optional): ``Replicate()`` (default: one all-reduce),
            ``Shard(0)`` (one reduce-scatter onto the tokens) or ``Partial()`` (leave the
            partial sums to a later reduction, with ``use_local_output=False``).
        use_local_output (bool): return a plain tensor (default ``True``) or the DTensor.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> parallelize_module(model, mesh, {"layers.*.mlp.experts": ExpertTensorParallel()})
    """

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True

    def __post_init__(self):
        name = "ExpertTensorParallel"
        self.input_layouts = _token_layout_argument(self.input_layouts, "input_layouts", name)
        self.output_layouts = _token_layout_argument(self.output_layouts, "output_layouts", name, (*_TOKENS, Partial()))
        self.use_local_output = rules.flag(self.use_local_output, "use_local_output", name)

    def param_placements(self, module):
        shards = _hidden_dim_shards(module) or _HIDDEN_DIM_SHARDS
        return {name: rules.packed_shard(dim, parts) for name, (dim, parts) in shards.items()}

    def check(self, module, device_mesh, module_path=None):
        _check_expert_tensor_parallel(module, device_mesh, module_path)
        _require_replicated_dense_input(module, {"input_layouts": self.input_layouts}, "ExpertTensorParallel")

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        dense = not _takes_routing(module)
        forward = _dense_expert_tensor_parallel_forward if dense else _expert_tensor_parallel_forward
        return _apply_expert_style(
            self, "ExpertTensorParallel", module, device_mesh, src_data_rank, forward,
            input_layouts=self.input_layouts, output_layouts=self.output_layouts,
        )


def _apply_expert_style(style, name: str, module: nn.Module, device_mesh, src_data_rank, forward, **layouts):
    """Both expert styles' ``apply_to``: distribute the style's parameter placements, then run
    ``forward`` (bound to the mesh, ``layouts`` and ``use_local_output``) as the module's forward."""
    distribute_parameters(module, style.param_placements(module), device_mesh, src_data_rank)
    replace_forward(
        module, forward, inner=module.forward, mesh=device_mesh, use_local_output=style.use_local_output, **layouts
    )
    rules.mark_prepared(module, rules.BOTH_STAGES, name)
    return module


# ---------------------------------------------------------------------------- routing summary


@dataclass(frozen=True)
class Routing:
    """Token copies this rank sent to (``sent[r]``) and received from (``received[r]``) each
    rank in the last forward of one :class:`ExpertParallel` module.

    Example::

        >>> Routing(sent=(3, 5), received=(3, 1)).received_total
        4
    """

    sent: tuple[int, ...]
    received: tuple[int, ...]

    @property
    def received_total(self) -> int:
        """Token copies this rank's experts computed."""
        return sum(self.received)


def routing_summary(model: nn.Module) -> dict[str, Routing]:
    """``{path: Routing}`` for every :class:`ExpertParallel` module that has run a forward.

    Local to this rank (no communication): gather it yourself for a table of every rank.

    Example::

        >>> routing_summary(nn.Linear(2, 2))
        {}
    """
    states = ((path, state_of(m)) for path, m in model.named_modules())
    return {path: state.route for path, state in states if state is not None and state.route is not None}

