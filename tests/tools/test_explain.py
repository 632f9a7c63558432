"""explain_plan: rows for every matched path, shapes and bytes per rank, flags; nothing changes."""


import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from torch_tp import ColwiseParallel, RowwiseParallel, explain_plan, parallelize_module
from torch_tp._module_state import state_of
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.tools.explain import shard_sizes
from torch_tp.parallel.plan import resolve_plan
from torch_tp.testing import on_ranks, tp_mesh

# vocab 100 does not divide by 8 ranks: the embedding and output head are uneven.
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=8, vocab_size=100, ffn_hidden=96)


def _meta_model():
    with torch.device("meta"):
        return Transformer(ARGS)


def _state(model):
    return [(n, p.device.type, type(p), tuple(p.shape)) for n, p in model.named_parameters()], [
        (len(m._forward_hooks), len(m._forward_pre_hooks), state_of(m) is not None) for m in model.modules()
    ]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_explain_names_every_matched_path_with_shapes_and_bytes_per_rank(sequence_parallel):
    model = _meta_model()
    plan = tensor_parallel_plan(sequence_parallel=sequence_parallel)
    before = _state(model)
    report = explain_plan(model, 8, plan)
    assert _state(model) == before  # nothing changed, nothing materialized

    matched = {entry.path: type(entry.style).__name__ for entry in resolve_plan(model, plan)}
    for path, style in matched.items():
        assert any(row.path == path or row.module_path == path for row in report if row.style == style), path
    by_path = {row.path: row for row in report}
    assert set(by_path) >= {name for name, _ in model.named_parameters()}

    wq = by_path["layers.1.attention.wq.weight"]
    assert (wq.style, wq.global_shape, wq.placement) == ("ColwiseParallel", (64, 64), Shard(0))
    assert wq.local_shapes == ((8, 64),) * 8 and wq.bytes_per_rank == (8 * 64 * 4,) * 8 and wq.note == ""
    w2 = by_path["layers.0.feed_forward.w2.weight"]
    assert (w2.placement, w2.local_shapes[0]) == (Shard(1), (64, 12))
    emb = by_path["tok_embeddings.weight"]
    assert emb.local_shapes == ((13, 64),) * 7 + ((9, 64),)
    assert emb.note == "uneven: 100 over 8 ranks -> 13, 13, 13, 13, 13, 13, 13, 9"
    norm = by_path["norm.weight"]
    if sequence_parallel:
        assert (norm.style, norm.placement) == ("SequenceParallel", Replicate())
    else:
        assert (norm.style, norm.placement, norm.local_shapes[0]) == ("-", None, (64,))
    attention = by_path["layers.0.attention"]
    assert (attention.style, attention.name, attention.bytes_per_rank) == ("PrepareModuleInput", None, (0,) * 8)

    total = sum(p.numel() * 4 for p in model.parameters())
    assert sum(report.bytes_per_rank()) == total + 7 * sum(
        r.bytes_per_rank[0] for r in report if r.placement == Replicate() or (r.name and r.placement is None)
    )


def test_explain_table_prints_one_line_per_row_and_the_totals():
    text = str(explain_plan(_meta_model(), 8, tensor_parallel_plan()))
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["parameter", "style", "global", "placement"]
    assert any(line.startswith("tok_embeddings.weight") and "(13, 64) x7 | (9, 64) x1" in line and "uneven" in line for line in lines)
    assert lines[-1].startswith("parameter bytes per rank:")


def test_explain_flags_empty_shards_and_unhandled_modules_without_raising():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 4)))
    report = explain_plan(model, 4, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    by_path = {row.path: row for row in report}
    assert by_path["0"].note.startswith("error: ColwiseParallel cannot shard '0' (Linear).weight")
    assert by_path["2"].note.startswith("error: RowwiseParallel cannot shard '2' (Sequential)")
    assert by_path["2.0.weight"].style == "-"  # left as it is, and listed
    assert len(report.problems()) == 2
    assert shard_sizes(3, 4) == (1, 1, 1, 0)


def test_explain_rejects_unmatched_keys_like_parallelize_module():
    with pytest.raises(ValueError, match="'layers.*.attention.wz' matched no submodule"):
        explain_plan(_meta_model(), 2, {"layers.*.attention.wz": ColwiseParallel()})


def test_explain_with_replicate_unplanned_params_shows_replicate():
    report = explain_plan(_meta_model(), 2, tensor_parallel_plan(), replicate_unplanned_params=True)
    assert {row.placement for row in report if row.style == "-"} == {Replicate()}


@on_ranks(2, 4)
def test_explained_local_shapes_and_bytes_equal_what_parallelize_module_allocates():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    report = explain_plan(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=True))
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=True))
    rank = torch.distributed.get_rank()
    measured = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    nbytes = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    predicted = {row.path: row.local_shapes[rank] for row in report if row.name}
    assert measured == predicted
    assert nbytes == report.bytes_per_rank()[rank]
