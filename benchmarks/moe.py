"""Mixture-of-experts parallelism: expert parallel vs expert-tensor parallel vs replicated experts.

Command (spawns gloo CPU ranks, world size 2 then 4, and prints its tables)::

    python3 benchmarks/moe.py                      # dim 128, 8 experts, top-2, 256 tokens, 30 rounds
    python3 benchmarks/moe.py --quick              # tiny sizes, few rounds (smoke test)
    python3 benchmarks/moe.py --top-k 1 --experts 16 --tokens 512   # other sizes
    python3 benchmarks/moe.py --sequence-parallel  # the TP+SP plans (sequence-sharded between blocks)
    python3 benchmarks/moe.py --world-sizes 2      # one world size
    torchrun --nproc-per-node 4 benchmarks/moe.py  # the launcher's ranks, once

Every variant parallelizes a copy of the same zoo decoder,
:class:`torch_tp.models.moe.MoETransformer` (Llama attention, an MoE block of top-k routed
SwiGLU experts in every layer), with :func:`torch_tp.models.moe.tensor_parallel_plan`:
attention, embedding and head are tensor parallel alike in all three, only the experts differ:

``EP``
    ``experts="expert"``: :class:`~torch_tp.parallel.ExpertParallel`, whole experts per rank
    (``Shard(0)`` of the ``[E, ...]`` weights); each rank sends its ``1/world`` of the tokens
    to the experts' owners with an all-to-all, gets the results back with another and
    gathers the tokens again.
``expert-TP``
    ``experts="tensor"``: :class:`~torch_tp.parallel.ExpertTensorParallel`, every expert
    split on its hidden dim; every rank runs every token through its slice; one all-reduce.
``replicated``
    the ``experts="expert"`` plan without its ``layers.*.feed_forward.experts`` entry: the
    experts stay whole on every rank, and every rank runs every token through them (the
    block still prepares its input: under ``--sequence-parallel`` it gathers the sequence).

The step is ``cross_entropy(model(tokens), targets) + 0.01 * model.aux_loss()`` and its
backward (gradients cleared first; no optimizer step). Before anything is measured, each
variant's loss and every parameter gradient are checked against the single-process model
(``assert_close``, float32 tolerances); the script fails rather than time a wrong model.

Columns of the main table (one row per world size and variant):

``world``            number of ranks.
``variant``          see above.
``f+b comms``        collectives of one step (forward + backward), counted with
                     ``CommDebugMode``: ``A2A`` all_to_all_single, ``AR`` all_reduce, ``AG``
                     all_gather_into_tensor, ``RS`` reduce_scatter_tensor.
``f+b KiB``          bytes of the tensors a rank hands to those collectives (the input side,
                     as in the other benchmarks), the most any rank handed.
``sent KiB``         bytes a rank sends to the other ranks, the most any rank sent: for an
                     all-to-all, the rows it routes to other ranks (exact, from the split
                     sizes); for the others the ring algorithm's share of the input:
                     all-reduce ``2(w-1)/w``, all-gather ``w-1``, reduce-scatter ``(w-1)/w``.
``MoE comms``, ``MoE KiB``, ``MoE sent KiB``   the same for the collectives issued by the MoE
                     blocks: in the forward while a block runs (its input/output hooks
                     included), in the backward between the arrival of the block output's
                     gradient and the completion of its input's. The rest (attention,
                     embedding, head) is the same plan in every variant, and the same bytes.
``param KiB``        parameter bytes a rank holds (local shards of DTensor parameters).
``expert KiB``       the same for the experts' weights only (``*.experts.*``).
``loss Δ``, ``grads max Δ``   largest absolute difference from the single-process model's
                     loss and parameter gradients (checked, see above).
``step ms``          median wall time of the step on rank 0. Warm-up rounds first; then each
                     round runs the three variants once, in an order rotated every round;
                     every rank runs the same steps and a barrier precedes each timed step;
                     GC is off.
``p25-p75``          interquartile range of those wall times.
``CPU ms``           median CPU time of rank 0's main thread over the same steps (compute
                     plus Python/dispatch cost, without time spent waiting for other ranks).

The second table is the EP variant's routing (from :func:`torch_tp.parallel.routing_summary`
after the checked step): token copies each rank's experts computed in each MoE layer, the even
share ``tokens * top_k / world``, and the busiest rank's load over that share. (expert-TP runs
all ``tokens * top_k`` copies on every rank, at ``1/world`` of each expert's width; replicated
runs them all at full width.)

The third puts ``MoE sent KiB`` beside a model of it: per MoE layer ``(w-1)/w * T*H*b`` times a
coefficient per variant (``T`` tokens, ``H`` dim, ``b`` bytes per element, ``k`` top-k, ``w``
ranks; see ``FORMULAS``) plus the small terms of the routing weights and expert counts, for
uniform routing. expert-TP and replicated match it exactly; EP's measured bytes follow the
actual routing. Last, the script says which variant won on each measure at each world size
(fewest MoE bytes sent, least expert memory, fastest step, noting a lead within the quartiles),
and why, from the model and the measured numbers.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import textwrap
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from torch_tp import parallelize_module
from torch_tp.launch import rank_device
from torch_tp.models.llama import ModelArgs
from torch_tp.models.moe import MoEArgs, MoETransformer, tensor_parallel_plan
from torch_tp.parallel import routing_summary
from torch_tp.testing import TOL, assert_params_and_grads_match, comm_counts

# _driver.py and _measure.py are next to this script, whose directory running it (python3 or
# torchrun) puts first on sys.path; spawned ranks inherit sys.path.
from _driver import RunConfig, benchmark_arguments, finish_arguments, markdown_table, report_header  # noqa: E402
from _driver import require_for_each_world, run_worlds, world_sizes  # noqa: E402
from _measure import CollectiveBytesMode, local_parameter_bytes, median_ms, tensor_bytes, time_interleaved

# ------------------------------------------------------------------------ configuration

VARIANTS = ("EP", "expert-TP", "replicated")
EXPERTS_KEY = "layers.*.feed_forward.experts"
AUX = 0.01  # weight of the load-balancing loss in the step's loss
N_HEADS, VOCAB = 4, 256


@dataclass(frozen=True)
class Sizes:
    """Model and batch sizes of one run (``--quick`` or the defaults, then the options)."""

    dim: int
    layers: int
    experts: int
    top_k: int
    expert_hidden: int
    tokens: int  # per step: one sequence of this many tokens, the same on every rank


DEFAULT = Sizes(dim=128, layers=2, experts=8, top_k=2, expert_hidden=256, tokens=256)
QUICK = Sizes(dim=32, layers=2, experts=8, top_k=2, expert_hidden=32, tokens=32)


@dataclass(frozen=True)
class Config(RunConfig):
    sizes: Sizes
    sequence_parallel: bool

    def model_args(self) -> ModelArgs:
        s = self.sizes
        return ModelArgs(dim=s.dim, n_layers=s.layers, n_heads=N_HEADS, vocab_size=VOCAB, max_seq_len=s.tokens)

    def moe_args(self) -> MoEArgs:
        s = self.sizes
        return MoEArgs(num_experts=s.experts, top_k=s.top_k, expert_hidden=s.expert_hidden)


def plan_for(variant: str, moe: MoEArgs, sequence_parallel: bool) -> dict:
    """The zoo plan of ``variant``; ``replicated`` drops the experts' entry of the EP plan."""
    if variant == "replicated":
        plan = tensor_parallel_plan(moe, experts="expert", sequence_parallel=sequence_parallel)
        return {key: style for key, style in plan.items() if key != EXPERTS_KEY}
    experts = {"EP": "expert", "expert-TP": "tensor"}[variant]
    return tensor_parallel_plan(moe, experts=experts, sequence_parallel=sequence_parallel)


