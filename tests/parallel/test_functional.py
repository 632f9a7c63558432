"""The function form and the styles are one implementation: identical parameters, outputs,
gradients and communication, overlapped sibling layers included."""

import contextlib
import copy
import warnings
from unittest import mock

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import torch_tp
import torch_tp.functional as tpf
from torch_tp import parallelize_module
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import record_p2p, run_on_ranks, tp_mesh, world_sizes

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=48)


def _parallelize_with_functions(model, mesh, overlap=False):
    """The TP + SP Llama plan (``tensor_parallel_plan(sequence_parallel=True, overlap=...)``),
    spelled as plain function calls: one call per plan entry and parent."""
    seq = Shard(1)
    block_input = seq if overlap else Replicate()
    colwise = dict(input_layouts=seq, overlap=True) if overlap else {}
    fused = dict(overlap=True) if overlap else {}
    tpf.rowwise(model.tok_embeddings, mesh, input_layouts=Replicate(), output_layouts=seq)
    for layer in model.layers:
        tpf.sequence_parallel(layer.attention_norm, mesh)
        tpf.prepare_input(layer.attention, mesh, input_layouts=(seq, None), desired_input_layouts=(block_input, None))
        tpf.colwise([layer.attention.wq, layer.attention.wk, layer.attention.wv], mesh, **colwise)
        tpf.rowwise(layer.attention.wo, mesh, output_layouts=seq, **fused)
        tpf.sequence_parallel(layer.ffn_norm, mesh)
        tpf.prepare_input(layer.feed_forward, mesh, input_layouts=(seq,), desired_input_layouts=(block_input,))
        tpf.colwise([layer.feed_forward.w1, layer.feed_forward.w3], mesh, **colwise)
        tpf.rowwise(layer.feed_forward.w2, mesh, output_layouts=seq, **fused)
    tpf.sequence_parallel(model.norm, mesh)
    tpf.colwise(model.output, mesh, input_layouts=seq, output_layouts=Replicate(), **fused)
    return model


def _both_forms(overlap):
    torch.manual_seed(0)
    reference = Transformer(ARGS)
    plan = tensor_parallel_plan(sequence_parallel=True, overlap=overlap)
    by_styles = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    by_functions = _parallelize_with_functions(copy.deepcopy(reference), tp_mesh(), overlap)
    return by_styles, by_functions


def _function_form_equals_style_form():
    by_styles, by_functions = _both_forms(overlap=False)
    for (name, a), (_, b) in zip(by_styles.named_parameters(), by_functions.named_parameters()):
        assert isinstance(a, DTensor) and a.placements == b.placements, name
        assert torch.equal(a.to_local(), b.to_local()), name
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    out_styles, out_functions = by_styles(tokens), by_functions(tokens)
    assert torch.equal(out_styles, out_functions)
    out_styles.sum().backward()
    out_functions.sum().backward()
    for (name, a), (_, b) in zip(by_styles.named_parameters(), by_functions.named_parameters()):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), name


@world_sizes(2, 4)
def test_function_form_and_styles_give_identical_parameters_outputs_and_grads(world_size):
    run_on_ranks(_function_form_equals_style_form, world_size)


def _sends_of_one_step(model, tokens, under_comm_debug_mode):
    """P2P sends of one forward + backward; torch_tp's warnings are errors (no sibling may gather alone).

    ``CommDebugMode``'s module tracker installs full backward hooks, which hand every module
    call an alias of its input: the siblings must still share their gather.
    """
    tracker = CommDebugMode() if under_comm_debug_mode else contextlib.nullcontext()
    with record_p2p() as records, warnings.catch_warnings(), tracker:
        warnings.filterwarnings("error", message="torch_tp")
        model(tokens).sum().backward()
    return sum(kind == "send" for kind, _, _ in records)


def _overlapped_sends_by_form():
    by_styles, by_functions = _both_forms(overlap=True)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    sends = {
        (form, tracked): _sends_of_one_step(model, tokens, tracked)
        for form, model in (("styles", by_styles), ("functions", by_functions))
        for tracked in (False, True)
    }
    outputs = [model(tokens) for model in (by_styles, by_functions)]
    assert torch.equal(*outputs)
    return sends


@world_sizes(2, 4)
def test_overlapped_siblings_share_one_gather_in_function_and_style_form_even_under_comm_debug_mode(world_size):
    sends = run_on_ranks(_overlapped_sends_by_form, world_size)[0]
    # per block: one fused gather for wq/wk/wv and one for w1/w3 forward, plus wo and w2;
    # the same again in the backward; and the output head: each a ring of world_size - 1 steps
    steps = world_size - 1
    per_block = 4 * steps * 2
    expected = ARGS.n_layers * per_block + 2 * steps
    assert sends == {key: expected for key in sends}, sends


# ----------------------------------------------------------------------------- one route


STYLE_OF_FUNCTION = {
    "colwise": (torch_tp.ColwiseParallel, dict(input_layouts=Shard(1), use_local_output=False)),
    "rowwise": (torch_tp.RowwiseParallel, dict(output_layouts=Shard(1))),
    "sequence_parallel": (torch_tp.SequenceParallel, dict(sequence_dim=0)),
    "spatial": (torch_tp.SpatialParallel, dict(dim=3)),
    "prepare_input": (torch_tp.PrepareModuleInput, dict(input_layouts=Shard(1), desired_input_layouts=Replicate())),
    "prepare_output": (torch_tp.PrepareModuleOutput, dict(output_layouts=Shard(1), desired_output_layouts=Replicate())),
    "prepare_input_output": (torch_tp.PrepareModuleInputOutput, dict(
        input_layouts=Shard(1), desired_input_layouts=Replicate(),
        output_layouts=Replicate(), desired_output_layouts=Shard(1))),
}


@pytest.mark.parametrize("name", sorted(STYLE_OF_FUNCTION))
def test_each_function_checks_and_applies_the_style_of_the_same_name_once(name, monkeypatch):
    style_class, kwargs = STYLE_OF_FUNCTION[name]
    calls = []
    monkeypatch.setattr(style_class, "check", lambda self, module, mesh, path=None: calls.append(("check", self, path)))
    monkeypatch.setattr(style_class, "apply_to", lambda self, module, mesh, **kw: calls.append(("apply_to", self, kw)))
    module = torch.nn.Linear(2, 2)
    assert getattr(tpf, name)(module, "mesh", **kwargs, module_path="x") is module
    expected = style_class(**kwargs)
    assert [(call[0], call[1]) for call in calls] == [("check", expected), ("apply_to", expected)]
    assert calls[1][2]["module_path"] == "x"


def _check_and_apply_order():
    from torch_tp.parallel import rules

    order = []
    real_check = rules.check_colwise

    def counting_check(*args, **kwargs):
        order.append("check")
        return real_check(*args, **kwargs)

    def counting_apply(self, module, mesh, **kwargs):
        order.append("apply")

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with mock.patch.object(rules, "check_colwise", counting_check), \
            mock.patch.object(torch_tp.ColwiseParallel, "apply_to", counting_apply):
        parallelize_module(model, tp_mesh(), {"*": torch_tp.ColwiseParallel()})
    return order


def test_parallelize_module_checks_every_entry_once_before_applying_any():
    assert run_on_ranks(_check_and_apply_order, 2)[0] == ["check", "check", "apply", "apply"]
