"""Collective counting for distributed tests: :func:`comm_counts`,
:func:`assert_comm_counts`, :func:`record_p2p`, :func:`communication_of` and
:func:`wire_bytes` (the bytes gloo was handed).

Collectives may be given as op packets, op overloads or names, of the
in-place c10d ops or of the functional collectives; they are normalized to one
short functional-collective name per communication (e.g. ``"all_reduce"``).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Mapping
from unittest import mock

import torch.distributed as dist


__all__ = ["assert_comm_counts", "comm_counts", "communication_of", "record_p2p", "sent_bytes", "wire_bytes"]

# In-place c10d ops (what torch.distributed.* calls dispatch to) -> the
# functional-collective name for the same communication.
_C10D_TO_FUNCTIONAL = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce_coalesced",
    "_allgather_base_": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather_coalesced",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_": "reduce_scatter",
    "alltoall_base_": "all_to_all_single",
    "alltoall_": "all_to_all",
    "broadcast_": "broadcast",
    "gather_": "gather",
    "scatter_": "scatter",
    "reduce_": "reduce",
}


def _collective_name(key: Any) -> str:
    """Short name of a collective given as an op packet, op overload or string."""
    if isinstance(key, str):
        parts = key.rsplit("::", 1)[-1].split(".")  # "c10d_functional.all_reduce"
        if len(parts) > 1 and parts[-1] == "default":  # "all_reduce.default"
            parts.pop()
        name = parts[-1]
    else:
        packet = getattr(key, "_overloadpacket", key)
        name = getattr(packet, "__name__", None) or str(key)
    return _C10D_TO_FUNCTIONAL.get(name, name)


def _normalize_counts(counts: Mapping[Any, int]) -> dict[str, int]:
    normalized: dict[str, int] = {}
    for key, count in counts.items():
        name = _collective_name(key)
        normalized[name] = normalized.get(name, 0) + int(count)
    return {name: count for name, count in sorted(normalized.items()) if count}


def comm_counts(mode: Any) -> dict[str, int]:
    """``{short_collective_name: count}`` from a ``CommDebugMode``.

    Example:
        >>> # xdoctest: +SKIP("only inside a function run by run_on_ranks")
        >>> with CommDebugMode() as mode:
        ...     sharded.redistribute(tp_mesh(), [Replicate()])
        >>> comm_counts(mode)
        {'all_gather_into_tensor': 1}
    """
    return _normalize_counts(mode.get_comm_counts())


def assert_comm_counts(counts: Mapping[Any, int], expected: Mapping[Any, int], what: str) -> None:
    """Assert collective counts match; keys may be op packets or short names.

    Zero counts are ignored on both sides, so ``{"all_reduce": 0}`` means
    "no all_reduce". Raises ``AssertionError`` showing both dicts.

    Example:
        >>> assert_comm_counts({"all_reduce": 1}, {"all_reduce": 1, "broadcast": 0}, "row-wise")
        >>> assert_comm_counts({"all_reduce": 2}, {"all_reduce": 1}, "row-wise")
        Traceback (most recent call last):
        AssertionError: row-wise: collective counts differ...
    """
    actual = _normalize_counts(counts)
    wanted = _normalize_counts(expected)
    if actual != wanted:
        raise AssertionError(
            f"{what}: collective counts differ\n  expected: {wanted}\n  actual:   {actual}"
        )


@contextlib.contextmanager
def record_p2p() -> Iterator[list[tuple[str, int, int]]]:
    """Record every point-to-point op given to ``dist.batch_isend_irecv`` on this rank.

    Yields a list that fills with ``(kind, global_peer, nbytes)``, ``kind`` being ``"send"``
    or ``"recv"``; the ops still run.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> with record_p2p() as ops:
        ...     halo_exchange(x, dim=-1, recv_left=1, recv_right=1, send_left=1, send_right=1, mesh=mesh)
        >>> sum(n for kind, _, n in ops if kind == "send")
        256
    """
    records: list[tuple[str, int, int]] = []
    real = dist.batch_isend_irecv

    def recording(ops):
        for op in ops:
            kind = "send" if op.op is dist.isend else "recv"
            records.append((kind, op.peer, op.tensor.numel() * op.tensor.element_size()))
        return real(ops)

    with mock.patch.object(dist, "batch_isend_irecv", recording):
        yield records


def sent_bytes(records: list[tuple[str, int, int]]) -> int:
    """Bytes of the ``"send"`` ops in a :func:`record_p2p` list.

    Example::

        >>> sent_bytes([("send", 1, 64), ("recv", 1, 64), ("send", 0, 32)])
        96
    """
    return sum(nbytes for kind, _, nbytes in records if kind == "send")


def communication_of(step: Callable[[], Any]) -> tuple[int, dict[str, int]]:
    """``(P2P sends, {collective: count})`` of ``step``, which is run twice.

    The first run records the point-to-point sends (:func:`record_p2p`: the ring steps of
    :mod:`torch_tp.overlap`'s fused ops); the second counts collectives under
    ``CommDebugMode``. Its module tracker installs full backward hooks, for which PyTorch
    warns about modules whose inputs need no gradient (token ids): that warning is silenced.
    torch_tp's forward-time agreement checks (:mod:`torch_tp._agreement`, one 8-byte
    ``all_gather`` each) are listed apart, as ``"agreement checks"``. FSDP2's warning that its root
