"""Tutorial: a Hugging Face transformers model, parallelized from the plan it carries.

Run on 2 CPU ranks (gloo)::

    python tutorials/transformers_tensor_parallel.py

or under torchrun (NCCL on GPUs, gloo on CPU)::

    torchrun --nproc-per-node 2 tutorials/transformers_tensor_parallel.py

Every transformers model class carries a tensor-parallel plan in transformers' own
vocabulary (``"colwise"``, ``"rowwise"``, ...). ``torch_tp.integrations.transformers``
translates it into torch_tp styles and applies it. The tiny Qwen3 here (per-head
``q_norm``/``k_norm``) is built from its config, so nothing is downloaded:

1. ``explain_plan`` of the translated plan on a ``meta`` copy: what every rank will hold.
2. Tensor + sequence parallel training with vocab-sharded logits and
   ``torch_tp.loss.cross_entropy``, beside a single-process copy trained with
   ``F.cross_entropy``: the losses match.
3. ``verify_plan`` on the translated plan: every output, gradient and updated parameter.
4. Greedy generation with a KV cache from a plain tensor-parallel copy: the same tokens
   as one process.

The last line says whether all of it matched one process (the exit status is 1 if not). It
needs transformers (and accelerate)::

    pip install -e ".[transformers]"
"""

import copy
import functools
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

try:
    from transformers import Qwen3Config, Qwen3ForCausalLM
except ModuleNotFoundError as missing:  # transformers is an optional extra of torch_tp
    sys.exit(
        f"tutorials/transformers_tensor_parallel.py needs the transformers package ({missing}); install "
        'torch_tp\'s transformers extra from the checkout: pip install -e ".[transformers]"'
    )

from torch_tp import explain_plan, verify_plan
from torch_tp._verdict import check, compare, conclude
from torch_tp.integrations.transformers import parallelize, tp_plan
from torch_tp.launch import launch, rank_device
from torch_tp.loss import cross_entropy

VOCAB = 128
# 8 query heads of 8 and 4 key/value heads: whole heads on 2 or 4 ranks
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=8, max_position_embeddings=64, use_cache=False)
# tensor + sequence parallel, and the logits left sharded on the vocab for the loss
OPTIONS = dict(sequence_parallel=True, vocab_parallel_loss=True)


def build(device):
    with torch.device(device):
        return Qwen3ForCausalLM(Qwen3Config(**CONFIG))


def main(steps=5):
    rank, device = dist.get_rank(), rank_device()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))

    # 1. The model's own plan, translated: q/k/v/gate/up colwise, o/down rowwise, the per-head
    #    norms replicated with their gradients summed, the decoder norms on sequence shards.
    #    A meta copy has shapes only, so this costs nothing for a model of any size.
    shapes_only = build("meta")
    plan = tp_plan(shapes_only, **OPTIONS)
    if rank == 0:
        print(explain_plan(shapes_only, mesh, plan), "\n")

    # 2. The same weights on every rank (seed 0): one copy stays whole, one is parallelized.
    torch.manual_seed(0)
    reference = build(device)
    model = parallelize(copy.deepcopy(reference), mesh, **OPTIONS)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, reference)]
    generator = torch.Generator().manual_seed(0)
    losses, single = [], []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (2, 16), generator=generator).to(device)
        targets = (5 * ids + 3) % VOCAB  # every rank sees the same batch
        logits = model(ids).logits  # a DTensor sharded on the vocab: never gathered
        loss = cross_entropy(logits, targets, label_smoothing=0.1)
        want = F.cross_entropy(reference(ids).logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1)
        for value, optimizer in zip((loss, want), optimizers):
            value.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        single.append(want.item())
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f} (single process {single[-1]:.6f})")

    # 3. verify_plan builds the model twice more on every rank, trains both copies and compares
    #    them tensor by tensor (its outputs are made whole, so any scalar loss will do).
    report = verify_plan(
        functools.partial(build, device), mesh, plan, lambda step: (torch.randint(0, VOCAB, (2, 8), device=device),),
        loss_fn=lambda out: out.logits.float().pow(2).mean(), steps=2, raise_on_mismatch=False,
    )
    if rank == 0:
        print(report)

    # 4. Generation: one new token does not split over the ranks, so use plain tensor
    #    parallelism (gathered logits); each rank caches its own key/value heads.
    reference.eval()
    generating = parallelize(copy.deepcopy(reference), mesh)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=generator).to(device)
    greedy = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    ours, theirs = generating.generate(prompt, **greedy), reference.generate(prompt, **greedy)
    if rank == 0:
        print(f"greedy tokens: {ours[0].tolist()} (single process {theirs[0].tolist()})")

    # 5. The verdict: the losses (vocab-parallel vs F.cross_entropy, float32), verify_plan's
    #    findings, and the generated tokens (exactly).
    conclude([
        compare("loss per step", losses, single, atol=1e-4, index_name="step"),
        check("verify_plan findings", len(report.findings), 0),
        compare("greedy tokens", ours, theirs, index_name="token"),
    ])


if __name__ == "__main__":
    launch(main, nproc=2)
