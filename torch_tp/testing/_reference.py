"""Comparing a parallelized module with its single-process reference (rank side).

Every distributed test keeps an unsharded copy of its module as the reference; these
helpers turn DTensors back into full tensors and compare parameters and gradients,
naming the parameter that differs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["assert_params_and_grads_match", "assert_training_step_matches", "full_tensor", "local_chunk"]


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value.full_tensor()`` for a DTensor (a collective: call it on every rank), else ``value``.

    Example::

        >>> full_tensor(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return value.full_tensor() if isinstance(value, DTensor) else value


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

    Parameters are paired by name order; DTensors (on either side) are compared as full tensors.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> assert_params_and_grads_match(parallel_model, reference_model, what="step 2")
    """
    prefix = f"{what} " if what else ""
    pairs = zip(module.named_parameters(), reference.named_parameters())
    for (name, param), (ref_name, ref_param) in pairs:
        assert name == ref_name, f"parameter order differs: {name} vs {ref_name}"
        if params:
            torch.testing.assert_close(
                full_tensor(param), full_tensor(ref_param), rtol=rtol, atol=atol, msg=lambda m: f"{prefix}{name}: {m}"
            )
        torch.testing.assert_close(
            full_tensor(param.grad), full_tensor(ref_param.grad), rtol=rtol, atol=atol,
            msg=lambda m: f"{prefix}grad of {name}: {m}",
        )


def assert_training_step_matches(
    module: nn.Module,
    reference: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    params: bool = True,
    what: str = "",
) -> float:
    """Run forward and backward of ``module`` and ``reference`` on one batch; assert they agree.

    Outputs and losses (``loss_fn(output, targets)``) must match, then every parameter (unless
    ``params=False``) and gradient, as in :func:`assert_params_and_grads_match`. The optimizer
    step is the caller's. Returns ``module``'s loss as a float.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> for step in range(3):
        ...     loss = assert_training_step_matches(model, reference, tokens, targets, loss_fn, what=f"step {step}")
        ...     optimizer.step(); ref_optimizer.step()
    """
    prefix = f"{what} " if what else ""
    out, ref_out = module(inputs), reference(inputs)
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol, msg=lambda m: f"{prefix}output: {m}")
    loss, ref_loss = loss_fn(out, targets), loss_fn(ref_out, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol, msg=lambda m: f"{prefix}loss: {m}")
    loss.backward()
    ref_loss.backward()
    assert_params_and_grads_match(module, reference, rtol=rtol, atol=atol, params=params, what=what)
    return loss.item()
