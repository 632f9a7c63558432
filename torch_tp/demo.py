"""The main job: a Llama-style model, built on ``meta``, trained with tensor + sequence parallelism.

``python -m torch_tp.demo`` spawns 2 CPU ranks with gloo (``--nproc N`` for more;
``--overlap`` fuses the sequence-parallel collectives into the matmuls). Under
``torchrun`` it uses the launcher's ranks, with NCCL when CUDA is available::

    torchrun --nproc-per-node 2 -m torch_tp.demo

Steps: build the model on the ``meta`` device (no memory), print the ``explain_plan``
table, parallelize it (TP + SP), materialize each rank's shards with ``init_parameters``,
train on a synthetic task with a progress bar, then train the same model in one process
and check that the loss curves match; finally print each rank's parameter bytes and the
collectives of one training step.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import explain_plan, init_parameters, parallelize_module
from torch_tp.launch import launch, rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan

__all__ = ["main"]

SEED = 0
LOSS_RTOL = 1e-3


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torch_tp.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--no-sequence-parallel", action="store_true", help="plain tensor parallelism")
    parser.add_argument(
        "--overlap", action="store_true",
        help="fuse the sequence-parallel all-gathers/reduce-scatters into the matmuls (torch_tp.overlap)",
    )
    options = parser.parse_args(argv)
    if options.overlap and options.no_sequence_parallel:
        parser.error("--overlap fuses the sequence-parallel collectives; drop --no-sequence-parallel")
    return options


def _model_args(world: int) -> ModelArgs:
    return ModelArgs(dim=64, n_layers=2, n_heads=2 * world, vocab_size=128, ffn_hidden=32 * world, max_seq_len=64)


def _batches(args: ModelArgs, steps: int, world: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable synthetic task: the next token is ``(5 * token + 3) mod vocab``."""
    generator = torch.Generator().manual_seed(SEED)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, args.vocab_size, (4, 8 * world), generator=generator)
        targets = (5 * tokens + 3) % args.vocab_size
        batches.append((tokens.to(device), targets.to(device)))
    return batches


def _progress(step: int, total: int, loss: float, width: int = 30) -> None:
    """Redraw one bar on a terminal; print a line every tenth of the way otherwise (logs, CI)."""
    done = width * step // total
    line = f"  [{'#' * done}{'.' * (width - done)}] {step:3d}/{total} loss {loss:.4f}"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if step == total else "", flush=True)
    elif step == total or step % max(1, total // 10) == 0:
        print(line, flush=True)


def _train(model, batches, *, show_progress: bool) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step, (tokens, targets) in enumerate(batches, start=1):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if show_progress:
            _progress(step, len(batches), losses[-1])
    return losses


def _collectives_of_one_step(model, batch) -> str:
    from torch_tp.testing import communication_of

    tokens, targets = batch

    def step():
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        model.zero_grad()

    sends, counts = communication_of(step)
    if sends:  # the fused ops' ring steps (torch_tp.overlap)
        counts["P2P sends (fused ops)"] = sends
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items())) or "none"


def _local_param_bytes(model) -> int:
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def _single_process_losses(args, batches, device) -> list[float]:
    reference = Transformer(args).to(device)
    init_parameters(reference, seed=SEED)
    return _train(reference, batches, show_progress=False)


def _compare(losses: list[float], ref_losses: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))


def _run(options: argparse.Namespace) -> None:
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    say = print if rank == 0 else (lambda *a, **k: None)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    sequence_parallel = not options.no_sequence_parallel
    plan = tensor_parallel_plan(sequence_parallel=sequence_parallel, overlap=options.overlap)
    args = _model_args(world)
    mode = "tensor + sequence parallel" if sequence_parallel else "tensor parallel"
    if options.overlap:
        mode += ", overlapped (fused all-gather+matmul, matmul+reduce-scatter)"
    say(f"torch_tp demo: {world} ranks ({dist.get_backend()}), {mode}, {options.steps} steps\n")

    with torch.device("meta"):
        model = Transformer(args)
    say(explain_plan(model, mesh["tp"], plan), end="\n\n")
    parallelize_module(model, mesh["tp"], plan)
    model.to_empty(device=device)
    init_parameters(model, seed=SEED)

    batches = _batches(args, options.steps, world, device)
    say("training:")
    losses = _train(model, batches, show_progress=rank == 0)
    collectives = _collectives_of_one_step(model, batches[0])
    param_bytes = [None] * world
    dist.all_gather_object(param_bytes, _local_param_bytes(model))

    verdict = [None]
    if rank == 0:
        ref_losses = _single_process_losses(args, batches, device)
        verdict[0] = _compare(losses, ref_losses)
        say(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}; single process {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}")
    dist.broadcast_object_list(verdict, src=0)
    worst = verdict[0]
    ok = worst <= LOSS_RTOL
    say(f"loss curve {'matches' if ok else 'DOES NOT match'} the single-process run "
        f"(max relative difference {worst:.1e} over {len(losses)} steps)")
    say("parameter bytes per rank: " + ", ".join(f"rank {r}: {b}" for r, b in enumerate(param_bytes)))
    say(f"collectives per training step (forward + backward): {collectives}")
    if not ok:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m torch_tp.demo``.

    Example::

        >>> # xdoctest: +SKIP("spawns processes")
        >>> main(["--nproc", "2", "--steps", "10"])
    """
    options = _parse(argv)
    launch(_run, options, nproc=options.nproc)


if __name__ == "__main__":
    main()
