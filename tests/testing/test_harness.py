"""Tests of the distributed test harness (torch_tp.testing._dist, ._on_ranks and ._device).

Rank functions live at module level here: workers import this module by the
name pytest gave it, using the sys.path the parent sends with each task.
"""

import inspect
import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp.testing import _dist
from torch_tp.testing import (
    RankFailure,
    assert_comm_counts,
    comm_counts,
    mesh_2x2,
    on_ranks,
    rank,
    run_on_ranks,
    tp_mesh,
    world_size,
    world_sizes,
)
from torch_tp.testing._device import (
    DEVICE_ENV,
    DeviceSelectionError,
    backend_for,
    device_skip_reason,
    harness_device,
    item_skip_reason,
    to_current_device,
    validate_device,
)


# ---------------------------------------------------------------- rank functions


def _all_reduce_rank_values():
    t = torch.tensor([float(rank())])
    dist.all_reduce(t)
    mesh = tp_mesh()
    return rank(), world_size(), t.item(), mesh.size(), mesh.mesh_dim_names, tp_mesh() is mesh


def _device_of_the_pool():
    return dist.get_backend(), tp_mesh().device_type, torch.get_default_device().type, torch.ones(1).device.type


def _row_sums_on_2x2_mesh():
    mesh = mesh_2x2()
    t = torch.tensor([float(rank())])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    return tuple(mesh.shape), mesh.mesh_dim_names, t.item(), mesh_2x2() is mesh


def _mesh_2x2_error():
    try:
        mesh_2x2()
    except RuntimeError as exc:
        return str(exc)
    return None


def _pid_and_fresh_rng():
    return os.getpid(), torch.rand(3)


def _explode():
    raise ValueError("boom-rank1")


def _rank1_raises_while_rank0_waits():
    if rank() == 1:
        print("rank 1 about to fail")
        _explode()
    dist.all_reduce(torch.ones(1, device="cpu"))  # rank 1 never joins


def _rank0_skips_the_collective():
    # CPU tensors in the failure cases: over gloo (on cuda too, "cpu:gloo,cuda:nccl") a
    # collective blocks the host, where NCCL's returns once queued
    if rank() != 0:
        dist.all_reduce(torch.ones(1, device="cpu"))
    return rank()


def _rank1_exits_with_code_3():
    if rank() == 1:
        os._exit(3)
    return rank()


def _print_and_return_rank():
    print("hello from a worker")
    os.write(2, b"raw bytes on fd 2\n")
    return rank()


def _redistribute_counts():
    mesh = tp_mesh()
    full = torch.arange(16.0).reshape(4, 4)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    with CommDebugMode() as mode:
        replicated = sharded.redistribute(mesh, [Replicate()])
    assert_comm_counts(mode.get_comm_counts(), {"all_gather_into_tensor": 1}, "Shard(0)->Replicate")
    try:
        assert_comm_counts(mode.get_comm_counts(), {"all_reduce": 1}, "wrong expectation")
        mismatch = None
    except AssertionError as exc:
        mismatch = str(exc)
    return comm_counts(mode), mismatch, torch.equal(replicated.to_local(), full)


# ---------------------------------------------------------------- happy paths


@world_sizes(1, 2, 4)
def test_all_reduce_and_tp_mesh_on_every_rank(world_size, request):
    assert request.node.callspec.id == f"ws{world_size}"
    results = run_on_ranks(_all_reduce_rank_values, world_size)
    expected_sum = float(sum(range(world_size)))
    assert results == [(r, world_size, expected_sum, world_size, ("tp",), True) for r in range(world_size)]


def test_the_pool_computes_on_the_harness_device():
    device = harness_device()
    assert run_on_ranks(_device_of_the_pool, 1) == [(backend_for(device), device, device, device)]


def test_mesh_2x2_sums_within_tp_rows():
    results = run_on_ranks(_row_sums_on_2x2_mesh, 4)
    row_sums = [1.0, 1.0, 5.0, 5.0]  # rows are ranks {0, 1} and {2, 3}
    assert results == [((2, 2), ("dp", "tp"), row_sums[r], True) for r in range(4)]


