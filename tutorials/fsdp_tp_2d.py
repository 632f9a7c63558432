"""Tutorial: train a Llama on a 2-D mesh, FSDP2 over data parallelism × tensor parallelism.

Run on 4 CPU ranks (gloo) as dp 2 × tp 2::

    python tutorials/fsdp_tp_2d.py

or ``torchrun --nproc-per-node 4 tutorials/fsdp_tp_2d.py`` (NCCL on GPUs).

Tensor parallelism splits every matrix over the ``tp`` ranks; FSDP2 then shards what each
``tp`` rank holds over the ``dp`` ranks, gathers a block's weights just before it runs and
frees them after, and averages gradients over ``dp``. torch_tp drives both by pattern, in
torchtitan's order: the TP plan, then activation checkpointing, then FSDP. Before anything is
allocated, :func:`torch_tp.predict_placements` says on a ``meta`` model where every
parameter will live and how many bytes each rank will hold. Each dp rank trains on its half
of the batch; the run matches one process training on the whole batch (the last line says
whether it did; the exit status is 1 if not).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import (
    checkpoint_by_pattern,
    fully_shard_by_pattern,
    parallelize_module,
    predict_placements,
    save_collectives_and_matmuls,
)
from torch_tp._verdict import compare, conclude
from torch_tp.launch import launch, rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, ffn_hidden=176, max_seq_len=32)
MIN_WEIGHT_SIZE = 1024  # smaller parameters (the norms) stay whole on every dp rank
BATCH, SEQ = 4, 16


def _plan():
    return tensor_parallel_plan(sequence_parallel=True)


def main(steps=3):
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    dp = 2 if world % 2 == 0 and world > 1 else 1
    mesh = init_device_mesh(device.type, (dp, world // dp), mesh_dim_names=("dp", "tp"))

    # 1. Where every parameter will live, on a meta model: nothing is allocated.
    with torch.device("meta"):
        blueprint = Transformer(ARGS)
    report = predict_placements(blueprint, mesh, _plan(), "layers.*", min_weight_size=MIN_WEIGHT_SIZE)
    if rank == 0:
        print(report)

    # 2. The real model: TP on the tp dim, checkpointing (keeping collective and matmul
    #    results), then FSDP2 on the dp dim, one unit per block.
    torch.manual_seed(0)
    reference = Transformer(ARGS).to(device)
    model = copy.deepcopy(reference)
    parallelize_module(model, mesh["tp"], _plan())
    checkpoint_by_pattern(model, "layers.*", policy=save_collectives_and_matmuls)
    fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=MIN_WEIGHT_SIZE)
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    predicted = report.bytes_per_rank()[rank]
    if rank == 0:
        whole = sum(p.numel() * p.element_size() for p in reference.parameters())
        print(f"rank 0 holds {held} parameter bytes (predicted {predicted}) of the model's {whole}")

    # 3. Train: each dp rank takes its rows of the batch; the dp-average loss is the batch's.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    dp_rank = mesh["dp"].get_local_rank()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    losses, single = [], []
    for step in range(steps):
        tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), device=device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        loss = F.cross_entropy(model(inputs[rows]).flatten(0, 1), targets[rows].flatten())
        ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
        for opt, value in ((optimizer, loss), (ref_optimizer, ref_loss)):
            value.backward()
            opt.step()
            opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())  # the batch's loss
        losses.append(mean.item() / dp)
        single.append(ref_loss.item())
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f} (single process {single[-1]:.6f})")

    # 4. The verdict: float32, so only the summation order differs.
    conclude([compare("loss per step", losses, single, rtol=1e-5, atol=1e-5, index_name="step")])


if __name__ == "__main__":
    launch(main, nproc=4)
