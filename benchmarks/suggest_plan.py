"""Plans derived from the dataflow: the bytes they split and the step time, vs shipped plans and replicated.

Command (spawns 2 gloo CPU ranks and prints one table)::

    python3 benchmarks/suggest_plan.py            # 20 timed steps per row (~60 s)
    python3 benchmarks/suggest_plan.py --quick    # 3 steps, 4 models (the smoke test)

Under ``torchrun --nproc-per-node 2 benchmarks/suggest_plan.py`` the launcher's ranks are used.

For each model, ``torch_tp.suggest_plan`` derives a plan from its ``torch.export`` graph on
the benchmark's batch; the model is then trained (forward, backward, SGD step) with that plan,
with the plan it ships where it ships one (the zoo Llama's ``tensor_parallel_plan``,
transformers' Qwen3 through ``integrations.transformers.tp_plan``), and replicated (every rank
computes the whole model: no plan). Models: the zoo Llama (also with ``sequence_parallel=True``
against its shipped sequence-parallel plan), the zoo MLP-Mixer and timm-style ViT (no plan of
their own), and, when transformers is installed, BERT and GPT-2 (no plan) and Qwen3 (a shipped
plan), built from their configs. Columns (rank 0's wall times; a barrier before each step):

``plan``          derived, shipped or replicated.
``bytes split``   the share of the parameter bytes that are sharded DTensors once the plan is
                  applied (read off the parallel model, for every plan alike).
``derive ms``     the time ``suggest_plan`` took (export, the rules, the probe forward).
``step ms``       median of a training step.
``vs replicated`` replicated step time / this row's (above 1: faster than computing it all).
``same layers``   for a shipped plan: whether the derived plan splits every linear layer it
                  splits, with the same style.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from torch_tp import parallelize_module, suggest_plan
from torch_tp.launch import rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.models.mixer import mlp_mixer
from torch_tp.models.vit import vit
from torch_tp.parallel import match_pattern

# _driver.py is next to this script, whose directory running it (python3 or torchrun) puts first
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _driver import RunConfig, markdown_table, parse_arguments, report_header, run_world, world_sizes  # noqa: E402

COLUMNS = ("model", "plan", "bytes split", "derive ms", "step ms", "vs replicated", "same layers")


@dataclass(frozen=True)
class Config(RunConfig):
    quick: bool = False


class _Output(nn.Module):
    """A transformers model with one tensor as its output (logits, or the last hidden state)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _models(quick: bool) -> list[tuple[str, nn.Module, torch.Tensor, dict | None, bool]]:
    """(name, model, batch, the plan it ships or None, sequence parallel), each built from seed 0.
    ``quick`` (the smoke test) keeps the zoo Llama, the Mixer, BERT and Qwen3: the ViT's derivation
    spends ~15 s in DTensor's sharding propagation through CPU attention (its probe on DTensors),
    and the unit tests derive it, GPT-2 and the sequence-parallel Llama (``tests/parallel/
    test_suggest.py``, ``tests/integrations/test_suggest_transformers.py``)."""
    torch.manual_seed(0)
    llama = Transformer(ModelArgs(dim=128, n_layers=2, n_heads=8, vocab_size=256, ffn_hidden=256, max_seq_len=64))
    tokens = torch.randint(0, 256, (4, 64))
    models = [("zoo Llama", llama, tokens, tensor_parallel_plan(), False)]
    if not quick:
        models.append(("zoo Llama, sequence parallel", llama, tokens, tensor_parallel_plan(sequence_parallel=True), True))
    models.append(("zoo MLP-Mixer", mlp_mixer(image_size=64, patch=8, dim=128), torch.randn(8, 3, 64, 64), None, False))
    if not quick:
        models.append(("zoo ViT (timm's)", vit(image_size=64, patch=8, dim=128, num_heads=8), torch.randn(8, 3, 64, 64), None, False))
    try:
        import transformers
    except ImportError:
        return models
    from torch_tp.integrations.transformers import tp_plan

    sizes = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, intermediate_size=256)
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                                          attention_probs_dropout_prob=0.0, **sizes))
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(vocab_size=256, max_position_embeddings=64, head_dim=16,
                                                                   num_key_value_heads=4, use_cache=False, **sizes))
    qwen3.config._attn_implementation = "sdpa"
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=128, n_layer=2, n_head=8, vocab_size=256, n_positions=64, use_cache=False, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    gpt2_row = [] if quick else [("transformers GPT-2", _Output(gpt2), tokens, None, False)]
    return models + [("transformers BERT", _Output(bert), tokens, None, False), *gpt2_row,
                     ("transformers Qwen3", _Output(qwen3), tokens, _prefixed(tp_plan(qwen3), "model."), False)]


