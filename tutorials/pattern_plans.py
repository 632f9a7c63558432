"""Tutorial: tensor-parallel plans with patterns, and the errors that keep them honest.

Run on 2 CPU ranks (gloo)::

    python tutorials/pattern_plans.py

or on GPUs::

    torchrun --nproc-per-node 2 tutorials/pattern_plans.py

1. Build a small model with BERT-like module paths.
2. Parallelize it with a plan whose keys are globs over the full dotted path.
3. See what a typo in a plan key does: an error naming the closest real paths.
4. Check the parallel model against the single-process one (the last line says whether they
   match; the exit status is 1 if not).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp._verdict import compare, conclude
from torch_tp.launch import launch, rank_device


class SelfAttention(nn.Module):
    """Multi-head attention. Colwise sharding splits query/key/value features, so each rank
    holds whole heads: everything between the colwise and rowwise layers must work per head
    (a single-head attention would contract q.k over features split across ranks)."""

    def __init__(self, dim, head_dim=4):
        super().__init__()
        self.head_dim = head_dim
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        def heads(t):  # (batch, seq, local features) -> (batch, local heads, seq, head_dim)
            return t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim**0.5, dim=-1)
        return self.out((scores @ v).transpose(1, 2).flatten(-2))


class Encoder(nn.Module):
    def __init__(self, dim=16, layers=2):
        super().__init__()
        self.layer = nn.ModuleList(nn.ModuleDict({"self": SelfAttention(dim)}) for _ in range(layers))

    def forward(self, x):
        for block in self.layer:
            x = x + block["self"](x)
        return x


# '*' crosses dots, so one key reaches every layer, however deep.
PLAN = {
    "*self.[qkv]*": ColwiseParallel(),  # query, key, value
    "*self.out": RowwiseParallel(),
}


def main():
    rank = dist.get_rank()
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    torch.manual_seed(0)
    reference = Encoder().to(rank_device())
    model = copy.deepcopy(reference)

    # 1. A typo is an error that names the closest paths, and leaves the model untouched.
    try:
        parallelize_module(model, mesh, {"*self.qurey": ColwiseParallel()})
    except ValueError as err:
        if rank == 0:
            print(f"typo in a plan key -> ValueError:\n  {err}\n")

    # 2. The real plan.
    parallelize_module(model, mesh, PLAN)
    if rank == 0:
        print("parameters after parallelize_module:")
        for name, param in model.named_parameters():
            if name.startswith("layer.0."):
                print(f"  {name:28s} {str(param.placements):16s} local {tuple(param.to_local().shape)}")

    # 3. Same numbers as one process.
    x = torch.randn(2, 5, 16, device=rank_device())
    with torch.no_grad():
        output, single = model(x), reference(x)
    diff = (output - single).abs().max().item()
    if rank == 0:
        print(f"\nmax |parallel - single process| = {diff:.2e}")
    conclude([compare("outputs", output, single, atol=1e-5)])


if __name__ == "__main__":
    launch(main, nproc=2)
