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
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

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


def _full_size_twin(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose own tensors are fresh full-size CPU tensors, no children."""
    twin = module.__new__(type(module))
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


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)


def _init_module(module: nn.Module, path: str, init_fn: Callable[[nn.Module], None], seed: int) -> None:
    twin = _full_size_twin(module)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, path))
        try:
            init_fn(twin)
        except AttributeError as err:
            raise TypeError(
                f"initializing {path or '<root>'!r} ({type(module).__name__}) touched something "
                f"outside its own parameters ({err}); init_parameters runs init_fn on one "
                f"module's own parameters and buffers at a time — pass an init_fn that handles "
                f"{type(module).__name__} without reaching into its children"
            ) from err
    with torch.no_grad():
        for name, full in [*twin._parameters.items(), *twin._buffers.items()]:
            if full is not None:
                _copy_into(getattr(module, name), full.detach())


def init_parameters(
    module: nn.Module,
    init_fn: Callable[[nn.Module], None] | None = None,
    *,
    seed: int = 0,
) -> nn.Module:
    """Initialize every parameter and buffer of ``module`` in place, reproducibly across world sizes.

    ``init_fn(m)`` is called once per submodule that owns parameters or buffers, on a
    stand-in whose own tensors are full-size plain CPU tensors (so ``nn.init`` functions and
    fan-in computations see the global shapes); it must only touch ``m``'s own tensors.
    Default: ``m.reset_parameters()`` where the module defines it (tensors of modules that
    define none are left as they are — after ``to_empty`` that means uninitialized, so give
    such modules an ``init_fn`` or a ``reset_parameters``). DTensor parameters receive this
    rank's shard; plain tensors the whole value.

    Returns ``module``.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
        >>> a = init_parameters(model, seed=1)[0].weight.clone()
        >>> torch.equal(init_parameters(model, seed=1)[0].weight, a)
        True
    """
    init_fn = init_fn or _default_init
    for path, submodule in module.named_modules():
        owns = any(t is not None for t in [*submodule._parameters.values(), *submodule._buffers.values()])
        if owns:
            _init_module(submodule, path, init_fn, seed)
    return module
