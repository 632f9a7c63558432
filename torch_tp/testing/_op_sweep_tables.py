"""``python3 -m torch_tp.testing._op_sweep_tables [SURFACE ...]``: run the whole op sweep of each
surface (default: all) and rewrite its coverage table in ``docs/op_coverage.md``.

- ``int8-weight``: :data:`~torch_tp.testing._op_sweep_int8.INT8_WEIGHT`, about 3 minutes on 2 cores
- ``w8a8``: :data:`~torch_tp.testing._op_sweep_w8a8.W8A8`, about 3 minutes
- ``spatial``: :data:`~torch_tp.testing._op_sweep_spatial.SPATIAL` (2 ranks), about an hour
- ``int8-tokens``: :data:`~torch_tp.testing._op_sweep_tokens.INT8_TOKENS` (2 ranks), under a
  minute (CI runs all of it)

``TORCH_TP_SWEEP_JOURNAL=PATH`` makes the spatial sweep append each op's cases to ``PATH`` as it
goes and skip the ops ``PATH`` holds: an interrupted run resumes (delete ``PATH`` after changing
what the region runs).

CI sweeps a fixed sample of each surface's ops and checks it against the table
(:func:`~torch_tp.testing._op_sweep.assert_documented`); after changing what a surface runs,
rewrite the table with this command.

Example::

    >>> # xdoctest: +SKIP("sweeps every op (minutes)")
    >>> result = SWEEPS["int8-weight"]()
    >>> write_coverage(COVERAGE_DOC, result)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from torch_tp.testing._op_sweep import COVERAGE_DOC, SweepResult, sweep_ops, write_coverage
from torch_tp.testing._op_sweep_int8 import INT8_WEIGHT
from torch_tp.testing._op_sweep_spatial import sweep_spatial
from torch_tp.testing._op_sweep_tokens import sweep_tokens
from torch_tp.testing._op_sweep_w8a8 import W8A8

__all__ = ["SWEEPS", "main"]

#: ``key -> the whole sweep of that surface``.
SWEEPS: dict[str, Callable[[], SweepResult]] = {
    "int8-weight": lambda: sweep_ops(INT8_WEIGHT),
    "w8a8": lambda: sweep_ops(W8A8),
    "spatial": lambda: sweep_spatial(journal=os.environ.get("TORCH_TP_SWEEP_JOURNAL")),
    "int8-tokens": sweep_tokens,
}


def main(keys: list[str]) -> None:
    """Sweep the surfaces named by ``keys`` (default every one) and rewrite their tables."""
    unknown = [key for key in keys if key not in SWEEPS]
    if unknown:
        raise SystemExit(f"torch_tp.testing._op_sweep_tables: no surface {unknown}; the keys are {list(SWEEPS)}")
    for key in keys or list(SWEEPS):
        swept = SWEEPS[key]()
        write_coverage(COVERAGE_DOC, swept)
        print(f"{swept.surface.name}: {len(swept.cases)} cases, {len(swept.failures())} wrong or unclear "
              f"-> {COVERAGE_DOC}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
