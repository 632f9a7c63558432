"""Vocab-parallel cross-entropy: the loss of logits sharded on the vocab dim, never gathered.

An output head under ``ColwiseParallel(use_local_output=False)`` returns logits as a DTensor
sharded on the last (vocab) dim: rank ``r`` of the tensor-parallel group holds the columns
``[start_r, stop_r)`` of ``torch.chunk``'s rule (vocab 10 on 4 ranks: 3, 3, 3, 1).
:func:`cross_entropy` computes ``F.cross_entropy`` of the full logits from those slices, so
no rank ever holds a ``tokens x vocab`` tensor. Per token, with ``x`` the logits, ``t`` the
target, ``V`` the vocab size and ``eps`` the label smoothing::

    m        = max_v x_v                                 local max, all-reduce MAX
    lse      = m + log(sum_v exp(x_v - m))               local sum, all-reduce SUM
    x_t      = the target's logit                        owner's value, all-reduce SUM
    mean_x   = (sum_v x_v) / V                           local sum, all-reduce SUM
    loss     = (1 - eps) * (lse - x_t) + eps * (lse - mean_x)

which is PyTorch's label smoothing (the target mixed with the uniform distribution over the
``V`` classes). The three sums travel in one all-reduce, so the forward issues two
all-reduces of ``tokens`` and ``3 * tokens`` values (``2 * tokens`` without smoothing).
Tokens whose target is ``ignore_index`` contribute nothing; ``reduction="mean"`` divides
by the number of the others. The backward needs no collective: on each rank ::

    grad_x = (softmax(x) - (1 - eps) * onehot(t) - eps / V) * grad_token

over its own columns (``softmax`` recomputed from the saved logits and ``lse``).

:func:`loss_parallel` is upstream's context manager
(``torch.distributed.tensor.parallel.loss_parallel``), re-exported unchanged. See
``docs/loss.md`` for the two compared.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from torch_tp._agreement import Fact, check_on_every_rank
from torch_tp._layouts import shard_bounds

__all__ = ["cross_entropy", "loss_parallel"]

_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(
    logits: DTensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of logits sharded on the vocab (last) dim, computed without gathering them.

    ``logits`` has shape ``(..., V)`` and is ``Shard(-1)`` on exactly one mesh dim (the
    tensor-parallel dim); any other mesh dim holds it ``Shard`` on a leading dim (a batch
    sharded over ``"dp"``) or ``Replicate()``. That is what
    ``ColwiseParallel(use_local_output=False)`` on the output head returns. Each rank works
    on its vocab slice; two all-reduces over the tensor-parallel group give every token's
    log-sum-exp, target logit and (with smoothing) mean logit. The backward is local.

    Args:
        logits: the DTensor of logits, floating point.
        target: class indices (an integer tensor) of the logits' *local* leading shape:
            ``logits.to_local().shape[:-1]``, the same on every rank of the tensor-parallel
            group. On a 2-D mesh whose other dim shards the batch, that is this rank's batch
            shard. A DTensor on the logits' mesh is taken as its local value; it must be
            ``Replicate()`` on the tensor-parallel dim.

    Keyword Args:
        ignore_index (int): tokens with this target contribute no loss and no gradient.
            Default ``-100``.
        label_smoothing (float): ``eps`` in ``[0, 1]``; the target becomes
            ``(1 - eps) * onehot + eps / V``, as in ``F.cross_entropy``. Default ``0.0``.
        reduction (str): ``"mean"`` (over the tokens not ignored), ``"sum"`` or ``"none"``.

    Returns:
        A plain tensor, equal on every rank of the tensor-parallel group: a scalar, or for
        ``"none"`` the per-token losses in the local leading shape (ignored tokens 0). The
        reduction covers the tokens this rank's tensor-parallel group holds: on a 2-D mesh
        with the batch sharded over ``"dp"`` it is ``F.cross_entropy`` of this dp shard, and
        averaging across dp stays with DDP/FSDP as usual. Backward gives ``logits`` a
        gradient with its own placements.

    Raises:
        TypeError: ``logits`` is not a DTensor.
        ValueError: ``logits`` is not sharded on its last dim on exactly one mesh dim (or is
            ``Partial``), ``target`` has the wrong shape, dtype, mesh or placements or holds
            an index outside ``[0, V)`` other than ``ignore_index``, or an option is out of range.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> from torch.distributed.tensor import Replicate
        >>> from torch_tp import ColwiseParallel, parallelize_module
        >>> from torch_tp.loss import cross_entropy
        >>> from torch_tp.models.llama import tensor_parallel_plan
        >>> plan = tensor_parallel_plan()
        >>> plan["output"] = ColwiseParallel(input_layouts=Replicate(), use_local_output=False)
        >>> parallelize_module(model, mesh, plan)
        >>> logits = model(tokens)                 # DTensor, Shard(2): each rank a vocab slice
        >>> loss = cross_entropy(logits, targets, label_smoothing=0.1)
        >>> loss.backward()

    .. note::
        Every rank checks ``target`` (shape, range) and the ranks agree on it (a checksum of its
        values, the options) before any collective: one device sync on GPU and one all-gather of
        8 bytes per rank (``torch_tp.runtime_checks(False)`` skips the all-gather). Bad or
        differing targets on any rank raise ``ValueError`` on every rank.
    """
    tp_axis = _vocab_axis(logits)
    x_local, mesh, vocab = logits.to_local(), logits.device_mesh, logits.shape[-1]
    start, stop = shard_bounds(vocab, mesh.size(tp_axis))[mesh.get_local_rank(tp_axis)]
    checked = {}

    def facts() -> list[Fact]:  # this rank's checks; the ranks then agree (torch_tp._agreement)
        _check_options(reduction, label_smoothing)
        checked["target"] = t_local = _local_target(target, logits, tp_axis, x_local.shape)
        if x_local.shape[-1] != stop - start:
            raise ValueError(
                f"cross_entropy found a local vocab slice of {x_local.shape[-1]} columns where torch.chunk's "
                f"rule (what Shard places) gives this rank [{start}, {stop}) of {vocab}; build the logits with "
                f"a style or distribute_tensor, or pass shape= to DTensor.from_local only for chunk-sized pieces"
            )
        return [
            Fact("targets differ (a checksum of their values)", _checked_target_checksum(t_local, vocab, ignore_index),
                 "every rank of the tensor-parallel group holds the same tokens, so pass each the same targets"),
            Fact("calls pass different options", (reduction, float(label_smoothing), ignore_index),
                 "pass the same reduction, label_smoothing and ignore_index on every rank"),
        ]

    check_on_every_rank(mesh.get_group(tp_axis), facts, what="cross_entropy", at_runtime=True)
    t_local = checked["target"] if "target" in checked else _local_target(target, logits, tp_axis, x_local.shape)
    loss = _VocabParallelCrossEntropy.apply(
        x_local.reshape(t_local.numel(), stop - start),  # not -1: a slice may be empty
        t_local.reshape(-1).long(),
        mesh.get_group(tp_axis),
        start,
        vocab,
        ignore_index,
        float(label_smoothing),
        reduction,
    )
    return loss.reshape(t_local.shape) if reduction == "none" else loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy on local vocab slices ``x_local (N, Vl)``, columns ``[start, start + Vl)``.

    Legend: ``N`` tokens, ``V`` vocab, ``Vl`` this rank's columns, ``eps`` smoothing.
    Forward: the formulas of the module docstring (one MAX and one SUM all-reduce over
    ``group``). Saves the local logits (the input, so no extra memory), ``lse (N,)``, the
    local target column and masks; the backward recomputes ``softmax = exp(x - lse)``
    instead of saving an ``(N, Vl)`` tensor, and issues no collective.

    Every op computes in one dtype, ``x``'s (float32 for bfloat16 or float16 logits): Python
    constants such as ``1 - eps`` enter only as scalar arguments of ops on tensors of that
    dtype (``masked_fill``, ``mul``, ``sub_``), never through a tensor built from Python
    floats, which would be float32 (``torch.where(mask, -(1 - eps), 0.0)``) and round a
    float64 loss's gradient to float32 precision.
    """

    @staticmethod
    def forward(ctx: Any, x_local, target, group, start, vocab, ignore_index, eps, reduction):
        width = x_local.shape[-1]
        x = x_local.to(torch.promote_types(x_local.dtype, torch.float32))
        valid = target != ignore_index
        column = target - start
        owned = valid & (column >= 0) & (column < width)
        column = column.clamp(0, max(width - 1, 0))
        if width:
            row_max = x.amax(dim=-1)
        else:
            row_max = x.new_full(x.shape[:-1], float("-inf"))
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sums = [torch.exp(x - row_max[:, None]).sum(dim=-1), _owned_logit(x, column, owned)]
        if eps:
            sums.append(x.sum(dim=-1))
        sums = torch.stack(sums)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = row_max + sums[0].log()
        per_token = lse - (1 - eps) * sums[1]
        if eps:
            per_token = per_token - eps * sums[2] / vocab
        per_token = per_token.masked_fill(~valid, 0)
        count = valid.sum()
        ctx.save_for_backward(x_local, lse, column, owned, valid, count)
        ctx.eps, ctx.vocab, ctx.reduction = eps, vocab, reduction
        if reduction == "none":
            return per_token.to(x_local.dtype)
        total = per_token.sum()
        return (total / count if reduction == "mean" else total).to(x_local.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss):
        x_local, lse, column, owned, valid, count = ctx.saved_tensors
        eps = ctx.eps
        grad_token = grad_loss.to(lse.dtype)
        if ctx.reduction == "mean":
            grad_token = grad_token / count
        grad_token = grad_token.masked_fill(~valid, 0)  # also 0 where count is 0 (loss nan)
        grad = torch.exp(x_local.to(lse.dtype) - lse[:, None])
        if eps:
            grad.sub_(eps / ctx.vocab)
        if grad.shape[-1]:
            hit = torch.zeros_like(lse).masked_fill_(owned, -(1.0 - eps))
            grad.scatter_add_(1, column[:, None], hit[:, None])
        grad.mul_(grad_token[:, None])
        return grad.to(x_local.dtype), None, None, None, None, None, None, None


def _owned_logit(x: torch.Tensor, column: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """The target's logit on the rank whose slice holds it, 0 elsewhere (and on empty slices)."""
    if not x.shape[-1]:
        return x.new_zeros(x.shape[:-1])
    return x.gather(1, column[:, None]).squeeze(1).masked_fill(~owned, 0)


