"""The main job: a Llama-style model, built on ``meta``, trained with tensor + sequence parallelism.

``python -m torch_tp.demo`` spawns 2 CPU ranks with gloo (``--nproc N`` for more;
``--overlap`` fuses the sequence-parallel collectives into the matmuls; ``--dp D`` trains in
2-D, FSDP2 over ``D`` data-parallel ranks × tensor parallelism over the rest, e.g.
``--nproc 4 --dp 2``). Under ``torchrun`` it uses the launcher's ranks, with NCCL when CUDA
is available::

    torchrun --nproc-per-node 2 -m torch_tp.demo

Steps: build the model on the ``meta`` device (no memory), print the ``explain_plan``
table (with ``--dp``, the 2-D one of ``predict_placements``), parallelize it (TP + SP; with
``--dp``, then FSDP2 over dp by pattern), materialize each rank's shards with
``init_parameters``, train on a synthetic task with a progress bar (each dp rank on its rows
of the batch), then train the same model in one process on the whole batches and check that
the loss curves match; finally print each rank's parameter bytes, its memory (parameters,
gradients, optimizer state, activations saved for backward, measured) and the collectives
of one training step, and the two lines that tell runs apart: ``final loss:`` and ``final
parameters sha256:`` (of the whole parameters, in name order: equal for equal parameters on
any mesh). Bytes per rank are printed once, in bytes, measured beside the plan's prediction (the
plan's table leaves its own total out).

With ``--checkpoint-dir DIR`` it saves the model, the optimizer, the step and the data position
every ``--checkpoint-every`` steps (:func:`torch_tp.checkpoint.save_training_state`: a
checkpoint appears only once complete), printing each one's path and step, and keeps the newest
``--keep`` (default 2) of those it saved, deleting its own older ones (never a checkpoint it did
not write in this run); on start, it resumes from the newest complete one in DIR, on any mesh:
the model's sizes and the sequence length are the checkpoint's. A run killed
at any moment and started again (by hand, or by ``torchrun --max-restarts``) ends with the
parameters of the run that was never killed::

    python -m torch_tp.demo --checkpoint-dir ckpt --checkpoint-every 5
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import pathlib
import shutil
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import (
    explain_plan,
    fully_shard_by_pattern,
    init_parameters,
    parallelize_module,
    predict_placements,
)
from torch_tp.checkpoint import (
    CheckpointMismatchError,
    latest_checkpoint,
    load_training_state,
    read_extra,
    save_training_state,
)
from torch_tp.launch import launch, rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan

__all__ = ["main"]

SEED = 0
LOSS_RTOL = 1e-3
#: --keep's default: the newest checkpoints of a run left in --checkpoint-dir
KEEP = 2


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torch_tp.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--no-sequence-parallel", action="store_true", help="plain tensor parallelism")
    parser.add_argument(
        "--overlap", action="store_true",
        help="fuse the sequence-parallel all-gathers/reduce-scatters into the matmuls (torch_tp.overlap)",
    )
    parser.add_argument(
        "--dp", type=int, default=1,
        help="data-parallel ranks: FSDP2 over dp x tensor parallelism over nproc/dp (2-D; default 1: TP only)",
    )
    parser.add_argument(
        "--checkpoint-dir", metavar="DIR",
        help="save checkpoints here and resume from the newest complete one found here on start "
             "(no --resume flag: an empty or missing DIR starts fresh); the run may resume on another "
             "mesh: the model's sizes and the sequence length are the checkpoint's",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=5, metavar="K",
        help="with --checkpoint-dir: save after every K steps (default 5)",
    )
    parser.add_argument(
        "--keep", type=int, default=KEEP, metavar="N",
        help=f"with --checkpoint-dir: keep the newest N checkpoints this run saved, deleting its older ones "
             f"(default {KEEP}); checkpoints it did not save in this run are never deleted",
    )
    options = parser.parse_args(argv)
    if options.checkpoint_every < 1:
        parser.error(f"--checkpoint-every must be at least 1, got {options.checkpoint_every}")
    if options.keep < 1:
        parser.error(f"--keep must be at least 1 (the checkpoint just saved), got {options.keep}")
    if options.overlap and options.no_sequence_parallel:
        parser.error("--overlap fuses the sequence-parallel collectives; drop --no-sequence-parallel")
    if options.dp < 1:
        parser.error(f"--dp must be at least 1, got {options.dp}")
    return options


#: with --dp, parameters this small stay whole on every dp rank (the norms)
MIN_WEIGHT_SIZE = 1024
BATCH = 4


def _model_args(tp: int) -> ModelArgs:
    return ModelArgs(dim=64, n_layers=2, n_heads=2 * tp, vocab_size=128, ffn_hidden=32 * tp, max_seq_len=64)


def _sizes(tp: int, saved: dict | None) -> tuple[ModelArgs, int]:
    """The model's arguments and the sequence length: a checkpoint's (a resumed run trains the
    model it saved, on the same data, whatever the mesh), else those of ``tp`` ranks."""
    if saved is not None:
        return ModelArgs(**saved["model_args"]), saved["seq_len"]
    return _model_args(tp), 8 * tp


def _batches(args: ModelArgs, steps: int, seq_len: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable synthetic task: the next token is ``(5 * token + 3) mod vocab``."""
    generator = torch.Generator().manual_seed(SEED)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, args.vocab_size, (BATCH, seq_len), generator=generator)
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


