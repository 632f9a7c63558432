"""``init_parameters``: initialize a (possibly sharded) model so its values do not depend on the world size.

The flow for a model too big for one device::

    with torch.device("meta"):
        model = Transformer(args)                  # shapes only, no memory
    parallelize_module(model, mesh, plan)          # parameters become (meta) DTensors
    model.to_empty(device="cuda")                  # each rank allocates only its shards
    init_parameters(model, seed=0)                 # fill them

Each module's own parameters and buffers are initialized at full size on the CPU, under a
seed derived from ``seed`` and the module's path, and each rank keeps its shard. So the
full tensors are the same whatever the world size, the same as
``init_parameters(unsharded_model, seed=0)`` on one process, and independent of the order
modules are visited. Peak extra memory is one module's own parameters at full size.

Only the tensors the init function sets are written: a tensor it does not set (a module
without ``reset_parameters``, a buffer its ``reset_parameters`` ignores, a parameter a
custom ``init_fn`` skips) keeps exactly the values it had. A tensor counts as set when the
init function writes to its memory in any way (``nn.init``, ``copy_``, ``.data.normal_()``,
a write to a view) or replaces it (``self.weight = nn.Parameter(...)``). A tensor that
nothing sets and that is still on the ``meta`` device has no values to keep, so
``init_parameters`` refuses it, naming its path, before writing anything.

Example::

    >>> class Gain(nn.Module):  # no reset_parameters
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gain = nn.Parameter(torch.full((8,), 2.0))
    >>> model = init_parameters(nn.Sequential(nn.Linear(4, 8), Gain()), seed=0)
    >>> model[1].gain.tolist() == [2.0] * 8
    True
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["init_parameters", "module_seed"]


def module_seed(seed: int, module_path: str) -> int:
    """The RNG seed :func:`init_parameters` uses for the module at ``module_path``.

    Example::

        >>> module_seed(0, "layers.0.attention.wq") == module_seed(0, "layers.0.attention.wq")
        True
        >>> module_seed(0, "a") != module_seed(0, "b")
        True
    """
    digest = hashlib.sha256(f"{seed}/{module_path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _default_init(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s own parameters and buffers by name, without the ``None`` entries."""
    own = {**module._parameters, **module._buffers}
    return {name: t for name, t in own.items() if t is not None}


def _full_size_twin(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose own tensors are fresh full-size CPU tensors, no children."""
    cls = _unwrapped_class(module)
    twin = cls.__new__(cls)
    twin.__dict__ = dict(module.__dict__)
    twin._parameters = {  # None entries (Linear(bias=False)) stay None
        name: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        for name, p in module._parameters.items()
    }
    twin._buffers = {
        name: None if b is None else torch.empty(b.shape, dtype=b.dtype) for name, b in module._buffers.items()
    }
    twin._modules = {}
    return twin


def _unwrapped_class(module: nn.Module) -> type:
    """The module's own class: FSDP2 swaps in a subclass ``FSDP<Name>(FSDPModule, <Name>)``
    whose ``__new__`` runs ``__init__``; the twin needs only the module's ``reset_parameters``.

    Example:
        >>> _unwrapped_class(nn.Linear(2, 2)).__name__
        'Linear'
    """
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):
        return next(base for base in cls.__mro__[1:] if not issubclass(base, FSDPModule) and base is not object)
    return cls


def _storage_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _has_storage(value: object) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.layout is torch.strided
        and not value.is_meta
        and not is_traceable_wrapper_subclass(value)
    )


class _WriteRecorder(TorchDispatchMode):
    """Records the storage of every tensor an aten op writes to, whichever alias it writes through.

    A write through ``.data`` (``m.weight.data.normal_()``) leaves ``m.weight._version`` as it
    was, but it reaches the dispatcher as ``normal_`` on a tensor sharing ``m.weight``'s storage.
    """

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)
        for i, argument in enumerate(schema.arguments if schema is not None else []):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if _has_storage(t):
                    self.written.add(_storage_address(t))
        return func(*args, **kwargs)


def _init_twin(
    module: nn.Module, path: str, init_fn: Callable[[nn.Module], None], seed: int
) -> dict[str, torch.Tensor]:
    """Run ``init_fn`` on ``module``'s full-size twin; the full tensors it set, by name."""
    twin = _full_size_twin(module)
    before = {name: (t, _storage_address(t)) for name, t in _own_tensors(twin).items()}
    recorder = _WriteRecorder()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, path))
        try:
            with recorder:
                init_fn(twin)
        except AttributeError as err:
            raise TypeError(
                f"initializing {path or '<root>'!r} ({type(module).__name__}) touched something "
                f"outside its own parameters ({err}); init_parameters runs init_fn on one "
                f"module's own parameters and buffers at a time — pass an init_fn that handles "
                f"{type(module).__name__} without reaching into its children"
            ) from err

    def was_set(name: str, t: torch.Tensor) -> bool:
        old, address = before[name]
        return t is not old or _storage_address(t) != address or address in recorder.written

    return {name: t.detach() for name, t in _own_tensors(twin).items() if name in before and was_set(name, t)}


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)


