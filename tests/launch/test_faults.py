"""Fault injection: one rank misbehaves, and both ways of running ranks name it.

``torch_tp.launch`` (torch's elastic agent underneath) and ``torch_tp.testing.run_on_ranks``
(the persistent gloo pools) run the same faulty functions at world sizes 2 and 4. The last
rank is the culprit: it raises while the others wait in an all_reduce, calls ``sys.exit(3)``,
calls ``os._exit(0)``, sleeps forever, calls all_reduce while the others call all_gather,
passes 1000 elements where the others pass 4, is killed by SIGKILL or stopped by SIGSTOP,
returns while the others wait, or raises an exception that cannot print itself, chained to a
50 MiB message. Each report must put that rank first, with the cause (exception text, exit
code, signal, stack), within the timeout plus a few seconds, and stay a few kilobytes long;
the processes the ranks started must end with the run.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torch_tp._supervise.orphans import process_state
from torch_tp._supervise.rank_failure import MESSAGE_CHARS, exception_record
from torch_tp._supervise.root_cause import RankOutcome, explain
from torch_tp.launch import LaunchFailure, _record_for_torchrun, launch
from torch_tp.testing import RankFailure, run_on_ranks, run_script

WORLD_SIZES = pytest.mark.parametrize("world_size", [2, 4], ids=["ws2", "ws4"])
TIMEOUT_S = 2  # the collective timeout of a launch, and the task timeout of a pool call
SLACK_S = 8  # starting the ranks, the agent's teardown, stack dumps


def _culprit() -> int:
    return dist.get_world_size() - 1


def _raises_mid_collective():
    if dist.get_rank() == _culprit():
        print(f"rank {dist.get_rank()} about to fail", file=sys.stderr, flush=True)
        raise ValueError(f"boom on rank {dist.get_rank()}")
    dist.all_reduce(torch.ones(4))


def _culprit_calls(misbehave, *args):
    """The culprit calls ``misbehave(*args)``, which never returns; the others wait in an all_reduce."""
    if dist.get_rank() == _culprit():
        misbehave(*args)
    dist.all_reduce(torch.ones(4))


def _exits_3():
    _culprit_calls(sys.exit, 3)


def _exits_0_at_once():
    _culprit_calls(os._exit, 0)


def _sleeps_forever():
    _culprit_calls(time.sleep, 3600)  # its stack shows this function


def _calls_another_collective():
    if dist.get_rank() == _culprit():
        dist.all_reduce(torch.ones(4))
    else:
        dist.all_gather([torch.zeros(4) for _ in range(dist.get_world_size())], torch.ones(4))


def _passes_another_size():
    dist.all_reduce(torch.ones(1000 if dist.get_rank() == _culprit() else 4))


def _corrupts_its_heap():
    # a double free: glibc aborts the process (a corrupted heap in native code ends the same way)
    if dist.get_rank() == _culprit():
        import ctypes

        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        block = libc.malloc(24)
        libc.free(block)
        libc.free(block)
    dist.all_reduce(torch.ones(4))


def _rowwise_gets_the_wrong_width():
    from torch.distributed.device_mesh import init_device_mesh

    from torch_tp import RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    layer = parallelize_module(torch.nn.Linear(8, 4), mesh, RowwiseParallel())
    width = 8 // dist.get_world_size() + (1 if dist.get_rank() == _culprit() else 0)
    layer(torch.ones(2, width))  # refused on every rank before the reduction


def _starts_a_child_then_signals_itself(sig, pid_dir):
    """Every rank starts a process of its own; the culprit then sends itself ``sig``."""
    child = subprocess.Popen(["sleep", "600"])
    pathlib.Path(pid_dir, f"rank{dist.get_rank()}").write_text(str(child.pid))
    if dist.get_rank() == _culprit():
        os.kill(os.getpid(), sig)
    dist.all_reduce(torch.ones(4))


def _returns_early():
    if dist.get_rank() != _culprit():
        dist.all_reduce(torch.ones(4))


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("this __str__ is broken")


def _raises_what_cannot_be_printed_after_a_50_mib_message():
    if dist.get_rank() == _culprit():
        print("z" * (5 << 20), file=sys.stderr, flush=True)  # a 5 MiB line of output
        try:
            raise ValueError("y" * (50 << 20))
        except ValueError as huge:
            raise _Unprintable() from huge
    dist.all_reduce(torch.ones(4))


def _sums_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _launch_failure(fn, world_size, *args, **kwargs):
    start = time.monotonic()
    with pytest.raises(LaunchFailure) as info:
        launch(fn, *args, nproc=world_size, timeout=timedelta(seconds=TIMEOUT_S), **kwargs)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed
    return info.value, str(info.value)


def _pool_failure(fn, world_size, *args):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(fn, world_size, *args, timeout=TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed
    return info.value, str(info.value)


def _summary(message):
    return message.splitlines()[0]


def _cause(message):
    """The summary after the headline ("... failed on 2 ranks: ", "... on world_size=2: ")."""
    return re.split(r"(?:failed on \d+ ranks|on world_size=\d+): ", _summary(message), maxsplit=1)[1]


def _first_section(message):
    return message.split("=====")[1]


# Both harnesses: `fail(fn, world_size)` runs `fn` and returns the error and its message.
HARNESSES = pytest.mark.parametrize("fail", [_launch_failure, _pool_failure], ids=["launch", "run_on_ranks"])


def _exit_code(error, rank):
    """The rank's exit code as torch_tp.launch reports it (run_on_ranks reports none)."""
    return error.exit_codes[rank] if isinstance(error, LaunchFailure) else None


