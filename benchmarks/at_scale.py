"""Llama-3-8B on 8 GPUs and Llama-3-70B on 64 GPUs, on paper: per-rank parameter bytes and per-step communication time.

Command (prints three tables; the third spawns gloo CPU ranks)::

    python3 benchmarks/at_scale.py            # measures the small model at world sizes 2 and 4
    python3 benchmarks/at_scale.py --quick    # world size 2 only, TP + SP and FSDP (the smoke test)

Nothing here runs on a GPU. The figures are exact where they are arithmetic on shapes, and
estimates where they are times:

**Table 1, parameter bytes per rank** (exact): the zoo ``Transformer``
(``torch_tp.models.llama``) built on ``meta`` in bfloat16 at Llama-3's sizes, its ``wk``/``wv``
resized to 8 KV heads (the zoo has no grouped-query attention; the plan and the prediction read
shapes only), with the zoo plan (``tensor_parallel_plan``, with and without
``sequence_parallel``). ``predicted`` is ``explain_plan(model, tp, plan)`` on a 1-D TP layout and
``predict_placements(model, {"dp": dp, "tp": tp}, plan, "layers.*")`` (the default
``min_weight_size``) on a 2-D one: rank 0's bytes (every rank holds the same: every size
divides). ``arithmetic`` is the same figure from the sizes alone (this file's
:func:`arithmetic_bytes`, no torch_tp code), and ``agree`` compares the two. int8 weights:
``quantize_weights(model)`` (every ``nn.Linear`` and the embedding:
``Int8SymmetricTensor``, int8 ``qdata`` and one float32 scale per row).

**Table 2, communication per training step** (estimates): the collectives of one forward and
backward, from an analytic model (:func:`tp_collectives`, :func:`fsdp_collectives`) of the
plans, checked against a measured small model in table 3. Each collective is named by the
bytes of its full tensor ``B`` (the gathered output, the reduce-scatter input, the all-reduced
tensor) and timed as NCCL's ring algorithms move it over a group of ``n`` ranks at bandwidth
``bw``: all-gather and reduce-scatter ``(n - 1) / n * B / bw``, all-reduce
``2 (n - 1) / n * B / bw``; one after another, nothing overlapped (an upper bound on exposed
communication; latency not counted). ``compute ms`` is context: the step's matmul FLOPs per GPU
(``6 P T / tp`` for the ``P`` parameters of the linear layers, plus ``6 L T^2 D / tp`` for causal
attention) at the GPU's peak.

**Table 3, the model checked**: the zoo Llama at ``dim 64``, 4 heads, ``ffn 128``, vocabulary
128, 16 tokens x 2 sequences, bfloat16, 1 and 2 layers, run on gloo ranks: collective counts
from ``communication_of`` and bytes from ``wire_bytes`` (what gloo was handed: an all-gather's
input, ``B / n``; a reduce-scatter's input, ``B``, which gloo runs as an all-reduce), next to
the same functions' prediction for that model. The scaling in table 2 is those functions at
Llama-3's sizes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

from torch_tp import explain_plan, fully_shard_by_pattern, parallelize_module, predict_placements
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import communication_of, quantize_weights, wire_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _driver import RunConfig, markdown_table, progress, run_worlds  # noqa: E402

#: Published bandwidths (assumptions; see docs/at_scale.md for the sources).
NVLINK_BW = 450e9  # NVLink 4, H100/H200 SXM: 900 GB/s total, 450 GB/s per direction, per GPU
IB_BW = 50e9  # InfiniBand NDR, 400 Gb/s per GPU (one ConnectX-7 per GPU)
PEAK_FLOPS = 989e12  # H100/H200 SXM, dense bfloat16 tensor-core peak
GPUS_PER_NODE = 8
TOKENS = 8192  # one sequence of 8192 tokens per TP group per step
ACT_BYTES = 2  # bfloat16 activations (and parameters)


@dataclass(frozen=True)
class Llama3:
    """Llama-3's sizes (Meta's model cards / params.json)."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


