"""Mixture-of-experts styles: :class:`ExpertParallel` (experts spread over the ranks, tokens
travel to them) and :class:`ExpertTensorParallel` (every expert split on its hidden dim).

Both take a *grouped-experts* module, the layout of transformers' Mixtral / Qwen3-MoE experts
and of :class:`torch_tp.models.moe.GroupedExperts`:

* every parameter has a leading expert dim ``[E, ...]`` and the module has an int ``num_experts``;
* it is called as ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` and
  returns ``[T, H]``: for each token, the sum over its ``k`` experts of weight x expert(token).

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

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_tp._layouts import finish_output, redistribute_to, replace_forward, shard_sizes, to_dtensor
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
_ROUTE_ATTR = "_torch_tp_route"


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
    if set(shapes) != set(_HIDDEN_DIM_SHARDS) or getattr(module, "is_transposed", False) or _mismatched(shapes):
        raise rules.UnsupportedModuleError(
            f"{style} cannot split {where} (parameters {shapes}, is_transposed="
            f"{getattr(module, 'is_transposed', False)}): it takes gate_up_proj [E, 2I, H] and down_proj "
            f"[E, H, I] (transformers' Mixtral / Qwen3-MoE experts, torch_tp.models.moe.GroupedExperts). "
            f"Use ExpertParallel, which takes any grouped-experts module"
        )
    hidden, world = shapes["down_proj"][2], rules.mesh_size(device_mesh)
    if hidden < world:
        raise ValueError(
            f"{style} cannot split the expert hidden size {hidden} of {where} over {world} ranks; "
            f"use a smaller tensor-parallel mesh or ExpertParallel"
        )


def _mismatched(shapes: dict[str, tuple[int, ...]]) -> bool:
    gate_up, down = shapes["gate_up_proj"], shapes["down_proj"]
    return len(gate_up) != 3 or len(down) != 3 or gate_up[1] != 2 * down[2] or gate_up[2] != down[1]


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


def _tokens_layout(hidden_states: torch.Tensor, declared: Placement, style: str) -> Placement:
    if isinstance(hidden_states, DTensor):
        return _require_token_layout(hidden_states.placements[0], "input DTensor placements", style)
    return declared


@torch.compiler.disable  # split sizes are data dependent; the dense parts around still compile
def _expert_parallel_forward(
    module, hidden_states, top_k_index, top_k_weights, *, inner, mesh, input_layouts, use_local_output
):
    layout = _tokens_layout(hidden_states, input_layouts, "ExpertParallel")
    group, world = mesh.get_group(), mesh.size()
    tokens, index, weights = (_own_tokens(v, mesh, layout) for v in (hidden_states, top_k_index, top_k_weights))
    route = _dispatch.plan_route(index, module.num_experts, group, world)
    received = _dispatch.dispatch(tokens, route, index.shape[1], group)
    out = _dispatch.combine(_run_local_experts(module, inner, received, route.local_expert), route, weights, group)
    module.__dict__[_ROUTE_ATTR] = Routing(sent=route.sent, received=route.received)
    return _home(out, hidden_states, mesh, layout, use_local_output)


def _token_count(hidden_states: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> int | None:
    """The number of tokens over the group, for plain inputs holding each rank's own tokens.

    One small all-gather; the counts must follow ``torch.chunk`` (as sequence parallelism
    gives), the layout a ``Shard(0)`` DTensor of them has.
    """
    if layout != Shard(0) or isinstance(hidden_states, DTensor):
        return None
    counts = torch.tensor([hidden_states.shape[0]], device=hidden_states.device)
    counts = funcol.wait_tensor(funcol.all_gather_tensor(counts, 0, mesh.get_group())).tolist()
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
    layout = _tokens_layout(hidden_states, input_layouts, "ExpertTensorParallel")
    count = _token_count(hidden_states, mesh, layout)
    tokens, weights, index = (_all_tokens(v, mesh, layout, count) for v in (hidden_states, top_k_weights, top_k_index))
    with _local_parameters(module):
        partial = inner(tokens, index, weights)
    out = DTensor.from_local(partial, mesh, (Partial(),), run_check=False)
    return finish_output(redistribute_to(out, output_layouts), use_local_output)


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

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        return _apply_expert_style(
            self, "ExpertParallel", module, device_mesh, src_data_rank, _expert_parallel_forward,
            input_layouts=self.input_layouts,
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
        return {name: rules.packed_shard(dim, parts) for name, (dim, parts) in _HIDDEN_DIM_SHARDS.items()}

    def check(self, module, device_mesh, module_path=None):
        _check_expert_tensor_parallel(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        return _apply_expert_style(
            self, "ExpertTensorParallel", module, device_mesh, src_data_rank, _expert_tensor_parallel_forward,
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
    return {path: m.__dict__[_ROUTE_ATTR] for path, m in model.named_modules() if _ROUTE_ATTR in m.__dict__}

