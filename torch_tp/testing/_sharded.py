"""One op or layer on a sharded input against one process, forward and backward (rank side).

The spatial tests push a given output gradient ``dy`` through a layer (a BatchNorm, a pooling,
an activation) rather than a loss: :func:`assert_sharded_step_matches` is that comparison, once,
and :func:`assert_sharded_trains_like` repeats it over several optimizer steps.
:func:`shard_locally` and :func:`replicated_copy` build its inputs without communication.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp.testing._comm import comm_counts
from torch_tp.testing._reference import assert_params_and_grads_match

__all__ = [
    "ShardedStep",
    "assert_sharded_step_matches",
    "assert_sharded_trains_like",
    "replicated_copy",
    "shard_locally",
]


def shard_locally(tensor: torch.Tensor, mesh: Any, placements: Sequence[Placement]) -> DTensor:
    """``tensor`` (the same on every rank) as a DTensor with ``placements``: each rank keeps its
    ``torch.chunk`` piece, nothing is sent.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> shard_locally(torch.arange(10.0), tp_mesh(), [Shard(0)]).to_local()   # rank 1 of 2
        tensor([5., 6., 7., 8., 9.])
    """
    return distribute_tensor(tensor, mesh, placements, src_data_rank=None)


def replicated_copy(module: nn.Module, mesh: Any, *, buffers: bool = False) -> nn.Module:
    """A deep copy of ``module`` with every parameter a replicated DTensor on ``mesh``; buffers
    stay plain tensors (as ``SpatialParallel`` keeps them) or, with ``buffers=True``, become
    replicated DTensors too.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> replicated_copy(nn.BatchNorm2d(4), tp_mesh()).weight.placements
        (Replicate(),)
    """
    model = copy.deepcopy(module)
    replicated = [Replicate()] * mesh.ndim
    for sub in model.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, nn.Parameter(distribute_tensor(p.detach(), mesh, replicated, src_data_rank=None)))
        for name, b in list(sub.named_buffers(recurse=False)) if buffers else ():
            setattr(sub, name, distribute_tensor(b, mesh, replicated, src_data_rank=None))
    return model


@dataclasses.dataclass
class ShardedStep:
    """What :func:`assert_sharded_step_matches` ran: the output, the sharded input (its ``.grad``
    set) and the collectives of the forward and of the backward (:func:`~torch_tp.testing.comm_counts`).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> step = assert_sharded_step_matches(replicated_copy(gn, mesh), gn, x, dy, mesh, [Shard(3)])
        >>> step.output.placements, step.input.grad.placements, step.backward_comms
        ((Shard(dim=3),), (Shard(dim=3),), {'all_reduce': 1})
    """

    output: DTensor
    input: DTensor
    forward_comms: dict
    backward_comms: dict


def assert_sharded_step_matches(
    fn: Callable[[Any], Any],
    reference: Callable[[Any], Any],
    x: torch.Tensor,
    dy: torch.Tensor | None,
    mesh: Any,
    placements: Sequence[Placement],
    *,
    output_placements: Sequence[Placement] | None = None,
    exact: Sequence[str] = (),
    rtol: float = 1e-5,
    atol: float = 1e-5,
    params: bool = True,
    what: str = "",
) -> ShardedStep:
    """``fn`` on ``x`` sharded by ``placements`` against ``reference`` on ``x``, forward and backward.

    ``reference`` runs on ``x`` and backpropagates ``dy`` (``None``: a fixed random gradient of
    the output's shape); ``fn`` runs on :func:`shard_locally` of ``x`` and backpropagates ``dy``
    sharded as its output. Asserted: the output has ``output_placements`` (default
    ``placements``) and the global shape, the input gradient keeps ``placements``, both equal
    the reference's piece on every rank (bit for bit for those named in ``exact``:
    ``"output"``, ``"grad"``), and, when both are modules and ``params``, every parameter and
    gradient (:func:`~torch_tp.testing.assert_params_and_grads_match`).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> step = assert_sharded_step_matches(replicated_copy(bn, mesh), bn, x, dy, mesh, [Shard(3)])
        >>> step.forward_comms
        {'all_gather': 1}
    """
    rx = x.clone().requires_grad_()
    expected = reference(rx)
    if dy is None:
        dy = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    expected.backward(dy)
    dx = shard_locally(x, mesh, placements).requires_grad_()
    with CommDebugMode() as forward:
        y = fn(dx)
    with CommDebugMode() as backward:
        y.backward(shard_locally(dy, mesh, y.placements))
    prefix = f"{what} " if what else ""
    wanted = tuple(output_placements if output_placements is not None else placements)
    assert tuple(y.placements) == wanted, f"{prefix}output placements {y.placements}, expected {wanted}"
    assert y.shape == expected.shape, f"{prefix}output shape {tuple(y.shape)}, expected {tuple(expected.shape)}"
    assert tuple(dx.grad.placements) == tuple(placements), f"{prefix}grad_input placements {dx.grad.placements}"
    for kind, actual, whole in (("output", y, expected.detach()), ("grad", dx.grad, rx.grad)):
        tol = dict(rtol=0, atol=0) if kind in exact else dict(rtol=rtol, atol=atol)
        torch.testing.assert_close(actual.to_local(), shard_locally(whole, mesh, actual.placements).to_local(),
                                   **tol, msg=lambda m, kind=kind: f"{prefix}{kind}: {m}")
    if params and isinstance(fn, nn.Module) and isinstance(reference, nn.Module):
        assert_params_and_grads_match(fn, reference, rtol=rtol, atol=atol, what=what)
    return ShardedStep(y, dx, comm_counts(forward), comm_counts(backward))


def assert_sharded_trains_like(
    model: nn.Module,
    reference: nn.Module,
    batches: Iterable[tuple[torch.Tensor, ...]],
    mesh: Any,
    placements: Sequence[Placement] | None,
    *,
    optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer] | None,
    check: Callable[[ShardedStep, str], None] | None = None,
    **compare: Any,
) -> list[ShardedStep]:
    """Train ``model`` (input sharded by ``placements``) and ``reference`` side by side, one step
    per ``(x, dy)`` of ``batches``; assert every step agrees. With ``placements=None`` each batch
    names its own: ``(x, dy, placements)``, e.g. to alternate the sharded dim between steps.

    Each step is :func:`assert_sharded_step_matches` (``compare`` holds its keyword arguments;
    messages name ``"<what> step <i>"``), then ``check(step, what)`` if given, then a step and
    ``zero_grad()`` of each model's own ``optimizer(model.parameters())``. ``optimizer=None``
    (a layer with nothing to train) leaves the parameters as they are. ``batches`` is read one
    batch per step, so a generator drawing from one RNG draws as a hand-written loop would.
    Returns the steps.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> batches = ((torch.randn(2, 3, 5, 10), torch.randn(2, 3, 5, 10)) for _ in range(3))
        >>> with sharded_batch_norm():
        ...     assert_sharded_trains_like(replicated_copy(bn, mesh), bn, batches, mesh, [Shard(3)],
        ...                                optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    """
    what = compare.pop("what", "")
    optimizers = [optimizer(m.parameters()) for m in (model, reference)] if optimizer is not None else []
    steps = []
    for i, batch in enumerate(batches):
        x, dy, layout = batch if placements is None else (*batch, placements)
        label = f"{what} step {i}".strip()
        step = assert_sharded_step_matches(model, reference, x, dy, mesh, layout, what=label, **compare)
        if check is not None:
            check(step, label)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        steps.append(step)
    return steps