LLAMA3_8B = Llama3("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256)
LLAMA3_70B = Llama3("Llama-3-70B", 8192, 80, 64, 8, 28672, 128256)
#: the measured small model (kv heads = heads: the zoo's own attention)
SMALL = Llama3("small", 64, 1, 4, 4, 128, 128)
SMALL_BATCH, SMALL_SEQ, SMALL_MIN_WEIGHT = 2, 16, 1024  # norms (64) replicated over dp, matrices sharded


@dataclass(frozen=True)
class Layout:
    model: Llama3
    gpus: int
    tp: int
    dp: int  # FSDP over dp when fsdp, else replicas (the memory is one replica's)
    sequence_parallel: bool
    fsdp: bool

    @property
    def name(self) -> str:
        tp = f"TP {self.tp}" + (" + SP" if self.sequence_parallel else "")
        if self.fsdp:
            return f"FSDP dp {self.dp} x {tp}"
        return tp if self.dp == 1 else f"{tp} (x {self.dp} replicas)"


LAYOUTS = [
    Layout(LLAMA3_8B, 8, 8, 1, False, False),
    Layout(LLAMA3_8B, 8, 8, 1, True, False),
    Layout(LLAMA3_8B, 8, 4, 2, True, True),
    Layout(LLAMA3_70B, 64, 8, 8, False, False),
    Layout(LLAMA3_70B, 64, 8, 8, True, False),
    Layout(LLAMA3_70B, 64, 8, 8, True, True),
]


@functools.lru_cache(maxsize=None)
def meta_llama(model: Llama3, *, n_layers: int | None = None, int8: bool = False, dtype=torch.bfloat16) -> nn.Module:
    """The zoo Transformer at ``model``'s sizes on ``meta``, ``wk``/``wv`` resized to its KV heads
    (built once per arguments: the tables only read it)."""
    args = ModelArgs(dim=model.dim, n_layers=n_layers or model.n_layers, n_heads=model.n_heads,
                     vocab_size=model.vocab_size, ffn_hidden=model.ffn_hidden, max_seq_len=16)
    with torch.device("meta"):
        built = Transformer(args).to(dtype)
        for layer in built.layers:
            for name in ("wk", "wv"):
                setattr(layer.attention, name, nn.Linear(model.dim, model.n_kv_heads * model.head_dim, bias=False, dtype=dtype))
    return quantize_weights(built) if int8 else built


# ------------------------------------------------------------------------ table 1: memory


def arithmetic_bytes(model: Llama3, *, tp: int, dp: int, fsdp: bool, int8: bool, elem: int = ACT_BYTES) -> int:
    """One rank's parameter bytes from the sizes alone (every sharded size divides).

    A column-wise weight ``(out, in)`` keeps ``out / tp`` rows (and FSDP, the dim TP left free,
    ``in / dp`` columns); a row-wise one ``in / tp`` columns (FSDP: ``out / dp`` rows); the
    embedding is row-wise on the vocabulary (rows). int8: a byte per element and a float32
    scale per local row. Norm weights (under ``min_weight_size``) are whole everywhere.
    """
    d, kv, f, v = model.dim, model.n_kv_heads * model.head_dim, model.ffn_hidden, model.vocab_size
    col = [(d, d), (kv, d), (kv, d), (f, d), (f, d)]  # wq wk wv w1 w3
    row = [(d, d), (d, f)]  # wo w2

    def local(rows: int, cols: int) -> int:
        return rows * cols + 4 * rows if int8 else rows * cols * elem

    split = dp if fsdp else 1
    layer = sum(local(r // tp, c // split) for r, c in col) + sum(local(r // split, c // tp) for r, c in row)
    norms = (2 * model.n_layers + 1) * d * elem
    assert d < 2**18  # the default min_weight_size: the norms stay replicated over dp
    embedding_and_head = 2 * local(v // tp, d // split)
    return model.n_layers * layer + norms + embedding_and_head


def _predicted(layout: Layout, model: nn.Module) -> tuple[int, ...]:
    plan = tensor_parallel_plan(sequence_parallel=layout.sequence_parallel)
    if layout.fsdp:
        return predict_placements(model, {"dp": layout.dp, "tp": layout.tp}, plan, "layers.*").bytes_per_rank()
    return explain_plan(model, layout.tp, plan).bytes_per_rank()


def memory_rows(layouts: list[Layout]) -> list[tuple[str, ...]]:
    rows = []
    for int8 in (False, True):
        models = {}
        for layout in layouts:
            if layout.model not in models:
                progress(f"table 1: {layout.model.name} on meta{' (int8 weights)' if int8 else ''} ...")
                models[layout.model] = meta_llama(layout.model, int8=int8)
            per_rank = _predicted(layout, models[layout.model])
            predicted = max(per_rank)
            arithmetic = arithmetic_bytes(layout.model, tp=layout.tp, dp=layout.dp, fsdp=layout.fsdp, int8=int8)
            agree = "yes" if predicted == arithmetic else f"NO ({predicted / arithmetic:.2f}x)"
            same = "" if len(set(per_rank)) == 1 else " (ranks differ)"
            rows.append((layout.model.name, str(layout.gpus), layout.name, "int8" if int8 else "bf16",
                         f"{predicted}{same}", f"{predicted / 2**30:.3f}", str(arithmetic), agree))
    return rows


# ------------------------------------------------------------------ table 2: communication


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of one kind over one mesh axis, each on a tensor of ``nbytes`` (full size)."""

    kind: str  # "all_gather", "reduce_scatter" or "all_reduce"
    axis: str  # "tp" or "dp"
    count: int
    nbytes: int


def tp_collectives(n_layers: int, tokens: int, dim: int, vocab: int, elem: int, *, sequence_parallel: bool) -> list[Collective]:
    """The zoo plan's collectives in one forward + backward (``tokens`` per TP group).

    Sequence parallel: per block 4 all-gathers (the attention and feed-forward inputs; the
    gradients of their outputs) and 4 reduce-scatters (``wo``'s and ``w2``'s outputs; the
    blocks' input gradients) of ``tokens x dim``; outside the blocks the embedding's
    reduce-scatter and its gradient's all-gather, the head's input all-gather and input-gradient
    reduce-scatter, and the all-gather of the replicated logits (``tokens x vocab``). Without
    it the pairs are all-reduces: 4 per block, 2 outside, and the logits' all-gather.
    """
    act, logits, blocks = tokens * dim * elem, tokens * vocab * elem, 4 * n_layers + 2
    if sequence_parallel:
        return [Collective("all_gather", "tp", blocks, act), Collective("all_gather", "tp", 1, logits),
                Collective("reduce_scatter", "tp", blocks, act)]
    return [Collective("all_reduce", "tp", blocks, act), Collective("all_gather", "tp", 1, logits)]


def fsdp_collectives(model: nn.Module, plan, *, tp: int, dp: int, min_weight_size: int) -> list[Collective]:
    """``fully_shard_by_pattern(model, mesh, "layers.*")``'s collectives in one forward + backward.

    Each unit (every block, and the root: embedding, final norm, head) all-gathers the
    parameters it shards over dp twice (forward, and again in backward: ``reshard_after_forward``)
    and reduce-scatters their gradients once; each parameter left replicated over dp (under
    ``min_weight_size``: the norms) has its gradient all-reduced over dp. Sizes are the TP-local
    shards (``explain_plan`` on the tp axis), in the parameters' dtype.
    """
    axes = {"dp": dp, "tp": tp} if tp > 1 else {"dp": dp}
    report = predict_placements(model, axes, plan if tp > 1 else None, "layers.*", min_weight_size=min_weight_size)
    tp_local = {row.path: row.bytes_per_rank[0] for row in (explain_plan(model, tp, plan) if tp > 1 else explain_plan(model, 1, {}))}
    units: dict[str, int] = {}
    trained: dict[str, int] = {}  # the gradients a unit reduce-scatters: frozen (int8) weights have none
    replicated = []
    for row in report:
        if row.name is None:
            continue
        unit = ".".join(row.path.split(".")[:2]) if row.path.startswith("layers.") else ""
        learns = model.get_parameter(row.path).requires_grad
        if row.dp_placement == Replicate():
            if learns:
                replicated.append(tp_local[row.path])
        else:
            units[unit] = units.get(unit, 0) + tp_local[row.path]
            trained[unit] = trained.get(unit, 0) + (tp_local[row.path] if learns else 0)
    out = []
    for nbytes in sorted(set(units.values())):
        out.append(Collective("all_gather", "dp", 2 * sum(1 for b in units.values() if b == nbytes), nbytes))
    for nbytes in sorted(set(trained.values()) - {0}):
        out.append(Collective("reduce_scatter", "dp", sum(1 for b in trained.values() if b == nbytes), nbytes))
    for nbytes in sorted(set(replicated)):
        out.append(Collective("all_reduce", "dp", replicated.count(nbytes), nbytes))
    return out


def ring_seconds(c: Collective, n: int, bandwidth: float) -> float:
    """NCCL ring time of ``c`` over ``n`` ranks: (n-1)/n B/bw (all-gather, reduce-scatter), 2(n-1)/n B/bw (all-reduce)."""
    factor = 2 if c.kind == "all_reduce" else 1
    return c.count * factor * (n - 1) / n * c.nbytes / bandwidth


def _counts(collectives: list[Collective]) -> str:
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    totals: dict[str, int] = {}
    for c in collectives:
        totals[short[c.kind]] = totals.get(short[c.kind], 0) + c.count
    return " ".join(f"{totals[k]} {k}" for k in ("AG", "RS", "AR") if k in totals)


def _by_key(collectives: list[Collective]) -> dict[tuple[str, str, int], int]:
    """``{(kind, axis, nbytes): count}``: a 2-layer step minus a 1-layer one is one block's collectives."""
    out: dict = {}
    for c in collectives:
        out[(c.kind, c.axis, c.nbytes)] = out.get((c.kind, c.axis, c.nbytes), 0) + c.count
    return out


def _step_collectives(layout: Layout, n_layers: int, model: nn.Module | None = None) -> list[Collective]:
    m = layout.model
    out = tp_collectives(n_layers, TOKENS, m.dim, m.vocab_size, ACT_BYTES, sequence_parallel=layout.sequence_parallel)
    if layout.fsdp:
        plan = tensor_parallel_plan(sequence_parallel=layout.sequence_parallel)
        out += fsdp_collectives(model, plan, tp=layout.tp, dp=layout.dp, min_weight_size=2**18)
    return out


def _compute_seconds(model: Llama3, tp: int) -> float:
    kv = model.n_kv_heads * model.head_dim
    linear = model.n_layers * (2 * model.dim * model.dim + 2 * kv * model.dim + 3 * model.dim * model.ffn_hidden)
    linear += model.vocab_size * model.dim  # the head (the embedding is a lookup)
    flops = 6 * linear * TOKENS + 6 * model.n_layers * TOKENS**2 * model.dim
    return flops / tp / PEAK_FLOPS


def communication_rows(layouts: list[Layout]) -> list[tuple[str, ...]]:
    """One row per layout (bf16 weights), and per 2-D layout once more with int8 weights: TP moves
    activations, the same either way; FSDP gathers the int8 shards and reduce-scatters no
    gradient of a frozen int8 weight."""
    cases = [(lay, False) for lay in layouts if lay.fsdp or lay.dp == 1] + [(lay, True) for lay in layouts if lay.fsdp]
    rows = []
    for layout, int8 in cases:
        m = layout.model
        model = meta_llama(m, int8=int8) if layout.fsdp else None
        one = _by_key(_step_collectives(layout, 1, meta_llama(m, n_layers=1, int8=int8) if layout.fsdp else None))
        two = _by_key(_step_collectives(layout, 2, meta_llama(m, n_layers=2, int8=int8) if layout.fsdp else None))
        per_layer = [Collective(kind, axis, n - one.get((kind, axis, nbytes), 0), nbytes)
                     for (kind, axis, nbytes), n in two.items() if n != one.get((kind, axis, nbytes), 0)]
        step = _step_collectives(layout, m.n_layers, model)
        dp_bw = NVLINK_BW if layout.tp * layout.dp <= GPUS_PER_NODE else IB_BW
        tp_s = sum(ring_seconds(c, layout.tp, NVLINK_BW) for c in step if c.axis == "tp")
        dp_s = sum(ring_seconds(c, layout.dp, dp_bw) for c in step if c.axis == "dp")
        link = "NVLink" if dp_bw == NVLINK_BW else "IB"
        rows.append((m.name, layout.name, "int8" if int8 else "bf16", _counts([c for c in per_layer if c.axis == "tp"]),
                     _counts([c for c in per_layer if c.axis == "dp"]) or "-",
                     f"{TOKENS * m.dim * ACT_BYTES / 2**20:.0f}",
                     f"{max(c.nbytes for c in per_layer if c.axis == 'dp') / 2**20:.1f}" if layout.fsdp else "-",
                     _counts(step), f"{tp_s * 1e3:.1f}", f"{dp_s * 1e3:.1f} ({link})" if layout.fsdp else "-",
                     f"{_compute_seconds(m, layout.tp) * 1e3:.0f}"))
    return rows


# --------------------------------------------------------- table 3: the measured small model


@dataclass(frozen=True)
class Config(RunConfig):
    kinds: tuple[str, ...] = ("TP", "TP + SP", "FSDP")


def _small_kinds(world: int, quick: bool) -> tuple[str, ...]:
    if quick:
        return ("TP + SP", "FSDP")
    return ("TP", "TP + SP", "FSDP") + (("dp 2 x TP 2 + SP",) if world == 4 else ())


def _small_model(n_layers: int, *, meta: bool = False) -> nn.Module:
    args = ModelArgs(dim=SMALL.dim, n_layers=n_layers, n_heads=SMALL.n_heads, vocab_size=SMALL.vocab_size,
                     ffn_hidden=SMALL.ffn_hidden, max_seq_len=SMALL_SEQ)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return Transformer(args).to(torch.bfloat16)


def _parallel(model: nn.Module, kind: str, world: int) -> None:
    if kind.startswith("TP"):
        parallelize_module(model, init_device_mesh("cpu", (world,)), tensor_parallel_plan(sequence_parallel="SP" in kind))
    elif kind == "FSDP":
        fully_shard_by_pattern(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), "layers.*",
                               min_weight_size=SMALL_MIN_WEIGHT)
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=True))
        fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=SMALL_MIN_WEIGHT)


def rank_main(config: Config) -> None:
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, SMALL.vocab_size, (SMALL_BATCH, SMALL_SEQ), generator=generator) for _ in "ab")
    rows = []
    for kind in config.kinds:
        for n_layers in (1, 2):
            model = _small_model(n_layers)
            _parallel(model, kind, world)

            def step(model=model):
                out = model(tokens)
                out = out.to_local() if hasattr(out, "to_local") else out
                F.cross_entropy(out.flatten(0, 1).float(), targets.flatten()).backward()

            _, counts = communication_of(step)
            rows.append({"world": world, "kind": kind, "layers": n_layers, "counts": counts, "bytes": wire_bytes(step)})
    if dist.get_rank() == 0:
        with open(config.result_path, "w") as f:
            json.dump(rows, f)


