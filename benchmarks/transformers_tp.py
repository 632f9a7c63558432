"""Compare torch_tp with transformers' own tensor parallelism on one tiny causal LM.

Command (spawns gloo CPU ranks, world size 2 then 4, and prints one table)::

    python3 benchmarks/transformers_tp.py                 # llama and qwen3, 40 timed rounds
    python3 benchmarks/transformers_tp.py --quick         # few rounds (smoke test)
    python3 benchmarks/transformers_tp.py --world-sizes 2 # one world size
    python3 benchmarks/transformers_tp.py --models llama  # one model family
    torchrun --nproc-per-node 2 benchmarks/transformers_tp.py  # the launcher's ranks, once

Needs ``transformers`` and ``accelerate`` (the ``test`` extra): transformers' TP refuses to
load without accelerate.

Rank 0 builds a tiny model from a seeded config (no download) and writes it with
``save_pretrained`` to a temporary directory (the ranks share one machine's file system);
every rank loads it three times:

``reference``
    ``AutoModelForCausalLM.from_pretrained(dir)``: one process, no parallelism.
``torch_tp``
    the same, then ``torch_tp.integrations.transformers.parallelize(model, mesh)``: the
    model's own plan translated into torch_tp styles (plain TP, logits gathered).
``transformers``
    ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(tp_plan="auto"))``,
    transformers' own TP (what ``tp_plan="auto"`` does; that spelling is deprecated in
    transformers 5). It builds its device mesh from the process group the benchmark
    initialized (gloo on CPU), so it runs in spawned ranks and under ``torchrun`` alike.

Both parallel models run the same step on the same batch: ``model(input_ids=ids,
labels=ids).loss.backward()`` (gradients cleared first). Before anything is timed, their
logits and every parameter gradient (DTensor gradients as full tensors) are compared with
the reference model's; torch_tp must match (the script fails otherwise), transformers'
result is reported in the ``max Δ`` columns. If transformers' TP cannot be loaded or run
in this install, the report says why (the exception and the innermost transformers frame
it came through) and still prints torch_tp's rows.

Columns of the table:

``world``        number of ranks.
``model``        ``llama``: ``LlamaForCausalLM``; ``qwen3``: ``Qwen3ForCausalLM`` (per-head
                 ``q_norm``/``k_norm``, whose gradients are summed over the ranks). Both:
                 vocab 256, hidden 128, ffn 384, 2 layers, 8 heads, 4 key/value heads.
``variant``      ``torch_tp`` or ``transformers`` (see above).
``fwd comms``    collectives in one forward, counted with ``CommDebugMode`` (functional and
                 c10d ops alike): ``AR`` all_reduce, ``AG`` all_gather_into_tensor,
                 ``RS`` reduce_scatter_tensor.
``fwd KiB``      bytes of the tensors this rank hands to those collectives.
``f+b comms``, ``f+b KiB``   the same for the whole step (forward + backward).
``opt comms``    collectives in one ``torch.optim.AdamW`` step after that backward: what
                 the gradients still cost. torch_tp leaves the gradients of replicated
                 parameters computed from sharded inputs (Qwen3's ``q_norm``/``k_norm``)
                 ``Partial``, so they are reduced where the optimizer reads them (and
                 again at every read); transformers all-reduces them in the backward.
``param KiB``    parameter bytes one rank holds (local shards of DTensor parameters).
``logits max Δ``, ``grads max Δ``   largest absolute difference from the reference
                 model's logits and parameter gradients.
``step ms``      median wall time of the step on rank 0. Warm-up rounds first; then each
                 round runs both variants once, in an order rotated every round; every rank
                 runs the same steps and a barrier precedes each timed step; GC is off.
``p25-p75``      interquartile range of those wall times.
``CPU ms``       median CPU time of rank 0's main thread over the same steps (compute plus
                 Python/dispatch cost, without the time spent waiting for other ranks).

Below it, the ratio torch_tp / transformers of ``step ms`` and ``CPU ms`` and both
libraries' collective counts (``f+b comms / opt comms``), for every world size and model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers  # here, not in a function: the fork server imports it once for every rank (~4 s each)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from torch_tp.integrations.transformers import parallelize
from torch_tp.launch import rank_device
from torch_tp.testing import comm_counts

# _driver.py and _measure.py are next to this script, whose directory running it (python3 or
# torchrun) puts first on sys.path; spawned ranks inherit sys.path.
from _driver import RunConfig, benchmark_arguments, finish_arguments, markdown_table, report_header, run_worlds  # noqa: E402
from _measure import CollectiveBytesMode, format_counts, local_parameter_bytes, median_ms, time_interleaved

# ------------------------------------------------------------------------ configuration

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 128, 384, 2, 8, 4
BATCH, SEQ = 2, 64
MODELS = ("llama", "qwen3")
# float32, parallel vs one process: only the summation order differs
LOGITS_TOL = dict(rtol=1e-4, atol=1e-5)
GRADS_TOL = dict(rtol=1e-4, atol=1e-5)


@dataclass(frozen=True)
class Config(RunConfig):
    models: tuple[str, ...]


def tiny_model(name: str) -> torch.nn.Module:
    """A freshly initialized tiny causal LM of family ``name`` (same weights on every rank)."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
                  tie_word_embeddings=False)
    torch.manual_seed(0)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=HIDDEN // HEADS, **common))
    raise ValueError(f"unknown model {name!r}; known: {MODELS}")


