"""The op sweep of int8 token communication (``torch_tp/testing/_op_sweep_tokens.py``): the int8
all-gather and reduce-scatter of token rows on 2 gloo ranks, on the OpInfo database's sample shapes
with empty, featureless, uneven and non-finite samples, against the float collective of the rounded
values. CI runs the whole sweep; ``docs/op_coverage.md`` must hold its table
(``python3 -m torch_tp.testing._op_sweep_tables int8-tokens`` rewrites it)."""

from torch_tp.testing import ROOT
from torch_tp.testing._op_sweep import COVERAGE_DOC, assert_documented, coverage_table, marked_section
from torch_tp.testing._op_sweep_tokens import INT8_TOKENS, sweep_tokens


def test_the_int8_token_collectives_equal_the_float_ones_of_the_rounded_values_and_the_docs_table_is_the_sweeps():
    result = sweep_tokens(timeout=600)
    text = (ROOT / COVERAGE_DOC).read_text()
    assert_documented(result, text, "python3 -m torch_tp.testing._op_sweep_tables int8-tokens")
    begin, end = marked_section(INT8_TOKENS)
    assert text.split(begin, 1)[1].split(end, 1)[0].strip() == coverage_table(result).strip()
    samples = {case.sample.rpartition(" ")[2] for case in result.cases if case.outcome == "equal"}
    assert {"non-finite", "features", "0"} <= samples, samples
    refused = {case.op for case in result.cases if case.outcome == "refused"}
    assert refused and all(op.startswith("int8_reduce_scatter") for op in refused), refused  # uneven dims only
