"""``suggest_plan`` on transformers models that ship no tensor-parallel plan (BERT, RoBERTa, CLIP's
text encoder, ViT, T5 encoder-decoder, GPT-2 and its ``Conv1D``),
built from their configs: the derived plan, applied as it is, trains like one process at 2 ranks
(outputs, every gradient, parameters after an SGD step)."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from torch_tp import parallelize_module
from torch_tp.testing import assert_trains_like, block_linear_fraction, on_ranks, tp_mesh

transformers = pytest.importorskip("transformers")

SGD = functools.partial(torch.optim.SGD, lr=0.1)
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
#: where each family's blocks are (their linear layers' bytes: at least half split)
BLOCKS = {"bert": "encoder.layer.", "roberta": "encoder.layer.", "clip_text": "encoder.layers.",
          "vit": "layers.", "t5": ("model.encoder.block.", "model.decoder.block.")}


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
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_heads=4, dropout_rate=0.0,
                                   use_cache=False, decoder_start_token_id=0)
    return _EncoderDecoder(transformers.T5ForConditionalGeneration(config)), torch.randint(0, 128, (2, 16))


class _EncoderDecoder(torch.nn.Module):
    """T5 on one batch of token ids: the first 8 go to the encoder, the last 8 to the decoder."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(input_ids=tokens[:, :8], decoder_input_ids=tokens[:, 8:]).logits


class _Hidden(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


def _mse(out, target):
    return F.mse_loss(out, target)


@pytest.mark.parametrize("family", ["bert", "roberta", "clip_text", "vit", "t5"])
@on_ranks(2)
def test_a_model_that_ships_no_plan_gets_one_from_its_dataflow_and_trains_like_one_process(family):
    from torch_tp.tools.suggest import suggest_plan

    reference, example = _build(family)
    plan = suggest_plan(reference, tp_mesh(), (example,))
    blocks = [n for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear) and ("layer" in n or "block" in n)]
    if family == "t5":  # its relative position bias holds a value per head, computed whole: attention stays whole
        attention = [n for n in blocks if "Attention" in n]
        assert all(n not in plan and "a value per head" in plan.reasons[n] for n in attention if not n.endswith(".o")), str(plan)
        blocks = [n for n in blocks if n not in attention]
    assert all(n in plan for n in blocks), str(plan)  # every other linear layer of the blocks
    assert block_linear_fraction(reference, plan, BLOCKS[family]) >= 0.5 and plan.sharded_fraction > 0.5, str(plan)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    shape = _Hidden(reference)(example).shape
    batches = [(example, torch.randn(shape)) for _ in range(2)]
    assert_trains_like(_Hidden(model), _Hidden(reference), batches, _mse, optimizer=SGD, rtol=1e-4, atol=1e-5, what=family)


@on_ranks(2)
def test_gpt2s_conv1d_mlps_are_split_its_attention_sized_by_the_whole_model_kept_whole_and_it_trains_like_one_process():
    from torch_tp.tools.suggest import PlanDerivationError, suggest_plan

    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    tokens = torch.randint(0, 128, (2, 8))
    with pytest.raises(PlanDerivationError, match="torch.export could not trace GPT2LMHeadModel .*use_cache=False"):
        suggest_plan(reference, tp_mesh(), (tokens,))  # it returns its KV cache, which export cannot trace
    reference.config.use_cache = False
    plan = suggest_plan(reference, tp_mesh(), (tokens,))
    for block in ("transformer.h.0", "transformer.h.1"):  # Conv1D: weights stored (in, out)
        assert type(plan[f"{block}.mlp.c_fc"]).__name__ == "ColwiseParallel", str(plan)
        assert type(plan[f"{block}.mlp.c_proj"]).__name__ == "RowwiseParallel", str(plan)
        for layer in ("c_attn", "c_proj"):  # cut with split(embed_dim): the whole model's size
            why = plan.reasons[f"{block}.attn.{layer}"]
            assert f"{block}.attn.{layer}" not in plan and "GPT2Attention's forward does not run on each rank's slice" in why, why
    assert type(plan["lm_head"]).__name__ == "ColwiseParallel" and type(plan["transformer.wte"]).__name__ == "RowwiseParallel"
    assert block_linear_fraction(reference, plan, "transformer.h.") > 0.5, str(plan)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    assert model.transformer.h[0].mlp.c_fc.weight.placements == (Shard(1),)  # (in, out): out is dim 1
    batches = [(torch.randint(0, 128, (2, 8)), torch.randint(0, 128, (2, 8))) for _ in range(2)]
    assert_trains_like(_Logits(model), _Logits(reference), batches, _ce, optimizer=SGD, rtol=1e-4, atol=1e-5, what="gpt2")