def batch(config: Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, ``[1, tokens]`` each (seeded: the same on every rank)."""
    ids = torch.randint(0, VOCAB, (1, config.sizes.tokens + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


# --------------------------------------------------------------------------- one step


def step(model: MoETransformer, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One training step's compute, gradients cleared first; returns the (detached) loss."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + AUX * model.aux_loss()
    loss.backward()
    return loss.detach()


def gradient_difference(model: MoETransformer, reference: MoETransformer) -> float:
    """Largest |Δ| of any parameter gradient (DTensor gradients as full tensors)."""
    worst = 0.0
    for (_, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (grad - ref.grad).abs().max().item())
    return worst


def check_against_reference(models: dict[str, MoETransformer], reference: MoETransformer,
                            tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, dict]:
    """Every variant's loss and gradients equal the single-process model's; else AssertionError."""
    ref_loss = step(reference, tokens, targets)
    checks = {}
    for variant, model in models.items():
        loss = step(model, tokens, targets)
        torch.testing.assert_close(loss, ref_loss, **TOL,
                                   msg=lambda m, v=variant: f"{v}: loss differs from the single-process model: {m}")
        assert_params_and_grads_match(model, reference, **TOL, params=False, what=f"{variant} vs one process:")
        checks[variant] = {"loss_diff": (loss - ref_loss).abs().item(),
                           "grads_diff": gradient_difference(model, reference)}
    return checks


# ------------------------------------------------------------------------ bytes moved


def sent_by_this_rank(name: str, args: tuple, world: int, rank: int) -> int:
    """Bytes the collective ``name`` (called with ``args``) sends from this rank to the others.

    All-to-all: the rows routed to other ranks (its split sizes). The rest: the ring
    algorithm's share of the input tensor.
    """
    size = tensor_bytes(args[0])
    if name == "all_to_all_single":
        splits = args[2]  # (input, output_split_sizes, input_split_sizes, group_name)
        if not splits:
            return size * (world - 1) // world
        row_bytes = size // max(sum(splits), 1)
        return row_bytes * (sum(splits) - splits[rank])
    if name == "all_reduce":
        return 2 * size * (world - 1) // world
    if name == "all_gather_into_tensor":
        return size * (world - 1)
    if name == "reduce_scatter_tensor":
        return size * (world - 1) // world
    raise ValueError(f"no byte model for collective {name!r}: add one to sent_by_this_rank")


class ScopedBytesMode(CollectiveBytesMode):
    """Records every collective with its input and sent bytes, and whether an MoE block issued it."""

    def __init__(self, world: int, rank: int) -> None:
        super().__init__()
        self.world, self.rank = world, rank
        self.in_moe = 0  # > 0 while an MoE block runs its forward or its backward
        self.records: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = comm_counts(self)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        after = comm_counts(self)
        for name in (n for n in after if after[n] != before.get(n, 0)):  # CommDebugMode counted it
            self.records.append({
                "name": name,
                "input": tensor_bytes(args[0]),
                "sent": sent_by_this_rank(name, args, self.world, self.rank),
                "moe": self.in_moe > 0,
            })
        return out


@contextmanager
def moe_scopes(model: MoETransformer, mode: ScopedBytesMode) -> Iterator[None]:
    """Mark ``mode.in_moe`` while any MoE block runs, forward and backward.

    Forward: from a pre-hook that runs before the plan's input hook to a hook that runs after
    its output hook. Backward: from the moment the block output's gradient is ready (a tensor
    hook on the output) to the moment its input's gradient is complete (a tensor hook on the
    input; the input is the norm's output, which only the block reads).
    """

    def enter(*_):
        mode.in_moe += 1

    def leave(*_):
        mode.in_moe -= 1

    def pre_hook(module, args):
        enter()
        if isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(leave)

    def post_hook(module, args, output):
        leave()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(enter)

    handles = []
    for layer in model.layers:
        block = layer.feed_forward
        handles.append(block.register_forward_pre_hook(pre_hook, prepend=True))
        handles.append(block.register_forward_hook(post_hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def measure_communication(model: MoETransformer, run_step: Callable[[], object]) -> dict:
    """Collectives of one step: counts, input and sent bytes, in total and in the MoE blocks."""
    mode = ScopedBytesMode(dist.get_world_size(), dist.get_rank())
    with warnings.catch_warnings():
        # CommDebugMode's module tracker installs full backward hooks; token ids need no gradient
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with moe_scopes(model, mode), mode:
            run_step()
    if mode.in_moe != 0:
        raise RuntimeError(f"MoE scope left unbalanced ({mode.in_moe}): the block hooks did not pair up")
    summary = {}
    for part, records in (("total", mode.records), ("moe", [r for r in mode.records if r["moe"]])):
        counts: dict[str, int] = {}
        for record in records:
            counts[record["name"]] = counts.get(record["name"], 0) + 1
        summary[part] = {
            "counts": counts,
            "input": sum(r["input"] for r in records),
            "sent": sum(r["sent"] for r in records),
        }
    return summary


def across_ranks(value):
    """``value`` of every rank, rank 0 first."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def expert_parameter_bytes(model: MoETransformer) -> int:
    """Bytes of the experts' weights this rank holds (local shards)."""
    return sum(
        tensor_bytes(p.to_local() if isinstance(p, DTensor) else p)
        for name, p in model.named_parameters() if ".experts." in name
    )