def batch() -> torch.Tensor:
    """The token ids every rank feeds (seeded, so the same everywhere)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------ loading


@contextlib.contextmanager
def saved_model(name: str) -> Iterator[str]:
    """A directory holding ``tiny_model(name)`` written by ``save_pretrained``, on every rank.

    In a process group ``save_pretrained`` writes on rank 0 only, so rank 0 makes the
    directory and sends its path to the others (the ranks share a file system: one machine).
    """
    path = tempfile.mkdtemp(prefix=f"transformers_tp_{name}_") if dist.get_rank() == 0 else None
    try:
        if path is not None:
            tiny_model(name).save_pretrained(path)
        shared = [path]
        dist.broadcast_object_list(shared, src=0)
        yield shared[0]
        dist.barrier()  # every rank has loaded it
    finally:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


def load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def load_transformers_tp(path: str) -> torch.nn.Module:
    """transformers' own TP: ``tp_plan="auto"``, through the non-deprecated ``DistributedConfig``."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before DistributedConfig: the keyword itself
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto")
    )


def describe_failure(error: BaseException) -> str:
    """``Type: message (last transformers frame: transformers/<file>:<line> in <function>)``, causes after.

    The frame is the innermost one in transformers' sources: where transformers called what
    failed, or raised it itself.
    """
    marker = f"{os.sep}transformers{os.sep}"
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        where = ""
        frames = [f for f in traceback.extract_tb(error.__traceback__) if marker in f.filename]
        if frames:
            frame = frames[-1]
            short = frame.filename[frame.filename.rindex(marker) + 1:].replace(os.sep, "/")
            where = f" (last transformers frame: {short}:{frame.lineno} in {frame.name})"
        message = " ".join(str(error).split())
        parts.append(f"{type(error).__name__}: {message}{where}")
        error = error.__cause__ or error.__context__
    return " <- caused by ".join(parts)


def agreed(error: str | None) -> str | None:
    """The first rank's failure, if any rank failed: every rank then skips the variant alike."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)


# --------------------------------------------------------------------------- one step


def step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One training step's compute, gradients cleared first: returns the (detached) logits."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach()


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient as one full tensor (a collective for DTensor gradients)."""
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for name, p in model.named_parameters()
    }


def differences(logits: torch.Tensor, grads: dict[str, torch.Tensor], ref_logits: torch.Tensor,
                ref_grads: dict[str, torch.Tensor]) -> dict:
    """Largest |Δ| from the reference, and whether it is within float32 summation-order noise."""
    missing = sorted(name for name in ref_grads if grads.get(name) is None)
    if missing:
        return {"logits_diff": float("nan"), "grads_diff": float("nan"), "close": False,
                "why": f"no gradient for {missing}"}
    logits_diff = (logits - ref_logits).abs().max().item()
    grads_diff = max((grads[name] - ref).abs().max().item() for name, ref in ref_grads.items())
    why = None
    try:
        torch.testing.assert_close(logits, ref_logits, **LOGITS_TOL)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, **GRADS_TOL, msg=lambda m, n=name: f"{n}: {m}")
    except AssertionError as error:
        why = " ".join(str(error).split())
    return {"logits_diff": logits_diff, "grads_diff": grads_diff, "close": why is None, "why": why}