def _culprit_named(fail, fn, world_size, cause):
    """``fail(fn, world_size)``: the culprit (the last rank) must be the root cause, and the
    summary must start with ``cause`` (``{culprit}`` is its rank). Returns the error, its
    message and the culprit."""
    error, message = fail(fn, world_size)
    culprit = world_size - 1
    assert error.root_cause_rank == culprit, message
    assert _cause(message).startswith(cause.format(culprit=culprit)), message
    return error, message, culprit


@HARNESSES
@WORLD_SIZES
def test_the_rank_that_raised_comes_first_with_its_traceback_then_the_others(fail, world_size):
    cause = "rank {culprit} raised ValueError: boom on rank {culprit}; then "
    error, message, culprit = _culprit_named(fail, _raises_mid_collective, world_size, cause)
    assert error.failed_ranks == list(range(world_size)), message
    assert f"rank {culprit}: raised [root cause]" in _first_section(message), message
    assert 'raise ValueError(f"boom on rank' in message.split("[then]")[0]  # its traceback, first
    assert f"rank {culprit} about to fail" in message  # its output
    if isinstance(error, LaunchFailure):  # every rank's exit code, the culprit's too
        assert error.exit_codes[culprit] == 1 and sorted(error.exit_codes) == list(range(world_size)), error.exit_codes
        assert all(code != 0 for code in error.exit_codes.values()), error.exit_codes


@HARNESSES
@WORLD_SIZES
def test_sys_exit_3_is_reported_with_its_code(fail, world_size):
    error, message, culprit = _culprit_named(fail, _exits_3, world_size, "rank {culprit} called sys.exit(3)")
    assert _exit_code(error, culprit) in (3, None)


@HARNESSES
@WORLD_SIZES
def test_os_exit_0_is_reported_as_a_rank_that_left_early(fail, world_size):
    cause = "rank {culprit} exited with code 0 before its function returned"
    error, message, culprit = _culprit_named(fail, _exits_0_at_once, world_size, cause)
    assert f"rank {culprit}: worker process died (exit code 0) [root cause]" in message, message
    assert _exit_code(error, culprit) in (0, None)


@HARNESSES
@WORLD_SIZES
def test_a_hung_rank_is_named_with_its_stack_as_the_rank_the_others_waited_for(fail, world_size):
    error, message = fail(_sleeps_forever, world_size)
    culprit = world_size - 1
    assert error.root_cause_rank == culprit, message
    assert re.match(rf"rank \d (timed out|waited) in all_reduce.*, which rank {culprit} never reached", _cause(message)), message
    first = _first_section(message) + message.split("=====")[2]
    assert f"rank {culprit}: did not answer" in first and "in _sleeps_forever" in first, message  # its Python stack
    if isinstance(error, LaunchFailure):  # the collective timed out: the group is named, the hung rank stopped
        assert f"timed out in all_reduce on the group of ranks {list(range(world_size))}" in _cause(message), message
        assert error.exit_codes[culprit] == -15, error.exit_codes


@HARNESSES
@WORLD_SIZES
def test_ranks_that_call_different_collectives_are_named_with_their_calls(fail, world_size):
    error, message = fail(_calls_another_collective, world_size)
    cause = _cause(message)
    assert cause.startswith("the ranks called different collectives"), message
    assert f"rank {world_size - 1} in all_reduce" in cause and "rank 0 in all_gather" in cause, message


