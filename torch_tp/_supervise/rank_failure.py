"""What a failing rank records about itself, for the parent to find the root cause.

A rank that raises writes a *record* (a plain dict, JSON- and pickle-safe) instead of only a
traceback string, so that the parent (:mod:`torch_tp._supervise.root_cause`) can tell the rank that
failed first from the ranks that failed because of it:

============  ==============================================================================
key           value
============  ==============================================================================
type          the exception's qualified class name (``"ValueError"``, ``"SystemExit"``)
message       ``str(exception)`` (``SystemExit``: its code), at most :data:`MESSAGE_CHARS` characters
              (:func:`bounded`); an exception whose ``__str__`` raises keeps its type, and its
              message says it could not be formatted
traceback     the formatted traceback, at most :data:`TRACEBACK_CHARS` characters
time_ns       ``time.time_ns()`` when it was recorded (ranks share one host clock)
collective    the torch.distributed collective the exception came out of, if any:
              ``{"op": "all_reduce", "ranks": [0, 1], "tensors": "float32[4]"}``
symptom       ``True`` when a collective failed on this rank (timed out, lost its peer), when
              gloo says a peer's connection closed or reset (wherever that surfaced: a peer
              that died is never this rank's fault), when a wait in the job's store timed out
              (``DistStoreError``: joining the group, a peer never came), or when the exception says it is a
              consequence (``exc.consequence is True``: torch_tp's agreement raises it on the
              ranks whose own checks passed): the cause is another rank's, not this one's
calls         ``{rank: "ALLREDUCE float32[1000]"}`` when torch's collective check
              (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) found ranks calling different collectives
============  ==============================================================================

:func:`collective_in_stack` reads the same ``op`` from a faulthandler stack dump, for ranks that
were killed (a hang, an abort) rather than raising. Imports nothing from torch_tp.
"""

from __future__ import annotations

import os
import re
import time
import traceback
from types import TracebackType
from typing import Any

__all__ = [
    "COLLECTIVES",
    "MESSAGE_CHARS",
    "TRACEBACK_CHARS",
    "bounded",
    "collective_in_stack",
    "exception_record",
    "formatted_traceback",
    "mismatched_calls",
    "native_errors_to_stderr",
    "recording_in_stack",
]

#: The most characters of an exception's message a record keeps (its first and last half).
MESSAGE_CHARS = 4096
#: The most characters of a formatted traceback a record keeps.
TRACEBACK_CHARS = 16384

#: torch.distributed functions that are (or wait on) one collective.
COLLECTIVES = frozenset(
    """all_reduce all_reduce_coalesced all_gather all_gather_coalesced all_gather_into_tensor
    all_gather_object all_gather_single all_gather_tensor all_gather_tensor_autograd all_to_all
    all_to_all_single all_to_all_single_autograd reduce_scatter reduce_scatter_single
    reduce_scatter_tensor reduce_scatter_tensor_autograd broadcast broadcast_object_list barrier
    monitored_barrier gather gather_object scatter scatter_object_list reduce send recv isend
    irecv send_object_list recv_object_list batch_isend_irecv wait_tensor""".split()
)

# Where torch.distributed runs its collectives (not where it merely checks arguments).
_C10D_FILES = ("distributed_c10d.py", "_functional_collectives.py", "c10d_logger.py")
_TENSOR_ARGS = ("tensor", "output_tensor", "input_tensor", "output", "input", "tensor_list", "self")
_FINGERPRINT = re.compile(
    r"Rank (?P<rank>\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=\d+, "
    r"OpType=(?P<op>\w+), TensorShape=(?P<shape>\[[^\]]*\]), TensorDtypes=(?P<dtype>\w+)"
)
#: How gloo says a peer went away (its process died or closed the group).
_LOST_PEER = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe")
_STACK_LINE = re.compile(r'File "(?P<file>[^"]+)", line \d+ in (?P<name>\S+)')