def _vocab_axis(logits: Any) -> int:
    """The mesh dim that shards the logits' last dim; every other mesh dim must be Shard or Replicate."""
    if not isinstance(logits, DTensor):
        raise TypeError(
            f"cross_entropy takes the logits as a DTensor sharded on the vocab (last) dim, got "
            f"{type(logits).__name__}; give the output head ColwiseParallel(use_local_output=False), "
            f"or use F.cross_entropy for plain logits"
        )
    if logits.ndim < 1 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"cross_entropy needs floating-point logits of shape (..., vocab), got {logits.dtype} of shape "
            f"{tuple(logits.shape)}"
        )
    last = logits.ndim - 1
    placements = tuple(logits.placements)
    vocab_axes = [a for a, p in enumerate(placements) if type(p) is Shard and p.dim % logits.ndim == last]
    if len(vocab_axes) != 1:
        how = "on no mesh dim" if not vocab_axes else f"on {len(vocab_axes)} mesh dims"
        raise ValueError(
            f"cross_entropy needs logits sharded on the vocab (last) dim on exactly one mesh dim, got "
            f"placements {placements} (sharded {how}); give the output head "
            f"ColwiseParallel(use_local_output=False) with its default output_layouts=Shard(-1) "
            f"(output_layouts=Replicate() gathers the full logits: use F.cross_entropy on those)"
        )
    for axis, p in enumerate(placements):
        if axis != vocab_axes[0] and not (p.is_replicate() or (type(p) is Shard and p.dim % logits.ndim != last)):
            raise ValueError(
                f"cross_entropy needs the logits' other mesh dims to be Shard on a leading dim or "
                f"Replicate(), got {p!r} on mesh dim {axis} (placements {placements}); redistribute "
                f"the logits (e.g. reduce a Partial) first"
            )
    return vocab_axes[0]


