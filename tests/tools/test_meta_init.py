"""Meta build -> parallelize -> to_empty -> init_parameters: each rank stores only its shards,
and the values equal a single-process init with the same seed, whatever the world size."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torch_tp import explain_plan, init_parameters, parallelize_module
from torch_tp.models.llama import Transformer, tensor_parallel_plan
from torch_tp.testing import TOL, run_on_ranks, small_llama_args, tp_mesh, world_sizes

# vocab 100 is uneven on 8 ranks (13,...,9) and divides by 2 and 4 (50, 25 each).
ARGS = small_llama_args(vocab_size=100)


def _init_weights(module):
    """A user init: small normal weights, everything else by its own reset_parameters."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.trunc_normal_(module.weight, std=0.02)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _single_process_reference(init_fn):
    reference = Transformer(ARGS)
    return init_parameters(reference, init_fn, seed=1234)


def _meta_parallelize_materialize(sequence_parallel, init_fn):
    with torch.device("meta"):
        model = Transformer(ARGS)
    plan = tensor_parallel_plan(sequence_parallel=sequence_parallel)
    predicted = explain_plan(model, tp_mesh(), plan).bytes_per_rank()[torch.distributed.get_rank()]
    parallelize_module(model, tp_mesh(), plan)
    model.to_empty(device="cpu")
    init_parameters(model, init_fn, seed=1234)

    stored = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stored == shard_bytes == predicted and stored < full_bytes

    reference = _single_process_reference(init_fn)
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert isinstance(p, DTensor), name
        assert torch.equal(p.full_tensor(), ref), name
    assert torch.equal(model.rope, reference.rope)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    torch.testing.assert_close(model(tokens), reference(tokens), **TOL)
    return stored


@world_sizes(2, 4)
@pytest.mark.parametrize("init", ["reset_parameters", "user_init"])
def test_meta_model_materializes_to_exact_shards_with_single_process_values(world_size, init):
    init_fn = _init_weights if init == "user_init" else None
    stored = run_on_ranks(_meta_parallelize_materialize, world_size, True, init_fn)
    assert len(set(stored)) == 1  # evenly divisible here: every rank stores the same bytes


def test_init_parameters_depends_on_seed_and_path_not_on_visit_order():
    a = init_parameters(Transformer(ARGS), seed=7)
    b = init_parameters(Transformer(ARGS), seed=7)
    c = init_parameters(Transformer(ARGS), seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
    assert not torch.equal(a.layers[0].attention.wq.weight, a.layers[1].attention.wq.weight)


def test_init_fn_reaching_into_children_gets_a_clear_error():
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(2))
            self.child = nn.Linear(2, 2)

    def bad_init(module):
        if isinstance(module, Parent):
            nn.init.zeros_(module.child.weight)

    with pytest.raises(TypeError, match="'<root>' \\(Parent\\) touched something outside its own parameters"):
        init_parameters(Parent(), bad_init)
