"""The op sweep of int8 weights (``torch_tp/testing/_op_sweep_int8.py``): every OpInfo op and float32
sample with an ``Int8SymmetricTensor`` in place of each 2-D float argument, against the op on its
float values. CI sweeps the ops int8 weights exist for and a fixed eighth of the rest (chosen by a
hash of the name): no case may be a silent wrong result or an unclear error, and each op's counts
must be those of the table in ``docs/op_coverage.md``, which the whole sweep wrote
(``python3 -m torch_tp.testing._op_sweep_tables int8-weight``, about 3 minutes on 2 cores). The sweep
itself is checked on a surface that lies: it must call those cases wrong."""

import dataclasses

import pytest

from torch_tp.testing import ROOT
from torch_tp.testing._op_sweep import COVERAGE_DOC, assert_documented, sampled_ops, sweep_ops
from torch_tp.testing._op_sweep_int8 import INT8_WEIGHT

#: the ops int8 weights exist for: swept in CI every time
KEEP = ("nn.functional.linear", "nn.functional.embedding", "mm", "addmm", "matmul", "t", "vsplit", "flatten")


@pytest.fixture(scope="module")
def int8_sweep():
    from torch.testing._internal.common_methods_invocations import op_db

    return sweep_ops(INT8_WEIGHT, ops=sampled_ops(op_db, keep=KEEP))


def test_no_sampled_op_gives_a_wrong_result_or_an_unclear_error_and_the_docs_table_is_the_sweeps(int8_sweep):
    assert_documented(int8_sweep, (ROOT / COVERAGE_DOC).read_text(), "python3 -m torch_tp.testing._op_sweep_tables int8-weight")
    by_op = int8_sweep.by_op()
    for op in KEEP:  # the ops int8 weights exist for run equal; the sweep reaches them
        assert by_op[op]["equal"] > 0, (op, by_op.get(op))
    # found by the sweep: a flattened weight (Int8FlatView, FSDP's view(-1)) dequantized a value near
    # float32's max to inf, where the weight itself gives the largest float (_ops_fsdp.py)
    assert any(c.op == "flatten" and c.sample == "non-finite" and c.outcome == "equal" for c in int8_sweep.cases)


def test_the_sweep_calls_a_lying_surface_wrong():
    from torch.testing._internal.common_methods_invocations import op_db

    lying = dataclasses.replace(INT8_WEIGHT, name="lying", value=lambda t: t.dequantize() + 1)
    ops = [op for op in op_db if op.name in ("t", "nn.functional.linear")]
    cases = sweep_ops(lying, ops=ops, samples_per_op=2).cases
    assert {case.outcome for case in cases if case.op == "t"} == {"wrong"}, cases
    assert "wrong" in {case.outcome for case in cases if case.op == "nn.functional.linear"}, cases
