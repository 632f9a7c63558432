"""The main job: parallelize a small Llama-style model and check it against one process.

Run ``python -m torch_tp.demo`` to spawn 2 CPU ranks with gloo (``--nproc N`` for more).
Under ``torchrun`` it uses the launcher's ranks instead, and NCCL when CUDA is available::

    torchrun --nproc-per-node 2 -m torch_tp.demo

Each rank builds the same model, parallelizes a copy with tensor + sequence parallelism,
trains both for a few steps on the same synthetic batches and reports whether the
parallel model's loss follows the single-process loss.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import parallelize_module
from torch_tp.launch import launch, rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan

__all__ = ["main"]

def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torch_tp.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn on CPU (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--no-sequence-parallel", action="store_true", help="plain tensor parallelism")
    return parser.parse_args(argv)


def _train(model, batches, lr=0.1):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for tokens, targets in batches:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _run(options: argparse.Namespace) -> None:
    device = rank_device()
    backend = dist.get_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    sequence_parallel = not options.no_sequence_parallel

    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4 * world, vocab_size=256, ffn_hidden=64 * world)
    reference = Transformer(args).to(device)
    model = parallelize_module(
        copy.deepcopy(reference), mesh["tp"], tensor_parallel_plan(sequence_parallel=sequence_parallel)
    )
    shape = (4, 8 * world)
    batches = [
        (torch.randint(0, args.vocab_size, shape, device=device),
         torch.randint(0, args.vocab_size, shape, device=device))
        for _ in range(options.steps)
    ]
    losses = _train(model, batches)
    ref_losses = _train(reference, batches)
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    if rank == 0:
        mode = "tensor + sequence parallel" if sequence_parallel else "tensor parallel"
        print(f"torch_tp demo: {world} ranks ({backend}), {mode}, {options.steps} steps")
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            print(f"  step {step}: loss {a:.5f} (single process {b:.5f})")
        verdict = "matches" if worst < 1e-4 else "DOES NOT match"
        print(f"loss {verdict} the single-process run (max |diff| {worst:.2e})")
    if worst >= 1e-4:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m torch_tp.demo``.

    Example::

        >>> # xdoctest: +SKIP("spawns processes")
        >>> main(["--nproc", "2", "--steps", "3"])
    """
    options = _parse(argv)
    launch(_run, options, nproc=options.nproc)


if __name__ == "__main__":
    main()
