"""Comparing a parallelized module with its single-process reference (rank side).

Every distributed test keeps an unsharded copy of its module as the reference; these
helpers turn DTensors back into full tensors and compare parameters and gradients,
naming the parameter that differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._pytree import tree_map

__all__ = [
    "assert_params_and_grads_match",
    "assert_trains_like",
    "assert_training_step_matches",
    "full_tensor",
    "full_tensors",
    "local_chunk",
]


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value.full_tensor()`` for a DTensor (a collective: call it on every rank), else ``value``.

    Example::

        >>> full_tensor(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return value.full_tensor() if isinstance(value, DTensor) else value


def full_tensors(values: Iterable[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """:func:`full_tensor` of each value (detached), with one collective per process group and
    dtype for the DTensors on 1-D meshes (every rank must pass the same list).

    A test that compares every parameter and gradient would otherwise issue one all-gather or
    all-reduce per tensor. DTensors on a 1-D mesh placed ``Shard(d)``, ``Replicate()`` or
    ``Partial("sum"/"avg")`` are made whole from one all-gather of their local pieces (a
    ``Shard(d)`` piece's size follows ``torch.chunk``, as DTensor's own split does); any other
    DTensor (2-D meshes, strided shards) through its own ``full_tensor()``. A quantized weight
    (int8 ``qdata`` and scales) comes back as the float values it stands for (each rank's piece
    dequantized, then gathered). ``None`` stays ``None``.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> weight, grad = full_tensors([model.w.weight, model.w.weight.grad])
    """
    values = [_dequantized(value) for value in values]
    out: list[torch.Tensor | None] = [None] * len(values)
    batched: dict[tuple, list[int]] = {}
    for i, value in enumerate(values):
        if not isinstance(value, DTensor):
            out[i] = value.detach() if value is not None else None
        elif _gathered_in_one_batch(value):
            if value.placements[0].is_replicate():
                out[i] = value.to_local().detach()
            else:
                batched.setdefault((value.device_mesh.get_group(), value.dtype), []).append(i)
        else:
            out[i] = value.full_tensor().detach()
    for (group, dtype), indices in batched.items():
        for i, whole in zip(indices, _gather_whole(group, [values[i] for i in indices])):
            out[i] = whole
    return out


def _gathered_in_one_batch(value: DTensor) -> bool:
    if value.device_mesh.ndim != 1:
        return False
    placement = value.placements[0]
    if type(placement) is Shard or isinstance(placement, Replicate):
        return True
    return isinstance(placement, Partial) and placement.reduce_op in ("sum", "avg")


def _piece_shapes(value: DTensor, ranks: int) -> list[torch.Size]:
    """Each rank's local shape of ``value`` (1-D mesh): ``torch.chunk`` sizes for ``Shard(d)``."""
    shape = value.shape
    placement = value.placements[0]
    if not isinstance(placement, Shard):
        return [shape] * ranks
    d = placement.dim
    sizes = [len(c) for c in torch.arange(shape[d]).chunk(ranks)]
    sizes += [0] * (ranks - len(sizes))
    return [torch.Size((*shape[:d], n, *shape[d + 1:])) for n in sizes]


def _gather_whole(group: Any, dtensors: list[DTensor]) -> list[torch.Tensor]:
    """The whole tensors of same-dtype DTensors on the 1-D mesh of ``group``: one all-gather."""
    ranks = dist.get_world_size(group)
    shapes = [_piece_shapes(t, ranks) for t in dtensors]
    per_rank = [sum(s[r].numel() for s in shapes) for r in range(ranks)]
    width = max(per_rank)
    mine = torch.cat([t.to_local().detach().reshape(-1) for t in dtensors])
    send = torch.zeros(width, dtype=mine.dtype, device=mine.device)
    send[: mine.numel()] = mine
    received = torch.empty(ranks * width, dtype=mine.dtype, device=mine.device)
    dist.all_gather_single(received, send, group=group)
    rows = received.view(ranks, width)
    offsets = [0] * ranks
    wholes = []
    for t, pieces_shapes in zip(dtensors, shapes):
        pieces = []
        for r, shape in enumerate(pieces_shapes):
            pieces.append(rows[r, offsets[r] : offsets[r] + shape.numel()].view(shape))
            offsets[r] += shape.numel()
        placement = t.placements[0]
        if isinstance(placement, Shard):
            wholes.append(torch.cat(pieces, dim=placement.dim))
        else:  # Partial: the sum (or mean) of the pieces
            total = torch.stack(pieces).sum(0)
            wholes.append(total / ranks if placement.reduce_op == "avg" else total)
    return wholes


