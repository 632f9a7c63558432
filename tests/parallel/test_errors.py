"""Every user error in ``parallelize_module`` is a clear exception naming the module path.

Each case runs the real ``parallelize_module`` on gloo ranks (world size 2 unless the case
needs 4): the test bodies run on every rank (``@on_ranks``) and check with ``pytest.raises``;
a failed check comes back as a ``RankFailure`` carrying the rank's traceback. Only a call
that fails before any mesh exists (no mesh given and none active) runs in this process.
"""

import copy
import functools
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import _mesh_resources
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel as UpstreamColwiseParallel

from torch_tp import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch_tp.models.llama import TransformerBlock, block_tensor_parallel_plan, rotary_table
from torch_tp.testing import (
    TOL,
    assert_params_and_grads_match,
    mesh_2x2,
    on_ranks,
    small_llama,
    small_llama_args,
    tp_mesh,
)

ARGS = small_llama_args()


# ----------------------------------------------------------------------------- helpers


class _raises:
    """``pytest.raises(exc_type, match=<the quoted module path>)``, then every phrase, literally."""

    def __init__(self, exc_type, path, *phrases):
        self.ctx = pytest.raises(exc_type, match=re.escape(f"'{path}'"))
        self.phrases = phrases

    def __enter__(self):
        self.info = self.ctx.__enter__()
        return self.info

    def __exit__(self, *exc):
        suppressed = self.ctx.__exit__(*exc)
        if suppressed:
            for phrase in self.phrases:
                self.info.match(re.escape(phrase))
        return suppressed


def _block_input(batch=2, seq=8):
    x = torch.randn(batch, seq, ARGS.dim)
    rope = rotary_table(ARGS.head_dim, ARGS.max_seq_len, ARGS.rope_theta)
    return x, rope


def _no_dtensor_params(model):
    return not any(isinstance(p, DTensor) for p in model.parameters())


def _no_hooks(model):
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def _assert_rejected(model, plan, exc_type, path, phrases):
    """``parallelize_module`` refuses ``plan`` naming ``path`` and every phrase; nothing changed."""
    with _raises(exc_type, path, *phrases):
        parallelize_module(model, tp_mesh(), plan)
    assert _no_dtensor_params(model)


