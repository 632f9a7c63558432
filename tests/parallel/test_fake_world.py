"""``fake_world_memory``: one rank of an 8-rank (and a 64-rank 2-D) job in the pytest process, on
PyTorch's fake process group: the parameter bytes it holds equal ``explain_plan`` /
``predict_placements``'s for that rank, the compiled step has no graph break, an existing
process group is refused, and no process group is left behind.

These run in the parent (no rank pool: its workers hold a gloo group, which the function
refuses). One intra-op thread, as the pool workers use: the models are tiny and the 2-core
machine is shared, where torch's default two threads made each case ~8x slower. The file takes
~7 s on 2 cores (pytest's figure at load 1.3; ~15 s at load 7), the compiled case ~3 s of it
(dynamo's trace of the forward).
"""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import fake_world_memory, quantize_weights

# every sharded size divides by 8: dim 64 / 8 heads of 8, ffn 128, vocab 128, 16 tokens (2 per rank under SP)
ARGS = ModelArgs(dim=64, n_layers=1, n_heads=8, vocab_size=128, ffn_hidden=128, max_seq_len=16)
PLAN = tensor_parallel_plan(sequence_parallel=True)
TOKENS = torch.zeros(2, 16, dtype=torch.long)
# the harness's device: under TORCH_TP_TEST_DEVICE=cuda tests/conftest.py makes cuda the default
DEVICE = torch.get_default_device().type


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    assert not dist.is_initialized(), "a test left a default process group behind"


def _llama(int8: bool, args: ModelArgs = ARGS, *, embeddings: bool = True):
    def build():
        model = Transformer(args)
        return quantize_weights(model, embeddings=embeddings) if int8 else model

    return build


def _expected_bytes(args: ModelArgs, int8: bool, tp: int = 8) -> int:
    """One rank's parameter bytes under the TP + SP plan, from the sizes alone (vocab divisible by tp)."""
    dim, ffn, vocab = args.dim, args.ffn_hidden, args.vocab_size

    def colwise(rows, cols):  # Shard(0): rows / tp, each with its scale
        return rows // tp * cols * (1 if int8 else 4) + (rows // tp * 4 if int8 else 0)

    def rowwise(rows, cols):  # Shard(1): cols / tp, every row's scale
        return rows * (cols // tp) * (1 if int8 else 4) + (rows * 4 if int8 else 0)

    block = 3 * colwise(dim, dim) + rowwise(dim, dim) + 2 * colwise(ffn, dim) + rowwise(dim, ffn) + 2 * dim * 4
    return colwise(vocab, dim) + args.n_layers * block + dim * 4 + colwise(vocab, dim)  # embedding: rows too


@pytest.mark.parametrize("rank", [0, 7])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_rank_of_8_holds_exactly_the_predicted_parameter_bytes(int8, rank):
    result = fake_world_memory(_llama(int8), PLAN, 8, inputs=TOKENS, rank=rank, device=DEVICE)
    assert result.mismatches() == []
    assert result.held_bytes == result.shard_bytes == result.predicted_bytes == _expected_bytes(ARGS, int8), result
    assert (result.world_size, result.rank, result.mesh_axes, result.graph_breaks) == (8, rank, {"tp": 8}, None)


UNEVEN = ModelArgs(dim=64, n_layers=1, n_heads=8, vocab_size=100, ffn_hidden=128, max_seq_len=16)
PADDING = 2 * (13 - 9) * 64 * 4  # embedding and head: 4 rows of 64 float32 short of 13


def test_uneven_vocab_last_rank_holds_fewer_bytes_each_as_predicted():
    # vocab 100 over 8 ranks: 13 rows on ranks 0-6, 9 on rank 7 (embedding and head). Rank 0 runs
    # first: DTensor's sharding caches, which hold no rank, must not replay its widths as rank 7's
    first, last = (fake_world_memory(_llama(False, UNEVEN), PLAN, 8, inputs=TOKENS, rank=r, device=DEVICE) for r in (0, 7))
    assert first.matches(), first.mismatches()
    assert last.mismatches() == [] and last.shard_bytes == last.predicted_bytes
    assert first.shard_bytes - last.shard_bytes == PADDING


def test_uneven_vocab_last_rank_allocates_no_padding():
    # torch's distribute_tensor scatters an uneven Shard into buffers padded to the largest shard
    # and keeps a narrow() view; torch_tp copies the view (style.distribute_parameters)
    last = fake_world_memory(_llama(False, UNEVEN), PLAN, 8, inputs=TOKENS, rank=7, device=DEVICE)
    assert last.held_bytes == last.shard_bytes, f"{last.held_bytes - last.shard_bytes} B of padding held"


def test_compiled_int8_step_has_no_graph_break_and_holds_the_predicted_bytes():
    backend = "inductor" if DEVICE == "cuda" else "eager"  # eager: dynamo's trace alone, the cheapest on CPU
    result = fake_world_memory(_llama(True), PLAN, 8, inputs=TOKENS, rank=7, device=DEVICE, compile_backend=backend)
    assert (result.graph_breaks, result.graphs) == (0, 1), result
    assert result.matches(), result.mismatches()


def test_rank_of_dp8_x_tp8_under_fsdp_holds_the_predicted_bytes():
    result = fake_world_memory(_llama(False), PLAN, 64, inputs=TOKENS, rank=63, device=DEVICE, dp=8,
                               fsdp_patterns="layers.*", min_weight_size=1)
    assert result.mesh_axes == {"dp": 8, "tp": 8}
    assert result.matches(), result.mismatches()
    assert result.held_bytes * 8 == _expected_bytes(ARGS, False)  # FSDP split every TP shard 8 ways


def test_int8_rank_of_dp8_x_tp8_under_fsdp_holds_the_predicted_bytes():
    result = fake_world_memory(_llama(True, embeddings=False), PLAN, 64, inputs=TOKENS, rank=63, device=DEVICE, dp=8,
                               fsdp_patterns="layers.*", min_weight_size=1)
    assert result.matches(), result.mismatches()


def test_refuses_when_a_default_process_group_exists_and_leaves_it_alone():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match=r"torch_tp\.testing\.fake_world_memory: a default process group is "
                                                r"already initialized .*'fake', world size 2.*destroy_process_group"):
            fake_world_memory(_llama(False), PLAN, 8, inputs=TOKENS)
        assert dist.is_initialized() and dist.get_world_size() == 2
    finally:
        dist.destroy_process_group()


def test_a_step_that_fails_destroys_the_fake_process_group():
    with pytest.raises(RuntimeError, match="indices"):  # float token ids: the embedding refuses them
        fake_world_memory(_llama(False), PLAN, 8, inputs=torch.zeros(2, 16), device=DEVICE)
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=8), r"rank must be in 0 \.\. world_size - 1"),
    (dict(dp=3), "world_size divisible by dp"),
    (dict(dp=2), "needs both dp > 1 and the fsdp_patterns"),
])
def test_arguments_that_do_not_fit_raise_before_any_process_group(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fake_world_memory(_llama(False), PLAN, 8, inputs=TOKENS, **kwargs)
