"""The op sweep of W8A8 weights (``torch_tp/testing/_op_sweep_w8a8.py``): every OpInfo op and
float32 sample with an ``Int8SymmetricTensor(activations="int8")`` in place of each 2-D float
argument, against the op on its float values with the activations rounded as W8A8 rounds them.
CI sweeps the ops W8A8 exists for and a fixed eighth of the rest; their counts must be the table's
in ``docs/op_coverage.md`` (``python3 -m torch_tp.testing._op_sweep_tables w8a8`` sweeps all)."""

import pytest
import torch

from torch_tp.testing import ROOT
from torch_tp.testing._op_sweep import COVERAGE_DOC, assert_documented, op_name, sampled_ops, sweep_ops
from torch_tp.testing._op_sweep_w8a8 import W8A8, RoundedActivations

KEEP = ("nn.functional.linear", "mm", "addmm", "matmul", "t", "nn.functional.embedding", "flatten")


@pytest.fixture(scope="module")
def op_db():
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def test_no_sampled_op_gives_a_wrong_result_or_an_unclear_error_and_the_docs_table_is_the_sweeps(op_db):
    result = sweep_ops(W8A8, ops=sampled_ops(op_db, keep=KEEP))
    assert_documented(result, (ROOT / COVERAGE_DOC).read_text(), "python3 -m torch_tp.testing._op_sweep_tables w8a8")
    by_op = result.by_op()
    for op in KEEP:
        assert by_op[op]["equal"] > 0, (op, by_op.get(op))
    # found by the sweep: a flattened weight (Int8FlatView, FSDP's view(-1)) dequantized a value near
    # float32's max to inf, where the weight itself gives the largest float (_ops_fsdp.py)
    assert any(c.op == "flatten" and c.sample == "non-finite" and c.outcome == "equal" for c in result.cases)
    equal = {(case.op, case.sample) for case in result.cases if case.outcome == "equal"}
    assert {("nn.functional.linear", "non-finite"), ("mm", "no rows")} <= equal, sorted(equal, key=str)


def test_against_the_unrounded_float_op_w8a8_linear_would_be_wrong(op_db, monkeypatch):
    """The reference must round the activations: without it, W8A8's rounding reads as wrong."""
    import torch_tp.testing._op_sweep_w8a8 as module

    class Unrounded(RoundedActivations):
        def _per_output_column(self, b, linear):
            return False

    monkeypatch.setattr(module, "RoundedActivations", Unrounded)
    linear = [op for op in op_db if op_name(op) == "nn.functional.linear"]
    outcomes = {case.outcome for case in sweep_ops(W8A8, ops=linear, samples_per_op=4).cases}
    assert "wrong" in outcomes, outcomes


def test_the_rounded_reference_rounds_only_x_times_the_weights_transpose():
    w = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    x = torch.tensor([[0.3, 1.0], [0.7, -0.2]])
    with RoundedActivations(w):
        forward, gradient_like = x @ w.t(), x @ w
    rounded = _rounded(x)
    torch.testing.assert_close(forward, rounded @ w.t())
    assert not torch.equal(forward, x @ w.t())
    torch.testing.assert_close(gradient_like, x @ w)  # sums over the weight's rows: weight-only in W8A8


def _rounded(x):
    from torch_tp._tokens import dequantize_tokens, quantize_tokens

    return dequantize_tokens(*quantize_tokens(x), x.dtype)
