"""The tutorials and the main job run as users run them, and print what they promise: each
tutorial ends with its verdict line against one process (``torch_tp._verdict``; its mismatch
path: ``tests/scripts/test_verdict.py``)."""

import re

import pytest

from torch_tp.testing import ScriptRun

# subprocess runs of seconds to minutes: `pytest -m "not slow"` leaves them out
pytestmark = pytest.mark.slow


PATTERN_PLANS = ScriptRun("tutorials/pattern_plans.py")
MAIN_JOB = ScriptRun("-m", "torch_tp.demo")
LLAMA_TUTORIAL = ScriptRun("tutorials/llama_tensor_parallel.py")
INT8_TUTORIAL = ScriptRun("tutorials/int8_tensor_parallel.py")
MAIN_JOB_TORCHRUN_OVERLAP = ScriptRun("-m", "torch.distributed.run", "--nproc-per-node", "2",
                                      "-m", "torch_tp.demo", "--overlap", "--steps", "5")
SPATIAL_CONV_TUTORIAL = ScriptRun("tutorials/spatial_conv_parallel.py")
SPATIAL_UNET_TUTORIAL = ScriptRun("tutorials/spatial_unet.py")
FSDP_TP_TUTORIAL = ScriptRun("tutorials/fsdp_tp_2d.py")
RESUME_TUTORIAL = ScriptRun("tutorials/resume_training.py")

G = r"(\S+)"  # a number in a verdict line


def _verdict(out: str, pattern: str) -> list[float]:
    """The one verdict line, last, matching ``pattern``; returns its numbers (the differences)."""
    assert len(re.findall(r"match(es)? one process", out)) == 1, out
    last = out.rstrip().splitlines()[-1]
    found = re.fullmatch(r"matches one process \(" + pattern + r"\)", last)
    assert found, out
    return [float(g) for g in found.groups()]


@pytest.mark.script_runs(PATTERN_PLANS)
def test_pattern_plans_tutorial_matches_single_process_and_shows_the_typo_error():
    out = PATTERN_PLANS.result().stdout
    assert "typo in a plan key -> ValueError" in out and "layer.0.self.query" in out
    assert "layer.0.self.out.weight      (Shard(dim=1),)" in out
    diff = float(re.search(r"max \|parallel - single process\| = (\S+)", out).group(1))
    assert diff < 1e-5, out
    (largest,) = _verdict(out, rf"outputs: largest difference {G}, tolerance 1e-05")
    assert largest < 1e-5, out


@pytest.mark.script_runs(MAIN_JOB)
def test_main_job_explains_trains_with_progress_and_matches_single_process():
    result = MAIN_JOB.result()  # exactly the README's main job
    out = result.stdout
    assert "Warning" not in result.stderr, result.stderr  # nothing for a user to interpret
    assert "2 ranks (gloo), tensor + sequence parallel, 30 steps" in out
    assert re.search(r"^parameter +style +global +placement", out, flags=re.M)
    assert "layers.1.feed_forward.w2.weight  RowwiseParallel" in out
    assert "[##############################]  30/30 loss" in out  # the progress bar, finished
    assert out.count("parameter bytes per rank") == 1 and "(rank order)" not in out, out  # once, in bytes
    worst = float(re.search(r"max relative difference (\S+) over 30 steps", out).group(1))
    assert "loss curve matches the single-process run" in out and worst <= 1e-3, out
    first, last = map(float, re.search(r"loss (\S+) -> (\S+);", out).groups())
    assert last < first / 2, out  # it actually learns
    per_rank = re.search(r"parameter bytes per rank: rank 0: (\d+), rank 1: (\d+)", out).groups()
    assert per_rank[0] == per_rank[1]
    assert "collectives per training step (forward + backward): 11 all_gather_into_tensor, 10 reduce_scatter_tensor" in out