# ----------------------------------------------------------------------- per-rank driver


def measure(config: Config, mesh: DeviceMesh) -> list[dict]:
    """One row per variant on this world size (every rank computes them)."""
    device = rank_device()
    world = dist.get_world_size()
    moe = config.moe_args()
    torch.manual_seed(0)
    reference = MoETransformer(config.model_args(), moe).to(device)
    models = {
        variant: parallelize_module(copy.deepcopy(reference), mesh, plan_for(variant, moe, config.sequence_parallel))
        for variant in VARIANTS
    }
    for model in (reference, *models.values()):
        model.train()
    tokens, targets = batch(config, device)
    checks = check_against_reference(models, reference, tokens, targets)
    # routing of the checked step (the weights do not change: no optimizer step, same batch)
    routing = {path: route.received_total for path, route in routing_summary(models["EP"]).items()}
    routing = across_ranks(routing)

    steps = {variant: (lambda m=model: step(m, tokens, targets)) for variant, model in models.items()}
    comms = {variant: across_ranks(measure_communication(models[variant], steps[variant])) for variant in VARIANTS}
    times = time_interleaved(steps, config.iters, config.warmup)

    rows = []
    for variant, model in models.items():
        per_rank = comms[variant]
        for part in ("total", "moe"):  # every rank joins every collective: the same counts everywhere
            if any(r[part]["counts"] != per_rank[0][part]["counts"] for r in per_rank):
                raise RuntimeError(f"{variant}: the ranks counted different collectives: {per_rank}")
        rows.append({
            "world": world,
            "variant": variant,
            **{f"{part}_{key}": (per_rank[0][part]["counts"] if key == "counts"
                                 else max(r[part][key] for r in per_rank))
               for part in ("total", "moe") for key in ("counts", "input", "sent")},
            "param_bytes": max(across_ranks(local_parameter_bytes(model))),
            "expert_bytes": max(across_ranks(expert_parameter_bytes(model))),
            "expert_bytes_whole": sum(p.nbytes for n, p in reference.named_parameters() if ".experts." in n),
            **checks[variant],
            "wall_s": [wall for wall, _ in times[variant]],
            "cpu_s": [cpu for _, cpu in times[variant]],
        })
    rows[0]["routing"] = {path: [r[path] for r in routing] for path in sorted(routing[0])}
    return rows