def test_mesh_2x2_needs_four_ranks():
    messages = run_on_ranks(_mesh_2x2_error, 2)
    assert all(m is not None and "world_size 4" in m for m in messages), messages


def test_pool_is_reused_and_rng_is_reseeded_per_task():
    first = run_on_ranks(_pid_and_fresh_rng, 2)
    second = run_on_ranks(_pid_and_fresh_rng, 2)
    assert [pid for pid, _ in first] == [pid for pid, _ in second]
    assert len({pid for pid, _ in first}) == 2
    expected = torch.rand(3, generator=torch.Generator(torch.get_default_device()).manual_seed(0))
    for _, values in first + second:
        torch.testing.assert_close(values, expected)


def test_args_kwargs_and_tensor_results_round_trip():
    results = run_on_ranks(torch.add, 2, torch.ones(2), other=torch.full((2,), 2.0))
    for value in results:
        torch.testing.assert_close(value, torch.full((2,), 3.0))


def test_function_from_a_directory_added_to_sys_path_at_runtime(tmp_path, monkeypatch):
    (tmp_path / "harness_runtime_module.py").write_text("def answer(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import harness_runtime_module

    assert run_on_ranks(harness_runtime_module.answer, 2, 21) == [42, 42]


def test_worker_output_goes_to_logs_not_to_the_test(capfd):
    assert run_on_ranks(_print_and_return_rank, 2) == [0, 1]
    captured = capfd.readouterr()
    assert "hello from a worker" not in captured.out + captured.err
    assert "raw bytes" not in captured.out + captured.err


def test_assert_comm_counts_with_real_comm_debug_mode():
    for counts, mismatch, values_ok in run_on_ranks(_redistribute_counts, 2):
        assert counts == {"all_gather_into_tensor": 1}
        assert values_ok
        assert "wrong expectation" in mismatch
        assert "{'all_reduce': 1}" in mismatch and "{'all_gather_into_tensor': 1}" in mismatch


def test_assert_comm_counts_normalizes_keys_without_workers():
    import torch.distributed._functional_collectives  # noqa: F401  (registers c10d_functional)

    counts = {
        torch.ops.c10d_functional.all_reduce: 2,
        torch.ops.c10d.allreduce_: 1,
        torch.ops.c10d_functional.reduce_scatter_tensor.default: 1,
        torch.ops.c10d_functional.all_to_all_single: 0,
    }
    assert_comm_counts(counts, {"all_reduce": 3, "reduce_scatter_tensor": 1}, "mixed keys")
    assert_comm_counts({}, {"all_reduce": 0}, "zero means absent")
    with pytest.raises(AssertionError, match="row-wise forward"):
        assert_comm_counts(counts, {"all_reduce": 2}, "row-wise forward")


# ---------------------------------------------------------------- misuse


def test_unpicklable_function_is_rejected_before_spawning():
    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(lambda: 1, 2)


@pytest.mark.parametrize("helper", [rank, world_size, tp_mesh, mesh_2x2], ids=lambda f: f.__name__)
def test_rank_helpers_refuse_to_run_in_the_parent(helper):
    with pytest.raises(RuntimeError, match="inside a function run by run_on_ranks"):
        helper()


def test_invalid_world_size_is_rejected():
    with pytest.raises(ValueError, match="world_size"):
        run_on_ranks(_print_and_return_rank, 0)


# ---------------------------------------------------------------- failures


def _pids(size):
    return [pid for pid, _ in run_on_ranks(_pid_and_fresh_rng, size)]


def test_raising_rank_reports_its_traceback_and_the_pool_is_respawned():
    pids_before = _pids(2)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_rank1_raises_while_rank0_waits, 2)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1: raised" in message
    assert "boom-rank1" in message
    assert 'raise ValueError("boom-rank1")' in message  # the source line of the traceback
    assert "in _explode" in message
    assert "rank 1 about to fail" in message  # rank 1's output tail
    # rank 1 left the pool with its error: rank 0's all_reduce failed at once, reported after
    # the cause, with the line it waited on (not after the parent's grace period, with a stack)
    assert "rank 0: raised [then]" in message, message
    assert 'dist.all_reduce(torch.ones(1, device="cpu"))  # rank 1 never joins' in message.split("rank 0: raised [then]")[1]
    assert info.value.failed_ranks == [0, 1] and info.value.root_cause_rank == 1, message
    assert elapsed < 20, elapsed

    pids_after = _pids(2)
    assert set(pids_after).isdisjoint(pids_before)


