"""The fault matrix: a training loop's collective sites and file operations, times what a rank
can do wrong there, each with the outcome :func:`torch_tp.launch.launch` must give.

The loop (:func:`training_job`, on 2 CPU ranks over gloo) trains a tensor-parallel two-layer MLP
(``ColwiseParallel`` then ``RowwiseParallel``) with AdamW for :data:`STEPS` steps, resuming from
the newest checkpoint in its directory and saving after every second step with ``keep=1``
(:func:`torch_tp.checkpoint.save_training_state`, which prunes the older one). One rank (the
*culprit*: rank 1, or rank 0 where only rank 0 acts, the prune) misbehaves at one *site*:

====================  ==========================================================================
site                  where the culprit misbehaves (its peers wait in the next collective)
====================  ==========================================================================
``rendezvous``        before it joins the process group (the others wait in the store's barrier)
``forward``           step 3, before the forward (the peer waits in the row-wise all-reduce)
``backward``          step 3, after the forward (the peer waits in the backward's all-reduce)
``optimizer step``    step 3, at the optimizer step (the peer waits in step 4's forward)
``save``              step 4, after writing its part of ``step-4.partial`` (mid-save)
``prune``             step 4, rank 0, after renaming ``step-2`` to ``.partial`` (mid-prune)
``load``              at the start, in ``load_training_state`` (the directory holds ``step-2``)
====================  ==========================================================================

The *faults*: ``sigkill`` (the OOM killer), ``sigstop`` (stopped, never continued), ``sigterm``
(from outside: a scheduler, ``kill``), ``raises``, and ``disagrees`` on one value where the site
has one: another ``path``, ``step``, ``shape`` or ``dtype`` than its peers.

Every cell must end in a named error within its bound: :class:`~torch_tp.launch.LaunchFailure`
whose first line names the culprit and what it did, or, for a disagreement, the named error
raised on every rank; and nothing may be lost: the run resumed from the directory ends with the
parameters of the run that was never interrupted, bit for bit. :data:`CELLS` is the table;
:func:`run_cell` runs one cell and says whether it held. ``tests/launch/test_fault_matrix.py``
runs :data:`SAMPLE` (every site once, every fault at least once) and checks that the table in
``docs/fault_matrix.md`` is :func:`matrix_table`; the whole matrix::

    python3 tests/launch/fault_matrix.py             # every cell, with its time (about 3 min)
    python3 tests/launch/fault_matrix.py --write     # rewrite docs/fault_matrix.md's table
    TORCH_TP_FAULT_MATRIX=all python3 -m pytest tests/launch/test_fault_matrix.py

It lives beside the tests, not in ``torch_tp.testing``: it reaches into
``torch_tp.checkpoint``'s private phases (after a rank's files are written, mid-prune, before the
load) to fault a rank there, inside that rank's process only.

Example::

    >>> [cell.name for cell in CELLS if cell.site == "prune"]
    ['prune/sigkill', 'prune/sigstop', 'prune/raises']
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = [
    "CELLS",
    "FAULTS",
    "MATRIX_DOC",
    "SAMPLE",
    "SITES",
    "STEPS",
    "Cell",
    "CellResult",
    "InjectedFault",
    "cells_to_run",
    "matrix_table",
    "run_cell",
    "training_job",
]

#: Training steps of the loop; a checkpoint after every second one.
STEPS = 4
SAVE_EVERY = 2
FAULT_STEP = 3  # the training sites' step; the save and prune sites fault in step 4's save
#: The collective timeout of a matrix run (the peers of a stopped rank wait this long).
TIMEOUT_S = 3.0
_CLEAN_TIMEOUT_S = 30.0  # the runs without a fault (the reference, the resumed runs): no bound to hold
SITES = ("rendezvous", "forward", "backward", "optimizer step", "save", "prune", "load")
FAULTS = ("sigkill", "sigstop", "sigterm", "raises", "disagrees")
MATRIX_DOC = "docs/fault_matrix.md"  # under the repository root
_BEGIN, _END = "<!-- fault matrix -->", "<!-- end fault matrix -->"
_WHAT = "fault_matrix"


class InjectedFault(RuntimeError):
    """The exception the ``raises`` fault raises on the culprit.

    Example::

        >>> str(InjectedFault("save"))
        'fault_matrix: the injected fault at save'
    """

    def __init__(self, site: str) -> None:
        super().__init__(f"{_WHAT}: the injected fault at {site}")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell: ``fault`` (``value``: what disagrees) by rank ``culprit`` at ``site``, and the
    outcome: the report's first line matches ``expected`` (``{culprit}`` is the rank) within
    ``bound_s`` seconds; ``every_rank``: each rank raised ``error`` (a disagreement).

    Example::

        >>> Cell("save", "disagrees", "rank . raised", value="step").name
        'save/step'
    """

    site: str
    fault: str
    expected: str
    value: str = ""
    culprit: int = 1
    bound_s: float = 20.0
    error: str = ""

    @property
    def name(self) -> str:
        return f"{self.site}/{self.value or self.fault}"

    @property
    def outcome(self) -> str:
        """The outcome in words (the docs' table)."""
        named = (f"every rank raises `{self.error}`" if self.error
                 else f"`LaunchFailure` naming rank {self.culprit} first")
        return f"{named} within {self.bound_s:g} s; resumed: the uninterrupted parameters"


