"""The function form and the styles are one implementation: identical parameters and outputs."""

import copy

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

import torch_tp.functional as tpf
from torch_tp import parallelize_module
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.testing import run_on_ranks, tp_mesh, world_sizes

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=48)


def _parallelize_with_functions(model, mesh):
    """The TP + SP Llama plan, spelled as plain function calls."""
    seq = Shard(1)
    tpf.rowwise(model.tok_embeddings, mesh, input_layouts=Replicate(), output_layouts=seq)
    for layer in model.layers:
        tpf.sequence_parallel(layer.attention_norm, mesh)
        tpf.prepare_input(layer.attention, mesh, input_layouts=(seq, None), desired_input_layouts=(Replicate(), None))
        for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
            tpf.colwise(linear, mesh)
        tpf.rowwise(layer.attention.wo, mesh, output_layouts=seq)
        tpf.sequence_parallel(layer.ffn_norm, mesh)
        tpf.prepare_input(layer.feed_forward, mesh, input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        tpf.colwise(layer.feed_forward.w1, mesh)
        tpf.colwise(layer.feed_forward.w3, mesh)
        tpf.rowwise(layer.feed_forward.w2, mesh, output_layouts=seq)
    tpf.sequence_parallel(model.norm, mesh)
    tpf.colwise(model.output, mesh, input_layouts=seq, output_layouts=Replicate())
    return model


def _function_form_equals_style_form():
    torch.manual_seed(0)
    reference = Transformer(ARGS)
    by_styles = parallelize_module(copy.deepcopy(reference), tp_mesh(), tensor_parallel_plan(sequence_parallel=True))
    by_functions = _parallelize_with_functions(copy.deepcopy(reference), tp_mesh())
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


def test_public_function_module_re_exports_the_implementation():
    import torch_tp.parallel.functional as impl

    for name in tpf.__all__:
        assert getattr(tpf, name) is getattr(impl, name), name


def test_styles_delegate_to_the_function_of_the_same_name(monkeypatch):
    import torch_tp.parallel.functional as impl
    from torch_tp import ColwiseParallel, PrepareModuleInput

    calls = []
    monkeypatch.setattr(impl, "colwise", lambda module, mesh, **kw: calls.append(("colwise", kw)))
    monkeypatch.setattr(impl, "prepare_input", lambda module, mesh, **kw: calls.append(("prepare_input", kw)))
    ColwiseParallel(use_local_output=False).apply_to(None, None, src_data_rank=None, module_path="x")
    PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()).apply_to(None, None)
    assert calls[0] == ("colwise", dict(
        input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False, overlap=False,
        src_data_rank=None, module_path="x"))
    assert calls[1][0] == "prepare_input" and calls[1][1]["input_layouts"] == (Shard(1),)
