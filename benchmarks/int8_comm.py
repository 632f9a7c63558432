"""int8 sequence-parallel communication (``comm_dtype=torch.int8``) against float: bytes, error, loss curve.

Command (spawns gloo CPU ranks, world size 2 then 4, and prints two tables)::

    python3 benchmarks/int8_comm.py            # 200 training steps per world size (~2 min)
    python3 benchmarks/int8_comm.py --quick    # 20 steps (the smoke test)

Under ``torchrun --nproc-per-node N benchmarks/int8_comm.py`` the launcher's ranks are used.

The zoo Llama (``dim=256``, 2 blocks, 8 heads, vocabulary 256, sequences of 64) with its TP +
SP plan (``tensor_parallel_plan(sequence_parallel=True)``, the head leaving its logits
vocab-sharded for ``torch_tp.loss.cross_entropy``, so that every collective is a
sequence-parallel one or the loss's) and the same plan with ``comm_dtype=torch.int8``, both
from one seed, trained side by side with AdamW (lr 1e-3) on one stream of batches of a
synthetic language (each token followed by one of its 8 successors, chance alike: the loss
falls from ln 256 = 5.5 toward ln 8 = 2.1, and, as on text, never to 0).

Table 1 (one row per world size):

``bytes fp32``      bytes this rank hands gloo in one training step (forward, loss and
                    backward), counted by gloo (``torch_tp.testing.wire_bytes``), float
                    communication.
``bytes int8``      the same with ``comm_dtype=torch.int8``.
``ratio``           ``bytes int8 / bytes fp32``; per token ``(E + 4) / 4E`` (0.254 at E = 256).
``bf16 ratio``      ``bytes int8 / (bytes fp32 / 2)``: against bfloat16 activations.
``loss first``      the loss at the first step (the same for both: nothing was sent yet).
``loss last fp32``, ``loss last int8``   each run's loss at the last step.
``max diff / first``   the largest ``|loss int8 - loss fp32|`` over every step, over the first
                    loss: the curves' distance against the curve's scale.
``max diff / loss`` the largest ``|loss int8 - loss fp32| / loss fp32`` over every step:
                    pointwise, which grows where the loss is small (the end of a run).

Table 2 (world size 2, the first batch, before any step): each layer's output error with
int8 communication against float communication, ``max |int8 - fp32| / max |fp32|`` over
its local output (the same layers, the same weights).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from torch_tp import ColwiseParallel, parallelize_module
from torch_tp.launch import rank_device
from torch_tp.loss import cross_entropy
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import wire_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _driver import RunConfig, markdown_table, parse_arguments, report_header, run_worlds  # noqa: E402

CURVE = ("world", "bytes fp32", "bytes int8", "ratio", "bf16 ratio", "loss first", "loss last fp32", "loss last int8",
         "max diff / first", "max diff / loss")
LAYERS = ("layer", "output error")
VOCAB, SEQ, BATCH = 256, 64, 4


@dataclass(frozen=True)
class Config(RunConfig):
    steps: int = 200


def _plan(**options) -> dict:
    """The TP + SP plan, its head leaving the logits vocab-sharded for the vocab-parallel loss
    (no logits gather: every collective left is a sequence-parallel one, and the loss's own)."""
    plan = tensor_parallel_plan(sequence_parallel=True, **options)
    plan["output"] = ColwiseParallel(input_layouts=Shard(1), use_local_output=False, **options)
    return plan


def _models(mesh):
    torch.manual_seed(0)
    reference = Transformer(ModelArgs(dim=256, n_layers=2, n_heads=8, vocab_size=VOCAB, ffn_hidden=512, max_seq_len=SEQ))
    return [parallelize_module(copy.deepcopy(reference), mesh, _plan(**options)) for options in ({}, dict(comm_dtype=torch.int8))]


def _loss(model, tokens, targets):
    return cross_entropy(model(tokens), targets)


#: A language with structure to learn that, like text, stays uncertain: each token is followed by
#: one of its 8 successors (fixed, chance alike), so the loss falls from ln 256 toward ln 8.
_SUCCESSORS = torch.randint(0, VOCAB, (VOCAB, 8), generator=torch.Generator().manual_seed(1234))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, next tokens) of ``BATCH`` sequences of the successor language."""
    generator = torch.Generator().manual_seed(step)
    text = [torch.randint(0, VOCAB, (BATCH,), generator=generator)]
    choices = torch.randint(0, 8, (BATCH, SEQ), generator=generator)
    for position in range(SEQ):
        text.append(_SUCCESSORS[text[-1], choices[:, position]])
    text = torch.stack(text, dim=1)
    return text[:, :-1], text[:, 1:]


def _layer_errors(models) -> list[dict]:
    outputs: list[dict[str, torch.Tensor]] = [{}, {}]
    hooks = []
    for seen, model in zip(outputs, models):
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and name.startswith(("tok", "layers.0", "output")):
                def keep(module, inputs, output, name=name, seen=seen):
                    seen[name] = (output.to_local() if isinstance(output, DTensor) else output).detach()
                hooks.append(module.register_forward_hook(keep))
    with torch.no_grad():
        for model in models:
            model(_batch(0)[0].to(rank_device()))
    for hook in hooks:
        hook.remove()
    rows = []
    for name, want in outputs[0].items():
        error = (outputs[1][name] - want).abs().max() / want.abs().max()
        rows.append({"layer": name, "output error": f"{error.item():.2e}"})
    return rows


def _train_step(model, optimizer, step: int) -> float:
    tokens, targets = (t.to(rank_device()) for t in _batch(step))
    loss = _loss(model, tokens, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def rank_main(config: Config) -> None:
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    models = _models(mesh)
    layers = _layer_errors(models) if dist.get_world_size() == 2 else []
    tokens, targets = (t.to(rank_device()) for t in _batch(0))
    sent = [sum(wire_bytes(lambda m=m: _loss(m, tokens, targets).backward()).values()) for m in models]
    for model in models:
        model.zero_grad()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    curves = [[_train_step(m, o, step) for step in range(config.steps)] for m, o in zip(models, optimizers)]
    pointwise = max(abs(i - f) / f for f, i in zip(*curves))
    scaled = max(abs(i - f) for f, i in zip(*curves)) / curves[0][0]
    if os.environ.get("INT8_COMM_CURVES") and dist.get_rank() == 0:
        print(json.dumps(curves), file=sys.stderr)
    row = {"world": str(dist.get_world_size()), "bytes fp32": str(sent[0]), "bytes int8": str(sent[1]),
           "ratio": f"{sent[1] / sent[0]:.3f}", "bf16 ratio": f"{2 * sent[1] / sent[0]:.3f}",
           "loss first": f"{curves[0][0]:.4f}", "loss last fp32": f"{curves[0][-1]:.4f}",
           "loss last int8": f"{curves[1][-1]:.4f}", "max diff / first": f"{100 * scaled:.2f}%",
           "max diff / loss": f"{100 * pointwise:.2f}%"}
    if dist.get_rank() == 0:
        with open(config.result_path, "w") as f:
            json.dump([{"kind": "curve", **row}] + [{"kind": "layer", **r} for r in layers], f)


def main(argv: list[str] | None = None) -> None:
    options = parse_arguments(argv, __file__, __doc__, iters=(200, 20), warmup=(0, 0), what="world size",
                              quick="20 training steps")
    rows = run_worlds(rank_main, Config(iters=options.iters, warmup=0, steps=options.iters), options.world_sizes,
                      "float and int8 communication, side by side")
    if not rows:
        return
    print(report_header(options))
    print(markdown_table(CURVE, [tuple(r[c] for c in CURVE) for r in rows if r["kind"] == "curve"]))
    print()
    print(markdown_table(LAYERS, [tuple(r[c] for c in LAYERS) for r in rows if r["kind"] == "layer"]))


if __name__ == "__main__":
    main()