def small_prediction(kind: str, world: int, n_layers: int) -> tuple[dict[str, int], dict[str, int]]:
    """The analytic model's ``({collective: count}, {gloo op: bytes handed})`` for the measured small model.

    Counts are named as ``communication_of`` names them; bytes as ``wire_bytes`` does (gloo's
    reduce-scatter is an all-reduce of its input).
    """
    tp, dp = {"TP": (world, 1), "TP + SP": (world, 1), "FSDP": (1, world)}.get(kind, (2, 2))
    out = []
    if tp > 1:
        out += tp_collectives(n_layers, SMALL_BATCH * SMALL_SEQ, SMALL.dim, SMALL.vocab_size, ACT_BYTES,
                              sequence_parallel="SP" in kind)
    if dp > 1:
        plan = tensor_parallel_plan(sequence_parallel=True) if tp > 1 else None
        out += fsdp_collectives(_small_model(n_layers, meta=True), plan, tp=tp, dp=dp, min_weight_size=SMALL_MIN_WEIGHT)
    names = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor", "all_reduce": "all_reduce"}
    counts: dict[str, int] = {}
    handed: dict[str, int] = {}
    for c in out:
        group = tp if c.axis == "tp" else dp
        counts[names[c.kind]] = counts.get(names[c.kind], 0) + c.count
        gloo, nbytes = ("all_gather", c.nbytes // group) if c.kind == "all_gather" else ("all_reduce", c.nbytes)
        handed[gloo] = handed.get(gloo, 0) + c.count * nbytes
    return counts, handed


def _counts_cell(counts: dict[str, int]) -> str:
    short = {"all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS", "all_reduce": "AR"}
    return " ".join(f"{n} {short.get(name, name)}" for name, n in sorted(counts.items()))


def _bytes_cell(handed: dict[str, int]) -> str:
    return " ".join(f"{n} {name}" for name, n in sorted(handed.items()))


def check_rows(measured: list[dict]) -> list[tuple[str, ...]]:
    rows = []
    for m in measured:
        counts, handed = small_prediction(m["kind"], m["world"], m["layers"])
        same = counts == m["counts"] and handed == m["bytes"]
        rows.append((str(m["world"]), m["kind"], str(m["layers"]), _counts_cell(m["counts"]), _counts_cell(counts),
                     _bytes_cell(m["bytes"]), _bytes_cell(handed), "yes" if same else "NO"))
    return rows


# ------------------------------------------------------------------------------- report

MEMORY = ("model", "GPUs", "layout", "weights", "predicted B/rank", "GiB", "arithmetic B/rank", "agree")
COMM = ("model", "layout", "weights", "per layer, tp", "per layer, dp", "TP msg MiB", "dp msg MiB", "per step",
        "tp ms (NVLink)", "dp ms", "compute ms at peak")
CHECK = ("world", "layout", "layers", "counts measured", "counts model", "gloo bytes measured", "gloo bytes model", "equal")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 benchmarks/at_scale.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="measure the small model at world size 2 only, TP + SP and FSDP (smoke test)")
    options = parser.parse_args(argv)
    worlds = "2" if options.quick else "2,4"
    print(f"torch {torch.__version__}; on paper: bf16 parameters and activations, {TOKENS} tokens per TP group "
          f"per step (1 x {TOKENS}); NVLink {NVLINK_BW / 1e9:.0f} GB/s per direction, IB {IB_BW / 1e9:.0f} GB/s "
          f"per GPU, {PEAK_FLOPS / 1e12:.0f} TFLOP/s peak; {GPUS_PER_NODE} GPUs per node")
    print()
    print(markdown_table(MEMORY, memory_rows(LAYOUTS)))
    print()
    progress("table 2: the analytic model at Llama-3's sizes ...")
    print(markdown_table(COMM, communication_rows(LAYOUTS)))
    print()
    print("ring times over n ranks: all-gather, reduce-scatter (n-1)/n B/bw; all-reduce 2(n-1)/n B/bw; one after "
          "another, none overlapped; dp over NVLink inside a node, over IB across nodes")
    print()
    measured = []
    for world in worlds.split(","):
        config = Config(iters=1, warmup=0, kinds=_small_kinds(int(world), options.quick))
        measured += run_worlds(rank_main, config, world, "the small model, 1 and 2 layers, each layout")
    print(markdown_table(CHECK, check_rows(measured)))


if __name__ == "__main__":
    main()
