"""Halo exchange vs all-gather for a Conv2d whose input is sharded on width.

Command (spawns gloo CPU ranks, world size 2 then 4, and prints one table)::

    python3 benchmarks/halo_conv.py                  # 6 conv shapes, 20 timed rounds (~1-2 min)
    python3 benchmarks/halo_conv.py --quick          # 3 conv shapes, smaller image, 6 rounds (~30 s)
    python3 benchmarks/halo_conv.py --iters 50       # more timed rounds
    python3 benchmarks/halo_conv.py --world-sizes 2  # one world size

Under ``torchrun --nproc-per-node N benchmarks/halo_conv.py`` the launcher's ranks are used
once (world size N).

Every row is one ``Conv2d`` (``C -> C`` channels, bias) on an ``(N, C, H, W)`` image sharded
``Shard(3)`` (width) over a 1-D mesh, run two ways:

``halo``
    the DTensor convolution with torch_tp's handlers (``torch_tp.conv.sharded_convolution()``):
    each rank receives from its neighbours the border columns its outputs read, convolves
    locally and keeps its own output chunk; the backward re-exchanges the input (the weight
    gradient needs the strip) and sends the halo gradients back to their owners.
``all-gather``
    redistribute the input to ``Replicate()`` (an all-gather), convolve the whole image on
    every rank, keep this rank's output chunk; the backward is the matching reduce-scatter of
    the input gradient.

In both, the weight and bias gradients stay per-rank partial sums (neither variant
all-reduces them), so the two do equal work apart from how the input travels. Before
anything is timed, both variants' output chunk and input-gradient shard are checked against
the single-process convolution.

Columns:

``world``           number of ranks.
``conv``            ``k`` kernel, ``s`` stride, ``d`` dilation, ``p`` padding (on both dims).
``W out``           global output width.
``halo fwd KiB``    bytes each rank sends in the forward halo exchange, rank 0 / rank 1 / ...:
                    ``halo_bytes(conv_windows(...), direction="forward")``.
``index-set fwd``   the minimum, counted independently of torch_tp's geometry: for each rank,
                    the input columns the taps of its outputs read (``j * stride - padding +
                    i * dilation`` for its ``torch.chunk`` outputs ``j`` and taps ``i``), minus
                    its own; a rank sends each reader the part of that set it holds (times
                    ``N * C * H`` elements of 4 bytes).
``measured fwd``    the same, measured: the bytes of the tensors handed to the send ops of
                    ``torch.distributed.batch_isend_irecv`` (wrapped inside every rank)
                    during one forward.
``halo f+b KiB``    forward + backward: ``2 * forward + backward`` from ``halo_bytes`` (the
                    backward exchanges the input again for the weight gradient, then sends
                    the halo gradients: ``direction="backward"``).
``index-set f+b``   the minimum of forward + backward from the same index sets: twice the
                    forward's, plus the gradients of the columns the rank received.
``measured f+b``    the same, measured over one forward plus its backward.
``AG f+b KiB``      what the all-gather path moves per rank: ``(world-1)/world`` of the input
                    bytes in the forward (all-gather) and again in the backward
                    (reduce-scatter of the input gradient).
``AG/halo``         ``AG f+b KiB`` divided by the largest rank's ``halo f+b KiB``.
``halo ms``, ``AG ms``   median wall time of one forward + backward on rank 0. Warm-up
                    rounds first; then each round runs both variants, in an order rotated
                    every round; a barrier precedes each timed step; GC is off while timing.
``AG/halo ms``      ``AG ms / halo ms`` (above 1: the halo path is faster).

A second table measures the *exposed halo time* of forward + backward: the time rank 0 is
blocked waiting on halo exchanges (each exchange's ``wait``, timed around the call: the
forward's halos, the strip exchanged again in the backward, the halo gradients sent back), in
two variants per round, interleaved:

``serial ms``, ``overlap ms``   median wall time of one forward + backward with
                    ``halo_overlap(False)`` (every exchange waited for at once) and with the
                    default ``halo_overlap(True)``: the forward convolves the interior columns
                    (those no halo reaches) while the halos are in flight, the borders after;
                    the backward computes the input gradient while the strip travels again
                    and the weight gradient while the halo gradients travel back.
``waited serial``, ``waited overlap``   median ms blocked on the exchanges: with the overlap
                    off that is every exchange whole; with it on, what compute did not cover.
``hidden``          ``1 - waited overlap / waited serial``: the share of the exposed halo time
                    the overlap removes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from torch_tp.conv import conv_windows, halo_bytes, halo_overlap, sharded_convolution
from torch_tp.conv import _halo_exchange
from torch_tp.launch import rank_device
from torch_tp.testing import record_p2p, sent_bytes

# _measure.py is next to this script, whose directory running it (python3 or torchrun) puts first
# on sys.path; spawned ranks inherit sys.path when they re-import it for ``__main__.rank_main``.
from _driver import RunConfig, markdown_table, parse_arguments, report_header, run_worlds  # noqa: E402
from _measure import time_interleaved

# ------------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class ConvShape:
    """One convolution: kernel, stride, dilation and padding on both spatial dims."""

    kernel: int
    stride: int
    dilation: int
    padding: int

    @property
    def name(self) -> str:
        return f"k{self.kernel} s{self.stride} d{self.dilation} p{self.padding}"


CONVS = (
    ConvShape(3, 1, 1, 1),
    ConvShape(5, 1, 1, 2),
    ConvShape(7, 1, 1, 3),
    ConvShape(3, 2, 1, 1),
    ConvShape(3, 1, 2, 2),
    ConvShape(5, 2, 2, 4),
)
QUICK_CONVS = (ConvShape(3, 1, 1, 1), ConvShape(7, 1, 1, 3), ConvShape(5, 2, 2, 4))

IMAGE = (2, 16, 32, 1024)  # N, C, H, W: a wide image
QUICK_IMAGE = (2, 8, 16, 512)


@dataclass(frozen=True)
class Config(RunConfig):
    image: tuple[int, int, int, int]
    convs: tuple[ConvShape, ...]


# ------------------------------------------------------------------------------ bytes


def formula_bytes(image: tuple[int, ...], conv: ConvShape, world: int, element_size: int) -> dict:
    """Per-rank halo bytes from the geometry: forward, and forward + backward."""
    n, c, h, w = image
    windows = conv_windows(w, world, kernel_size=conv.kernel, stride=conv.stride,
                           padding=conv.padding, dilation=conv.dilation)
    kw = dict(slice_numel=n * c * h, element_size=element_size)
    fwd = halo_bytes(windows, **kw, direction="forward")
    bwd = halo_bytes(windows, **kw, direction="backward")
    return {"fwd": fwd, "total": [2 * f + b for f, b in zip(fwd, bwd)]}


def index_set_bytes(image: tuple[int, ...], conv: ConvShape, world: int, element_size: int) -> dict:
    """Per-rank minimum halo bytes, forward and forward + backward, from the index sets the
    windows read (no torch_tp code: the chunk rule and the convolution's arithmetic only)."""
    n, c, h, w = image
    k, s, d, p = conv.kernel, conv.stride, conv.dilation, conv.padding
    out_w = (w + 2 * p - d * (k - 1) - 1) // s + 1

    def chunks(size: int) -> list[set[int]]:  # torch.chunk's pieces, one per rank
        step = -(-size // world)
        return [set(range(min(r * step, size), min((r + 1) * step, size))) for r in range(world)]

    ins, outs = chunks(w), chunks(out_w)
    reads = [{j * s - p + i * d for j in outs[r] for i in range(k)} & set(range(w)) for r in range(world)]
    fwd = [sum(len(reads[r] & ins[q]) for r in range(world) if r != q) for q in range(world)]
    returned = [len(reads[q] - ins[q]) for q in range(world)]
    column = n * c * h * element_size
    return {"fwd": [f * column for f in fwd], "total": [(2 * f + g) * column for f, g in zip(fwd, returned)]}


# --------------------------------------------------------------------------- variants


@dataclass
class Case:
    """The tensors of one row on this rank."""

    mesh: DeviceMesh
    conv: ConvShape
    x: torch.Tensor  # global input (same on every rank)
    weight: torch.Tensor
    bias: torch.Tensor

    def kwargs(self) -> dict:
        c = self.conv
        return dict(stride=c.stride, padding=c.padding, dilation=c.dilation)

    def halo_leaves(self) -> tuple[DTensor, DTensor, DTensor]:
        x = distribute_tensor(self.x, self.mesh, [Shard(3)]).requires_grad_()
        w = distribute_tensor(self.weight, self.mesh, [Replicate()]).requires_grad_()
        b = distribute_tensor(self.bias, self.mesh, [Replicate()]).requires_grad_()
        return x, w, b

    def gather_leaves(self) -> tuple[DTensor, torch.Tensor, torch.Tensor]:
        x = distribute_tensor(self.x, self.mesh, [Shard(3)]).requires_grad_()
        w = self.weight.detach().clone().requires_grad_()
        b = self.bias.detach().clone().requires_grad_()
        return x, w, b


def halo_step(case: Case, leaves) -> torch.Tensor:
    """Forward + backward through torch_tp's sharded convolution; returns the local output."""
    x, w, b = leaves
    for t in leaves:
        t.grad = None
    with sharded_convolution():
        y = F.conv2d(x, w, b, **case.kwargs())
        y.to_local().sum().backward()
    return y.to_local().detach()


def gather_step(case: Case, leaves) -> torch.Tensor:
    """All-gather the input, convolve the whole image, keep this rank's output chunk.

    ``to_local(grad_placements=[Partial()])``: each rank's gradient of the gathered input
    covers only its own outputs, so the backward of the gather is a reduce-scatter.
    """
    x, w, b = leaves
    for t in leaves:
        t.grad = None
    full = x.redistribute(case.mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    y = F.conv2d(full, w, b, **case.kwargs())
    rank, world = case.mesh.get_local_rank(), case.mesh.size()
    chunks = torch.chunk(y, world, dim=3)  # DTensor's Shard rule
    own = chunks[rank] if rank < len(chunks) else y.narrow(3, 0, 0)
    own.sum().backward()
    return own.detach()


class WaitClock:
    """Seconds spent blocked on halo exchanges: the forward's halos and, in the backward, the
    strip exchanged again and the halo gradients sent back (every ``wait`` of an exchange)."""

    CLASSES = (_halo_exchange.HalosInFlight, _halo_exchange.GradientsInFlight)

    def __init__(self) -> None:
        self.seconds = 0.0
        self._waits = [cls.wait for cls in self.CLASSES]

    def __enter__(self) -> "WaitClock":
        for cls, wait in zip(self.CLASSES, self._waits):
            cls.wait = self._timed(wait)
        return self

    def _timed(self, wait):
        def timed_wait(flight):
            start = time.perf_counter()
            try:
                return wait(flight)
            finally:
                self.seconds += time.perf_counter() - start

        return timed_wait

    def __exit__(self, *exc) -> None:
        for cls, wait in zip(self.CLASSES, self._waits):
            cls.wait = wait


def timed_halo_step(case: Case, leaves, overlap: bool, waits: list[float]) -> None:
    """:func:`halo_step` with the overlap on or off, recording the seconds blocked on halos."""
    with WaitClock() as clock, halo_overlap(overlap):
        halo_step(case, leaves)
    waits.append(clock.seconds)


def check_agreement(case: Case, halo, gather) -> None:
    """Both variants' output chunk and input-gradient shard equal the single-process conv's."""
    rank, world = case.mesh.get_local_rank(), case.mesh.size()
    rx = case.x.detach().clone().requires_grad_()
    ref = F.conv2d(rx, case.weight, case.bias, **case.kwargs())
    ref.sum().backward()
    ref_out, ref_gx = ref.detach().chunk(world, dim=3)[rank], rx.grad.chunk(world, dim=3)[rank]
    for name, leaves, step in (("halo", halo, halo_step), ("all-gather", gather, gather_step)):
        out = step(case, leaves)
        gx = leaves[0].grad.to_local()
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name} {case.conv.name} output: {m}")
        torch.testing.assert_close(gx, ref_gx, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name} {case.conv.name} input grad: {m}")


# ----------------------------------------------------------------------- per-rank driver


def measure_conv(conv: ConvShape, mesh: DeviceMesh, config: Config) -> dict:
    """One row (every rank computes it; rank 0's times are kept)."""
    world = mesh.size()
    n, c, h, w = config.image
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, w, generator=gen)
    weight = torch.randn(c, c, conv.kernel, conv.kernel, generator=gen) / (c * conv.kernel ** 2) ** 0.5
    bias = torch.randn(c, generator=gen)
    case = Case(mesh, conv, x, weight, bias)
    halo, gather = case.halo_leaves(), case.gather_leaves()
    check_agreement(case, halo, gather)

    with record_p2p() as forward_ops, sharded_convolution():
        y = F.conv2d(halo[0], halo[1], halo[2], **case.kwargs())
    with record_p2p() as backward_ops, sharded_convolution():
        y.to_local().sum().backward()
    forward_sent = sent_bytes(forward_ops)
    measured = [None] * world
    dist.all_gather_object(measured, (forward_sent, forward_sent + sent_bytes(backward_ops)))

    steps = {"halo": lambda: halo_step(case, halo), "all-gather": lambda: gather_step(case, gather)}
    times = time_interleaved(steps, config.iters, config.warmup)
    waits: dict[str, list[float]] = {"serial": [], "overlap": []}
    forwards = {
        "serial": lambda: timed_halo_step(case, halo, False, waits["serial"]),
        "overlap": lambda: timed_halo_step(case, halo, True, waits["overlap"]),
    }
    forward_times = time_interleaved(forwards, config.iters, config.warmup)
    input_bytes = x.numel() * x.element_size()
    return {
        "world": world,
        "conv": conv.name,
        "w_out": y.shape[3],
        "formula": formula_bytes(config.image, conv, world, x.element_size()),
        "index_sets": index_set_bytes(config.image, conv, world, x.element_size()),
        "measured": {"fwd": [m[0] for m in measured], "total": [m[1] for m in measured]},
        "ag_total": 2 * input_bytes * (world - 1) // world,
        "halo_s": [wall for wall, _ in times["halo"]],
        "gather_s": [wall for wall, _ in times["all-gather"]],
        "forward_s": {k: [wall for wall, _ in v] for k, v in forward_times.items()},
        "waited_s": {k: v[-config.iters:] for k, v in waits.items()},  # the timed rounds
    }


def rank_main(config: Config) -> None:
    """Entry point on every rank: measure every conv shape, rank 0 writes the rows as JSON."""
    world = dist.get_world_size()
    mesh = init_device_mesh(rank_device().type, (world,), mesh_dim_names=("sp",))["sp"]
    rows = [measure_conv(conv, mesh, config) for conv in config.convs]
    if dist.get_rank() == 0:
        with open(config.result_path, "w") as f:
            json.dump(rows, f)


# ------------------------------------------------------------------------------ report

COLUMNS = ("world", "conv", "W out", "halo fwd KiB", "index-set fwd", "measured fwd", "halo f+b KiB",
           "index-set f+b", "measured f+b", "AG f+b KiB", "AG/halo", "halo ms", "AG ms", "AG/halo ms")


def kib_list(values: list[int]) -> str:
    """``[4096, 8192]`` -> ``"4/8"`` (KiB per rank, rank 0 first)."""
    return "/".join(f"{v / 1024:g}" for v in values)


def table_cells(row: dict) -> tuple[str, ...]:
    halo_ms, gather_ms = (statistics.median(row[k]) * 1e3 for k in ("halo_s", "gather_s"))
    worst = max(row["formula"]["total"])
    return (
        str(row["world"]), row["conv"], str(row["w_out"]),
        kib_list(row["formula"]["fwd"]), kib_list(row["index_sets"]["fwd"]), kib_list(row["measured"]["fwd"]),
        kib_list(row["formula"]["total"]), kib_list(row["index_sets"]["total"]), kib_list(row["measured"]["total"]),
        f"{row['ag_total'] / 1024:g}", f"{row['ag_total'] / worst:.1f}" if worst else "inf",
        f"{halo_ms:.2f}", f"{gather_ms:.2f}", f"{gather_ms / halo_ms:.2f}",
    )


OVERLAP_COLUMNS = ("world", "conv", "serial ms", "overlap ms", "waited serial", "waited overlap", "hidden")


def overlap_cells(row: dict) -> tuple[str, ...]:
    serial, overlap = (statistics.median(row["forward_s"][k]) * 1e3 for k in ("serial", "overlap"))
    waited_serial, waited_overlap = (statistics.median(row["waited_s"][k]) * 1e3 for k in ("serial", "overlap"))
    hidden = 1 - waited_overlap / waited_serial if waited_serial > 0 else float("nan")
    return (
        str(row["world"]), row["conv"], f"{serial:.2f}", f"{overlap:.2f}", f"{waited_serial:.3f}",
        f"{waited_overlap:.3f}", f"{hidden:.2f}",
    )


def format_report(rows: list[dict], options: argparse.Namespace, config: Config) -> str:
    n, c, h, w = config.image
    return "\n".join([
        report_header(options),
        f"Conv2d {c}->{c}, input N={n} C={c} H={h} W={w} float32 ({n * c * h * w * 4 / 2**20:g} MiB), "
        f"sharded Shard(3) on width",
        "",
        markdown_table(COLUMNS, [table_cells(row) for row in rows]),
        "",
        "Exposed halo time of forward + backward (rank 0, median ms blocked on halo exchanges):",
        "",
        markdown_table(OVERLAP_COLUMNS, [overlap_cells(row) for row in rows]),
    ])


# -------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    options = parse_arguments(argv, __file__, __doc__, iters=(20, 6), warmup=(3, 1), what="conv shape",
                              quick="3 conv shapes on a smaller image, few rounds")
    config = Config(QUICK_IMAGE if options.quick else IMAGE, QUICK_CONVS if options.quick else CONVS,
                    iters=options.iters, warmup=options.warmup)
    rows = run_worlds(rank_main, config, options.world_sizes, f"{len(config.convs)} conv shapes")
    if rows:
        print(format_report(rows, options, config))


if __name__ == "__main__":
    main()
