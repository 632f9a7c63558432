"""Fused (P2P ring, transfer overlapping the matmul) vs unfused all-gather+matmul and matmul+reduce-scatter.

Command (spawns gloo CPU ranks, world size 2 then 4, and prints one table per op)::

    python3 benchmarks/overlap.py                  # 5 shapes, 30 timed rounds (~1.5 min)
    python3 benchmarks/overlap.py --quick          # 2 shapes, 6 rounds (~15 s)
    python3 benchmarks/overlap.py --iters 50       # more timed rounds
    python3 benchmarks/overlap.py --world-sizes 2  # one world size

Under ``torchrun --nproc-per-node N benchmarks/overlap.py`` the launcher's ranks are used
once (world size N).

A shape ``B S K N`` is a sequence-parallel linear layer as one rank runs it: activations of
``B`` sequences of ``S`` tokens (``S`` global: sharded over the ranks where the op says so),
``K`` the contracted features and ``N`` the output features *this rank* holds (its
column shard of the weight, or its row shard's output width). Float32 throughout.

``AG+MM`` (a ``ColwiseParallel(input_layouts=Shard(1))`` layer)
    each rank holds ``x`` of shape ``(B, S / world, K)``; the result is
    ``all_gather(x, dim=1) @ w`` with ``w`` of shape ``(K, N)``: ``(B, S, N)`` on every rank.
``MM+RS`` (a ``RowwiseParallel(output_layouts=Shard(1))`` layer)
    each rank holds ``h`` of shape ``(B, S, K)``; the result is
    ``reduce_scatter(h @ w, dim=1)``: ``(B, S / world, N)``, summed over ranks.

Four steps are timed per row, interleaved. ``comm`` and ``compute`` are the two halves of
the op, each measured on its own; the bounds below come from them alone, never from the
unfused run:

``comm``      the collective alone, nothing else: the functional collective the unfused op
              issues, on the same tensors: ``funcol.all_gather_single`` of ``x`` on dim 1
              (AG) / ``funcol.reduce_scatter_single`` (``"sum"``) of a ``(B, S, N)`` tensor
              on dim 1 (RS), waited.
``compute``   the matmul alone, no communication, on the full-size operand as the rank
              does it: ``(B, S, K) @ (K, N)`` (the gathered input for AG, the rank's own
              ``h`` for RS).
``unfused``   ``torch_tp.overlap.all_gather_then_matmul`` / ``matmul_then_reduce_scatter``:
              the same collective (gloo's own algorithm), then the same matmul on what
              it gathered (AG); the same matmul, then the collective on its product (RS).
``fused``     ``torch_tp.overlap.all_gather_matmul`` / ``matmul_reduce_scatter``: a ring
              of ``world - 1`` batched ``isend``/``irecv`` steps, each step's transfer
              overlapping the matmul of the chunk already held. Called with
              ``check_shapes=False``, as the ``overlap=True`` styles call them (no shape
              all-gather before the op).

Columns:

``world``           number of ranks.
``shape``           ``B S K N`` as above.
``MiB sent``        bytes each rank sends per op: ``(world - 1) / world`` of the gathered
                    input (AG) or of the unreduced output (RS).
``comm ms``, ``compute ms``, ``unfused ms``, ``fused ms``   median wall time on rank 0.
                    Warm-up rounds first; then each round runs the four steps once, in an
                    order rotated every round; a barrier precedes each timed step; GC is
                    off while timing.
``ideal ms``        ``max(comm, compute)``: the step with the transfer hidden entirely
                    behind the matmul (or the matmul behind the transfer), perfect overlap.
``ring ms``         the best the ring's schedule allows: its ``world - 1`` transfers (each
                    ``comm / (world - 1)``) overlap ``world - 1`` of the ``world`` chunk
                    matmuls (each ``compute / world``), and one chunk's matmul is never
                    overlapped: ``(world - 1) * max(comm / (world - 1), compute / world) +
                    compute / world``, between ``ideal ms`` and ``serial ms``.
``serial ms``       ``comm + compute``: no overlap at all, the serial bound.
``ideal/fused``     ``ideal ms / fused ms``: the fraction of perfect overlap the fused op
                    reaches (1.0 = perfect; 0.5 = it takes twice the ideal).
``ring/fused``      ``ring ms / fused ms``: the same against the ring's own bound.
``serial/unfused``  ``serial ms / unfused ms``: 1.0 when the unfused op costs exactly its
                    two halves measured alone; below 1 it costs more than they do apart.
``fused/unfused``   ``fused ms / unfused ms`` (below 1: the fused op is faster than the
                    unfused op as measured, whatever the bounds say).

Before anything is timed, the fused op's outputs are checked against the unfused op's
(``rtol = atol = 1e-5``) once per shape. Each rank uses ``torch.set_num_threads(max(1,
cpus // world))`` intra-op threads: 1 on a 2-core machine, where gloo's transfer threads
then compete with the matmul for the same cores (at world size 4, four ranks share two).
See ``docs/overlap.md`` for the measured tables and why fused stays far from ideal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh

from torch_tp.launch import rank_device
from torch_tp.overlap import (
    all_gather_matmul,
    all_gather_then_matmul,
    group_name_of,
    matmul_reduce_scatter,
    matmul_then_reduce_scatter,
)

# _driver.py is next to this script, whose directory running it (python3 or torchrun) puts first
# on sys.path; spawned ranks inherit sys.path when they re-import it for ``__main__.rank_main``.
from _driver import RunConfig, markdown_table, parse_arguments, report_header, run_worlds
from _measure import time_interleaved

# ------------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class Shape:
    """One linear layer as a rank runs it: ``(B, S, K) @ (K, N)``, ``S`` the global sequence."""

    batch: int
    seq: int
    k: int
    n: int

    @property
    def name(self) -> str:
        return f"B{self.batch} S{self.seq} K{self.k} N{self.n}"


SHAPES = (
    Shape(1, 1024, 512, 128),
    Shape(2, 1024, 512, 128),
    Shape(2, 1024, 512, 256),
    Shape(4, 1024, 512, 128),
    Shape(2, 2048, 1024, 128),
)
QUICK_SHAPES = (Shape(1, 1024, 512, 128), Shape(2, 1024, 512, 256))

OPS = ("AG+MM", "MM+RS")
STEPS = ("comm", "compute", "unfused", "fused")
TOL = {"rtol": 1e-5, "atol": 1e-5}


@dataclass(frozen=True)
class Config(RunConfig):
    shapes: tuple[Shape, ...]


# --------------------------------------------------------------------------- the steps


def waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` once its collective has finished (functional collectives return before that)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def all_gather_steps(shape: Shape, group: str, world: int, rank: int) -> dict:
    """The four AG+MM steps of one shape, after checking fused == unfused."""
    gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    full = torch.randn(shape.batch, shape.seq, shape.k, generator=gen)
    w = torch.randn(shape.k, shape.n, generator=gen) / shape.k ** 0.5
    x = full.chunk(world, dim=1)[rank].contiguous()

    gathered, (fused,) = all_gather_matmul(x, [w], 1, group, check_shapes=False)
    ref_gathered, (unfused,) = all_gather_then_matmul(x, [w], 1, group)
    torch.testing.assert_close(gathered, ref_gathered, rtol=0, atol=0)
    torch.testing.assert_close(fused, unfused, **TOL, msg=lambda m: f"AG+MM {shape.name}: {m}")
    return {
        "unfused": lambda: all_gather_then_matmul(x, [w], 1, group)[1][0],
        "fused": lambda: all_gather_matmul(x, [w], 1, group, check_shapes=False)[1][0],
        "comm": lambda: waited(funcol.all_gather_single(x, 1, group)),
        "compute": lambda: full @ w,
    }, full.numel() * full.element_size() * (world - 1) // world


def reduce_scatter_steps(shape: Shape, group: str, world: int, rank: int) -> dict:
    """The four MM+RS steps of one shape, after checking fused == unfused."""
    gen = torch.Generator().manual_seed(1 + rank)  # every rank its own partial sum
    h = torch.randn(shape.batch, shape.seq, shape.k, generator=gen)
    w = torch.randn(shape.k, shape.n, generator=gen) / shape.k ** 0.5
    partial = h @ w  # what the comm step reduce-scatters: a (B, S, N) tensor

    fused = matmul_reduce_scatter(h, w, 1, group, check_shapes=False)
    unfused = matmul_then_reduce_scatter(h, w, 1, group)
    torch.testing.assert_close(fused, unfused, **TOL, msg=lambda m: f"MM+RS {shape.name}: {m}")
    return {
        "unfused": lambda: waited(matmul_then_reduce_scatter(h, w, 1, group)),
        "fused": lambda: matmul_reduce_scatter(h, w, 1, group, check_shapes=False),
        "comm": lambda: waited(funcol.reduce_scatter_single(partial, "sum", 1, group)),
        "compute": lambda: h @ w,
    }, partial.numel() * partial.element_size() * (world - 1) // world


BUILDERS = {"AG+MM": all_gather_steps, "MM+RS": reduce_scatter_steps}


# ----------------------------------------------------------------------- per-rank driver


def measure(op: str, shape: Shape, group: str, config: Config) -> dict:
    """One row (every rank computes it; rank 0's times are kept)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    steps, sent = BUILDERS[op](shape, group, world, rank)
    times = time_interleaved(steps, config.iters, config.warmup)
    return {
        "op": op,
        "world": world,
        "shape": shape.name,
        "sent": sent,
        **{f"{step}_s": [wall for wall, _ in times[step]] for step in STEPS},
    }


def rank_main(config: Config) -> None:
    """Entry point on every rank: measure every op and shape, rank 0 writes the rows as JSON."""
    world = dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh(rank_device().type, (world,), mesh_dim_names=("tp",))["tp"]
    group = group_name_of(mesh)
    rows = [measure(op, shape, group, config) for op in OPS for shape in config.shapes]
    if dist.get_rank() == 0:
        with open(config.result_path, "w") as f:
            json.dump(rows, f)


# ------------------------------------------------------------------------------ report

COLUMNS = ("world", "shape", "MiB sent", "comm ms", "compute ms", "ideal ms", "ring ms", "serial ms",
           "unfused ms", "fused ms", "ideal/fused", "ring/fused", "serial/unfused", "fused/unfused")


def ring_bound(comm: float, compute: float, world: int) -> float:
    """Fastest a ``world``-rank ring can run: one chunk's matmul is never overlapped."""
    steps = world - 1
    return steps * max(comm / steps, compute / world) + compute / world


def table_cells(row: dict) -> tuple[str, ...]:
    comm, compute, unfused, fused = (statistics.median(row[f"{s}_s"]) * 1e3 for s in STEPS)
    ideal, ring, serial = max(comm, compute), ring_bound(comm, compute, row["world"]), comm + compute
    return (
        str(row["world"]), row["shape"], f"{row['sent'] / 2**20:g}",
        *(f"{ms:.2f}" for ms in (comm, compute, ideal, ring, serial, unfused, fused)),
        *(f"{ratio:.2f}" for ratio in (ideal / fused, ring / fused, serial / unfused, fused / unfused)),
    )


def format_report(rows: list[dict], options: argparse.Namespace, config: Config) -> str:
    cpus = os.cpu_count() or 1
    threads = ", ".join(f"{max(1, cpus // w)} at world {w}" for w in sorted({row["world"] for row in rows}))
    lines = [
        report_header(options, ranks=f"intra-op threads per rank: {threads}"),
        ("fused ops called with check_shapes=False; shape B S K N: (B, S, K) @ (K, N), "
         "S the global sequence (dim 1, sharded), float32"),
    ]
    for op in OPS:
        lines += ["", f"### {op}", "",
                  markdown_table(COLUMNS, [table_cells(row) for row in rows if row["op"] == op])]
    return "\n".join(lines)


# -------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    options = parse_arguments(argv, __file__, __doc__, iters=(30, 6), warmup=(3, 1), what="shape",
                              quick="2 shapes, few rounds")
    config = Config(QUICK_SHAPES if options.quick else SHAPES, iters=options.iters, warmup=options.warmup)
    rows = run_worlds(rank_main, config, options.world_sizes,
                      f"{len(OPS)} ops x {len(config.shapes)} shapes")
    if rows:
        print(format_report(rows, options, config))


if __name__ == "__main__":
    main()