@pytest.mark.cpu_only(reason="gloo's abort on a size mismatch; NCCL does not check sizes")
@HARNESSES
@WORLD_SIZES
def test_a_size_mismatch_names_the_rank_gloo_aborts_and_why(fail, world_size):
    error, message = fail(_passes_another_size, world_size)
    # gloo aborts the rank that receives the bigger message; the report's first line says so, and
    # gloo's reason (a truncated CI log keeps that line)
    aborted = error.root_cause_rank
    assert _cause(message).startswith(f"rank {aborted} was killed by SIGABRT"), message
    assert "Received data size doesn't match expected size" in _cause(message), message
    assert _exit_code(error, aborted) in (-6, None)


@HARNESSES
def test_a_rank_aborted_by_a_corrupted_heap_is_named_with_glibcs_reason(fail):
    # glibc's message comes before faulthandler's dump of every thread, which alone outgrows a
    # report's tail: the report keeps it and its first line says what killed the rank (ranks send
    # glibc's messages to stderr, which glibc would otherwise write to a terminal no log sees)
    error, message = fail(_corrupts_its_heap, 2)
    assert error.root_cause_rank == 1, message
    assert _cause(message).startswith("rank 1 was killed by SIGABRT: free(): double free detected"), message


@HARNESSES
def test_a_shape_error_under_rowwise_parallel_on_one_rank_names_that_rank_within_seconds(fail):
    # the agreement before the reduction refuses on every rank: the rank with the wrong width is the
    # root cause (the others' "another rank refused" is a consequence), long before any timeout
    error, message, _ = _culprit_named(fail, _rowwise_gets_the_wrong_width, 4,
                                       "rank 3 raised ValueError: RowwiseParallel on '<root>' (Linear): this rank's input has size 3")
    assert "in _rowwise_gets_the_wrong_width" in message.split("[then]")[0], message


