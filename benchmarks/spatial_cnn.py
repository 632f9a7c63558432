"""Spatial parallelism on a whole U-Net: step time, activation memory per rank, halo bytes.

Command (spawns gloo CPU ranks once, runs world sizes 1, 2 and 4 side by side, prints tables)::

    python3 benchmarks/spatial_cnn.py                   # 1x3x256x1024 image, 10 timed rounds (~1-2 min)
    python3 benchmarks/spatial_cnn.py --quick           # 1x3x32x128 image, small U-Net, 3 rounds
    python3 benchmarks/spatial_cnn.py --image 1x3x512x2048 --features 16 --depth 3
    python3 benchmarks/spatial_cnn.py --world-sizes 2   # world 1 and 2 only
    python3 benchmarks/spatial_cnn.py --transposed      # 2x2 stride-2 transposed convolutions up
    torchrun --nproc-per-node 4 benchmarks/spatial_cnn.py   # world 1 and the launcher's 4 ranks

The model is the zoo's :func:`torch_tp.models.cnn.unet` (two 3x3 ConvBN+ReLU per level, 2x2
max pooling down, bilinear upsampling up (``--transposed``: transposed convolutions), skip
connections concatenated, a 1x1 convolution to per-pixel logits) in training mode, on one
large image. World 1 is that model in one process,
not parallelized. World ``w`` > 1 is ``parallelize_module(model, mesh, SpatialParallel(dim=3))``
on a mesh of ranks ``0 .. w-1``: each rank feeds its ``torch.chunk`` width strip of the image
(a contiguous copy: a rank holds only its strip), every layer runs on width strips, and the
rank gets back its strip of the logits. The step is ``cross_entropy`` of the logits against a
per-pixel class map (world ``w``: each rank's strip summed, divided by the image's pixels, so
the strips' losses add up to the image's mean loss) and its backward; gradients are cleared
first, no optimizer step. At world > 1 the parameters are replicated and their gradients come
back ``Partial(sum)``: the sum over the ranks happens when they are read (an optimizer step, or
``full_tensor()``), so the step timed here does not include it.

All world sizes run in one launch of ``max(world sizes)`` ranks: rank ``r`` takes part in the
worlds larger than ``r`` and skips the others, so the world sizes can be timed in interleaved
rounds, under the same machine load. Every rank computes with one thread (on CPU), so world
``w`` uses ``w`` threads; with fewer cores than ranks the ranks share cores.

Before anything is measured, every world's step is checked against world 1's, on float64 copies
of the model and image (in float32 a max-pool or ReLU decision near a tie may flip between two
correct programs, e.g. when the halo overlap convolves a strip's borders apart from its
interior): the loss of the image (the strips' losses summed over the mesh) with
``assert_close`` at float32 tolerance (``TOL``); the script fails rather than measure a wrong
model. The largest parameter-gradient difference is reported alongside. What is measured and
timed afterwards runs in float32.

Tables (``per rank`` cells list rank 0 first; other cells are the most any rank had):

Step time
    ``loss``: the image's loss; ``loss Δ``, ``grads max Δ``: absolute differences from world 1
    (all three from the float64 check).
    ``step ms``: median wall time of one step (forward + backward). Warm-up rounds first; then
    each round runs every world once, in an order rotated every round, a barrier before each
    step, GC off; a step's time is the longest of its ranks'. ``p25-p75``: the quartiles.
    ``speedup``: world 1's median over this world's. ``CPU ms``: median main-thread CPU time
    of a step (the busiest rank's): compute plus Python and DTensor dispatch, without waiting
    for other ranks (on CPU, backward runs in the calling thread).

Activation memory per rank
    ``saved MiB``: bytes of the tensors autograd saves for backward during the forward (the
    loss included), counted with ``torch.autograd.graph.saved_tensors_hooks``: each distinct
    storage once, its whole storage (a view keeps its base alive); for a DTensor the storage
    of its local tensor; parameters and buffers left out (the same at every world size).
    ``vs world 1``: that over world 1's. ``goal``: the issue's targets, ``<= 0.6`` at world 2
    and ``<= 0.35`` at world 4, and whether this run met them. ``whole MiB``: the part of
    ``saved MiB`` held in *whole* tensors: DTensors whose local width is the global width
    (gathered, not a strip; the last table says where). ``largest MiB``: the largest tensor
    any op returned on the rank during one step (forward and backward), seen below DTensor
    (a ``TorchDispatchMode``): local compute, halo-padded strips, and the buffers of
    redistributions and collectives, which the saved bytes do not show; ``largest vs
    world 1`` the ratio. The reading names the op and module that returned it.

Communication per step (world > 1)
    ``halo KiB``: bytes this rank handed to send ops of ``dist.batch_isend_irecv`` over one
    forward + backward (:func:`torch_tp.testing.record_p2p`), per rank. ``conv halo KiB``:
    the part sent inside the ``nn.Conv2d`` layers (during their forward, and while autograd
    runs their output's backward node). ``conv formula KiB``: the sum of the conv layers'
    formula (below). ``pool+upsample KiB``: the part sent inside the pooling, upsampling and
    transposed-convolution layers, the same way. ``AG instead KiB``: what gathering each conv's
    input instead would move per rank (below), summed; ``AG/halo``: that over the busiest
    rank's ``conv halo KiB``. ``collectives``, ``coll KiB``: the collectives of one step (c10d
    and functional collectives below DTensor, counted by a ``TorchDispatchMode``: ``AG``
    all-gather, ``AR`` all-reduce, ``RS`` reduce-scatter, ``A2A`` all-to-all, ...; the
    ``record_p2p`` sends left out) and the bytes of their input tensors, the most any rank had.

Conv layers (world > 1, one row per ``nn.Conv2d``)
    ``input``: the conv's global input ``CxHxW``; ``layout``: its placement (a ``Shard(3)``
    strip, or whole). ``halo fwd KiB``: ``halo_bytes(conv_windows(W, w, ...), direction=
    "forward")`` with ``slice_numel = N*C*H``, per rank; ``measured fwd``: sent during the
    conv's forward. ``halo f+b KiB``: ``2 * forward + backward``: the backward exchanges the
    input again (the weight gradient reads the strip) and, when the input needs a gradient
    (not for the first conv, whose input is the image), sends the halo gradients back
    (``direction="backward"``); ``measured f+b``: sent in forward and backward. The formula
    is that of a ``Shard(3)`` input; a whole input exchanges nothing. ``AG f+b KiB``: the
    all-gather alternative, ``(w-1)/w`` of the input's bytes forward, and again as the
    reduce-scatter of its gradient when it needs one. ``equal``: measured f+b == formula on
    every rank.

Whole activations (world > 1; a line saying "none" when there are none)
    saved tensors that are whole, grouped by the innermost module running and the torch
    function that saved them (``<root>`` is ``UNet.forward`` itself: the skip ``cat``), the
    most tensors any rank saved there and the bytes per rank.

All world sizes share one launch, so the world-1 step runs on rank 0 while the other ranks wait
in the next step's barrier; compare ``--world-sizes 1`` (world 1 alone) to see what that costs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import textwrap
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torch_tp import SpatialParallel, parallelize_module
from torch_tp.conv import conv_windows, halo_bytes
from torch_tp.launch import rank_device
from torch_tp.models.cnn import unet
from torch_tp.testing import TOL, record_p2p

# _driver.py and _measure.py are next to this script, whose directory running it (python3 or
# torchrun) puts first on sys.path; spawned ranks inherit sys.path.
from _driver import RunConfig, benchmark_arguments, finish_arguments, markdown_table, progress  # noqa: E402
from _driver import report_header, require_for_each_world, run_world, world_sizes  # noqa: E402
from _measure import tensor_bytes, time_interleaved

# ------------------------------------------------------------------------ configuration

DIM = 3  # width of NCHW: the sharded dim
CLASSES = 3
GOALS = {2: 0.6, 4: 0.35}  # issue 14: saved activations per rank vs world 1
MIB, KIB = 2**20, 2**10


@dataclass(frozen=True)
class Sizes:
    """Image and U-Net sizes of one run."""

    image: tuple[int, int, int, int]  # N, C, H, W
    features: int  # channels of the first level (doubling per level)
    depth: int  # pooling levels
    transposed: bool = False  # transposed convolutions instead of bilinear upsampling


DEFAULT = Sizes(image=(1, 3, 256, 1024), features=8, depth=2)
QUICK = Sizes(image=(1, 3, 32, 128), features=4, depth=2)


@dataclass(frozen=True)
class Config(RunConfig):
    sizes: Sizes
    worlds: tuple[int, ...]  # world sizes > 1; world 1 always runs (on rank 0)


def batch(sizes: Sizes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The image and its per-pixel class map (seeded: the same on every rank)."""
    gen = torch.Generator().manual_seed(1)
    n, c, h, w = sizes.image
    image = torch.randn(n, c, h, w, generator=gen)
    target = torch.randint(0, CLASSES, (n, h, w), generator=gen)
    return image.to(device), target.to(device)


