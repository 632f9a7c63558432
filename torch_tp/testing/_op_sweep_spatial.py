"""The op sweep's ``SpatialParallel`` surface: every OpInfo op inside a spatial region, its first
argument's last dim sharded over 2 ranks, against the op in one process.

For each op and float32 sample whose input has a spatial dim (``ndim >= 3``: (N, C, ...)), a
module whose forward is the op (its other float tensor arguments replicated DTensors, as the
module's parameters are; integer and boolean ones plain tensors, as indices a forward makes) is
parallelized with ``SpatialParallel(dim=-1)`` and called on the whole input on every rank (``input_layouts=Replicate()``: each rank keeps its ``torch.chunk`` strip,
uneven for the database's odd sizes). Three variants per sample:

========================  =============================================================
``out of place``          ``op(x, ...)``
``in place``              the op's in-place variant (``x.add_(y)``): the written ``x``
``view written through``  where ``op(x, ...)`` is a view of ``x`` in one process:
                          ``op(x, ...).add_(1)``, then ``x``
========================  =============================================================

Besides the database's samples, three built from an op's first one: ``non-finite`` (NaN, inf
and -inf in the input), ``size 1`` (one rank's strip is empty) and ``size 0`` (every strip
is); tensor arguments of the input's shape are cut to match. A case is ``equal`` when every
rank's whole result (``full_tensor()``) equals one process's (non-finite where it is),
``refused`` when every rank raises a named error (:func:`torch_tp.testing._op_sweep.refusal`);
ranks that disagree are ``unclear``. The sweep runs in one spawned pool of 2 ranks
(:func:`sweep_spatial`); its collectives use a group with a short timeout, made again after a
case that failed, so that one rank's hang costs seconds and not the sweep.

Example::

    >>> # xdoctest: +SKIP("starts 2 worker processes and imports the OpInfo database")
    >>> result = sweep_spatial(op_names=["add", "sort"], samples_per_op=2)
    >>> sorted({case.outcome for case in result.cases})
    ['equal', 'refused']
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils import _pytree as pytree

from torch_tp.testing._op_sweep import (
    _UNINITIALIZED,
    Surface,
    SweepCase,
    SweepResult,
    compared,
    describe,
    op_name,
    refusal,
    sweep_ops,
)

__all__ = ["SPATIAL", "spatial_positions", "sweep_spatial"]

WORLD_SIZE = 2
_GROUP_TIMEOUT = timedelta(seconds=15)
_TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def spatial_positions(args: Sequence[Any]) -> list[int]:
    """``[0]`` when the sample's input is a float32 (N, C, ...) tensor with a spatial dim, else ``[]``."""
    x = args[0] if args else None
    return [0] if (type(x) is torch.Tensor and x.layout == torch.strided and x.dtype == torch.float32
                   and x.ndim >= 3) else []


def _extra_samples(args: list, kwargs: dict) -> list[tuple[str, list, dict]]:
    """The ``non-finite``, ``size 1`` and ``size 0`` samples built from ``args``."""
    x, d = args[0], args[0].ndim - 1
    extra = []
    if x.numel() >= 3:
        bad = x.clone(memory_format=torch.contiguous_format)
        bad.view(-1)[0], bad.view(-1)[1], bad.view(-1)[-1] = math.nan, math.inf, -math.inf
        extra.append(("non-finite", [bad, *args[1:]], kwargs))
    for size in (1, 0):
        if x.shape[d] > size:
            cut = [a.narrow(d, 0, size).clone() if isinstance(a, torch.Tensor) and a.shape == x.shape else a
                   for a in args]
            extra.append((f"size {size}", cut, kwargs))
    return extra


class _OpRegion(nn.Module):
    """A module whose forward is ``program(x, *rest, **kwargs)``; the float tensors among ``rest`` and
    ``kwargs`` enter as replicated DTensors beside the strips (as a model's parameters do), the
    others (indices, masks: what a forward makes or a buffer holds) as plain tensors."""

    def __init__(self, program, rest: list, kwargs: dict) -> None:
        super().__init__()
        self.program = program
        self.tail = nn.Identity()  # a child, so the style runs this module as a region
        self.leaves, self.spec = pytree.tree_flatten((rest, kwargs))

    def forward(self, x: torch.Tensor) -> Any:
        def beside(v: Any) -> Any:  # float tensors as a model's parameters; indices and masks stay plain
            if isinstance(v, torch.Tensor) and v.is_floating_point() and isinstance(x, DTensor):
                return DTensor.from_local(v.clone(), x.device_mesh, [Replicate()], run_check=False)
            return v

        rest, kwargs = pytree.tree_unflatten([beside(v) for v in self.leaves], self.spec)
        return self.program(x, *rest, **kwargs)


def _program(fn, write: bool):
    def program(x, *rest, **kwargs):
        out = fn(x, *rest, **kwargs)
        if not write:
            return out
        pytree.tree_leaves(out)[0].add_(1)
        return x
    return program


def _is_view_of(out: Any, x: torch.Tensor) -> bool:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(leaves) and leaves[0].numel() > 0 and leaves[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def _whole(result: Any) -> Any:
    return pytree.tree_map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, result)


