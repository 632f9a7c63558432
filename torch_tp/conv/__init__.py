"""torch_tp.conv: convolution with its input sharded along a spatial dim (halo exchange).

The foundation of spatially sharded convolution: :func:`conv_windows` says, per rank, which
border slices its outputs need from the ranks beside it (pure integer math; a halo wider
than the neighbour's strip continues into the next ranks'), and :func:`halo_exchange` moves
them between the ranks of a process group or mesh dim,
with the exact adjoint as its backward. :func:`halo_bytes` gives the bytes each rank sends.
:func:`install` / :func:`uninstall` / :func:`sharded_convolution` put DTensor handlers for
``aten.convolution`` and its backward in place that use them, ordinary and transposed (see
:mod:`torch_tp.conv.sharded_conv`, :mod:`torch_tp.conv.transposed_conv`).
:class:`SpatialParallel` (and :func:`torch_tp.functional.spatial`) run whole convolution
layers on spatial shards with them (:mod:`torch_tp.conv.spatial`), and BatchNorm in training
mode with the statistics of the whole batch through :mod:`torch_tp.conv.batch_norm`'s
handlers (:func:`sharded_batch_norm`), and max / average pooling with halos
(:func:`sharded_pooling`, :mod:`torch_tp.conv.pooling`), GroupNorm with the whole image's
statistics (:func:`sharded_group_norm`) and DTensor rules for the activations it lacks
(:func:`sharded_pointwise`, :mod:`torch_tp.conv.pointwise`), and upsampling and transposed
convolution on strips (:func:`sharded_upsampling`, :mod:`torch_tp.conv.upsample`,
:mod:`torch_tp.conv.transposed_conv`), and constant padding that keeps a padded strip sharded
(:func:`sharded_padding`, :mod:`torch_tp.conv.padding`: an even kernel's ``padding="same"``),
and spatial means over uneven strips without a gather (:func:`sharded_mean`,
:mod:`torch_tp.conv.global_mean`).

Importing this package changes no DTensor behaviour, and neither does a spatial model for the
DTensor code beside it: each handler module owns one handler set of the registry
(:mod:`torch_tp.conv._registry`), a ``SpatialParallel`` model holds the sets it needs while it
lives, and their handlers run only inside it; the shared helpers are :mod:`torch_tp.conv._core`.

Example::

    >>> from torch_tp.conv import conv_windows, halo_bytes
    >>> windows = conv_windows(30, 4, kernel_size=5, padding=2)
    >>> halo_bytes(windows, slice_numel=16, element_size=4)  # 16 = batch * channels
    [128, 256, 256, 128]
"""

from torch_tp.conv._geometry import ShardWindow, conv_windows, resolve_padding
from torch_tp.conv._region_ops import UnsupportedSpatialOpError
from torch_tp.conv.batch_norm import batch_norm_backward_handler, batch_norm_handler, sharded_batch_norm
from torch_tp.conv.global_mean import sharded_mean
from torch_tp.conv.group_norm import group_norm_backward_handler, group_norm_handler, sharded_group_norm
from torch_tp.conv.halo import halo_bytes, halo_exchange
from torch_tp.conv.padding import sharded_padding
from torch_tp.conv.pointwise import sharded_pointwise
from torch_tp.conv.pooling import sharded_pooling
from torch_tp.conv import sharded_conv as _sharded_conv
from torch_tp.conv import transposed_conv as _transposed_conv
from torch_tp.conv._registry import public_functions as _public_functions
from torch_tp.conv.sharded_conv import convolution_backward_handler, convolution_handler, halo_overlap, overlaps_halos
from torch_tp.conv.spatial import SpatialParallel, check_spatial
from torch_tp.conv.transposed_conv import transposed_convolution_handler
from torch_tp.conv.upsample import sharded_upsampling

# ordinary and transposed convolution share aten.convolution: one switch for both sets
install, uninstall, is_installed, sharded_convolution = _public_functions(
    (_sharded_conv.HANDLERS, _transposed_conv.HANDLERS), "torch_tp.conv", "sharded_convolution",
    "convolution (ordinary and transposed)")

__all__ = [
    "ShardWindow",
    "UnsupportedSpatialOpError",
    "batch_norm_backward_handler",
    "batch_norm_handler",
    "sharded_batch_norm",
    "SpatialParallel",
    "check_spatial",
    "conv_windows",
    "convolution_backward_handler",
    "convolution_handler",
    "halo_bytes",
    "halo_exchange",
    "halo_overlap",
    "install",
    "is_installed",
    "overlaps_halos",
    "resolve_padding",
    "sharded_convolution",
    "sharded_group_norm",
    "sharded_mean",
    "sharded_padding",
    "sharded_pointwise",
    "group_norm_handler",
    "group_norm_backward_handler",
    "sharded_pooling",
    "sharded_upsampling",
    "transposed_convolution_handler",
    "uninstall",
]