@pytest.mark.parametrize("packed", [1, 2])
@on_ranks(2)
def test_a_conv1d_pair_colwise_then_rowwise_trains_like_one_process(packed):
    from transformers.pytorch_utils import Conv1D

    from torch_tp import ColwiseParallel, RowwiseParallel

    class Pair(torch.nn.Module):  # a gated MLP in GPT-2's layers: [gate; up] fused when packed=2
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.up, self.down = Conv1D(16 * packed, 8), Conv1D(8, 16)

        def forward(self, x):
            parts = self.up(x).chunk(packed, dim=-1)
            return self.down(parts[0] * (parts[-1].sigmoid() if packed > 1 else 1.0))

    reference = Pair()
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(),
                               {"up": ColwiseParallel(packed=packed), "down": RowwiseParallel()})
    assert model.down.weight.placements == (Shard(0),) and model.down.bias.placements == (Replicate(),)
    batches = [(torch.randn(2, 4, 8), torch.randn(2, 4, 8)) for _ in range(2)]
    assert_trains_like(model, reference, batches, _mse, optimizer=SGD, what=f"conv1d packed={packed}")


def _decoder(family):
    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
             "mistral": ("MistralConfig", "MistralForCausalLM")}
    config_name, model_name = names[family]
    config = getattr(transformers, config_name)(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=64, attention_dropout=0.0, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(tokens).logits


def _ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("family, sequence_parallel", [("llama", False), ("qwen3", False), ("mistral", False),
                                                       ("llama", True), ("qwen3", True)])
@on_ranks(2)
def test_a_decoder_that_ships_a_plan_gets_a_derived_plan_that_covers_its_linear_layers(family, sequence_parallel):
    from torch_tp.integrations.transformers import tp_plan
    from torch_tp.parallel import match_pattern
    from torch_tp.tools.suggest import suggest_plan

    reference = _decoder(family)
    plan = suggest_plan(reference, tp_mesh(), (torch.randint(0, 128, (2, 8)),), sequence_parallel=sequence_parallel)
    shipped = tp_plan(reference, sequence_parallel=sequence_parallel)
    covered = norms = 0
    for name, module in reference.named_modules():
        style = next((s for p, s in shipped.items() if match_pattern(p, [name])), None)
        if isinstance(module, torch.nn.Linear) and type(style).__name__ in ("ColwiseParallel", "RowwiseParallel"):
            assert type(plan.get(name)).__name__ == type(style).__name__, (name, str(plan))
            covered += 1
        if type(style).__name__ == "SequenceParallel":  # the decoder norms, on sequence shards
            assert type(plan.get(name)).__name__ == "SequenceParallel", (name, str(plan))
            norms += 1
    assert covered >= 7 * 2, (covered, str(plan))  # q, k, v, o, gate, up, down in each block
    assert norms >= (2 * 2 + 1 if sequence_parallel else 0), (norms, str(plan))
    if family == "qwen3":  # per-head norms: one copy, gradients summed
        assert type(plan["model.layers.0.self_attn.q_norm"]).__name__ == "ReplicateParallel", str(plan)
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    batches = [(torch.randint(0, 128, (2, 8)), torch.randint(0, 128, (2, 8))) for _ in range(2)]
    assert_trains_like(_Logits(model), _Logits(reference), batches, _ce, optimizer=SGD, rtol=1e-4, atol=1e-5, what=family)


@on_ranks(2)
def test_parallelize_gives_a_model_that_ships_no_plan_its_derived_plan_and_says_so():
    from torch_tp.integrations.transformers import DerivedPlanWarning, parallelize

    reference, _ = _build("bert")
    model = copy.deepcopy(reference)
    with pytest.warns(DerivedPlanWarning, match=r"BertModel ships no tensor-parallel plan .*derived from its dataflow, "
                                                r"which splits 9\d\.\d% of the parameter bytes"):
        parallelize(model, tp_mesh())  # its own dummy batch of token ids is the example
    example = torch.randint(0, 128, (2, 8))
    batches = [(example, torch.randn(2, 8, 64)) for _ in range(2)]
    assert_trains_like(_Hidden(model), _Hidden(reference), batches, _mse, optimizer=SGD, rtol=1e-4, atol=1e-5, what="bert")


@pytest.mark.parametrize("case", ["no example for pixels", "sequence parallel on an encoder", "vocab parallel loss"])
@on_ranks(2)
def test_parallelize_refuses_what_a_derived_plan_cannot_do_by_name(case):
    from torch_tp.integrations.transformers import parallelize
    from torch_tp.tools.suggest import PlanDerivationError

    if case == "sequence parallel on an encoder":  # BERT returns its hidden states: the stream ends whole
        model, _ = _build("bert")
        error, match, kwargs = PlanDerivationError, "the residual stream cannot be split along the sequence", \
            dict(sequence_parallel=True)
    elif case == "vocab parallel loss":
        model, _ = _build("bert")
        error, match, kwargs = NotImplementedError, "a plan derived from its dataflow has no vocab_parallel_loss yet", \
            dict(vocab_parallel_loss=True)
    else:
        model, _ = _build("vit")
        error, match, kwargs = ValueError, r"needs an example batch: pass example_inputs=\(a pixel_values batch,\)", {}
    with pytest.raises(error, match=match):
        parallelize(model, tp_mesh(), **kwargs)
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())  # untouched