class _Ranks:
    """Each rank's side of the sweep: the mesh (remade after a failed case) and the cases."""

    def __init__(self) -> None:
        self.mesh = None

    def ensure_mesh(self) -> None:
        if self.mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)
            self.mesh = DeviceMesh.from_group(group, "cpu")

    def run(self, op, args: list, kwargs: dict, position: int) -> list[tuple[str, str, str]]:
        found = []
        torch.manual_seed(0)
        x = args[0].clone()
        try:
            want_out = op(x, *args[1:], **kwargs)
        except Exception:
            return []  # not a case: the op refuses this sample in one process
        variants = [("out of place", op.op, False)]
        if op.inplace_variant is not None:
            variants.append(("in place", op.inplace_variant, False))
        if _is_view_of(want_out, x):
            variants.append(("view written through", op.op, True))
        for variant, fn, write in variants:
            case = self._case(op, _program(fn, write), args, kwargs)
            if case is not None:
                found.append((variant, *case))
        return found

    def _case(self, op, program, args: list, kwargs: dict) -> tuple[str, str] | None:
        from torch_tp.conv import SpatialParallel
        from torch_tp.parallel import parallelize_module

        try:
            torch.manual_seed(0)
            want = program(args[0].clone(), *args[1:], **kwargs)
        except Exception:
            return None  # the variant does not run in one process (an in-place op that changes dtype)
        self.ensure_mesh()
        try:
            region = _OpRegion(program, list(args[1:]), kwargs)
            parallelize_module(region, self.mesh, SpatialParallel(dim=-1, input_layouts=Replicate(),
                                                                  output_layouts=Replicate()))
            torch.manual_seed(0)
            got = _whole(region(args[0].clone()))
            mine = compared(got, want, op.name in _UNINITIALIZED, **_TOLERANCE)
        except Exception as error:
            mine = refusal(error)
        return self._agreed(mine)

    def _agreed(self, mine: tuple[str, str]) -> tuple[str, str]:
        every = [None] * WORLD_SIZE
        dist.all_gather_object(every, mine)  # the default group: a rank the sweep's group left hanging answers
        if any(outcome not in ("equal", "refused") for outcome, _ in every):
            self.mesh = None  # a failed case may leave the group mid-collective: the next case makes a new one
        if len({outcome for outcome, _ in every}) > 1:
            return "unclear", f"ranks disagree: {every}"
        return every[0]


#: A ``SpatialParallel`` region (its input's last dim sharded over 2 ranks) in place of each
#: sample's (N, C, ...) float32 input; runs only on the ranks of :func:`sweep_spatial`.
SPATIAL = Surface("SpatialParallel region", spatial_positions, extra=_extra_samples)


def _sweep_on_rank(names: list[str] | None, samples_per_op: int | None, journal: str | None) -> list[tuple] | None:
    """Each rank's sweep of the ops named ``names``; rank 0 returns the cases and, with a
    ``journal``, appends each op's cases to it (one JSON line per op) as soon as the op is done."""
    import json

    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if names is None or op_name(op) in names]
    surface = dataclasses.replace(SPATIAL, run=_Ranks().run)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in ops:
            cases = [dataclasses.astuple(case) for case in sweep_ops(surface, ops=[op], samples_per_op=samples_per_op).cases]
            rows += cases
            if journal is not None and dist.get_rank() == 0:
                with open(journal, "a") as f:
                    f.write(json.dumps({"op": op_name(op), "cases": cases}) + "\n")
    return rows if dist.get_rank() == 0 else None


def _journaled(journal: str) -> dict[str, list]:
    """``{op: its case rows}`` of the ops a journal holds."""
    import json
    import os

    if not os.path.exists(journal):
        return {}
    with open(journal) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    return {entry["op"]: entry["cases"] for entry in entries}


def sweep_spatial(*, op_names: Sequence[str] | None = None, samples_per_op: int | None = None,
                  timeout: float = 3 * 3600.0, journal: str | None = None) -> SweepResult:
    """Sweep :data:`SPATIAL` on a pool of 2 ranks: the ops named in ``op_names`` (OpInfo names
    with their variant, :func:`~torch_tp.testing._op_sweep.op_name`; default every op).

    With ``journal`` (a path), each op's cases are appended to it as the op finishes, and the ops
    it already holds are not swept again: an interrupted whole sweep (about an hour on 2 busy
    cores) resumes where it stopped. Delete the journal after changing what the region runs.

    Example::

        >>> # xdoctest: +SKIP("starts 2 worker processes and imports the OpInfo database")
        >>> sweep_spatial(op_names=["cumsum"]).by_op()["cumsum"]["equal"] > 0
        True
    """
    from torch.testing._internal.common_methods_invocations import op_db

    from torch_tp.testing._dist import run_on_ranks

    wanted = [op_name(op) for op in op_db if op_names is None or op_name(op) in op_names]
    done = _journaled(journal) if journal is not None else {}
    missing = [name for name in wanted if name not in done]
    if missing:
        rows = run_on_ranks(_sweep_on_rank, WORLD_SIZE, missing, samples_per_op, journal, timeout=timeout)[0]
        if journal is None:
            return SweepResult(SPATIAL, [SweepCase(*row) for row in rows])
        done = _journaled(journal)
    return SweepResult(SPATIAL, [SweepCase(*row) for name in wanted for row in done.get(name, [])])
