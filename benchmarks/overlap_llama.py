"""One training step of the TP + SP Llama-style model, with and without ``overlap=True``.

Command (spawns gloo CPU ranks, world size 2 then 4, and prints one table)::

    python3 benchmarks/overlap_llama.py                  # dim 512, seq 1024, 10 timed rounds (~1 min)
    python3 benchmarks/overlap_llama.py --quick          # a tiny model, 4 rounds (smoke test, ~15 s)
    python3 benchmarks/overlap_llama.py --world-sizes 2  # one world size

Under ``torchrun --nproc-per-node N benchmarks/overlap_llama.py`` the launcher's ranks are
used once (world size N).

Both variants are the same model (``torch_tp.models.llama.Transformer``, float32, same
seed) parallelized with ``tensor_parallel_plan(sequence_parallel=True)`` and with
``overlap=True`` added; a step is forward, cross-entropy loss and backward. Before timing,
the two losses must agree (1e-4 relative). Rounds alternate the variants (order rotated
each round) with a barrier around every step; the ``ms`` columns are medians on rank 0.
Each rank uses ``max(1, cpus // world)`` intra-op threads.

Columns: ``world``; ``model`` (dim / layers / sequence); ``unfused ms``; ``overlap ms``;
``overlap/unfused``; ``P2P steps`` (the fused ops' ring steps per training step, on
rank 0); ``collectives`` (functional collectives per training step of each variant).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import parallelize_module
from torch_tp.launch import rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import communication_of

from _driver import RunConfig, markdown_table, parse_arguments, report_header, run_worlds
from _measure import time_interleaved

FULL = dict(dim=512, n_layers=2, n_heads=8, vocab_size=1024, ffn_hidden=1536, seq=1024, batch=2)
QUICK = dict(dim=64, n_layers=1, n_heads=4, vocab_size=128, ffn_hidden=192, seq=64, batch=2)


@dataclass(frozen=True)
class Config(RunConfig):
    model: dict


def _models(config: Config, mesh) -> dict[str, torch.nn.Module]:
    m = config.model
    args = ModelArgs(dim=m["dim"], n_layers=m["n_layers"], n_heads=m["n_heads"], vocab_size=m["vocab_size"],
                     ffn_hidden=m["ffn_hidden"], max_seq_len=m["seq"])
    models = {}
    for name, overlap in (("unfused", False), ("overlap", True)):
        torch.manual_seed(0)
        plan = tensor_parallel_plan(sequence_parallel=True, overlap=overlap)
        models[name] = parallelize_module(Transformer(args).to(rank_device()), mesh, plan)
    return models


def _step(model, tokens, targets) -> torch.Tensor:
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    model.zero_grad()
    return loss.detach()


def _communication(model, tokens, targets) -> tuple[int, int]:
    """(fused-op P2P sends, functional collectives) of one training step."""
    sends, counts = communication_of(lambda: _step(model, tokens, targets))
    return sends, sum(counts.values())


def rank_main(config: Config) -> None:
    """Entry point on every rank: time both variants; rank 0 writes its row as JSON."""
    world = dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh(rank_device().type, (world,), mesh_dim_names=("tp",))["tp"]
    models = _models(config, mesh)
    m = config.model
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, m["vocab_size"], (m["batch"], m["seq"]), generator=generator).to(rank_device())
    targets = torch.randint(0, m["vocab_size"], (m["batch"], m["seq"]), generator=generator).to(rank_device())
    losses = {name: _step(model, tokens, targets) for name, model in models.items()}
    torch.testing.assert_close(losses["overlap"], losses["unfused"], rtol=1e-4, atol=1e-5)
    counts = {name: _communication(model, tokens, targets) for name, model in models.items()}

    def synced(model):
        def run():
            dist.barrier()
            _step(model, tokens, targets)
            dist.barrier()
        return run

    times = time_interleaved({name: synced(model) for name, model in models.items()}, config.iters, config.warmup)
    if dist.get_rank() == 0:
        row = dict(world=world, model=f"d{m['dim']} L{m['n_layers']} S{m['seq']}", counts=counts,
                   **{f"{name}_s": [wall for wall, _ in samples] for name, samples in times.items()})
        with open(config.result_path, "w") as f:
            json.dump([row], f)


def format_report(rows: list[dict], options: argparse.Namespace, model: dict) -> str:
    header = ("world", "model", "unfused ms", "overlap ms", "overlap/unfused", "P2P steps", "collectives")
    cells = []
    for row in rows:
        unfused, fused = (statistics.median(row[f"{name}_s"]) * 1e3 for name in ("unfused", "overlap"))
        (_, unfused_collectives), (sends, fused_collectives) = row["counts"]["unfused"], row["counts"]["overlap"]
        cells.append((str(row["world"]), row["model"], f"{unfused:.1f}", f"{fused:.1f}", f"{fused / unfused:.2f}",
                      str(sends), f"{unfused_collectives} -> {fused_collectives}"))
    return (f"{report_header(options, load=False)}; float32, batch {model['batch']}, one step = forward + "
            f"loss + backward\n\n" + markdown_table(header, cells))


def main(argv: list[str] | None = None) -> None:
    options = parse_arguments(argv, __file__, __doc__, iters=(10, 4), warmup=(2, 1), what="variant",
                              quick="a tiny model, few rounds")
    config = Config(QUICK if options.quick else FULL, iters=options.iters, warmup=options.warmup)
    rows = run_worlds(rank_main, config, options.world_sizes, "unfused vs overlap training step")
    if rows:
        print(format_report(rows, options, config.model))


if __name__ == "__main__":
    main()