returned a view (those hooks make every module output one) is silenced too.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> communication_of(lambda: model(tokens).sum().backward())
        (18, {'agreement checks': 2, 'all_gather_into_tensor': 2, 'reduce_scatter_tensor': 1})
    """
    from torch.distributed.tensor.debug import CommDebugMode

    from torch_tp._agreement import checks_run

    with record_p2p() as p2p:
        step()
    before = checks_run()
    with CommDebugMode() as mode, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        # the tracker's full backward hooks return every module's output through an autograd
        # Function, as a view: FSDP2's root then warns about in-place ops the step never does
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
        step()
    counts, checks = comm_counts(mode), checks_run() - before
    if checks:
        counts["all_gather"] -= checks
        counts = {name: n for name, n in counts.items() if n} | {"agreement checks": checks}
    return sum(kind == "send" for kind, _, _ in p2p), counts


#: Bytes per element of the dtypes the profiler names on gloo's events.
_PROFILER_DTYPE_BYTES = {"signed char": 1, "unsigned char": 1, "bool": 1, "c10::Half": 2, "c10::BFloat16": 2,
                         "short int": 2, "float": 4, "int": 4, "double": 8, "long int": 8}


def _dtype_bytes(dtype: str, event: str) -> int:
    if dtype not in _PROFILER_DTYPE_BYTES:
        raise ValueError(f"torch_tp.testing.wire_bytes: {event} was handed a {dtype!r} tensor, whose element size "
                         f"this counter does not know; add it to _PROFILER_DTYPE_BYTES")
    return _PROFILER_DTYPE_BYTES[dtype]


def _require_gloo_only() -> None:
    """gloo's events are the count: a group any of whose devices another backend serves (NCCL's
    collectives have no such events) would be counted short, so it is refused."""
    config = dist.get_backend_config() if dist.is_initialized() else ""
    backends = {entry.split(":")[-1] for entry in config.split(",") if entry}
    if backends != {"gloo"}:
        raise RuntimeError(
            f"torch_tp.testing.wire_bytes counts what gloo is handed, but the default process group's "
            f"backend is {config or 'not initialized'!r}: run it on a gloo group (on a GPU, count with "
            f"communication_of or the CUDA profiler's NCCL kernels instead)"
        )


def wire_bytes(step: Callable[[], Any]) -> dict[str, int]:
    """``{gloo collective: bytes this rank handed to it}`` while ``step()`` runs.

    Read off the profiler's ``gloo:*`` events (their input's element count times its dtype's
    size): gloo's own account of what it was given, below torch_tp, DTensor and the tensor
    subclasses, so an independent count of what travels.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized gloo process group")
        >>> wire_bytes(lambda: dist.all_reduce(torch.ones(3)))
        {'all_reduce': 12}
    """
    from torch.profiler import ProfilerActivity, profile

    _require_gloo_only()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    counted: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("gloo:"):
            name = event.name.removeprefix("gloo:")
            size = sum(math.prod(shape) * _dtype_bytes(dtype, event.name)
                       for shape, dtype in zip(event.input_shapes, event.input_dtypes) if dtype)
            counted[name] = counted.get(name, 0) + size
    return counted
