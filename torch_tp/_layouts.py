"""Layouts shared by every package of torch_tp: the ``torch.chunk`` shard rule and the two
moves between plain tensors and DTensors.

* :func:`shard_bounds` / :func:`shard_sizes`: which slice of a dim each rank holds under
  ``Shard`` (``torch.chunk``'s rule: 10 over 4 ranks is 3, 3, 3, 1). ``torch_tp.parallel``
  (uneven shards, ``explain_plan``) and ``torch_tp.conv`` (halo geometry) both use it.
* :func:`to_dtensor` *annotates* a plain local tensor as a DTensor with a known layout
  (no communication); :func:`redistribute_to` *redistributes* a DTensor to the layout the
  next computation needs; :func:`finish_output` hands a DTensor back to user code.

Every style's forward hooks reduce to these moves. The functions are module-level (the
styles bind them with keyword :func:`functools.partial`) so that ``torch.compile``
traces them without graph breaks. :func:`same_input` says whether two inputs are one value
(siblings sharing one gather). :func:`agreed_dtensor` annotates a plain tensor that claims
to be this rank's shard only after the ranks agree on it (the sizes of the collectives that
follow come from it). :func:`inner_tensors` lists the plain tensors that hold a local shard's
data (a tensor subclass's, such as int8 ``qdata`` + ``scale``), for what counts or copies its
storage. This module imports only :mod:`torch_tp._agreement` from torch_tp.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_global_tensor_info
from torch.distributed.tensor.placement_types import Placement

from torch_tp._agreement import Fact, check_on_every_rank

__all__ = [
    "agreed_dtensor", "shard_bounds", "shard_sizes", "to_dtensor", "redistribute_to", "finish_output", "replace_forward",
    "same_input", "inner_tensors", "packed_dtensor",
]


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s data: itself, or a wrapper subclass's inner
    tensors (``__tensor_flatten__``; recursively).

    Example::

        >>> x = torch.ones(2)
        >>> inner_tensors(x)[0] is x
        True
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return [inner for name in names for inner in inner_tensors(getattr(tensor, name))]
    return [tensor]


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


def packed_dtensor(local: torch.Tensor, mesh: DeviceMesh, placement: Placement, shape) -> DTensor:
    """Label this rank's pieces of a packed tensor (a packed shard: its slice of each part) with
    the global ``shape``, which ``from_local`` cannot infer from local sizes.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> packed_dtensor(y_local, mesh, _StridedShard(1, split_factor=2), (2, 8, 12))
    """
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, (placement,), run_check=False, shape=torch.Size(shape), stride=stride)


def agreed_dtensor(
    value: torch.Tensor, mesh: DeviceMesh, layout: Placement, *, sharded_dim_size: int | None = None, what: str
) -> DTensor:
    """:func:`to_dtensor`, after every rank agrees when ``value`` is a plain tensor claiming to be
    this rank's ``Shard``: the global shape each rank infers and the dtype are the same, and with
    ``sharded_dim_size`` known this rank's piece has its ``torch.chunk`` size. One all-gather of
    8 bytes per rank (:func:`torch_tp._agreement.check_on_every_rank`, a runtime check); a
    difference raises ``ValueError`` on every rank, naming ``what``, before the collectives whose
    sizes come from it (a Rowwise all-reduce, a sequence all-gather) could abort or hang.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> agreed_dtensor(torch.ones(2, 9), mesh, Shard(1), sharded_dim_size=16, what="RowwiseParallel on 'wo'")
        ValueError: RowwiseParallel on 'wo': this rank's input has size 9 along its sharded dim 1, ...
    """
    if not isinstance(value, DTensor) and isinstance(layout, Shard):
        check_on_every_rank(
            mesh.get_group(), partial(_shard_facts, value, mesh, layout, sharded_dim_size, what),
            what=what, at_runtime=True,
        )
    return to_dtensor(value, mesh, layout, sharded_dim_size=sharded_dim_size)


def _shard_facts(value: torch.Tensor, mesh: DeviceMesh, layout: Shard, size: int | None, what: str) -> list[Fact]:
    d = layout.dim % value.ndim
    if size is not None and type(layout) is Shard:
        expected = shard_sizes(size, mesh.size())[mesh.get_local_rank()]
        if value.shape[d] != expected:
            raise ValueError(
                f"{what}: this rank's input has size {value.shape[d]} along its sharded dim {d}, but this "
                f"rank's shard of {size} is {expected} (torch.chunk over {mesh.size()} ranks); pass each "
                f"rank its own chunk"
            )
    shape = list(value.shape)
    shape[d] = size if size is not None else value.shape[d] * mesh.size()
    return [
        Fact("inputs, as one sharded tensor, have different shapes", tuple(shape),
             f"every rank must pass its shard of one tensor, the other dims equal; a plain tensor is read "
             f"as an even shard (dim {d}: this rank's size x {mesh.size()}, as DTensor.from_local reads it), "
             f"so strips of a length the ranks do not divide are refused: pad dim {d} to a multiple of "
             f"{mesh.size()}, or pass a DTensor (DTensor.from_local(..., shape=...) states uneven strips)"),
        Fact("inputs have different dtypes", str(value.dtype), "pass the same dtype on every rank"),
    ]


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

    Synchronous: every caller's next op needs the result. (An async redistribute hands user
    code an ``AsyncCollectiveTensor``; in torch 2.13 one that enters a ``torch.compile``d
    module, as an embedding's output enters the first compiled block, breaks its backward:
    ``Redistribute.backward`` gets a plain tensor.)
    """
    layout = _with_positive_dim(layout, value.ndim)
    if tuple(value.placements) == (layout,):
        return value
    return value.redistribute(placements=(layout,))


