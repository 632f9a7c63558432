"""Hugging Face transformers decoders parallelized from their own plans match the single-process model.

Tiny configs built from the config classes (no download): vocab 128, hidden 64, 2 layers,
8 heads of 8 with 4 key/value heads, so both world sizes split whole heads.
"""

import copy
import functools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from torch_tp import explain_plan, verify_plan
from torch_tp.testing import assert_trains_like, run_on_ranks, tp_mesh, world_sizes

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "mixtral", "qwen3_moe"]
MOE_FAMILIES = ["mixtral", "qwen3_moe"]
# At 4 ranks, the families whose mechanics differ from 2 ranks': one key/value head per rank,
# per-head norms (qwen3), a tied head over a vocabulary split 4 ways (gemma), fused projections
# split per part (phi3). qwen2 and mistral are llama at 4 ranks; the MoE families' 4-rank cases
# are the MoE test's.
AT_4_RANKS = ["llama", "qwen3", "gemma", "phi3"]
DECODER_CASES = [(family, 2) for family in FAMILIES] + [(family, 4) for family in AT_4_RANKS]
OPTIONS = {}  # the translator's defaults (MoE experts: experts="tensor", transformers' moe_tp_experts)
VOCAB = 128
# float32. AdamW normalizes each update by the gradient's running scale, so for a gradient
# element near zero a 1e-8 difference moves the parameter by up to lr: the optimizer's eps is
# raised to 1e-5 (elements below that scale move by ~g/eps * lr) and comparisons allow 1e-4
TOL = dict(rtol=1e-4, atol=1e-4)
ADAMW = dict(lr=1e-3, eps=1e-5)


def _config_and_class(family):
    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # per-head q_norm / k_norm
        "mistral": ("MistralConfig", "MistralForCausalLM", {}),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),  # tied embeddings
        # fused qkv_proj / gate_up_proj, gathered by its shipped plan (colwise_gather_output)
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    }
    config_name, model_name, extra = classes[family]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=64, attention_dropout=0.0, **extra,
    )
    config._attn_implementation = "sdpa"
    return config, getattr(transformers, model_name)


def _build(family):
    config, model_class = _config_and_class(family)
    torch.manual_seed(0)
    return model_class(config)


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _Logits(torch.nn.Module):
    """The model with its logits as output, for assert_trains_like."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


class _LossesOnLabels(torch.nn.Module):
    """The model on ``(ids, labels)``, with its logits, router auxiliary loss and total loss as output."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        ids, labels = batch
        out = self.model(ids, labels=labels)
        return {"logits": out.logits, "aux loss": out.aux_loss, "loss": out.loss}


def _trains_like_one_process(family, sequence_parallel):
    from torch_tp.integrations.transformers import parallelize

    reference = _build(family)
    model = parallelize(copy.deepcopy(reference), tp_mesh(), sequence_parallel=sequence_parallel,
                        **OPTIONS.get(family, {}))
    if family == "gemma":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    norm = model.model.layers[0].input_layernorm.weight
    assert type(norm).__name__ == ("DTensor" if sequence_parallel else "Parameter")
    batches = ((torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))) for _ in range(3))
    adamw = functools.partial(torch.optim.AdamW, **ADAMW)
    assert_trains_like(_Logits(model), _Logits(reference), batches, _loss, optimizer=adamw, **TOL,
                       what=f"{family} sp={sequence_parallel}")
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(full, q, **TOL, msg=lambda m: f"{name} after 3 steps: {m}")


@pytest.mark.parametrize("family, world_size", DECODER_CASES, ids=[f"{f}-ws{n}" for f, n in DECODER_CASES])
def test_transformers_decoder_parallelized_from_its_own_plan_trains_like_one_process(world_size, family):
    run_on_ranks(_trains_like_one_process, world_size, family, False)
    run_on_ranks(_trains_like_one_process, world_size, family, True)


