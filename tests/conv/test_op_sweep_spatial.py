"""The op sweep of a ``SpatialParallel`` region (``torch_tp/testing/_op_sweep_spatial.py``): every
OpInfo op and float32 sample with a spatial input, run inside a region with the input's last dim
sharded over 2 gloo ranks (out of place, in place, and written through a view), against the op in
one process. CI sweeps, in one spawned run, the ops the region is for and a fixed sample of the
rest: none may be a silent wrong result, an unclear error or ranks that disagree, and each op's
counts must be the table's in ``docs/op_coverage.md`` (the whole sweep, about 10 minutes on 2
cores: ``python3 -m torch_tp.testing._op_sweep_tables spatial``)."""

from torch_tp.testing import ROOT
from torch_tp.testing._op_sweep import COVERAGE_DOC, assert_documented, op_name, sampled_ops
from torch_tp.testing._op_sweep_spatial import sweep_spatial

#: the region's allowlist by kind (elementwise, view, reduction, scan, a handler), swept every time;
#: and what the sweep found, each an unclear DTensor RuntimeError before (torch_tp/conv/_region_ops.py,
#: spatial.py): a reshape merging the sharded dim (``flatten``) and ``expand`` of a sharded singleton
#: now run on the gathered dim; ``x.clamp_(lo, hi)`` with replicated bounds runs out of place into the
#: strips; ``rms_norm`` over the sharded dim (``add_`` into a partial mean) and a plain tensor beside
#: the strips (``linalg.matrix_power``'s ``torch.empty``) are refused naming the fix; an int16 map
#: (``short``) is gathered as int32 (gloo has no int16)
KEEP = ("add", "sum", "masked.logsumexp", "amax", "cumsum", "narrow", "flatten", "nn.functional.relu", "nn.functional.conv2d",
        "linalg.matrix_power", "expand", "clamp", "nn.functional.rms_norm", "short")


#: expected failures (upstream's xfail list): none. ``masked.logsumexp`` with ``keepdim`` was wrong on 2
#: samples (DTensor placed aten.logsumexp's keepdim result as if the dims were dropped; fixed in the region).
KNOWN_WRONG: dict[str, int] = {}
REFUSED = ("nn.functional.rms_norm", "linalg.matrix_power")


def test_no_sampled_op_in_a_spatial_region_is_wrong_and_the_docs_table_is_the_sweeps():
    from torch.testing._internal.common_methods_invocations import op_db

    names = [op_name(op) for op in sampled_ops(op_db, keep=KEEP, every=96)]
    result = sweep_spatial(op_names=names, timeout=600)
    assert_documented(result, (ROOT / COVERAGE_DOC).read_text(), "python3 -m torch_tp.testing._op_sweep_tables spatial",
                      known_wrong=KNOWN_WRONG)
    by_op = result.by_op()
    for op in KEEP:  # the allowlist's kinds run equal; the refusals found by the sweep stay named
        assert by_op[op]["equal" if op not in REFUSED else "refused"] > 0, (op, by_op.get(op))
    variants = {(case.op, case.variant) for case in result.cases if case.outcome == "equal"}
    assert {("add", "in place"), ("narrow", "view written through")} <= variants, variants
    samples = {case.sample for case in result.cases if case.op == "sum" and case.outcome == "equal"}
    assert {"non-finite", "size 1", "size 0"} <= samples, samples
