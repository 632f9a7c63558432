"""Smoke test of ``benchmarks/int8_comm.py --quick`` (2 ranks, 20 steps): int8 sequence-parallel
communication moves at most 0.27x the float32 bytes (0.52x bfloat16), forward and backward, its
loss curve stays within 1% of float communication's, and each layer's output error is reported
and small. Times are not measured."""

import pytest

from torch_tp.testing import ScriptRun, markdown_tables

# a subprocess run of seconds: `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

QUICK = ScriptRun("benchmarks/int8_comm.py", "--quick", "--world-sizes", "2")


@pytest.mark.script_runs(QUICK)
def test_quick_int8_comm_benchmark_reports_bytes_error_and_the_loss_curve():
    out = QUICK.result().stdout
    curve, layers = markdown_tables(out)
    (row,) = curve
    assert float(row["ratio"]) <= 0.27 and float(row["bf16 ratio"]) <= 0.52, out
    assert int(row["bytes int8"]) > 0 and float(row["loss last int8"]) < float(row["loss first"]), out
    assert float(row["max diff / first"].rstrip("%")) < 1.0 and float(row["max diff / loss"].rstrip("%")) < 1.0, out
    assert {r["layer"] for r in layers} >= {"tok_embeddings", "layers.0.attention.wo", "layers.0.feed_forward.w2", "output"}, out
    assert all(0 < float(r["output error"]) < 0.05 for r in layers), out
