"""What the ranks agree on before :func:`~torch_tp.tools.suggest_plan` acts, and the errors it
raises on every rank alike.

``suggest_plan`` compares a candidate plan's forward with each rank's own whole model, and
every later step (another candidate, a group kept whole, the plan returned) follows from that
verdict. A rank that decided alone could return while another started a second
``parallelize_module`` nobody joins (a hang), so every verdict is agreed first, each with one
all-gather of 8 bytes (:func:`torch_tp._agreement.agree_or_raise`):

===========================================  ==================================================
agreed                                       when the ranks differ (on every rank)
===========================================  ==================================================
each tensor of the model's state dict, each  :class:`RanksDisagreeError` naming the first
example input (a digest of its bytes), and   tensor or input that differs, each rank's digest,
how the derivation ended (the candidate      and the fix: seed every rank alike before
plan's digest, or its error): one agreement  building the model, or build it on rank 0 and
                                             broadcast it
each probe of a candidate: its verdict (and  :class:`RanksDisagreeError`: the model computes
the module that raised) and the candidate's  differently on the ranks (values outside its
digest: one agreement per probe              state dict, randomness, code reading the rank)
===========================================  ==================================================

So ``suggest_plan`` ends the same way on every rank: one plan, or one error (same class,
same message).

Example::

    >>> [f.topic for f in state_facts(torch.nn.Linear(2, 2))]
    ["models hold 'weight' as", "models hold 'bias' as"]
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torch_tp._agreement import Fact, agree_or_raise

__all__ = ["PlanDerivationError", "RanksDisagreeError", "agree", "derivation_fact", "digest", "input_facts", "outcome_of",
           "probe_fact", "state_facts"]

WHAT = "torch_tp.suggest_plan"

T = TypeVar("T")


class PlanDerivationError(RuntimeError):
    """``suggest_plan`` found no plan it could prove: the model could not be traced, the derived
    plan does not give the model's outputs in either form (local slices or DTensors between a
    group's ends), or the residual stream cannot be split; raised on every rank alike, naming
    why and what to change.

    Example::

        >>> issubclass(PlanDerivationError, RuntimeError)
        True
    """


class RanksDisagreeError(PlanDerivationError):
    """The ranks hold different models or example inputs, or a step of ``suggest_plan`` ended
    differently on them: raised on every rank alike, before any rank acts on its own verdict,
    naming what differs on each rank and how to make the ranks agree.

    Example::

        >>> issubclass(RanksDisagreeError, PlanDerivationError)
        True
    """


_SEED = ("suggest_plan compares the split model with each rank's own whole model, so every rank must hold "
         "the same one: call torch.manual_seed(<one seed>) on every rank before building the model, or build "
         "it on rank 0 and broadcast it (torch.distributed.broadcast of every tensor of model.state_dict())")
_INPUTS = ("pass the same example inputs on every rank: seed every rank alike before drawing them "
           "(torch.manual_seed), or broadcast them from rank 0")
_FORWARD = ("the ranks hold the same parameters and example inputs, so the model computes differently on them "
            "(a value outside its state dict, randomness in its forward, code that reads the rank): make its "
            "forward the same on every rank, or write the plan yourself")


def digest(tensor: torch.Tensor) -> str:
    """16 hex digits of SHA-256 over ``tensor``'s dtype, shape and bytes (a wrapper subclass's
    inner tensors; a ``meta`` tensor by its shape only).

    Example::

        >>> digest(torch.zeros(2)) == digest(torch.zeros(2)) != digest(torch.ones(2))
        True
    """
    hashed = hashlib.sha256(f"{tensor.dtype} {tuple(tensor.shape)}".encode())
    _feed(hashed, tensor)
    return hashed.hexdigest()[:16]


def _feed(hashed: Any, tensor: torch.Tensor) -> None:
    if is_traceable_wrapper_subclass(tensor):  # a DTensor, an int8 tensor: the tensors it holds
        for name in tensor.__tensor_flatten__()[0]:
            _feed(hashed, getattr(tensor, name))
    elif tensor.device.type != "meta":
        hashed.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def state_facts(model: nn.Module) -> list[Fact]:
    """One fact per entry of ``model.state_dict()`` (parameters, buffers): its digest.

    Example::

        >>> [f.topic for f in state_facts(torch.nn.BatchNorm1d(2))][:2]
        ["models hold 'weight' as", "models hold 'bias' as"]
    """
    return [Fact(f"models hold {name!r} as", digest(value) if isinstance(value, torch.Tensor) else repr(value), _SEED)
            for name, value in model.state_dict().items()]


def input_facts(example_inputs: tuple[Any, ...]) -> list[Fact]:
    """One fact per leaf of the example inputs: a tensor's digest, a number's or string's value.

    Example::

        >>> [(f.topic, f.value) for f in input_facts((torch.zeros(1), 3))]
        [('example inputs hold [0] as', '49d0707e2666a1c6'), ('example inputs hold [1] as', '3')]
    """
    leaves, _ = pytree.tree_flatten_with_path(example_inputs)
    return [Fact(f"example inputs hold {pytree.keystr(path)} as", _leaf_value(leaf), _INPUTS) for path, leaf in leaves]


def _leaf_value(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return digest(leaf)
    if leaf is None or isinstance(leaf, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return repr(leaf)
    return type(leaf).__qualname__  # an object's repr may hold its address, which differs on every rank


def outcome_of(run: Callable[[], T], describe: Callable[[T], str]) -> tuple[T | None, Exception | None, str]:
    """``(result, None, describe(result))`` if ``run()`` returns, else ``(None, error, "raised
    <type>: <message>")``: how this rank's step ended, as a value the ranks can agree on.

    Example::

        >>> outcome_of(lambda: 1 / 0, str)[2]
        'raised ZeroDivisionError: division by zero'
    """
    try:
        result = run()
    except Exception as error:  # noqa: BLE001 - any end of this rank's step is agreed before it is acted on
        return None, error, f"raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return result, None, describe(result)


def agree(mesh: DeviceMesh, facts: Sequence[Fact]) -> None:
    """Return on every rank if all hold the same ``facts``; else raise :class:`RanksDisagreeError`
    on every rank, with the same message (the first fact that differs, each rank's value, the fix).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> agree(mesh, state_facts(model))   # one all-gather of 8 bytes
    """
    try:
        agree_or_raise(mesh.get_group(), None, facts, what=WHAT)
    except ValueError as error:  # raised on every rank alike: the ranks' facts differ
        raise RanksDisagreeError(str(error)) from None


def derivation_fact(ended: str) -> Fact:
    """How the derivation ended on this rank (the candidate plan's digest, or its error)."""
    return Fact("derivations of the plan from the exported graph ended", ended, _FORWARD)


def probe_fact(form: str, ended: str) -> Fact:
    """How the probe of the candidate plan ``form`` ended on this rank (its verdict and digest)."""
    return Fact(f"probes of the candidate plan {form} ended", ended, _FORWARD)