def _train(model, optimizer, batches, *, first_step: int = 1, show_progress: bool, dp_group=None,
           after_step=None) -> list[float]:
    """Train on ``batches[first_step - 1:]``; with ``dp_group``, ``batches`` are this dp rank's
    rows and the losses recorded are the dp average (the whole batch's). ``after_step(step,
    loss)`` runs after each optimizer step (the checkpoint)."""
    losses = []
    for step in range(first_step, len(batches) + 1):
        tokens, targets = batches[step - 1]
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_batch_loss(loss.detach(), dp_group))
        if show_progress:
            _progress(step, len(batches), losses[-1])
        if after_step is not None:
            after_step(step, losses[-1])
    return losses


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def _batch_loss(loss: torch.Tensor, dp_group) -> float:
    if dp_group is None:
        return loss.item()
    total = loss.clone()
    dist.all_reduce(total, group=dp_group)
    return total.item() / dist.get_world_size(dp_group)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _memory_of(model, optimizer, batch) -> dict[str, int]:
    """This rank's bytes: parameters, gradients (of one step), AdamW state, and the activations
    autograd saves for backward in one forward (distinct storages, counted as they are saved)."""
    from torch.autograd.graph import saved_tensors_hooks

    tokens, targets = batch
    saved: dict[int, int] = {}

    def pack(t):
        local = _local(t)
        if type(local) not in (torch.Tensor, nn.Parameter) or local.is_meta:
            return t
        storage = local.untyped_storage()
        # weights are not activations: under FSDP2 a unit's parameters are its gathered ones
        # while it runs, so they are read from the model at each save
        weights = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        if storage.nbytes() and storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    memory = {
        "parameters": _bytes(model.parameters()),
        "gradients": _bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer state": _bytes(state),
        "saved activations": sum(saved.values()),
    }
    model.zero_grad()
    return memory


def _collectives_of_one_step(model, batch) -> str:
    from torch_tp.testing import communication_of

    tokens, targets = batch

    def step():
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        model.zero_grad()

    sends, counts = communication_of(step)
    checks = counts.pop("agreement checks", 0)
    if sends:  # the fused ops' ring steps (torch_tp.overlap)
        counts["P2P sends (fused ops)"] = sends
    text = ", ".join(f"{n} {name}" for name, n in sorted(counts.items())) or "none"
    if checks:  # torch_tp._agreement: before the collectives whose sizes come from the inputs
        text += f"; and {checks} agreement checks of the inputs (8 bytes per rank each)"
    return text


def _single_process_losses(args, batches, device) -> list[float]:
    reference = Transformer(args).to(device)
    init_parameters(reference, seed=SEED)
    return _train(reference, _adamw(reference), batches, show_progress=False)