# generous for a loaded 2-core machine: what they rule out is a hang (the agent's 30 s waits, or forever)
_STOP_BOUND = TIMEOUT_S + 22.0  # the peers' collective timeout, then the stack dump and the agent's teardown
_KILLED = "rank {culprit} was killed by SIGKILL"
_STOPPED = "rank {culprit} was stopped by SIGSTOP"
_TERMINATED = r"rank {culprit} was killed by SIGTERM(?: in \w+)?, sent from outside the launcher"
_RAISED = "rank {culprit} raised fault_matrix.InjectedFault: fault_matrix: the injected fault at {site}"
_CKPT = "torch_tp.checkpoint._errors.CheckpointError"
_EVERY = r"rank [01] raised {error}: .*the ranks' {why}"


def _cells() -> list[Cell]:
    cells = []
    for site in SITES:
        culprit = 0 if site == "prune" else 1
        cells += [
            Cell(site, "sigkill", _KILLED, culprit=culprit),
            Cell(site, "sigstop", _STOPPED, culprit=culprit, bound_s=_STOP_BOUND),
        ]
        cells.append(Cell(site, "sigterm", _TERMINATED, culprit=culprit))
        cells.append(Cell(site, "raises", _RAISED.replace("{site}", site), culprit=culprit))
    disagree = [
        # another batch on one rank: each rank's matmul runs, the row-wise layer's check names it
        Cell("forward", "disagrees", _EVERY.format(error="ValueError", why="inputs, as one sharded tensor, have different shapes"),
             value="shape", error="ValueError"),
        Cell("forward", "disagrees", r"rank {culprit} raised RuntimeError: mat1 and mat2 must have the same dtype",
             value="dtype"),
        # every rank raises: with two ranks, either may come first
        Cell("save", "disagrees", _EVERY.format(error=_CKPT, why="views of the new checkpoint's directory differ"),
             value="path", error=_CKPT),
        Cell("save", "disagrees", _EVERY.format(error=_CKPT, why="steps differ"), value="step", error=_CKPT),
        Cell("load", "disagrees", _EVERY.format(error=_CKPT, why="newest complete checkpoints differ"),
             value="path", error=_CKPT),
        # a model of another shape or dtype on one rank is refused before the load, by parallelize_module
        Cell("load", "disagrees", _EVERY.format(error="ValueError", why="models hold parameter '0.weight' as .*\\(24, 8\\)"),
             value="shape", error="ValueError"),
        Cell("load", "disagrees", _EVERY.format(error="ValueError", why="models hold parameter '0.weight' as .*float64"),
             value="dtype", error="ValueError"),
    ]
    order = {site: i for i, site in enumerate(SITES)}
    return sorted(cells + disagree, key=lambda c: order[c.site])


