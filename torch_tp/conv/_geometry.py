"""Halo geometry of a convolution whose input is sharded along one spatial dim (pure integer math).

Along the sharded dim the global input has ``in_size`` elements, split over ``num_ranks``
ranks with DTensor's ``Shard`` rule (``torch.chunk`` sizes: ``chunk = ceil(in_size /
num_ranks)``, rank ``r`` holds ``[r * chunk, min((r + 1) * chunk, in_size))``, possibly
empty). The global output has

    ``L_out = (in_size + pad_l + pad_r - dilation * (k - 1) - 1) // stride + 1``

elements, and rank ``r`` owns the outputs the same chunk rule gives it on ``L_out``, so the
output is itself a proper ``Shard`` of the global output. Output ``j`` reads the unpadded
input positions ``j * stride - pad_l + i * dilation`` for ``i < k``, so the outputs
``[a, b)`` read ``[a * stride - pad_l, (b - 1) * stride - pad_l + dilation * (k - 1) + 1)``.

:func:`conv_windows` turns that into one :class:`ShardWindow` per rank: what to receive from
and send to each other rank, how much of the received strip to trim, and how many zeros to
add at the global edges. A halo wider than the neighbour's shard (small maps, many ranks,
wide kernels) continues into the next ranks' shards ("multi-hop"); every rank derives every
rank's window from the sizes alone, so each knows what to send to whom. Nothing here touches
``torch.distributed``.

The halos are contiguous ranges, but with stride or dilation the taps need not read every
position of them (kernel 5, stride 2, dilation 2 reads only every other column): a window
then also lists, per range, the positions that are read (``recv_picks`` / ``send_picks``),
and only those travel; the positions between them stay zero in the local input, where no
tap reads them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence, Union

from torch_tp._layouts import shard_bounds

__all__ = ["ShardWindow", "conv_windows", "resolve_padding"]

Padding = Union[int, str, Sequence[int]]
_BAD_PADDING = "padding must be an int, a (left, right) pair, 'valid' or 'same', got {!r}"
_COUNTS = ("recv_left", "recv_right", "send_left", "send_right")


@dataclasses.dataclass(frozen=True)
class ShardWindow:
    """What one rank holds, owns, reads and exchanges for a convolution along a sharded dim.

    All positions are global indices along the sharded dim, half-open ``[start, stop)``.

    Fields:
        rank: position of the rank on the sharded mesh dim (``0 .. num_ranks - 1``).
        in_start, in_stop: its input shard.
        out_start, out_stop: the global outputs it owns.
        need_start, need_stop: the unpadded input positions its outputs span, from the first
            tap of its first output to the last tap of its last output; below ``0`` and from
            ``in_size`` on that is zero padding. Empty (at ``in_start``) for a rank without outputs.
        recv_left, recv_right: elements received from the ranks on the left / right: the
            ``recv_left`` positions just below ``in_start`` / the ``recv_right`` just from
            ``in_stop`` (the halos always adjoin the shard). Usually all from the immediate
            neighbour (the end of its shard / the start); when that shard is too short, the
            halo continues into the next ranks' (see the ``*_hops`` fields).
        send_left, send_right: elements sent, in total, to the ranks on the left / right:
            to each, a prefix / a suffix of its own shard. With single-hop halos that is
            the neighbour's ``recv_right`` / ``recv_left``.
        trim_left, trim_right: elements dropped from the two ends of the exchanged strip
            ``halo_left ++ own ++ halo_right`` because no owned output reads them.
        pad_left, pad_right: zeros to add at the two ends after trimming: the padding at the
            global edges, plus the real edge positions no tap reads (dilation can skip them,
            and they are then neither exchanged nor kept).
        recv_left_hops, recv_right_hops, send_left_hops, send_right_hops: the four counts
            split per hop, nearest rank first: ``recv_left_hops[h]`` elements come from rank
            ``rank - 1 - h`` (the whole shard of every rank but the farthest, the end of the
            farthest's), ``send_right_hops[h]`` go to rank ``rank + 1 + h`` (a suffix of
            the own shard), and so on; each tuple sums to its count. Filled only for a rank
            that exchanges with a rank beyond its immediate neighbours; ``()`` means the count
            is one hop. :attr:`hops` reads the split either way; ``halo_exchange`` takes its
            entries as counts (a sequence is a count per hop).
        recv_picks, send_picks: the global positions that travel, one sorted tuple per entry
            of :attr:`recv_ranges` / :attr:`send_ranges` (in that order): the positions of
            the range that the receiver's taps read. ``()`` (the default) means every
            position of every range travels; set only when some range has positions no tap
            reads (stride or dilation > 1 near a border). The positions left out are zero in
            the received halo (no owned output reads them).

    The local convolution input is therefore
    ``pad(strip[trim_left : len(strip) - trim_right], (pad_left, pad_right))``, and convolving
    it with padding 0 and the same stride and dilation gives exactly the owned outputs. The
    halos hold only needed data, so the trims cut own elements, except in the rare
    stride > 1 case where a rank's outputs read none of its own shard: then a trim may also
    cut part of a received halo (halos always adjoin the own shard).

    Example:
        >>> w = conv_windows(8, 2, kernel_size=3, padding=1)[0]
        >>> (w.in_start, w.in_stop, w.out_start, w.out_stop, w.need_start, w.need_stop)
        (0, 4, 0, 4, -1, 5)
        >>> (w.recv_left, w.recv_right, w.send_left, w.send_right, w.pad_left, w.pad_right)
        (0, 1, 0, 1, 1, 0)
        >>> w.strip_size, w.local_size, w.out_size
        (5, 6, 4)
        >>> w = conv_windows(8, 4, kernel_size=7, padding=3)[1]  # shards of 2, halos of 3
        >>> w.recv_left, w.recv_right, w.recv_right_hops
        (2, 3, (2, 1))
        >>> w.recv_ranges  # [0, 2) from rank 0, [4, 6) from rank 2, [6, 7) from rank 3
        ((0, 0, 2), (2, 4, 6), (3, 6, 7))
        >>> w.send_ranges  # to rank 0 (its right halo), 2 and 3 (their left halos)
        ((0, 2, 4), (2, 2, 4), (3, 3, 4))
        >>> w = conv_windows(16, 2, kernel_size=5, stride=2, dilation=2, padding=4)[1]
        >>> w.recv_ranges, w.recv_picks  # outputs 4.. read 4, 6, 8, ...: of [4, 8) only 4 and 6
        (((0, 4, 8),), ((4, 6),))
        >>> w.recv_left, w.recv_total
        (4, 2)
    """

    rank: int
    in_start: int
    in_stop: int
    out_start: int
    out_stop: int
    need_start: int
    need_stop: int
    recv_left: int
    recv_right: int
    send_left: int
    send_right: int
    trim_left: int
    trim_right: int
    pad_left: int
    pad_right: int
    recv_left_hops: tuple[int, ...] = ()
    recv_right_hops: tuple[int, ...] = ()
    send_left_hops: tuple[int, ...] = ()
    send_right_hops: tuple[int, ...] = ()
    recv_picks: tuple[tuple[int, ...], ...] = ()
    send_picks: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in _COUNTS:
            hops = tuple(getattr(self, f"{name}_hops"))
            if not hops:
                continue
            if any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in hops) or (
                    sum(hops) != getattr(self, name)):
                raise ValueError(
                    f"ShardWindow: {name}_hops={hops} must be ints >= 0 summing to {name}={getattr(self, name)}"
                )
            object.__setattr__(self, f"{name}_hops", hops)
        for name, ranges in (("recv_picks", self.recv_ranges), ("send_picks", self.send_ranges)):
            picks = tuple(tuple(p) for p in getattr(self, name))
            if picks and (len(picks) != len(ranges) or any(
                    list(p) != sorted(set(p)) or any(not start <= i < stop for i in p)
                    for p, (_, start, stop) in zip(picks, ranges))):
                raise ValueError(
                    f"torch_tp.conv.ShardWindow: {name}={picks} needs one sorted tuple of distinct positions "
                    f"inside each range of {ranges} (or () for every position)"
                )
            object.__setattr__(self, name, picks)

    @property
    def hops(self) -> tuple[tuple[int, ...], ...]:
        """``(recv_left, recv_right, send_left, send_right)`` per hop, nearest rank first
        (``(3,)``: all from / to the immediate neighbour; ``()``: nothing)."""
        return tuple(
            getattr(self, f"{name}_hops") or ((getattr(self, name),) if getattr(self, name) else ())
            for name in _COUNTS
        )

    @property
    def recv_ranges(self) -> tuple[tuple[int, int, int], ...]:
        """``(rank, start, stop)`` of every global input range received, in strip order: what
        this rank needs from every other rank (each range lies in that rank's shard)."""
        recv_left, recv_right, _, _ = self.hops
        left, stop = [], self.in_start
        for h, count in enumerate(recv_left):
            left.append((self.rank - 1 - h, stop - count, stop))
            stop -= count
        right, start = [], self.in_stop
        for h, count in enumerate(recv_right):
            right.append((self.rank + 1 + h, start, start + count))
            start += count
        return tuple(r for r in left[::-1] + right if r[1] < r[2])

    @property
    def send_ranges(self) -> tuple[tuple[int, int, int], ...]:
        """``(rank, start, stop)`` of every global range of the own shard sent, ranks ascending."""
        _, _, send_left, send_right = self.hops
        left = [(self.rank - 1 - h, self.in_start, self.in_start + c) for h, c in enumerate(send_left)]
        right = [(self.rank + 1 + h, self.in_stop - c, self.in_stop) for h, c in enumerate(send_right)]
        return tuple(r for r in left[::-1] + right if r[1] < r[2])

    @property
    def recv_total(self) -> int:
        """Slices that travel to this rank: the picked positions, else ``recv_left + recv_right``."""
        if self.recv_picks:
            return sum(len(p) for p in self.recv_picks)
        return self.recv_left + self.recv_right

    @property
    def send_total(self) -> int:
        """Slices this rank sends: the receivers' picked positions, else ``send_left + send_right``."""
        if self.send_picks:
            return sum(len(p) for p in self.send_picks)
        return self.send_left + self.send_right

    @property
    def in_size(self) -> int:
        """Length of the rank's input shard."""
        return self.in_stop - self.in_start

    @property
    def out_size(self) -> int:
        """Number of outputs the rank owns (0 means: skip the local convolution)."""
        return self.out_stop - self.out_start

    @property
    def strip_size(self) -> int:
        """Length of ``halo_left ++ own ++ halo_right`` (what the halo exchange returns)."""
        return self.recv_left + self.in_size + self.recv_right

    @property
    def local_size(self) -> int:
        """Length of the local convolution input: the trimmed strip plus the edge zeros."""
        return self.strip_size - self.trim_left - self.trim_right + self.pad_left + self.pad_right

    def halo_free_span(self) -> tuple[int, int]:
        """``[a, b)`` of the local convolution input that holds no received position: the own
        shard's kept slices with the edge zeros next to them. Outside it (``[0, a)`` and
        ``[b, local_size)``) lie the kept parts of the left / right halo.

        Example:
            >>> w = conv_windows(8, 2, kernel_size=3, padding=1)[0]  # local input: 0 ++ own(4) ++ 1 halo
            >>> w.halo_free_span(), w.local_size
            ((0, 5), 6)
        """
        kept_left = max(0, self.recv_left - self.trim_left)  # left-halo slices the trim keeps
        kept_right = max(0, self.recv_right - self.trim_right)
        a = self.pad_left + kept_left if kept_left else 0
        b = self.local_size - self.pad_right - kept_right if kept_right else self.local_size
        return a, b

    def interior_outputs(self, stride: int, span: int) -> tuple[int, int]:
        """``[j0, j1)``: the owned outputs (local indices) whose taps read no halo, so they can
        be computed while the halos are in flight. ``span`` is ``dilation * (kernel_size - 1)``.
        Empty (``j0 == j1``) when every output reads a halo.

        Example:
            >>> w = conv_windows(16, 2, kernel_size=3, padding=1)[1]  # 1 halo column, then own(8) ++ 0
            >>> w.interior_outputs(stride=1, span=2)                 # output 0 reads the halo
            (1, 8)
        """
        a, b = self.halo_free_span()
        j0 = min(-(-a // stride), self.out_size)
        j1 = max(j0, min(self.out_size, (b - 1 - span) // stride + 1 if b - 1 - span >= 0 else 0))
        return j0, j1


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"conv_windows needs a positive int {name}, got {value!r}")


def resolve_padding(
    padding: Padding, *, kernel_size: int, stride: int = 1, dilation: int = 1
) -> tuple[int, int]:
    """``(left, right)`` zeros of one spatial dim, validated against the supported range.

    ``padding`` is an int, a ``(left, right)`` pair, ``"valid"`` (0) or ``"same"`` (torch's
    rule, stride 1 only: ``total = dilation * (k - 1)``, ``left = total // 2``, the extra zero on
    the right). Each side must lie in ``0 .. dilation * (k - 1)``: more would add outputs that
    read nothing but zeros.

    Example:
        >>> resolve_padding("same", kernel_size=4, dilation=1)
        (1, 2)
        >>> resolve_padding(2, kernel_size=3, dilation=2)
        (2, 2)
        >>> resolve_padding(3, kernel_size=3)
        Traceback (most recent call last):
        ValueError: sharded convolution supports padding 0..dilation*(kernel_size-1) = 0..2 ...
    """
    span = dilation * (kernel_size - 1)
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0)
        if padding != "same":
            raise ValueError(_BAD_PADDING.format(padding))
        if stride != 1:
            raise ValueError(f"padding='same' needs stride 1 (torch refuses it too), got stride={stride}")
        return (span // 2, span - span // 2)
    pair = (padding, padding) if isinstance(padding, int) else tuple(padding)
    if len(pair) != 2 or not all(isinstance(p, int) and not isinstance(p, bool) for p in pair):
        raise ValueError(_BAD_PADDING.format(padding))
    if not all(0 <= p <= span for p in pair):
        raise ValueError(
            f"sharded convolution supports padding 0..dilation*(kernel_size-1) = 0..{span} on each "
            f"side (kernel_size={kernel_size}, dilation={dilation}), got {pair}"
        )
    return pair


def conv_windows(
    in_size: int,
    num_ranks: int,
    *,
    kernel_size: int,
    stride: int = 1,
    padding: Padding = 0,
    dilation: int = 1,
) -> list[ShardWindow]:
    """One :class:`ShardWindow` per rank for a convolution along a ``Shard``-ed dim.

    Keyword Args:
        kernel_size, stride, dilation: the convolution's values on this dim (positive ints).
        padding: an int, a ``(left, right)`` pair, ``"valid"`` or ``"same"`` (stride 1), each
            side in ``0 .. dilation * (kernel_size - 1)``.

    Returns:
        ``list[ShardWindow]``, indexed by the rank's position on the sharded mesh dim. The
        windows agree with each other: what rank ``r`` sends the rank ``h + 1`` to its left is
        what that rank receives from the rank ``h + 1`` to its right
        (``windows[r].hops[2][h] == windows[r - 1 - h].hops[1][h]``, and mirrored), which
        with single-hop halos is ``windows[r].send_left == windows[r - 1].recv_right`` and
        ``windows[r].send_right == windows[r + 1].recv_left``; the first rank receives
        nothing from the left and the last nothing from the right (no ring). A halo wider
        than the neighbour's shard takes that whole shard and continues into the next ones
        (empty shards pass nothing on).

    Raises:
        ValueError: a non-positive size; padding out of range or ``"same"`` with stride > 1;
            or an input too short for the dilated kernel.

    Example:
        >>> ws = conv_windows(30, 4, kernel_size=5, padding=2)  # uneven: shards 8, 8, 8, 6
        >>> [(w.recv_left, w.recv_right) for w in ws]
        [(0, 2), (2, 2), (2, 2), (2, 0)]
        >>> [(w.send_left, w.send_right) for w in ws]
        [(0, 2), (2, 2), (2, 2), (2, 0)]
        >>> ws = conv_windows(9, 4, kernel_size=2, stride=2)  # rank 3 holds no input
        >>> [(w.in_start, w.in_stop) for w in ws]
        [(0, 3), (3, 6), (6, 9), (9, 9)]
        >>> [(w.out_start, w.out_stop) for w in ws]
        [(0, 1), (1, 2), (2, 3), (3, 4)]
        >>> ws[3].recv_left, ws[3].trim_right  # output 3 reads [6, 8): receive 3, drop 1
        (3, 1)
        >>> ws = conv_windows(7, 3, kernel_size=1, stride=2)  # rank 2 owns no output ...
        >>> [(w.out_size, w.send_left) for w in ws]  # ... but sends rank 1 the input it reads
        [(2, 0), (2, 0), (0, 1)]
        >>> ws = conv_windows(5, 4, kernel_size=7, padding=3)  # shards 2, 2, 1, 0: multi-hop
        >>> [(w.recv_left, w.recv_right) for w in ws]
        [(0, 3), (2, 1), (3, 0), (0, 0)]
        >>> [w.hops for w in ws]  # (recv_left, recv_right, send_left, send_right) per hop
        [((), (2, 1), (), (2, 1)), ((2,), (1,), (2,), (2,)), ((2, 1), (), (1, 1), ()), ((), (), (), ())]
        >>> ws[2].recv_ranges  # rank 2 reads [1, 5): [1, 2) from rank 0, [2, 4) from rank 1
        ((0, 1, 2), (1, 2, 4))

    .. note::
        With stride > 1 the output chunks do not line up with the input chunks (rank ``r``
        owns outputs from ``r * ceil(L_out / num_ranks)``, which read input from about
        ``stride`` times that), so a rank's halos can be lopsided (all from one side), its
        outputs may read little or none of its own shard, and a rank may own no output at all
        while it still has to send halos. A rank with ``out_size == 0`` skips its local
        convolution but takes part in the exchange. When the drift reaches past a neighbour,
        the halo continues into the next ranks' shards like any wide halo.
    """
    _check_positive(
        in_size=in_size, num_ranks=num_ranks, kernel_size=kernel_size, stride=stride, dilation=dilation
    )
    pad_l, pad_r = resolve_padding(padding, kernel_size=kernel_size, stride=stride, dilation=dilation)
    span = dilation * (kernel_size - 1)
    out_total = (in_size + pad_l + pad_r - span - 1) // stride + 1
    if out_total < 1:
        raise ValueError(
            f"input of length {in_size} padded by ({pad_l}, {pad_r}) is shorter than the dilated "
            f"kernel span dilation*(kernel_size-1)+1 = {span + 1}; the convolution has no output"
        )
    in_chunks, out_chunks = shard_bounds(in_size, num_ranks), shard_bounds(out_total, num_ranks)
    return _chunk_windows(in_chunks, out_chunks, stride=stride, pad_l=pad_l, dilation=dilation, span=span)


def _chunk_windows(
    in_chunks: list[tuple[int, int]],
    out_chunks: list[tuple[int, int]],
    *,
    stride: int,
    pad_l: int,
    dilation: int,
    span: int,
) -> list[ShardWindow]:
    """Every rank's :class:`ShardWindow`, multi-hop halos included, for given input and output
    chunks (:func:`conv_windows` after its checks; pooling's ``ceil_mode`` outputs too).

    Example:
        >>> ws = _chunk_windows([(0, 2), (2, 4), (4, 5), (5, 5)], [(0, 2), (2, 4), (4, 5), (5, 5)],
        ...                     stride=1, pad_l=3, dilation=1, span=6)
        >>> [w.recv_ranges for w in ws]
        [((1, 2, 4), (2, 4, 5)), ((0, 0, 2), (2, 4, 5)), ((0, 1, 2), (1, 2, 4)), ()]
    """
    return list(_cached_windows(tuple(map(tuple, in_chunks)), tuple(map(tuple, out_chunks)), stride=stride,
                                pad_l=pad_l, dilation=dilation, span=span))


@functools.lru_cache(maxsize=256)
def _cached_windows(
    in_chunks: tuple[tuple[int, int], ...],
    out_chunks: tuple[tuple[int, int], ...],
    *,
    stride: int,
    pad_l: int,
    dilation: int,
    span: int,
) -> tuple[ShardWindow, ...]:
    """:func:`_chunk_windows`, computed once per geometry (each handler call asks again; the
    windows are frozen, so sharing them is safe)."""
    num_ranks = len(in_chunks)
    sizes = [stop - start for start, stop in in_chunks]
    halves = [
        _own_side(r, in_chunks, out_chunks[r], stride=stride, pad_l=pad_l, dilation=dilation, span=span)
        for r in range(num_ranks)
    ]
    recv_left = [_split(h["recv_left"], sizes[r - 1 :: -1] if r else []) for r, h in enumerate(halves)]
    recv_right = [_split(h["recv_right"], sizes[r + 1 :]) for r, h in enumerate(halves)]
    windows = []
    for r, half in enumerate(halves):
        hops = dict(  # what rank r sends the rank h + 1 away is what that rank receives from h + 1 away
            recv_left_hops=recv_left[r], recv_right_hops=recv_right[r],
            send_left_hops=_hop_column(recv_right[r - 1 :: -1] if r else []),
            send_right_hops=_hop_column(recv_left[r + 1 :]),
        )
        extra = hops if any(len(h) > 1 for h in hops.values()) else {}
        windows.append(ShardWindow(send_left=sum(hops["send_left_hops"]),
                                   send_right=sum(hops["send_right_hops"]), **half, **extra))
    taps = dict(stride=stride, pad_l=pad_l, dilation=dilation, span=span)
    return tuple(_with_picks(w, out_chunks, taps) for w in windows)


def _with_picks(w: ShardWindow, out_chunks: Sequence[tuple[int, int]], taps: dict) -> ShardWindow:
    """``w`` with ``recv_picks`` / ``send_picks`` filled where a range has positions no tap of
    its reader's outputs reads (the reader of a received range is ``w``'s rank, of a sent
    range the rank it goes to)."""
    recv = tuple(_tapped(start, stop, out_chunks[w.rank], **taps) for _, start, stop in w.recv_ranges)
    send = tuple(_tapped(start, stop, out_chunks[q], **taps) for q, start, stop in w.send_ranges)

    def sparse(picks: tuple, ranges: tuple) -> bool:
        return any(len(p) < stop - start for p, (_, start, stop) in zip(picks, ranges))

    recv = recv if sparse(recv, w.recv_ranges) else ()
    send = send if sparse(send, w.send_ranges) else ()
    return dataclasses.replace(w, recv_picks=recv, send_picks=send) if recv or send else w


def _tapped(
    lo: int, hi: int, chunk: tuple[int, int], *, stride: int, pad_l: int, dilation: int, span: int
) -> tuple[int, ...]:
    """The positions in ``[lo, hi)`` that some tap of some index ``j`` in ``chunk`` reaches:
    ``j * stride - pad_l + i * dilation``, ``0 <= i * dilation <= span`` (sorted).

    For a convolution ``chunk`` is a range of outputs and the positions are inputs they read;
    for a transposed convolution it is a range of inputs and the positions are the outputs
    they add to.

    Example:
        >>> _tapped(4, 8, (4, 8), stride=2, pad_l=4, dilation=2, span=8)  # outputs 4..7 read 4, 6, ...
        (4, 6)
        >>> _tapped(0, 6, (0, 3), stride=1, pad_l=0, dilation=2, span=2)  # 0, 1, 2 and 2, 3, 4
        (0, 1, 2, 3, 4)
    """
    first, stop = chunk
    hit: set[int] = set()
    for tap in range(0, span + 1, dilation):
        base = tap - pad_l
        j_lo = max(first, -((base - lo) // stride))  # the first j with j * stride + base >= lo
        j_hi = min(stop, -((base - hi) // stride))  # the first j with j * stride + base >= hi
        hit.update(range(j_lo * stride + base, j_hi * stride + base, stride))
    return tuple(sorted(hit))


def _split(count: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """``count`` halo elements taken from shards of ``sizes`` (nearest first): per hop, the
    whole shard until the last one, which gives the rest. ``()`` for no halo."""
    hops = []
    for size in sizes:
        if count == 0:
            break
        hops.append(min(count, size))
        count -= hops[-1]
    assert count == 0, "a halo reaches past the global edge"  # reads lie in [0, in_size)
    return tuple(hops)


def _hop_column(peers: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Entry ``h`` of the ``h``-th peer's hop tuple (nearest peer first), trailing zeros dropped."""
    column = [hops[h] if h < len(hops) else 0 for h, hops in enumerate(peers)]
    while column and column[-1] == 0:
        column.pop()
    return tuple(column)


def _own_side(
    r: int,
    in_chunks: list[tuple[int, int]],
    out_chunk: tuple[int, int],
    *,
    stride: int,
    pad_l: int,
    dilation: int,
    span: int,
) -> dict[str, int]:
    """Every :class:`ShardWindow` field of rank ``r`` but the sends (those are the readers').

    The counts are totals; :func:`_chunk_windows` splits them per hop.
    """
    in_size = in_chunks[-1][1]
    in_start, in_stop = in_chunks[r]
    out_start, out_stop = out_chunk
    fields = dict(rank=r, in_start=in_start, in_stop=in_stop, out_start=out_start, out_stop=out_stop)
    if out_stop == out_start:  # nothing to compute: receive nothing, trim the whole shard
        return dict(fields, need_start=in_start, need_stop=in_start, recv_left=0, recv_right=0,
                    trim_left=in_stop - in_start, trim_right=0, pad_left=0, pad_right=0)
    need_start = out_start * stride - pad_l
    need_stop = (out_stop - 1) * stride - pad_l + span + 1
    lo, hi = _read_range(out_chunk, in_size, stride=stride, pad_l=pad_l, dilation=dilation, span=span)
    if lo < hi:
        recv_left, recv_right = max(0, in_start - lo), max(0, hi - in_stop)
        trim_left, trim_right = lo - (in_start - recv_left), (in_stop + recv_right) - hi
    else:  # every tap lands in the padding: the outputs are bias only, the input all zeros
        lo = hi = need_stop
        recv_left = recv_right = trim_right = 0
        trim_left = in_stop - in_start
    return dict(
        fields, need_start=need_start, need_stop=need_stop, recv_left=recv_left, recv_right=recv_right,
        trim_left=trim_left, trim_right=trim_right, pad_left=lo - need_start, pad_right=need_stop - hi,
    )


def _read_range(
    out_chunk: tuple[int, int], in_size: int, *, stride: int, pad_l: int, dilation: int, span: int
) -> tuple[int, int]:
    """``[first, last + 1)`` of the real input positions (in ``[0, in_size)``) that the taps of
    outputs ``out_chunk`` read; ``(0, 0)`` if every tap lands in the padding.

    Only the first and last few outputs can have taps in the padding, so the scans stop at the
    first output whose outermost tap is real (at most ``span // stride + 1`` outputs each).
    """
    out_start, out_stop = out_chunk
    first = last = None
    for j in range(out_start, out_stop):
        base = j * stride - pad_l  # tap 0 of output j
        t = base + max(0, -(base // dilation)) * dilation  # its first tap at >= 0
        if t <= base + span and t < in_size:
            first = t if first is None else min(first, t)
        if base >= 0:
            break
    for j in range(out_stop - 1, out_start - 1, -1):
        top = j * stride - pad_l + span  # last tap of output j
        t = top - max(0, -((in_size - 1 - top) // dilation)) * dilation  # its last tap at < in_size
        if t >= top - span and t >= 0:
            last = t if last is None else max(last, t)
        if top < in_size:
            break
    return (0, 0) if first is None else (first, last + 1)
