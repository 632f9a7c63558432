"""Every docstring example that can run on one process runs and prints what it claims.

Examples that need a process group carry ``# xdoctest: +SKIP(reason)``; the behaviour they
show is covered by the distributed tests.
"""

import xdoctest


def test_docstring_examples_run():
    summary = xdoctest.doctest_module("torch_tp", command="all", argv=[], verbose=0)
    assert summary["n_failed"] == 0, summary
    assert summary["n_passed"] >= 10, summary
