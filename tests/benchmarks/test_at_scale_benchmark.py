"""Smoke test of ``benchmarks/at_scale.py --quick``: Llama-3-8B and -70B's parameter bytes per rank
equal figures computed here from their sizes, the communication estimates equal the ring formulas
at those sizes, and the analytic collective model equals what gloo measured on the small model
(world size 2). Times are estimates printed by the script, never measured."""

import pytest

from torch_tp.testing import ScriptRun, markdown_tables

# a subprocess run of seconds: `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

QUICK = ScriptRun("benchmarks/at_scale.py", "--quick", timeout=180)

VOCAB, KV = 128256, 1024  # 8 KV heads of 128
BF16, NVLINK, IB = 2, 450e9, 50e9


def _linear_params(dim: int, ffn: int) -> int:
    """One block's linear parameters: wq, wo (dim x dim), wk, wv (KV x dim), w1, w2, w3 (ffn x dim)."""
    return 2 * dim * dim + 2 * KV * dim + 3 * ffn * dim


def _bf16_bytes_per_rank(dim: int, layers: int, ffn: int, ranks: int) -> int:
    """Every matrix split ``ranks`` ways (TP, or TP x FSDP), the 2 L + 1 norm weights whole."""
    matrices = layers * _linear_params(dim, ffn) + 2 * VOCAB * dim  # the blocks, the embedding and the head
    return matrices // ranks * BF16 + (2 * layers + 1) * dim * BF16


def _row(rows, **cells):
    (row,) = [r for r in rows if all(r[k] == v for k, v in cells.items())]
    return row


@pytest.mark.script_runs(QUICK)
def test_quick_at_scale_benchmark_prints_exact_bytes_ring_estimates_and_a_model_that_matches_gloo():
    out = QUICK.result().stdout
    memory, comm, check = markdown_tables(out)

    tp8 = _row(memory, model="Llama-3-8B", layout="TP 8", weights="bf16")
    assert int(tp8["predicted B/rank"]) == _bf16_bytes_per_rank(4096, 32, 14336, 8) == 2008031232, out
    two_d = _row(memory, model="Llama-3-70B", layout="FSDP dp 8 x TP 8 + SP", weights="bf16")
    assert int(two_d["predicted B/rank"]) == _bf16_bytes_per_rank(8192, 80, 28672, 64), out
    # int8, one rank of dp 8 x tp 8: a byte per element, a float32 scale per local row (column-wise
    # weights keep out/8 rows, FSDP splits their columns; row-wise ones FSDP splits to out/8 rows)
    scale_rows = 80 * ((8192 + 2 * KV + 2 * 28672) // 8 + 2 * 8192 // 8) + 2 * VOCAB // 8  # wq wk wv w1 w3 | wo w2 | emb head
    int8_2d = (80 * _linear_params(8192, 28672) + 2 * VOCAB * 8192) // 64 + 4 * scale_rows + 161 * 8192 * BF16
    assert int(_row(memory, model="Llama-3-70B", layout="FSDP dp 8 x TP 8 + SP", weights="int8")["arithmetic B/rank"]) == int8_2d
    assert all(r["agree"] == "yes" for r in memory), out  # every prediction equals the arithmetic

    row70 = _row(comm, model="Llama-3-70B", weights="bf16")
    assert (row70["per layer, tp"], row70["per layer, dp"]) == ("4 AG 4 RS", "2 AG 1 RS 2 AR"), out
    act, logits = 8192 * 8192 * BF16, 8192 * VOCAB * BF16
    tp_seconds = ((4 * 80 + 2) * 2 * act + logits) * 7 / 8 / NVLINK  # all-gathers and reduce-scatters, ring over 8
    assert abs(float(row70["tp ms (NVLink)"]) - tp_seconds * 1e3) < 0.06, out
    unit, root = _linear_params(8192, 28672) // 8 * BF16, 2 * VOCAB * 8192 // 8 * BF16  # TP-local, gathered over dp
    dp_seconds = (3 * (80 * unit + root) * 7 / 8 + 161 * 2 * 7 / 8 * 8192 * BF16) / IB  # 2 AG + 1 RS per unit; norms' AR
    assert abs(float(row70["dp ms"].split()[0]) - dp_seconds * 1e3) < 0.06, out
    # int8 weights: FSDP gathers the int8 shards (a byte per element, a float32 scale per TP-local
    # row: column-wise weights keep out/8 rows, wo and w2 all 8192) and reduce-scatters no gradient
    # of a frozen weight; the norms' all-reduces stay
    int8_70 = _row(comm, model="Llama-3-70B", weights="int8")
    assert (int8_70["per layer, tp"], int8_70["per layer, dp"]) == ("4 AG 4 RS", "2 AG 2 AR"), out
    unit8 = _linear_params(8192, 28672) // 8 + 4 * ((8192 + 2 * KV + 2 * 28672) // 8 + 2 * 8192)
    root8 = 2 * VOCAB * 8192 // 8 + 4 * 2 * VOCAB // 8
    dp8_seconds = (2 * (80 * unit8 + root8) * 7 / 8 + 161 * 2 * 7 / 8 * 8192 * BF16) / IB
    assert abs(float(int8_70["dp ms"].split()[0]) - dp8_seconds * 1e3) < 0.06, out
    assert int8_70["tp ms (NVLink)"] == row70["tp ms (NVLink)"], out  # activations move as before

    assert {(r["world"], r["layout"], r["layers"]) for r in check} == {
        ("2", layout, layers) for layout in ("TP + SP", "FSDP") for layers in ("1", "2")}, out
    assert all(r["equal"] == "yes" for r in check), out
