"""Compare torch_tp with upstream ``torch.distributed.tensor.parallel`` on one Llama block.

Command (spawns gloo CPU ranks, world size 2 then 4, and prints one table)::

    python3 benchmarks/compare_upstream.py                   # sizes small and tiny, ~2 min
    python3 benchmarks/compare_upstream.py --iters 100       # more timed rounds
    python3 benchmarks/compare_upstream.py --quick           # tiny size, few rounds (smoke test)
    python3 benchmarks/compare_upstream.py --hook-breakdown  # also: hook CPU by style

``--world-sizes 2`` runs one world size. Under ``torchrun --nproc-per-node N
benchmarks/compare_upstream.py`` the launcher's ranks are used once (world size N).

Every variant parallelizes a copy of the same :class:`torch_tp.models.llama.TransformerBlock`
(same weights) and runs it on the same input:

``torch_tp``
    ``torch_tp.parallelize_module`` with ``block_tensor_parallel_plan(sequence_parallel=...)``.
``upstream-same``
    upstream ``parallelize_module`` with the same plan written in upstream's styles
    (``PrepareModuleInput`` on ``attention`` / ``feed_forward``, Colwise, Rowwise, and
    ``SequenceParallel`` on the norms for TP+SP).
``upstream-usual``
    upstream ``parallelize_module`` with the usual plan: ``wq``/``wk``/``wv``/``w1``/``w3``
    Colwise, ``wo``/``w2`` Rowwise, no ``PrepareModuleInput`` (TP only).

Before anything is timed, every variant's output and input gradient are checked against
the single-process block, and torch_tp's against upstream-same's (``assert_close``), so the
variants compared do equal work.

Columns of the table:

``world``       number of ranks.
``size``        ``small``: dim 256, 8 heads, ffn 688, batch 4, seq 128 (compute-bound);
                ``tiny``: dim 32, 4 heads, ffn 88, batch 2, seq 16 (compute is negligible,
                so hooks, DTensor dispatch and collective latency dominate).
``variant``     see above.
``mode``        ``TP``: activations between blocks replicated; ``TP+SP``: sharded on the
                sequence dim, norms run on sequence shards.
``fwd comms``   collectives issued by one forward, counted with ``CommDebugMode``:
                ``AR`` all_reduce, ``AG`` all_gather_into_tensor, ``RS`` reduce_scatter_tensor.
``fwd KiB``     bytes of the tensors this rank hands *to* those collectives (the input
                side: the whole tensor for an all-reduce or a reduce-scatter, the local
                shard for an all-gather), in KiB.
``f+b comms``, ``f+b KiB``   the same for one forward plus its backward.
``param KiB``   parameter bytes held by one rank (local shards of DTensor parameters).
``step ms``     median wall time of one eager forward+backward on rank 0. Variants are
                interleaved run by run (the order rotates each round) after a warm-up,
                every rank runs the same steps, and a barrier precedes each timed step.
``p25-p75``     interquartile range of those wall times.
``CPU ms``      median CPU time of rank 0's main thread over the same steps. On CPU,
                autograd runs backward in the calling thread and gloo moves data on its
                own threads, so this is compute plus Python/dispatch cost without the
                time spent waiting for other ranks: far less noisy than wall time when
                ranks share cores. (On CUDA, backward runs on autograd's device thread,
                so there it covers the forward's host work only.)
``hook µs``     main-thread CPU time spent inside the modules' forward hooks and
                pre-hooks (the styles' input/output conversion, including issuing
                collectives) per step, mean over separate rounds with timed wrappers.

Below the table, the *hook overhead ratio* is torch_tp / upstream-same for each of the
three times, per world size, size and mode: same plan, same collectives, so a difference
is what the two libraries' hooks and style code cost. ``--hook-breakdown`` splits
``hook µs`` by style and side (``ColwiseParallel pre``, ...).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import parallel as upstream

import torch_tp
from torch_tp.launch import rank_device
from torch_tp.models.llama import ModelArgs, TransformerBlock, block_tensor_parallel_plan, rotary_table

# _measure.py is next to this script, whose directory running it (python3 or torchrun) puts first
# on sys.path; spawned ranks inherit sys.path when they re-import it for ``__main__.rank_main``.
from _driver import RunConfig, benchmark_arguments, finish_arguments, markdown_table, report_header, run_worlds  # noqa: E402
from _measure import format_counts, local_parameter_bytes, measure_collectives, measure_hook_cpu, median_ms, time_interleaved

# ------------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class BlockSize:
    """One block shape to benchmark."""

    name: str
    dim: int
    n_heads: int
    ffn_hidden: int
    batch: int
    seq: int

    def model_args(self) -> ModelArgs:
        return ModelArgs(
            dim=self.dim, n_layers=1, n_heads=self.n_heads, ffn_hidden=self.ffn_hidden,
            max_seq_len=self.seq,
        )


SIZES = {
    "small": BlockSize("small", dim=256, n_heads=8, ffn_hidden=688, batch=4, seq=128),
    "tiny": BlockSize("tiny", dim=32, n_heads=4, ffn_hidden=88, batch=2, seq=16),
}


@dataclass(frozen=True)
class Variant:
    """A library, a plan and a mode: one row of the table per world size and block size."""

    name: str
    sequence_parallel: bool

    @property
    def mode(self) -> str:
        return "TP+SP" if self.sequence_parallel else "TP"


VARIANTS = (
    Variant("torch_tp", False),
    Variant("upstream-same", False),
    Variant("upstream-usual", False),
    Variant("torch_tp", True),
    Variant("upstream-same", True),
)


@dataclass(frozen=True)
class Config(RunConfig):
    sizes: tuple[str, ...]
    hook_rounds: int


# ------------------------------------------------------------------------------- plans


def upstream_same_plan(*, sequence_parallel: bool) -> dict[str, upstream.ParallelStyle]:
    """torch_tp's ``block_tensor_parallel_plan``, built from upstream's style classes."""
    return block_tensor_parallel_plan(sequence_parallel=sequence_parallel, styles=upstream)


def upstream_usual_plan() -> dict[str, upstream.ParallelStyle]:
    """The plan usually written for a Llama block with upstream's styles (plain TP)."""
    return {
        "attention.wq": upstream.ColwiseParallel(),
        "attention.wk": upstream.ColwiseParallel(),
        "attention.wv": upstream.ColwiseParallel(),
        "attention.wo": upstream.RowwiseParallel(),
        "feed_forward.w1": upstream.ColwiseParallel(),
        "feed_forward.w3": upstream.ColwiseParallel(),
        "feed_forward.w2": upstream.RowwiseParallel(),
    }


