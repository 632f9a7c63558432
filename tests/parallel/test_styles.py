"""Every style's arguments, on real gloo ranks, against the single-process module.

Each test body runs on every rank (``@on_ranks``): it builds a module, keeps an unsharded
copy as reference, parallelizes the copy and checks placements, local shapes, outputs and
gradients.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from torch_tp import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch_tp.models.llama import RMSNorm
from torch_tp.testing import TOL, assert_params_and_grads_match, assert_trains_like, local_chunk, on_ranks, run_on_ranks, tp_mesh


def _parallel_copy(module, plan, **kwargs):
    sharded = copy.deepcopy(module)
    parallelize_module(sharded, tp_mesh(), plan, **kwargs)
    return sharded


def _assert_grads_match(module, reference):
    assert_params_and_grads_match(module, reference, **TOL, params=False)


# ------------------------------------------------------------------ ColwiseParallel


_BIAS = pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])


@_BIAS
@on_ranks(2, 4)
def test_colwise_linear_with_and_without_bias_and_every_layout(bias):
    reference = nn.Linear(16, 12, bias=bias)
    x = torch.randn(3, 5, 16)
    expected = reference(x)

    default = _parallel_copy(reference, ColwiseParallel())
    assert default.weight.placements == (Shard(0),)
    assert default.weight.to_local().shape == local_chunk(reference.weight, 0).shape
    if bias:
        assert default.bias.placements == (Shard(0),)
    out = default(x)
    assert not isinstance(out, DTensor)  # use_local_output=True: the local last-dim shard
    torch.testing.assert_close(out, local_chunk(expected, -1), **TOL)
    out.sum().backward()
    expected.sum().backward()
    _assert_grads_match(default, reference)
    reference.zero_grad()

    as_dtensor = _parallel_copy(reference, ColwiseParallel(use_local_output=False))(x)
    assert isinstance(as_dtensor, DTensor) and as_dtensor.placements == (Shard(2),)
    torch.testing.assert_close(as_dtensor.full_tensor(), expected.detach(), **TOL)

    replicated = _parallel_copy(reference, ColwiseParallel(output_layouts=Replicate()))(x)
    torch.testing.assert_close(replicated, expected.detach(), **TOL)

    # a batch-sharded input is gathered before the matmul
    batch_sharded = _parallel_copy(reference, ColwiseParallel(input_layouts=Shard(0)))
    full_x = torch.randn(2 * dist.get_world_size(), 5, 16)
    out = batch_sharded(local_chunk(full_x, 0))
    torch.testing.assert_close(out, local_chunk(reference(full_x), -1).detach(), **TOL)


@on_ranks(2, 4)
def test_colwise_embedding_shards_the_embedding_dim():
    reference = nn.Embedding(20, 8)
    ids = torch.randint(0, 20, (2, 6))
    expected = reference(ids)
    sharded = _parallel_copy(reference, ColwiseParallel())
    assert sharded.weight.placements == (Shard(1),)
    out = sharded(ids)
    torch.testing.assert_close(out, local_chunk(expected, -1), **TOL)
    out.sum().backward()
    expected.sum().backward()
    _assert_grads_match(sharded, reference)
    gathered = _parallel_copy(reference, ColwiseParallel(output_layouts=Replicate()))(ids)
    torch.testing.assert_close(gathered, expected.detach(), **TOL)


# ------------------------------------------------------------------ RowwiseParallel


@_BIAS
@on_ranks(2, 4)
def test_rowwise_linear_with_and_without_bias_and_every_layout(bias):
    reference = nn.Linear(16, 6, bias=bias)
    x = torch.randn(3, 5, 16, requires_grad=True)
    expected = reference(x)

    sharded = _parallel_copy(reference, RowwiseParallel())
    assert sharded.weight.placements == (Shard(1),)
    if bias:
        assert sharded.bias.placements == (Replicate(),)
    x_shard = local_chunk(x.detach(), -1).requires_grad_()
    out = sharded(x_shard)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, expected, **TOL)
    out.sum().backward()
    expected.sum().backward()
    _assert_grads_match(sharded, reference)
    torch.testing.assert_close(x_shard.grad, local_chunk(x.grad, -1), **TOL)
    reference.zero_grad()

    dt = _parallel_copy(reference, RowwiseParallel(use_local_output=False))(x_shard)
    assert isinstance(dt, DTensor) and dt.placements == (Replicate(),)

    # reduce-scatter onto the sequence dim (sequence parallelism)
    seq = _parallel_copy(reference, RowwiseParallel(output_layouts=Shard(1)))(x_shard)
    torch.testing.assert_close(seq, local_chunk(expected.detach(), 1), **TOL)

    # a replicated input is split locally, without communication
    replicated_in = _parallel_copy(reference, RowwiseParallel(input_layouts=Replicate()))(x.detach())
    torch.testing.assert_close(replicated_in, expected.detach(), **TOL)


@on_ranks(2, 4)
def test_rowwise_embedding_shards_the_vocabulary():
    reference = nn.Embedding(20, 8)
    ids = torch.randint(0, 20, (2, 4 * dist.get_world_size()))
    expected = reference(ids)
    sharded = _parallel_copy(reference, RowwiseParallel())  # ids replicated by default
    assert sharded.weight.placements == (Shard(0),)
    out = sharded(ids)
    torch.testing.assert_close(out, expected, **TOL)
    out.sum().backward()
    expected.sum().backward()
    _assert_grads_match(sharded, reference)
    seq = _parallel_copy(reference, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))(ids)
    torch.testing.assert_close(seq, local_chunk(expected.detach(), 1), **TOL)


@on_ranks(2, 4)
def test_rowwise_embedding_looks_up_its_own_rows_and_keeps_its_gradient_sharded():
    # 21 rows on 4 ranks: 6, 6, 6, 3 (torch.chunk); a padding row on rank 1; a Gemma-like
    # subclass with its own forward keeps DTensor's embedding rule and still matches
    reference = nn.Embedding(21, 8, padding_idx=7)
    ids = torch.randint(0, 21, (3, 5))
    ids[0, 0] = 7
    expected = reference(ids)
    expected.square().sum().backward()
    for build in (lambda: copy.deepcopy(reference), lambda: _Scaled.like(reference)):
        module = build()
        sharded = parallelize_module(module, tp_mesh(), RowwiseParallel())
        out = sharded(ids)
        out.square().sum().backward()
        torch.testing.assert_close(out, expected * getattr(module, "scale", 1.0), **TOL)
        if not isinstance(module, _Scaled):
            grad = sharded.weight.grad
            assert grad.placements == (Shard(0),), grad.placements  # DTensor's rule: Replicate()
            assert grad.to_local().shape == sharded.weight.to_local().shape
            torch.testing.assert_close(grad.full_tensor(), reference.weight.grad, **TOL)
            assert grad.full_tensor()[7].abs().sum() == 0  # the padding row gets no gradient


class _Scaled(nn.Embedding):
    scale = 2.0

    @classmethod
    def like(cls, embedding):
        made = cls(embedding.num_embeddings, embedding.embedding_dim, padding_idx=embedding.padding_idx)
        made.load_state_dict(embedding.state_dict())
        return made

    def forward(self, ids):
        return super().forward(ids) * self.scale


@pytest.mark.parametrize("option", [{"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}], ids=str)
def test_rowwise_embedding_refuses_options_that_need_the_whole_table(option):
    from torch_tp.parallel.rules import UnsupportedModuleError, check_rowwise

    with pytest.raises(UnsupportedModuleError, match=rf"RowwiseParallel cannot shard 'emb' .* by vocabulary with \['{next(iter(option))}'\] set"):
        check_rowwise(nn.Embedding(8, 4, **option), 2, "emb")


# ------------------------------------------------------------------ uneven shards


def _uneven_colwise_feeds_rowwise():
    reference = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 6))
    x = torch.randn(4, 8)
    expected = reference(x)
    sharded = _parallel_copy(reference, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    local_features = sharded[0].weight.to_local().shape[0]
    out = sharded(x)
    torch.testing.assert_close(out, expected, **TOL)
    out.sum().backward()
    expected.sum().backward()
    _assert_grads_match(sharded, reference)
    return local_features


def test_uneven_colwise_output_survives_use_local_output_into_rowwise():
    # 10 features on 4 ranks are local 3, 3, 3, 1: the rowwise layer must rebuild the
    # global shape from its in_features, not from local size * 4 (upstream pytorch#150336).
    assert run_on_ranks(_uneven_colwise_feeds_rowwise, 4) == [3, 3, 3, 1]
    run_on_ranks(_uneven_colwise_feeds_rowwise, 2)


# ------------------------------------------------------------------ SequenceParallel


_SEQUENCE_LOCAL_MODULES = {
    "layernorm": lambda: nn.LayerNorm(8),
    "torch_rmsnorm": lambda: nn.RMSNorm(8),
    "user_rmsnorm": lambda: RMSNorm(8),
    "dropout": lambda: nn.Dropout(p=0.0),
}


@pytest.mark.parametrize("module", list(_SEQUENCE_LOCAL_MODULES))
@pytest.mark.parametrize("sequence_dim", [1, 0])
@on_ranks(2, 4)
def test_sequence_parallel_on_layernorm_rmsnorm_user_rmsnorm_and_dropout(module, sequence_dim):
    world = dist.get_world_size()
    reference = _SEQUENCE_LOCAL_MODULES[module]()
    for param in reference.parameters():
        nn.init.normal_(param)  # a custom init must survive (broadcast, not assumed ones)
    shape = [2, 2] if sequence_dim == 1 else [2 * world, 3]
    shape[sequence_dim] = 2 * world
    x = torch.randn(*shape, 8, requires_grad=True)
    expected = reference(x)
    sharded = _parallel_copy(reference, SequenceParallel(sequence_dim=sequence_dim))
    for param in sharded.parameters():
        assert param.placements == (Replicate(),)
    x_shard = local_chunk(x.detach(), sequence_dim).requires_grad_()
    out = sharded(x_shard)
    assert isinstance(out, DTensor) and out.placements == (Shard(sequence_dim),)
    torch.testing.assert_close(out.full_tensor(), expected, **TOL)
    out.to_local().sum().backward()
    expected.sum().backward()
    _assert_grads_match(sharded, reference)
    torch.testing.assert_close(x_shard.grad, local_chunk(x.grad, sequence_dim), **TOL)
    reference.zero_grad()
    local = _parallel_copy(reference, SequenceParallel(sequence_dim=sequence_dim, use_local_output=True))
    assert not isinstance(local(x_shard.detach()), DTensor)


@on_ranks(2)
def test_sequence_parallel_redistributes_a_dtensor_input_to_the_sequence_dim():
    reference = nn.LayerNorm(8)
    x = torch.randn(2, 4 * dist.get_world_size(), 8)
    sharded = _parallel_copy(reference, SequenceParallel())
    replicated = DTensor.from_local(x, tp_mesh(), [Replicate()])
    out = sharded(replicated)
    assert out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), reference(x).detach(), **TOL)


# ------------------------------------------------------------------ PrepareModule*


class TakesMixedArgs(nn.Module):
    """Records what forward receives; returns (x + y, scale, mask)."""

    def forward(self, x, scale, y, *, mask=None):
        self.seen = (
            getattr(x, "placements", "local"), scale, getattr(y, "placements", "local"),
            getattr(mask, "placements", "local"),
        )
        return x * scale + y, scale, mask


@on_ranks(2, 4)
def test_prepare_module_input_positional_layouts_with_none_placeholders():
    world = dist.get_world_size()
    module = TakesMixedArgs()
    style = PrepareModuleInput(
        input_layouts=(Shard(0), None, Replicate()),
        desired_input_layouts=(Replicate(), None, Replicate()),
    )
    parallelize_module(module, tp_mesh(), style)
    full_x = torch.arange(2.0 * world).reshape(2 * world, 1)
    y = torch.ones(2 * world, 1)
    out, scale, _ = module(local_chunk(full_x, 0), 3.0, y)
    assert module.seen[:3] == ((Replicate(),), 3.0, (Replicate(),))
    assert scale == 3.0  # the None placeholder passed the float through untouched
    torch.testing.assert_close(out.full_tensor(), full_x * 3.0 + 1.0)


@on_ranks(2)
def test_prepare_module_input_kwarg_layouts_and_use_local_output():
    world = dist.get_world_size()
    module = TakesMixedArgs()
    style = PrepareModuleInput(
        input_layouts=(Replicate(), None, None),
        desired_input_layouts=(Replicate(), None, None),
        input_kwarg_layouts={"mask": Shard(0)},
        desired_input_kwarg_layouts={"mask": Replicate()},
        use_local_output=True,
    )
    parallelize_module(module, tp_mesh(), style)
    full_mask = torch.arange(float(world * 2))
    out, _, mask = module(torch.ones(2), 2.0, torch.zeros(2), mask=local_chunk(full_mask, 0))
    assert module.seen == ("local", 2.0, "local", "local")
    torch.testing.assert_close(mask, full_mask)  # gathered, then handed over as a local tensor


class TwoOutputs(nn.Module):
    def forward(self, x):
        return x * 2, "label", x + 1


@on_ranks(2, 4)
def test_prepare_module_output_tuple_and_single_outputs():
    world = dist.get_world_size()
    full = torch.arange(4.0 * world).reshape(2 * world, 2)
    module = TwoOutputs()
    parallelize_module(module, tp_mesh(), PrepareModuleOutput(
        output_layouts=(Shard(0), None, Shard(0)),
        desired_output_layouts=(Replicate(), None, Shard(0)),
    ))
    doubled, label, plus_one = module(local_chunk(full, 0))
    assert label == "label"
    torch.testing.assert_close(doubled, full * 2)  # gathered, returned local (default)
    torch.testing.assert_close(plus_one, local_chunk(full, 0) + 1)

    single = nn.Identity()
    parallelize_module(single, tp_mesh(), PrepareModuleOutput(
        output_layouts=Shard(0), desired_output_layouts=Replicate(), use_local_output=False,
    ))
    out = single(local_chunk(full, 0))
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    torch.testing.assert_close(out.to_local(), full)


@on_ranks(2)
def test_prepare_module_input_output_gathers_input_and_scatters_output():
    world = dist.get_world_size()
    full = torch.randn(2, 2 * world, 4)
    reference = nn.Linear(4, 4)
    module = copy.deepcopy(reference)
    parallelize_module(module, tp_mesh(), PrepareModuleInputOutput(
        input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_input=True,
        output_layouts=Replicate(), desired_output_layouts=Shard(1),
    ))
    out = module(local_chunk(full, 1))
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, local_chunk(reference(full), 1).detach(), **TOL)


class _SharedPlusRouted(nn.Module):
    """Llama-4's MoE block adds into its shared expert's output in place: ``out.add_(routed)``."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.other = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 8)

    def forward(self, x):
        out = self.down(torch.relu(self.up(x)))  # a Rowwise output under the plan below
        out.add_(self.other(x))
        return out.mul_(2)