@pytest.mark.script_runs(LLAMA_TUTORIAL)
def test_llama_tutorial_runs_from_meta_device_to_training_like_one_process():
    out = LLAMA_TUTORIAL.result().stdout
    assert "output.weight" in out and "step 9: loss" in out
    losses = [float(x) for x in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 10 and losses[-1] < losses[0]
    pairs = re.findall(r"^step \d+: loss (\S+) \(single process (\S+)\)$", out, flags=re.M)
    assert len(pairs) == 10 and all(abs(float(a) - float(b)) <= 1e-4 for a, b in pairs), out  # 4 decimals
    (largest,) = _verdict(out, rf"loss per step: largest difference {G}, tolerance 1e-05 relative")
    assert largest <= 1e-5 * max(losses), out
    held = {int(n) for n in re.findall(r"rank \d holds (\d+) parameter bytes", out)}
    assert len(held) == 1


@pytest.mark.script_runs(INT8_TUTORIAL)
def test_int8_tutorial_shards_int8_weights_matches_unsharded_and_compiles():
    out = INT8_TUTORIAL.result().stdout
    assert "compiling the sharded int8 model (fullgraph=True) with inductor (the first compile can take minutes)" in out
    assert re.search(r"^compiled in \d+\.\d s$", out, flags=re.M), out
    errors = re.findall(
        r"rank \d: vs float model (\S+), vs unsharded int8 model (\S+), compiled vs eager (\S+)$", out, flags=re.M
    )
    assert len(errors) == 2, out
    for vs_float, vs_unsharded, compiled_vs_eager in (map(float, e) for e in errors):
        assert 1e-4 < vs_float <= 1e-2, out  # quantized (not zero), and close to the float model
        assert vs_unsharded <= 1e-5 and compiled_vs_eager <= 1e-5, out
    held = re.findall(r"rank \d: (\d+) bytes, float32 would take (\d+) ", out)
    assert len(held) == 2, out
    for nbytes, as_float32 in held:
        assert 0 < int(nbytes) <= 0.3 * int(as_float32), out  # int8 + one scale per row: ~1/4
    unsharded, compiled = _verdict(
        out, rf"logits vs the unsharded int8 model \(relative error\): largest difference {G}, tolerance 1e-05; "
             rf"compiled logits vs eager \(relative error\): largest difference {G}, tolerance 1e-05")
    assert unsharded <= 1e-5 and compiled <= 1e-5, out


@pytest.mark.script_runs(MAIN_JOB_TORCHRUN_OVERLAP)
def test_main_job_under_torchrun_with_overlap_uses_the_launchers_ranks_and_fused_collectives():
    # `torchrun` is `python -m torch.distributed.run`; gloo on CPU, NCCL where CUDA is. One run
    # checks both: the launcher's ranks (not spawned ones) and the fused collectives of --overlap.
    out = MAIN_JOB_TORCHRUN_OVERLAP.result().stdout
    assert "2 ranks (gloo), tensor + sequence parallel, overlapped (fused all-gather+matmul, matmul+reduce-scatter), 5 steps" in out
    assert "loss curve matches the single-process run" in out, out
    # 9 fused ops forward (per layer: one gather shared by wq/wk/wv, one by w1/w3, and the wo
    # and w2 reduce-scatters; and the output head) and 9 backward, one ring step each at 2
    # ranks. Collectives left: the embedding's reduce-scatter and its backward all-gather,
    # and the all-gather of the logits to Replicate() (unfused: 11 + 10)
    assert (
        "collectives per training step (forward + backward): 18 P2P sends (fused ops), "
        "2 all_gather_into_tensor, 1 reduce_scatter_tensor"
    ) in out, out


@pytest.mark.script_runs(SPATIAL_CONV_TUTORIAL)
def test_spatial_conv_tutorial_trains_like_one_process_and_sends_only_halos():
    out = SPATIAL_CONV_TUTORIAL.result().stdout
    pairs = re.findall(r"step \d: loss (\S+) \(single process (\S+)\)", out)
    assert len(pairs) == 3
    for sharded, single in pairs:
        assert abs(float(sharded) - float(single)) <= 1e-5 * max(1.0, abs(float(single)))
    sent = re.search(r"each rank sends \[(\d+), (\d+)\] bytes of halo; gathering the input would move (\d+)", out)
    halo_left, halo_right, gathered = map(int, sent.groups())
    assert halo_left == halo_right == 2 * 3 * 16 * 4  # one column of a 2x3x16 image per edge
    assert gathered > 40 * halo_left
    _verdict(out, rf"loss per step: largest difference {G}, tolerance 1e-05 \+ 1e-05 x \|one process\|")


@pytest.mark.script_runs(SPATIAL_UNET_TUTORIAL)
def test_spatial_unet_tutorial_segments_on_strips_like_one_process():
    out = SPATIAL_UNET_TUTORIAL.result().stdout
    pairs = re.findall(r"step \d: loss (\S+) \(single process (\S+)\)", out)
    assert len(pairs) == 4
    for sharded, single in pairs:  # float32: summation order (and pooling ties) only
        assert abs(float(sharded) - float(single)) <= 1e-4 * max(1.0, abs(float(single)))
    assert "rank 0 logits strip (1, 3, 32, 96) of the image's (1, 3, 32, 192)" in out
    _verdict(out, rf"loss per step: largest difference {G}, tolerance 0.0001 \+ 0.0001 x \|one process\|")


@pytest.mark.script_runs(FSDP_TP_TUTORIAL)
def test_fsdp_tp_2d_tutorial_predicts_the_bytes_it_holds_and_trains_like_one_process():
    out = FSDP_TP_TUTORIAL.result().stdout
    assert "fsdp units: layers.0, layers.1, <root>" in out, out
    held = re.search(r"rank 0 holds (\d+) parameter bytes \(predicted (\d+)\) of the model's (\d+)", out)
    assert held and held.group(1) == held.group(2) and int(held.group(1)) < int(held.group(3)) / 3, out
    pairs = re.findall(r"step \d: loss (\S+) \(single process (\S+)\)", out)
    assert len(pairs) == 3, out
    for sharded, single in pairs:  # float32: summation order only
        assert abs(float(sharded) - float(single)) <= 1e-5 * max(1.0, abs(float(single))), (sharded, single)
    _verdict(out, rf"loss per step: largest difference {G}, tolerance 1e-05 \+ 1e-05 x \|one process\|")


@pytest.mark.script_runs(RESUME_TUTORIAL)
def test_resume_tutorial_ends_with_the_parameters_of_the_job_that_never_stopped():
    out = RESUME_TUTORIAL.result().stdout
    assert "job 1 (dies after step 5): trained steps 1-5; newest checkpoint: step-00000003" in out, out
    assert "job 2 (started again): resumed from step-00000003, trained steps 4-8; newest checkpoint: step-00000006" in out, out
    assert "job 3 (never stopped): trained steps 1-8" in out, out
    digests = re.findall(r"parameters sha256 ([0-9a-f]{64})$", out, flags=re.M)
    assert len(digests) == 3 and digests[1] == digests[2] != digests[0], out
    differing, largest = _verdict(
        out, rf"resumed job's parameters vs the never-stopped job's \(SHA-256 digests that differ\): largest "
             rf"difference {G}, tolerance exact; never-stopped job's loss per step: largest difference {G}, "
             r"tolerance 1e-05 relative")
    assert differing == 0 and largest <= 1e-4, out
