"""The one line a tutorial ends with: does the parallel run match one process? And the exit status.

Each tutorial (and ``python -m torch_tp.demo``) computes what it parallelizes twice, on the mesh
and in one process, and ends with exactly one verdict line:

- ``matches one process (<what>: largest difference <d>, tolerance <t>; ...)``, exit 0;
- ``DOES NOT match one process: <what> differs by <d> (<where>; tolerance <t>); ...``, and
  ``SystemExit(1)`` on every rank, so the command exits non-zero.

:func:`compare` measures values against the single-process ones with a stated tolerance,
:func:`check` takes a difference measured elsewhere (a relative error, a count of findings),
:func:`conclude` prints the line (rank 0) and exits 1 on a mismatch (every rank).

``TORCH_TP_BREAK_VERDICT=1`` in the environment breaks the comparison on purpose, to see the
mismatch path run: :func:`compare` moves each parallel value by ``1 + atol + 2 * rtol * |single|``
and :func:`check` adds ``1 + tolerance`` to the difference, so every comparison fails and the
line says the break was asked for.

Example::

    >>> checks = [compare("loss per step", [2.0, 1.5], [2.0, 1.5000001], rtol=1e-5),
    ...           check("findings", 0, 0)]
    >>> print(verdict_line(checks))
    matches one process (loss per step: largest difference 1.0e-07, tolerance 1e-05 relative; findings: largest difference 0.0e+00, tolerance exact)
    >>> print(verdict_line([compare("logits", [1.0, 3.0], [1.0, 2.0], atol=1e-6)]))
    DOES NOT match one process: logits differs by 1.0e+00 (at index 1; tolerance 1e-06)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["BREAK_VERDICT_ENV", "Check", "check", "compare", "conclude", "verdict_line"]

#: set to ``1`` to break every comparison on purpose (the tests of the mismatch path)
BREAK_VERDICT_ENV = "TORCH_TP_BREAK_VERDICT"


@dataclasses.dataclass(frozen=True)
class Check:
    """One comparison: ``what`` was compared, its largest ``difference``, the ``tolerance`` (as
    text), whether it passed, and ``where`` the largest one lies (``""`` when there is one value).

    Example::

        >>> check("findings", 2, 0)
        Check(what='findings', difference=2.0, tolerance='exact', ok=False, where='')
    """

    what: str
    difference: float
    tolerance: str
    ok: bool
    where: str = ""


def _broken() -> bool:
    return os.environ.get(BREAK_VERDICT_ENV, "") not in ("", "0")


def _tolerance_text(rtol: float, atol: float) -> str:
    if rtol and atol:
        return f"{atol:g} + {rtol:g} x |one process|"
    if rtol:
        return f"{rtol:g} relative"
    return f"{atol:g}" if atol else "exact"


def compare(what: str, parallel, single, *, rtol: float = 0.0, atol: float = 0.0,
            index_name: str = "index") -> Check:
    """Compare ``parallel`` with ``single`` (numbers, sequences of numbers or tensors of one shape)
    element by element: each ``|parallel - single|`` must be at most ``atol + rtol * |single|``.

    Example::

        >>> compare("loss per step", [3.0, 2.0], [3.0, 2.5], atol=1e-4, index_name="step")
        Check(what='loss per step', difference=0.5, tolerance='0.0001', ok=False, where='at step 1')
    """
    p = torch.as_tensor(parallel, dtype=torch.float64).detach().cpu()
    s = torch.as_tensor(single, dtype=torch.float64).detach().cpu()
    if p.shape != s.shape:
        raise ValueError(f"torch_tp._verdict.compare({what!r}): parallel values of shape {tuple(p.shape)} against "
                         f"single-process ones of shape {tuple(s.shape)}; pass values of the same shape")
    shape, p, s = p.shape, p.flatten(), s.flatten()
    if _broken():
        p = p + 1 + atol + 2 * rtol * s.abs()
    if p.numel() == 0:
        return Check(what, 0.0, _tolerance_text(rtol, atol), True)
    gap = (p - s).abs()
    excess = gap - (atol + rtol * s.abs())
    worst = int(torch.argmax(excess if (excess > 0).any() else gap))
    at = worst if len(shape) < 2 else tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), shape))
    where = f"at {index_name} {at}" if p.numel() > 1 else ""
    return Check(what, float(gap[worst]), _tolerance_text(rtol, atol), bool((excess <= 0).all()), where)


def check(what: str, difference: float, tolerance: float) -> Check:
    """A difference measured elsewhere (a relative error, a count of findings) against ``tolerance``.

    Example::

        >>> check("compiled vs eager (relative error)", 3e-7, 1e-5).ok
        True
    """
    difference = float(difference) + (1 + tolerance if _broken() else 0.0)
    return Check(what, difference, f"{tolerance:g}" if tolerance else "exact", difference <= tolerance)


def verdict_line(checks: Iterable[Check]) -> str:
    """The verdict line of ``checks`` (see the module's docstring)."""
    checks = list(checks)
    failed = [c for c in checks if not c.ok]
    note = f" [{BREAK_VERDICT_ENV}=1: broken on purpose]" if _broken() else ""
    if not failed:
        shown = "; ".join(f"{c.what}: largest difference {c.difference:.1e}, tolerance {c.tolerance}" for c in checks)
        return f"matches one process ({shown}){note}"
    shown = "; ".join(
        f"{c.what} differs by {c.difference:.1e} ({c.where + '; ' if c.where else ''}tolerance {c.tolerance})"
        for c in failed
    )
    return f"DOES NOT match one process: {shown}{note}"


def _gathered(checks: list[Check]) -> list[Check]:
    """Rank 0's checks, or, where rank 0 passed and another rank failed, that rank's (named)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return checks
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, checks)
    for rank, theirs in enumerate(every):
        if any(not c.ok for c in theirs):
            if rank == 0:
                return theirs
            return [dataclasses.replace(c, what=f"{c.what} on rank {rank}") for c in theirs]
    return every[0]


def conclude(checks: Sequence[Check]) -> str:
    """Print the verdict line of ``checks`` (rank 0 only, when a process group is up) and raise
    ``SystemExit(1)`` on a mismatch (on every rank: call it on every rank, after the comparisons).

    Returns the line when everything matched.

    Example::

        >>> line = conclude([check("findings", 0, 0)])
        matches one process (findings: largest difference 0.0e+00, tolerance exact)
    """
    merged = _gathered(list(checks))
    line = verdict_line(merged)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(line, flush=True)
    if not all(c.ok for c in merged):
        raise SystemExit(1)
    return line