def plan_for(variant: Variant) -> dict[str, upstream.ParallelStyle]:
    """The plan ``variant`` applies to one block."""
    sp = variant.sequence_parallel
    if variant.name == "torch_tp":
        return block_tensor_parallel_plan(sequence_parallel=sp)
    if variant.name == "upstream-same":
        return upstream_same_plan(sequence_parallel=sp)
    if variant.name == "upstream-usual":
        return upstream_usual_plan()
    raise ValueError(f"unknown variant {variant.name!r}")


def parallelize(variant: Variant, block: TransformerBlock, mesh: DeviceMesh) -> TransformerBlock:
    """Apply ``variant``'s library and plan to ``block`` (in place) and return it."""
    library = torch_tp if variant.name == "torch_tp" else upstream
    return library.parallelize_module(block, mesh, plan_for(variant))


# ---------------------------------------------------------------------------- inputs


@dataclass
class BlockInputs:
    """The global input of one size, and this rank's view of it for a TP or TP+SP block."""

    x: torch.Tensor
    rope: torch.Tensor

    def local_x(self, sequence_parallel: bool) -> torch.Tensor:
        """A fresh leaf (``requires_grad``): the whole input, or this rank's sequence shard."""
        x = self.x
        if sequence_parallel:
            x = x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]
        return x.detach().clone().requires_grad_(True)

    def local_view(self, full: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        """What a rank holds of a full-sequence tensor in this mode."""
        if not sequence_parallel:
            return full
        return full.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]


def make_inputs(size: BlockSize, device: torch.device) -> BlockInputs:
    """Same input on every rank (seeded), and the rotary table of ``size``."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(size.batch, size.seq, size.dim, generator=generator)
    args = size.model_args()
    return BlockInputs(x.to(device), rotary_table(args.head_dim, size.seq, args.rope_theta).to(device))


# --------------------------------------------------------------------------- one step


def forward_backward(block: TransformerBlock, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """One training step's compute: forward, then backward of ``sum(output)``."""
    out = block(x, rope)
    out.sum().backward()
    return out