def exception_record(exc: BaseException, *, with_traceback: bool = True) -> dict[str, Any]:
    """A record of ``exc`` as raised on this rank (see the module docstring for its keys).

    ``with_traceback=False`` leaves the traceback empty: formatting it reads source files,
    and a rank about to be stopped writes the rest of the record first.

    Example::

        >>> try:
        ...     raise ValueError("boom")
        ... except ValueError as e:
        ...     record = exception_record(e)
        >>> record["type"], record["message"], record["symptom"], record["collective"]
        ('ValueError', 'boom', False, None)
    """
    collective = _collective_in_traceback(exc.__traceback__)
    message = _message(exc)
    calls = mismatched_calls(message)
    return {
        "type": _qualified_name(type(exc)),
        "message": bounded(message, MESSAGE_CHARS),
        "traceback": formatted_traceback(exc) if with_traceback else "",
        "time_ns": time.time_ns(),
        "collective": collective,
        "symptom": _says_consequence(exc) or _lost_peer(exc, message) or _store_wait_timed_out(exc, message) or (
            not calls and collective is not None and isinstance(exc, RuntimeError) and _raised_in_c10d(exc.__traceback__)),
        "calls": calls,
    }


def native_errors_to_stderr() -> None:
    """Have glibc write its fatal heap errors (``malloc(): unaligned tcache chunk detected``) to
    stderr, where a rank's report reads them, instead of to the terminal (``/dev/tty``), which a
    rank's log never sees: a rank that aborts on a corrupted heap then says so.

    Example::

        >>> native_errors_to_stderr()
        >>> os.environ["LIBC_FATAL_STDERR_"]
        '1'
    """
    os.environ.setdefault("LIBC_FATAL_STDERR_", "1")


