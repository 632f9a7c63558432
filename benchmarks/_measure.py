"""Measurement utilities of ``compare_upstream.py``: collectives, parameter bytes, hook CPU, timing.

Nothing here knows the benchmark's plans or variants: a *step* is a zero-argument callable,
and the dicts of steps, modules and plans are keyed by whatever names a variant (the
benchmark uses its ``Variant``). Every rank calls these functions alike; the timers use
``dist.barrier`` and, on CUDA, synchronize this rank's device.

- :class:`CollectiveBytesMode`, :func:`measure_collectives`: collectives issued by one
  forward, and by one forward plus backward, with the bytes handed to them.
- :func:`local_parameter_bytes`: parameter bytes one rank holds.
- :class:`HookCPUTimer`, :func:`measure_hook_cpu`: main-thread CPU time inside the
  modules' forward (pre-)hooks, by the style a plan gives the hooked module.
- :func:`time_interleaved` (with :func:`rotated`, :func:`timed_step`, :func:`run_rounds`):
  wall and CPU time of steps run in rounds, in an order rotated every round.
"""

from __future__ import annotations

import fnmatch
import gc
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp.launch import rank_device

__all__ = [
    "CollectiveBytesMode",
    "HookCPUTimer",
    "add_counts",
    "local_parameter_bytes",
    "measure_collectives",
    "measure_hook_cpu",
    "rotated",
    "run_rounds",
    "short_counts",
    "style_name_of",
    "tensor_bytes",
    "time_interleaved",
    "timed_step",
]

Key = TypeVar("Key", bound=Hashable)


# -------------------------------------------------------------------------- collectives


class _NoModuleTracking:
    """What ``CommDebugMode`` reads of its module tracker, with no module hooks: every count is
    the whole step's (``"Global"``). The tracker's global hooks lose their place in models whose
    own hooks return early (transformers >= 5.2x: ``IndexError`` in ``_fw_set_module_hook``), and
    the counts here are per step, not per module."""

    name = "Global"
    is_bw = False
    activation_checkpointing = False
    module_parents_dict = {"Global": set()}

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info) -> None:
        pass


class CollectiveBytesMode(CommDebugMode):
    """``CommDebugMode`` that also sums the bytes of each collective's input tensor(s), counting
    per step (no module tracking: :class:`_NoModuleTracking`)."""

    def __init__(self) -> None:
        super().__init__()
        self.advanced_module_tracker = _NoModuleTracking()
        self.input_bytes = 0

    def __enter__(self):
        self.input_bytes = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:  # CommDebugMode counted a collective
            self.input_bytes += tensor_bytes(args[0])
        return out


def tensor_bytes(value) -> int:
    """Bytes of a tensor, or of every tensor in a list (coalesced collectives)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def short_counts(mode: CommDebugMode) -> dict[str, int]:
    """``{"all_reduce": 2, ...}`` from a CommDebugMode."""
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = getattr(op, "_qualified_op_name", str(op)).split("::")[-1]
        counts[name] = counts.get(name, 0) + n
    return counts


def add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Per-collective sum of two count dicts."""
    return {name: a.get(name, 0) + b.get(name, 0) for name in sorted({*a, *b})}


def measure_collectives(module: nn.Module, *inputs: torch.Tensor) -> dict:
    """Collective counts and input bytes of one forward, and of forward + backward.

    The backward is that of ``module(*inputs).sum()``; gradients are cleared afterwards.
    """
    with CollectiveBytesMode() as forward_mode:
        out = module(*inputs)
    with CollectiveBytesMode() as backward_mode:
        out.sum().backward()
    module.zero_grad(set_to_none=True)
    forward = short_counts(forward_mode)
    return {
        "fwd_counts": forward,
        "fwd_bytes": forward_mode.input_bytes,
        "total_counts": add_counts(forward, short_counts(backward_mode)),
        "total_bytes": forward_mode.input_bytes + backward_mode.input_bytes,
    }


