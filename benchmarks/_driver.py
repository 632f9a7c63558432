"""Driving a benchmark's ranks and printing its report (shared by the benchmark scripts).

A script defines ``rank_main(config)``, which runs on every rank and has rank 0 write its
result rows as JSON to ``config.result_path``; :func:`run_world` launches it (spawned gloo
ranks, or the ranks ``torchrun`` made) and returns those rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch_tp.launch import launch, launched_by_torchrun

__all__ = ["benchmark_arguments", "finish_arguments", "run_world", "run_worlds", "progress", "markdown_table"]


def run_world(rank_main: Callable[[Any], None], nproc: int, config: Any) -> list[dict]:
    """Launch ``nproc`` ranks (or use torchrun's) running ``rank_main(config)``; return rank 0's rows."""
    with tempfile.TemporaryDirectory() as tmp:
        config = replace(config, result_path=os.path.join(tmp, "rows.json"))
        launch(rank_main, config, nproc=nproc)
        if not os.path.exists(config.result_path):  # a non-zero rank under torchrun
            return []
        with open(config.result_path) as f:
            return json.load(f)


def progress(message: str) -> None:
    """Progress goes to stderr (rank 0's only, under torchrun) so stdout holds only the report."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Aligned Markdown table: readable in a terminal, pasteable into docs."""
    widths = [max(len(line[i]) for line in (header, *rows)) for i in range(len(header))]

    def line(values):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), separator, *(line(r) for r in rows)])


def run_worlds(rank_main: Callable[[Any], None], config: Any, world_sizes: str, what: str) -> list[dict]:
    """:func:`run_world` for each size in ``world_sizes`` ("2,4"), or once under torchrun.

    Reports progress (``what`` says what each world runs) and the total time on stderr.
    """
    if launched_by_torchrun():  # this process is one of the launcher's ranks
        worlds = [int(os.environ["WORLD_SIZE"])]
    else:
        worlds = [int(w) for w in world_sizes.split(",")]
    start = time.perf_counter()
    rows: list[dict] = []
    for nproc in worlds:
        progress(f"world size {nproc}: {what} ...")
        world_start = time.perf_counter()
        rows += run_world(rank_main, nproc, config)
        progress(f"  done in {time.perf_counter() - world_start:.1f} s")
    if rows:
        progress(f"total {time.perf_counter() - start:.1f} s")
    return rows


def benchmark_arguments(
    prog: str,
    description: str,
    *,
    iters: tuple[int, int],
    warmup: tuple[int, int],
    what: str,
    quick: str,
    min_iters: int = 1,
) -> argparse.ArgumentParser:
    """The options every benchmark script takes: ``--iters``, ``--quick``, ``--world-sizes``.

    ``iters`` and ``warmup`` are ``(full, quick)`` defaults; :func:`finish_arguments` fills
    them in after parsing. A script adds its own options to the returned parser.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed rounds per {what} (default {iters[0]}; {iters[1]} with --quick)")
    parser.add_argument("--quick", action="store_true", help=f"{quick} (smoke test)")
    parser.add_argument("--world-sizes", default="2,4",
                        help="comma-separated world sizes to spawn (default 2,4; ignored under torchrun)")
    parser.set_defaults(_iters=iters, _warmup=warmup, _min_iters=min_iters)
    return parser


def finish_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` and fill in ``iters`` and ``warmup`` from the ``--quick`` choice."""
    options = parser.parse_args(argv)
    index = 1 if options.quick else 0
    if options.iters is None:
        options.iters = options._iters[index]
    if options.iters < options._min_iters:
        parser.error(f"--iters must be at least {options._min_iters}")
    options.warmup = options._warmup[index]
    return options
