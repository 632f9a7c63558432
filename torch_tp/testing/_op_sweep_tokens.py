"""The op sweep's int8 token communication surface: ``torch_tp::int8_all_gather`` and
``torch_tp::int8_reduce_scatter`` (``comm_dtype=torch.int8``'s collectives,
:mod:`torch_tp.overlap._int8_comm`, packing by :mod:`torch_tp._tokens`) on the shapes of the
OpInfo database's samples, against the float collective of the rounded values.

The samples are the distinct shapes of the database's float32 sample inputs with at least 2 dims
(token rows: the last dim is the features), at most :data:`MAX_SHAPES` of them, in database
order. Rank ``r`` sends ``x * (r + 1) + r`` (a different tensor per rank) of each, gathered or
reduce-scattered along each leading dim. Besides, per shape: ``non-finite`` (NaN, inf and -inf
in three tokens), ``size 0`` along the dim and ``no features`` (a last dim of 0). The reference,
computed on every rank from every rank's input: the float collective (``torch.cat`` / the sum of
the rank's chunks) of ``dequantize_tokens(*quantize_tokens(x_r))``, non-finite where it is. A
dim that does not split evenly is refused by name (``int8_reduce_scatter``); ranks that disagree
are ``unclear``. One spawned run of 2 ranks: :func:`sweep_tokens`.

Example::

    >>> # xdoctest: +SKIP("starts 2 worker processes and imports the OpInfo database")
    >>> sweep_tokens(max_shapes=4).failures()
    []
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.distributed as dist

from torch_tp._tokens import dequantize_tokens, quantize_tokens
from torch_tp.testing._op_sweep import Surface, SweepCase, SweepResult, compared, cpu_seeding, refusal

__all__ = ["INT8_TOKENS", "MAX_SHAPES", "sweep_tokens", "token_shapes"]

WORLD_SIZE = 2
#: How many of the database's distinct sample shapes the whole sweep takes.
MAX_SHAPES = 24
_TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def token_shapes(max_shapes: int = MAX_SHAPES) -> list[tuple[int, ...]]:
    """The distinct shapes (at least 2 dims) of the OpInfo database's float32 sample inputs, in order.

    Example::

        >>> # xdoctest: +SKIP("imports the OpInfo database (a few seconds)")
        >>> token_shapes(3)
        [(5, 5), (5, 5, 5), (5, 1)]
    """
    from torch.testing._internal.common_methods_invocations import op_db

    shapes: dict[tuple[int, ...], None] = {}
    with warnings.catch_warnings(), cpu_seeding():
        warnings.simplefilter("ignore")
        for op in op_db:
            if len(shapes) >= max_shapes:
                break
            if torch.float32 not in op.supported_dtypes("cpu"):
                continue
            try:
                for sample in op.sample_inputs("cpu", torch.float32):
                    x = sample.input
                    if type(x) is torch.Tensor and x.layout == torch.strided and x.ndim >= 2:
                        shapes.setdefault(tuple(x.shape))
            except Exception:  # a sample generator this build cannot run
                continue
    return list(shapes)[:max_shapes]


def _inputs(shape: tuple[int, ...], label: str) -> list[torch.Tensor]:
    """Every rank's input for ``shape`` and the sample ``label``."""
    torch.manual_seed(len(shape) * 1000 + sum(shape))
    base = torch.randn(shape) * 4
    if label == "non-finite" and base.shape[-1] and base.numel() >= 3 * base.shape[-1]:
        rows = base.view(-1, base.shape[-1])
        rows[0, 0], rows[1, -1], rows[2, 0] = math.nan, math.inf, -math.inf
    return [base * (r + 1) + r for r in range(WORLD_SIZE)]


def _rounded(x: torch.Tensor) -> torch.Tensor:
    return dequantize_tokens(*quantize_tokens(x), x.dtype)


def _reference(collective: str, xs: list[torch.Tensor], dim: int, rank: int) -> torch.Tensor:
    rounded = [_rounded(x) for x in xs]
    if collective == "int8_all_gather":
        return torch.cat(rounded, dim)
    return torch.stack([r.chunk(WORLD_SIZE, dim)[rank] for r in rounded]).sum(0)


def _samples(shape: tuple[int, ...], dim: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(label, shape)`` of the samples of ``shape`` gathered or scattered along ``dim``."""
    name = "x".join(map(str, shape))
    return [(name, shape), (f"{name} non-finite", shape), (f"{name} no features", (*shape[:-1], 0)),
            (f"{name} size 0", (*shape[:dim], 0, *shape[dim + 1:]))]


def _case(collective: str, shape: tuple[int, ...], label: str, dim: int, group) -> tuple[str, str]:
    rank = dist.get_rank()
    xs = _inputs(shape, "non-finite" if label.endswith("non-finite") else "")
    if collective == "int8_reduce_scatter" and shape[dim] % WORLD_SIZE == 0:
        want = _reference(collective, xs, dim, rank)
    elif collective == "int8_all_gather":
        want = _reference(collective, xs, dim, rank)
    else:
        want = None  # a dim that does not split evenly: the float collective has no answer either
    try:
        got = getattr(torch.ops.torch_tp, collective)(xs[rank], dim, group.group_name)
        mine = ("wrong", "ran on a dim that does not split") if want is None else compared(got, want, False, **_TOLERANCE)
    except Exception as error:
        mine = refusal(error)
    every = [None] * WORLD_SIZE
    dist.all_gather_object(every, mine)
    if len({outcome for outcome, _ in every}) > 1:
        return "unclear", f"ranks disagree: {every}"
    return every[0]


def _sweep_on_rank(shapes: list[tuple[int, ...]]) -> list[tuple] | None:
    import torch_tp.overlap  # noqa: F401  (registers torch.ops.torch_tp.int8_*)

    group = dist.new_group(backend="gloo")
    cases = []
    for shape in shapes:
        for dim in range(len(shape) - 1):
            for label, sample_shape in _samples(shape, dim):
                for collective in ("int8_all_gather", "int8_reduce_scatter"):
                    outcome = _case(collective, sample_shape, label, dim, group)
                    cases.append(SweepCase(f"{collective} dim {dim}", label, dim, *outcome))
    return [dataclasses.astuple(case) for case in cases] if dist.get_rank() == 0 else None


#: The int8 token collectives over 2 ranks, on the database's sample shapes; see :func:`sweep_tokens`.
INT8_TOKENS = Surface("int8 token communication", lambda args: [])


def sweep_tokens(*, max_shapes: int = MAX_SHAPES, timeout: float = 1800.0) -> SweepResult:
    """Sweep :data:`INT8_TOKENS` on a pool of 2 ranks over the first ``max_shapes`` shapes of
    :func:`token_shapes`.

    Example::

        >>> # xdoctest: +SKIP("starts 2 worker processes and imports the OpInfo database")
        >>> sorted(sweep_tokens(max_shapes=2).by_op())
        ['int8_all_gather dim 0', 'int8_reduce_scatter dim 0', ...]
    """
    from torch_tp.testing._dist import run_on_ranks

    rows = run_on_ranks(_sweep_on_rank, WORLD_SIZE, token_shapes(max_shapes), timeout=timeout)[0]
    return SweepResult(INT8_TOKENS, [SweepCase(*row) for row in rows])