class TwoInputs(nn.Module):
    """``forward(x, y=None, *, mask=None)``: a module whose extra inputs may be non-tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y=None, *, mask=None):
        out = self.lin(x)
        return out if y is None else out + y


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 2)
        self.emb = nn.Embedding(10, 2)
        self.down = nn.Linear(2, 8)


# ------------------------------------------------------------------- plan resolution


@on_ranks(2)
def test_unmatched_plan_key_raises_with_closest_paths():
    model = small_llama()
    with _raises(ValueError, "layers.*.attention.wqq", "matched no submodule", "closest module paths") as info:
        parallelize_module(model, tp_mesh(), {"layers.*.attention.wqq": ColwiseParallel()})
    info.match(re.escape("'layers.0.attention.wq'"))

    with _raises(ValueError, "layers.0.feed_forwrd.w1", "matched no submodule") as info:
        parallelize_module(
            model,
            tp_mesh(),
            {"layers.*.attention.wq": ColwiseParallel(), "layers.0.feed_forwrd.w1": ColwiseParallel()},
        )
    # The typo'd path's real counterpart is the first suggestion.
    info.match(re.escape("closest module paths: ['layers.0.feed_forward.w1'"))
    assert _no_dtensor_params(model)


@on_ranks(2)
def test_two_patterns_giving_one_module_different_styles_raise_naming_both_patterns():
    block = TransformerBlock(ARGS)
    plan = {"attention.w*": ColwiseParallel(), "attention.wo": RowwiseParallel()}
    with _raises(ValueError, "attention.wo", "two different styles", "'attention.w*'", "'attention.wo'"):
        parallelize_module(block, tp_mesh(), plan)
    with _raises(ValueError, "attention.wq", "'*.wq'", "'attention.w[qk]'"):
        parallelize_module(
            block,
            tp_mesh(),
            {"*.wq": ColwiseParallel(), "attention.w[qk]": ColwiseParallel(output_layouts=Replicate())},
        )
    assert _no_dtensor_params(block)
    # Overlapping patterns are fine when they give the module equal styles.
    parallelize_module(block, tp_mesh(), {"*.wq": ColwiseParallel(), "attention.w[qk]": ColwiseParallel()})
    assert block.attention.wq.weight.placements == (Shard(0),)
    assert block.attention.wk.weight.placements == (Shard(0),)


# ----------------------------------------------------------------------- module types


_BLOCK = functools.partial(TransformerBlock, ARGS)
# case: (model factory, plan, path, phrases of the TypeError)
_UNSUPPORTED_MODULES = {
    "colwise_on_attention": (
        _BLOCK, {"attention": ColwiseParallel()}, "attention",
        ("ColwiseParallel cannot shard", "(Attention)", "nn.Linear"),
    ),
    "rowwise_on_attention": (
        _BLOCK, {"attention": RowwiseParallel()}, "attention",
        ("RowwiseParallel cannot shard", "(Attention)", "nn.Linear"),
    ),
    "sequence_parallel_on_linear": (
        _BLOCK, {"attention.wq": SequenceParallel()}, "attention.wq",
        ("SequenceParallel", "(Linear).weight", "(32, 32)"),
    ),
    "sequence_parallel_on_batchnorm": (
        WithBatchNorm, {"bn": SequenceParallel()}, "bn", ("SequenceParallel", "(BatchNorm1d)", "batch statistics"),
    ),
}


@pytest.mark.parametrize("case", sorted(_UNSUPPORTED_MODULES))
@on_ranks(2)
def test_style_on_unsupported_module_type_raises_type_error_naming_path(case):
    build, plan, path, phrases = _UNSUPPORTED_MODULES[case]
    _assert_rejected(build(), plan, TypeError, path, phrases)


@on_ranks(2)
def test_upstream_style_on_unsupported_module_raises_naming_path():
    block = TransformerBlock(ARGS)
    with _raises(NotImplementedError, "attention", "(Attention)", "ColwiseParallel"):
        parallelize_module(block, tp_mesh(), {"attention": UpstreamColwiseParallel()})


# ---------------------------------------------------------------- forward-time inputs


@pytest.mark.parametrize("value, kind", [(3, "int"), (None, "NoneType")], ids=["int", "None"])
@on_ranks(2)
def test_non_tensor_input_with_a_layout_raises_type_error_at_forward_naming_path_and_position(value, kind):
    one = nn.Sequential(TwoInputs())
    parallelize_module(
        one, tp_mesh(), {"0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))}
    )
    with _raises(TypeError, "0", "PrepareModuleInput", "(TwoInputs)", "input 0", f"received {kind}"):
        one(value)


@on_ranks(2)
def test_non_tensor_later_or_keyword_input_with_a_layout_raises_naming_its_position():
    two = nn.Sequential(TwoInputs())
    layouts = (Replicate(), Replicate())
    parallelize_module(
        two,
        tp_mesh(),
        {
            "0": PrepareModuleInput(
                input_layouts=layouts,
                desired_input_layouts=layouts,
                input_kwarg_layouts={"mask": Replicate()},
                desired_input_kwarg_layouts={"mask": Replicate()},
            )
        },
    )
    x = torch.randn(2, 4)
    with _raises(TypeError, "0", "input 1", "received NoneType"):
        two[0](x, None)
    with _raises(TypeError, "0", "input 'mask'", "received int"):
        two[0](x, x, mask=7)


@on_ranks(2)
def test_non_tensor_input_to_a_colwise_linear_raises_naming_path_and_position():
    lin = nn.Sequential(nn.Linear(4, 4))
    parallelize_module(lin, tp_mesh(), {"0": ColwiseParallel()})
    with _raises(TypeError, "0", "ColwiseParallel", "(Linear)", "input 0", "received int"):
        lin(5)


@on_ranks(2)
def test_wrong_number_of_positional_inputs_raises_value_error_naming_path():
    model = nn.Sequential(TwoInputs())
    parallelize_module(
        model, tp_mesh(), {"0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))}
    )
    x = torch.randn(2, 4)
    with _raises(ValueError, "0", "PrepareModuleInput", "1 layouts", "got 2 positional values"):
        model[0](x, x)

    model = nn.Sequential(TwoInputs())
    layouts = (Replicate(), None)
    style = PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts, use_local_output=True)
    parallelize_module(model, tp_mesh(), {"0": style})
    with _raises(ValueError, "0", "2 layouts", "got 1 positional values"):
        model(x)
    # The right count works, the None entry leaving a non-tensor alone.
    torch.testing.assert_close(model[0](x, None), model[0].lin(x))


# ---------------------------------------------------------------------------- meshes


@on_ranks(4)
def test_2d_mesh_without_a_chosen_dim_raises_and_its_tp_submesh_matches_single_process():
    torch.manual_seed(0)
    reference = TransformerBlock(ARGS)
    block = copy.deepcopy(reference)
    mesh = mesh_2x2()
    with pytest.raises(ValueError, match=re.escape('device_mesh["tp"]')) as info:
        parallelize_module(block, mesh, block_tensor_parallel_plan())
    info.match("2 dims")
    assert _no_dtensor_params(block)

    tp = mesh["tp"]
    parallelize_module(block, tp, block_tensor_parallel_plan())
    assert block.attention.wq.weight.device_mesh == tp
    assert block.attention.wq.weight.to_local().shape == (ARGS.dim // 2, ARGS.dim)
    x, rope = _block_input()
    out, ref_out = block(x, rope), reference(x, rope)
    torch.testing.assert_close(out, ref_out, **TOL)
    out.pow(2).sum().backward()
    ref_out.pow(2).sum().backward()
    assert_params_and_grads_match(block, reference, **TOL, params=False)


# A missing plan or a missing mesh fails before any mesh is used: no ranks needed.


def test_missing_plan_warns_and_changes_nothing_as_upstream():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="no parallelize_plan, so it changes nothing"):
        assert parallelize_module(model, None, None) is model
    with pytest.warns(UserWarning, match="no parallelize_plan"):
        assert parallelize_module(model) is model
    assert _no_dtensor_params(model)


def test_missing_mesh_raises_value_error_saying_how_to_pass_one():
    model = nn.Sequential(nn.Linear(4, 4))
    assert not _mesh_resources.mesh_stack, "a mesh was left active by an earlier test"
    with pytest.raises(ValueError, match="device_mesh=None and no mesh is active") as info:
        parallelize_module(model, None, {"0": ColwiseParallel()})
    info.match(re.escape("with mesh:"))
    assert _no_dtensor_params(model)


@on_ranks(2)
def test_active_mesh_context_is_used_when_device_mesh_is_none():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    model = copy.deepcopy(reference)
    mesh = tp_mesh()
    with mesh:
        parallelize_module(model, parallelize_plan={"0": ColwiseParallel(), "2": RowwiseParallel()})
    assert not _mesh_resources.mesh_stack
    assert model[0].weight.device_mesh == mesh and model[0].weight.placements == (Shard(0),)
    assert model[2].weight.device_mesh == mesh and model[2].weight.placements == (Shard(1),)
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), reference(x), **TOL)


# ------------------------------------------------------------------- parameter sizes


# case: (plan, path, phrases of the ValueError) for Tiny on 4 ranks
_TOO_SMALL = {
    "colwise_linear": (
        {"proj": ColwiseParallel()}, "proj",
        ("ColwiseParallel cannot shard", "(Linear).weight", "(2, 8)", "size 2", "4 ranks"),
    ),
    "colwise_embedding": (
        {"emb": ColwiseParallel()}, "emb", ("ColwiseParallel", "(Embedding).weight", "(10, 2)", "on dim 1", "size 2"),
    ),
    "rowwise_linear": (
        {"down": RowwiseParallel()}, "down", ("RowwiseParallel cannot shard", "(8, 2)", "on dim 1", "size 2"),
    ),
}


@pytest.mark.parametrize("case", sorted(_TOO_SMALL))
@on_ranks(4)
def test_parameter_too_small_to_shard_raises_naming_path_and_sizes(case):
    plan, path, phrases = _TOO_SMALL[case]
    _assert_rejected(Tiny(), plan, ValueError, path, phrases)


@on_ranks(4)
def test_the_transposed_choices_of_too_small_parameters_shard_on_4_ranks():
    # 8 >= 4 features; 10 rows over 4 ranks: 3, 3, 3, 1.
    model = Tiny()
    plan = {"proj": RowwiseParallel(), "emb": RowwiseParallel(), "down": ColwiseParallel()}
    parallelize_module(model, tp_mesh(), plan)
    assert model.emb.weight.shape == (10, 2)


@on_ranks(2)
def test_parallelizing_a_module_twice_raises_already_a_dtensor():
    block = TransformerBlock(ARGS)
    plan = block_tensor_parallel_plan(sequence_parallel=True)
    parallelize_module(block, tp_mesh(), plan)
    # the first entry re-applied is attention's PrepareModuleInput: refused, not stacked
    with _raises(ValueError, "attention", "PrepareModuleInput already converts"):
        parallelize_module(block, tp_mesh(), plan)
    with _raises(ValueError, "attention.wq", "already a DTensor", "parallelized once"):
        parallelize_module(block, tp_mesh(), {"attention.wq": ColwiseParallel()})
    with _raises(ValueError, "attention.wo", "RowwiseParallel", "already a DTensor"):
        parallelize_module(block, tp_mesh(), {"attention.wo": RowwiseParallel()})
    with _raises(ValueError, "ffn_norm", "SequenceParallel", "already a DTensor"):
        parallelize_module(block, tp_mesh(), {"ffn_norm": SequenceParallel()})


@on_ranks(2)
def test_preparing_a_module_input_twice_raises_instead_of_stacking_hooks():
    module = nn.Identity()
    style = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True)
    parallelize_module(module, tp_mesh(), style)
    assert module(torch.ones(1, 4)).shape == (1, 4 * dist.get_world_size())
    with _raises(ValueError, "<root>", "inputs can be prepared once"):
        parallelize_module(module, tp_mesh(), style)
    with _raises(ValueError, "<root>", "PrepareModuleInputOutput"):
        parallelize_module(module, tp_mesh(), PrepareModuleInputOutput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(),
            output_layouts=Replicate(), desired_output_layouts=Shard(1)))
    # still one gather, not two stacked ones
    assert module(torch.ones(1, 4)).shape == (1, 4 * dist.get_world_size())


# ---------------------------------------------------------- rejected plans change nothing

_BAD_SECOND_KEYS = {
    "unmatched": ({"feed_forward.w4": ColwiseParallel()}, ValueError, "feed_forward.w4"),
    "conflict": ({"attention.w[qo]": RowwiseParallel()}, ValueError, "attention.wq"),
    "module_type": ({"feed_forward": ColwiseParallel()}, TypeError, "feed_forward"),
    "sequence_parallel_on_linear": ({"feed_forward.w2": SequenceParallel()}, TypeError, "feed_forward.w2"),
}


def _assert_block_rejected_untouched(second_key, exc_type, path, *phrases):
    """A plan whose first key is valid and whose second is ``second_key`` is refused as a whole."""
    torch.manual_seed(0)
    reference = TransformerBlock(ARGS)
    block = copy.deepcopy(reference)
    plan = {"attention.wq": ColwiseParallel(), **second_key}
    with _raises(exc_type, path, *phrases):
        parallelize_module(block, tp_mesh(), plan)
    assert _no_dtensor_params(block), [n for n, p in block.named_parameters() if isinstance(p, DTensor)]
    assert _no_hooks(block)
    x, rope = _block_input()
    torch.testing.assert_close(block(x, rope), reference(x, rope), rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(_BAD_SECOND_KEYS))
@on_ranks(2)
def test_rejected_plan_leaves_the_model_untouched(case):
    _assert_block_rejected_untouched(*_BAD_SECOND_KEYS[case])


@on_ranks(2)
def test_rejected_plan_with_an_upstream_style_leaves_the_model_untouched():
    _assert_block_rejected_untouched({"feed_forward": UpstreamColwiseParallel()}, NotImplementedError,
                                     "feed_forward", "(FeedForward)")