def test_hung_rank_times_out_with_its_stack():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_rank0_skips_the_collective, 2, timeout=5.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < 30, elapsed
    assert "timed out after 5 s" in message
    # rank 0 returned without the all_reduce rank 1 waits in: it is the root cause
    assert info.value.failed_ranks == [0, 1] and info.value.root_cause_rank == 0, message
    assert "on world_size=2: rank 0 returned early" in message.splitlines()[0], message
    assert "rank 1: did not answer" in message
    assert "_rank0_skips_the_collective" in message  # from rank 1's stack dump
    assert run_on_ranks(_print_and_return_rank, 2) == [0, 1]


def test_dead_worker_reports_its_exit_code():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_rank1_exits_with_code_3, 2)
    message = str(info.value)
    assert "rank 1: worker process died (exit code 3)" in message
    assert info.value.failed_ranks == [1]
    assert run_on_ranks(_print_and_return_rank, 2) == [0, 1]


def test_the_collectives_list_names_every_collective_of_torch_distributed():
    # a rank that fails inside a collective is a consequence, not a cause; an unlisted one (FSDP2's
    # all_gather_single was) made the peer's "Connection reset" the root cause of a SIGABRT
    import inspect as inspect_module

    from torch.distributed import distributed_c10d

    from torch_tp._supervise.rank_failure import COLLECTIVES

    not_collectives = {"destroy_process_group", "init_process_group", "new_group", "new_subgroups",
                       "new_subgroups_by_enumeration", "shrink_group", "split_group", "record_comm",
                       "supports_complex"}
    public = {name for name, f in vars(distributed_c10d).items() if inspect_module.isfunction(f)
              and f.__module__ == distributed_c10d.__name__ and not name.startswith(("_", "get_", "is_"))}
    assert public - not_collectives - COLLECTIVES == set()


def test_a_peer_lost_anywhere_is_a_symptom_and_the_rank_that_crashed_comes_first():
    # gloo's "Connection reset by peer" surfaces from frames the collectives list does not name
    # (a wait inside a tensor subclass, a DTensor redistribute); the rank that died comes first
    from torch_tp._supervise.rank_failure import exception_record
    from torch_tp._supervise.root_cause import RankOutcome, root_cause

    def wait_somewhere():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41: Connection reset by peer")

    with pytest.raises(RuntimeError) as info:
        wait_somewhere()
    record = exception_record(info.value)
    assert record["symptom"] and record["collective"] is None
    assert not exception_record(RuntimeError("shape mismatch"))["symptom"]
    peer = RankOutcome(1, "raised", record=record)
    crashed = RankOutcome(0, "exited", exit_code=-11)
    assert [o.rank for o in root_cause([peer, crashed])] == [0, 1]


# ---------------------------------------------------------------- on_ranks


@pytest.mark.parametrize("value", [1.0, 3.0])
@on_ranks(2, 4)
def test_on_ranks_runs_the_body_on_every_rank_with_its_parametrized_arguments(value):
    t = torch.tensor([value * (rank() + 1)])
    dist.all_reduce(t)  # hangs (and times out) unless every rank runs the body
    assert t.item() == value * world_size() * (world_size() + 1) / 2


@on_ranks(2)
def test_on_ranks_with_one_world_size_passes_it_to_a_body_that_asks(world_size):
    assert world_size == dist.get_world_size() == 2