def _greedy_generation(family):
    from torch_tp.integrations.transformers import parallelize

    reference = _build(family).eval()
    model = parallelize(copy.deepcopy(reference), tp_mesh(), **OPTIONS.get(family, {}))
    prompt = torch.randint(0, VOCAB, (1, 5))
    kwargs = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    ours, theirs = model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs)
    assert torch.equal(ours, theirs), (ours, theirs)
    return ours.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_with_a_kv_cache_gives_the_single_process_tokens(family):
    tokens = run_on_ranks(_greedy_generation, 2, family)
    assert tokens[0] == tokens[1] and len(tokens[0][0]) == 5 + 8


def _verified(family):
    from torch_tp.integrations.transformers import tp_plan

    reference = _build(family)
    report = verify_plan(
        lambda: _build(family), tp_mesh(), tp_plan(reference, **OPTIONS.get(family, {})),
        lambda step: (torch.randint(0, VOCAB, (2, 8)),),
        loss_fn=lambda out: out.logits.float().pow(2).mean(), raise_on_mismatch=False,
    )
    return report.ok, str(report)


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_plan_passes_on_the_translated_plan(family):
    ok, text = run_on_ranks(_verified, 2, family)[0]
    assert ok, text


@pytest.mark.parametrize("family", FAMILIES)
def test_explain_plan_works_on_a_meta_model(family):
    from torch_tp.integrations.transformers import tp_plan

    config, model_class = _config_and_class(family)
    with torch.device("meta"):
        model = model_class(config)
    report = explain_plan(model, 4, tp_plan(model, sequence_parallel=True, **OPTIONS.get(family, {})))
    assert not report.problems()
    rows = {row.path: row for row in report}
    projection = "qkv_proj" if family == "phi3" else "q_proj"
    assert rows[f"model.layers.0.self_attn.{projection}.weight"].local_shapes[0][1] == 64


def test_plan_translation_drops_unbuilt_modules_and_refuses_unknown_strings():
    from torch_tp import ReplicateParallel
    from torch_tp.integrations.transformers import tp_plan

    model = _build("qwen3")
    plan = tp_plan(model)
    assert isinstance(plan["model.layers.*.self_attn.q_norm"], ReplicateParallel)
    # the parents of the colwise projections turn their input into one DTensor: by keyword for
    # the attention (transformers calls self_attn(hidden_states=...)), positionally for the MLP
    assert plan["model.layers.0.self_attn"].input_kwarg_layouts == {"hidden_states": Replicate()}
    assert plan["model.layers.1.mlp"].input_layouts == (Replicate(),)
    # transformers merges the base model's plan into the instance's _tp_plan when it builds it
    original = dict(model._tp_plan)
    model._tp_plan = {**original, "model.layers.*.mlp.nonexistent": "colwise"}
    assert "model.layers.*.mlp.nonexistent" not in tp_plan(model)  # a module this config does not build
    model._tp_plan = {**original, "model.layers.*.mlp.up_proj": "colwise_sideways"}
    with pytest.raises(ValueError, match=r"'model.layers.\*.mlp.up_proj' is 'colwise_sideways'.*transformers 5"):
        tp_plan(model)
    model._tp_plan = {**original, "model.layers.*.mlp.up_proj": "mla_kv_a_proj"}
    with pytest.raises(NotImplementedError, match="experts=None"):
        tp_plan(model)
    assert "model.layers.*.mlp.up_proj" not in tp_plan(model, experts=None)
    with pytest.raises(ValueError, match=r"experts='experts'"):
        tp_plan(model, experts="experts")


def _three_heads_on_two_ranks():
    from torch_tp.integrations.transformers import parallelize

    config, model_class = _config_and_class("llama")
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 3, 3, 8
    config.hidden_size = 24
    try:
        parallelize(model_class(config), tp_mesh())
    except ValueError as err:
        return str(err)
    return None


