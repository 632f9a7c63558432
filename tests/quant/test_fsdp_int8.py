"""FSDP2 (``fully_shard``) of models with frozen ``Int8SymmetricTensor`` weights, against one process.

Every linear weight of the small Llama is int8 (frozen); embeddings and norms are float and
train. FSDP2 shards every weight over the data-parallel ranks and gathers each block's before
its forward: the int8 weights travel as int8 ``qdata`` + float32 row scales through
``Int8SymmetricTensor.fsdp_pre_all_gather`` / ``fsdp_post_all_gather``. Each rank feeds the
same batch, so the FSDP model must match the single-process one exactly (up to summation
order) through 3 AdamW steps: logits, loss, every float gradient; the int8 weights unchanged.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from torch_tp import checkpoint_by_pattern, fully_shard_by_pattern, parallelize_module, save_collectives_and_matmuls
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.quant import Int8SymmetricTensor
from torch_tp.testing import TOL, assert_trains_like, full_tensor, mesh_2x2, on_ranks, quantize_weights, small_llama, tp_mesh


def _int8_llama(seed=0, **overrides):
    return quantize_weights(small_llama(seed=seed, **overrides), embeddings=False)


def _wrap(model, mesh, **kwargs):
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _dim1(param):  # shard every 2-D weight on its columns (the int8 scales broadcast there)
    return Shard(1) if param.ndim == 2 else Shard(0)


def _adamw_on_float(params):
    return torch.optim.AdamW([p for p in params if not isinstance(_local(p), Int8SymmetricTensor)], lr=1e-2)


def _local(param):
    return param.to_local() if isinstance(param, DTensor) else param


def _train_and_compare(model, reference, steps=3, tol=TOL):
    gen = torch.Generator().manual_seed(1)
    batches = ((torch.randint(0, 64, (2, 8), generator=gen), None) for _ in range(steps))

    def int8_weights_frozen_and_unchanged(out, ref_out):
        named = dict(model.named_parameters())
        for name, ref_param in reference.named_parameters():
            if isinstance(ref_param, Int8SymmetricTensor):
                param = named[name]
                assert param.grad is None and ref_param.grad is None, name
                whole = full_tensor(param)
                assert torch.equal(whole.qdata, ref_param.qdata) and torch.equal(whole.scale, ref_param.scale), name

    # logits, loss and every gradient (the int8 weights': None on both) each step
    assert_trains_like(model, reference, batches, lambda logits, _: logits.square().mean(), optimizer=_adamw_on_float,
                       **tol, params=False, check=int8_weights_frozen_and_unchanged)


@pytest.mark.parametrize("shard_on", ["rows", "columns"])
@on_ranks(2, 4)
def test_int8_llama_under_fsdp2_matches_one_process_through_3_adamw_steps(shard_on):
    reference, model = _int8_llama(), _int8_llama()
    kwargs = {"shard_placement_fn": _dim1} if shard_on == "columns" else {}
    _wrap(model, tp_mesh(), **kwargs)
    weight = model.layers[0].attention.wq.weight
    assert isinstance(weight, DTensor) and isinstance(weight.to_local(), Int8SymmetricTensor)
    assert weight.placements == ((Shard(1),) if shard_on == "columns" else (Shard(0),))
    assert weight.to_local().qdata.numel() * dist.get_world_size() == weight.numel()  # each rank its share
    _train_and_compare(model, reference)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
@on_ranks(4)
def test_int8_llama_on_dp2_x_tp2_matches_one_process_through_3_adamw_steps(checkpoint, compiled):
    # TP shards the int8 weights on tp (colwise rows, rowwise columns), FSDP2 the local shards on dp;
    # compiled: each block compiled (fullgraph) before FSDP2, as torchtitan orders it
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    reference, model = _int8_llama(), _int8_llama()
    mesh = mesh_2x2()
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=True))
    if checkpoint:
        checkpoint_by_pattern(model, "layers.*", policy=save_collectives_and_matmuls if compiled else None)
    if compiled:
        for block in model.layers:
            block.compile(backend="aot_eager", fullgraph=True)
    fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=256)
    weight = model.layers[0].attention.wq.weight
    assert isinstance(weight.to_local(), Int8SymmetricTensor) and weight.to_local().qdata.numel() * 4 == weight.numel()
    _train_and_compare(model, reference)
    assert dict(counters["graph_break"]) == {}


@on_ranks(2)
def test_weights_kept_gathered_between_forward_and_backward_and_bfloat16_compute():
    reference, model = _int8_llama(), _int8_llama()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _wrap(model, tp_mesh(), reshard_after_forward=False, mp_policy=policy)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second all-gather writes into the tensors the first one built
        logits = model(tokens)
        assert logits.dtype == torch.bfloat16
        logits.float().square().mean().backward()
    reference = reference.to(torch.bfloat16)
    ref_logits = reference(tokens)
    torch.testing.assert_close(logits.float(), ref_logits.float(), rtol=2e-2, atol=2e-2)


def _gathered_bytes(step):
    """Bytes FSDP2's all-gathers receive on this rank while ``step`` runs."""
    total, gather = [0], dist.all_gather_single  # what FSDP2's DefaultAllGather calls (torch 2.13)

    @functools.wraps(gather)
    def counting(output, *args, **kwargs):
        total[0] += output.numel() * output.element_size()
        return gather(output, *args, **kwargs)

    dist.all_gather_single = counting
    try:
        step()
    finally:
        dist.all_gather_single = gather
    assert total[0] > 0, "no all-gather seen: FSDP2 calls another function in this torch"
    return total[0]


@pytest.mark.parametrize("shard_on", ["rows", "columns"])
@on_ranks(2, 4)
def test_int8_all_gathers_move_at_most_0_27x_the_float32_bytes(shard_on):
    # rows of 256 columns: a row moves 256 int8 bytes + a 4-byte scale, 0.254x its 1024 float32 bytes
    make = lambda: nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(3)))  # noqa: E731
    kwargs = {"shard_placement_fn": _dim1} if shard_on == "columns" else {}
    moved = {}
    for kind in ("float32", "int8"):
        torch.manual_seed(0)
        model = make()
        if kind == "int8":
            quantize_weights(model)
        else:
            model.requires_grad_(False)  # frozen too: the same all-gathers, no reduce-scatter
        for layer in model:
            fully_shard(layer, mesh=tp_mesh(), **kwargs)
        x = torch.randn(4, 256)
        moved[kind] = _gathered_bytes(lambda: model(x))
    ratio = moved["int8"] / moved["float32"]
    # on rows, each row's scale travels with it; on columns every rank holds all the scales already
    expected = (256 + 4) / (256 * 4) if shard_on == "rows" else 256 / (256 * 4)
    assert ratio == pytest.approx(expected, rel=1e-6), (moved, ratio)
    assert ratio <= 0.27, (moved, ratio)


@on_ranks(4)
def test_rows_that_do_not_divide_raise_naming_the_shape_on_every_rank():
    model = nn.Sequential(nn.Linear(8, 6, bias=False))  # 6 rows on 4 ranks: FSDP2 would pad
    quantize_weights(model)
    fully_shard(model, mesh=tp_mesh())
    with pytest.raises(NotImplementedError, match=r"shape \(6, 8\): dim 0 \(6\) does not divide by the 4"):
        model(torch.randn(2, 8))
