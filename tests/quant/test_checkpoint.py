"""Checkpoints of quantized models hold int8 and restore it bit for bit.

- ``torch.save`` / ``torch.load(weights_only=True)`` of an unsharded quantized model's
  ``state_dict()`` (float32 and bfloat16 originals), then ``load_state_dict`` into a fresh one.
- ``torch.distributed.checkpoint`` of the tensor-parallel quantized Llama saved on 2 ranks and
  loaded on 4, and 4 -> 2 (bfloat16, sequence-parallel plan on one side only), with uneven
  shards (vocab 250 and ffn 171 do not divide by 4; ffn 171 not by 2); a quantized tensor
  saved under one placement and loaded under another; an unsharded checkpoint loaded sharded.

The reference is always the unsharded quantized model: every weight's ``full_tensor()``
must have the same ``qdata`` and ``scale`` (``torch.equal``), and the model loaded into is
built from a different seed, so the load has to overwrite every value.
"""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torch_tp import parallelize_module
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.quant import Int8SymmetricTensor
from torch_tp.testing import TOL, quantize_weights, run_on_ranks, tolerance, tp_mesh

# Big enough that the int8 payload dominates the ~2 KB each saved tensor costs in
# torch.save's zip format (12 tensors per rank), small enough to run in well under a second.
ARGS = ModelArgs(dim=256, n_layers=1, n_heads=4, vocab_size=250, ffn_hidden=171, max_seq_len=16)
TOKENS = torch.randint(0, ARGS.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
# Sharded vs unsharded forward: float32 differs only by summation order; bfloat16 rounds
# partial sums to 8 bits (tolerance(dtype)).


def _build(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return quantize_weights(Transformer(ARGS).to(dtype))


def _float32_bytes(model):
    return sum(p.numel() * 4 for p in model.parameters())


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _parts(t):
    """A picklable, comparable view of a (full) weight: (qdata, scale, logical dtype) or the tensor."""
    t = t.full_tensor() if isinstance(t, DTensor) else t
    if isinstance(t, Int8SymmetricTensor):
        return (t.qdata, t.scale, t.dtype)
    return t.detach()


def _assert_same_parts(got, expected, what):
    assert type(got) is type(expected), what
    if isinstance(expected, tuple):
        assert torch.equal(got[0], expected[0]), f"{what}: qdata differs"
        assert torch.equal(got[1], expected[1]), f"{what}: scale differs"
        assert got[2] == expected[2] and got[0].dtype == torch.int8 and got[1].dtype == torch.float32, what
    else:
        assert got.dtype == expected.dtype and torch.equal(got, expected), what


def _assert_model_matches_reference(parts, reference):
    ref_parts = {name: _parts(p) for name, p in reference.named_parameters()}
    assert parts.keys() == ref_parts.keys()
    for name, expected in ref_parts.items():
        _assert_same_parts(parts[name], expected, name)


# ------------------------------------------------------------------ torch.save, one process


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_save_load_weights_only_restores_int8_bit_for_bit(dtype, tmp_path):
    model = _build(0, dtype)
    torch.save(model.state_dict(), tmp_path / "quantized.pt")
    loaded = torch.load(tmp_path / "quantized.pt", weights_only=True)

    for name, value in model.state_dict().items():
        assert type(loaded[name]) is type(value), name
        _assert_same_parts(_parts(loaded[name]), _parts(value), name)

    fresh = _build(1, dtype)
    assert not torch.equal(fresh.output.weight.qdata, model.output.weight.qdata)
    assert not fresh.load_state_dict(loaded).missing_keys
    _assert_model_matches_reference({n: _parts(p) for n, p in fresh.named_parameters()}, model)
    for layer in (fresh.output, fresh.tok_embeddings, fresh.layers[0].feed_forward.w2):
        assert isinstance(layer.weight, nn.Parameter) and isinstance(layer.weight, Int8SymmetricTensor)
        assert not layer.weight.requires_grad
    with torch.no_grad():
        assert torch.equal(fresh(TOKENS), model(TOKENS))

    # int8 on disk: a quarter of the float32 bytes plus the scales and the float norms.
    size = os.path.getsize(tmp_path / "quantized.pt")
    assert size < 0.3 * _float32_bytes(model), (size, _float32_bytes(model))


def test_copy_between_quantized_and_float_weights_is_a_clear_error():
    quantized, plain = _build(0), Transformer(ARGS)
    with pytest.raises(RuntimeError, match="a quantized weight only copies to and from a quantized weight"):
        plain.load_state_dict(quantized.state_dict())
    with pytest.raises(RuntimeError, match="Load it into the float model, then quantize"):
        _build(1).load_state_dict(plain.state_dict())


def test_copy_keeps_the_destination_dtype_like_a_plain_copy():
    model, source = _build(1, torch.float32), _build(0, torch.bfloat16)
    model.load_state_dict(source.state_dict())
    assert model.output.weight.dtype == torch.float32
    assert torch.equal(model.output.weight.qdata, source.output.weight.qdata)
    assert torch.equal(model.output.weight.scale, source.output.weight.scale)


# ------------------------------------------------------------------ DCP, sharded


def _save_sharded(path, dtype, sequence_parallel):
    model = _build(0, dtype)
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=sequence_parallel))
    dcp.save(model.state_dict(), checkpoint_id=path)