def local_parameter_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds (the local shard of a DTensor parameter)."""
    total = 0
    for param in module.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        total += tensor_bytes(local)
    return total


# --------------------------------------------------------------------------- hook cost


def style_name_of(path: str, plan: dict[str, object]) -> str:
    """Name of the style ``plan`` gives the module at ``path`` (keys are globs)."""
    for key, style in plan.items():
        if fnmatch.fnmatchcase(path, key):
            return type(style).__name__
    return "none"


class HookCPUTimer:
    """Wraps every forward (pre-)hook of a module tree to add up its main-thread CPU time.

    Times are keyed by ``"<style> pre"`` / ``"<style> post"`` (the style the plan gives
    the hooked module). Hooks are found in ``nn.Module``'s hook dicts, where both
    libraries register them; :meth:`remove` puts the original hooks back.
    """

    def __init__(self, module: nn.Module, plan: dict[str, object]):
        self.ns: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._originals = []
        for path, submodule in module.named_modules():
            style = style_name_of(path, plan)
            for side, hooks in (("pre", submodule._forward_pre_hooks), ("post", submodule._forward_hooks)):
                for hook_id, hook in list(hooks.items()):
                    hooks[hook_id] = self._timed(hook, f"{style} {side}")
                    self._originals.append((hooks, hook_id, hook))

    def _timed(self, hook: Callable, key: str) -> Callable:
        def timed(*args, **kwargs):
            start = time.thread_time_ns()
            try:
                return hook(*args, **kwargs)
            finally:
                self.ns[key] += time.thread_time_ns() - start
                self.calls[key] += 1

        return timed

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()

    def remove(self) -> None:
        for hooks, hook_id, hook in self._originals:
            hooks[hook_id] = hook


def measure_hook_cpu(steps: dict[Key, Callable[[], None]], modules: dict[Key, nn.Module],
                     plans: dict[Key, dict[str, object]], rounds: int) -> dict[Key, dict]:
    """Forward-hook CPU µs per step of each variant, in total and by style and side.

    ``modules[key]`` is what ``steps[key]`` runs and ``plans[key]`` the plan applied to it
    (only used to name the style of each hooked module).
    """
    timers = {variant: HookCPUTimer(modules[variant], plans[variant]) for variant in modules}
    try:
        run_rounds(steps, 1)  # the wrappers' own first calls
        for timer in timers.values():
            timer.reset()
        run_rounds(steps, rounds)
    finally:
        for timer in timers.values():
            timer.remove()
    return {
        variant: {
            "hook_us": sum(timer.ns.values()) / rounds / 1e3,
            "hook_breakdown": {
                key: (timer.ns[key] / rounds / 1e3, timer.calls[key] / rounds) for key in sorted(timer.ns)
            },
        }
        for variant, timer in timers.items()
    }


# ------------------------------------------------------------------------------ timing


def rotated(items: list, shift: int) -> list:
    """``items`` rotated left by ``shift`` (the order of variants in one round)."""
    shift %= len(items)
    return items[shift:] + items[:shift]


def timed_step(step: Callable[[], None]) -> tuple[float, float]:
    """Wall and main-thread CPU seconds of one step on this rank, started after a barrier.

    On CPU the autograd engine runs backward in the calling thread and gloo moves data on
    its own threads, so the main thread's CPU time is the step's compute plus the Python
    and dispatch cost of hooks and DTensor, without time spent waiting for other ranks.
    (On CUDA, backward runs on an autograd device thread: CPU time covers the forward.)
    """
    dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    step()
    if rank_device().type == "cuda":
        torch.cuda.synchronize()  # kernels run asynchronously: wait for this step's
    return time.perf_counter() - wall, time.thread_time() - cpu


def run_rounds(steps: dict[Key, Callable[[], None]], rounds: int) -> None:
    """Run every step ``rounds`` times, alternating variants in a rotating order."""
    order = list(steps)
    for round_ in range(rounds):
        for variant in rotated(order, round_):
            steps[variant]()


def time_interleaved(
    steps: dict[Key, Callable[[], None]], iters: int, warmup: int
) -> dict[Key, list[tuple[float, float]]]:
    """Run ``warmup`` rounds, then time ``iters`` rounds, alternating variants.

    Each round runs every variant once, in an order rotated by one each round, so that
    machine noise (and any benefit of following a particular variant) hits all alike.
    """
    run_rounds(steps, warmup)
    order = list(steps)
    times: dict[Key, list[tuple[float, float]]] = {variant: [] for variant in order}
    gc.collect()
    gc.disable()
    try:
        for round_ in range(iters):
            for variant in rotated(order, round_):
                times[variant].append(timed_step(steps[variant]))
    finally:
        gc.enable()
    return times


COLLECTIVE_ABBREVIATIONS = {
    "all_reduce": "AR",
    "all_gather_into_tensor": "AG",
    "reduce_scatter_tensor": "RS",
}


def format_counts(counts: dict[str, int]) -> str:
    """``{"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}`` -> ``"2AG+2RS"``."""
    parts = [f"{n}{COLLECTIVE_ABBREVIATIONS.get(name, name)}" for name, n in sorted(counts.items()) if n]
    return "+".join(parts) or "0"


def median_ms(row: dict, metric: str = "wall_s") -> float:
    """Median of ``row[metric]`` (``"wall_s"`` or ``"cpu_s"``) in milliseconds."""
    import statistics

    return statistics.median(row[metric]) * 1e3
