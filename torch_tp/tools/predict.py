"""Predicting where FSDP shards each parameter over the data-parallel mesh axis.

The rule (the design note's ``predict_shard_params_fn``), for a parameter of global
``shape`` that tensor parallelism places as ``tp_placement`` over ``tp_size`` ranks:

1. fewer than ``min_weight_size`` elements: **replicated** over dp (its gradient is
   all-reduced over dp instead of reduce-scattered): gathering a tiny tensor costs more
   latency than its memory is worth;
2. else the **largest dim the TP axis has not taken** whose size divides by ``dp_size``
   (ties: the lower dim) is sharded over dp;
3. else the **dim TP already shards**, if its size divides by ``tp_size * dp_size``: both axes
   split it (FSDP2 records this as a strided shard; every rank holds
   ``size / (tp * dp)``). A packed TP weight (``packed=k``) is not split further;
4. else nothing divides: **replicated** over dp, with a note saying why.

Divisibility is required (no uneven FSDP shards): FSDP2 refuses uneven shards on dims
other than 0, and even shards make the bytes on every rank exactly what is predicted.

Example::

    >>> from torch.distributed.tensor import Shard
    >>> predict_dp_placement((96, 64), Shard(0), dp_size=2, tp_size=2, min_weight_size=1)
    (Shard(dim=1), '')
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_tp.parallel import rules

__all__ = ["predict_dp_placement", "check_min_weight_size", "axis_sizes", "DEFAULT_MIN_WEIGHT_SIZE"]

#: Parameters with fewer elements stay replicated over dp (the design note's ``2**18``).
DEFAULT_MIN_WEIGHT_SIZE = 2**18


def check_min_weight_size(value: object, caller: str) -> int:
    """Return ``value`` if it is a positive int, else raise ``ValueError`` naming ``caller``.

    Example::

        >>> check_min_weight_size(1024, "fully_shard_by_pattern")
        1024
        >>> check_min_weight_size(0.5, "fully_shard_by_pattern")
        Traceback (most recent call last):
        ValueError: fully_shard_by_pattern(min_weight_size=0.5): ...
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{caller}(min_weight_size={value!r}): the smallest parameter (in elements) to shard "
            f"over dp must be a positive int, e.g. 2**18; smaller parameters stay replicated"
        )
    return value


def predict_dp_placement(
    shape: tuple[int, ...],
    tp_placement: Placement | None = None,
    *,
    dp_size: int,
    tp_size: int = 1,
    min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
) -> tuple[Placement, str]:
    """Where FSDP should put a parameter over dp, and why: ``(Shard(dim) or Replicate(), note)``.

    ``note`` is empty when a dim TP left free is sharded; otherwise it says that the dim is
    shared with TP, that the parameter is too small, or that no dim divides (the rules are
    in this module's docstring).

    Example::

        >>> predict_dp_placement((10, 6), None, dp_size=4, min_weight_size=1)
        (Replicate(), 'no divisible dim: (10, 6) has no dim divisible by dp 4')
        >>> predict_dp_placement((64, 8), Shard(0), dp_size=2, tp_size=2, min_weight_size=1)
        (Shard(dim=1), '')
        >>> predict_dp_placement((64, 6), Shard(0), dp_size=4, tp_size=2, min_weight_size=1)
        (Shard(dim=0), 'dim 0 split by tp and dp: 64 % (2 * 4) == 0')
        >>> predict_dp_placement((64,), None, dp_size=2, min_weight_size=1024)
        (Replicate(), 'too small: 64 < min_weight_size 1024 elements')
    """
    numel = 1
    for size in shape:
        numel *= size
    if numel < min_weight_size:
        return Replicate(), f"too small: {numel} < min_weight_size {min_weight_size} elements"
    tp_dim = _tp_dim(shape, tp_placement, tp_size)
    free = [d for d in range(len(shape)) if d != tp_dim and shape[d] % dp_size == 0]
    if free:
        return Shard(max(free, key=lambda d: (shape[d], -d))), ""
    if tp_dim is not None and rules.parts_of(tp_placement) == 1 and shape[tp_dim] % (tp_size * dp_size) == 0:
        return Shard(tp_dim), f"dim {tp_dim} split by tp and dp: {shape[tp_dim]} % ({tp_size} * {dp_size}) == 0"
    return Replicate(), _no_dim_note(shape, tp_dim, tp_placement, dp_size, tp_size)


def _tp_dim(shape: tuple[int, ...], tp_placement: Placement | None, tp_size: int) -> int | None:
    """The dim TP shards over more than one rank (``None``: none)."""
    dim = rules.sharded_dim(tp_placement)
    if dim is None or tp_size == 1:
        return None
    return dim % len(shape)


def _no_dim_note(shape, tp_dim, tp_placement, dp_size: int, tp_size: int) -> str:
    note = f"no divisible dim: {tuple(shape)} has no dim divisible by dp {dp_size}"
    if tp_dim is None:
        return note
    if rules.parts_of(tp_placement) > 1:
        return note + f" (dim {tp_dim} is a packed tp shard, not split further)"
    return note + f" (dim {tp_dim}, taken by tp, would need {shape[tp_dim]} % ({tp_size} * {dp_size}) == 0)"


def axis_sizes(mesh: object, *, dp_dim: str, tp_dim: str, caller: str) -> dict[str, int]:
    """``{dp_dim: n, tp_dim: m}`` of a 2-D mesh (``{dp_dim: n}`` of a 1-D one: FSDP only).

    ``mesh`` is a :class:`DeviceMesh` (2-D with named dims, or 1-D: the dp axis), a mapping
    ``{"dp": n, "tp": m}`` or an int (dp only), so predictions need no process group.

    Example::

        >>> axis_sizes({"dp": 2, "tp": 4}, dp_dim="dp", tp_dim="tp", caller="predict_placements")
        {'dp': 2, 'tp': 4}
        >>> axis_sizes(8, dp_dim="dp", tp_dim="tp", caller="predict_placements")
        {'dp': 8}
    """
    from collections.abc import Mapping

    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim == 1:
            return {dp_dim: mesh.size()}
        names = tuple(mesh.mesh_dim_names or ())
        sizes = dict(zip(names, mesh.shape))
    elif isinstance(mesh, Mapping):
        names, sizes = tuple(mesh), dict(mesh)
    elif isinstance(mesh, int) and not isinstance(mesh, bool):
        names, sizes = (dp_dim,), {dp_dim: mesh}
    else:
        raise TypeError(f"{caller} needs a DeviceMesh, a mapping {{{dp_dim!r}: n, {tp_dim!r}: m}} or an int (dp only), got {mesh!r}")
    if dp_dim not in sizes or not set(names) <= {dp_dim, tp_dim}:
        raise ValueError(
            f"{caller}: the mesh has dims {names} but needs a data-parallel dim named {dp_dim!r} "
            f"(and at most a tensor-parallel dim {tp_dim!r}); build it with "
            f"init_device_mesh(device, (dp, tp), mesh_dim_names=({dp_dim!r}, {tp_dim!r})) or pass "
            f"dp_dim=/tp_dim= naming its dims"
        )
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{caller}: mesh dim {name!r} must have a positive int size, got {size!r}")
    return {name: sizes[name] for name in (dp_dim, tp_dim) if name in sizes}