def _check_options(reduction: str, label_smoothing: float) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def _local_target(target: Any, logits: DTensor, tp_axis: int, local_shape: torch.Size) -> torch.Tensor:
    """``target`` as this rank's plain tensor of the logits' local leading shape."""
    if isinstance(target, DTensor):
        if target.device_mesh != logits.device_mesh:
            raise ValueError(
                f"cross_entropy needs a DTensor target on the logits' mesh {logits.device_mesh}, got one on "
                f"{target.device_mesh}; pass target.to_local() (this rank's targets) instead"
            )
        if not target.placements[tp_axis].is_replicate():
            raise ValueError(
                f"cross_entropy needs the target Replicate() on the tensor-parallel mesh dim {tp_axis} (every "
                f"rank there holds the same tokens), got placements {tuple(target.placements)}"
            )
        target = target.to_local()
    elif not isinstance(target, torch.Tensor):
        raise TypeError(f"cross_entropy needs the target as a tensor of class indices, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise ValueError(
            f"cross_entropy needs class indices (an integer target), got {target.dtype}; class "
            f"probabilities are not supported"
        )
    expected = tuple(local_shape[:-1])
    if tuple(target.shape) != expected:
        raise ValueError(
            f"cross_entropy needs a target of shape {expected} (the local logits' shape "
            f"{tuple(local_shape)} without the vocab dim), got {tuple(target.shape)}; on a "
            f"mesh whose other dim shards the batch, pass this rank's batch shard"
        )
    return target


def _checked_target_checksum(target: torch.Tensor, vocab: int, ignore_index: int) -> int:
    """Raise on a target index outside the vocab; else a position-weighted checksum of the targets
    (int64 arithmetic, wrapping), which the ranks compare. One host read for both."""
    flat = target.reshape(-1).long()
    if flat.numel() == 0:
        return 0
    bad = (flat != ignore_index) & ((flat < 0) | (flat >= vocab))
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * 0x9E3779B1
    first_bad = flat[bad.long().argmax()]  # the first bad index (index 0 when none is bad)
    any_bad, value, checksum = torch.stack([bad.any().long(), first_bad, (flat * weights).sum()]).tolist()
    if any_bad:
        raise ValueError(
            f"cross_entropy got target index {value}, outside the vocab [0, {vocab}) and not "
            f"ignore_index={ignore_index}"
        )
    return checksum + flat.numel()


