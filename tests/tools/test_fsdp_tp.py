"""2-D parallelism (FSDP2 over dp x torch_tp over tp) equals the single-process model.

The zoo Llama under ``parallelize_module`` on ``mesh["tp"]`` (with and without
``checkpoint_by_pattern``) and ``fully_shard_by_pattern`` on the (dp 2, tp 2) mesh trains
like one process on the whole batch: each dp rank takes its half of the batch, FSDP2
averages the gradients over dp, and every loss, gradient and parameter (full tensors)
matches through 3 AdamW steps. The bytes each rank holds are what ``predict_placements``
says, and misuse raises errors naming the pattern, the mesh dim or the right order.
"""

import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from torch_tp import (
    ColwiseParallel,
    RowwiseParallel,
    checkpoint_by_pattern,
    fully_shard_by_pattern,
    init_parameters,
    parallelize_module,
    predict_placements,
    save_collectives_and_matmuls,
)
from torch_tp.models.llama import Transformer, tensor_parallel_plan
from torch_tp.testing import (
    TOL,
    assert_params_and_grads_match,
    assert_trains_like,
    full_tensor,
    mesh_2x2,
    on_ranks,
    small_llama,
    small_llama_args,
    tolerance,
)

ARGS = small_llama_args()
# small enough that the Llama's matrices shard over dp and its norm weights (32) do not
MIN_SIZE = 256
BATCH = 4  # split over dp
# AdamW divides by sqrt(v): float32 summation-order noise on tiny gradients becomes a
# visible step, so parameters after a step get a looser tolerance than gradients.
STEP_TOL = dict(rtol=1e-4, atol=1e-4)


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _two_d_llama(mesh, *, sequence_parallel, checkpoint, tie_embeddings=False):
    model = small_llama(seed=0, tie_embeddings=tie_embeddings)
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=sequence_parallel))
    if checkpoint is not None:
        checkpoint_by_pattern(model, "layers.*", policy=save_collectives_and_matmuls if checkpoint == "selective" else None)
    fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=MIN_SIZE)
    return model, reference


def _train_and_compare(model, reference, dp_mesh, steps=3):
    """Each dp rank runs its slice of the batch; its logits and loss, and all grads, match the reference's."""
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    batches = ((torch.randint(0, ARGS.vocab_size, (BATCH, 8)), torch.randint(0, ARGS.vocab_size, (BATCH, 8)))
               for _ in range(steps + 1))
    step = iter(range(steps + 1))

    def loss_fn(logits, targets):  # the model's logits are this dp rank's rows only
        return _loss(logits, targets if len(logits) == BATCH else targets[rows])

    def params_within_step_tol(out, ref_out):
        assert_params_and_grads_match(model, reference, **STEP_TOL, what=f"step {next(step)}")

    # each dp rank's logits and loss on its rows equal the reference's on them (so their dp mean is the
    # whole batch's loss); gradients at TOL's rtol, parameters at STEP_TOL. After AdamW steps the
    # parameters differ by float32 summation order (up to STEP_TOL), so the later steps' logits do
    # too: 2.8e-5 at step 3 on an AMD EPYC (4 ranks, tied embeddings), hence atol 1e-4
    losses = assert_trains_like(model, reference, batches, loss_fn, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                                rtol=TOL["rtol"], atol=STEP_TOL["atol"], params=False, module_inputs=lambda tokens: tokens[rows],
                                expected_output=lambda logits: logits[rows], check=params_within_step_tol)
    assert losses[0] != losses[-1]


@pytest.mark.parametrize(
    "sequence_parallel, checkpoint, tie_embeddings",
    [(False, None, False), (True, "full", False), (True, "selective", False), (True, None, True)],
    ids=["tp", "sp-full-checkpoint", "sp-selective-checkpoint", "sp-tied-embeddings"],
)
@on_ranks(4)
def test_2d_llama_matches_single_process_through_3_adamw_steps(sequence_parallel, checkpoint, tie_embeddings):
    mesh = mesh_2x2()
    model, reference = _two_d_llama(mesh, sequence_parallel=sequence_parallel, checkpoint=checkpoint, tie_embeddings=tie_embeddings)
    if tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    assert all(isinstance(p, DTensor) for n, p in model.named_parameters() if "norm" not in n)
    _train_and_compare(model, reference, mesh["dp"])


