"""What the forward-pass agreement checks cost per training step: Llama TP+SP and an MoE decoder.

Command (spawns gloo CPU ranks, world size 2 then 4, and prints one table)::

    python3 benchmarks/agreement.py                  # dim 256, 4 layers, batch 2 x 128 tokens, 20 rounds
    python3 benchmarks/agreement.py --quick          # tiny sizes, few rounds (smoke test)
    torchrun --nproc-per-node 4 benchmarks/agreement.py

Before a collective whose sizes come from data, torch_tp runs one agreement across the group
(``torch_tp._agreement``: every rank's 8-byte digest), so a rank whose inputs differ raises a
named error on every rank instead of aborting or hanging the job. Where: the plain inputs a
style annotates as shards (Rowwise, SequenceParallel, PrepareModuleInput of a ``Shard`` layout:
an all-gather of its own each), and every MoE routing (ids in range, one top-k, replicated
token counts: under ``ExpertParallel`` the digest rides on the token-count all-to-all every
rank runs anyway, no collective of its own). ``torch_tp.runtime_checks(False)`` turns them off.

Each model takes the same step twice per round, checks on and off (order rotated each round):
``cross_entropy(model(tokens), targets)`` (MoE: plus its auxiliary loss) and its backward.
On a shared 2-core machine the difference of the two medians moves by several percent from
run to run, so the agreements' own latency is also measured apart: 200 back-to-back agreements
(20 with ``--quick``) of a site's two facts on the same ranks, after a barrier. Columns:

``world``             ranks.
``model``             ``llama TP+SP`` (``torch_tp.models.llama.tensor_parallel_plan(sequence_parallel=True)``)
                      or ``MoE EP`` (``torch_tp.models.moe``, ``experts="expert"``, TP+SP around).
``agreements/step``   agreements one step settles (counted).
``all-gathers/step``  those that run an all-gather of their own (the rest ride on the MoE count exchange).
``bytes/step``        digest bytes each rank receives: ``agreements * 8 * world``.
``check us``          median wall time of one agreement's all-gather (rank 0).
``est. cost %``       ``all-gathers/step * check us`` as a share of the step without checks.
``on ms``, ``off ms`` median wall time of the step with the checks on and off (rank 0).
``cost %``            ``on ms - off ms`` as a share of ``off ms`` (noisy: see above).
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import torch_tp._agreement as agreement
from torch_tp import parallelize_module, runtime_checks
from torch_tp.launch import rank_device
from torch_tp.models import llama, moe

from _driver import RunConfig, markdown_table, parse_arguments, report_header, run_worlds  # noqa: E402
from _measure import median_ms, time_interleaved  # noqa: E402


@dataclass(frozen=True)
class Config(RunConfig):
    dim: int
    layers: int
    batch: int
    seq: int
    latency_rounds: int


def _models(config: Config) -> dict[str, tuple[torch.nn.Module, dict]]:
    args = llama.ModelArgs(dim=config.dim, n_layers=config.layers, n_heads=8, vocab_size=512,
                           ffn_hidden=2 * config.dim, max_seq_len=config.seq)
    torch.manual_seed(0)
    dense = llama.Transformer(args)
    experts = moe.MoEArgs(num_experts=8, top_k=2, expert_hidden=config.dim)
    mixture = moe.MoETransformer(args, experts)
    return {
        "llama TP+SP": (dense, llama.tensor_parallel_plan(sequence_parallel=True)),
        "MoE EP": (mixture, moe.tensor_parallel_plan(experts, experts="expert", sequence_parallel=True)),
    }


def _step(model, tokens, targets):
    def step():
        model.zero_grad(set_to_none=True)
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if hasattr(model, "aux_loss"):
            loss = loss + 0.01 * model.aux_loss()
        loss.backward()
    return step


def _counted(step) -> tuple[int, int]:
    """(agreements settled, all-gathers of their own) in one call of ``step``."""
    settled, gathers = agreement._AGREEMENTS[0], agreement.checks_run()
    step()
    return agreement._AGREEMENTS[0] - settled, agreement.checks_run() - gathers


def _check_latency_us(group, rounds: int) -> float:
    """Median wall time of one forward-time agreement (a site's two facts), back to back."""
    facts = [agreement.Fact("inputs, as one sharded tensor, have different shapes", (2, 128, 256), "fix"),
             agreement.Fact("inputs have different dtypes", "torch.float32", "fix")]
    times = []
    with runtime_checks(True):
        for _ in range(5):
            dist.barrier(group)
            start = time.perf_counter()
            for _ in range(rounds):
                agreement.check_on_every_rank(group, lambda: facts, what="latency", at_runtime=True)
            times.append((time.perf_counter() - start) / rounds * 1e6)
    return statistics.median(times)


def rank_main(config: Config) -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh(rank_device().type, (world,))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (config.batch, config.seq), generator=generator)
    targets = torch.randint(0, 512, (config.batch, config.seq), generator=generator)
    rows = []
    for name, (model, plan) in _models(config).items():
        model = parallelize_module(copy.deepcopy(model), mesh, plan)
        checked = _step(model, tokens, targets)

        def step(checked=checked):  # the driver runs ranks with the checks off: on here
            with runtime_checks(True):
                checked()

        def unchecked(step=step):
            with runtime_checks(False):
                step()

        agreements, gathers = _counted(step)
        times = time_interleaved({"on": step, "off": unchecked}, config.iters, config.warmup)
        on, off = median_ms({"wall_s": [w for w, _ in times["on"]]}), median_ms({"wall_s": [w for w, _ in times["off"]]})
        rows.append({"world": world, "model": name, "agreements": agreements, "gathers": gathers,
                     "bytes": agreements * 8 * world, "on": on, "off": off})
    latency = _check_latency_us(mesh.get_group(), config.latency_rounds)
    for row in rows:
        row["check_us"] = latency
    if dist.get_rank() == 0:
        with open(config.result_path, "w") as f:
            json.dump(rows, f)


def main(argv: list[str] | None = None) -> None:
    options = parse_arguments(argv, __file__, __doc__, iters=(20, 3), warmup=(3, 1), what="model",
                              quick="dim 64, 2 layers, 32 tokens")
    sizes = dict(dim=64, layers=2, batch=1, seq=32, latency_rounds=20) if options.quick else dict(
        dim=256, layers=4, batch=2, seq=128, latency_rounds=200)
    config = Config(iters=options.iters, warmup=options.warmup, **sizes)
    rows = run_worlds(rank_main, config, options.world_sizes, "Llama TP+SP and MoE EP, checks on and off")
    print(report_header(options, agreement_checks=True, rounds=f"; dim {config.dim}, {config.layers} layers, {config.batch} x {config.seq} tokens"))
    print(markdown_table(
        ("world", "model", "agreements/step", "all-gathers/step", "bytes/step", "check us", "est. cost %",
         "on ms", "off ms", "cost %"),
        [(str(r["world"]), r["model"], str(r["agreements"]), str(r["gathers"]), str(r["bytes"]), f"{r['check_us']:.0f}",
          f"{100 * r['gathers'] * r['check_us'] / 1000 / r['off']:.2f}", f"{r['on']:.2f}", f"{r['off']:.2f}",
          f"{100 * (r['on'] - r['off']) / r['off']:+.1f}") for r in rows],
    ))


if __name__ == "__main__":
    main()