def count_collectives(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """Collective counts and input bytes of one forward, of forward + backward, and of an AdamW step.

    The optimizer step changes the weights; nothing compares values after it.
    """
    with warnings.catch_warnings():
        # CommDebugMode's module tracker installs full backward hooks; token ids need no gradient
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        warnings.filterwarnings("ignore", message="For backward hooks to be called")  # ModelOutput results
        model.zero_grad(set_to_none=True)
        with CollectiveBytesMode() as forward:
            loss = model(input_ids=ids, labels=ids).loss
        with CollectiveBytesMode() as backward:
            loss.backward()
        # what the gradients still cost: an optimizer step reads them (a Partial gradient is
        # reduced there, and again on every later read)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with CollectiveBytesMode() as optimizer_step:
            optimizer.step()
    model.zero_grad(set_to_none=True)
    fwd, bwd = comm_counts(forward), comm_counts(backward)
    return {
        "fwd_counts": fwd,
        "fwd_bytes": forward.input_bytes,
        "total_counts": {name: fwd.get(name, 0) + bwd.get(name, 0) for name in sorted({*fwd, *bwd})},
        "total_bytes": forward.input_bytes + backward.input_bytes,
        "opt_counts": comm_counts(optimizer_step),
        "opt_bytes": optimizer_step.input_bytes,
    }


# ----------------------------------------------------------------------- per-rank driver


def measure_model(name: str, mesh: DeviceMesh, config: Config) -> list[dict]:
    """The rows of one model on this world size (every rank computes them)."""
    common = {"world": dist.get_world_size(), "model": name}
    with saved_model(name) as path:
        reference = load(path)
        models = {"torch_tp": parallelize(load(path), mesh)}
        error = None
        try:
            models["transformers"] = load_transformers_tp(path)
        except Exception as exc:  # noqa: BLE001 - reported, not hidden: the row says why
            error = describe_failure(exc)
        error = agreed(error)

    ids = batch()
    for model in (reference, *models.values()):
        model.train()
    ref_logits = step(reference, ids)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    checks = {}
    ours = differences(step(models["torch_tp"], ids), full_grads(models["torch_tp"]), ref_logits, ref_grads)
    if not ours["close"]:
        raise AssertionError(f"{name}: torch_tp differs from the single-process model: {ours['why']}")
    checks["torch_tp"] = ours
    if error is None:
        try:
            checks["transformers"] = differences(step(models["transformers"], ids), full_grads(models["transformers"]),
                                                 ref_logits, ref_grads)
        except Exception as exc:  # noqa: BLE001
            error = describe_failure(exc)
        error = agreed(error)
    if error is not None:
        models.pop("transformers", None)

    comms = {variant: count_collectives(model, ids) for variant, model in models.items()}
    steps = {variant: (lambda m=model: step(m, ids)) for variant, model in models.items()}
    times = time_interleaved(steps, config.iters, config.warmup)
    rows = [
        {
            **common, "variant": variant, **comms[variant], **checks[variant],
            "param_bytes": local_parameter_bytes(models[variant]),
            "wall_s": [wall for wall, _ in times[variant]],
            "cpu_s": [cpu for _, cpu in times[variant]],
        }
        for variant in models
    ]
    if error is not None:
        rows.append({**common, "variant": "transformers", "error": error})
    return rows


def rank_main(config: Config) -> None:
    """Entry point on every rank: measure every model, rank 0 writes the rows as JSON."""
    transformers.logging.set_verbosity_error()  # loading reports and deprecation notes
    transformers.utils.logging.disable_progress_bar()
    world = dist.get_world_size()
    mesh = init_device_mesh(rank_device().type, (world,), mesh_dim_names=("tp",))["tp"]
    rows = []
    for name in config.models:
        rows += measure_model(name, mesh, config)
    if dist.get_rank() == 0:
        with open(config.result_path, "w") as f:
            json.dump(rows, f)


# ------------------------------------------------------------------------------ report


COLUMNS = ("world", "model", "variant", "fwd comms", "fwd KiB", "f+b comms", "f+b KiB", "opt comms", "param KiB",
           "logits max Δ", "grads max Δ", "step ms", "p25-p75", "CPU ms")
RATIO_COLUMNS = ("world", "model", "step ms ratio", "CPU ms ratio", "torch_tp comms", "transformers comms")


def table_cells(row: dict) -> tuple[str, ...]:
    q1, _, q3 = statistics.quantiles(row["wall_s"], n=4)
    return (
        str(row["world"]), row["model"], row["variant"],
        format_counts(row["fwd_counts"]), f"{row['fwd_bytes'] / 1024:.1f}",
        format_counts(row["total_counts"]), f"{row['total_bytes'] / 1024:.1f}", format_counts(row["opt_counts"]),
        f"{row['param_bytes'] / 1024:.1f}", f"{row['logits_diff']:.1e}", f"{row['grads_diff']:.1e}",
        f"{median_ms(row):.2f}", f"{q1 * 1e3:.2f}-{q3 * 1e3:.2f}", f"{median_ms(row, 'cpu_s'):.2f}",
    )


def ratio_cells(rows: list[dict]) -> list[tuple[str, ...]]:
    by_key = {(r["world"], r["model"], r["variant"]): r for r in rows if "error" not in r}
    cells = []
    for (world, model, variant), ours in by_key.items():
        theirs = by_key.get((world, model, "transformers"))
        if variant != "torch_tp" or theirs is None:
            continue
        cells.append((
            str(world), model, f"{median_ms(ours) / median_ms(theirs):.3f}",
            f"{median_ms(ours, 'cpu_s') / median_ms(theirs, 'cpu_s'):.3f}",
            f"{format_counts(ours['total_counts'])} / {format_counts(ours['opt_counts'])}",
            f"{format_counts(theirs['total_counts'])} / {format_counts(theirs['opt_counts'])}",
        ))
    return cells


def format_report(rows: list[dict], options: argparse.Namespace) -> str:
    timed = [r for r in rows if "error" not in r]
    parts = [
        report_header(options, software=f"transformers {transformers.__version__}"),
        f"models: vocab {VOCAB}, hidden {HIDDEN}, ffn {FFN}, {LAYERS} layers, {HEADS} heads, "
        f"{KV_HEADS} key/value heads, float32; batch {BATCH}, seq {SEQ}; "
        "step: model(input_ids, labels=input_ids).loss.backward()",
        "",
        markdown_table(COLUMNS, [table_cells(row) for row in timed]),
    ]
    for row in timed:
        if not row["close"]:
            parts.append(f"world {row['world']}, {row['model']}, {row['variant']}: differs from the "
                         f"single-process model: {row['why']}")
    for row in rows:
        if "error" in row:
            parts.append(f"world {row['world']}, {row['model']}: transformers' TP could not run here: {row['error']}")
    ratios = ratio_cells(rows)
    if ratios:
        parts += ["", "ratio = torch_tp / transformers (medians); comms: forward + backward / one AdamW step after it",
                  markdown_table(RATIO_COLUMNS, ratios)]
    return "\n".join(parts)


# -------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_arguments(__file__, __doc__, iters=(40, 4), warmup=(5, 1), what="model",
                                 quick="few rounds", min_iters=2)  # quartiles need two samples
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated model families (default {','.join(MODELS)})")
    options = finish_arguments(parser, argv)
    options.models = tuple(options.models.split(","))
    unknown = set(options.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
    return options


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    config = Config(options.models, iters=options.iters, warmup=options.warmup)
    rows = run_worlds(rank_main, config, options.world_sizes, ", ".join(options.models))
    if rows:
        print(format_report(rows, options))


if __name__ == "__main__":
    main()
