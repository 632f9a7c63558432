"""Int8SymmetricTensor inside DTensor, on real gloo ranks: sharding, moving int8 bytes, and the TP styles.

For quantized weights the reference is the *unsharded quantized* model: where no reduction
is involved the sharded result is bit-identical; where rowwise layers sum partial results
float32 agrees to 1e-5 and bfloat16 to its own rounding (8-bit mantissa, see
``torch_tp.testing.tolerance``).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp import ColwiseParallel, RowwiseParallel, explain_plan, parallelize_module
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.quant import Int8SymmetricTensor, quantize_module_weight
from torch_tp.testing import (
    TOL, comm_counts, local_chunk, on_ranks, quantize_weights, rank, tolerance, tp_mesh, wire_bytes, world_size,
)

# Sharded vs unsharded quantized: float32 differs only by summation order; bfloat16 sums
# partial results rounded to 8 bits, so it gets bfloat16-sized tolerances (tolerance(dtype)).
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


def _relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ------------------------------------------------------------------ distribute / from_local / full


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=["rows", "features", "replicate"])
@pytest.mark.parametrize("src", [0, None], ids=["src0", "srcNone"])
@pytest.mark.parametrize("shape", [(8, 16), (10, 18)], ids=["even", "uneven"])
@on_ranks(2, 4)
def test_distribute_tensor_shards_rows_features_or_replicates_with_and_without_src_rank(shape, src, placement):
    rows, cols = shape
    torch.manual_seed(dist.get_rank())  # rank-dependent values: src_data_rank decides who wins
    w = torch.randn(rows, cols)
    mine = Int8SymmetricTensor.from_hp(w).dequantize()
    from_rank0 = mine.clone()
    dist.broadcast(from_rank0, src=0)
    # replicating with src_data_rank broadcasts into the input in place (DTensor does the
    # same to plain tensors): quantize again rather than reuse the one behind ``mine``
    q = Int8SymmetricTensor.from_hp(w)
    d = distribute_tensor(q, tp_mesh(), [placement], src_data_rank=src)
    local = d.to_local()
    assert isinstance(local, Int8SymmetricTensor)
    source = from_rank0 if src == 0 else mine
    expected = source if isinstance(placement, Replicate) else local_chunk(source, placement.dim)
    assert local.shape == expected.shape, local.shape
    if isinstance(placement, Shard) and placement.dim == 1:
        assert local.scale.shape == (rows, 1)  # feature split: every row keeps its scale
    torch.testing.assert_close(local.dequantize(), expected, rtol=0, atol=0)
    if src == 0:
        full = d.full_tensor()
        assert isinstance(full, Int8SymmetricTensor)
        torch.testing.assert_close(full.dequantize(), from_rank0, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [0, 1])
@on_ranks(2, 4)
def test_from_local_shards_rebuild_the_exact_quantized_weight(dim):
    q = Int8SymmetricTensor.from_hp(torch.randn(10, 16))
    local = torch.chunk(q, dist.get_world_size(), dim=dim)[dist.get_rank()]
    d = DTensor.from_local(local, tp_mesh(), [Shard(dim)], shape=q.shape, stride=q.stride())
    assert d.shape == q.shape
    torch.testing.assert_close(d.full_tensor().dequantize(), q.dequantize(), rtol=0, atol=0)


@on_ranks(2)
def test_quantizing_an_already_parallelized_weight_is_a_clear_error():
    layer = parallelize_module(nn.Linear(8, 4), tp_mesh(), ColwiseParallel())
    with pytest.raises(TypeError, match="already a DTensor .* quantize the model first"):
        quantize_module_weight(layer)


@on_ranks(2, 4)
def test_gradients_reach_activations_and_biases_through_sharded_quantized_layers():
    torch.manual_seed(0)
    quantized = quantize_weights(nn.Sequential(nn.Linear(16, 40), nn.ReLU(), nn.Linear(40, 16)))
    sharded = parallelize_module(copy.deepcopy(quantized), tp_mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(3, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    sharded(x).pow(2).sum().backward()
    quantized(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    for (name, p), (_, ref) in zip(sharded.named_parameters(), quantized.named_parameters()):
        if p.requires_grad:  # biases train; int8 weights are frozen
            torch.testing.assert_close(p.grad.full_tensor(), ref.grad, **TOL, msg=_named(name))


@on_ranks(2, 4)
def test_redistribute_shard_to_replicate_moves_int8_bytes_not_floats():
    q = Int8SymmetricTensor.from_hp(torch.randn(64, 256))
    sharded = distribute_tensor(q, tp_mesh(), [Shard(0)])
    with CommDebugMode() as mode:
        gathered = sharded.redistribute(tp_mesh(), [Replicate()]).to_local()
    assert comm_counts(mode) == {"all_gather_into_tensor": 1}
    assert isinstance(gathered, Int8SymmetricTensor) and gathered.qdata.dtype == torch.int8
    torch.testing.assert_close(gathered.dequantize(), q.dequantize(), rtol=0, atol=0)
    received = gathered.qdata.untyped_storage().nbytes() + gathered.scale.untyped_storage().nbytes()
    ratio = received / (q.numel() * 4)
    assert ratio <= 0.27, ratio  # int8 (0.25x) + one float32 scale per 256-wide row


@pytest.mark.cpu_only(reason="wire_bytes reads gloo's profiler events; NCCL's collectives have none")
@pytest.mark.parametrize("style", ["rowwise", "colwise", "rowwise uneven", "rowwise empty pieces"])
@on_ranks(2, 4)
def test_an_int8_gather_moves_qdata_and_only_the_scales_that_are_sharded(style):
    # counted by gloo (the profiler's gloo events), below DTensor and the int8 subclass. Uneven
    # pieces are padded on some ranks only, and empty ones made on some ranks only: the gather
    # must move the same on every rank (else gloo aborts on the size mismatch)
    torch.manual_seed(0)
    columns = {"rowwise uneven": 66, "rowwise empty pieces": 3}.get(style, 64)
    linear = quantize_weights(nn.Linear(columns, 32, bias=False))
    q = linear.weight
    if style == "rowwise empty pieces":  # 3 columns on 4 ranks: one rank holds none (no style allows it)
        sharded = distribute_tensor(q, tp_mesh(), [Shard(1)])
    else:
        sharded = parallelize_module(copy.deepcopy(linear), tp_mesh(),
                                     ColwiseParallel() if style == "colwise" else RowwiseParallel()).weight
    local = sharded.to_local()
    gathered = {}
    sent = wire_bytes(lambda: gathered.setdefault("whole", sharded.full_tensor()))
    torch.testing.assert_close(gathered["whole"].dequantize(), q.dequantize(), rtol=0, atol=0)
    padded = 32 * -(-columns // world_size())  # the largest piece's qdata, which every rank sends
    if style == "colwise":  # each rank's rows and their scales
        assert sent == {"all_gather": local.qdata.numel() + 4 * local.scale.numel()}, sent
    else:  # every rank holds every row's scale: only qdata travels
        assert sent == {"all_gather": padded}, sent


@on_ranks(2)
def test_feature_pieces_quantized_on_each_rank_still_gather_their_scales_and_disagree_by_name():
    # each rank quantizes its own columns: their scales differ, which the join refuses
    torch.manual_seed(rank())
    piece = Int8SymmetricTensor.from_hp(torch.randn(8, 4) * (1 + rank()))
    sharded = DTensor.from_local(piece, tp_mesh(), [Shard(1)], shape=(8, 8), stride=(8, 1))
    with pytest.raises(ValueError, match="whose scales must be equal"):
        sharded.full_tensor()


@on_ranks(2)
def test_an_int8_gather_leaves_no_collective_in_flight():
    # Two functional all-gathers in flight at once over gloo corrupt the heap in torch 2.13
    # (glibc: "malloc(): unaligned tcache chunk detected"; tests/launch/gloo_gathers_in_flight.py shows
    # it without torch_tp). The int8 gather was two (qdata, scale); it is one, waited.
    q = Int8SymmetricTensor.from_hp(torch.randn(8, 16))
    gathered = distribute_tensor(q, tp_mesh(), [Shard(0)]).redistribute(tp_mesh(), [Replicate()], async_op=True)
    assert torch._C._distributed_c10d._get_work_registry_size() == 0
    local = gathered.to_local()
    torch.testing.assert_close(local.wait().dequantize(), q.dequantize(), rtol=0, atol=0)


# ------------------------------------------------------------------ the TP styles on quantized modules


@DTYPES
@on_ranks(2, 4)
def test_quantized_colwise_up_rowwise_down_matches_the_unsharded_quantized_mlp(dtype):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 40), nn.ReLU(), nn.Linear(40, 16)).to(dtype)
    quantized = quantize_weights(copy.deepcopy(mlp))
    sharded = parallelize_module(copy.deepcopy(quantized), tp_mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    up = parallelize_module(copy.deepcopy(quantized[0]), tp_mesh(), ColwiseParallel(output_layouts=Replicate()))
    assert isinstance(sharded[0].weight.to_local(), Int8SymmetricTensor)
    assert sharded[0].bias.dtype == dtype and not isinstance(sharded[0].bias.to_local(), Int8SymmetricTensor)
    x = torch.randn(3, 16).to(dtype)
    # colwise alone involves no reduction: bit-identical to the unsharded quantized layer
    torch.testing.assert_close(up(x), quantized[0](x), rtol=0, atol=0)
    out, ref = sharded(x), quantized(x)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    error_vs_float = _relative_error(ref, mlp(x))
    assert error_vs_float <= 1e-2, error_vs_float


@DTYPES
@on_ranks(2, 4)
def test_quantized_embedding_colwise_and_rowwise_are_bit_identical(dtype):
    torch.manual_seed(0)
    emb = quantize_weights(nn.Embedding(20, 8).to(dtype))
    ids = torch.randint(0, 20, (2, 8))
    col = parallelize_module(copy.deepcopy(emb), tp_mesh(), ColwiseParallel(output_layouts=Replicate()))
    row = parallelize_module(copy.deepcopy(emb), tp_mesh(), RowwiseParallel())
    torch.testing.assert_close(col(ids), emb(ids), rtol=0, atol=0)
    torch.testing.assert_close(row(ids), emb(ids), rtol=0, atol=0)  # each id lives on one rank


def _batched_inputs_that_cannot_fold():
    """Inputs ``F.linear`` cannot view as 2-D: matmul broadcasts the weight and calls bmm."""
    return {"transposed 3-D": torch.randn(3, 5, 16).transpose(0, 1), "transposed 4-D": torch.randn(2, 3, 5, 16).transpose(1, 2),
            "empty": torch.randn(0, 3, 16).transpose(0, 1)}


def _named(case):
    return lambda message: f"{case}: {message}"


@pytest.mark.parametrize("activations", ["float", "int8"])
@on_ranks(2, 4)
def test_quantized_layers_take_batched_inputs_that_are_not_contiguous_as_their_contiguous_copies(activations):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 40), nn.ReLU(), nn.Linear(40, 16))
    quantized = copy.deepcopy(mlp)
    for layer in (quantized[0], quantized[2]):
        quantize_module_weight(layer, activations=activations)
    sharded = parallelize_module(copy.deepcopy(quantized), tp_mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for name, x in _batched_inputs_that_cannot_fold().items():
        for model in (quantized, sharded):  # one process, then the ranks
            given = x.clone().requires_grad_()  # clone keeps the strides
            copied = x.clone(memory_format=torch.contiguous_format).requires_grad_()
            assert not given.is_contiguous() or not given.numel()
            out, ref = model(given), model(copied)
            out.square().sum().backward(), ref.square().sum().backward()
            torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=_named(name))
            torch.testing.assert_close(given.grad, copied.grad, rtol=0, atol=0, msg=_named(name))
        if activations == "float":  # and the ranks as one process (summation order apart)
            torch.testing.assert_close(sharded(x), quantized(x), **tolerance(torch.float32), msg=_named(name))


ARGS = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=64, ffn_hidden=128)


@DTYPES
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@on_ranks(2, 4)
def test_quantized_llama_matches_unsharded_quantized_and_stays_near_float(dtype, sequence_parallel):
    torch.manual_seed(0)
    model = Transformer(ARGS).to(dtype)
    quantized = quantize_weights(copy.deepcopy(model))
    sharded = parallelize_module(copy.deepcopy(quantized), tp_mesh(), tensor_parallel_plan(sequence_parallel=sequence_parallel))
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    with torch.no_grad():
        out, ref, float_out = sharded(tokens), quantized(tokens), model(tokens)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    vs_float, vs_quantized = _relative_error(ref, float_out), _relative_error(out, ref)
    assert vs_float <= 1e-2, vs_float
    assert vs_quantized <= (1e-5 if dtype == torch.float32 else 1e-2), vs_quantized


@on_ranks(2, 4)
def test_per_rank_weight_storage_is_int8_bytes_over_world_size_plus_scales_as_explained():
    model = quantize_weights(nn.Sequential(nn.Linear(256, 64, bias=False), nn.Linear(64, 256, bias=False)))
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    predicted = explain_plan(model, tp_mesh(), plan).bytes_per_rank()[dist.get_rank()]
    parallelize_module(model, tp_mesh(), plan)
    world = dist.get_world_size()
    stored = 0
    for layer in model:
        local = layer.weight.to_local()
        stored += local.qdata.untyped_storage().nbytes() + local.scale.untyped_storage().nbytes()
    # colwise: a quarter of the rows and their scales; rowwise: a quarter of the features, all scales
    expected = (64 * 256) // world + (64 // world) * 4 + (256 * 64) // world + 256 * 4
    assert predicted == expected, (predicted, expected)  # explain_plan counts int8 + scales
    assert stored == expected, (stored, expected)
