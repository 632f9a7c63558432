"""Tutorial: tensor + sequence parallelism for a Llama-style model, from meta device to training.

Run on 2 CPU ranks (gloo)::

    python tutorials/llama_tensor_parallel.py

or on GPUs (NCCL)::

    torchrun --nproc-per-node 2 tutorials/llama_tensor_parallel.py

The flow is the one a model too big for one device needs: build it on ``meta`` (shapes
only), check the plan with ``explain_plan``, parallelize, let each rank allocate and
initialize only its shards, train beside the same model in one process: the losses match
step by step (the last line says whether they do; the exit status is 1 if not).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import explain_plan, init_parameters, parallelize_module
from torch_tp._verdict import compare, conclude
from torch_tp.launch import launch, rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan


def main(steps=10):
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, ffn_hidden=128)

    # 1. Shapes only: nothing is allocated yet.
    with torch.device("meta"):
        model = Transformer(args)

    # 2. The plan: attention/feed-forward weights sharded, norms on sequence shards.
    #    explain_plan shows what every rank will hold, before anything happens.
    plan = tensor_parallel_plan(sequence_parallel=True)
    if rank == 0:
        print(explain_plan(model, mesh["tp"], plan), "\n")

    # 3. Parallelize, then allocate and initialize only this rank's shards. The values
    #    are those a single process would get from init_parameters(model, seed=0).
    parallelize_module(model, mesh["tp"], plan)
    model.to_empty(device=device)
    init_parameters(model, seed=0)

    # 4. Train as usual: every rank sees the same batch; DTensor does the communication.
    #    Beside it, the whole model in one process (each rank has its own copy), from the
    #    same init_parameters values: the losses must agree step by step.
    reference = Transformer(args).to(device)
    init_parameters(reference, seed=0)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, reference)]
    generator = torch.Generator().manual_seed(0)
    losses, single = [], []
    for step in range(steps):
        tokens = torch.randint(0, args.vocab_size, (4, 16), generator=generator).to(device)
        targets = (5 * tokens + 3) % args.vocab_size  # a learnable mapping
        for m, optimizer, record in zip((model, reference), optimizers, (losses, single)):
            loss = F.cross_entropy(m(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            record.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f} (single process {single[-1]:.4f})")

    # 5. Each rank holds only its shards (and the small replicated norm weights).
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    per_rank = [None] * world
    dist.all_gather_object(per_rank, local_bytes)
    if rank == 0:
        for r, nbytes in enumerate(per_rank):
            print(f"rank {r} holds {nbytes} parameter bytes")

    # 6. The verdict: float32, so only the summation order differs.
    conclude([compare("loss per step", losses, single, rtol=1e-5, index_name="step")])


if __name__ == "__main__":
    launch(main, nproc=2)
