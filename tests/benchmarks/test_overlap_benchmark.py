"""Smoke tests of ``benchmarks/overlap.py --quick`` and ``benchmarks/overlap_llama.py --quick``.

``overlap.py`` prints one table per op.

Times are machine noise here and are not asserted. What is checked: both tables have every
(world, shape) row and the columns the docstring defines, every time and ratio is a positive
number, and the bounds are what their formulas make of the printed ``comm ms`` and
``compute ms`` (up to rounding), never of the unfused run: ``ideal ms`` is their max,
``serial ms`` their sum, ``ring ms`` the ring's schedule, between the two; each ratio is
its two printed cells' quotient. (The script itself checks fused == unfused before timing
and exits non-zero if they differ.)
"""

import itertools
import operator
from functools import partial

import pytest

from torch_tp.testing import ScriptRun

# subprocess runs of seconds to minutes: `pytest -m "not slow"` leaves them out
pytestmark = pytest.mark.slow

COLUMNS = ["world", "shape", "MiB sent", "comm ms", "compute ms", "ideal ms", "ring ms", "serial ms",
           "unfused ms", "fused ms", "ideal/fused", "ring/fused", "serial/unfused", "fused/unfused"]
OPS = ("AG+MM", "MM+RS")
QUICK_SHAPES = {"B1 S1024 K512 N128", "B2 S1024 K512 N256"}
TIME_COLUMNS = ("comm ms", "compute ms", "ideal ms", "ring ms", "serial ms", "unfused ms", "fused ms")
# ratio column: (numerator, denominator), both printed columns
RATIOS = {"ideal/fused": ("ideal ms", "fused ms"), "ring/fused": ("ring ms", "fused ms"),
          "serial/unfused": ("serial ms", "unfused ms"), "fused/unfused": ("fused ms", "unfused ms")}


QUICK = ScriptRun("benchmarks/overlap.py", "--quick", timeout=150)
QUICK_LLAMA = ScriptRun("benchmarks/overlap_llama.py", "--quick", timeout=150)


def _tables(text: str) -> dict[str, list[dict[str, str]]]:
    """Every Markdown table in ``text`` under its ``### <op>`` heading, as {column: cell} rows."""
    tables, heading, block = {}, None, []
    for line in [*text.splitlines(), ""]:
        if line.startswith("### "):
            heading = line[4:].strip()
        elif line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif block:
            header, _separator, *rows = block
            tables[heading] = [dict(zip(header, row)) | {"__header__": header} for row in rows]
            block = []
    return tables


def _rounded_range(f, *cells: str) -> tuple[float, float]:
    """Least and greatest ``f(*values)`` over the values that round to the printed ``cells``.

    ``f`` must be monotonic in each argument (the ring bound and ``a / b`` are, for positive
    values), so the corners of the rounding box bound it.
    """
    bounds = []
    for cell in cells:
        half = 0.5 * 10 ** -len(cell.split(".")[1])
        bounds.append((float(cell) - half, float(cell) + half))
    values = [f(*corner) for corner in itertools.product(*bounds)]
    return min(values), max(values)


def _ring(world: int, comm: float, compute: float) -> float:
    steps = world - 1
    return steps * max(comm / steps, compute / world) + compute / world


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator


def _agrees(printed: str, f, *cells: str) -> bool:
    """``printed`` (2 decimals) is ``f`` of the printed ``cells``, up to everyone's rounding."""
    low, high = _rounded_range(f, *cells)
    return low - 0.005 <= float(printed) <= high + 0.005


@pytest.mark.script_runs(QUICK)
def test_quick_overlap_benchmark_prints_both_tables_with_bounds_from_comm_and_compute_alone():
    out = QUICK.result().stdout
    assert "check_shapes=False" in out, out
    tables = _tables(out)
    assert set(tables) == set(OPS), out
    for op in OPS:
        rows = tables[op]
        assert rows and rows[0]["__header__"] == COLUMNS, (op, out)
        assert {(int(r["world"]), r["shape"]) for r in rows} == {(w, s) for w in (2, 4) for s in QUICK_SHAPES}, out
        for row in rows:
            for column in ("MiB sent", *TIME_COLUMNS, *RATIOS):
                assert float(row[column]) > 0, (op, column, row, out)
            comm, compute = row["comm ms"], row["compute ms"]
            # rounding is monotonic: the max of the rounded cells is the rounded max
            assert float(row["ideal ms"]) == max(float(comm), float(compute)), (op, row, out)
            assert _agrees(row["serial ms"], operator.add, comm, compute), (op, row, out)
            low, high = _rounded_range(partial(_ring, int(row["world"])), comm, compute)
            assert low - 0.005 <= float(row["ring ms"]) <= high + 0.005, (op, row, out)
            # up to rounding (the ring's formula equals the max or the sum exactly at its ends)
            ideal, ring, serial = (float(row[c]) for c in ("ideal ms", "ring ms", "serial ms"))
            assert ideal - 0.01 <= ring <= serial + 0.01, (op, row, out)
            for column, (numerator, denominator) in RATIOS.items():
                assert _agrees(row[column], _ratio, row[numerator], row[denominator]), (op, column, row, out)


@pytest.mark.script_runs(QUICK_LLAMA)
def test_quick_llama_overlap_benchmark_times_both_variants_and_counts_their_communication():
    out = QUICK_LLAMA.result().stdout
    rows = _tables(out)[None]
    assert [int(r["world"]) for r in rows] == [2, 4], out
    for row in rows:
        world = int(row["world"])
        assert float(row["unfused ms"]) > 0 and float(row["overlap ms"]) > 0, (row, out)
        assert _agrees(row["overlap/unfused"], _ratio, row["overlap ms"], row["unfused ms"]), (row, out)
        # one layer: 5 fused ops forward (2 shared gathers, 2 reduce-scatters, the head) and 5
        # backward, world - 1 ring steps each; the fused plan keeps 3 collectives (the
        # embedding's reduce-scatter and its backward all-gather, the logits' all-gather)
        assert int(row["P2P steps"]) == 10 * (world - 1), (row, out)
        assert row["collectives"] == "13 -> 3", (row, out)
