"""Converting module inputs and outputs between plain tensors and DTensors.

Every style's forward hooks reduce to two moves: *annotate* a plain local tensor as
a DTensor with a known layout, and *redistribute* a DTensor to the layout the next
computation needs. Both live here so the styles share one definition of each.

The functions are module-level (styles bind them with :func:`functools.partial`)
so that ``torch.compile`` traces them without graph breaks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

__all__: list[str] = []


def normalize_layouts(
    layouts: Placement | Sequence[Placement | None] | None,
    argument: str,
) -> tuple[Placement | None, ...] | None:
    """Return ``layouts`` as a tuple (one entry per input or output), or ``None``.

    A single :class:`Placement` means "one tensor". Anything else must be a sequence
    of placements and ``None`` placeholders.
    """
    if layouts is None:
        return None
    if isinstance(layouts, Placement):
        return (layouts,)
    if isinstance(layouts, Sequence) and not isinstance(layouts, str):
        layouts = tuple(layouts)
        for layout in layouts:
            if layout is not None and not isinstance(layout, Placement):
                raise TypeError(
                    f"{argument} entries must be Placements (Shard(d), Replicate(), ...) "
                    f"or None placeholders; got {layout!r} in {layouts!r}"
                )
        return layouts
    raise TypeError(
        f"{argument} must be a Placement or a tuple of Placements/None; got {layouts!r}"
    )


def shard_bounds(size: int, num_ranks: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each rank's piece of a dim of ``size`` under ``Shard`` (``torch.chunk`` rule).

    Example::

        >>> shard_bounds(10, 4)
        [(0, 3), (3, 6), (6, 9), (9, 10)]
    """
    chunk = -(-size // num_ranks)
    return [(min(r * chunk, size), min((r + 1) * chunk, size)) for r in range(num_ranks)]


def shard_sizes(size: int, num_ranks: int) -> tuple[int, ...]:
    """How many slices of a dim of ``size`` each rank holds under ``Shard`` (torch.chunk rule).

    Example::

        >>> shard_sizes(10, 4)
        (3, 3, 3, 1)
        >>> shard_sizes(3, 4)
        (1, 1, 1, 0)
    """
    return tuple(stop - start for start, stop in shard_bounds(size, num_ranks))


def check_same_length(
    layouts: tuple | None, desired: tuple | None, names: tuple[str, str]
) -> None:
    """Raise if a layout tuple and its desired-layout tuple cannot be zipped."""
    if layouts is None and desired is None:
        return
    if layouts is None or desired is None:
        given, missing = names if desired is None else names[::-1]
        raise ValueError(f"{given} is set but {missing} is not; pass both, one entry per tensor")
    if len(layouts) != len(desired):
        raise ValueError(
            f"{names[0]} has {len(layouts)} entries but {names[1]} has {len(desired)}: "
            f"they describe the same tensors and need the same length "
            f"(use None for an entry to leave alone)"
        )


def _global_shape_with_dim(
    local: torch.Tensor, mesh: DeviceMesh, layout: Placement, dim_size: int | None
) -> torch.Size | None:
    """Global shape of ``local`` sharded by ``layout``, when the sharded dim's size is known.

    DTensor infers a sharded dim's global size as ``local_size * mesh_size``, which is
    wrong for uneven shards (10 features on 4 ranks are local 3, 3, 3, 1). A caller that
    knows the true size (a Linear knows its ``in_features``) passes it as ``dim_size``.
    """
    if dim_size is None or not isinstance(layout, Shard):
        return None
    shape = list(local.shape)
    shape[layout.dim % local.ndim] = dim_size
    return torch.Size(shape)


def to_dtensor(
    value: torch.Tensor,
    mesh: DeviceMesh,
    layout: Placement,
    *,
    sharded_dim_size: int | None = None,
) -> DTensor:
    """Annotate a local tensor as a DTensor with ``layout`` (no communication).

    A DTensor passes through unchanged. ``sharded_dim_size`` gives the global size of
    the sharded dim when the caller knows it, so uneven shards keep their global shape.
    """
    if isinstance(value, DTensor):
        return value
    shape = _global_shape_with_dim(value, mesh, layout, sharded_dim_size)
    if shape is None:
        return DTensor.from_local(value, mesh, (layout,), run_check=False)
    stride = _contiguous_stride(shape)
    return DTensor.from_local(
        value, mesh, (layout,), run_check=False, shape=shape, stride=stride
    )


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def _with_positive_dim(layout: Placement, ndim: int) -> Placement:
    if type(layout) is Shard and layout.dim < 0:
        return Shard(layout.dim + ndim)
    return layout


def redistribute_to(value: DTensor, layout: Placement) -> DTensor:
    """Redistribute ``value`` to the single-mesh-axis ``layout`` if it is not already there.

    ``Shard(-1)`` and ``Shard(ndim - 1)`` are the same layout: no redistribution.
    """
    layout = _with_positive_dim(layout, value.ndim)
    if tuple(value.placements) == (layout,):
        return value
    return value.redistribute(placements=(layout,), async_op=True)


def finish_output(value: DTensor, use_local_output: bool) -> torch.Tensor:
    """Hand a DTensor back to the user's code: its local shard, or the DTensor itself."""
    return value.to_local() if use_local_output else value