def finish_output(value: DTensor, use_local_output: bool) -> torch.Tensor:
    """Hand a DTensor back to the user's code: its local shard, or the DTensor itself.

    The local shard supports in-place ops (a model's ``out.add_(...)`` on a Rowwise output):
    ``DTensor.to_local()`` returns a view made inside an autograd Function, which autograd
    forbids modifying in place. (Traced by ``torch.compile``, ``to_local()`` is kept.)
    """
    if not use_local_output:
        return value
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return value.to_local()
    return _LocalShard.apply(value)


class _LocalShard(torch.autograd.Function):
    """``DTensor.to_local()`` whose output is not a view autograd tracks; the backward wraps the
    gradient back into the DTensor's layout, as upstream's."""

    @staticmethod
    def forward(ctx, value: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = value._spec
        return value._local_tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:  # type: ignore[override]
        # The gradient's own strides, not the output's: a gradient that arrives transposed (the
        # output was transposed after this layer, an MLP-Mixer's token MLP) labelled with the
        # output's contiguous strides breaks the next view in the layer's backward.
        spec = ctx.spec
        _, stride = compute_global_tensor_info(grad, spec.mesh, spec.placements)
        return DTensor.from_local(grad, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                  stride=tuple(stride))


def replace_forward(module: torch.nn.Module, forward, **bound) -> None:
    """Run ``forward(module, *args, **bound)`` in place of ``module``'s own ``forward``.

    The one way torch_tp swaps a forward (fused overlap layers, vocab-parallel embeddings,
    expert styles, checkpointed blocks): a module-level function bound by keyword, set on the instance, which
    ``nn.Module.__call__`` prefers to the class's method (hooks still run around it).

    Example::

        >>> layer = torch.nn.Linear(2, 2)
        >>> replace_forward(layer, lambda module, x, *, scale: x * scale, scale=2.0)
        >>> layer(torch.ones(2)).tolist()
        [2.0, 2.0]
    """
    module.forward = partial(forward, module, **bound)


def same_input(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two inputs are one value: the same tensor, or views of the same memory.

    Full backward hooks (``CommDebugMode``'s module tracker) hand every module call an alias
    of its input, so object identity alone would split a group that reads one input. While
    ``torch.compile`` traces, memory cannot be inspected and the traced objects are compared.
    Sibling layers that share one gather use it (``overlap=True``, ``comm_dtype=torch.int8``).

    Example::

        >>> x = torch.ones(2, 3)
        >>> same_input(x, x.view(2, 3)), same_input(x, x.clone())
        (True, False)
    """
    if a is b:
        return True
    if type(a) is not type(b) or torch.compiler.is_compiling():
        return False
    if isinstance(a, DTensor):
        if a.placements != b.placements or a.device_mesh != b.device_mesh:
            return False
        a, b = a._local_tensor, b._local_tensor
    if a.device.type == "meta" or (a.dtype, a.shape, a.stride()) != (b.dtype, b.shape, b.stride()):
        return False
    return a.storage_offset() == b.storage_offset() and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
