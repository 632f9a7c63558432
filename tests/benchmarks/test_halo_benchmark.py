"""Smoke test of ``benchmarks/halo_conv.py --quick``: it runs and prints its table.

Times are machine noise here and are not asserted; bytes are exact: the halo bytes measured
at ``batch_isend_irecv`` equal, per rank, both ``halo_bytes`` and the minimum the benchmark
counts from the index sets the windows read (independent of torch_tp's geometry; for ``k5 s2
d2 p4`` half the border block), and every rank's halo bytes are below the bytes an all-gather
(plus its reduce-scatter) of the input moves.
"""

import pytest

from torch_tp.testing import ScriptRun, markdown_tables

# subprocess runs of seconds to minutes: `pytest -m "not slow"` leaves them out
pytestmark = pytest.mark.slow

COLUMNS = [
    "world", "conv", "W out", "halo fwd KiB", "index-set fwd", "measured fwd", "halo f+b KiB", "index-set f+b",
    "measured f+b", "AG f+b KiB", "AG/halo", "halo ms", "AG ms", "AG/halo ms",
]
OVERLAP_COLUMNS = ["world", "conv", "serial ms", "overlap ms", "waited serial", "waited overlap", "hidden"]
QUICK_CONVS = {"k3 s1 d1 p1", "k7 s1 d1 p3", "k5 s2 d2 p4"}


QUICK = ScriptRun("benchmarks/halo_conv.py", "--quick", timeout=180)


def _table(text: str) -> list[dict[str, str]]:
    return markdown_tables(text)[0]


def _per_rank(cell: str) -> list[float]:
    return [float(v) for v in cell.split("/")]


@pytest.mark.script_runs(QUICK)
def test_quick_halo_benchmark_prints_the_table_with_exact_halo_bytes():
    out = QUICK.result().stdout
    rows = _table(out)
    assert rows and rows[0]["__header__"] == COLUMNS, out
    assert {(int(r["world"]), r["conv"]) for r in rows} == {(w, c) for w in (2, 4) for c in QUICK_CONVS}, out
    for row in rows:
        world = int(row["world"])
        for formula, minimum, measured in (("halo fwd KiB", "index-set fwd", "measured fwd"),
                                           ("halo f+b KiB", "index-set f+b", "measured f+b")):
            assert row[formula] == row[minimum] == row[measured], (row["conv"], world, formula, out)
            assert len(_per_rank(row[formula])) == world, (row, out)
        if row["conv"] == "k5 s2 d2 p4":  # every other column read: 2 of the 4 / 3 border columns travel
            column = 8 * 16 * 4 * 2 / 1024  # KiB of one column of the quick image (C=8, H=16, N=2)
            inner = [4 * column] * (world - 2)
            assert _per_rank(row["measured fwd"]) == [2 * column] + inner + [2 * column], (row, out)
        total = _per_rank(row["halo f+b KiB"])
        assert 0 < max(total) < float(row["AG f+b KiB"]), (row, out)
        assert float(row["AG/halo"]) > 1, (row, out)
        # inner ranks exchange with two neighbours, edge ranks with one: stride 1 sends twice the edges'
        if row["conv"].split()[1] == "s1":
            fwd = _per_rank(row["halo fwd KiB"])
            assert fwd[1:-1] == [2 * fwd[0]] * (world - 2) and fwd[0] == fwd[-1] > 0, (row, out)
        for column in ("halo ms", "AG ms"):
            assert float(row[column]) > 0, (row, out)
    # the forward's exposed halo time, overlap off and on: every cell measured, the share hidden computed
    overlap = markdown_tables(out)[1]
    assert overlap[0]["__header__"] == OVERLAP_COLUMNS, out
    assert [(r["world"], r["conv"]) for r in overlap] == [(r["world"], r["conv"]) for r in rows], out
    for row in overlap:
        waited = float(row["waited serial"]), float(row["waited overlap"])
        assert float(row["serial ms"]) > 0 and float(row["overlap ms"]) > 0 and min(waited) >= 0, (row, out)
        if waited[0] >= 0.05:  # the cells are rounded to 0.001 ms
            assert float(row["hidden"]) == pytest.approx(1 - waited[1] / waited[0], abs=0.05), (row, out)
