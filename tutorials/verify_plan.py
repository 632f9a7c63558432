"""Tutorial: verify a tensor-parallel plan against the single-process model before a long run.

Run on 2 CPU ranks (gloo)::

    python tutorials/verify_plan.py

or on GPUs::

    torchrun --nproc-per-node 2 tutorials/verify_plan.py

A plan that every check accepts can still train a different model: a per-head norm left
out of the plan only sees this rank's heads' gradient, a parallelization that registers a
new Parameter unties a shared embedding. ``verify_plan`` builds a small config of the model
twice on every rank, once whole and once parallelized, trains both for a few steps on the
same tokens, and compares every output, gradient and updated parameter.

1. Verify torch_tp's plan for a Qwen3-style Llama (per-head q_norm/k_norm): OK.
2. Verify the same plan without the norms: the report names them and says what to change.
3. Verify any parallelization, here upstream's parallelize_module on a tied model: the
   broken tie is flagged.

The last line says whether torch_tp's plan (1.) matches one process and the two wrong ones
were caught (the exit status is 1 if not).
"""

import functools

import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as upstream
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import verify_plan
from torch_tp._verdict import check, conclude
from torch_tp.launch import launch, rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan

# A small config of the real model: the reference is a full copy on every rank.
QWEN_LIKE = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=48, max_seq_len=16, qk_norm=True)
TIED = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=48, max_seq_len=16, tie_embeddings=True)


def build(args):
    return Transformer(args).to(rank_device())


def tokens(step):
    # verify_plan seeds torch's RNG before each call, so every rank draws the same tokens
    return (torch.randint(0, 64, (2, 8), device=rank_device()),)


def show(title, report):
    if dist.get_rank() == 0:
        print(f"== {title}\n{report}\n")


def main():
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)

    # 1. The right plan: ReplicateParallel(input_layouts=Shard(2)) on q_norm/k_norm.
    right = verify_plan(
        functools.partial(build, QWEN_LIKE), mesh, tensor_parallel_plan(qk_norm=True), tokens,
        steps=3, optimizer=adamw, raise_on_mismatch=False,
    )
    show("torch_tp's plan with qk_norm=True", right)

    # 2. The norms left out: the first forward is right, their gradients are not (one step
    # shows it; by default verify_plan would go on until no new parameter moves).
    no_norms = verify_plan(
        functools.partial(build, QWEN_LIKE), mesh, tensor_parallel_plan(), tokens,
        steps=1, optimizer=adamw, raise_on_mismatch=False,
    )
    show("the same plan without the per-head norms", no_norms)

    # 3. Any parallelization is a callable plan(model, mesh) -> model.
    upstream_plan = tensor_parallel_plan(styles=upstream)
    untied = verify_plan(
        functools.partial(build, TIED), mesh,
        lambda model, mesh: upstream.parallelize_module(model, mesh, upstream_plan), tokens,
        optimizer=adamw, raise_on_mismatch=False,
    )
    show("upstream's parallelize_module on a tied-embedding model", untied)

    # The verdict: the right plan trains like one process (no finding, within verify_plan's
    # atol/rtol); each wrong one has findings (0 would mean verify_plan missed what it breaks).
    conclude([
        check("verify_plan findings for torch_tp's plan", len(right.findings), 0),
        check("wrong plans verify_plan let through", int(no_norms.ok) + int(untied.ok), 0),
    ])


if __name__ == "__main__":
    launch(main, nproc=2)
