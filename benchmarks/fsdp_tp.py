"""A Llama under tensor parallelism, FSDP2, and both (2-D): bytes per rank, bytes moved, step time.

Command (spawns 4 gloo CPU ranks and prints two tables)::

    python3 benchmarks/fsdp_tp.py            # dim 256, 4 layers, 10 timed rounds (~1-2 min)
    python3 benchmarks/fsdp_tp.py --quick    # dim 64, 2 layers, 3 rounds (the smoke test)

Under ``torchrun --nproc-per-node 4 benchmarks/fsdp_tp.py`` the launcher's ranks are used.

The zoo Llama (``torch_tp.models.llama``), trained with AdamW, on 4 ranks three ways:

``TP 1x4``      ``parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=True))``
                on a (dp 1, tp 4) mesh: every rank sees the whole batch.
``FSDP 4x1``    ``fully_shard_by_pattern(model, mesh, "layers.*")`` on a 1-D dp mesh of 4: each
                rank takes a quarter of the batch.
``2-D 2x2``     both on (dp 2, tp 2): TP, then FSDP2 over dp; each dp rank takes half the batch.

and, for context, ``1 process``: the single-process model on the whole batch, run by rank 0
alone while the other ranks wait (measured like the others; no prediction, no loss check).

Before anything is measured, each variant's step is checked against the single-process model
on the whole batch (the dp-averaged loss, ``assert_close`` at 1e-5); the script fails rather
than measure a wrong model.

Per-rank columns (the largest rank's; every rank holds the same here):

``params KiB``, ``predicted``   bytes of the parameters this rank holds, measured (local
                    shards), and what ``predict_placements`` / ``explain_plan`` says on a
                    ``meta`` model (they must be equal).
``grads KiB``       bytes of the gradients after one backward (local shards).
``AdamW KiB``       bytes of the optimizer state after one step (``exp_avg``, ``exp_avg_sq``, ``step``).
``sent KiB``        bytes this rank sends per training step (forward, backward and
                    ``optimizer.step()``), from every collective seen by a dispatch mode that
                    lets DTensor desugar its ops first, as ``CommDebugMode`` does (DTensor's
                    functional collectives, those DTensor issues inside an op, and FSDP2's
                    ``c10d`` calls alike), under a ring model: an all-gather sends
                    ``(g - 1) x`` its input, a reduce-scatter ``(g - 1) / g x`` its input, an
                    all-reduce ``2 (g - 1) / g x`` its tensor, ``g`` the group size.
``collectives``     how many of each (AG all-gather, RS reduce-scatter, AR all-reduce) per step.
                    Under TP, ``optimizer.step()`` all-reduces each replicated norm weight's
                    ``Partial`` gradient 3 times: AdamW uses the gradient 3 times (``lerp_``,
                    ``addcmul_`` of it with itself) and DTensor reduces it anew at each use.
``step ms``         median wall time of forward + backward + ``optimizer.step()`` on rank 0;
                    variants interleaved round by round, a barrier before each step.
``loss Δ``          |dp-averaged loss - the single-process loss| of the checked step.

The second table is activation checkpointing on the 2-D model: peak memory of one forward +
backward on rank 0, in total and its activations part, from torch's own tracker
(``torch.distributed._tools.mem_tracker.MemTracker``, which follows every tensor's storage and
classifies it: parameters, gradients, optimizer state, activations, temporaries), with no
checkpointing, with full recompute (``checkpoint_by_pattern(model, "layers.*")``) and with the
selective policy (``policy=save_collectives_and_matmuls``), and the collectives (and sent
bytes) of one forward + backward: full recompute re-runs the sequence-parallel all-gathers in
backward, the selective policy adds none. (Counting what autograd saves with
``saved_tensors_hooks`` would not do: checkpointing installs its own hooks, which hide what the
selective policy caches.)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from torch_tp import (
    checkpoint_by_pattern,
    explain_plan,
    fully_shard_by_pattern,
    parallelize_module,
    predict_placements,
    save_collectives_and_matmuls,
)
from torch_tp.launch import rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan

# _driver.py is next to this script, whose directory running it (python3 or torchrun) puts first
# on sys.path; spawned ranks inherit sys.path when they re-import it for ``__main__.rank_main``.
from _driver import RunConfig, markdown_table, parse_arguments, progress, report_header, run_world  # noqa: E402
from _measure import time_interleaved

# ------------------------------------------------------------------------ configuration

FULL = ModelArgs(dim=256, n_layers=4, n_heads=8, vocab_size=1024, ffn_hidden=688, max_seq_len=128)
QUICK = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, ffn_hidden=176, max_seq_len=32)
VARIANTS = {"TP 1x4": (1, 4), "FSDP 4x1": (4, 1), "2-D 2x2": (2, 2)}  # name: (dp, tp)
REFERENCE = "1 process"
AC_MODES = ("none", "full", "selective")
BATCH = 4
TOL = dict(rtol=1e-5, atol=1e-5)


@dataclass(frozen=True)
class Config(RunConfig):
    args: ModelArgs
    seq: int
    min_weight_size: int


# ------------------------------------------------------------------------- bytes sent


class SentBytes(TorchDispatchMode):
    """Counts every collective below it and the bytes this rank sends for it (ring model)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor desugar the op first (CommDebugMode's trick): the collectives it issues
            # inside an op (AdamW's update reducing a Partial gradient) then come back here.
            return NotImplemented
        kind = _collective_kind(func)
        if kind is not None:
            size, nbytes = _group_size_and_bytes(func, kind, args)
            self.counts[kind] += 1
            self.sent += {"AG": (size - 1) * nbytes, "RS": (size - 1) * nbytes // size,
                          "AR": 2 * (size - 1) * nbytes // size}[kind]
        return func(*args, **(kwargs or {}))


def _collective_kind(func) -> str | None:
    if func.namespace not in ("_c10d_functional", "c10d"):
        return None
    name = func._overloadpacket.__name__
    if "all_gather" in name or "allgather" in name:
        return "AG"
    if "reduce_scatter" in name:
        return "RS"
    if "all_reduce" in name or "allreduce" in name:
        return "AR"
    return None


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _group_size_and_bytes(func, kind: str, args: tuple) -> tuple[int, int]:
    """``(group size, bytes of the input)`` of a functional or a ``c10d`` collective."""
    if func.namespace == "_c10d_functional":  # (input, [reduce op,] [group_size,] group_name)
        group = args[-1]
        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(group)
        return group.size(), _nbytes(args[0])
    size = dist.ProcessGroup.unbox(args[1] if kind == "AR" else args[2]).size()  # the op's ProcessGroup argument
    if kind == "AR":  # allreduce_(tensors, group, reduce op, ...)
        return size, _nbytes(args[0])
    return size, _nbytes(args[1])  # _allgather_base_ / _reduce_scatter_base_(output, input, group, ...)


# ------------------------------------------------------------------------- one variant


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _batch(config: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, config.args.vocab_size, (BATCH, config.seq + 1), generator=gen)
    return tokens[:, :-1].to(rank_device()), tokens[:, 1:].to(rank_device())


class Variant:
    """The model of one (dp, tp) layout on this rank, its optimizer and its rows of the batch."""

    def __init__(self, config: Config, reference: torch.nn.Module, dp: int, tp: int, ac: str = "none"):
        self.config, self.dp = config, dp
        mesh = init_device_mesh(rank_device().type, (dp, tp), mesh_dim_names=("dp", "tp"))
        self.dp_group = mesh["dp"].get_group()
        self.model = copy.deepcopy(reference)
        plan = tensor_parallel_plan(sequence_parallel=True)
        with torch.device("meta"):
            blueprint = Transformer(config.args)
        if tp > 1:
            parallelize_module(self.model, mesh["tp"], plan)
        if ac != "none":
            checkpoint_by_pattern(self.model, "layers.*", policy=save_collectives_and_matmuls if ac == "selective" else None)
        if dp > 1:
            fsdp_mesh = mesh if tp > 1 else mesh["dp"]
            fully_shard_by_pattern(self.model, fsdp_mesh, "layers.*", min_weight_size=config.min_weight_size)
            report = predict_placements(blueprint, fsdp_mesh, plan if tp > 1 else None, "layers.*",
                                        min_weight_size=config.min_weight_size)
        else:
            report = explain_plan(blueprint, mesh["tp"], plan)
        self.predicted = max(report.bytes_per_rank())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        dp_rank = mesh["dp"].get_local_rank()
        self.rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)

    def loss(self, step: int) -> torch.Tensor:
        inputs, targets = _batch(self.config, step)
        logits = self.model(inputs[self.rows])
        return F.cross_entropy(logits.flatten(0, 1), targets[self.rows].flatten())

    def batch_loss(self, loss: torch.Tensor) -> float:
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.dp_group)
        return total.item() / self.dp

    def train_step(self, step: int = 0) -> None:
        self.loss(step).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def _peak_memory(variant: Variant) -> dict[str, int]:
    """Peak bytes of one forward + backward on this rank, by kind, from torch's ``MemTracker``
    (``torch.distributed._tools.mem_tracker``): ``total`` and the activations part."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(variant.model, variant.optimizer)
    with tracker:
        variant.loss(0).backward()
    variant.optimizer.zero_grad()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {"total": peak["Total"], "activations": next(v for k, v in peak.items() if str(k).endswith("ACT"))}


def _held_and_sent(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, train_step) -> dict:
    """This rank's bytes of gradients (after ``loss.backward()``), of the AdamW state (after the
    step), of the parameters, and the collectives of one more ``train_step``."""
    loss.backward()
    grads = _bytes(p.grad for p in model.parameters() if p.grad is not None)
    optimizer.step()
    state = _bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    optimizer.zero_grad()
    with SentBytes() as sent:
        train_step(1)
    return {"params": _bytes(model.parameters()), "grads": grads, "state": state, "sent": sent.sent,
            "counts": dict(sent.counts)}


def measure_variant(name: str, config: Config, reference: torch.nn.Module, ref_loss: float) -> tuple[dict, Variant]:
    dp, tp = VARIANTS[name]
    variant = Variant(config, reference, dp, tp)
    loss = variant.loss(0)
    batch_loss = variant.batch_loss(loss)
    torch.testing.assert_close(batch_loss, ref_loss, **TOL,
                               msg=lambda m: f"{name}: the loss differs from the single-process model's: {m}")
    row = {"variant": name, "predicted": variant.predicted, "loss_diff": abs(batch_loss - ref_loss),
           **_held_and_sent(variant.model, variant.optimizer, loss, variant.train_step)}
    return row, variant


class Reference:
    """The single-process model on the whole batch, run by rank 0 alone (the others idle)."""

    def __init__(self, config: Config, reference: torch.nn.Module):
        self.config = config
        self.model = copy.deepcopy(reference)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def loss(self, step: int) -> torch.Tensor:
        inputs, targets = _batch(self.config, step)
        return F.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())

    def train_step(self, step: int = 0) -> None:
        if dist.get_rank() == 0:
            self.loss(step).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()


def measure_reference(config: Config, reference: torch.nn.Module) -> tuple[dict | None, Reference]:
    """The ``1 process`` row, measured like the variants' (on rank 0; ``None`` on the others)."""
    single = Reference(config, reference)
    if dist.get_rank() != 0:
        return None, single
    row = {"variant": REFERENCE, "predicted": None, "loss_diff": None,
           **_held_and_sent(single.model, single.optimizer, single.loss(0), single.train_step)}
    return row, single