@on_ranks(2, 4)
def test_in_place_ops_on_a_rowwise_output_train_like_one_process():
    # DTensor.to_local() hands back a view made inside an autograd Function: autograd refused
    # the model's in-place add (upstream fails the same way)
    torch.manual_seed(0)
    reference = _SharedPlusRouted()
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    batches = ((torch.randn(3, 8), torch.randn(3, 8)) for _ in range(2))
    assert_trains_like(model, reference, batches, lambda out, target: (out - target).square().mean(),
                       optimizer=functools.partial(torch.optim.SGD, lr=0.1))


class _TokenMlp(nn.Module):
    """An MLP over the transposed tokens (an MLP-Mixer's token mixing): its Rowwise output is
    transposed back, so the gradient reaches the layer's local output transposed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x.transpose(1, 2)))).transpose(1, 2)


@on_ranks(2)
def test_a_gradient_that_arrives_transposed_at_a_local_output_trains_like_one_process():
    reference = _TokenMlp()
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    batches = [(torch.randn(2, 8, 4), torch.randn(2, 8, 4)) for _ in range(2)]
    assert_trains_like(model, reference, batches, lambda out, target: (out - target).square().mean(),
                       optimizer=functools.partial(torch.optim.SGD, lr=0.1), what="token mlp")