def _prefixed(plan: dict, prefix: str) -> dict:
    return {prefix + key: style for key, style in plan.items()}


def _split_share(model: nn.Module) -> float:
    params = list({id(p): p for p in model.parameters()}.values())
    total = sum(p.numel() * p.element_size() for p in params)
    split = sum(p.numel() * p.element_size() for p in params
                if isinstance(p, DTensor) and any(q.is_shard() for q in p.placements))
    return split / total


def _step_ms(model: nn.Module, batch: torch.Tensor, config: RunConfig) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for step in range(config.warmup + config.iters):
        dist.barrier()
        began = time.perf_counter()
        model(batch).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= config.warmup:
            times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def _same_layers(reference: nn.Module, derived: dict, shipped: dict) -> str:
    names = [name for name, m in reference.named_modules() if isinstance(m, nn.Linear)]
    pairs = [(derived.get(n), next((s for p, s in shipped.items() if match_pattern(p, [n])), None)) for n in names]
    pairs = [(d, s) for d, s in pairs if type(s).__name__ in ("ColwiseParallel", "RowwiseParallel")]
    same = all(type(d).__name__ == type(s).__name__ for d, s in pairs)
    return f"{'yes' if same else 'NO'} ({len(pairs)} layers)"


def rank_main(config: Config) -> None:
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    rows = []
    for name, reference, batch, shipped, sequence_parallel in _models(config.quick):
        reference, batch = reference.to(rank_device()), batch.to(rank_device())
        began = time.perf_counter()
        derived = suggest_plan(reference, mesh, (batch,), sequence_parallel=sequence_parallel)
        derive_ms = 1e3 * (time.perf_counter() - began)
        replicated_ms = _step_ms(copy.deepcopy(reference), batch, config)
        plans = [("derived", derived)] + ([("shipped", shipped)] if shipped is not None else [])
        rows.append({"model": name, "plan": "replicated", "bytes split": "0.0%", "derive ms": "",
                     "step ms": f"{replicated_ms:.2f}", "vs replicated": "1.00", "same layers": ""})
        for kind, plan in plans:
            model = parallelize_module(copy.deepcopy(reference), mesh, plan)
            ms = _step_ms(model, batch, config)
            rows.append({"model": name, "plan": kind, "bytes split": f"{100 * _split_share(model):.1f}%",
                         "derive ms": f"{derive_ms:.0f}" if kind == "derived" else "", "step ms": f"{ms:.2f}",
                         "vs replicated": f"{replicated_ms / ms:.2f}",
                         "same layers": _same_layers(reference, derived, shipped) if kind == "shipped" else ""})
    if dist.get_rank() == 0:
        with open(config.result_path, "w") as f:
            json.dump(rows, f)


def main(argv: list[str] | None = None) -> None:
    options = parse_arguments(argv, __file__, __doc__, iters=(20, 3), warmup=(3, 1), what="plan",
                              quick="3 timed steps per row")
    nproc = world_sizes("2")[0]
    rows = run_world(rank_main, nproc, Config(iters=options.iters, warmup=options.warmup, quick=options.quick))
    if not rows:
        return
    print(report_header(options, ranks=f"{nproc} ranks"))
    print(markdown_table(COLUMNS, [tuple(row[c] for c in COLUMNS) for row in rows]))


if __name__ == "__main__":
    main()
