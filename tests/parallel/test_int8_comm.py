"""``comm_dtype=torch.int8``: sequence-parallel collectives that move int8 and one scale per token.

Each collective against its float result (within the quantization bound), the zoo Llama's
TP + SP plan with int8 communication against one process and against the same plan in float
(bytes counted by gloo, forward + backward), int8 weights with int8 communication, and the
arguments refused by name. (Compiled: ``tests/overlap/test_overlap_compile.py``; the 200-step
loss curve: ``benchmarks/int8_comm.py``.)"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import torch_tp.overlap  # noqa: F401  (registers torch.ops.torch_tp.int8_*)
from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import (
    assert_trains_like, on_ranks, quantize_weights, rank, small_llama, small_llama_args, tp_mesh, wire_bytes, world_size,
)

SGD = functools.partial(torch.optim.SGD, lr=0.1)
VOCAB = small_llama_args().vocab_size


def _group():
    return tp_mesh().get_group().group_name


@on_ranks(2, 4)
def test_each_int8_collective_is_within_half_a_step_per_token_of_the_float_one():
    torch.manual_seed(0)
    ranks, me = world_size(), rank()
    whole = torch.randn(2, 4 * ranks, 16) * torch.rand(1, 4 * ranks, 1) * 10  # tokens of different scales
    piece = whole.chunk(ranks, dim=1)[me].clone().requires_grad_()
    gathered = torch.ops.torch_tp.int8_all_gather(piece, 1, _group())
    step = whole.abs().amax(-1, keepdim=True) / 127  # one quantization step per token
    assert ((gathered - whole).abs() <= step / 2 + 1e-6).all()
    partials = [torch.randn(2, 4 * ranks, 16) * (r + 1) for r in range(ranks)]  # every rank's, known to all
    reduced = torch.ops.torch_tp.int8_reduce_scatter(partials[me], 1, _group())
    want = sum(partials).chunk(ranks, dim=1)[me]
    bound = sum(p.abs().amax(-1, keepdim=True) / 254 for p in partials).chunk(ranks, dim=1)[me]
    assert ((reduced - want).abs() <= bound + 1e-6).all()
    gathered.backward(torch.ones_like(gathered))  # the gather's backward: an int8 reduce-scatter of ones
    torch.testing.assert_close(piece.grad, torch.full_like(piece, ranks), rtol=0, atol=0)


def _llama(dim=64):
    torch.manual_seed(0)
    return Transformer(ModelArgs(dim=dim, n_layers=2, n_heads=4, vocab_size=VOCAB, ffn_hidden=2 * dim, max_seq_len=16))


def _ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("overlap", [False, True], ids=["unfused", "overlap"])
@on_ranks(2)
def test_the_int8_sequence_parallel_llama_trains_like_one_process_within_the_quantization_error(overlap):
    reference = small_llama(seed=0)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(),
                               tensor_parallel_plan(sequence_parallel=True, overlap=overlap, comm_dtype=torch.int8))
    batches = [(torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))) for _ in range(3)]
    losses = assert_trains_like(model, reference, batches, _ce, optimizer=SGD, rtol=0.05, atol=0.02,
                                what="int8 sequence-parallel communication")
    assert len(losses) == 3


@pytest.mark.cpu_only(reason="wire_bytes reads gloo's profiler events; NCCL's collectives have none")
@pytest.mark.parametrize("overlap", [False, True], ids=["unfused", "overlap"])
@on_ranks(4)
def test_int8_communication_moves_at_most_027_of_the_float32_plans_bytes_forward_and_backward(overlap):
    # counted by gloo (the profiler's gloo events, the ring's sends too); per token E int8 bytes
    # and a 4-byte scale against 4E: (E + 4) / 4E = 0.254 at E = 256, plus the same 8-byte
    # agreement checks
    reference, tokens = _llama(dim=256), torch.randint(0, VOCAB, (2, 8))
    sent = {}
    for name, options in (("float32", {}), ("int8", dict(comm_dtype=torch.int8))):
        plan = tensor_parallel_plan(sequence_parallel=True, overlap=overlap, **options)
        model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
        sent[name] = wire_bytes(lambda: model(tokens).square().mean().backward())
    total = {name: sum(counts.values()) for name, counts in sent.items()}
    assert total["int8"] <= 0.27 * total["float32"], sent


@on_ranks(2)
def test_int8_weights_with_int8_communication_stay_within_the_quantization_error_of_the_int8_model():
    reference = quantize_weights(small_llama(seed=0))
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(),
                               tensor_parallel_plan(sequence_parallel=True, comm_dtype=torch.int8))
    tokens = torch.randint(0, VOCAB, (2, 8))
    want, got = reference(tokens), model(tokens)
    assert (got - want).abs().max() <= 0.02 * want.abs().max(), ((got - want).abs().max(), want.abs().max())


class _Biased(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


@on_ranks(2)
def test_an_int8_rowwise_layer_adds_its_bias_once():
    reference = _Biased()
    nn.init.constant_(reference.down.bias, 3.0)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), {
        "up": ColwiseParallel(input_layouts=Shard(1), comm_dtype=torch.int8),
        "down": RowwiseParallel(output_layouts=Shard(1), comm_dtype=torch.int8),
    })
    x = torch.randn(2, 8, 16)
    got = model(x.chunk(world_size(), dim=1)[rank()])
    want = reference(x).chunk(world_size(), dim=1)[rank()]
    assert (got - want).abs().max() <= 0.05, (got - want).abs().max()


@pytest.mark.parametrize("case", ["float16", "a string", "colwise without a gather", "rowwise without a scatter",
                                  "an embedding gathering ids"])
def test_comm_dtype_is_refused_by_name_where_it_cannot_apply(case):
    from torch_tp.parallel.rules import UnsupportedModuleError

    error, make = {
        "float16": (TypeError, lambda: ColwiseParallel(input_layouts=Shard(1), comm_dtype=torch.float16)),
        "a string": (TypeError, lambda: RowwiseParallel(output_layouts=Shard(1), comm_dtype="int8")),
        "colwise without a gather": (ValueError, lambda: ColwiseParallel(comm_dtype=torch.int8)),
        "rowwise without a scatter": (ValueError, lambda: RowwiseParallel(comm_dtype=torch.int8)),
        "an embedding gathering ids": (UnsupportedModuleError, lambda: ColwiseParallel(
            input_layouts=Shard(1), comm_dtype=torch.int8).check(nn.Embedding(8, 4), 2, "emb")),
    }[case]
    with pytest.raises(error, match="comm_dtype"):
        make()


@pytest.mark.parametrize("overlap", [False, True], ids=["unfused", "overlap"])
@pytest.mark.parametrize("comm_dtype", [None, torch.int8], ids=["float", "int8"])
@on_ranks(2)
def test_a_sequence_the_ranks_cannot_split_evenly_is_refused_on_every_rank_before_anything_is_sent(comm_dtype, overlap):
    # before: with overlap=True the ring sent the pieces as they came and gloo aborted the process
    style = ColwiseParallel(input_layouts=Shard(1), comm_dtype=comm_dtype, overlap=overlap)
    model = parallelize_module(_Biased(), tp_mesh(), {"up": style})
    piece = torch.randn(2, 4 if rank() == 0 else 3, 16)  # 7 positions over 2 ranks
    with pytest.raises(ValueError, match=r"ColwiseParallel.* on 'up'.*the ranks' inputs, as one sharded tensor, "
                                         r"have different shapes \[\(2, 8, 16\), \(2, 6, 16\)\]"):
        model.up(piece)
    dist.barrier()


@pytest.mark.parametrize("comm_dtype", [None, torch.int8], ids=["float", "int8"])
@on_ranks(2, 4)
def test_a_batch_of_no_sequences_under_sequence_parallelism_gives_what_one_process_gives(comm_dtype):
    # before: the Llama's attention split heads with view(..., -1, head_dim), which a tensor of
    # 0 elements cannot infer, and int8 communication's packing failed on it
    reference = small_llama(seed=0)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(),
                               tensor_parallel_plan(sequence_parallel=True, comm_dtype=comm_dtype))
    tokens = torch.zeros(0, 8, dtype=torch.long)
    got, want = model(tokens), reference(tokens)
    assert got.shape == want.shape == (0, 8, VOCAB)
    got.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        grad = p.grad.full_tensor() if p.grad is not None else None
        assert grad is None or torch.equal(grad, torch.zeros_like(q)), name