def _parameters_sha256(model) -> str:
    """SHA-256 over the whole parameters in name order (name, shape, float32 bytes): equal for
    equal parameters whatever the mesh. Every rank calls it (each DTensor is gathered)."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        whole = param.full_tensor() if hasattr(param, "full_tensor") else param
        values = whole.detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}{tuple(values.shape)}".encode())
        digest.update(values.numpy().tobytes())
    return digest.hexdigest()


def _saved_sizes(directory: str | None) -> dict | None:
    """The model's sizes a checkpoint in ``directory`` pins, or ``None`` to start fresh."""
    if directory is None:
        return None
    saved = read_extra(directory)
    if saved is not None and not {"model_args", "seq_len", "data_position"} <= set(saved):
        raise CheckpointMismatchError(
            f"torch_tp.demo: {latest_checkpoint(directory)} is not a checkpoint of this demo (its saved values "
            f"are {sorted(saved)}); point --checkpoint-dir at a directory of demo checkpoints or an empty one"
        )
    return saved


def _compare(losses: list[float], ref_losses: list[float]) -> float:
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses)), default=0.0)


def _plan_table(report) -> str:
    """The plan's table without its total line (``parameter bytes per rank: ... (rank order)``,
    in KiB): the demo prints the total once, in bytes, measured beside the prediction."""
    return "\n".join(line for line in str(report).splitlines() if not line.startswith("parameter bytes per rank:"))


def _print_line(say, text: str) -> None:
    """Print ``text`` on a line of its own, also below a progress bar redrawn on a terminal."""
    say(("\n" if sys.stdout.isatty() else "") + text, flush=True)


def _delete_checkpoint(path: pathlib.Path) -> None:
    """Remove one complete checkpoint: renamed to ``.partial`` first, as
    ``save_training_state(keep=...)`` does, so one half removed is never loaded."""
    doomed = path.with_name(path.name + ".partial")
    shutil.rmtree(doomed, ignore_errors=True)
    if path.is_dir():
        os.rename(path, doomed)
        shutil.rmtree(doomed)


def _checkpointer(options: argparse.Namespace, model, optimizer, extra_of, say):
    """``after_step(step, loss)`` for :func:`_train`: every ``--checkpoint-every`` steps, save, print
    the path and step, and delete this run's checkpoints older than its newest ``--keep``
    (rank 0 deletes; a checkpoint this run did not save is never touched). Returns it and the
    list of the lines it printed."""
    saved: list[pathlib.Path] = []
    lines: list[str] = []

    def checkpoint(step: int, loss: float) -> None:
        if options.checkpoint_dir is None or step % options.checkpoint_every:
            return
        path = save_training_state(options.checkpoint_dir, step, model, optimizer, extra=extra_of(step, loss))
        saved[:] = [p for p in saved if p != path] + [path]
        notes = [f"saved checkpoint {path} (step {step})"]
        for old in saved[:-options.keep]:
            if dist.get_rank() == 0:
                _delete_checkpoint(old)
            notes.append(f"deleted checkpoint {old} (--keep {options.keep}: this run's newest {options.keep} stay)")
        del saved[:-options.keep]
        for note in notes:
            _print_line(say, f"  {note}")
        lines.extend(notes)

    return checkpoint, lines