@pytest.mark.parametrize(
    "sequence_parallel, checkpoint", [(False, False), (True, False), (True, True)], ids=["tp", "sp", "sp-selective-checkpoint"]
)
@on_ranks(4)
def test_2d_llama_with_compiled_blocks_matches_single_process_with_no_graph_break(sequence_parallel, checkpoint):
    # torchtitan's order: TP, then each block compiled, then FSDP2 (its hooks run outside the
    # compiled blocks). The embedding's output enters the first compiled block: an async
    # redistribute there broke the backward in torch 2.13 (see _layouts.redistribute_to).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mesh = mesh_2x2()
    model = small_llama(seed=0)
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=sequence_parallel))
    if checkpoint:
        checkpoint_by_pattern(model, "layers.*", policy=save_collectives_and_matmuls)
    for block in model.layers:
        block.compile(backend="aot_eager", fullgraph=True)
    fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=MIN_SIZE)
    # the blocks compile in the first forward and backward; one AdamW step and the step after it
    # show the compiled blocks train on (3 steps: the eager test above, same layouts)
    _train_and_compare(model, reference, mesh["dp"], steps=1)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= len(model.layers)  # the blocks did compile


@on_ranks(4)
def test_meta_built_model_materialized_after_fsdp_trains_like_one_process():
    # the meta flow: shapes only, TP, FSDP2, then to_empty + init_parameters replace every tensor;
    # the replicated norms' gradients must still be averaged over dp (a hook on the meta tensors was lost)
    mesh = mesh_2x2()
    reference = init_parameters(small_llama(seed=0), seed=3)
    with torch.device("meta"):
        model = Transformer(ARGS)
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=True))
    fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=MIN_SIZE)
    model.to_empty(device="cpu")
    init_parameters(model, seed=3)
    _train_and_compare(model, reference, mesh["dp"])


@pytest.mark.parametrize("dp, tp", [(4, 1), (1, 4)], ids=["fsdp-only-4x1", "tp-only-1x4"])
@on_ranks(4)
def test_1x4_and_4x1_meshes_match_single_process(dp, tp):
    model = small_llama(seed=0)
    reference = copy.deepcopy(model)
    if tp == 1:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        dp_mesh = mesh
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
        parallelize_module(model, mesh["tp"], tensor_parallel_plan())
    fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=MIN_SIZE)
    _train_and_compare(model, reference, dp_mesh, steps=1)