def test_on_ranks_parametrizes_world_size_like_world_sizes_and_keeps_the_body_importable():
    test = test_on_ranks_runs_the_body_on_every_rank_with_its_parametrized_arguments
    marks = {m.args[0]: (tuple(m.args[1]), m.kwargs.get("ids")) for m in test.pytestmark}
    assert marks == {"world_size": ((2, 4), ["ws2", "ws4"]), "value": ((1.0, 3.0), None)}
    assert list(inspect.signature(test).parameters) == ["world_size", "value"]
    body = globals()["_test_on_ranks_runs_the_body_on_every_rank_with_its_parametrized_arguments_on_ranks"]
    assert test.__wrapped__ is body and pickle.loads(pickle.dumps(body)) is body  # by reference
    single = test_on_ranks_with_one_world_size_passes_it_to_a_body_that_asks
    assert [(m.args, m.kwargs["ids"]) for m in single.pytestmark] == [(("world_size", (2,)), ["ws2"])]
    assert list(inspect.signature(single).parameters) == ["world_size"]


@on_ranks(2)
def _raises_on_rank_1_under_on_ranks():  # no test_ prefix: pytest does not collect it; the test below calls it
    if rank() == 1:
        print("rank 1 about to fail")
        raise ValueError("boom-on-ranks")


def test_on_ranks_reports_a_failing_rank_with_its_traceback_and_output():
    with pytest.raises(RankFailure) as info:
        _raises_on_rank_1_under_on_ranks(world_size=2)
    message = str(info.value)
    assert info.value.failed_ranks == [1]
    assert f"{__name__}.__raises_on_rank_1_under_on_ranks_on_ranks failed on world_size=2" in message
    assert "rank 1: raised" in message and "rank 0" not in message
    assert 'raise ValueError("boom-on-ranks")' in message  # the body's source line
    assert "rank 1 about to fail" in message  # rank 1's output tail


@on_ranks(2)
def _returns_its_rank():
    return rank()


def test_on_ranks_refuses_a_body_that_returns_values():
    with pytest.raises(TypeError, match=r"returned values \{0: 0, 1: 1\} .*call run_on_ranks"):
        _returns_its_rank(world_size=2)


def test_on_ranks_refuses_nested_functions_and_bad_world_sizes():
    def nested():
        pass

    with pytest.raises(TypeError, match="needs a module-level test function"):
        on_ranks(2)(nested)
    with pytest.raises(ValueError, match="at least one world size"):
        on_ranks()
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        on_ranks(2, 0)


# ---------------------------------------------------------------- the device (TORCH_TP_TEST_DEVICE)


def test_the_device_defaults_to_cpu_and_cuda_needs_cuda():
    for value in (None, "", "cpu", " cpu "):
        assert validate_device(value, cuda_available=False) == "cpu"
        assert validate_device(value, cuda_available=True) == "cpu"
    assert validate_device("cuda", cuda_available=True, cuda_version="12.8") == "cuda"
    assert validate_device("cuda", cuda_available=True, start_method="spawn") == "cuda"


def test_cuda_requested_without_cuda_is_a_startup_error_that_says_what_to_change():
    with pytest.raises(DeviceSelectionError) as cpu_build:
        validate_device("cuda", cuda_available=False, cuda_version=None)
    message = str(cpu_build.value)
    assert message.startswith("TORCH_TP_TEST_DEVICE=cuda, but torch.cuda.is_available() is False: "
                              "this torch is a CPU build"), message
    assert "unset TORCH_TP_TEST_DEVICE (or set it to cpu)" in message, message
    with pytest.raises(DeviceSelectionError, match="no CUDA device is visible to this CUDA 12.8 build"):
        validate_device("cuda", cuda_available=False, cuda_version="12.8")
    with pytest.raises(DeviceSelectionError, match=r"TORCH_TP_START_METHOD=fork: .* set it to spawn"):
        validate_device("cuda", cuda_available=True, start_method="fork")