def local_chunk(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's piece of ``tensor`` along ``dim`` under ``Shard(dim)`` (``torch.chunk`` sizes;
    an empty piece for ranks past the last chunk).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> local_chunk(torch.arange(10), 0)   # on rank 3 of 4
        tensor([9])
    """
    chunks = torch.chunk(tensor, dist.get_world_size(), dim=dim)
    rank = dist.get_rank()
    return chunks[rank] if rank < len(chunks) else tensor.narrow(dim, 0, 0)


def assert_params_and_grads_match(
    module: nn.Module,
    reference: nn.Module,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    params: bool = True,
    what: str = "",
) -> None:
    """Assert every parameter (if ``params``) and gradient of ``module`` equals ``reference``'s.

    Parameters are paired by name order; DTensors (on either side) are compared as full tensors;
    NaN matches NaN at the same place (a diverging model must diverge where one process does).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> assert_params_and_grads_match(parallel_model, reference_model, what="step 2")
    """
    prefix = f"{what} " if what else ""
    named, ref_named = list(module.named_parameters()), list(reference.named_parameters())
    for (name, _), (ref_name, _) in zip(named, ref_named):
        assert name == ref_name, f"parameter order differs: {name} vs {ref_name}"
    pairs = list(zip(named, ref_named))
    # every DTensor made whole in a few collectives (full_tensors), in the same order on every rank
    wanted = [t for (_, p), (_, q) in pairs for t in ((p, q) if params else ()) + (p.grad, q.grad)]
    whole = iter(full_tensors(wanted))
    for (name, _), _ in pairs:
        if params:
            torch.testing.assert_close(next(whole), next(whole), rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m: f"{prefix}{name}: {m}")
        torch.testing.assert_close(next(whole), next(whole), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{prefix}grad of {name}: {m}")


def _dequantized(value: torch.Tensor | None) -> torch.Tensor | None:
    """A quantized weight (``torch_tp.quant``'s int8 tensors, or a DTensor of them) as the float
    values it stands for; anything else as it is."""
    def quantized(tensor):
        return isinstance(getattr(tensor, "qdata", None), torch.Tensor)

    if isinstance(value, DTensor) and quantized(value.to_local()):
        return DTensor.from_local(value.to_local().dequantize(), value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    if not isinstance(value, DTensor) and quantized(value):
        return value.dequantize()
    return value


def assert_training_step_matches(
    module: nn.Module,
    reference: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    params: bool = True,
    what: str = "",
    module_inputs: Callable[[Any], Any] | None = None,
    expected_output: Callable[[Any], Any] | None = None,
) -> float:
    """Run forward and backward of ``module`` and ``reference`` on one batch; assert they agree.

    Outputs and losses (``loss_fn(output, targets)``) must match, then every parameter (unless
    ``params=False``) and gradient, as in :func:`assert_params_and_grads_match`. DTensors in
    the outputs or losses are compared as full tensors. The optimizer step is the caller's
    (or use :func:`assert_trains_like`). Returns ``module``'s loss as a float.

    Keyword Args:
        module_inputs: what ``module`` is given instead of ``inputs`` (``reference`` always
            gets ``inputs``), e.g. this rank's strip of an image.
        expected_output: maps ``reference``'s output to what ``module``'s output must equal,
            e.g. this rank's strip of it; the module's loss must then equal ``loss_fn`` of
            that (while ``reference`` backpropagates its own loss).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> for step in range(3):
        ...     loss = assert_training_step_matches(model, reference, tokens, targets, loss_fn, what=f"step {step}")
        ...     optimizer.step(); ref_optimizer.step()
    """
    loss, _, _ = _training_step(
        module, reference, inputs, targets, loss_fn, rtol=rtol, atol=atol, params=params, what=what,
        module_inputs=module_inputs, expected_output=expected_output,
    )
    return full_tensor(loss).item()


def assert_trains_like(
    module: nn.Module,
    reference: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer],
    rtol: float = 1e-5,
    atol: float = 1e-5,
    params: bool = True,
    what: str = "",
    module_inputs: Callable[[Any], Any] | None = None,
    expected_output: Callable[[Any], Any] | None = None,
    check: Callable[[Any, Any], None] | None = None,
) -> list[float]:
    """Train ``module`` and ``reference`` side by side, one step per batch; assert every step agrees.

    Each model gets its own ``optimizer(model.parameters())``. For each ``(inputs, targets)``
    of ``batches``: :func:`assert_training_step_matches` (outputs, losses, parameters and
    gradients; messages name ``"<what> step <i>"``), then ``check(output, reference_output)``
    if given, then a step and ``zero_grad()`` of both optimizers. ``batches`` is read one batch
    per step, so a generator drawing from the global RNG draws in the order a hand-written
    loop would. Returns ``module``'s losses as floats.

    Keyword Args:
        optimizer: makes an optimizer from parameters, e.g.
            ``functools.partial(torch.optim.SGD, lr=0.1)``.
        module_inputs, expected_output: as in :func:`assert_training_step_matches`.
        check: the test's own assertions on each step's raw outputs (placements, types),
            before the optimizers step.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> batches = ((torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(3))
        >>> sgd = functools.partial(torch.optim.SGD, lr=0.1)
        >>> losses = assert_trains_like(model, reference, batches, loss_fn, optimizer=sgd)
        >>> losses[-1] < losses[0]
        True
    """
    optimizers = [optimizer(m.parameters()) for m in (module, reference)]
    losses = []
    for step, (inputs, targets) in enumerate(batches):
        loss, out, ref_out = _training_step(
            module, reference, inputs, targets, loss_fn, rtol=rtol, atol=atol, params=params,
            what=f"{what} step {step}".lstrip(), module_inputs=module_inputs, expected_output=expected_output,
        )
        if check is not None:
            check(out, ref_out)
        for each in optimizers:
            each.step()
            each.zero_grad()
        losses.append(full_tensor(loss).item())
    return losses


def _training_step(module, reference, inputs, targets, loss_fn, *, rtol, atol, params, what, module_inputs,
                   expected_output):
    """One forward and backward of both, compared; returns ``module``'s loss and both outputs."""
    prefix = f"{what} " if what else ""
    out = module(inputs if module_inputs is None else module_inputs(inputs))
    ref_out = reference(inputs)
    expected = ref_out if expected_output is None else expected_output(ref_out)
    torch.testing.assert_close(
        _full(out), _full(expected), rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{prefix}output: {m}"
    )
    loss, ref_loss = loss_fn(out, targets), loss_fn(ref_out, targets)
    expected_loss = ref_loss if expected_output is None else loss_fn(expected, targets)
    torch.testing.assert_close(
        _full(loss), _full(expected_loss), rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{prefix}loss: {m}"
    )
    trainable = (_full(loss).requires_grad, ref_loss.requires_grad)
    assert trainable[0] == trainable[1], f"{prefix}loss: requires_grad {trainable[0]}, one process's {trainable[1]}"
    if trainable[1]:  # (a model with nothing to train, e.g. only int8 weights: outputs and losses compared)
        loss.backward()
        ref_loss.backward()
    assert_params_and_grads_match(module, reference, rtol=rtol, atol=atol, params=params, what=what)
    return loss, out, ref_out


def _full(value: Any) -> Any:
    """``value`` with every DTensor in it (a tensor, or tuples, lists, dicts of them) made whole."""
    return tree_map(full_tensor, value)