#: Every cell of the matrix, site by site.
CELLS: tuple[Cell, ...] = tuple(_cells())
#: The cells CI runs: every site once, every fault at least once.
SAMPLE = ("rendezvous/sigterm", "forward/sigstop", "backward/raises", "optimizer step/sigkill", "save/sigkill",
          "prune/sigkill", "load/path")


def cells_to_run(which: str | None = None) -> list[Cell]:
    """:data:`SAMPLE`'s cells, or every cell for ``which="all"`` (default: the
    ``TORCH_TP_FAULT_MATRIX`` environment variable).

    Example::

        >>> len(cells_to_run("all")) == len(CELLS) > len(cells_to_run("sample"))
        True
    """
    which = which if which is not None else os.environ.get("TORCH_TP_FAULT_MATRIX", "sample")
    if which not in ("all", "sample"):
        raise ValueError(f"{_WHAT}: TORCH_TP_FAULT_MATRIX={which!r}; set it to 'all' or 'sample'")
    return list(CELLS) if which == "all" else [c for c in CELLS if c.name in SAMPLE]


# -- the rank side ----------------------------------------------------------------------------


def _misbehave(fault: str, site: str) -> None:
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)  # continued only to be ended (the launcher's SIGTERM)
    elif fault == "sigterm":  # from outside: another process sends it
        import subprocess

        subprocess.run(["kill", "-TERM", str(os.getpid())], check=False)
        time.sleep(60)
    elif fault == "raises":
        raise InjectedFault(site)


class _Culprit:
    """The cell as the rank sees it: whether and how this rank misbehaves at each site."""

    def __init__(self, cell: dict | None) -> None:
        self.cell = cell if cell is not None and dist.get_rank() == cell["culprit"] else None

    def value(self, site: str) -> str:
        """What disagrees on this rank at ``site`` (``""``: nothing)."""
        c = self.cell
        return c["value"] if c and c["site"] == site and c["fault"] == "disagrees" else ""

    def at(self, site: str, step: int | None = None) -> None:
        c = self.cell
        if c and c["site"] == site and c["fault"] != "disagrees" and step in (None, FAULT_STEP):
            _misbehave(c["fault"], site)


def _model(mesh, culprit: _Culprit) -> nn.Module:
    from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    width = 24 if culprit.value("load") == "shape" else 16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.Linear(width, 8))
    if culprit.value("load") == "dtype":
        model = model.to(torch.float64)
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})


def _batch(step: int, culprit: _Culprit) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    if culprit.value("forward") == "shape":
        return torch.randn(5, 8)
    return x.double() if culprit.value("forward") == "dtype" else x