def bounded(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its first and last part with a note
    of how much was cut between them: never more than ``limit`` characters (so bounding twice
    changes nothing). A 50 MiB message must not make a 100 MiB report.

    Example::

        >>> bounded("short", 100)
        'short'
        >>> text = bounded("a" * 500 + "b" * 500, 100)
        >>> len(text) <= 100, text[:3], text[-3:]
        (True, 'aaa', 'bbb')
        >>> text.splitlines()[1]
        '[... 931 characters cut ...]'
    """
    if len(text) <= limit:
        return text
    note_len = len(_cut_note(len(text)))
    keep = max(0, limit - note_len)
    head, tail = keep - keep // 2, keep // 2
    note = _cut_note(len(text) - head - tail)
    return text[:head] + note + (text[len(text) - tail:] if tail else "")


def formatted_traceback(exc: BaseException, tb: TracebackType | None = None, limit: int = TRACEBACK_CHARS) -> str:
    """``exc``'s formatted traceback (from ``tb``, default its own), at most ``limit``
    characters (:func:`bounded`). An exception whose ``__str__`` raises is still formatted.

    Example::

        >>> try:
        ...     raise ValueError("x" * 100_000)
        ... except ValueError as e:
        ...     text = formatted_traceback(e)
        >>> text.startswith("Traceback"), len(text) <= TRACEBACK_CHARS, "characters cut" in text
        (True, True, True)
    """
    tb = exc.__traceback__ if tb is None else tb
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except BaseException as error:  # noqa: BLE001 - a broken exception must not hide the failure
        text = "".join(traceback.format_tb(tb)) + f"{_qualified_name(type(exc))}: {_message(exc)}\n" + (
            f"(the traceback could not be formatted: {_describe(error)})\n")
    return bounded(text, limit)


def mismatched_calls(message: str) -> dict[int, str]:
    """The calls of each rank named in torch's "Detected mismatch between collectives" error.

    Example::

        >>> mismatched_calls("Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0, "
        ...     "OpType=ALLREDUCE, TensorShape=[1000], TensorDtypes=Float, ...), but Rank 0 is running "
        ...     "collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], "
        ...     "TensorDtypes=Float, ...)")
        {1: 'ALLREDUCE Float[1000]', 0: 'ALLREDUCE Float[4]'}
    """
    return {int(m["rank"]): f"{m['op']} {m['dtype']}{m['shape']}" for m in _FINGERPRINT.finditer(message)}


def collective_in_stack(stack: str) -> str | None:
    """The innermost collective in a faulthandler dump (most recent call first), if any.

    Example::

        >>> collective_in_stack('  File "/x/torch/distributed/distributed_c10d.py", line 3 in all_reduce\\n'
        ...                     '  File "/x/torch/distributed/c10d_logger.py", line 8 in wrapper\\n')
        'all_reduce'
        >>> collective_in_stack('  File "t.py", line 5 in main\\n') is None
        True
    """
    for match in _STACK_LINE.finditer(stack):
        if _in_torch_distributed(match["file"]) and match["name"] in COLLECTIVES:
            return match["name"]
    return None


def recording_in_stack(stack: str) -> bool:
    r"""Whether a stack dump caught the rank recording its own failure (its whereabouts before that
    are in the record it was writing, not in this stack).

    Example::

        >>> recording_in_stack('  File "/x/torch_tp/_rank_failure.py", line 74 in exception_record\n')
        True
    """
    return any(match["name"] == "exception_record" for match in _STACK_LINE.finditer(stack))


def _message(exc: BaseException) -> str:
    """``str(exc)`` (``SystemExit``: its code); a note, not an exception, when that raises."""
    try:
        return str(exc.code) if isinstance(exc, SystemExit) else str(exc)
    except BaseException as error:  # noqa: BLE001 - a broken __str__ must not hide the exception
        return f"<the message could not be formatted: str() raised {_describe(error)}>"


def _describe(error: BaseException) -> str:
    """``"RuntimeError: why"``, or only the type when the message cannot be formatted either."""
    try:
        return bounded(f"{_qualified_name(type(error))}: {error}", 500)
    except BaseException:  # noqa: BLE001
        return _qualified_name(type(error))


def _lost_peer(exc: BaseException, message: str) -> bool:
    return isinstance(exc, (RuntimeError, OSError)) and _LOST_PEER.search(message) is not None


def _store_wait_timed_out(exc: BaseException, message: str) -> bool:
    """A wait in the job's store ran out: the rank waited for keys a peer never set (joining the
    process group, a peer that never reached the rendezvous): the peer's fault, not this rank's."""
    return type(exc).__name__ == "DistStoreError" and "wait timeout" in message


def _says_consequence(exc: BaseException) -> bool:
    try:
        return getattr(exc, "consequence", False) is True
    except BaseException:  # noqa: BLE001 - a property that raises says nothing
        return False


def _cut_note(count: int) -> str:
    return f"\n[... {count} characters cut ...]\n"


def _qualified_name(cls: type) -> str:
    module = cls.__module__
    return cls.__qualname__ if module in ("builtins", "__main__") else f"{module}.{cls.__qualname__}"


def _frames(tb: TracebackType | None) -> list[Any]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _in_torch_distributed(path: str) -> bool:
    return "/torch/distributed/" in path.replace("\\", "/")


def _raised_in_c10d(tb: TracebackType | None) -> bool:
    frames = _frames(tb)
    return bool(frames) and frames[-1].f_code.co_filename.endswith(_C10D_FILES)


def _collective_in_traceback(tb: TracebackType | None) -> dict[str, Any] | None:
    for frame in reversed(_frames(tb)):
        if _in_torch_distributed(frame.f_code.co_filename) and frame.f_code.co_name in COLLECTIVES:
            return {"op": frame.f_code.co_name, "ranks": _group_ranks(frame.f_locals), "tensors": _tensors(frame.f_locals)}
    return None


def _group_ranks(local_vars: dict[str, Any]) -> list[int] | None:
    try:
        import torch.distributed as dist

        group = local_vars.get("group")
        if group is None or isinstance(group, dist.ProcessGroup):
            return dist.get_process_group_ranks(group or dist.group.WORLD)
    except Exception:  # a group torn down, or not a ProcessGroup: leave the ranks out
        pass
    return None


def _tensors(local_vars: dict[str, Any]) -> str | None:
    import torch

    for name in _TENSOR_ARGS:
        value = local_vars.get(name)
        if isinstance(value, torch.Tensor):
            return _describe_tensor(value)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return f"[{len(value)} x {_describe_tensor(value[0])}]"
    return None


def _describe_tensor(t: Any) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