@HARNESSES
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_rank_killed_by_sigkill_or_stopped_by_sigstop_is_named_and_what_the_ranks_started_ends(fail, sig, tmp_path):
    # SIGKILL (the OOM killer's) read "exited with code 0" under launch; a stopped rank read the same,
    # after its peers' timeout plus the agent's 30 s wait on a SIGTERM it could not take
    error, message = fail(_starts_a_child_then_signals_itself, 2, sig, str(tmp_path))
    cause = _cause(message)
    assert error.root_cause_rank == 1, message
    if sig == signal.SIGKILL:
        assert cause.startswith("rank 1 was killed by SIGKILL (most often the kernel's OOM killer"), message
        assert _exit_code(error, 1) in (-9, None), error.exit_codes
    else:
        assert cause.startswith("rank 1 was stopped by SIGSTOP"), message
        first = _first_section(message) + message.split("=====")[2]
        assert "in _starts_a_child_then_signals_itself" in first, message  # its stack: where it stopped
    children = [int(path.read_text()) for path in tmp_path.iterdir()]
    assert len(children) == 2, children
    deadline = time.monotonic() + 2
    while (left := [pid for pid in children if process_state(pid) not in (None, "Z")]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"the ranks' own processes outlived the run: {left}"


@HARNESSES
def test_a_rank_that_returns_while_its_peers_wait_in_a_collective_is_named_as_the_one_that_returned_early(fail):
    # launch blamed "different collectives" (its closing barrier), run_on_ranks the waiting rank
    error, message, _ = _culprit_named(fail, _returns_early, 2,
                                       "rank {culprit} returned early: its function returned while rank 0 waited in all_reduce")
    assert error.failed_ranks == [0, 1], message


@HARNESSES
def test_an_exception_that_cannot_print_itself_keeps_its_type_and_50_mib_make_a_report_of_kilobytes(fail):
    # the type was lost (the record itself raised); a 50 MiB message made a 100 MiB report
    error, message, _ = _culprit_named(
        fail, _raises_what_cannot_be_printed_after_a_50_mib_message, 2,
        "rank {culprit} raised test_faults._Unprintable: <the message could not be formatted: "
        "str() raised RuntimeError: this __str__ is broken>")
    assert len(message) < 64 << 10, len(message)
    first = _first_section(message) + message.split("=====")[2]
    assert "ValueError: yyyy" in first and "characters cut ..." in first, message  # the chained message, cut
    assert "raise _Unprintable() from huge" in first, message  # the traceback's ends are kept
    assert "zzzz" in message, message  # the output, cut too


def test_records_and_reports_are_bounded_and_keep_the_type():
    # what each rank records (both harnesses) and what the report quotes, without starting ranks
    record = exception_record(ValueError("m" * (50 << 20)))
    assert len(record["message"]) <= MESSAGE_CHARS and record["message"].startswith("mmm"), len(record["message"])
    outcome = RankOutcome(1, "raised", record=record, output="o" * (50 << 20))
    report = explain("f failed", [RankOutcome(0, "ok"), outcome])
    assert len(report) < 64 << 10 and report.startswith("f failed: rank 1 raised ValueError: mmm"), len(report)
    unprintable = exception_record(_Unprintable())
    assert unprintable["type"] == "test_faults._Unprintable", unprintable
    assert unprintable["message"].startswith("<the message could not be formatted"), unprintable


def test_under_torchrun_the_error_file_keeps_the_type_and_is_bounded(tmp_path):
    class Handler:  # torch's ErrorHandler, writing where torchrun's agent reads
        def _get_error_file_path(self):
            return str(tmp_path / "error.json")

    for exc in (_Unprintable(), ValueError("m" * (50 << 20))):
        record = exception_record(exc)
        _record_for_torchrun(record, Handler)
        written = json.loads((tmp_path / "error.json").read_text())["message"]["message"]
        assert written.startswith(f"{record['type']}: ") and len(written) < 2 * MESSAGE_CHARS, written[:200]


@HARNESSES
def test_the_raising_rank_comes_first_in_20_of_20_runs(fail):
    # the race the old launcher lost 3 times in 5: the peer's "Connection closed" first
    causes = [(error.root_cause_rank, _cause(message)[:40]) for error, message in (fail(_raises_mid_collective, 2) for _ in range(20))]
    assert causes == [(1, "rank 1 raised ValueError: boom on rank 1")] * 20, causes
    assert run_on_ranks(_sums_ranks, 2) == [1.0] * 2  # and a fresh pool works


# ------------------------------------------------------------------------ torch_tp.launch only


@WORLD_SIZES
@pytest.mark.parametrize("fault", [_calls_another_collective, _passes_another_size], ids=["op", "size"])
def test_launch_with_check_collectives_names_the_odd_rank_before_anything_is_sent(world_size, fault):
    error, message = _launch_failure(fault, world_size, check_collectives=True)
    culprit = world_size - 1
    odd_call = "ALLREDUCE Float[4]" if fault is _calls_another_collective else "ALLREDUCE Float[1000]"
    usual_call = "ALLGATHER Float[4]" if fault is _calls_another_collective else "ALLREDUCE Float[4]"
    cause = _cause(message)
    assert "found by torch's collective check before the call" in cause, message
    assert odd_call in cause and usual_call in cause, message
    if world_size > 2:  # with two ranks there is no majority to tell the odd one
        assert error.root_cause_rank == culprit, message
        assert cause.startswith(f"rank {culprit} called {odd_call}, unlike ranks 0, 1, 2 ({usual_call})"), message


def test_launch_returns_quietly_and_gives_back_the_signal_handlers_the_agent_replaced():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert launch(_sums_ranks, nproc=2) is None
    assert {sig: signal.getsignal(sig) for sig in before} == before  # Ctrl-C is KeyboardInterrupt again


@pytest.mark.slow
def test_under_torchrun_the_agent_names_the_rank_that_raised_not_its_peer():
    # launch records the rank's exception in the agent's error file: torchrun prints its traceback
    job = pathlib.Path(__file__).with_name("fault_job.py")
    done = run_script("-m", "torch.distributed.run", "--nproc-per-node", "2", str(job), "torchrun", "-",
                      timeout=120, check=False)
    assert done.returncode != 0
    root_cause = done.stderr.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root_cause, done.stderr
    assert "ValueError: boom under torchrun" in root_cause, done.stderr


def test_a_rank_the_agent_stopped_before_it_wrote_its_pid_file_reads_as_stopped_not_as_a_cause(tmp_path, monkeypatch):
    """The agent's SIGTERM can reach a peer while it still starts (a culprit that fails at once):
    its exit code comes from the agent's process context, and it reads as stopped by the launcher,
    not as a rank that exited with code 0 before its function returned (the root cause)."""
    from types import SimpleNamespace

    from torch_tp import launch as launch_module

    monkeypatch.setattr(launch_module, "_STACK_WAIT", 0.0)
    watch = launch_module._RankWatch(str(tmp_path), 2)
    watch.by_rank.update({0: SimpleNamespace(exitcode=-signal.SIGTERM), 1: SimpleNamespace(exitcode=None)})
    assert watch.exit_codes() == {0: -signal.SIGTERM}
    outcome = launch_module._outcome(str(tmp_path), 0, -signal.SIGTERM)
    assert outcome.state == "running" and not outcome.is_cause