def run_step(block: TransformerBlock, x: torch.Tensor, rope: torch.Tensor) -> None:
    """:func:`forward_backward` with gradients cleared first (what is timed)."""
    block.zero_grad(set_to_none=True)
    x.grad = None
    forward_backward(block, x, rope)


# ---------------------------------------------------------------------- equal work check


def check_agreement(blocks: dict[Variant, TransformerBlock], reference: TransformerBlock,
                    inputs: BlockInputs) -> None:
    """Every variant matches the single-process block; torch_tp matches upstream-same.

    Output and input gradient are compared with the single-process block (float32
    tolerances for a different summation order). torch_tp and upstream-same run the same
    plan, so their outputs, input gradients and local parameter-gradient shards must
    agree to ``assert_close``'s default float32 tolerance.
    """
    x_ref = inputs.x.detach().clone().requires_grad_(True)
    ref_out = forward_backward(reference, x_ref, inputs.rope).detach()
    results = {}
    for variant, block in blocks.items():
        sp = variant.sequence_parallel
        x = inputs.local_x(sp)
        out = forward_backward(block, x, inputs.rope).detach()
        what = f"{variant.name} {variant.mode}"
        torch.testing.assert_close(out, inputs.local_view(ref_out, sp), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{what} output vs single process: {m}")
        torch.testing.assert_close(x.grad, inputs.local_view(x_ref.grad, sp), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{what} input grad vs single process: {m}")
        results[variant] = {"output": out, "input grad": x.grad, **local_grads(block)}
        block.zero_grad(set_to_none=True)
    for sp in (False, True):
        ours, theirs = results[Variant("torch_tp", sp)], results[Variant("upstream-same", sp)]
        torch.testing.assert_close(ours, theirs, msg=lambda m: f"torch_tp vs upstream-same: {m}")


def local_grads(block: TransformerBlock) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter gradient, by parameter name."""
    return {
        name: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        for name, p in block.named_parameters()
    }


# ----------------------------------------------------------------------- per-rank driver


def measure_size(size: BlockSize, mesh: DeviceMesh, config: Config) -> list[dict]:
    """All rows of one block size on this world size (every rank computes them)."""
    device = rank_device()
    torch.manual_seed(0)
    reference = TransformerBlock(size.model_args()).to(device)
    inputs = make_inputs(size, device)
    blocks = {variant: parallelize(variant, copy.deepcopy(reference), mesh) for variant in VARIANTS}
    check_agreement(blocks, reference, inputs)

    xs = {variant: inputs.local_x(variant.sequence_parallel) for variant in VARIANTS}
    comms = {variant: measure_collectives(blocks[variant], xs[variant], inputs.rope) for variant in VARIANTS}
    steps = {
        variant: (lambda b=blocks[variant], x=xs[variant]: run_step(b, x, inputs.rope))
        for variant in VARIANTS
    }
    times = time_interleaved(steps, config.iters, config.warmup)
    hooks = measure_hook_cpu(steps, blocks, {variant: plan_for(variant) for variant in VARIANTS},
                             config.hook_rounds)
    return [
        {
            "world": dist.get_world_size(),
            "size": size.name,
            "variant": variant.name,
            "mode": variant.mode,
            **comms[variant],
            "param_bytes": local_parameter_bytes(blocks[variant]),
            "wall_s": [wall for wall, _ in times[variant]],
            "cpu_s": [cpu for _, cpu in times[variant]],
            **hooks[variant],
        }
        for variant in VARIANTS
    ]


def rank_main(config: Config) -> None:
    """Entry point on every rank: measure every size, rank 0 writes the rows as JSON."""
    world = dist.get_world_size()
    mesh = init_device_mesh(rank_device().type, (world,), mesh_dim_names=("tp",))["tp"]
    rows = []
    for name in config.sizes:
        rows += measure_size(SIZES[name], mesh, config)
    if dist.get_rank() == 0:
        with open(config.result_path, "w") as f:
            json.dump(rows, f)


# ------------------------------------------------------------------------------ report


COLUMNS = ("world", "size", "variant", "mode", "fwd comms", "fwd KiB", "f+b comms", "f+b KiB",
           "param KiB", "step ms", "p25-p75", "CPU ms", "hook µs")


def table_cells(row: dict) -> tuple[str, ...]:
    q1, _, q3 = statistics.quantiles(row["wall_s"], n=4)
    return (
        str(row["world"]), row["size"], row["variant"], row["mode"],
        format_counts(row["fwd_counts"]), f"{row['fwd_bytes'] / 1024:.1f}",
        format_counts(row["total_counts"]), f"{row['total_bytes'] / 1024:.1f}",
        f"{row['param_bytes'] / 1024:.1f}", f"{median_ms(row):.2f}",
        f"{q1 * 1e3:.2f}-{q3 * 1e3:.2f}", f"{median_ms(row, 'cpu_s'):.2f}", f"{row['hook_us']:.0f}",
    )


def same_plan_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """``(torch_tp row, upstream-same row)`` for every world size, block size and mode."""
    by_key = {(r["world"], r["size"], r["mode"], r["variant"]): r for r in rows}
    return [
        (row, by_key[(world, size, mode, "upstream-same")])
        for (world, size, mode, variant), row in by_key.items()
        if variant == "torch_tp"
    ]


def format_ratios(rows: list[dict]) -> str:
    """Hook overhead ratios: torch_tp / upstream-same for step time, CPU time and hook CPU."""
    header = ("world", "size", "mode", "step ms ratio", "CPU ms ratio", "hook µs ratio")
    cells = [
        (str(ours["world"]), ours["size"], ours["mode"],
         f"{median_ms(ours) / median_ms(same):.3f}",
         f"{median_ms(ours, 'cpu_s') / median_ms(same, 'cpu_s'):.3f}",
         f"{ours['hook_us'] / same['hook_us']:.3f}")
        for ours, same in same_plan_pairs(rows)
    ]
    return "hook overhead ratio = torch_tp / upstream-same (medians; hook µs: means)\n" + markdown_table(header, cells)


def format_hook_breakdown(rows: list[dict]) -> str:
    """Forward-hook CPU by style and side, torch_tp next to upstream-same."""
    header = ("world", "size", "mode", "hook", "calls", "torch_tp µs", "upstream-same µs", "difference µs")
    cells = []
    for ours, same in same_plan_pairs(rows):
        for key in sorted({*ours["hook_breakdown"], *same["hook_breakdown"]}):
            us_ours, calls = ours["hook_breakdown"].get(key, (0.0, 0))
            us_same, _ = same["hook_breakdown"].get(key, (0.0, 0))
            cells.append((str(ours["world"]), ours["size"], ours["mode"], key, f"{calls:g}",
                          f"{us_ours:.1f}", f"{us_same:.1f}", f"{us_ours - us_same:+.1f}"))
    return "forward-hook CPU per step, by style and side\n" + markdown_table(header, cells)


def format_report(rows: list[dict], options: argparse.Namespace, sizes: tuple[str, ...]) -> str:
    described = "; ".join(
        f"{s}: dim {SIZES[s].dim}, {SIZES[s].n_heads} heads, ffn {SIZES[s].ffn_hidden}, "
        f"batch {SIZES[s].batch}, seq {SIZES[s].seq}"
        for s in sizes
    )
    parts = [
        report_header(options, rounds=f", hooks timed over {options.hook_rounds} rounds"),
        described,
        "",
        markdown_table(COLUMNS, [table_cells(row) for row in rows]),
        "",
        format_ratios(rows),
    ]
    if options.hook_breakdown:
        parts += ["", format_hook_breakdown(rows)]
    return "\n".join(parts)


# -------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_arguments(__file__, __doc__, iters=(40, 8), warmup=(5, 2), what="block size",
                                 quick="tiny size only, few rounds", min_iters=2)  # quartiles need two samples
    parser.add_argument("--hook-breakdown", action="store_true",
                        help="also print forward-hook CPU time by style (torch_tp vs upstream-same)")
    options = finish_arguments(parser, argv)
    options.hook_rounds = max(2, options.iters // 4)
    return options


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    sizes = ("tiny",) if options.quick else ("small", "tiny")
    config = Config(sizes, options.hook_rounds, iters=options.iters, warmup=options.warmup)
    rows = run_worlds(rank_main, config, options.world_sizes, ", ".join(sizes))
    if rows:
        print(format_report(rows, options, sizes))


if __name__ == "__main__":
    main()
