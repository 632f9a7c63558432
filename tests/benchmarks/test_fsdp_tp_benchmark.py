"""Smoke test of ``benchmarks/fsdp_tp.py --quick``: it runs and prints its two tables.

Times are machine noise here and are not asserted beyond being positive. Asserted: every
variant matched one process before being measured; the measured parameter bytes per rank
equal the prediction; TP, FSDP and 2-D hold the same bytes, a quarter of the one-process
model's matrices plus its whole norms; their gradients and AdamW state are sharded like their
parameters; a TP step's collectives include
the optimizer's all-reduces of the norms' gradients; full recompute saves fewer activations and
re-runs collectives, the selective policy re-runs none.
"""

import pytest

from torch_tp.testing import ScriptRun, markdown_tables

# subprocess runs of seconds to minutes: `pytest -m "not slow"` leaves them out
pytestmark = pytest.mark.slow

COLUMNS = ["variant", "params KiB", "predicted", "grads KiB", "AdamW KiB", "sent KiB", "collectives", "step ms", "loss Δ"]
AC_COLUMNS = ["checkpointing", "peak MiB", "peak activations MiB", "activations vs none", "collectives", "sent KiB"]


QUICK = ScriptRun("benchmarks/fsdp_tp.py", "--quick", timeout=300)


@pytest.mark.script_runs(QUICK)
def test_quick_benchmark_predicts_the_bytes_it_measures_and_checkpointing_saves_activations():
    out = QUICK.result().stdout
    variants, checkpointing = markdown_tables(out)
    assert variants[0]["__header__"] == COLUMNS and checkpointing[0]["__header__"] == AC_COLUMNS, out
    rows = {r["variant"]: r for r in variants}
    assert list(rows) == ["1 process", "TP 1x4", "FSDP 4x1", "2-D 2x2"], out
    single = rows.pop("1 process")
    assert single["predicted"] == "-" and single["collectives"] == "-" and single["sent KiB"] == "0.0", out
    assert single["grads KiB"] == single["params KiB"] and float(single["step ms"]) > 0, out
    whole = None
    for name, r in rows.items():
        assert float(r["loss Δ"]) <= 1e-5 and float(r["step ms"]) > 0 and float(r["sent KiB"]) > 0, (name, out)
        assert r["params KiB"] == r["predicted"], (name, out)  # measured = predicted
        whole = whole or float(r["params KiB"])
        assert float(r["params KiB"]) == whole, (name, out)  # matrices split 4 ways, norms whole in all three
        assert float(r["AdamW KiB"]) >= 2 * float(r["params KiB"]), (name, out)  # two moments per element
    # each rank: a quarter of every matrix, the norms whole
    assert 3 * whole < float(single["params KiB"]) <= 4 * whole, out
    # FSDP2 reduce-scatters gradients to the parameters' shards; TP's vocab-parallel embedding
    # keeps its gradient Shard(0) (DTensor's own rule returned it whole on every rank)
    for name in ("TP 1x4", "FSDP 4x1", "2-D 2x2"):
        assert rows[name]["grads KiB"] == rows[name]["params KiB"], (name, out)
    # TP+SP: per block 2 AG + 2 RS each way, the head; AdamW all-reduces each of the 5 norms' Partial grads 3 times
    assert rows["TP 1x4"]["collectives"] == "11AG+10RS+15AR", out
    ac = {r["checkpointing"]: r for r in checkpointing}
    assert list(ac) == ["none", "full", "selective"], out
    assert float(ac["full"]["peak activations MiB"]) < float(ac["selective"]["peak activations MiB"]) <= float(
        ac["none"]["peak activations MiB"]), out
    assert ac["selective"]["collectives"] == ac["none"]["collectives"] != ac["full"]["collectives"], out
