"""What saving a training run costs: the main job's model, trained with and without checkpoints.

Command (spawns 2 gloo CPU ranks and prints one table)::

    python3 benchmarks/checkpoint.py            # 30 steps, a checkpoint every 5 (~20 s)
    python3 benchmarks/checkpoint.py --quick    # 10 steps (the smoke test)

Under ``torchrun --nproc-per-node 2 benchmarks/checkpoint.py`` the launcher's ranks are used
(the checkpoints then go to a directory named after torchrun's run id).

Every rank trains a Llama of the main job's size (``torch_tp.demo``: tensor + sequence parallel
over all ranks, AdamW) on the same batches twice: without checkpoints, then with
``torch_tp.checkpoint.save_training_state`` after every ``--every`` steps (into a temporary
directory). Columns (rank 0's wall times; a barrier before each step):

``step ms``           median of a training step (forward, backward, ``optimizer.step()``).
``save ms``           median of one ``save_training_state`` (model, optimizer, step, RNG; DCP's
                      write of every rank's shards, then the rename that makes it complete).
``checkpoint KiB``    bytes one checkpoint takes on disk (every rank's files and ``.metadata``).
``per step ms``       the run's wall time divided by its steps: without, and with a save every K.
``overhead``          how much longer the run with checkpoints takes (per step).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import init_parameters, parallelize_module
from torch_tp.checkpoint import save_training_state
from torch_tp.launch import launched_by_torchrun, rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan

# _driver.py is next to this script, whose directory running it (python3 or torchrun) puts first
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _driver import (  # noqa: E402
    RunConfig,
    benchmark_arguments,
    finish_arguments,
    markdown_table,
    report_header,
    run_world,
    world_sizes,
)

BATCH = 4
COLUMNS = ("step ms", "save ms", "checkpoint KiB", "per step ms (no saves)", "per step ms (saves)", "overhead")


@dataclass(frozen=True)
class Config(RunConfig):
    every: int
    directory: str


def _model_args(tp: int) -> ModelArgs:
    """The main job's sizes at ``tp`` ranks (``python -m torch_tp.demo``)."""
    return ModelArgs(dim=64, n_layers=2, n_heads=2 * tp, vocab_size=128, ffn_hidden=32 * tp, max_seq_len=64)


def _batches(args: ModelArgs, steps: int, seq_len: int):
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, args.vocab_size, (BATCH, seq_len), generator=generator) for _ in range(steps)]
    return [(t.to(rank_device()), ((5 * t + 3) % args.vocab_size).to(rank_device())) for t in tokens]


def _model_and_optimizer(tp: int):
    mesh = init_device_mesh(rank_device().type, (tp,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = Transformer(_model_args(tp))
    parallelize_module(model, mesh, tensor_parallel_plan(sequence_parallel=True))
    model.to_empty(device=rank_device())
    init_parameters(model, seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _train(steps: int, every: int | None, directory: str) -> tuple[list[float], list[float], float]:
    """(step times, save times, wall time of the whole run), in seconds."""
    tp = dist.get_world_size()
    model, optimizer = _model_and_optimizer(tp)
    batches = _batches(_model_args(tp), steps, 8 * tp)
    step_times, save_times = [], []
    dist.barrier()
    start = time.perf_counter()
    for step, (tokens, targets) in enumerate(batches, start=1):
        dist.barrier()
        began = time.perf_counter()
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        step_times.append(time.perf_counter() - began)
        if every is not None and step % every == 0:
            began = time.perf_counter()
            save_training_state(directory, step, model, optimizer, extra={"data_position": step})
            save_times.append(time.perf_counter() - began)
    return step_times, save_times, time.perf_counter() - start


def rank_main(config: Config) -> None:
    _train(config.warmup, None, config.directory)  # the first steps pay one-time costs
    plain, _, plain_wall = _train(config.iters, None, config.directory)
    _, saves, saving_wall = _train(config.iters, config.every, config.directory)
    if dist.get_rank() != 0:
        return
    newest = max(pathlib.Path(config.directory).iterdir())
    size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    per_step, per_step_saving = 1e3 * plain_wall / config.iters, 1e3 * saving_wall / config.iters
    row = {"step ms": f"{1e3 * statistics.median(plain):.2f}", "save ms": f"{1e3 * statistics.median(saves):.1f}",
           "checkpoint KiB": f"{size / 1024:.1f}", "per step ms (no saves)": f"{per_step:.2f}",
           "per step ms (saves)": f"{per_step_saving:.2f}", "overhead": f"{100 * (per_step_saving / per_step - 1):+.0f}%"}
    with open(config.result_path, "w") as f:
        json.dump([row], f)


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_arguments(__file__, __doc__, iters=(30, 10), warmup=(2, 2), what="run (steps)",
                                 quick="10 steps", min_iters=1)
    parser.add_argument("--every", type=int, default=5, help="save after every K steps (default 5)")
    parser.set_defaults(world_sizes="2")
    options = finish_arguments(parser, argv)
    nproc = world_sizes(options.world_sizes)[0]
    if launched_by_torchrun():  # every rank runs this: one directory, named after the job
        directory = os.path.join(tempfile.gettempdir(), f"torch_tp_checkpoint_bench_{os.environ['TORCHELASTIC_RUN_ID']}")
    else:
        directory = tempfile.mkdtemp(prefix="torch_tp_checkpoint_bench_")
    try:
        rows = run_world(rank_main, nproc, Config(iters=options.iters, warmup=options.warmup, every=options.every,
                                                  directory=directory))
    finally:
        if os.environ.get("RANK", "0") == "0":
            shutil.rmtree(directory, ignore_errors=True)
    if rows:
        print(report_header(options, ranks=f"{nproc} ranks", rounds=" steps")
              + f"\nthe main job's Llama (tp {nproc}), {options.iters} steps, a checkpoint every {options.every}\n")
        print(markdown_table(COLUMNS, [tuple(row[c] for c in COLUMNS) for row in rows]))


if __name__ == "__main__":
    main()
