"""Driving a benchmark's ranks and printing its report (shared by the benchmark scripts).

A script defines its ``Config`` (a frozen dataclass subclassing :class:`RunConfig`) and
``rank_main(config)``, which runs on every rank and has rank 0 write its result rows as JSON
to ``config.result_path``; :func:`run_world` launches it (spawned gloo ranks, or the ranks
``torchrun`` made) and returns those rows. Its report opens with :func:`report_header`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from torch_tp.launch import launch, launched_by_torchrun, rank_device

__all__ = [
    "RunConfig",
    "benchmark_arguments",
    "finish_arguments",
    "parse_arguments",
    "world_sizes",
    "run_world",
    "run_worlds",
    "progress",
    "markdown_table",
    "report_header",
]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What every rank needs to know (picklable: it travels to spawned ranks).

    A script's ``Config`` subclasses it as a frozen dataclass and adds its own fields; these
    shared ones are keyword-only. :func:`run_world` fills in ``result_path``.

    Example::

        >>> @dataclass(frozen=True)
        ... class Config(RunConfig):
        ...     shapes: tuple[str, ...]
        >>> Config(("B1 S1024",), iters=30, warmup=3)
        Config(iters=30, warmup=3, result_path='', shapes=('B1 S1024',))
    """

    iters: int
    warmup: int
    result_path: str = ""


def run_world(rank_main: Callable[[Any], None], nproc: int, config: Any) -> list[dict]:
    """Launch ``nproc`` ranks (or use torchrun's) running ``rank_main(config)``; return rank 0's rows."""
    with tempfile.TemporaryDirectory() as tmp:
        config = replace(config, result_path=os.path.join(tmp, "rows.json"))
        launch(_without_runtime_checks, rank_main, config, nproc=nproc)
        if not os.path.exists(config.result_path):  # a non-zero rank under torchrun
            return []
        with open(config.result_path) as f:
            return json.load(f)


def _without_runtime_checks(rank_main: Callable[[Any], None], config: Any) -> None:
    """Benchmarks measure the plans' own communication and time: torch_tp's forward-time
    agreement checks are off (``benchmarks/agreement.py`` measures them, turning them on)."""
    from torch_tp import runtime_checks

    with runtime_checks(False):
        rank_main(config)


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


def world_sizes(text: str) -> list[int]:
    """The world sizes to run: those in ``text`` ("2,4"), or torchrun's one world.

    Example::

        >>> world_sizes("2,4")  # not under torchrun
        [2, 4]
    """
    if launched_by_torchrun():  # this process is one of the launcher's ranks
        return [int(os.environ["WORLD_SIZE"])]
    return [int(w) for w in text.split(",")]


def require_for_each_world(parser: argparse.ArgumentParser, worlds: Iterable[int],
                           problem: Callable[[int], str | None]) -> None:
    """Stop with ``parser.error`` at the first world size where ``problem(world)`` names what
    is wrong with the sizes asked for (``None``: nothing).

    Example::

        >>> require_for_each_world(parser, [2, 4], lambda w: None if 12 % w == 0 else f"12 rows over {w} ranks")
    """
    for world in worlds:
        message = problem(world)
        if message is not None:
            parser.error(f"world size {world}: {message}")


def run_worlds(rank_main: Callable[[Any], None], config: Any, sizes: str, what: str) -> list[dict]:
    """:func:`run_world` for each size in ``sizes`` ("2,4"), or once under torchrun.

    Reports progress (``what`` says what each world runs) and the total time on stderr.
    """
    start = time.perf_counter()
    rows: list[dict] = []
    for nproc in world_sizes(sizes):
        progress(f"world size {nproc}: {what} ...")
        world_start = time.perf_counter()
        rows += run_world(rank_main, nproc, config)
        progress(f"  done in {time.perf_counter() - world_start:.1f} s")
    if rows:
        progress(f"total {time.perf_counter() - start:.1f} s")
    return rows