def _sha256(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode() + param.full_tensor().detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _faults_in_the_checkpoint_code(culprit: _Culprit) -> None:
    """Put the save, prune and load sites' faults inside :mod:`torch_tp.checkpoint` (this rank's process only)."""
    from torch_tp.checkpoint import _directory, _training

    c = culprit.cell
    if c is None or c["fault"] == "disagrees" or c["site"] not in ("save", "prune", "load"):
        return
    if c["site"] == "save":
        original_save = _training._save

        def save_then_fault(*args: Any, **kwargs: Any) -> None:
            original_save(*args, **kwargs)
            culprit.at("save")

        _training._save = save_then_fault
    elif c["site"] == "load":
        original_load = _training._load

        def fault_then_load(*args: Any, **kwargs: Any) -> None:
            culprit.at("load")
            original_load(*args, **kwargs)

        _training._load = fault_then_load
    else:  # prune: after step-2 was renamed to .partial, before it is removed
        real = _directory.shutil

        def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
            if str(path).endswith(".partial") and os.path.isdir(path):
                culprit.at("prune")
            real.rmtree(path, *args, **kwargs)

        _directory.shutil = type("shutil", (), {"rmtree": staticmethod(rmtree)})


def training_job(directory: str, cell: dict | None, result: str) -> None:
    """The loop on every rank (under :func:`torch_tp.launch.launch`): resume from ``directory``,
    train to :data:`STEPS`, saving every :data:`SAVE_EVERY` steps with ``keep=1``; ``cell`` (a
    :class:`Cell` as a dict, or ``None``) says who misbehaves where. Rank 0 writes the final
    parameters' SHA-256 to ``result``."""
    from torch.distributed.device_mesh import init_device_mesh

    from torch_tp.checkpoint import load_training_state, save_training_state

    culprit = _Culprit(cell)
    _faults_in_the_checkpoint_code(culprit)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model(mesh, culprit)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    where = directory + "-elsewhere" if culprit.value("load") == "path" else directory
    state = load_training_state(where, model, optimizer)
    for step in range((state.step if state else 0) + 1, STEPS + 1):
        culprit.at("forward", step)
        loss = model(_batch(step, culprit)).square().mean()
        culprit.at("backward", step)
        loss.backward()
        culprit.at("optimizer step", step)
        optimizer.step()
        optimizer.zero_grad()
        if step % SAVE_EVERY == 0:
            into = directory + "-elsewhere" if culprit.value("save") == "path" else directory
            save_training_state(into, step + (culprit.value("save") == "step"), model, optimizer, keep=1)
    digest = _sha256(model)
    if dist.get_rank() == 0:
        pathlib.Path(result).write_text(digest)


def _fault_at_rendezvous(directory: str, cell: dict | None, result: str) -> None:
    """``training_job.before_group``: the rendezvous site's fault, before this rank joins the group."""
    if cell is not None and cell["site"] == "rendezvous" and int(os.environ["RANK"]) == cell["culprit"]:
        _misbehave(cell["fault"], "rendezvous")


training_job.before_group = _fault_at_rendezvous  # type: ignore[attr-defined]


# -- the parent side ----------------------------------------------------------------------------


@dataclasses.dataclass
class CellResult:
    """What one cell did: ``first_line`` of the report, ``seconds`` until it was raised,
    ``problems`` (empty: the cell held)."""

    cell: Cell
    first_line: str
    seconds: float
    problems: list[str]


def _launch(directory: str, cell: Cell | None, result: str) -> tuple[str, str, float]:
    """Run the loop; returns the report (``""``: it succeeded), the error's root cause rank and the seconds."""
    from torch_tp.launch import LaunchFailure, launch

    start = time.monotonic()
    try:
        launch(training_job, directory, dataclasses.asdict(cell) if cell else None, result, nproc=2,
               timeout=timedelta(seconds=TIMEOUT_S if cell else _CLEAN_TIMEOUT_S))
        return "", "", time.monotonic() - start
    except LaunchFailure as failure:
        return str(failure), str(failure.root_cause_rank), time.monotonic() - start


def _reference(work: pathlib.Path) -> tuple[str, pathlib.Path]:
    """The uninterrupted run's parameters, and a directory holding its step-2 checkpoint only
    (what the load cells start from)."""
    seed = work / "seed"
    for steps in (SAVE_EVERY, STEPS):
        report, _, _ = _launch(str(seed if steps == SAVE_EVERY else work / "whole"), None, str(work / "whole.sha"))
        if report:
            raise AssertionError(f"{_WHAT}: the run without a fault failed:\n{report}")
    return (work / "whole.sha").read_text(), seed


_REFERENCE: dict[str, tuple[str, pathlib.Path]] = {}


def run_cell(cell: Cell, work: str | os.PathLike | None = None) -> CellResult:
    """Run ``cell``: the faulty run, then the run resumed from its directory; check the outcome.

    ``work`` holds the runs' directories (default: a temporary one, kept for the process, with
    the uninterrupted reference run made once).

    Example::

        >>> # xdoctest: +SKIP("starts ranks, about 3 s")
        >>> run_cell(CELLS[0]).problems
        []
    """
    root = pathlib.Path(work) if work is not None else pathlib.Path(tempfile.mkdtemp(prefix="torch_tp_faults_"))
    key = str(root)
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference(root)
    whole, seed = _REFERENCE[key]
    directory = root / re.sub(r"\W+", "-", cell.name)
    shutil.rmtree(directory, ignore_errors=True)
    if cell.site == "load":
        shutil.copytree(seed, directory)
    report, root_cause, seconds = _launch(str(directory), cell, str(directory) + ".sha")
    first = report.splitlines()[0] if report else "(no failure)"
    problems = _outcome_problems(cell, report, root_cause, seconds)
    resumed, _, _ = _launch(str(directory), None, str(directory) + ".sha")
    if resumed:
        problems.append(f"the resumed run failed: {resumed.splitlines()[0]}")
    elif pathlib.Path(str(directory) + ".sha").read_text() != whole:
        problems.append("the resumed run's parameters differ from the uninterrupted run's: something was lost")
    return CellResult(cell, first, seconds, problems)


def _outcome_problems(cell: Cell, report: str, root_cause: str, seconds: float) -> list[str]:
    if not report:
        return ["the run succeeded: the fault went unnoticed"]
    problems = []
    headline = report.splitlines()[0]
    cause = headline.split(" ranks: ", 1)[-1]
    if not re.match(cell.expected.format(culprit=cell.culprit), cause):
        problems.append(f"the report's first line does not match {cell.expected!r}")
    if not cell.error and root_cause != str(cell.culprit):
        problems.append(f"the root cause is rank {root_cause}, not rank {cell.culprit}")
    if seconds > cell.bound_s:
        problems.append(f"it took {seconds:.1f} s, past its bound of {cell.bound_s:g} s")
    if cell.error:
        for rank in (0, 1):
            if not re.search(rf"===== rank {rank}: raised .*=====\n(?:.*\n)*?{re.escape(cell.error)}: ", report):
                problems.append(f"rank {rank} did not raise {cell.error}")
    return problems


def matrix_table() -> str:
    """The matrix as the docs show it: one row per cell, site by site.

    Example::

        >>> matrix_table().splitlines()[0]
        '| site | fault | the report says (first line, after the headline) | outcome |'
    """
    rows = ["| site | fault | the report says (first line, after the headline) | outcome |", "| --- | --- | --- | --- |"]
    for c in CELLS:
        fault = f"disagrees: {c.value}" if c.value else c.fault
        said = c.expected.format(culprit=c.culprit).replace("|", "\\|")
        rows.append(f"| {c.site} | {fault} | `{said}` | {c.outcome} |")
    return "\n".join(rows) + "\n"


def _doc(path: str | None) -> pathlib.Path:
    from torch_tp.testing import ROOT

    return pathlib.Path(path) if path is not None else ROOT / MATRIX_DOC


def _write_doc(path: str | None = None) -> None:
    path = _doc(path)
    text = path.read_text()
    head, rest = text.split(_BEGIN, 1)
    tail = rest.split(_END, 1)[1]
    path.write_text(f"{head}{_BEGIN}\n{matrix_table()}{_END}{tail}")


def documented_table(path: str | None = None) -> str:
    """The table between the markers in ``path`` (default: :data:`MATRIX_DOC`)."""
    return _doc(path).read_text().split(_BEGIN, 1)[1].split(_END, 1)[0].strip() + "\n"


def _main(argv: list[str]) -> int:
    if "--write" in argv:
        _write_doc()
        print(f"{len(CELLS)} cells -> {MATRIX_DOC}")
        return 0
    which = "sample" if "--sample" in argv else "all"
    failed = 0
    with tempfile.TemporaryDirectory(prefix="torch_tp_faults_") as work:
        for cell in cells_to_run(which):
            got = run_cell(cell, work)
            failed += bool(got.problems)
            print(f"{cell.name:24s} {got.seconds:5.1f} s  {'ok  ' if not got.problems else 'FAIL'}  {got.first_line[:160]}")
            for problem in got.problems:
                print(f"{'':32s}{problem}")
    print(json.dumps({"cells": len(cells_to_run(which)), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":  # python3 tests/launch/fault_matrix.py [--sample] [--write]
    import sys

    import fault_matrix  # the ranks unpickle the job from this module by name, as under pytest, not __main__

    sys.exit(fault_matrix._main(sys.argv[1:]))