def test_an_unknown_device_is_a_startup_error_naming_the_choices():
    with pytest.raises(DeviceSelectionError, match=r"TORCH_TP_TEST_DEVICE='xpu' is not a device .* 'cpu', 'cuda'"):
        validate_device("xpu", cuda_available=True)
    with pytest.raises(DeviceSelectionError, match="'cuda:1' is not a device"):  # a type, not one GPU
        validate_device("cuda:1", cuda_available=True)


def test_harness_device_reads_the_environment(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert harness_device() == "cpu"
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert harness_device() == "cpu"
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(DeviceSelectionError, match="'tpu' is not a device"):
        harness_device()
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    if torch.cuda.is_available():
        assert harness_device() == "cuda"
    else:
        with pytest.raises(DeviceSelectionError, match="torch.cuda.is_available"):
            harness_device()


def _conftest(request):
    return next(p for p in request.config.pluginmanager.get_plugins()
                if getattr(p, "__file__", "").endswith(os.path.join("tests", "conftest.py")))


def test_conftest_stops_pytest_at_startup_on_a_bad_device(request, monkeypatch):
    class Config:
        stash = {}

    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(pytest.UsageError, match="^DeviceSelectionError: TORCH_TP_TEST_DEVICE='tpu'"):
        _conftest(request).pytest_configure(Config())
    assert Config.stash == {}


def test_nothing_is_skipped_on_cpu():
    assert device_skip_reason("cpu", 0, world_size=64, script_run=True, cpu_only="a CPU kernel") is None


def test_cuda_skips_world_sizes_beyond_its_gpus():
    assert device_skip_reason("cuda", 1, world_size=2) == "world size 2 needs 2 GPUs; TORCH_TP_TEST_DEVICE=cuda sees 1"
    assert device_skip_reason("cuda", 0, world_size=1) == "world size 1 needs 1 GPU; TORCH_TP_TEST_DEVICE=cuda sees 0"
    assert device_skip_reason("cuda", 1, world_size=1) is None
    assert device_skip_reason("cuda", 8, world_size=4) is None
    assert device_skip_reason("cuda", 1) is None  # an in-process test


def test_cuda_skips_script_runs_and_cpu_only_tests_with_their_reasons():
    script = device_skip_reason("cuda", 8, script_run=True)
    assert script is not None and "the CPU job runs those" in script, script
    only = device_skip_reason("cuda", 8, world_size=2, script_run=True, cpu_only="gloo's events")
    assert only == "CPU only: gloo's events (TORCH_TP_TEST_DEVICE=cuda)"


class _Item:
    """What item_skip_reason reads of a collected pytest item: markers and callspec params."""

    def __init__(self, *marks, **params):
        self.marks = {m.mark.name: m.mark for m in marks}
        if params:
            self.callspec = type("CallSpec", (), {"params": params})()

    def get_closest_marker(self, name):
        return self.marks.get(name)


def test_item_skip_reason_reads_markers_and_the_world_size_parameter():
    assert item_skip_reason(_Item(world_size=4), "cuda", 2) == "world size 4 needs 4 GPUs; TORCH_TP_TEST_DEVICE=cuda sees 2"
    assert item_skip_reason(_Item(world_size=2, dtype="float32"), "cuda", 2) is None
    assert item_skip_reason(_Item(), "cuda", 0) is None
    assert item_skip_reason(_Item(pytest.mark.slow), "cuda", 8).startswith("a script run")
    assert item_skip_reason(_Item(pytest.mark.script_runs("run")), "cuda", 8).startswith("a script run")
    assert item_skip_reason(_Item(pytest.mark.cpu_only(reason="a CPU kernel")), "cuda", 8).startswith("CPU only: a CPU kernel (")
    assert item_skip_reason(_Item(pytest.mark.cpu_only("positional")), "cuda", 8).startswith("CPU only: positional (")
    assert item_skip_reason(_Item(pytest.mark.cpu_only), "cuda", 8).startswith("CPU only: marked cpu_only (")
    assert item_skip_reason(_Item(pytest.mark.slow, world_size=64), "cpu", 0) is None


def test_run_on_ranks_skips_a_test_asking_for_more_gpus_than_there_are(monkeypatch):
    monkeypatch.setattr(_dist, "device_count", lambda device: 1)
    _dist._require_devices_for(4, "cpu")  # nothing to check on CPU
    _dist._require_devices_for(1, "cuda")
    with pytest.raises(pytest.skip.Exception, match="world size 2 needs 2 GPUs; TORCH_TP_TEST_DEVICE=cuda sees 1"):
        _dist._require_devices_for(2, "cuda")
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    with pytest.raises(RuntimeError, match="run_on_ranks: world size 2 needs 2 GPUs"):
        _dist._require_devices_for(2, "cuda")


def test_cuda_pools_use_nccl_and_keep_gloo_for_the_cpu():
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda") == "cpu:gloo,cuda:nccl"


def test_values_crossing_a_pipe_on_cpu_are_left_as_they_are():
    x = torch.ones(2, device="cpu")
    moved = to_current_device({"a": [x, 3], "b": (x, "text")})
    assert moved["a"][0] is x and moved["b"][0] is x and moved["a"][1] == 3 and moved["b"][1] == "text"


def test_the_terminal_summary_names_the_device_unless_it_is_cpu(request, monkeypatch):
    from torch_tp.testing import _device

    conftest, lines = _conftest(request), []
    reporter = type("Reporter", (), {"write_line": lambda self, line: lines.append(line)})()
    conftest.pytest_terminal_summary(reporter, 0, type("Config", (), {"stash": {conftest._DEVICE: "cpu"}})())
    assert lines == []
    monkeypatch.setattr(_device, "device_count", lambda device: 2)
    stash = {conftest._DEVICE: "cuda", conftest._SKIPPED_FOR_DEVICE: 5}
    conftest.pytest_terminal_summary(reporter, 0, type("Config", (), {"stash": stash})())
    assert lines == ["torch_tp: the tests ran on cuda (TORCH_TP_TEST_DEVICE=cuda, 2 cuda devices visible); "
                     "5 skipped at collection for the device (-rs: why)"]


@pytest.fixture
def own_script_plan():
    """The session's planned script runs set aside while a test plans its own (restored after,
    and the session's chain of runs restarted)."""
    from torch_tp.testing import ScriptRun

    with ScriptRun._lock:
        saved = ScriptRun._planned, ScriptRun._in_flight
    yield ScriptRun
    with ScriptRun._lock:
        ScriptRun._planned, ScriptRun._in_flight = saved
        ScriptRun._start_planned(ScriptRun._planned)


def test_planned_scripts_run_one_at_a_time_beside_the_tests_then_two_once_read(own_script_plan, tmp_path):
    ScriptRun = own_script_plan
    log = tmp_path / "log"
    code = "import sys, time; open(sys.argv[1], 'a').write(sys.argv[2] + ' start\\n'); time.sleep(0.3); open(sys.argv[1], 'a').write(sys.argv[2] + ' end\\n')"
    runs = [ScriptRun("-c", code, str(log), name) for name in "abc"]
    ScriptRun.plan(runs)
    ScriptRun.begin()
    assert [run._thread is not None for run in runs] == [True, False, False]  # one beside the tests
    runs[0]._thread.join()
    deadline = time.monotonic() + 10
    while runs[1]._thread is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runs[1]._thread is not None and runs[2]._thread is None  # the next took its place
    runs[1]._thread.join()
    assert runs[1].result().returncode == 0  # a test reads: two at a time from now on
    runs[2].result()
    lines = log.read_text().split()
    assert lines[:4] == ["a", "start", "a", "end"] and lines[4:8] == ["b", "start", "b", "end"], lines


@pytest.mark.parametrize("backend", ["fake", None], ids=["fake", "no group"])
def test_wire_bytes_refuses_a_group_gloo_does_not_serve_alone(backend):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch_tp.testing import wire_bytes

    if backend is not None:
        dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match=r"torch_tp\.testing\.wire_bytes counts what gloo is handed.*communication_of"):
            wire_bytes(lambda: None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
