"""``suggest_plan`` on transformers models that ship no tensor-parallel plan (BERT, RoBERTa, CLIP's
text encoder, ViT, T5's encoder),
built from their configs: the derived plan, applied as it is, trains like one process at 2 ranks
(outputs, every gradient, parameters after an SGD step)."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from torch_tp import parallelize_module
from torch_tp.testing import assert_trains_like, on_ranks, tp_mesh

transformers = pytest.importorskip("transformers")

SGD = functools.partial(torch.optim.SGD, lr=0.1)
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def _build(family):
    torch.manual_seed(0)
    if family == "bert":
        config = transformers.BertConfig(vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, **SIZES)
        return transformers.BertModel(config), torch.randint(0, 128, (2, 8))
    if family == "roberta":
        config = transformers.RobertaConfig(vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                            attention_probs_dropout_prob=0.0, **SIZES)
        return transformers.RobertaModel(config), torch.randint(3, 128, (2, 8))
    if family == "clip_text":
        config = transformers.CLIPTextConfig(vocab_size=128, max_position_embeddings=64, **SIZES)
        return transformers.CLIPTextModel(config), torch.randint(0, 128, (2, 8))
    if family == "vit":
        config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0, **SIZES)
        return transformers.ViTModel(config), torch.randn(2, 3, 32, 32)
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0)
    return transformers.T5EncoderModel(config), torch.randint(0, 128, (2, 8))


class _Hidden(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).last_hidden_state


def _mse(out, target):
    return F.mse_loss(out, target)


@pytest.mark.parametrize("family", ["bert", "roberta", "clip_text", "vit", "t5"])
@on_ranks(2)
def test_a_model_that_ships_no_plan_gets_one_from_its_dataflow_and_trains_like_one_process(family):
    from torch_tp.parallel.suggest import suggest_plan

    reference, example = _build(family)
    plan = suggest_plan(reference, tp_mesh(), (example,))
    blocks = [n for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear) and ("layer" in n or "block" in n)]
    if family == "t5":  # its relative position bias holds a value per head, computed whole: attention stays whole
        attention = [n for n in blocks if "SelfAttention" in n]
        assert all(n not in plan and "a value per head" in plan.reasons[n] for n in attention if not n.endswith(".o")), str(plan)
        blocks = [n for n in blocks if n not in attention]
    assert all(n in plan for n in blocks), str(plan)  # every other linear layer of the blocks
    assert plan.sharded_fraction > (0.3 if family == "t5" else 0.5), str(plan)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    shape = _Hidden(reference)(example).shape
    batches = [(example, torch.randn(shape)) for _ in range(2)]
    assert_trains_like(_Hidden(model), _Hidden(reference), batches, _mse, optimizer=SGD, rtol=1e-4, atol=1e-5, what=family)


@on_ranks(2)
def test_gpt2s_conv1d_layers_are_listed_as_kept_whole_with_the_reason():
    from torch_tp.parallel.suggest import PlanDerivationError, suggest_plan

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=128, n_positions=16, bos_token_id=0, eos_token_id=0))
    tokens = torch.randint(0, 128, (2, 8))
    with pytest.raises(PlanDerivationError, match="torch.export could not trace GPT2LMHeadModel .*use_cache=False"):
        suggest_plan(gpt2, tp_mesh(), (tokens,))  # it returns its KV cache, which export cannot trace
    gpt2.config.use_cache = False
    plan = suggest_plan(gpt2, tp_mesh(), (tokens,))
    assert "no rule derives a Conv1D yet" in plan.reasons["transformer.h.0.attn.c_attn"], str(plan)
    assert "no rule derives a Conv1D yet" in plan.reasons["transformer.h.0.mlp.c_fc"], str(plan)
    assert type(plan["lm_head"]).__name__ == "ColwiseParallel" and type(plan["transformer.wte"]).__name__ == "RowwiseParallel"