def rank_main(config: Config) -> None:
    """Entry point on every rank: measure every variant, rank 0 writes the rows as JSON."""
    world = dist.get_world_size()
    mesh = init_device_mesh(rank_device().type, (world,), mesh_dim_names=("tp",))["tp"]
    rows = measure(config, mesh)
    if dist.get_rank() == 0:
        with open(config.result_path, "w") as f:
            json.dump(rows, f)


# ------------------------------------------------------------------------------ report

COLUMNS = ("world", "variant", "f+b comms", "f+b KiB", "sent KiB", "MoE comms", "MoE KiB", "MoE sent KiB",
           "param KiB", "expert KiB", "loss Δ", "grads max Δ", "step ms", "p25-p75", "CPU ms")
ROUTING_COLUMNS = ("world", "MoE layer", "EP copies per rank", "even share", "busiest/even")
MODEL_COLUMNS = ("world", "variant", "MoE sent KiB", "model KiB", "per MoE layer")
ABBREVIATIONS = {"all_to_all_single": "A2A", "all_reduce": "AR", "all_gather_into_tensor": "AG",
                 "reduce_scatter_tensor": "RS"}


def format_counts(counts: dict[str, int]) -> str:
    """``{"all_to_all_single": 10, "all_gather_into_tensor": 4}`` -> ``"4AG+10A2A"``."""
    parts = [f"{n}{ABBREVIATIONS.get(name, name)}" for name, n in sorted(counts.items()) if n]
    return "+".join(parts) or "0"


def kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def table_cells(row: dict) -> tuple[str, ...]:
    q1, _, q3 = statistics.quantiles(row["wall_s"], n=4)
    return (
        str(row["world"]), row["variant"],
        format_counts(row["total_counts"]), kib(row["total_input"]), kib(row["total_sent"]),
        format_counts(row["moe_counts"]), kib(row["moe_input"]), kib(row["moe_sent"]),
        kib(row["param_bytes"]), kib(row["expert_bytes"]),
        f"{row['loss_diff']:.1e}", f"{row['grads_diff']:.1e}",
        f"{median_ms(row):.2f}", f"{q1 * 1e3:.2f}-{q3 * 1e3:.2f}", f"{median_ms(row, 'cpu_s'):.2f}",
    )


def routing_cells(rows: list[dict], sizes: Sizes) -> list[tuple[str, ...]]:
    cells = []
    for row in rows:
        for path, per_rank in row.get("routing", {}).items():
            even = sizes.tokens * sizes.top_k / row["world"]
            cells.append((str(row["world"]), path.removesuffix(".feed_forward.experts"),
                          "/".join(str(n) for n in per_rank), f"{even:g}", f"{max(per_rank) / even:.2f}"))
    return cells


# Bytes a rank sends per MoE layer and step (forward + backward), in units of (w-1)/w * T*H*b, for
# uniform routing and ring collectives. TP (tokens replicated between blocks):
#   EP          2 all-to-alls each way of the T*k/w copies a rank routes (4k/w), the gather of its
#               T/w tokens back and of their gradient (2 all-gathers: 2)
#   expert-TP   all-reduce of the [T, H] partial sums forward and of the token gradient backward (4)
#   replicated  nothing
# TP+SP (sequence-sharded between blocks) adds the block's own sequence gather (forward) and the
# gather of the output gradient's shards (backward); expert-TP reduce-scatters its output instead
# of all-reducing it, and still all-reduces the token gradient:
#   EP 4k/w + 4; expert-TP 1 + 1 + 1 + 2 = 5; replicated 2.
# Small terms, in bytes: EP's per-expert counts (E int64, forward) and the gather of the routing
# weights' gradient (T/w * k floats); expert-TP's all-reduce of that gradient (T * k floats).
FORMULAS = {
    # variant: (TP coefficient, TP+SP coefficient, as printed)
    "EP": (lambda k, w: 4 * k / w + 2, lambda k, w: 4 * k / w + 4, "4k/w + 2", "4k/w + 4"),
    "expert-TP": (lambda k, w: 4, lambda k, w: 5, "4", "5"),
    "replicated": (lambda k, w: 0, lambda k, w: 2, "0", "2"),
}


