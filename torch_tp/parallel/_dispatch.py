"""Token dispatch for expert parallelism: every token copy travels to the rank that owns its expert.

=================================  =========================================================
step                               how
=================================  =========================================================
count copies per expert            ``bincount`` of the router's ``top_k_index`` (``[tokens, k]``)
exchange counts                    ``all_to_all_single`` of ``[E]`` int64 counts, equal splits (plus
                                   the routing's agreement digest, one int64 per destination)
split sizes (host)                 ``.tolist()``: data dependent, the one host sync per layer
send copies, sorted by expert      ``all_to_all_single_autograd`` with variable splits
run the local experts              the caller's function on ``[received, H]`` rows
send results back                  the inverse ``all_to_all_single_autograd``
weight and sum the k copies        ``[tokens, k, H] * top_k_weights`` summed over k
=================================  =========================================================

Dropless: nothing is capped or dropped, so the result is the single-process one. Experts are
laid out contiguously: rank ``r`` owns experts ``[r * E_local, (r + 1) * E_local)``, which is
``Shard(0)`` of the ``[E, ...]`` expert weights. Backward runs the same two all-to-alls in
reverse (the routing is kept from the forward). :class:`Route` records each step's split
sizes, which :func:`torch_tp.parallel.experts.routing_summary` reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup

__all__ = ["Route", "plan_route", "dispatch", "combine"]


@dataclass(frozen=True)
class Route:
    """Where this rank's token copies went in one forward, and what came back.

    ``order`` sorts the ``tokens * k`` copies by expert (so by owning rank); ``sent[r]`` copies
    went to rank ``r``; ``received[r]`` came from rank ``r``; ``local_expert`` is the local
    expert index of every received row.
    """

    order: torch.Tensor
    sent: tuple[int, ...]
    received: tuple[int, ...]
    local_expert: torch.Tensor


def plan_route(
    top_k_index: torch.Tensor | None,
    num_experts: int,
    group: ProcessGroup,
    world: int,
    *,
    digest: int | None = None,
    settle: Callable[[list[int]], None] | None = None,
    device: torch.device | None = None,
) -> Route:
    """Exchange per-expert counts and work out every split size (one small all-to-all).

    With ``digest`` (this rank's agreement digest, :mod:`torch_tp._agreement`) each rank also
    sends it to every rank, one more int64 beside the counts, and ``settle(digests)`` (every
    rank's, in group order: the same list everywhere) returns or raises on every rank before
    any split size is used. ``top_k_index=None``: this rank refused its routing; it sends zero
    counts (on ``device``) so the exchange completes, and ``settle`` raises.
    """
    if top_k_index is None:
        per_expert = torch.zeros(num_experts, dtype=torch.int64, device=device)
    else:
        per_expert = torch.bincount(top_k_index.reshape(-1), minlength=num_experts)
    send = per_expert.view(world, num_experts // world)  # [destination rank, its local expert]
    if digest is not None:
        send = torch.cat([send, send.new_full((world, 1), digest)], dim=1)
    incoming = funcol.wait_tensor(funcol.all_to_all_single(send.reshape(-1), None, None, group))
    incoming = incoming.view(world, -1)  # [source rank, local expert (+ its digest)]
    if digest is not None:
        rows = incoming.tolist()  # the one host read of the exchange: counts and digests together
        settle([row[-1] for row in rows])
        incoming = incoming[:, :-1]
        received = [sum(row[:-1]) for row in rows]
    else:
        received = incoming.sum(1).tolist()
    assert top_k_index is not None, "settle raises on a rank that refused its routing"
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sent = per_expert.view(world, -1).sum(1).tolist()
    local_ids = torch.arange(num_experts // world, device=flat.device).repeat(world)
    local_expert = local_ids.repeat_interleave(incoming.reshape(-1), output_size=sum(received))  # sized on the host: no second sync
    return Route(order, tuple(sent), tuple(received), local_expert)


def dispatch(hidden_states: torch.Tensor, route: Route, top_k: int, group: ProcessGroup) -> torch.Tensor:
    """The copies of this rank's tokens, sorted by expert, sent to the experts' owners."""
    copies = hidden_states[route.order // top_k]
    return _all_to_all(copies, route.received, route.sent, group)


def combine(
    expert_out: torch.Tensor, route: Route, top_k_weights: torch.Tensor, group: ProcessGroup
) -> torch.Tensor:
    """Send the experts' results home, restore token order, weight and sum the ``k`` copies."""
    back = _all_to_all(expert_out, route.sent, route.received, group)
    copies = back[torch.argsort(route.order)]  # copy i of the flattened [tokens, k] assignment
    tokens, top_k = top_k_weights.shape
    weighted = copies.view(tokens, top_k, copies.shape[-1]) * top_k_weights.unsqueeze(-1).to(copies.dtype)
    return weighted.sum(1)


def _all_to_all(rows: torch.Tensor, output_splits, input_splits, group: ProcessGroup) -> torch.Tensor:
    out = funcol.all_to_all_single_autograd(rows, list(output_splits), list(input_splits), group)
    return funcol.wait_tensor(out)