def benchmark_arguments(
    script: str,
    doc: str,
    *,
    iters: tuple[int, int],
    warmup: tuple[int, int],
    what: str,
    quick: str,
    min_iters: int = 1,
) -> argparse.ArgumentParser:
    """The options every benchmark script takes: ``--iters``, ``--quick``, ``--world-sizes``.

    ``script`` and ``doc`` are the script's ``__file__`` and ``__doc__`` (its first line
    describes the script). ``iters`` and ``warmup`` are ``(full, quick)`` defaults;
    :func:`finish_arguments` fills them in after parsing. A script adds its own options to
    the returned parser.
    """
    parser = argparse.ArgumentParser(prog=f"python3 benchmarks/{os.path.basename(script)}",
                                     description=doc.splitlines()[0])
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed rounds per {what} (default {iters[0]}; {iters[1]} with --quick)")
    parser.add_argument("--quick", action="store_true", help=f"{quick} (smoke test)")
    parser.add_argument("--world-sizes", default="2,4",
                        help="comma-separated world sizes to spawn (default 2,4; ignored under torchrun)")
    parser.set_defaults(_iters=iters, _warmup=warmup, _min_iters=min_iters)
    return parser


def finish_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` and fill in ``iters`` and ``warmup`` from the ``--quick`` choice.

    Also notes ``load_before``, the 1-min load average before anything runs (other jobs on
    the machine make times noisy), which :func:`report_header` prints.
    """
    options = parser.parse_args(argv)
    index = 1 if options.quick else 0
    if options.iters is None:
        options.iters = options._iters[index]
    if options.iters < options._min_iters:
        parser.error(f"--iters must be at least {options._min_iters}")
    options.warmup = options._warmup[index]
    options.load_before = os.getloadavg()[0]
    return options


def parse_arguments(argv: list[str] | None, script: str, doc: str, **defaults: Any) -> argparse.Namespace:
    """The options of a script that adds none of its own: :func:`benchmark_arguments` (with
    ``defaults`` as its keyword arguments), then :func:`finish_arguments`.

    Example::

        >>> options = parse_arguments(["--quick"], "benchmarks/overlap.py", "Fused vs unfused.",
        ...                           iters=(30, 6), warmup=(3, 1), what="shape", quick="2 shapes")
        >>> options.iters, options.warmup
        (6, 1)
    """
    return finish_arguments(benchmark_arguments(script, doc, **defaults), argv)


def report_header(options: argparse.Namespace, *, software: str = "", ranks: str = "", rounds: str = "",
                  load: bool = True, agreement_checks: bool = False) -> str:
    """The report's first line: versions, backend and CPUs, then rounds and load average.

    ``software`` follows torch's version (``"transformers 5.0"``), ``ranks`` the CPU count
    (``"4 ranks"``), ``rounds`` the warm-up count; ``load=False`` leaves the load average out;
    ``agreement_checks=True`` for a script that runs torch_tp's forward-time checks (the driver
    turns them off for the others).

    Example::

        >>> report_header(argparse.Namespace(iters=10, warmup=2), ranks="4 ranks", load=False)
        "torch ..., gloo, ... CPUs, 4 ranks; 10 timed rounds after 2 warm-up; torch_tp's forward-time agreement checks off (benchmarks/agreement.py)"
    """
    backend = "nccl" if rank_device().type == "cuda" else "gloo"
    setup = ", ".join(filter(None, (f"torch {torch.__version__}", software, backend, f"{os.cpu_count()} CPUs", ranks)))
    parts = [setup, f"{options.iters} timed rounds after {options.warmup} warm-up{rounds}"]
    if not agreement_checks:
        parts.append("torch_tp's forward-time agreement checks off (benchmarks/agreement.py)")
    if load:
        parts.append(f"1-min load average {options.load_before:.1f} before starting")
    return "; ".join(parts)