def _refuse_unset_meta_tensors(
    owners: list[tuple[str, nn.Module]], init_fn: Callable[[nn.Module], None], seed: int
) -> None:
    unset = []
    for path, module in owners:
        on_meta = [name for name, t in _own_tensors(module).items() if t.is_meta]
        if on_meta:
            set_names = _init_twin(module, path, init_fn, seed)
            unset += [f"{path}.{name}" if path else name for name in on_meta if name not in set_names]
    if unset:
        raise ValueError(
            f"init_parameters leaves a tensor that no init function sets as it is, but these are "
            f"on the meta device (no values to keep) and nothing sets them: {', '.join(unset)}. "
            f"Give their modules a reset_parameters, pass an init_fn that sets them, or "
            f"materialize the model (model.to_empty(device=...)) and set them yourself"
        )


def init_parameters(
    module: nn.Module,
    init_fn: Callable[[nn.Module], None] | None = None,
    *,
    seed: int = 0,
) -> nn.Module:
    """Initialize the parameters and buffers of ``module`` in place, reproducibly across world sizes.

    ``init_fn(m)`` is called once per submodule that owns parameters or buffers, on a
    stand-in whose own tensors are full-size plain CPU tensors (so ``nn.init`` functions and
    fan-in computations see the global shapes), under a seed derived from ``seed`` and
    ``m``'s path; it must only touch ``m``'s own tensors. Default: ``m.reset_parameters()``
    where the module defines it. DTensor parameters receive this rank's shard of each
    tensor ``init_fn`` sets; plain tensors the whole value.

    Only the tensors ``init_fn`` sets are written — by writing to them in any way (including
    through ``.data`` or a view) or by replacing them (``self.weight = nn.Parameter(...)``,
    whose values are then copied into the existing parameter). Every other tensor keeps
    exactly the values it had: those of a module without ``reset_parameters``, a buffer its
    ``reset_parameters`` ignores, a parameter ``init_fn`` skips. After ``to_empty`` that
    means uninitialized memory, so give such modules an ``init_fn`` or a ``reset_parameters``.

    Keyword Args:
        seed (int): the base of every module's seed (:func:`module_seed`). Default: 0.

    Returns:
        ``module``.

    Raises:
        ValueError: if a tensor that nothing sets is still on the ``meta`` device (it has no
            values to keep). The message names each such tensor's path; nothing is written.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
        >>> a = init_parameters(model, seed=1)[0].weight.clone()
        >>> torch.equal(init_parameters(model, seed=1)[0].weight, a)
        True
        >>> def zero_linear_weights(m):  # sets only Linear weights
        ...     if isinstance(m, nn.Linear):
        ...         nn.init.zeros_(m.weight)
        >>> bias = model[0].bias.clone()
        >>> _ = init_parameters(model, zero_linear_weights)
        >>> bool((model[0].weight == 0).all()), torch.equal(model[0].bias, bias)
        (True, True)

    .. note::
        A tensor ``init_fn`` writes to is taken whole from the stand-in, whose tensors start
        uninitialized: set all of it, not one row.
    """
    init_fn = init_fn or _default_init
    owners = [(path, m) for path, m in module.named_modules() if _own_tensors(m)]
    _refuse_unset_meta_tensors(owners, init_fn, seed)
    for path, submodule in owners:
        set_tensors = _init_twin(submodule, path, init_fn, seed)
        with torch.no_grad():
            for name, full in set_tensors.items():
                _copy_into(getattr(submodule, name), full)
    return module
