"""Predicted dp placements: the rules on shapes, and the 2-D report on a ``meta`` model.

No ranks: the prediction reads shapes only. That the real 2-D model holds exactly these
shards is checked on 4 ranks in ``test_fsdp_tp.py``.
"""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from torch_tp import explain_plan, predict_placements
from torch_tp.models.llama import Transformer, tensor_parallel_plan
from torch_tp.tools import predict_dp_placement
from torch_tp.parallel.rules import packed_shard
from torch_tp.testing import small_llama_args

ARGS = small_llama_args()


def _predict(shape, tp_placement=None, *, dp=2, tp=2, min_size=1):
    return predict_dp_placement(shape, tp_placement, dp_size=dp, tp_size=tp, min_weight_size=min_size)


def test_the_largest_divisible_dim_is_sharded():
    assert _predict((6, 64, 16), dp=4, tp=1) == (Shard(1), "")


def test_a_dim_that_does_not_divide_is_passed_over_for_a_smaller_one():
    assert _predict((10, 8), dp=4, tp=1) == (Shard(1), "")


def test_equal_dims_pick_the_lower_one():
    assert _predict((32, 32), dp=2, tp=1) == (Shard(0), "")


def test_the_dim_tp_shards_is_skipped():
    assert _predict((64, 32), Shard(0)) == (Shard(1), "")
    assert _predict((32, 64), Shard(-1)) == (Shard(0), "")


def test_tp_on_one_rank_takes_no_dim():
    assert _predict((64, 32), Shard(0), tp=1) == (Shard(0), "")


def test_the_tp_dim_is_shared_when_it_divides_by_tp_times_dp():
    assert _predict((64, 5), Shard(0), dp=4, tp=2) == (Shard(0), "dim 0 split by tp and dp: 64 % (2 * 4) == 0")


def test_the_tp_dim_that_does_not_divide_by_the_product_leaves_the_parameter_replicated():
    placement, note = _predict((12, 5), Shard(0), dp=4, tp=2)
    assert placement == Replicate()
    assert note == "no divisible dim: (12, 5) has no dim divisible by dp 4 (dim 0, taken by tp, would need 12 % (2 * 4) == 0)"


def test_a_packed_tp_dim_is_not_split_further():
    placement, note = _predict((64, 5), packed_shard(0, 2), dp=2, tp=2)
    assert placement == Replicate() and note.endswith("(dim 0 is a packed tp shard, not split further)")


def test_a_parameter_under_the_minimum_size_stays_replicated():
    assert _predict((16, 16), min_size=257) == (Replicate(), "too small: 256 < min_weight_size 257 elements")
    assert _predict((16, 16), min_size=256) == (Shard(0), "")


def test_a_parameter_with_no_divisible_dim_stays_replicated():
    assert _predict((7, 5), dp=2, tp=1) == (Replicate(), "no divisible dim: (7, 5) has no dim divisible by dp 2")


# --------------------------------------------------------------------- the report


def _meta_llama():
    with torch.device("meta"):
        return Transformer(ARGS)