def _mesh(world: int, dp: int, device):
    if world % dp:
        raise SystemExit(f"--dp {dp} must divide the {world} ranks (dp x tp)")
    return init_device_mesh(device.type, (dp, world // dp), mesh_dim_names=("dp", "tp"))


def _run(options: argparse.Namespace) -> dict:
    """The job on every rank (the process group is up); returns what rank 0 printed last: the
    first step it ran, the losses, the final loss, the parameters' SHA-256 and the lines about
    the checkpoints it saved and deleted."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    say = print if rank == 0 else (lambda *a, **k: None)
    dp = options.dp
    mesh = _mesh(world, dp, device)
    tp = world // dp
    sequence_parallel = not options.no_sequence_parallel
    plan = tensor_parallel_plan(sequence_parallel=sequence_parallel, overlap=options.overlap)
    saved = _saved_sizes(options.checkpoint_dir)
    args, seq_len = _sizes(tp, saved)
    mode = "tensor + sequence parallel" if sequence_parallel else "tensor parallel"
    if options.overlap:
        mode += ", overlapped (fused all-gather+matmul, matmul+reduce-scatter)"
    if dp > 1:
        mode = f"2-D: FSDP2 over dp {dp} x {mode} over tp {tp}"
    say(f"torch_tp demo: {world} ranks ({dist.get_backend()}), {mode}, {options.steps} steps\n")

    with torch.device("meta"):
        model = Transformer(args)
    if dp > 1:
        report = predict_placements(model, mesh, plan, "layers.*", min_weight_size=MIN_WEIGHT_SIZE)
    else:
        report = explain_plan(model, mesh["tp"], plan)
    say(_plan_table(report), end="\n\n")
    parallelize_module(model, mesh["tp"], plan)
    if dp > 1:
        fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=MIN_WEIGHT_SIZE)
    model.to_empty(device=device)
    init_parameters(model, seed=SEED)
    optimizer = _adamw(model)
    start, last_loss = 0, None
    if options.checkpoint_dir is not None:
        state = load_training_state(options.checkpoint_dir, model, optimizer)
        if state is not None:
            start, last_loss = state.extra["data_position"], state.extra["last_loss"]
            say(f"resumed from {state.path} after step {state.step} (saved on {state.extra['layout']})\n")

    def extra_of(step: int, loss: float) -> dict:
        return {"data_position": step, "last_loss": loss, "model_args": dataclasses.asdict(args),
                "seq_len": seq_len, "layout": f"{world} ranks, dp {dp} x tp {tp}"}

    checkpoint, checkpoint_lines = _checkpointer(options, model, optimizer, extra_of, say)

    batches = _batches(args, options.steps, seq_len, device)
    dp_rank = mesh["dp"].get_local_rank()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    mine = [(tokens[rows], targets[rows]) for tokens, targets in batches]
    say("training:")
    losses = _train(model, optimizer, mine, first_step=start + 1, show_progress=rank == 0,
                    dp_group=mesh["dp"].get_group() if dp > 1 else None, after_step=checkpoint)
    digest = _parameters_sha256(model)
    memory = _memory_of(model, optimizer, mine[0])
    collectives = _collectives_of_one_step(model, mine[0])
    per_rank = [None] * world
    dist.all_gather_object(per_rank, memory)

    verdict = [None]
    if rank == 0:
        ref_losses = _single_process_losses(args, batches, device)
        verdict[0] = _compare(losses, ref_losses[start:])
        if losses:
            say(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}; single process {ref_losses[start]:.4f} -> {ref_losses[-1]:.4f}")
    dist.broadcast_object_list(verdict, src=0)
    worst = verdict[0]
    ok = worst <= LOSS_RTOL
    say(f"loss curve {'matches' if ok else 'DOES NOT match'} the single-process run "
        f"(max relative difference {worst:.1e} over {len(losses)} steps)")
    say(f"loss per step ({start + 1}-{options.steps}): " + " ".join(f"{loss:.9g}" for loss in losses))
    say("parameter bytes per rank: " + ", ".join(f"rank {r}: {m['parameters']}" for r, m in enumerate(per_rank))
        + f" (predicted: {', '.join(map(str, report.bytes_per_rank()))})")
    say("memory per rank (bytes; measured):")
    for r, m in enumerate(per_rank):
        say(f"  rank {r}: " + ", ".join(f"{name} {value}" for name, value in m.items()) + f", total {sum(m.values())}")
    say(f"collectives per training step (forward + backward): {collectives}")
    final_loss = losses[-1] if losses else last_loss
    say(f"final loss: {final_loss!r}")
    say(f"final parameters sha256: {digest}")
    if not ok:
        sys.exit(1)
    return {"first_step": start + 1, "losses": losses, "final_loss": final_loss, "sha256": digest,
            "checkpoints": checkpoint_lines}


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m torch_tp.demo``.

    Example::

        >>> # xdoctest: +SKIP("spawns processes")
        >>> main(["--nproc", "2", "--steps", "10"])
    """
    options = _parse(argv)
    try:
        launch(_run, options, nproc=options.nproc)
    except KeyboardInterrupt:  # Ctrl-C: the launcher already stopped every rank
        print("torch_tp demo: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