def _load_sharded(path, dtype, sequence_parallel):
    model = _build(1, dtype)
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=sequence_parallel))
    dcp.load(model.state_dict(), checkpoint_id=path)  # in place: no load_state_dict needed
    with torch.no_grad():
        logits = model(TOKENS)
    return {name: _parts(p) for name, p in model.named_parameters()}, logits


@pytest.mark.parametrize("save_ranks, load_ranks, dtype", [
    (2, 4, torch.float32),
    (4, 2, torch.bfloat16),
])
def test_dcp_checkpoint_of_sharded_quantized_llama_reshards_bit_for_bit(save_ranks, load_ranks, dtype, tmp_path):
    reference = _build(0, dtype)
    before = _build(1, dtype)
    for name, p in reference.named_parameters():  # the load must overwrite every quantized weight
        if isinstance(p, Int8SymmetricTensor):
            assert not torch.equal(dict(before.named_parameters())[name].qdata, p.qdata), name

    # Save with the plain plan on one side and the sequence-parallel one (replicated norms)
    # on the other: the checkpoint is independent of the plan.
    run_on_ranks(_save_sharded, save_ranks, str(tmp_path), dtype, save_ranks == 4)
    results = run_on_ranks(_load_sharded, load_ranks, str(tmp_path), dtype, load_ranks == 4)

    for parts, logits in results:
        _assert_model_matches_reference(parts, reference)
        with torch.no_grad():
            torch.testing.assert_close(logits, reference(TOKENS), **tolerance(dtype))

    # int8 on disk: every rank wrote int8 shards, not floats (float32 would be 1.0, bfloat16
    # 0.5; int8 plus scales is ~0.25, plus the per-tensor overhead of the files).
    size, float32 = _dir_bytes(tmp_path), _float32_bytes(reference)
    assert size < 0.32 * float32, (size, float32)


def _save_placements(path):
    torch.manual_seed(0)
    q = Int8SymmetricTensor.from_hp(torch.randn(10, 14))
    mesh = tp_mesh()
    state = {
        "replicated": distribute_tensor(q, mesh, [Replicate()]),
        "rows": distribute_tensor(q, mesh, [Shard(0)]),
        "cols": distribute_tensor(q, mesh, [Shard(1)]),
    }
    dcp.save(state, checkpoint_id=path)
    return _parts(q)


def _load_placements(path):
    torch.manual_seed(1)
    q = Int8SymmetricTensor.from_hp(torch.randn(10, 14))
    mesh = tp_mesh()
    state = {  # each one loads under a placement other than the one it was saved with
        "replicated": distribute_tensor(q, mesh, [Shard(0)]),
        "rows": distribute_tensor(q, mesh, [Shard(1)]),
        "cols": distribute_tensor(q, mesh, [Replicate()]),
    }
    dcp.load(state, checkpoint_id=path)
    return {name: _parts(value) for name, value in state.items()}


def test_dcp_reshards_a_quantized_tensor_across_placements_and_uneven_shards(tmp_path):
    # (10, 14) over 4 ranks: rows 3/3/3/1 and columns 4/4/4/2; over 2: 5/5 and 7/7.
    expected = run_on_ranks(_save_placements, 2, str(tmp_path))[0]
    for loaded in run_on_ranks(_load_placements, 4, str(tmp_path)):
        for name, parts in loaded.items():
            _assert_same_parts(parts, expected, name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_checkpoint_of_an_unsharded_model_loads_into_a_sharded_one(tmp_path):
    reference = _build(0)
    dcp.save(reference.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    for parts, logits in run_on_ranks(_load_sharded, 2, str(tmp_path), torch.float32, False):
        _assert_model_matches_reference(parts, reference)
        with torch.no_grad():
            torch.testing.assert_close(logits, reference(TOKENS), **TOL)