def test_a_head_count_the_mesh_cannot_split_is_refused_naming_the_attention_module():
    message = run_on_ranks(_three_heads_on_two_ranks, 2)[0]
    assert "LlamaAttention ('model.layers.0.self_attn')" in message and "(3 units) as [12, 12]" in message


def _vocab_parallel_loss(family, sequence_parallel):
    from torch_tp.integrations.transformers import parallelize
    from torch_tp.loss import cross_entropy

    reference = _build(family)
    model = parallelize(copy.deepcopy(reference), tp_mesh(), sequence_parallel=sequence_parallel, vocab_parallel_loss=True)
    ids, targets = torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))
    logits = model(ids).logits
    assert type(logits).__name__ == "DTensor" and logits.placements[0].is_shard(dim=2)  # never gathered
    loss = cross_entropy(logits, targets, label_smoothing=0.1)
    want = torch.nn.functional.cross_entropy(reference(ids).logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1)
    torch.testing.assert_close(loss, want, **TOL)
    loss.backward()
    want.backward()
    from torch_tp.testing import assert_params_and_grads_match

    assert_params_and_grads_match(model, reference, **TOL)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_vocab_parallel_loss_on_sharded_logits_matches_the_single_process_loss(sequence_parallel):
    run_on_ranks(_vocab_parallel_loss, 2, "gemma", sequence_parallel)


def test_vocab_parallel_loss_shards_only_the_output_heads_logits():
    from torch_tp.integrations.transformers import tp_plan

    plan = tp_plan(_build("phi3"), vocab_parallel_loss=True)
    assert plan["lm_head"].use_local_output is False  # logits stay vocab-sharded
    # Phi-3's fused projections use the same string (colwise_gather_output) but stay gathered
    assert plan["model.layers.*.self_attn.qkv_proj"].output_layouts == Replicate()
    assert plan["model.layers.*.self_attn.qkv_proj"].use_local_output is True


# --------------------------------------------------------------------------- MoE experts


def _moe_trains_like_one_process(family, experts, sequence_parallel):
    """Logits, the router's auxiliary loss, the total loss and every gradient, 3 AdamW steps."""
    from torch_tp.integrations.transformers import parallelize

    reference = _build(family)
    reference.config.output_router_logits = True
    model = parallelize(copy.deepcopy(reference), tp_mesh(), sequence_parallel=sequence_parallel, experts=experts)
    down = model.model.layers[0].mlp.experts.down_proj
    assert down.placements == ((Shard(2),) if experts == "tensor" else (Shard(0),))  # [E, H, I]
    whole = sum(p.nbytes for n, p in reference.named_parameters() if ".experts." in n)
    local = sum(p.to_local().untyped_storage().nbytes() for n, p in model.named_parameters() if ".experts." in n)
    assert local == whole // tp_mesh().size()
    # each batch is the model's input (ids, labels): the model computes its own loss
    batches = ((torch.randint(0, VOCAB, (2, 2, 8)).unbind(), None) for _ in range(3))
    assert_trains_like(_LossesOnLabels(model), _LossesOnLabels(reference), batches, lambda out, _: out["loss"],
                       optimizer=functools.partial(torch.optim.AdamW, **ADAMW), **TOL,
                       what=f"{family} experts={experts} sp={sequence_parallel}")


