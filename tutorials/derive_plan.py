"""Tutorial: derive a tensor-parallel plan from a model's dataflow, verify it, train with it.

Run on 2 CPU ranks (gloo)::

    python tutorials/derive_plan.py

or on GPUs::

    torchrun --nproc-per-node 2 tutorials/derive_plan.py

The model below ships no plan and its names are its own (``mix``, ``fold``, ``widen``,
``narrow``): no list of module names knows them. ``suggest_plan`` exports it with
``torch.export`` and follows each linear layer's output features through the graph:

1. Derive: ``suggest_plan(model, mesh, example_inputs)`` gives a plan (a dict) whose table says,
   for every linear layer, the style and why; the fused ``[q; k; v]`` projection is split part
   by part (``packed=3``).
2. Verify: ``verify_plan`` takes the plan as it is and compares outputs, every gradient and
   the updated parameters with the single-process model over a few steps.
3. Train: ``parallelize_module(model, mesh, plan)`` and train beside the single-process model:
   the losses agree step by step (the last line says whether they do; the exit status is 1
   if not).
"""

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import parallelize_module, suggest_plan, verify_plan
from torch_tp._verdict import compare, conclude
from torch_tp.launch import launch, rank_device

DIM, HEADS, TOKENS = 64, 4, 16


class Block(nn.Module):
    """Attention through one fused projection, then an MLP; LayerNorms and residuals."""

    def __init__(self):
        super().__init__()
        self.pre, self.post = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.mix, self.fold = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)  # [q; k; v], then out
        self.widen, self.narrow = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p.view(b, t, -1, DIM // HEADS).transpose(1, 2) for p in self.mix(self.pre(x)).chunk(3, dim=-1))
        x = x + self.fold(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        return x + self.narrow(F.gelu(self.widen(self.post(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(128, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.logits = nn.Linear(DIM, 128)

    def forward(self, tokens):
        return self.logits(self.blocks(self.embed(tokens)))


def build():
    torch.manual_seed(0)  # the same weights on every rank
    return Model().to(rank_device())


def batch(step):
    generator = torch.Generator().manual_seed(step)  # the same tokens on every rank
    return (torch.randint(0, 128, (2, TOKENS), generator=generator).to(rank_device()),)


def loss_of(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def main():
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    leader = dist.get_rank() == 0

    # 1. Derive the plan from the dataflow.
    plan = suggest_plan(build(), mesh, batch(0))
    if leader:
        print(f"== the derived plan\n{plan}\n")

    # 2. Verify it against the single-process model.
    report = verify_plan(build, mesh, plan, batch, loss_fn=lambda logits: logits.square().mean(), steps=2)
    if leader:
        print(f"== verify_plan\n{report}\n")

    # 3. Train with it, beside the single-process model.
    reference, model = build(), parallelize_module(build(), mesh, plan)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    optimizers = [sgd(reference.parameters()), sgd(model.parameters())]
    single, parallel = [], []
    for step in range(5):
        (tokens,) = batch(100 + step)
        losses = [loss_of(m(tokens), tokens) for m in (reference, model)]
        for loss, optimizer in zip(losses, optimizers):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        single.append(losses[0].item())
        parallel.append(losses[1].item())
        if leader:
            print(f"step {step}: loss {losses[1].item():.6f} (one process: {losses[0].item():.6f})")
    worst = max(abs(a - b) for a, b in zip(parallel, single))
    if leader:
        print(f"trains like one process: largest loss difference {worst:.2e} over 5 SGD steps")
    conclude([compare("loss per step", parallel, single, atol=1e-5, index_name="step")])


if __name__ == "__main__":
    launch(main, nproc=2)