def test_report_lists_both_axes_local_shapes_and_bytes_of_every_rank_on_a_meta_model():
    report = predict_placements(_meta_llama(), {"dp": 2, "tp": 2}, tensor_parallel_plan(), "layers.*", min_weight_size=256)
    rows = {row.path: row for row in report if row.name}
    w2 = rows["layers.1.feed_forward.w2.weight"]  # (32, 48), tp Shard(1) -> dp Shard(0)
    assert (w2.placement, w2.dp_placement, w2.local_shapes, w2.bytes_per_rank) == (Shard(1), Shard(0), ((16, 24),) * 4, (16 * 24 * 4,) * 4)
    norm = rows["norm.weight"]
    assert (norm.dp_placement, norm.local_shapes[3], norm.note) == (Replicate(), (32,), "too small: 32 < min_weight_size 256 elements")
    assert report.fsdp_units == ["layers.0", "layers.1", ""]
    total = sum(p.numel() * 4 for p in _meta_llama().parameters())
    norms = 5 * 32 * 4  # replicated on both axes
    assert report.bytes_per_rank() == ((total - norms) // 4 + norms,) * 4
    assert all(p.is_meta for p in _meta_llama().parameters())


def test_report_table_shows_both_placements_and_why():
    text = str(predict_placements(_meta_llama(), {"dp": 2, "tp": 2}, tensor_parallel_plan(), "layers.*", min_weight_size=256))
    lines = text.splitlines()
    assert lines[0].split()[:6] == ["parameter", "style", "global", "placement", "(dp,", "tp)"]
    assert any(line.startswith("layers.0.attention.wq.weight") and "(Shard(1), Shard(0))" in line and "(16, 16) x4" in line for line in lines)
    assert any(line.startswith("norm.weight") and "(Replicate(), plain)" in line and line.endswith("too small: 32 < min_weight_size 256 elements") for line in lines)
    assert lines[-2].startswith("parameter bytes per rank:") and lines[-1] == "fsdp units: layers.0, layers.1, <root>"


def test_explain_plan_on_a_2d_mesh_is_the_same_report():
    plan = tensor_parallel_plan()
    predicted = predict_placements(_meta_llama(), {"dp": 2, "tp": 2}, plan, "layers.*", min_weight_size=256)
    explained = explain_plan(_meta_llama(), {"dp": 2, "tp": 2}, plan, fsdp_patterns="layers.*", min_weight_size=256)
    assert explained.rows == predicted.rows and str(explained) == str(predicted)


def test_explain_plan_on_a_2d_mesh_without_fsdp_replicates_over_dp():
    report = explain_plan(_meta_llama(), {"dp": 2, "tp": 4}, tensor_parallel_plan())
    assert {row.dp_placement for row in report if row.name} == {Replicate()}
    assert report.num_ranks == 8 and report.fsdp_units is None


def test_fsdp_only_prediction_on_an_int_mesh():
    report = predict_placements(_meta_llama(), 4, None, "layers.*", min_weight_size=256)
    wq = {row.path: row for row in report}["layers.0.attention.wq.weight"]
    assert (wq.placement, wq.dp_placement, wq.local_shapes) == (None, Shard(0), ((8, 32),) * 4)


@pytest.mark.parametrize(
    "mesh, plan, patterns, min_size, error, match",
    [
        ({"dp": 2, "tp": 2}, "plan", ["layers.*", "layer.*"], 256, ValueError, r"predict_placements fsdp pattern 'layer\.\*' matched no submodule of Transformer"),
        ({"data": 2, "tp": 2}, "plan", "layers.*", 256, ValueError, r"the mesh has dims \('data', 'tp'\) but needs a data-parallel dim named 'dp'"),
        ({"dp": 2, "tp": 2}, "plan", "layers.*", 0, ValueError, r"predict_placements\(min_weight_size=0\): .* must be a positive int"),
        ({"dp": 2, "tp": 2}, "plan", "layers.*", 2.5, ValueError, r"min_weight_size=2.5"),
        (4, "plan", "layers.*", 256, ValueError, r"a tensor-parallel plan needs a mesh with a 'tp' dim"),
        ({"dp": 2, "tp": 2}, None, "layers.*", 256, ValueError, r"the mesh has a tp dim 'tp' of size 2 but no parallelize_plan"),
        ({"dp": 0, "tp": 2}, "plan", "layers.*", 256, ValueError, r"mesh dim 'dp' must have a positive int size, got 0"),
        ("2x2", "plan", "layers.*", 256, TypeError, r"predict_placements needs a DeviceMesh, a mapping"),
    ],
    ids=["unmatched pattern", "no dp dim", "min size 0", "min size float", "plan on dp only", "tp without plan", "dp size 0", "mesh string"],
)
def test_bad_prediction_input_raises_a_named_error(mesh, plan, patterns, min_size, error, match):
    plan = tensor_parallel_plan() if plan == "plan" else plan
    with pytest.raises(error, match=match):
        predict_placements(_meta_llama(), mesh, plan, patterns, min_weight_size=min_size)


def test_fsdp_patterns_on_a_1d_explain_raise():
    with pytest.raises(ValueError, match=r"explain_plan\(fsdp_patterns=...\) needs a 2-D mesh"):
        explain_plan(_meta_llama(), 4, tensor_parallel_plan(), fsdp_patterns="layers.*")
