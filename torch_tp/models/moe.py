"""A small mixture-of-experts decoder and its two parallel plans (expert or expert-tensor parallel).

The MoE block replaces the Llama feed-forward: a top-k router (``gate``), grouped experts
stored as 3-D parameters (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj``
``[E, H, I]``: transformers' Mixtral / Qwen3-MoE layout) and an optional shared expert that
every token goes through (DeepSeek-style). Each block records its load-balancing loss
(Switch Transformer's ``E * sum_e f_e * P_e``) as ``aux_loss``; :meth:`MoETransformer.aux_loss`
sums them.

:func:`tensor_parallel_plan` shards attention as the Llama plan does and the experts with
:class:`~torch_tp.parallel.ExpertParallel` (``experts="expert"``) or
:class:`~torch_tp.parallel.ExpertTensorParallel` (``experts="tensor"``); the router stays
replicated and sees every token, so the routing and the auxiliary loss are the
single-process ones.

Example::

    >>> model = MoETransformer(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64), MoEArgs(num_experts=4))
    >>> model(torch.zeros(2, 8, dtype=torch.long)).shape, model.aux_loss().shape
    (torch.Size([2, 8, 64]), torch.Size([]))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from torch_tp.models import llama
from torch_tp.models.llama import FeedForward, ModelArgs, Transformer
from torch_tp.parallel import (
    ColwiseParallel,
    ExpertParallel,
    ExpertTensorParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
)

__all__ = [
    "MoEArgs",
    "TopKRouter",
    "GroupedExperts",
    "MoE",
    "MoETransformer",
    "load_balancing_loss",
    "moe_block_plan",
    "tensor_parallel_plan",
]


@dataclass(frozen=True)
class MoEArgs:
    """Sizes of the MoE block: ``num_experts`` experts of hidden size ``expert_hidden``, each
    token routed to ``top_k`` of them; ``shared_expert_hidden > 0`` adds a shared expert.

    Example::

        >>> MoEArgs(num_experts=8, top_k=2).top_k
        2
    """

    num_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 32
    shared_expert_hidden: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")


class TopKRouter(nn.Module):
    """Linear router: ``(logits, top-k weights, top-k expert indices)`` per token (``[T, dim]``).

    Example::

        >>> logits, weights, index = TopKRouter(16, 4, top_k=2)(torch.randn(5, 16))
        >>> logits.shape, weights.shape, index.shape
        (torch.Size([5, 4]), torch.Size([5, 2]), torch.Size([5, 2]))
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool = True):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.randn(num_experts, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        weights, index = torch.topk(logits.softmax(dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(x.dtype), index


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as 3-D parameters, run on the tokens routed to them.

    ``forward(x [T, H], top_k_index [T, k], top_k_weights [T, k])`` returns, for each token,
    the weighted sum of its experts' outputs. The expert count comes from the parameters, so
    the module runs unchanged on a shard of its experts.

    Example::

        >>> experts = GroupedExperts(16, 24, num_experts=4)
        >>> experts(torch.randn(5, 16), torch.tensor([[0, 1]] * 5), torch.full((5, 2), 0.5)).shape
        torch.Size([5, 16])
    """

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * hidden, dim) / dim**0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, dim, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        top_k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        rows = x[order // top_k]
        outs = [
            self._expert(e, chunk) for e, chunk in enumerate(torch.split(rows, counts)) if counts[e]
        ]
        out = torch.cat(outs) if outs else rows.new_zeros(0, x.shape[1])
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(x).index_add(0, order // top_k, out * weights)

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])


def load_balancing_loss(router_logits: torch.Tensor, top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss ``E * sum_e f_e * P_e``: ``f_e`` the share of token
    copies routed to expert ``e``, ``P_e`` its mean router probability. 1.0 when balanced.

    Example::

        >>> load_balancing_loss(torch.zeros(4, 2), torch.tensor([[0], [1], [0], [1]]), 2)
        tensor(1.)
    """
    flat = top_k_index.reshape(-1)  # scatter_add, not bincount: a static shape, so it compiles
    share = router_logits.new_zeros(num_experts).scatter_add(0, flat, router_logits.new_ones(flat.shape))
    share = share / flat.numel()
    probability = router_logits.softmax(dim=-1).mean(0)
    return num_experts * (share * probability).sum()


class MoE(nn.Module):
    """Router + grouped experts (+ shared expert) on ``[batch, seq, dim]``; keeps ``aux_loss``.

    Example::

        >>> block = MoE(ModelArgs(dim=16), MoEArgs(num_experts=4, shared_expert_hidden=8))
        >>> block(torch.randn(2, 3, 16)).shape, block.aux_loss.shape
        (torch.Size([2, 3, 16]), torch.Size([]))
    """

    def __init__(self, args: ModelArgs, moe: MoEArgs):
        super().__init__()
        self.num_experts = moe.num_experts
        self.gate = TopKRouter(args.dim, moe.num_experts, moe.top_k, moe.norm_topk_prob)
        self.experts = GroupedExperts(args.dim, moe.expert_hidden, moe.num_experts)
        self.shared_expert = (
            FeedForward(dataclasses.replace(args, ffn_hidden=moe.shared_expert_hidden))
            if moe.shared_expert_hidden else None
        )
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        logits, weights, index = self.gate(tokens)
        self.aux_loss = load_balancing_loss(logits, index, self.num_experts)
        out = self.experts(tokens, index, weights).reshape(batch, seq, dim)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out


class MoETransformer(Transformer):
    """The Llama :class:`~torch_tp.models.llama.Transformer` with an :class:`MoE` block as every
    layer's ``feed_forward``.

    Example::

        >>> model = MoETransformer(ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=32), MoEArgs())
        >>> type(model.layers[1].feed_forward).__name__
        'MoE'
    """

    def __init__(self, args: ModelArgs, moe: MoEArgs):
        super().__init__(args)
        self.moe_args = moe
        for layer in self.layers:
            layer.feed_forward = MoE(args, moe)

    def aux_loss(self) -> torch.Tensor:
        """The sum of the layers' load-balancing losses from the last forward."""
        return sum(layer.feed_forward.aux_loss for layer in self.layers)


def _require_experts(experts: str) -> None:
    if experts not in ("expert", "tensor"):
        raise ValueError(
            f'experts={experts!r}: pass "expert" (ExpertParallel: whole experts per rank, tokens '
            f'dispatched by all-to-all) or "tensor" (ExpertTensorParallel: every expert split on its hidden dim)'
        )


def moe_block_plan(
    *, experts: str = "expert", sequence_parallel: bool = False, shared_expert: bool = False, prefix: str = ""
) -> dict[str, ParallelStyle]:
    """The plan for one :class:`MoE` block (keys relative to the block, or under ``prefix``).

    The block reads every token (gathered from sequence shards under sequence parallelism),
    so the router and its auxiliary loss are the single-process ones with a plain replicated
    router. ``experts="expert"``: :class:`~torch_tp.parallel.ExpertParallel`, the block's
    output is replicated (then split back onto sequence shards). ``experts="tensor"``:
    :class:`~torch_tp.parallel.ExpertTensorParallel` and the shared expert leave partial sums,
    reduced once for the block (an all-reduce, or a reduce-scatter under sequence parallelism).

    Example::

        >>> sorted(moe_block_plan(experts="tensor", shared_expert=True))
        ['', 'experts', 'shared_expert.w2', 'shared_expert.w[13]']
    """
    _require_experts(experts)
    between = Shard(1) if sequence_parallel else Replicate()
    partial = experts == "tensor"
    block_output = Partial() if partial else Replicate()
    plan: dict[str, ParallelStyle] = {
        "": PrepareModuleInputOutput(
            input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(block_output,), desired_output_layouts=(between,), use_local_output=True,
        ),
        "experts": (
            ExpertTensorParallel(output_layouts=Partial(), use_local_output=False) if partial else ExpertParallel()
        ),
    }
    if shared_expert:
        plan["shared_expert.w[13]"] = ColwiseParallel()
        plan["shared_expert.w2"] = (
            RowwiseParallel(output_layouts=Partial(), use_local_output=False) if partial else RowwiseParallel()
        )
    return {f"{prefix}{key}".rstrip("."): style for key, style in plan.items()}


def tensor_parallel_plan(
    moe: MoEArgs, *, experts: str = "expert", sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """torch_tp's plan for :class:`MoETransformer`: the Llama plan with :func:`moe_block_plan`
    in place of the dense feed-forward's entries.

    Example::

        >>> plan = tensor_parallel_plan(MoEArgs(), experts="expert")
        >>> plan["layers.*.feed_forward.experts"]
        ExpertParallel(input_layouts=Replicate(), use_local_output=True)
    """
    plan = llama.tensor_parallel_plan(sequence_parallel=sequence_parallel)
    plan = {key: style for key, style in plan.items() if not key.startswith("layers.*.feed_forward")}
    plan.update(moe_block_plan(
        experts=experts, sequence_parallel=sequence_parallel, shared_expert=moe.shared_expert_hidden > 0,
        prefix="layers.*.feed_forward.",
    ))
    return plan
