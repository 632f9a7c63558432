"""The device the test harness runs on: ``TORCH_TP_TEST_DEVICE`` (``cpu``, the default, or ``cuda``).

The rules are plain functions of plain values, so the CPU suite tests them without a GPU:
:func:`validate_device` (what may be asked for, and what to change when it cannot run),
:func:`device_skip_reason` (which tests a device leaves out, and why) and
:func:`backend_for` (the process group backend of a pool). :func:`harness_device` applies the
first to this process's environment; ``tests/conftest.py`` applies the second to every
collected test and sets the parent's default device, ``torch_tp.testing._rank`` the worker's.

On ``cuda`` each rank of a pool owns one GPU (rank ``r`` uses ``cuda:r``), so a test whose world
size exceeds ``torch.cuda.device_count()`` is skipped; the script runs (the ``slow`` and
``script_runs`` tests) and the ``cpu_only`` tests are the CPU job's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "DEVICE_ENV",
    "DEVICES",
    "DeviceSelectionError",
    "backend_for",
    "device_count",
    "device_skip_reason",
    "harness_device",
    "item_skip_reason",
    "to_current_device",
    "validate_device",
]

#: The environment variable naming the device the tests run on.
DEVICE_ENV = "TORCH_TP_TEST_DEVICE"

#: The devices the harness can run on (the first is the default).
DEVICES = ("cpu", "cuda")

# Markers whose tests run scripts in subprocesses (tutorials, the demo, benchmarks, torchrun
# jobs): the CPU job's. ``slow`` marks all of them; ``script_runs`` is named for safety.
_SCRIPT_MARKERS = ("slow", "script_runs")


class DeviceSelectionError(ValueError):
    """``TORCH_TP_TEST_DEVICE`` asks for a device this process cannot run the tests on.

    The message says what to change. ``tests/conftest.py`` turns it into a usage error at
    pytest's startup, before anything is collected.
    """


def validate_device(
    value: str | None,
    *,
    cuda_available: bool,
    cuda_version: str | None = None,
    start_method: str = "forkserver",
) -> str:
    """The device ``TORCH_TP_TEST_DEVICE=value`` names, or :class:`DeviceSelectionError`.

    ``None`` or an empty value is ``"cpu"``. ``"cuda"`` needs ``cuda_available``
    (``torch.cuda.is_available()``; ``cuda_version`` is ``torch.version.cuda``, ``None`` for a
    CPU build) and a worker start method that does not fork a process that may hold CUDA.

    Example::

        >>> validate_device(None, cuda_available=False)
        'cpu'
        >>> validate_device("cuda", cuda_available=True)
        'cuda'
        >>> try:
        ...     validate_device("cuda", cuda_available=False)
        ... except DeviceSelectionError as error:
        ...     print(str(error)[:65])
        TORCH_TP_TEST_DEVICE=cuda, but torch.cuda.is_available() is False
    """
    device = (value or "").strip() or DEVICES[0]
    if device not in DEVICES:
        choices = ", ".join(repr(d) for d in DEVICES)
        raise DeviceSelectionError(
            f"{DEVICE_ENV}={value!r} is not a device the test harness knows; set it to one of "
            f"{choices} (or unset it: cpu)"
        )
    if device == "cuda" and not cuda_available:
        why = ("this torch is a CPU build (torch.version.cuda is None)" if cuda_version is None
               else f"no CUDA device is visible to this CUDA {cuda_version} build")
        raise DeviceSelectionError(
            f"{DEVICE_ENV}=cuda, but torch.cuda.is_available() is False: {why}; unset "
            f"{DEVICE_ENV} (or set it to cpu) to run the tests on CPU, or run them on a machine "
            f"with a GPU and a CUDA build of torch"
        )
    if device == "cuda" and start_method == "fork":
        raise DeviceSelectionError(
            f"{DEVICE_ENV}=cuda with TORCH_TP_START_METHOD=fork: a forked worker cannot use the "
            f"CUDA its parent initialized; unset TORCH_TP_START_METHOD (forkserver) or set it "
            f"to spawn"
        )
    return device


def harness_device() -> str:
    """The device this process's tests and worker pools run on: :func:`validate_device` of
    ``TORCH_TP_TEST_DEVICE`` here (raises :class:`DeviceSelectionError`).

    Example::

        >>> harness_device() in DEVICES
        True
    """
    value = os.environ.get(DEVICE_ENV)
    if not value or value.strip() == "cpu":  # the default: no CUDA query at all
        return validate_device(value, cuda_available=False)
    return validate_device(
        value,
        cuda_available=torch.cuda.is_available(),
        cuda_version=torch.version.cuda,
        start_method=os.environ.get("TORCH_TP_START_METHOD", "forkserver"),
    )


def device_count(device: str) -> int:
    """How many ranks ``device`` can hold at once: GPUs for ``cuda``; ``cpu`` has no bound
    (returns a number larger than any world size).

    Example::

        >>> device_count("cpu") > 1024
        True
    """
    if device == "cpu":
        return 1 << 30
    return getattr(torch, device).device_count()


def backend_for(device: str) -> str:
    """The backend of a pool's process group on ``device``.

    ``cpu`` is gloo. ``cuda`` is ``"cpu:gloo,cuda:nccl"``: CUDA tensors go through NCCL, and
    whatever a test or torch_tp keeps on the CPU still has a backend: an explicit
    ``device="cpu"`` tensor, the object collectives and barriers (``all_gather_object``, which
    torch_tp's agreement checks use, then stay in host memory, no device copy), a CPU reference
    model's collectives. Groups created later (``DeviceMesh`` sub-groups, ``new_group``) inherit it.

    Example::

        >>> backend_for("cpu"), backend_for("cuda")
        ('gloo', 'cpu:gloo,cuda:nccl')
    """
    return "gloo" if device == "cpu" else f"cpu:gloo,{device}:nccl"


def device_skip_reason(
    device: str,
    device_count: int,
    *,
    world_size: int | None = None,
    script_run: bool = False,
    cpu_only: str | None = None,
) -> str | None:
    """Why a test does not run on ``device``, or ``None`` when it runs.

    ``device_count`` is the GPUs visible; ``world_size`` the test's (its ``world_size``
    parameter), ``script_run`` whether it runs a script in a subprocess (``slow``,
    ``script_runs``), ``cpu_only`` the reason of its ``cpu_only`` marker. Nothing is skipped on
    ``cpu``.

    Example::

        >>> device_skip_reason("cuda", 1, world_size=2)
        'world size 2 needs 2 GPUs; TORCH_TP_TEST_DEVICE=cuda sees 1'
        >>> device_skip_reason("cuda", 8, world_size=4) is None
        True
    """
    if device == "cpu":
        return None
    if cpu_only is not None:
        return f"CPU only: {cpu_only} ({DEVICE_ENV}={device})"
    if script_run:
        return (f"a script run in a subprocess (tutorial, demo, benchmark): the CPU job runs "
                f"those, {DEVICE_ENV}={device} leaves them out")
    if world_size is not None and world_size > device_count:
        gpus = "GPU" if world_size == 1 else "GPUs"
        return f"world size {world_size} needs {world_size} {gpus}; {DEVICE_ENV}={device} sees {device_count}"
    return None


def item_skip_reason(item: Any, device: str, device_count: int) -> str | None:
    """:func:`device_skip_reason` of a collected pytest item (its markers and ``world_size``)."""
    if device == "cpu":
        return None
    cpu_only = item.get_closest_marker("cpu_only")
    params: Mapping[str, Any] = getattr(getattr(item, "callspec", None), "params", {})
    world_size = params.get("world_size")
    return device_skip_reason(
        device,
        device_count,
        world_size=world_size if isinstance(world_size, int) else None,
        script_run=any(item.get_closest_marker(name) is not None for name in _SCRIPT_MARKERS),
        cpu_only=None if cpu_only is None else _reason_of(cpu_only),
    )


def _reason_of(marker: Any) -> str:
    reason = marker.kwargs.get("reason", marker.args[0] if marker.args else None)
    return str(reason) if reason else "marked cpu_only"


def to_current_device(tree: Any) -> Any:
    """``tree`` with every CUDA tensor in it (lists, tuples, dicts) on this process's current
    CUDA device.

    A pickled CUDA tensor unpickles on the device it left (rank 1's results on ``cuda:1`` in
    the parent, the parent's arguments on ``cuda:0`` in rank 1); the harness moves what crosses
    a pool's pipe to the receiver's device. CPU tensors and other values are left as they are.

    Example::

        >>> x = torch.ones(2)
        >>> to_current_device([x, "text"])[0] is x  # a CPU tensor stays
        True
    """
    from torch.utils._pytree import tree_map_only

    def moved(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda" or t.device.index == torch.cuda.current_device():
            return t
        return t.to(torch.cuda.current_device())

    return tree_map_only(torch.Tensor, moved, tree)
