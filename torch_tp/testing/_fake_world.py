"""One rank of a large world, in this process: PyTorch's fake process group, held against predicted bytes.

:func:`fake_world_memory` initializes the ``"fake"`` backend
(``torch.testing._internal.distributed.fake_pg``: every collective returns at once, moving
nothing, so values are meaningless but shapes, placements and the memory each rank holds are
exactly those of a real world of that size), applies a plan as a real job would, runs one
training step, and compares the parameter bytes the rank holds with what
:func:`torch_tp.explain_plan` / :func:`torch_tp.predict_placements` say for that rank on a
``meta`` copy. The process group is destroyed before it returns, even on an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_tp._layouts import inner_tensors
from torch_tp.tools.predict import DEFAULT_MIN_WEIGHT_SIZE

__all__ = ["FakeWorldMemory", "fake_world_memory"]

_WHERE = "torch_tp.testing.fake_world_memory"


@dataclass(frozen=True)
class FakeWorldMemory:
    """What one rank of a fake world held, next to what the plan's prediction says it holds.

    ``held_bytes`` counts the storages of the rank's local parameter shards (a tensor
    subclass by its inner tensors: int8 ``qdata`` + float32 ``scale``; a storage shared by
    several parameters once); ``shard_bytes`` their elements times element sizes (equal
    unless a shard keeps a larger storage alive, or FSDP2 pads it); ``predicted_bytes`` the
    prediction's bytes for this rank. ``graph_breaks`` and ``graphs`` are dynamo's counts of
    the compiled step (``None`` when not compiled); ``peak_allocated_bytes`` the CUDA
    allocator's peak over build, parallelize and step (``None`` off CUDA).

    Example::

        >>> m = FakeWorldMemory(8, 0, {"tp": 8}, "cpu", 96, 96, 96, {"w": 96}, {"w": 96})
        >>> m.matches(), m.mismatches()
        (True, [])
    """

    world_size: int
    rank: int
    mesh_axes: dict[str, int]
    device: str
    held_bytes: int
    shard_bytes: int
    predicted_bytes: int
    held_by_parameter: dict[str, int] = field(repr=False)
    predicted_by_parameter: dict[str, int] = field(repr=False)
    graph_breaks: int | None = None
    graphs: int | None = None
    peak_allocated_bytes: int | None = None

    def mismatches(self) -> list[str]:
        """``"path: held X B, predicted Y B"`` for each parameter whose shard differs from its prediction."""
        return [
            f"{path}: held {held} B, predicted {self.predicted_by_parameter.get(path)} B"
            for path, held in self.held_by_parameter.items()
            if held != self.predicted_by_parameter.get(path)
        ]

    def matches(self) -> bool:
        """Whether the held bytes (by storage and by shard) equal the prediction, parameter by parameter."""
        return self.held_bytes == self.shard_bytes == self.predicted_bytes and not self.mismatches()


def fake_world_memory(
    build_model: Callable[[], nn.Module],
    plan: Any,
    world_size: int = 8,
    *,
    inputs: torch.Tensor | Sequence[torch.Tensor],
    rank: int = 0,
    device: str | torch.device = "cpu",
    compile_backend: str | None = None,
    fullgraph: bool = True,
    dp: int = 1,
    fsdp_patterns: str | list[str] | None = None,
    min_weight_size: int = DEFAULT_MIN_WEIGHT_SIZE,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> FakeWorldMemory:
    """Run rank ``rank`` of a ``world_size``-rank job in this process and compare its parameter bytes with the prediction.

    ``build_model()`` is called twice: under ``torch.device(device)`` for the job (after
    ``torch.manual_seed(0)``, inside ``torch.random.fork_rng``, so the caller's random state is
    untouched), and under ``torch.device("meta")`` for the prediction; quantize inside it
    (``quantize_weights(model)``, before the plan applies, as a real job does). The fake
    process group (backend ``"fake"``) is initialized as rank ``rank``; the plan is applied with
    :func:`torch_tp.parallelize_module` on a 1-D mesh of ``world_size`` (``dp=1``), or on the
    ``("dp", "tp")`` mesh ``(dp, world_size // dp)`` followed by
    :func:`torch_tp.fully_shard_by_pattern` (``fsdp_patterns``, ``min_weight_size``). One
    forward of ``inputs`` (moved to ``device``) and, if any parameter requires a gradient, one
    backward of ``loss_fn(output)`` (default: the local output's float sum) follow, under
    ``torch.compile(backend=compile_backend, fullgraph=fullgraph)`` when a backend is given
    (dynamo is reset before and after). The held bytes are read after the step.

    Keyword Args:
        inputs: the model's positional inputs (a tensor or a sequence of tensors).
        rank (int): which rank of the world this process plays.
        device (str or torch.device): where the job's model lives (``"cuda"`` on a GPU).
        compile_backend (str, optional): ``"eager"``, ``"aot_eager"``, ``"inductor"``; ``None``: eager.
        fullgraph (bool): ``torch.compile``'s; ``False`` lets dynamo break graphs and count them.
        dp (int): the data-parallel axis size; ``world_size`` must divide by it.
        fsdp_patterns, min_weight_size: :func:`torch_tp.fully_shard_by_pattern`'s (``dp > 1`` only).
        loss_fn (callable, optional): the scalar to differentiate, from the model's output.

    Returns:
        a :class:`FakeWorldMemory`; ``result.matches()`` says whether the prediction held.

    Raises:
        RuntimeError: a default process group is already initialized in this process (the
            fake one would replace it); call it where none is (the pytest parent, a fresh
            script), or ``dist.destroy_process_group()`` first.
        ValueError: ``world_size``, ``rank``, ``dp`` or ``fsdp_patterns`` do not fit together.

    .. note:: Values computed under the fake process group are meaningless (a collective
       leaves its output as it was); shapes, placements, held memory, graph breaks and the
       peak CUDA memory are those of the real rank.

    Example::

        >>> from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
        >>> args = ModelArgs(dim=32, n_layers=1, n_heads=8, vocab_size=64, ffn_hidden=64, max_seq_len=8)
        >>> result = fake_world_memory(lambda: Transformer(args), tensor_parallel_plan(sequence_parallel=True), 8,
        ...                            inputs=torch.zeros(1, 8, dtype=torch.long), rank=7)
        >>> result.held_bytes == result.predicted_bytes, result.mesh_axes
        (True, {'tp': 8})
    """
    device = torch.device(device)
    axes = _mesh_axes(world_size, rank, dp, fsdp_patterns)
    _require_no_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    predicted = _predicted_bytes(build_model, plan, axes, rank, fsdp_patterns, min_weight_size)
    _clear_sharding_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with _random_state_kept(device), _dynamo_reset(compile_backend is not None):
            peak = _reset_peak(device)
            model = _parallel_model(build_model, plan, axes, device, fsdp_patterns, min_weight_size)
            graph_breaks, graphs = _step(model, inputs, device, compile_backend, fullgraph, loss_fn)
            held, shard_bytes, by_parameter = _held_bytes(model)
            peak = _peak(device) if peak else None
    finally:
        dist.destroy_process_group()
        _clear_sharding_caches()
    return FakeWorldMemory(
        world_size, rank, axes, str(device), held, shard_bytes, sum(predicted.values()), by_parameter, predicted,
        graph_breaks, graphs, peak,
    )


def _mesh_axes(world_size: object, rank: object, dp: object, fsdp_patterns: object) -> dict[str, int]:
    for name, value in (("world_size", world_size), ("rank", rank), ("dp", dp)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{_WHERE}({name}={value!r}): must be an int")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{_WHERE}(world_size={world_size}, rank={rank}): rank must be in 0 .. world_size - 1")
    if dp < 1 or world_size % dp:
        raise ValueError(f"{_WHERE}(world_size={world_size}, dp={dp}): the (dp, tp) mesh needs world_size divisible by dp")
    if (dp > 1) != (fsdp_patterns is not None):
        raise ValueError(
            f"{_WHERE}(dp={dp}, fsdp_patterns={fsdp_patterns!r}): FSDP over dp needs both dp > 1 and the "
            f"fsdp_patterns of its units (e.g. 'layers.*'); for tensor parallelism alone leave both out"
        )
    return {"tp": world_size} if dp == 1 else {"dp": dp, "tp": world_size // dp}


def _require_no_process_group() -> None:
    if dist.is_initialized():
        raise RuntimeError(
            f"{_WHERE}: a default process group is already initialized in this process (backend "
            f"{dist.get_backend()!r}, world size {dist.get_world_size()}); the fake one would replace it. "
            f"Call it in a process without one (the pytest parent, not a run_on_ranks worker; a fresh "
            f"script), or call torch.distributed.destroy_process_group() first"
        )


def _predicted_bytes(build_model, plan, axes, rank, fsdp_patterns, min_weight_size) -> dict[str, int]:
    from torch_tp.tools import explain_plan, predict_placements

    with torch.device("meta"):
        meta_model = build_model()
    if "dp" in axes:
        report = predict_placements(meta_model, axes, plan, fsdp_patterns, min_weight_size=min_weight_size)
    else:
        report = explain_plan(meta_model, axes["tp"], plan)
    return {row.path: row.bytes_per_rank[rank] for row in report if row.name is not None}


def _clear_sharding_caches() -> None:
    """Forget DTensor's cached sharding propagations (Python and the C++ fast path's). Their keys
    hold no rank: a process is one rank for life, except here, where an entry cached as rank 0
    (the local width of an uneven shard in a ``view``) would be replayed as rank 7."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def _parallel_model(build_model, plan, axes, device, fsdp_patterns, min_weight_size) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    from torch_tp.parallel import parallelize_module
    from torch_tp.tools import fully_shard_by_pattern

    torch.manual_seed(0)
    with device:
        model = build_model()
    mesh = init_device_mesh(device.type, tuple(axes.values()), mesh_dim_names=tuple(axes))
    parallelize_module(model, mesh["tp"], plan)
    if "dp" in axes:
        fully_shard_by_pattern(model, mesh, fsdp_patterns, min_weight_size=min_weight_size)
    return model


def _step(model, inputs, device, backend, fullgraph, loss_fn) -> tuple[int | None, int | None]:
    """One forward (and backward); with a backend, dynamo's graph-break and graph counts."""
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor

    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    inputs = tuple(x.to(device) for x in inputs)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=fullgraph)
    output = run(*inputs)
    if any(p.requires_grad for p in model.parameters()):
        local = output.to_local() if isinstance(output, DTensor) else output
        loss = loss_fn(output) if loss_fn is not None else local.float().sum()
        loss.backward()
    if backend is None:
        return None, None
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def _held_bytes(model: nn.Module) -> tuple[int, int, dict[str, int]]:
    """(bytes of the distinct storages, bytes of the shards, {path: shard bytes}) of the local parameters."""
    from torch.distributed.tensor import DTensor

    storages: dict[tuple[str, int], int] = {}
    by_parameter = {}
    for path, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        inner = inner_tensors(local)
        by_parameter[path] = sum(t.numel() * t.element_size() for t in inner)
        for t in inner:
            storage = t.untyped_storage()
            storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values()), sum(by_parameter.values()), by_parameter


@contextlib.contextmanager
def _random_state_kept(device: torch.device):
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


@contextlib.contextmanager
def _dynamo_reset(compiling: bool):
    """A compile starts from a reset dynamo with cleared counters, and leaves no compiled code
    behind (its graphs name the fake process group's groups)."""
    if not compiling:
        yield
        return
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        yield
    finally:
        torch._dynamo.reset()


def _reset_peak(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return True


def _peak(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)