@on_ranks(4)
def test_bfloat16_mixed_precision_computes_in_bfloat16_and_keeps_float32_gradients():
    # every parameter sharded (min_weight_size=1), so FSDP2 casts them all
    mesh = mesh_2x2()
    model = small_llama(seed=0)
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=True))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=1, mp_policy=policy)
    dp_rank = mesh["dp"].get_local_rank()
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, 8))
    targets = torch.randint(0, ARGS.vocab_size, (BATCH, 8))
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)
    logits = model(tokens[rows])
    assert logits.dtype == torch.bfloat16
    loss = _loss(logits.float(), targets[rows])
    loss.backward()
    ref_loss = _loss(reference(tokens), targets)
    ref_loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=mesh["dp"].get_group())
    torch.testing.assert_close(mean / 2, ref_loss.detach(), **tolerance(torch.bfloat16))
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.dtype == param.grad.dtype == torch.float32, name
        torch.testing.assert_close(full_tensor(param.grad), ref.grad, **tolerance(torch.bfloat16), msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------ predicted = measured


class _Odd(nn.Module):
    """Shapes that exercise every rule on 2 x 2: a free dim, the TP dim shared with dp
    (5 columns do not divide by dp 2), a dim that divides nowhere, and a small bias."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(5, 16)  # weight (16, 5) Shard(0) by tp: dim 0 split by tp and dp
        self.down = nn.Linear(16, 5)  # weight (5, 16) Shard(1): dim 1 split by both; bias (5,) no dim
        self.mix = nn.Linear(5, 16, bias=False)  # not in the plan: Shard(0) over dp

    def forward(self, x):
        return self.mix(self.down(F.relu(self.up(x))))


_ODD_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def _local_bytes(param):
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


def _shard_as_predicted(build, plan, patterns, min_size):
    """Apply TP + FSDP to ``build()`` and check every parameter's shard against the prediction."""
    mesh = mesh_2x2()
    with torch.device("meta"):
        report = predict_placements(build(), {"dp": 2, "tp": 2}, plan, patterns, min_weight_size=min_size)
    model = build()
    parallelize_module(model, mesh["tp"], plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard_by_pattern(model, mesh, patterns, min_weight_size=min_size)
    unshardable = [line for line in report.replicated_over_dp() if "no divisible dim" in line]
    messages = [str(w.message) for w in caught]
    assert [m.count("no divisible dim") for m in messages] == ([len(unshardable)] if unshardable else []), messages
    rank = dist.get_rank()
    rows = {row.path: row for row in report if row.name is not None}
    for name, param in model.named_parameters():
        row = rows[name]
        local = param.to_local() if isinstance(param, DTensor) else param
        assert (tuple(local.shape), _local_bytes(param)) == (row.local_shapes[rank], row.bytes_per_rank[rank]), name
        if row.dp_placement == Replicate():  # ignored by FSDP: as TP left it
            assert not isinstance(param, DTensor) or param.device_mesh.ndim == 1, name
        else:
            assert param.placements[0].dim == row.dp_placement.dim, name
    assert sum(_local_bytes(p) for p in model.parameters()) == report.bytes_per_rank()[rank]
    return report


@on_ranks(4)
def test_per_rank_parameter_bytes_equal_the_prediction_on_the_llama():
    report = _shard_as_predicted(lambda: Transformer(ARGS), tensor_parallel_plan(), "layers.*", MIN_SIZE)
    assert report.bytes_per_rank()[0] < sum(p.numel() * 4 for p in small_llama().parameters()) / 3


def _seeded_odd():
    torch.manual_seed(0)
    return _Odd()


@on_ranks(4)
def test_odd_shapes_shard_as_predicted_and_train_like_one_process():
    report = _shard_as_predicted(_seeded_odd, _ODD_PLAN, ["mix", "up"], 4)
    dp_of = {row.path: (row.dp_placement, row.note) for row in report if row.name}
    assert dp_of["up.weight"][0] == Shard(0) and dp_of["down.weight"][0] == Shard(1)  # shared with tp
    assert dp_of["down.bias"] == (Replicate(), "no divisible dim: (5,) has no dim divisible by dp 2")
    assert dp_of["mix.weight"] == (Shard(0), "")
    reference = _seeded_odd()
    model = _seeded_odd()
    mesh = mesh_2x2()
    parallelize_module(model, mesh["tp"], _ODD_PLAN)
    with pytest.warns(UserWarning, match=r"down\.bias: no divisible dim"):
        fully_shard_by_pattern(model, mesh, ["mix", "up"], min_weight_size=4)
    rows = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    batches = ((torch.randn(4, 5), None) for _ in range(2))
    assert_trains_like(model, reference, batches, lambda y, _: y.square().mean(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                       **TOL, module_inputs=lambda x: x[rows], expected_output=lambda y: y[rows])


@on_ranks(4)
def test_matched_units_that_shard_nothing_over_dp_are_reported():
    # the default min_weight_size (2**18 elements) is above every weight of a small model: each
    # block would stay whole on every dp rank, silently; now a warning names them
    model = small_llama(seed=0)
    mesh = mesh_2x2()
    parallelize_module(model, mesh["tp"], tensor_parallel_plan())
    with pytest.warns(UserWarning, match=r"2 of the 2 matched units \('layers.0', 'layers.1'\) shard nothing over dp"):
        fully_shard_by_pattern(model, mesh, "layers.*")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with a size the weights pass, no word
        fully_shard_by_pattern(parallelize_module(small_llama(seed=0), mesh["tp"], tensor_parallel_plan()), mesh,
                               "layers.*", min_weight_size=MIN_SIZE)


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "case", ["mixed precision with replicated parameters", "tie across units", "unmatched pattern", "no dp dim", "min size 0", "min size float", "min size bool", "fsdp before tp", "fsdp twice", "tp after fsdp", "checkpoint after fsdp"]
)
@on_ranks(4)
def test_bad_input_raises_a_named_error(case):
    mesh = mesh_2x2()
    model = small_llama(seed=0)
    fsdp = dict(min_weight_size=MIN_SIZE)
    if case not in ("fsdp before tp", "tp after fsdp", "checkpoint after fsdp"):
        parallelize_module(model, mesh["tp"], tensor_parallel_plan())
    if case == "mixed precision with replicated parameters":
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"MixedPrecisionPolicy\(param_dtype=torch.bfloat16\)\): FSDP2 casts only the parameters it shards, and 5 stay replicated .* layers\.0\.attention_norm\.weight \(too small: 32 < min_weight_size 256 elements\)"):
            fully_shard_by_pattern(model, mesh, "layers.*", mp_policy=bf16, **fsdp)
    elif case == "tie across units":
        model = small_llama(seed=0, tie_embeddings=True)
        parallelize_module(model, mesh["tp"], tensor_parallel_plan())
        with pytest.raises(ValueError, match=r"parameter 'tok_embeddings\.weight' is shared \(tied\) with 'output\.weight', but the patterns put them in different FSDP units \('<root>' and 'output'\)"):
            fully_shard_by_pattern(model, mesh, ["layers.*", "output"], **fsdp)
    elif case == "unmatched pattern":
        with pytest.raises(ValueError, match=r"fully_shard_by_pattern pattern 'layer\.\*' matched no submodule.*'layers"):
            fully_shard_by_pattern(model, mesh, ["layers.*", "layer.*"], **fsdp)
    elif case == "no dp dim":
        with pytest.raises(ValueError, match=r"mesh has dims \('dp', 'tp'\) but needs a data-parallel dim named 'batch'"):
            fully_shard_by_pattern(model, mesh, "layers.*", dp_dim="batch", **fsdp)
    elif case.startswith("min size"):
        value = {"min size 0": 0, "min size float": 1.5, "min size bool": True}[case]
        with pytest.raises(ValueError, match=rf"fully_shard_by_pattern\(min_weight_size={value!r}\).*positive int"):
            fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=value)
    elif case == "fsdp before tp":
        with pytest.raises(ValueError, match=r"no parameter of Transformer is tensor-parallel; call parallelize_module\(model, mesh\['tp'\], plan\) first"):
            fully_shard_by_pattern(model, mesh, "layers.*", **fsdp)
    elif case == "fsdp twice":
        fully_shard_by_pattern(model, mesh, "layers.*", **fsdp)
        with pytest.raises(ValueError, match=r"fully_shard_by_pattern: module '<root>' \(FSDPTransformer\) already went through fully_shard; apply the transforms in the order parallelize_module \(TP\), then checkpoint_by_pattern, then fully_shard_by_pattern"):
            fully_shard_by_pattern(model, mesh, "layers.*", **fsdp)
    elif case == "tp after fsdp":
        fully_shard_by_pattern(model, mesh["dp"], "layers.*", **fsdp)
        with pytest.raises(ValueError, match=r"parallelize_module: module '<root>' .* already went through fully_shard; apply the transforms in the order parallelize_module \(TP\), then"):
            parallelize_module(model, mesh["tp"], tensor_parallel_plan())
    elif case == "checkpoint after fsdp":
        fully_shard_by_pattern(model, mesh["dp"], "layers.*", **fsdp)
        with pytest.raises(ValueError, match=r"checkpoint_by_pattern: module '<root>' .* already went through fully_shard"):
            checkpoint_by_pattern(model, "layers.*")