def measure_checkpointing(config: Config, reference: torch.nn.Module) -> list[dict]:
    rows = []
    for ac in AC_MODES:
        variant = Variant(config, reference, 2, 2, ac)
        peak = _peak_memory(variant)
        with SentBytes() as sent:
            variant.loss(1).backward()
        variant.optimizer.zero_grad()
        rows.append({"ac": ac, **peak, "counts": dict(sent.counts), "sent": sent.sent})
    return rows


def rank_main(config: Config) -> None:
    """Entry point on every rank: check, measure and time every variant; rank 0 writes the rows."""
    if rank_device().type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = Transformer(config.args).to(rank_device())
    inputs, targets = _batch(config, 0)
    ref_loss = F.cross_entropy(copy.deepcopy(reference)(inputs).flatten(0, 1), targets.flatten()).item()
    progress("1 process: measuring ...")
    single_row, single = measure_reference(config, reference)
    rows, variants = [], {}
    for name in VARIANTS:
        progress(f"{name}: checking and measuring ...")
        row, variants[name] = measure_variant(name, config, reference, ref_loss)
        rows.append(row)
    progress(f"timing {config.iters} rounds after {config.warmup} warm-up ...")
    steps = {REFERENCE: single.train_step, **{n: variants[n].train_step for n in VARIANTS}}
    times = time_interleaved(steps, config.iters, config.warmup)
    for row in rows:
        row["step_s"] = [wall for wall, _ in times[row["variant"]]]
    progress("activation checkpointing ...")
    checkpointing = measure_checkpointing(config, reference)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rows, checkpointing))
    if dist.get_rank() == 0:
        worst = [dict(r) for r in rows]
        for per_rank_rows, _ in everyone:  # the largest rank's bytes
            for mine, theirs in zip(worst, per_rank_rows):
                for key in ("params", "predicted", "grads", "state", "sent"):
                    mine[key] = max(mine[key], theirs[key])
        single_row["step_s"] = [wall for wall, _ in times[REFERENCE]]
        with open(config.result_path, "w") as f:
            json.dump({"variants": [single_row, *worst], "checkpointing": checkpointing}, f)


