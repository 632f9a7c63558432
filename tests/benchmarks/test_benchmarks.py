"""Smoke test of ``benchmarks/compare_upstream.py --quick``: it runs and prints its tables.

Times are machine noise here and are not asserted; collective counts and bytes are exact.
"""

import pytest

from torch_tp.testing import ScriptRun, markdown_tables

# subprocess runs of seconds to minutes: `pytest -m "not slow"` leaves them out
pytestmark = pytest.mark.slow

COLUMNS = [
    "world", "size", "variant", "mode", "fwd comms", "fwd KiB", "f+b comms", "f+b KiB",
    "param KiB", "step ms", "p25-p75", "CPU ms", "hook µs",
]
RATIO_COLUMNS = ["world", "size", "mode", "step ms ratio", "CPU ms ratio", "hook µs ratio"]
VARIANTS = {
    ("torch_tp", "TP"), ("upstream-same", "TP"), ("upstream-usual", "TP"),
    ("torch_tp", "TP+SP"), ("upstream-same", "TP+SP"),
}


QUICK = ScriptRun("benchmarks/compare_upstream.py", "--quick", timeout=120)


@pytest.mark.script_runs(QUICK)
def test_quick_benchmark_prints_the_table_and_same_plans_issue_the_same_collectives():
    out = QUICK.result().stdout
    main, ratios = markdown_tables(out)[:2]

    assert main[0]["__header__"] == COLUMNS, out
    got = {(int(r["world"]), r["size"], r["variant"], r["mode"]) for r in main}
    assert got == {(w, "tiny", v, m) for w in (2, 4) for v, m in VARIANTS}, out
    assert ratios[0]["__header__"] == RATIO_COLUMNS, out
    assert {(int(r["world"]), r["mode"]) for r in ratios} == {(w, m) for w in (2, 4) for m in ("TP", "TP+SP")}

    row = {(int(r["world"]), r["variant"], r["mode"]): r for r in main}
    for world in (2, 4):
        for mode in ("TP", "TP+SP"):
            ours, same = row[(world, "torch_tp", mode)], row[(world, "upstream-same", mode)]
            for column in ("fwd comms", "fwd KiB", "f+b comms", "f+b KiB", "param KiB"):
                assert ours[column] == same[column], (world, mode, column, out)
        # One Llama block: 2 all-reduces forward; backward 2 with torch_tp's plan, 5 with
        # the usual upstream plan. Sequence parallel: 2 gathers + 2 scatters each way.
        assert row[(world, "torch_tp", "TP")]["fwd comms"] == "2AR"
        assert row[(world, "torch_tp", "TP")]["f+b comms"] == "4AR"
        assert row[(world, "upstream-usual", "TP")]["f+b comms"] == "7AR"
        assert row[(world, "torch_tp", "TP+SP")]["fwd comms"] == "2AG+2RS"
        assert row[(world, "torch_tp", "TP+SP")]["f+b comms"] == "4AG+4RS"