# ---------------------------------------------------------------------------- one world


class World:
    """One world size as this rank sees it: the model, its inputs and its step (if it takes part)."""

    def __init__(self, world: int, reference: nn.Module, image: torch.Tensor, target: torch.Tensor,
                 mesh: DeviceMesh | None):
        self.world, self.mesh = world, mesh
        self.rank = dist.get_rank()
        self.member = self.rank < world
        self.pixels = target.numel()
        if not self.member:
            return
        model = copy.deepcopy(reference)
        if world == 1:
            self.model, self.image, self.target = model, image, target
        else:
            self.model = parallelize_module(model, mesh, SpatialParallel(dim=DIM))
            # a rank holds only its strip: contiguous copies, not views of the whole image
            self.image = image.chunk(world, dim=DIM)[self.rank].contiguous()
            self.target = target.chunk(world, dim=DIM - 1)[self.rank].contiguous()
        self.model.train()

    def loss(self) -> torch.Tensor:
        logits = self.model(self.image)
        if self.world == 1:
            return F.cross_entropy(logits, self.target)
        return F.cross_entropy(logits, self.target, reduction="sum") / self.pixels  # this strip's share

    def step(self) -> torch.Tensor | None:
        """One training step's compute (gradients cleared first); this rank's loss, or None."""
        if not self.member:
            return None
        self.model.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        return loss.detach()

    def whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The image's loss from the strips' (a collective over this world's mesh)."""
        if self.world == 1:
            return loss
        loss = loss.clone()
        dist.all_reduce(loss, group=self.mesh.get_group())
        return loss


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (no copy), else the tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def is_whole(t: torch.Tensor) -> bool:
    """A DTensor of an image-shaped activation whose local part spans the whole width."""
    return (isinstance(t, DTensor) and t.ndim == 4 and t.shape[DIM] > 1
            and t._local_tensor.shape[DIM] == t.shape[DIM])


# ------------------------------------------------------------------------------ memory


class FunctionName(TorchFunctionMode):
    """The torch function running, outermost (``conv2d``, ``batch_norm``, ``cat``, ...)."""

    def __init__(self):
        super().__init__()
        self.current = "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        outer, self.current = self.current, getattr(func, "__name__", str(func))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = outer


def running_node() -> str:
    """Outside any module's forward: the autograd node running (backward), else the loss."""
    node = torch._C._current_autograd_node()
    return f"backward of {node.name()}" if node is not None else "<loss>"


class LargestLocalTensor(TorchDispatchMode):
    """The largest tensor any op below DTensor returned: local ops, the halo-padded strips,
    the buffers of redistributions and collectives included."""

    def __init__(self, where: Callable[[], str]):
        super().__init__()
        self.where = where
        self.largest = (0, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs it as local ops, which come back here
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            # sharding propagation and shape checks build fake and meta tensors of the global shape: no memory
            if (type(t) in (torch.Tensor, nn.Parameter) and not t.is_meta
                    and t.numel() * t.element_size() > self.largest[0]):
                self.largest = (t.numel() * t.element_size(), f"{self.where()} {func._overloadpacket.__name__}")
        return out


@contextmanager
def module_stack(model: nn.Module) -> Iterator[list[str]]:
    """A list holding the labels of the modules whose forward is running, innermost last."""
    stack: list[str] = []
    handles = []
    for path, module in model.named_modules():
        label = f"{path or '<root>'} ({type(module).__name__})"
        handles.append(module.register_forward_pre_hook(lambda *_, label=label: stack.append(label)))
        # a forward hook that returns something replaces the output: pop, return None
        handles.append(module.register_forward_hook(lambda *_: None if stack.pop() else None))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


def measure_memory(run: World) -> dict:
    """Saved-for-backward bytes of one forward (and the loss), the whole part by where, and the
    largest tensor an op returned in that step (forward and backward)."""
    model = run.model
    held = {local(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    storages: dict[int, tuple[int, bool, str]] = {}  # data_ptr -> (bytes, whole, where)
    with module_stack(model) as stack:
        names = FunctionName()
        biggest = LargestLocalTensor(lambda: stack[-1] if stack else running_node())

        def pack(t):
            storage = local(t).untyped_storage()
            key = storage.data_ptr()
            if key not in held and key not in storages and storage.nbytes():
                where = f"{stack[-1] if stack else '<loss>'} {names.current}"
                storages[key] = (storage.nbytes(), is_whole(t), where)
            return t

        model.zero_grad(set_to_none=True)
        with biggest:
            with saved_tensors_hooks(pack, lambda t: t), names:
                loss = run.loss()
            loss.backward()  # frees what was saved
    model.zero_grad(set_to_none=True)
    whole: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for nbytes, is_whole_, where in storages.values():
        if is_whole_:
            whole[where][0] += 1
            whole[where][1] += nbytes
    return {
        "saved": sum(nbytes for nbytes, _, _ in storages.values()),
        "whole": sum(nbytes for nbytes, w, _ in storages.values() if w),
        "whole_by": dict(whole),
        "largest": biggest.largest[0],
        "largest_where": biggest.largest[1],
    }


# -------------------------------------------------------------------------- halo bytes


# the layers that exchange halos in a U-Net: their P2P bytes are attributed to them
HALO_LAYERS = (nn.Conv2d, nn.ConvTranspose2d, nn.MaxPool2d, nn.AvgPool2d, nn.Upsample)


@contextmanager
def layer_scopes(model: nn.Module, records: list) -> Iterator[dict[str, list[dict]]]:
    """Per call of each halo layer (``HALO_LAYERS``): its input geometry, and the spans of
    ``records`` (a :func:`record_p2p` list) filled during its forward and while autograd runs
    its output's backward node (the layer's one op: convolution, pooling, upsampling)."""
    calls: dict[str, list[dict]] = defaultdict(list)
    handles = []

    def pre_hook(module, args, path):
        x = args[0]
        call = {"type": type(module).__name__, "fwd": [len(records)], "bwd": []}
        if isinstance(module, nn.Conv2d):
            call.update(
                shape=list(x.shape), kernel=module.kernel_size[1], stride=module.stride[1],
                padding=module.padding[1], dilation=module.dilation[1],
                needs_grad=x.requires_grad, element_size=x.element_size(),
                sharded=isinstance(x, DTensor) and tuple(x.placements) == (Shard(DIM),),
            )
        calls[path].append(call)

    def post_hook(module, args, out, path):
        call = calls[path][-1]
        call["fwd"].append(len(records))
        out.grad_fn.register_prehook(lambda *_: call["bwd"].append(len(records)))
        out.grad_fn.register_hook(lambda *_: call["bwd"].append(len(records)))

    for path, module in model.named_modules():
        if isinstance(module, HALO_LAYERS):
            handles.append(module.register_forward_pre_hook(lambda m, a, p=path: pre_hook(m, a, p)))
            handles.append(module.register_forward_hook(lambda m, a, o, p=path: post_hook(m, a, o, p)))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def sent_in(records: list, span: list[int]) -> int:
    start, stop = span
    return sum(nbytes for kind, _, nbytes in records[start:stop] if kind == "send")


def measure_halos(run: World) -> dict:
    """Bytes this rank sends in one step: in all, per conv layer (forward, forward + backward), and
    per type of the other halo layers (pooling, upsampling)."""
    with record_p2p() as records, layer_scopes(run.model, records) as calls:
        run.step()
    convs, others = {}, defaultdict(int)
    for path, per_call in calls.items():
        for call in per_call:
            if len(call["bwd"]) != 2:
                raise RuntimeError(f"{path}: its backward node ran {len(call['bwd']) // 2} times, expected once")
        fwd = sum(sent_in(records, call["fwd"]) for call in per_call)
        total = fwd + sum(sent_in(records, call["bwd"]) for call in per_call)
        if per_call[0]["type"] == "Conv2d":
            if len(per_call) != 1:
                raise RuntimeError(f"{path}: the conv ran {len(per_call)} times in one forward; the table expects once")
            convs[path] = {**{k: v for k, v in per_call[0].items() if k not in ("fwd", "bwd", "type")},
                           "measured_fwd": fwd, "measured_total": total}
        else:
            others[per_call[0]["type"]] += total
    return {"sent": sum(n for kind, _, n in records if kind == "send"), "convs": convs, "others": dict(others)}


def formula(conv: dict, world: int) -> dict:
    """Per-rank halo bytes of a ``Shard(3)`` input from :func:`conv_windows` / :func:`halo_bytes`,
    and what an all-gather of the input (plus the reduce-scatter of its gradient) would move."""
    n, c, h, w = conv["shape"]
    windows = conv_windows(w, world, kernel_size=conv["kernel"], stride=conv["stride"],
                           padding=conv["padding"], dilation=conv["dilation"])
    kw = dict(slice_numel=n * c * h, element_size=conv["element_size"])
    fwd = halo_bytes(windows, **kw, direction="forward")
    bwd = halo_bytes(windows, **kw, direction="backward") if conv["needs_grad"] else [0] * world
    input_bytes = n * c * h * w * conv["element_size"]
    gather = input_bytes * (world - 1) // world * (2 if conv["needs_grad"] else 1)
    return {"fwd": fwd, "total": [2 * f + b for f, b in zip(fwd, bwd)], "gather": gather}


COLLECTIVE_NAMES = (  # op name prefixes (c10d and functional collectives) -> abbreviation
    ("allreduce", "AR"), ("all_reduce", "AR"), ("allgather", "AG"), ("_allgather", "AG"), ("all_gather", "AG"),
    ("reduce_scatter", "RS"), ("_reduce_scatter", "RS"), ("alltoall", "A2A"), ("all_to_all", "A2A"),
    ("broadcast", "BC"), ("reduce_", "R"), ("shard_dim_alltoall", "A2A"),
)
NOT_COLLECTIVES = ("wait_tensor", "send", "recv_", "recv_any_source_", "barrier", "monitored_barrier_")


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives (c10d and functional) of the ops below DTensor, with the bytes of
    their input tensors; point-to-point ops (the halos, counted apart) are left out.

    ``CommDebugMode`` does this too, but its module tracker loses count when a module runs twice
    in one forward (the U-Net's one ``pool``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = defaultdict(int)
        self.input_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn the op into local ops and collectives
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional", "_dtensor"):
            name = func._overloadpacket.__name__
            short = next((abbr for prefix, abbr in COLLECTIVE_NAMES if name.startswith(prefix)), None)
            if name not in NOT_COLLECTIVES:
                self.counts[short or name] += 1
                # c10d's gather/scatter ops take (outputs, inputs, ...); the others the input first
                source = args[1] if func.namespace == "c10d" and short in ("AG", "RS", "A2A") else args[0]
                self.input_bytes += tensor_bytes(source)
        return out


def format_counts(counts: dict[str, int]) -> str:
    """``{"AR": 12, "AG": 3}`` -> ``"3AG+12AR"``."""
    return "+".join(f"{n}{name}" for name, n in sorted(counts.items()) if n) or "0"


def measure_collectives(run: World) -> dict:
    """Collectives of one step and the bytes of their input tensors."""
    with CollectiveCounter() as mode:
        run.step()
    return {"counts": dict(mode.counts), "bytes": mode.input_bytes}


# ----------------------------------------------------------------------- per-rank driver


def gradient_difference(model: nn.Module, reference: nn.Module | None) -> float | None:
    """Largest |Δ| of any parameter gradient from ``reference``'s (on the rank that has it).

    Every rank of the model's mesh calls it: a DTensor gradient's ``full_tensor()`` may be a
    collective.
    """
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    if reference is None:
        return None
    return max((g - ref.grad).abs().max().item() for g, ref in zip(grads, reference.parameters()))


def rank_main(config: Config) -> None:
    """Entry point on every rank: check, measure and time every world; rank 0 writes the rows."""
    device = rank_device()
    if device.type == "cpu":
        torch.set_num_threads(1)  # one thread per rank: world w computes on w threads
    rank = dist.get_rank()
    worlds = (1, *config.worlds)
    meshes = {w: DeviceMesh(device.type, list(range(w))) for w in config.worlds}  # every rank builds each
    torch.manual_seed(0)
    s = config.sizes
    reference = unet(s.image[1], CLASSES, width=s.features, depth=s.depth, transposed=s.transposed).to(device)
    image, target = batch(s, device)
    runs = {w: World(w, reference, image, target, meshes.get(w)) for w in worlds}

    # 1. every world's loss and gradients equal the single-process model's (world 1, on rank 0),
    # in float64: in float32 a max-pool or ReLU decision near a tie may flip between two correct
    # programs (a different but exact summation order, e.g. the halo overlap's split convolution)
    checks = {w: World(w, copy.deepcopy(reference).double(), image.double(), target, meshes.get(w)) for w in worlds}
    ref_loss = checks[1].step()
    ref_model = checks[1].model if rank == 0 else None
    shared = [ref_loss.item() if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    results: dict[int, dict] = {}
    for w in worlds:
        run = checks[w]
        if not run.member:
            continue
        loss = run.whole_loss(run.step())
        torch.testing.assert_close(loss.item(), shared[0], **TOL,
                                   msg=lambda m, w=w: f"world {w}: loss differs from the single-process model: {m}")
        grads = gradient_difference(run.model, ref_model)
        results[w] = {"loss": loss.item(), "loss_diff": abs(loss.item() - shared[0]), "grads_diff": grads}

    # 2. memory, halo bytes and collectives of one step (untimed)
    for w in worlds:
        run = runs[w]
        if not run.member:
            continue
        progress(f"world {w}: measuring memory and communication ...")
        results[w]["memory"] = measure_memory(run)
        if w > 1:
            results[w]["halos"] = measure_halos(run)
            results[w]["collectives"] = measure_collectives(run)

    # 3. step times: every world once per round, in a rotated order
    progress(f"timing {config.iters} rounds after {config.warmup} warm-up ...")
    times = time_interleaved({w: runs[w].step for w in worlds}, config.iters, config.warmup)
    for w in worlds:
        if runs[w].member:
            results[w]["wall_s"] = [wall for wall, _ in times[w]]
            results[w]["cpu_s"] = [cpu for _, cpu in times[w]]
            params = runs[w].model.parameters()
            results[w]["param_bytes"] = sum(local(p).numel() * local(p).element_size() for p in params)

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if rank == 0:
        with open(config.result_path, "w") as f:
            json.dump(assemble(everyone, worlds), f)


def assemble(per_rank: list[dict], worlds: tuple[int, ...]) -> list[dict]:
    """One row per world from every rank's results (rank 0's check, the worst rank's bytes and times)."""
    rows = []
    for w in worlds:
        ranks = [per_rank[r][w] for r in range(w)]
        first = ranks[0]
        row = {
            "world": w, "loss": first["loss"], "loss_diff": first["loss_diff"], "grads_diff": first["grads_diff"],
            # a step lasts until its slowest rank is done
            "wall_s": [max(r["wall_s"][i] for r in ranks) for i in range(len(first["wall_s"]))],
            "cpu_s": [max(r["cpu_s"][i] for r in ranks) for i in range(len(first["cpu_s"]))],
            "param_bytes": first["param_bytes"],
            "memory": [r["memory"] for r in ranks],
        }
        if w > 1:
            row["halos"] = [r["halos"] for r in ranks]
            row["collectives"] = first["collectives"]
            row["collectives_bytes"] = max(r["collectives"]["bytes"] for r in ranks)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ report

STEP_COLUMNS = ("world", "loss", "loss Δ", "grads max Δ", "step ms", "p25-p75", "speedup", "CPU ms")
MEMORY_COLUMNS = ("world", "saved MiB per rank", "saved MiB", "vs world 1", "goal", "whole MiB",
                  "largest MiB", "largest vs world 1")
COMM_COLUMNS = ("world", "halo KiB", "conv halo KiB", "conv formula KiB", "pool+upsample KiB", "AG instead KiB",
                "AG/halo", "collectives", "coll KiB")
CONV_COLUMNS = ("world", "conv", "k s p", "input", "layout", "halo fwd KiB", "measured fwd", "halo f+b KiB",
                "measured f+b", "AG f+b KiB", "equal")
WHOLE_COLUMNS = ("world", "where (module, function)", "saved tensors", "MiB per rank")


def mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def kib(n: float) -> str:
    return f"{n / KIB:.1f}"


def per_rank(values: list[float], fmt) -> str:
    return "/".join(fmt(v) for v in values)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "inf"


def times(a: float, b: float) -> str:
    return f"{a / b:.1f}" if b else "inf"


def goal_cell(world: int, value: float) -> str:
    if world not in GOALS:
        return "-"
    return f"<= {GOALS[world]}: {'met' if value <= GOALS[world] else 'NOT met'}"


def saved(row: dict) -> int:
    return max(m["saved"] for m in row["memory"])


def largest(row: dict) -> int:
    return max(m["largest"] for m in row["memory"])


def step_cells(row: dict, base: dict) -> tuple[str, ...]:
    q1, _, q3 = statistics.quantiles(row["wall_s"], n=4)
    median = statistics.median(row["wall_s"])
    grads = "-" if row["world"] == 1 else f"{row['grads_diff']:.1e}"
    return (str(row["world"]), f"{row['loss']:.6f}", f"{row['loss_diff']:.1e}", grads,
            f"{median * 1e3:.1f}", f"{q1 * 1e3:.1f}-{q3 * 1e3:.1f}",
            f"{statistics.median(base['wall_s']) / median:.2f}", f"{statistics.median(row['cpu_s']) * 1e3:.1f}")


def memory_cells(row: dict, base: dict) -> tuple[str, ...]:
    w = row["world"]
    return (str(w), per_rank([m["saved"] for m in row["memory"]], mib), mib(saved(row)),
            ratio(saved(row), saved(base)), goal_cell(w, saved(row) / saved(base)),
            mib(max(m["whole"] for m in row["memory"])), mib(largest(row)), ratio(largest(row), largest(base)))


def conv_rows(row: dict) -> list[dict]:
    """Per conv layer: geometry, the formula and the measured bytes of every rank."""
    w = row["world"]
    out = []
    for path, conv in row["halos"][0]["convs"].items():
        f = formula(conv, w)
        measured_fwd = [h["convs"][path]["measured_fwd"] for h in row["halos"]]
        measured_total = [h["convs"][path]["measured_total"] for h in row["halos"]]
        out.append({"path": path, "conv": conv, "formula": f, "measured_fwd": measured_fwd,
                    "measured_total": measured_total, "equal": measured_total == f["total"]
                    and measured_fwd == f["fwd"]})
    return out


def conv_cells(row: dict) -> list[tuple[str, ...]]:
    cells = []
    for c in conv_rows(row):
        conv, f = c["conv"], c["formula"]
        n, ch, h, wd = conv["shape"]
        cells.append((
            str(row["world"]), c["path"], f"{conv['kernel']} {conv['stride']} {conv['padding']}",
            f"{ch}x{h}x{wd}", "Shard(3)" if conv["sharded"] else "whole",
            per_rank(f["fwd"], kib), per_rank(c["measured_fwd"], kib),
            per_rank(f["total"], kib), per_rank(c["measured_total"], kib),
            kib(f["gather"]), "yes" if c["equal"] else "no",
        ))
    return cells


def comm_totals(row: dict) -> dict:
    convs = conv_rows(row)
    w = row["world"]
    return {
        "sent": [h["sent"] for h in row["halos"]],
        "others": [sum(h["others"].values()) for h in row["halos"]],
        "conv_sent": [sum(c["measured_total"][r] for c in convs) for r in range(w)],
        "formula": [sum(c["formula"]["total"][r] for c in convs) for r in range(w)],
        "gather": sum(c["formula"]["gather"] for c in convs),
    }


def comm_cells(row: dict) -> tuple[str, ...]:
    t = comm_totals(row)
    return (str(row["world"]), per_rank(t["sent"], kib), per_rank(t["conv_sent"], kib), per_rank(t["formula"], kib),
            per_rank(t["others"], kib), kib(t["gather"]), times(t["gather"], max(t["conv_sent"])),
            format_counts(row["collectives"]["counts"]),
            kib(row["collectives_bytes"]))


def whole_cells(rows: list[dict]) -> list[tuple[str, ...]]:
    cells = []
    for row in rows:
        if row["world"] == 1:
            continue
        groups = sorted({where for m in row["memory"] for where in m["whole_by"]})
        for where in groups:
            per = [m["whole_by"].get(where, [0, 0]) for m in row["memory"]]
            cells.append((str(row["world"]), where, str(max(n for n, _ in per)), per_rank([b for _, b in per], mib)))
    return cells


def paragraph(text: str, indent: str = "  ") -> list[str]:
    return [*textwrap.wrap(text, width=100, subsequent_indent=indent), ""]


def reading(rows: list[dict], cpus: int, load: float) -> list[str]:
    """What the tables say, from the numbers."""
    base = rows[0]
    lines = ["Reading:", ""]
    lines += paragraph(
        f"- Loss: every world size matches the single-process model (largest |Δ| "
        f"{max(r['loss_diff'] for r in rows):.1e}, checked at rtol=atol=1e-5 before measuring).")
    t1, c1 = statistics.median(base["wall_s"]), statistics.median(base["cpu_s"])
    b_q3 = statistics.quantiles(base["wall_s"], n=4)[2]
    parts = []
    for r in rows[1:]:
        t, c = statistics.median(r["wall_s"]), statistics.median(r["cpu_s"])
        q1, _, q3 = statistics.quantiles(r["wall_s"], n=4)
        b_q1 = statistics.quantiles(base["wall_s"], n=4)[0]
        clear = "" if q3 < b_q1 or q1 > b_q3 else ", quartiles overlapping world 1's"
        parts.append(f"world {r['world']} {t * 1e3:.0f} ms ({t1 / t:.2f}x{clear}; the busiest rank computes "
                     f"{c * 1e3:.0f} ms of CPU, {c / c1:.2f}x world 1's {c1 * 1e3:.0f} ms, for 1/{r['world']} "
                     f"of the image)")
    crowded = [r["world"] for r in rows if r["world"] > cpus]
    note = (f" World {', '.join(map(str, crowded))} runs more ranks than the {cpus} CPUs: its ranks share cores."
            if crowded else "")
    lines += paragraph(f"- Step time (1-min load average {load:.1f} before starting: other jobs share the CPUs): "
                       f"world 1 {t1 * 1e3:.0f} ms; " + "; ".join(parts) + f".{note}")
    for row in rows[1:]:
        w = row["world"]
        r = saved(row) / saved(base)
        whole = max(m["whole"] for m in row["memory"])
        goal = GOALS.get(w)
        verdict = (f"goal <= {goal}: {'met' if r <= goal else 'NOT met'}" if goal is not None else "no goal set")
        text = (f"- World {w}: each rank saves {mib(saved(row))} MiB for backward, {r:.3f}x world 1's "
                f"{mib(saved(base))} MiB (an even split would be {1 / w:.3f}x); {verdict}. ")
        if whole:
            top = sorted(((max(m["whole_by"].get(k, [0, 0])[1] for m in row["memory"]), k)
                          for k in {k for m in row["memory"] for k in m["whole_by"]}), reverse=True)
            text += (f"{mib(whole)} MiB of it is whole (unsharded) tensors, "
                     f"{whole / saved(row):.0%} of the rank's saved bytes; without them the rank would save "
                     f"{(saved(row) - whole) / saved(base):.3f}x. They come from: "
                     + "; ".join(f"{k} {mib(b)} MiB" for b, k in top[:6]) + ". ")
        else:
            text += "No saved tensor is whole: every saved activation is a strip. "
        text += (f"Largest tensor of the step: {mib(largest(row))} MiB, {largest(row) / largest(base):.3f}x world 1's "
                 f"{mib(largest(base))} MiB ({base['memory'][0]['largest_where']}), from "
                 f"{max(row['memory'], key=lambda m: m['largest'])['largest_where']}.")
        lines += paragraph(text)
    for row in rows[1:]:
        w = row["world"]
        convs = conv_rows(row)
        t = comm_totals(row)
        sharded = [c for c in convs if c["conv"]["sharded"]]
        equal = sum(c["equal"] for c in sharded)
        whole_in = [c["path"] for c in convs if not c["conv"]["sharded"]]
        others = {kind: max(h["others"].get(kind, 0) for h in row["halos"])
                  for kind in sorted({k for h in row["halos"] for k in h["others"]})}
        lines += paragraph(
            f"- World {w} communication: the convolutions send {kib(max(t['conv_sent']))} KiB per step on the "
            f"busiest rank, {times(t['gather'], max(t['conv_sent']))}x less than gathering their inputs would "
            f"({kib(t['gather'])} KiB); measured equals halo_bytes for {equal} of the {len(sharded)} conv layers "
            f"with a Shard(3) input"
            + (f"; {len(whole_in)} conv layers get a whole input and exchange nothing ({', '.join(whole_in)})"
               if whole_in else "")
            + ". The other halo layers send " + ", ".join(f"{kind} {kib(b)} KiB" for kind, b in others.items())
            + f" (busiest rank). Collectives of the step: {format_counts(row['collectives']['counts'])}, "
              f"{kib(row['collectives_bytes'])} KiB handed to them. Not in the step: the sum of the "
              f"Partial(sum) parameter gradients ({kib(row['param_bytes'])} KiB of parameters), which an "
              f"optimizer step would all-reduce: about {kib(2 * (w - 1) / w * row['param_bytes'])} KiB sent per "
              f"rank in a ring.")
    return lines


def format_report(rows: list[dict], options: argparse.Namespace, config: Config) -> str:
    s = config.sizes
    n, c, h, w = s.image
    base = rows[0]
    cpus = os.cpu_count() or 1
    spatial = [r for r in rows if r["world"] > 1]
    parts = [
        report_header(options, ranks="1 thread per rank"),
        f"U-Net: features {s.features}, depth {s.depth}, {CLASSES} classes, BatchNorm in training mode, "
        f"{'transposed convolutions' if s.transposed else 'bilinear upsampling'}; image N={n} C={c} H={h} W={w} "
        f"float32 ({n * c * h * w * 4 / MIB:g} MiB); "
        f"world > 1: SpatialParallel(dim=3) on the whole model, width strips",
        "",
        "Step time (forward + backward)",
        markdown_table(STEP_COLUMNS, [step_cells(r, base) for r in rows]),
        "",
        "Activation memory per rank (saved for backward; parameters excluded)",
        markdown_table(MEMORY_COLUMNS, [memory_cells(r, base) for r in rows]),
    ]
    if spatial:
        parts += [
            "",
            "Communication per step (per rank, rank 0 first)",
            markdown_table(COMM_COLUMNS, [comm_cells(r) for r in spatial]),
            "",
            "Conv layers: halo bytes per rank, formula vs measured (k s p: kernel, stride, padding on the width)",
            markdown_table(CONV_COLUMNS, [cell for r in spatial for cell in conv_cells(r)]),
        ]
        whole = whole_cells(rows)
        parts += ["", "Whole (unsharded) activations saved for backward"]
        parts += [markdown_table(WHOLE_COLUMNS, whole)] if whole else ["none: every saved activation is a strip"]
    parts += ["", *reading(rows, cpus, options.load_before)]
    return "\n".join(parts).rstrip()


# -------------------------------------------------------------------------------- main


def parse_image(text: str) -> tuple[int, int, int, int]:
    try:
        dims = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"--image takes NxCxHxW, e.g. 1x3x256x1024, got {text!r}")
    return dims


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_arguments(__file__, __doc__, iters=(10, 3), warmup=(2, 1), what="world size",
                                 quick="a 1x3x32x128 image, small U-Net, few rounds",
                                 min_iters=2)  # quartiles need two samples
    parser.add_argument("--image", type=parse_image, default=None,
                        help=f"NxCxHxW (default {'x'.join(map(str, DEFAULT.image))}; "
                             f"{'x'.join(map(str, QUICK.image))} with --quick)")
    parser.add_argument("--features", type=int, default=None,
                        help=f"U-Net channels of the first level (default {DEFAULT.features}; "
                             f"{QUICK.features} with --quick)")
    parser.add_argument("--depth", type=int, default=None,
                        help=f"U-Net pooling levels (default {DEFAULT.depth}; {QUICK.depth} with --quick)")
    parser.add_argument("--transposed", action="store_true",
                        help="upsample with 2x2 stride-2 transposed convolutions instead of bilinear upsampling")
    options = finish_arguments(parser, argv)
    base = QUICK if options.quick else DEFAULT
    options.sizes = Sizes(
        image=options.image or base.image,
        features=options.features or base.features,
        depth=options.depth if options.depth is not None else base.depth,
        transposed=options.transposed,
    )
    options.worlds = tuple(sorted({w for w in world_sizes(options.world_sizes) if w > 1}))
    _, _, h, w = options.sizes.image
    scale = 2 ** options.sizes.depth
    if h % scale or w % scale:
        parser.error(f"--image height and width must be multiples of 2**depth = {scale}")
    require_for_each_world(parser, options.worlds, lambda world: None if w // scale >= 2 * world else (
        f"the deepest level is {w // scale} wide; want at least 2 columns per rank"))
    return options


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    config = Config(options.sizes, options.worlds, iters=options.iters, warmup=options.warmup)
    nproc = max((1, *config.worlds))
    progress(f"{nproc} ranks: world sizes {', '.join(map(str, (1, *config.worlds)))} in one launch ...")
    start = time.perf_counter()
    rows = run_world(rank_main, nproc, config)
    progress(f"done in {time.perf_counter() - start:.1f} s")
    if rows:
        print(format_report(rows, options, config))


if __name__ == "__main__":
    main()