@world_sizes(2, 4)
@pytest.mark.parametrize("experts", ["tensor", "expert"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_decoders_with_expert_tensor_or_expert_parallel_train_like_one_process(world_size, family, experts):
    run_on_ranks(_moe_trains_like_one_process, world_size, family, experts, False)
    run_on_ranks(_moe_trains_like_one_process, world_size, family, experts, True)


def _greedy_generation_with_expert_parallelism(family):
    from torch_tp.integrations.transformers import parallelize

    reference = _build(family).eval()
    model = parallelize(copy.deepcopy(reference), tp_mesh(), experts="expert")
    prompt = torch.randint(0, VOCAB, (1, 5))
    kwargs = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    # one new token per step: one rank dispatches it, the others send nothing
    assert torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_generation_with_expert_parallelism_gives_the_single_process_tokens(family):
    run_on_ranks(_greedy_generation_with_expert_parallelism, 2, family)


def _plans_derived_or_sharding_little():
    from torch_tp.integrations.transformers import DerivedPlanWarning, parallelize

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0)).eval()
    reference = copy.deepcopy(gpt2)
    with pytest.warns(DerivedPlanWarning, match=r"GPT2LMHeadModel ships no tensor-parallel plan .*: using the plan "
                                                r"torch_tp.suggest_plan derived from its dataflow, which splits \d+\.\d%"):
        parallelize(gpt2, tp_mesh())  # its Conv1D blocks stay whole, so it also warns that little is split
    assert isinstance(gpt2.transformer.wte.weight, torch.distributed.tensor.DTensor)  # vocabulary-parallel
    assert gpt2.config.use_cache  # left as it was (the trace ran without the cache)
    tokens = torch.randint(0, VOCAB, (2, 8))
    assert_trains_like(_Logits(gpt2), _Logits(reference), [(tokens, None)], lambda out, _: out.square().mean(),
                       optimizer=functools.partial(torch.optim.SGD, lr=0.1), what="gpt2, derived plan")
    config, model_class = _config_and_class("llama")
    config.base_model_tp_plan = {}  # only the embedding and the head left: most bytes whole
    with pytest.warns(UserWarning, match=r"LlamaForCausalLM's plan leaves 8\d% of its parameter bytes whole on every rank"):
        parallelize(model_class(config), tp_mesh())
    return True


def test_a_model_without_a_plan_gets_the_derived_one_and_a_plan_sharding_little_warns():
    assert run_on_ranks(_plans_derived_or_sharding_little, 2) == [True, True]


def _saved_and_loaded_back(family, directory):
    from torch_tp.integrations.transformers import parallelize

    reference = _build(family)
    model = parallelize(copy.deepcopy(reference), tp_mesh())
    model.save_pretrained(directory)  # every rank calls it; rank 0 writes the whole tensors
    torch.distributed.barrier()
    _, model_class = _config_and_class(family)
    loaded = model_class.from_pretrained(directory)
    expected = reference.state_dict()
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    if family == "gemma":
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    return sorted(loaded.state_dict()) == sorted(expected)


@pytest.mark.parametrize("family", ["llama", "gemma"])  # gemma: a tied lm_head
def test_save_pretrained_writes_the_whole_tensors_and_from_pretrained_loads_the_single_process_model(family, tmp_path):
    assert run_on_ranks(_saved_and_loaded_back, 2, family, str(tmp_path)) == [True, True]


def _llama4_trains_like_one_process(experts):
    from torch_tp.integrations.transformers import parallelize

    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=1, max_position_embeddings=64, attention_dropout=0.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference = transformers.Llama4ForCausalLM(config)
    model = parallelize(copy.deepcopy(reference), tp_mesh(), experts=experts)
    batches = ((torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))) for _ in range(2))
    adamw = functools.partial(torch.optim.AdamW, **ADAMW)
    assert_trains_like(_Logits(model), _Logits(reference), batches, _loss, optimizer=adamw, **TOL,
                       what=f"llama4 experts={experts}")
    return True


@world_sizes(2, 4)
@pytest.mark.parametrize("experts", ["tensor", "expert", None], ids=["expert_tensor", "expert_parallel", "whole"])
def test_llama4_text_trains_like_one_process_under_both_expert_styles_and_whole(world_size, experts):
    # its dense experts take every token once per expert ([E * T, H]), and its MoE block adds
    # into the shared expert's Rowwise output in place: every setting failed before
    assert run_on_ranks(_llama4_trains_like_one_process, world_size, experts) == [True] * world_size