def modelled_moe_sent(variant: str, world: int, sizes: Sizes, sequence_parallel: bool, element: int = 4) -> float:
    """Bytes a rank sends in the MoE blocks per step under the model above (every layer)."""
    t, h, k, e, w = sizes.tokens, sizes.dim, sizes.top_k, sizes.experts, world
    share = (w - 1) / w
    tp, sp, *_ = FORMULAS[variant]
    per_layer = share * t * h * element * (sp if sequence_parallel else tp)(k, w)
    if variant == "EP":
        per_layer += share * e * 8 + (w - 1) * (t // w) * k * element
    elif variant == "expert-TP":
        per_layer += 2 * share * t * k * element
    return per_layer * sizes.layers


def formula_text(variant: str, sequence_parallel: bool) -> str:
    return f"(w-1)/w * T*H*b * ({FORMULAS[variant][3 if sequence_parallel else 2]})"


def model_cells(rows: list[dict], sizes: Sizes, sequence_parallel: bool) -> list[tuple[str, ...]]:
    return [
        (str(row["world"]), row["variant"], kib(row["moe_sent"]),
         kib(modelled_moe_sent(row["variant"], row["world"], sizes, sequence_parallel)),
         formula_text(row["variant"], sequence_parallel))
        for row in rows
    ]


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "inf"


def listing(values: dict[str, float], unit: str, fmt: Callable[[float], str]) -> str:
    return ", ".join(f"{variant} {fmt(value)}{unit}" for variant, value in values.items())


def fastest(by: dict[str, dict]) -> tuple[str, str]:
    """The variant with the lowest median step, and a note when its lead is within the quartiles."""
    ranked = sorted(by, key=lambda v: median_ms(by[v]))
    best, runner_up = ranked[0], ranked[1]
    best_q3 = statistics.quantiles(by[best]["wall_s"], n=4)[2]
    runner_q1 = statistics.quantiles(by[runner_up]["wall_s"], n=4)[0]
    clear = "" if best_q3 < runner_q1 else f"; its p75 overlaps {runner_up}'s p25: not a clear win"
    return best, clear


def paragraph(text: str, indent: str = "") -> list[str]:
    return [*textwrap.wrap(text, width=100, subsequent_indent=indent), ""]


def verdicts(rows: list[dict], sizes: Sizes, sequence_parallel: bool) -> list[str]:
    """Which variant won on each measure at each world size, and the reasoning, from the numbers."""
    t, h, k, e, i = sizes.tokens, sizes.dim, sizes.top_k, sizes.experts, sizes.expert_hidden
    worlds = sorted({row["world"] for row in rows})
    lines = ["When each wins (measured here, then why):", ""]
    for world in worlds:
        by = {row["variant"]: row for row in rows if row["world"] == world}
        sent = {v: r["moe_sent"] for v, r in by.items()}
        memory = {v: r["expert_bytes"] for v, r in by.items()}
        fewest_sent = min(sent, key=sent.get)
        sharded = min(("EP", "expert-TP"), key=sent.get)
        least_memory = " and ".join(sorted(v for v in memory if memory[v] == min(memory.values())))
        best, note = fastest(by)
        lines += paragraph(
            f"- world {world}: fewest bytes sent by the MoE blocks: {fewest_sent} "
            f"({listing(sent, ' KiB', kib)}); of the two that shard the experts: {sharded}. "
            f"Least expert memory per rank: {least_memory} ({listing(memory, ' KiB', kib)}). "
            f"Fastest step: {best} ({listing({v: median_ms(r) for v, r in by.items()}, ' ms', '{:.2f}'.format)}"
            f"{note}).", indent="  ",
        )
    predicted, measured = [], []
    for world in worlds:
        by = {row["variant"]: row for row in rows if row["world"] == world}
        model = {v: modelled_moe_sent(v, world, sizes, sequence_parallel) for v in ("EP", "expert-TP")}
        predicted.append(f"{ratio(model['EP'], model['expert-TP'])} at world {world}")
        measured.append(f"{ratio(by['EP']['moe_sent'], by['expert-TP']['moe_sent'])} at world {world}")
    ep, tp = (FORMULAS[v][3 if sequence_parallel else 2] for v in ("EP", "expert-TP"))
    crossover = "k < w/4" if sequence_parallel else "k < w/2"
    lines += paragraph(
        f"EP vs expert-TP. Per MoE layer and step a rank sends about (w-1)/w * T*H*b * ({ep}) with EP: "
        f"two all-to-alls each way of the T*k/w token copies it routes, plus gathering the tokens back "
        f"(and their gradient) because the router and the rest of the block see every token; and "
        f"(w-1)/w * T*H*b * ({tp}) with expert-TP: one all-reduce of [T, H] forward and one of the token "
        f"gradient backward{' (and the block' + chr(39) + 's sequence gathers)' if sequence_parallel else ''}. "
        f"So EP sends fewer bytes only when {crossover}: many ranks, few experts per token. Here k={k}: "
        f"EP / expert-TP bytes modelled {', '.join(predicted)}, measured {', '.join(measured)} (the "
        f"measured EP bytes follow the actual routing). Neither moves expert weights, and both hold 1/w "
        f"of them. EP's all-to-all split sizes depend on the routing (one host sync per layer) and its "
        f"busiest rank sets the pace (the routing table: up to {max_busiest(rows, sizes):.2f}x the even "
        f"share here, and skewed routing makes it worse); expert-TP keeps every rank's compute even "
        f"whatever the routing (every rank runs every token copy on 1/w of each expert's hidden size "
        f"{i}), at the price of thinner matmuls and an all-reduce that does not shrink with k."
    )
    whole = rows[0]["expert_bytes_whole"]
    ep_sent = {row["world"]: row["moe_sent"] for row in rows if row["variant"] == "EP"}
    dp = ", ".join(f"{kib(2 * (w - 1) / w * whole)} KiB at world {w} (EP sent {kib(ep_sent[w])} KiB in this run)"
                   for w in worlds)
    gather = (" (under sequence parallelism the block still gathers the sequence and the output gradient: "
              "the bytes in its row)") if sequence_parallel else ""
    lines += paragraph(
        f"Replicated experts send nothing for the experts{gather}. Every rank holds all {e} experts "
        f"({kib(whole)} KiB of weights, w times EP's or expert-TP's share) and computes all T*k = {t * k} "
        f"token copies at full width, w times the expert FLOPs of the other two. Here the ranks share "
        f"one batch (tensor parallelism), so every rank computes the same expert gradients and nothing "
        f"is reduced. They win when the experts fit on every rank and collective latency costs more than "
        f"the redundant compute (small experts, slow links such as gloo on CPU; the step times above say "
        f"whether that held here). Were the ranks to hold different tokens instead (data parallelism), "
        f"replicated experts would all-reduce their gradients every step, 2(w-1)/w of {kib(whole)} KiB: "
        f"{dp}. That is where EP wins: the tokens a step routes (T*k*H = {t * k * h}) are small beside the "
        f"expert weights (E*3*H*I = {e * 3 * h * i}), the more so the more experts there are."
    )
    return lines


def max_busiest(rows: list[dict], sizes: Sizes) -> float:
    loads = [max(per_rank) * row["world"] / (sizes.tokens * sizes.top_k)
             for row in rows for per_rank in row.get("routing", {}).values()]
    return max(loads, default=float("nan"))


def format_report(rows: list[dict], options: argparse.Namespace, config: Config) -> str:
    s = config.sizes
    sp = config.sequence_parallel
    mode = "TP+SP (sequence-sharded between blocks)" if sp else "TP (replicated between blocks)"
    parts = [
        report_header(options),
        f"MoETransformer: dim {s.dim}, {s.layers} layers, {N_HEADS} heads, vocab {VOCAB}; {s.experts} experts "
        f"of hidden {s.expert_hidden}, top-{s.top_k}; {s.tokens} tokens per step; float32; {mode}; "
        f"step: (cross_entropy + {AUX} * aux_loss).backward(); bytes: the most any rank handed or sent",
        "",
        markdown_table(COLUMNS, [table_cells(row) for row in rows]),
        "",
        "EP routing: token copies each rank's experts computed (rank 0 first)",
        markdown_table(ROUTING_COLUMNS, routing_cells(rows, s)),
        "",
        "MoE bytes sent per rank and step, measured vs modelled (uniform routing, ring collectives, "
        "per MoE layer: formula + small terms, times the layers; b = 4 bytes)",
        markdown_table(MODEL_COLUMNS, model_cells(rows, s, sp)),
        "",
        *verdicts(rows, s, sp),
    ]
    return "\n".join(parts).rstrip()


# -------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_arguments(__file__, __doc__, iters=(30, 4), warmup=(3, 1), what="variant",
                                 quick="tiny sizes, few rounds", min_iters=2)  # quartiles need two samples
    for field, help_text in (
        ("dim", "model dim H"), ("layers", "decoder layers (each with an MoE block)"),
        ("experts", "experts E per MoE block (a multiple of every world size)"),
        ("top-k", "experts per token k"), ("expert-hidden", "hidden size I of each expert"),
        ("tokens", "tokens T per step (one sequence; a multiple of every world size)"),
    ):
        name = field.replace("-", "_")
        parser.add_argument(f"--{field}", type=int, default=None,
                            help=f"{help_text} (default {getattr(DEFAULT, name)}; {getattr(QUICK, name)} with --quick)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="the TP+SP plans: activations sequence-sharded between blocks")
    options = finish_arguments(parser, argv)
    base = QUICK if options.quick else DEFAULT
    options.sizes = Sizes(**{
        name: getattr(options, name) if getattr(options, name) is not None else getattr(base, name)
        for name in Sizes.__dataclass_fields__
    })
    s = options.sizes
    if not 1 <= s.top_k <= s.experts:
        parser.error(f"--top-k {s.top_k} must be in [1, --experts {s.experts}]")
    if s.dim % N_HEADS:
        parser.error(f"--dim {s.dim} must be a multiple of the {N_HEADS} heads")
    require_for_each_world(parser, world_sizes(options.world_sizes), lambda world: None if not (
        s.experts % world or s.tokens % world or s.expert_hidden % world) else (
        f"--experts ({s.experts}), --tokens ({s.tokens}) and --expert-hidden ({s.expert_hidden}) "
        f"must be multiples of it"))
    return options


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    config = Config(options.sizes, options.sequence_parallel, iters=options.iters, warmup=options.warmup)
    rows = run_worlds(rank_main, config, options.world_sizes, "EP, expert-TP, replicated experts")
    if rows:
        print(format_report(rows, options, config))


if __name__ == "__main__":
    main()
