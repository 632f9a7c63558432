"""The op sweep of int8 weights (``torch_tp/testing/_op_sweep.py``): every OpInfo op and float32
sample with an ``Int8SymmetricTensor`` in place of each 2-D float argument, against the op on its
float values. No case may be a silent wrong result or an unclear error, and the coverage table in
``docs/op_coverage.md`` must be the sweep's (``python3 -m torch_tp.testing._op_sweep`` rewrites it).
The sweep itself is checked on a surface that lies: it must call those cases wrong."""

import dataclasses
import pathlib

import pytest
import torch

from torch_tp.testing._op_sweep import COVERAGE_DOC, INT8_WEIGHT, coverage_table, marked_section, sweep_ops

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def int8_sweep():
    return sweep_ops(INT8_WEIGHT)


def test_no_op_gives_a_wrong_result_or_an_unclear_error_on_an_int8_weight(int8_sweep):
    failures = int8_sweep.failures()
    assert not failures, "\n".join(f"{c.op} sample {c.sample} arg {c.position}: {c.outcome}: {c.detail}"
                                   for c in failures[:30])
    by_op = int8_sweep.by_op()
    # the ops int8 weights exist for run equal; the sweep reaches them
    for op in ("nn.functional.linear", "nn.functional.embedding", "mm", "addmm", "matmul", "t", "vsplit"):
        assert by_op[op]["equal"] > 0, (op, by_op.get(op))


def test_the_docs_coverage_table_is_the_sweeps(int8_sweep):
    begin, end = marked_section(INT8_WEIGHT)
    text = (ROOT / COVERAGE_DOC).read_text()
    documented = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert documented == coverage_table(int8_sweep).strip(), (
        f"{COVERAGE_DOC} is not the sweep's table: run python3 -m torch_tp.testing._op_sweep")


def test_the_sweep_calls_a_lying_surface_wrong():
    from torch.testing._internal.common_methods_invocations import op_db

    lying = dataclasses.replace(INT8_WEIGHT, name="lying", value=lambda t: t.dequantize() + 1)
    ops = [op for op in op_db if op.name in ("t", "nn.functional.linear")]
    cases = sweep_ops(lying, ops=ops, samples_per_op=2).cases
    assert [case.outcome for case in cases if case.op == "t"] == ["wrong"], cases
    assert "wrong" in {case.outcome for case in cases if case.op == "nn.functional.linear"}, cases
