"""Gaps found by running upstream's own tensor-parallel tests with the import switched to torch_tp.

* ``RowwiseParallel`` on ``nn.Embedding`` runs under upstream's single-process
  ``LocalTensorMode`` harness (one process simulating every rank, the mesh coordinate a
  symbolic int), with the single-process output and gradient;
* upstream code imports the ``PrepareModule*`` styles from ``.style``;
* ``PrepareModule*`` layouts that do not pair up raise upstream's exception type;
* ``src_data_rank=None`` moves no parameter bytes: only the agreement's 8-byte digest.
"""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as upstream
import torch.distributed.tensor.parallel.style as upstream_style
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import torch_tp.parallel
from torch_tp import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch_tp.testing import TOL, assert_comm_counts, comm_counts, on_ranks, tp_mesh, world_size, world_sizes

# --------------------------------------------------- RowwiseParallel under LocalTensorMode


@contextlib.contextmanager
def _local_tensor_world(size):
    """Upstream's ``LocalDTensorTestBase`` in this process: a ``"fake"`` default group of
    ``size`` ranks, a mesh built outside the mode, then ``LocalTensorMode`` over every rank.
    Yields the mesh and the mode."""
    dist.init_process_group("fake", rank=0, world_size=size)
    try:
        mesh = init_device_mesh("cpu", (size,))
        with LocalTensorMode(size) as mode:
            yield mesh, mode
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ids_made", ["outside", "per_rank"])
@world_sizes(2, 4)
def test_rowwise_embedding_under_upstreams_local_tensor_mode_matches_one_process(world_size, ids_made):
    # 21 rows: 11/10 on 2 ranks, 6/6/6/3 on 4; the padding row 7 lies on rank 0 or 1.
    # Runs in the test process: LocalTensorMode simulates the ranks there, over a "fake"
    # group, and a harness rank already belongs to a gloo group of its own. The ids are a
    # plain tensor made before the mode, or (as upstream's tests make them) a LocalTensor
    # holding each simulated rank's copy.
    torch.manual_seed(0)
    reference = nn.Embedding(21, 8, padding_idx=7)
    module = copy.deepcopy(reference)
    ids = torch.randint(0, 21, (3, 5))
    ids[0, 0] = 7
    expected = reference(ids)
    expected.square().sum().backward()
    with _local_tensor_world(world_size) as (mesh, mode):
        sharded = parallelize_module(module, mesh, RowwiseParallel())
        out = sharded(ids if ids_made == "outside" else mode.rank_map(lambda _: ids.clone()))
        out.square().sum().backward()
        grad = sharded.weight.grad
        placements, full_grad = grad.placements, grad.full_tensor()
    # reconcile(): every simulated rank's value, which must be one and the same tensor
    torch.testing.assert_close(out.reconcile(), expected, **TOL)
    assert placements == (Shard(0),), placements
    torch.testing.assert_close(full_grad.reconcile(), reference.weight.grad, **TOL)


# ----------------------------------------------- the PrepareModule* styles from ``.style``


@pytest.mark.parametrize("name", upstream_style.__all__)
def test_every_name_of_upstreams_style_module_imports_from_torch_tps_style_module(name):
    from torch_tp.parallel import style

    assert getattr(style, name) is getattr(torch_tp.parallel, name)


def test_prepare_styles_import_from_style_as_in_upstream_code():
    from torch_tp.parallel.style import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput

    assert PrepareModuleInput is torch_tp.parallel.PrepareModuleInput
    assert PrepareModuleOutput is torch_tp.parallel.PrepareModuleOutput
    assert PrepareModuleInputOutput is torch_tp.parallel.PrepareModuleInputOutput


# ------------------------------------------------- layouts that do not pair up: upstream's type


# case: (style name, keyword arguments, what torch_tp's message says)
_UNPAIRED = {
    "input_lengths": ("PrepareModuleInput", dict(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(),)),
                      "input_layouts has 2 entries but desired_input_layouts has 1"),
    "input_without_desired": ("PrepareModuleInput", dict(input_layouts=Shard(1)),
                              "input_layouts is set but desired_input_layouts is not"),
    "kwarg_lengths": ("PrepareModuleInput", dict(input_kwarg_layouts={"a": Shard(0)},
                                                 desired_input_kwarg_layouts={"a": Replicate(), "b": Replicate()}),
                      r"desired_input_kwarg_layouts names \['b'\]"),
    "output_lengths": ("PrepareModuleOutput", dict(output_layouts=(Shard(1), None), desired_output_layouts=Replicate()),
                       "output_layouts has 2 entries but desired_output_layouts has 1"),
    "input_output_lengths": ("PrepareModuleInputOutput", dict(
        input_layouts=Shard(1), desired_input_layouts=(Replicate(), None),
        output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        "input_layouts has 1 entries but desired_input_layouts has 2"),
}


@pytest.mark.parametrize("case", list(_UNPAIRED))
def test_prepare_layouts_that_do_not_pair_up_raise_upstreams_exception_type(case):
    name, kwargs, message = _UNPAIRED[case]
    with pytest.raises(Exception) as by_upstream:
        getattr(upstream, name)(**kwargs)
    assert type(by_upstream.value) is AssertionError  # what upstream's except clauses catch
    with pytest.raises(AssertionError, match=message) as by_torch_tp:
        getattr(torch_tp.parallel, name)(**kwargs)
    assert isinstance(by_torch_tp.value, ValueError)  # and torch_tp's own type for a bad argument


# ------------------------------------------------------ src_data_rank=None: no parameter bytes


class _CollectiveTensors(TorchDispatchMode):
    """Records each c10d collective this rank runs: ``(op, bytes of every tensor it is handed)``.

    The bytes count inputs and outputs alike: an all-gather of an 8-byte value on N ranks
    counts ``8 * (N + 1)``."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.calls.append((func.__name__, sum(t.numel() * t.element_size() for t in tensors)))
        return func(*args, **(kwargs or {}))


# every style that moves parameter data: a vocab-sharded table, both Linear styles, a norm
_PARAMETER_MOVING_PLAN = {
    "0": RowwiseParallel(), "1": ColwiseParallel(), "2": RowwiseParallel(), "3": SequenceParallel()
}


def _model():
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8))


def _parallelize_recording(src_data_rank):
    model = _model()
    with CommDebugMode() as mode, _CollectiveTensors() as recorded:
        parallelize_module(model, tp_mesh(), _PARAMETER_MOVING_PLAN, src_data_rank=src_data_rank)
    return model, comm_counts(mode), recorded.calls


@on_ranks(2, 4)
def test_src_data_rank_none_communicates_only_the_agreement_digest_no_parameter_bytes():
    _, counts, calls = _parallelize_recording(None)
    assert_comm_counts(counts, {"all_gather": 1}, "parallelize_module(src_data_rank=None)")
    # the agreement: one int64 digest per rank, gathered from every rank
    assert calls == [("allgather_.default", 8 * (world_size() + 1))], calls


@on_ranks(2)
def test_the_collective_byte_count_sees_the_parameters_moved_by_src_data_rank_0():
    model, counts, calls = _parallelize_recording(0)
    assert counts["all_gather"] == 1 and counts["scatter"] + counts["broadcast"] > 1, counts
    # every rank receives at least its own shard of every parameter (rank 0 also sends the rest)
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert sum(nbytes for op, nbytes in calls if op != "allgather_.default") >= local_bytes, calls
