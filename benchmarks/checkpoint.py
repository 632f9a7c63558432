"""What saving a training run costs: the main job's model, trained with and without checkpoints.

Command (spawns 2 gloo CPU ranks and prints one table)::

    python3 benchmarks/checkpoint.py            # 30 steps, a checkpoint every 5 (~20 s)
    python3 benchmarks/checkpoint.py --quick    # 10 steps (the smoke test)

Under ``torchrun --nproc-per-node 2 benchmarks/checkpoint.py`` the launcher's ranks are used.

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

import argparse
import os
import pathlib
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import init_parameters, parallelize_module
from torch_tp.checkpoint import save_training_state
from torch_tp.launch import launch, launched_by_torchrun, rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan

BATCH = 4


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


def _train(steps: int, every: int | None, directory: str | None) -> tuple[list[float], list[float], float]:
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


def _bench(options: argparse.Namespace, directory: str) -> None:
    _train(2, None, None)  # warm-up: the first steps pay one-time costs
    plain, _, plain_wall = _train(options.steps, None, None)
    with_saves, saves, saving_wall = _train(options.steps, options.every, directory)
    if dist.get_rank() != 0:
        return
    newest = max(pathlib.Path(directory).iterdir())
    size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    per_step, per_step_saving = 1e3 * plain_wall / options.steps, 1e3 * saving_wall / options.steps
    print(f"torch {torch.__version__}, {dist.get_backend()}, {dist.get_world_size()} ranks; the demo's Llama "
          f"(tp {dist.get_world_size()}), {options.steps} steps, a checkpoint every {options.every}\n")
    print("| step ms | save ms | checkpoint KiB | per step ms (no saves) | per step ms (saves) | overhead |")
    print("|---------|---------|----------------|------------------------|---------------------|----------|")
    print(f"| {1e3 * statistics.median(plain):.2f} | {1e3 * statistics.median(saves):.1f} | {size / 1024:.1f} "
          f"| {per_step:.2f} | {per_step_saving:.2f} | {100 * (per_step_saving / per_step - 1):+.0f}% |")
    assert len(saves) == options.steps // options.every and len(with_saves) == options.steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 steps (the smoke test)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="save after every K steps")
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks to spawn (ignored under torchrun)")
    options = parser.parse_args(argv)
    if options.quick:
        options.steps = 10
    if launched_by_torchrun():  # every rank runs this: one directory, named after the job
        run = os.environ["TORCHELASTIC_RUN_ID"]
        directory = os.path.join(tempfile.gettempdir(), f"torch_tp_checkpoint_bench_{run}")
    else:
        directory = tempfile.mkdtemp(prefix="torch_tp_checkpoint_bench_")
    try:
        launch(_bench, options, directory, nproc=options.nproc)
    finally:
        if int(os.environ.get("RANK", "0")) == 0:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
