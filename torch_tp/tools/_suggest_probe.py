"""The probe of a candidate plan: applied to a copy of the model, run on the example inputs in
each mode it must hold in, compared with the whole model within the tolerance of its dtype.

=========================  ======  ===================================================
output dtype               rtol    atol
=========================  ======  ===================================================
float32 (and any other)    1e-4    1e-5
float16                    1e-3    ``4 * eps * max|want|`` (eps 9.8e-4: 0.39% of the
                                   output's largest magnitude)
bfloat16                   1.6e-2  ``4 * eps * max|want|`` (eps 7.8e-3: 3.1%)
=========================  ======  ===================================================

An output ``got`` matches the model's ``want`` when ``|got - want| <= atol + rtol * |want|``
element by element (``torch.allclose``). The half dtypes' ``rtol`` is torch.testing's default
for the dtype; their ``atol`` is set by the output's scale, not torch.testing's ``1e-5``: a
split layer rounds each rank's partial sum to the dtype at the output's scale, then the sum of
the partial sums again, so an element near zero can differ from one process by about one unit
in the last place of the output's largest values (measured: up to ``0.87 * eps * max|want|``
on MLPs at 2 and 4 ranks), far above ``1e-5`` and far below what a wrong plan changes.

In eval mode the copy and the model run as they are (dropout is off). In training mode both run
under one seed with dropout turned off (:class:`DropoutOff`: dropout on a rank's slice draws
another mask than on the whole tensor; it is pointwise and keeps any split, so the rules prove
it), on a copy of the model too, so its buffers (BatchNorm's running statistics) do not change.

Example::

    >>> tolerance(torch.bfloat16, scale=2.0)
    (0.016, 0.0625)
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from torch_tp.parallel import rules
from torch_tp.tools._suggest_modes import modes_kept

__all__ = ["DropoutOff", "Failure", "runs_like_the_model", "tolerance"]

#: ``{half dtype: rtol}`` (torch.testing's); their atol is ``_ULPS * eps * scale``.
_HALF_RTOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
_ULPS = 4
_FLOAT32 = (1e-4, 1e-5)


def tolerance(dtype: torch.dtype, *, scale: float = 1.0) -> tuple[float, float]:
    """``(rtol, atol)`` the probe compares an output of ``dtype`` whose largest magnitude is
    ``scale`` with (the module's table).

    Example::

        >>> tolerance(torch.float32), tolerance(torch.float16)
        ((0.0001, 1e-05), (0.001, 0.00390625))
    """
    if dtype in _HALF_RTOL:
        return _HALF_RTOL[dtype], _ULPS * torch.finfo(dtype).eps * scale
    return _FLOAT32


def _matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = want.detach().abs().max().item() if want.dtype in _HALF_RTOL and want.numel() else 1.0
    rtol, atol = tolerance(want.dtype, scale=scale)
    return got.shape == want.shape and torch.allclose(got, want, rtol=rtol, atol=atol)


@dataclasses.dataclass
class Failure:
    """Why a candidate plan did not give the model's outputs; ``module``: the innermost module
    whose forward raised, if one did.

    Example::

        >>> str(Failure("its outputs differ from the model's"))
        "its outputs differ from the model's"
    """

    message: str
    module: nn.Module | None = None

    def __str__(self) -> str:
        return self.message


_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}


class DropoutOff(TorchFunctionMode):
    """Inside, every dropout returns its input and attention runs with ``dropout_p=0``.

    Example::

        >>> x = torch.ones(4)
        >>> with DropoutOff():
        ...     torch.equal(F.dropout(x, 0.5, training=True), x)
        True
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:  # (query, key, value, attn_mask, dropout_p, ...)
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


def runs_like_the_model(model: nn.Module, mesh: DeviceMesh, example_inputs: tuple[Any, ...], plan: dict,
                        modes: tuple[str, ...]) -> Failure | None:
    """``None`` if ``plan`` applied to a copy of ``model`` gives the model's outputs on the
    example inputs in every one of ``modes`` (eval first), else what went wrong (with the mode,
    when there are two). Every rank runs the same forward; the caller agrees on the answer."""
    from torch_tp.parallel.api import parallelize_module

    if not plan:
        return None
    copied = None
    with modes_kept(model):
        try:
            copied = parallelize_module(copy.deepcopy(model), mesh, plan)
            for mode in sorted(modes, key=lambda m: m != "eval"):  # eval first: training updates buffers
                failure = _compare(model, copied, example_inputs, mode, mesh.device_type)
                if failure is not None:
                    return failure if len(modes) == 1 else Failure(f"in {mode} mode: {failure}", failure.module)
        except (RuntimeError, ValueError) as error:
            where = None if copied is None else _raised_in(copied, error)
            return Failure(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}", where)
    return None


def _compare(model: nn.Module, copied: nn.Module, example_inputs: tuple[Any, ...], mode: str,
             device_type: str) -> Failure | None:
    training = mode == "train"
    reference = copy.deepcopy(model) if training else model  # training may update buffers: not the user's
    reference.train(training)
    copied.train(training)
    devices = [] if device_type == "cpu" else [getattr(torch, device_type).current_device()]
    with torch.no_grad(), DropoutOff(), torch.random.fork_rng(devices=devices, device_type=device_type):
        torch.manual_seed(0)
        want = reference(*example_inputs)
        torch.manual_seed(0)  # the same draws for anything else random in the forward
        got = copied(*example_inputs)
    got, want = (pytree.tree_leaves(_as_tree(v)) for v in (got, want))
    same = len(got) == len(want) and all(
        _matches(_whole(g), w) for g, w in zip(got, want) if isinstance(w, torch.Tensor)
    )
    return None if same else Failure("its outputs differ from the model's")


def _raised_in(model: nn.Module, error: BaseException) -> nn.Module | None:
    """The innermost module of ``model`` whose own ``forward`` is on ``error``'s traceback and
    holds a parallelized layer below it (not a parallelized layer itself)."""
    holders = {id(m) for m in model.modules()
               if any(rules.is_prepared(c) for c in m.modules() if c is not m) and not rules.is_prepared(m)}
    found, frame = None, error.__traceback__
    while frame is not None:
        owner = frame.tb_frame.f_locals.get("self")
        if frame.tb_frame.f_code.co_name == "forward" and id(owner) in holders:
            found = owner
        frame = frame.tb_next
    return found


def _as_tree(value: Any) -> Any:
    """A model output as a pytree (transformers' ``ModelOutput`` is a dict of its fields)."""
    return dict(value) if isinstance(value, dict) else value


def _whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value