# ------------------------------------------------------------------------------ report

COLUMNS = ("variant", "params KiB", "predicted", "grads KiB", "AdamW KiB", "sent KiB", "collectives", "step ms", "loss Δ")
AC_COLUMNS = ("checkpointing", "peak MiB", "peak activations MiB", "activations vs none", "collectives", "sent KiB")


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def _counts(counts: dict) -> str:
    return "+".join(f"{counts[k]}{k}" for k in ("AG", "RS", "AR") if counts.get(k)) or "-"


def format_report(result: dict, options: argparse.Namespace, config: Config) -> str:
    a = config.args
    rows = [(r["variant"], _kib(r["params"]), "-" if r["predicted"] is None else _kib(r["predicted"]),
             _kib(r["grads"]), _kib(r["state"]), _kib(r["sent"]), _counts(r["counts"]),
             f"{statistics.median(r['step_s']) * 1e3:.1f}", "-" if r["loss_diff"] is None else f"{r['loss_diff']:.1e}")
            for r in result["variants"]]
    none = result["checkpointing"][0]["activations"]
    ac_rows = [(r["ac"], f"{r['total'] / 2**20:.3f}", f"{r['activations'] / 2**20:.3f}", f"{r['activations'] / none:.3f}",
                _counts(r["counts"]), _kib(r["sent"])) for r in result["checkpointing"]]
    return "\n".join([
        report_header(options, ranks="4 ranks", load=False),
        f"Llama dim {a.dim}, {a.n_layers} layers, {a.n_heads} heads, ffn {a.ffn_hidden}, vocab {a.vocab_size}; batch "
        f"{BATCH} x {config.seq} tokens; AdamW; TP with sequence parallelism; min_weight_size {config.min_weight_size}",
        "",
        markdown_table(COLUMNS, rows),
        "",
        "Activation checkpointing on 2-D 2x2 (peak memory of forward + backward on rank 0, torch's MemTracker; "
        "collectives of that forward + backward):",
        "",
        markdown_table(AC_COLUMNS, ac_rows),
    ])


def main(argv: list[str] | None = None) -> None:
    options = parse_arguments(argv, __file__, __doc__, iters=(10, 3), warmup=(2, 1), what="variant",
                              quick="a small Llama, few rounds")
    args = QUICK if options.quick else FULL
    config = Config(args, seq=16 if options.quick else 128, min_weight_size=1024 if options.quick else 2**14,
                    iters=options.iters, warmup=options.warmup)
    result = run_world(rank_main, 4, config)
    if result:
        print(format_report(result, options, config))


if __name__ == "__main__":
    main()
