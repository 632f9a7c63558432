"""torch_tp and upstream ``torch.distributed.tensor.parallel`` are interchangeable.

* upstream's ``parallelize_module`` applies torch_tp styles, and torch_tp's applies
  upstream styles (globs included), with the single-process results;
* neither torch_tp styles nor the user's upstream style objects are changed by torch_tp's
  ``parallelize_module`` (upstream's own mutates them);
* ``src_data_rank`` reaches every style, the root ``""`` key included;
* code written for upstream runs after changing the import, with the same keyword
  arguments and defaults.
"""

import copy
import importlib
import inspect
import warnings

import pytest
import torch
import torch.distributed.tensor.parallel.style as upstream_style
import torch.distributed.tensor.parallel as upstream
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

import torch_tp
from torch_tp import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch_tp.models.llama import RMSNorm, TransformerBlock, block_tensor_parallel_plan, rotary_table
from torch_tp.testing import (
    TOL,
    full_tensor,
    on_ranks,
    rank,
    run_on_ranks,
    small_llama_args,
    tp_mesh,
    world_size,
    world_sizes,
)

ARGS = small_llama_args(n_layers=1)
STYLE_NAMES = [name for name in upstream_style.__all__ if name != "ParallelStyle"]  # upstream's styles


# ----------------------------------------------------------------------------- helpers


def _snapshot(plan):
    return [(style, copy.deepcopy(vars(style))) for style in plan.values()]


def _assert_unchanged(snapshot):
    for style, before in snapshot:
        assert vars(style) == before, f"{style!r} was changed: {before} -> {vars(style)}"


def _seq_shard(t):
    return t.chunk(world_size(), dim=1)[rank()]


def _run_block(block, x, rope):
    """Forward + backward of a (parallelized or reference) block; returns (output, input grad).

    Under sequence parallelism a parallelized block takes and returns this rank's sequence
    shard; the loss is the sum over ranks of the shard losses, i.e. the global loss.
    """
    x = x.clone().requires_grad_()
    out = block(x, rope)
    out.pow(2).sum().backward()
    return out, x.grad


def _block_input():
    return torch.randn(2, 8, ARGS.dim), rotary_table(ARGS.head_dim, ARGS.max_seq_len, ARGS.rope_theta)


def _check_block(block, reference, x, rope, sequence_parallel, what):
    """``block``'s output, input grad and parameter grads equal ``reference``'s; returns the output."""
    reference.zero_grad(set_to_none=True)
    ref_out, ref_grad = _run_block(reference, x, rope)
    local_x = _seq_shard(x) if sequence_parallel else x
    out, x_grad = _run_block(block, local_x, rope)
    if sequence_parallel:
        ref_out, ref_grad = _seq_shard(ref_out), _seq_shard(ref_grad)
    torch.testing.assert_close(out, ref_out, **TOL, msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(x_grad, ref_grad, **TOL, msg=lambda m: f"{what} input grad: {m}")
    for (name, param), ref_param in zip(block.named_parameters(), reference.parameters()):
        # Without sequence parallelism the norms stay plain replicated parameters.
        assert isinstance(param, DTensor) == (sequence_parallel or "norm" not in name), name
        torch.testing.assert_close(
            full_tensor(param.grad), ref_param.grad, **TOL, msg=lambda m: f"{what} grad {name}: {m}"
        )
    return out.detach()


# -------------------------------------------- upstream parallelize_module, torch_tp styles


_TP_AND_SP = pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
_SRC_DATA_RANKS = pytest.mark.parametrize("src_data_rank", [0, None], ids=["src0", "srcNone"])


@_TP_AND_SP
@on_ranks(2, 4)
def test_upstream_parallelize_module_applies_torch_tp_styles_like_torch_tp(sequence_parallel):
    torch.manual_seed(0)
    reference = TransformerBlock(ARGS)
    by_upstream, by_torch_tp = copy.deepcopy(reference), copy.deepcopy(reference)
    plan = block_tensor_parallel_plan(sequence_parallel=sequence_parallel)
    assert {type(s) for s in plan.values()} >= {ColwiseParallel, RowwiseParallel, PrepareModuleInput}
    # Upstream matches globs per path component ('attention.w[kqv]' -> 'attention', 'w[kqv]'),
    # which these keys allow; it only warns on keys it cannot resolve, so make that an error.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        upstream.parallelize_module(by_upstream, tp_mesh(), plan)
    parallelize_module(by_torch_tp, tp_mesh(), block_tensor_parallel_plan(sequence_parallel=sequence_parallel))
    for (name, p), (_, q) in zip(by_upstream.named_parameters(), by_torch_tp.named_parameters()):
        assert type(p) is type(q) and getattr(p, "placements", None) == getattr(q, "placements", None), name
    x, rope = _block_input()
    out_upstream = _check_block(by_upstream, reference, x, rope, sequence_parallel, "upstream parallelize_module")
    out_torch_tp = _check_block(by_torch_tp, reference, x, rope, sequence_parallel, "torch_tp parallelize_module")
    torch.testing.assert_close(out_upstream, out_torch_tp, rtol=0, atol=0)


# -------------------------------------------- torch_tp parallelize_module, upstream styles


def _upstream_block_plan(sequence_parallel):
    """The Llama block plan written with upstream styles and torch_tp's cross-dot globs."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention": upstream.PrepareModuleInput(
            input_layouts=(between, None), desired_input_layouts=(Replicate(), None)
        ),
        "*.w[kqv]": upstream.ColwiseParallel(),
        "*.wo": upstream.RowwiseParallel(output_layouts=between),
        "feed_forward": upstream.PrepareModuleInput(
            input_layouts=(between,), desired_input_layouts=(Replicate(),)
        ),
        "*feed_forward.w[13]": upstream.ColwiseParallel(),
        "*.w2": upstream.RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        plan["*_norm"] = upstream.SequenceParallel()
    return plan


@_TP_AND_SP
@on_ranks(2, 4)
def test_torch_tp_applies_upstream_styles_via_globs_without_mutating_them(sequence_parallel):
    torch.manual_seed(0)
    reference = TransformerBlock(ARGS)
    block = copy.deepcopy(reference)
    plan = _upstream_block_plan(sequence_parallel)
    snapshot = _snapshot(plan)
    parallelize_module(block, tp_mesh(), plan)
    _assert_unchanged(snapshot)
    assert block.attention.wk.weight.placements == (Shard(0),)
    assert block.feed_forward.w2.weight.placements == (Shard(1),)
    _check_block(block, reference, *_block_input(), sequence_parallel, "upstream styles via torch_tp")

    # The same style object, applied by upstream itself, is changed (so the check above can fail).
    rowwise = plan["*.wo"]
    assert "desired_input_layouts" not in vars(rowwise) and "src_data_rank" not in vars(rowwise)
    upstream.parallelize_module(copy.deepcopy(reference), tp_mesh(), {"attention.wo": rowwise}, src_data_rank=None)
    assert vars(rowwise)["desired_input_layouts"] == (Shard(-1),) and vars(rowwise)["src_data_rank"] is None


# ------------------------------------------------------- torch_tp styles are never changed


@_SRC_DATA_RANKS
@on_ranks(2)
def test_torch_tp_styles_are_not_mutated_by_parallelize_module(src_data_rank):
    plan = {**_all_styles_plan(torch_tp), **block_tensor_parallel_plan(sequence_parallel=True, prefix="block.")}
    snapshot = _snapshot(plan)
    hashes = [hash(style) for style in plan.values()]
    model = Toy()
    model.block = TransformerBlock(ARGS)
    parallelize_module(model, tp_mesh(), plan, src_data_rank=src_data_rank)
    _assert_unchanged(snapshot)
    assert [hash(style) for style in plan.values()] == hashes
    assert all("src_data_rank" not in vars(style) for style in plan.values())


# ------------------------------------------------------------------------ src_data_rank


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Module()
        self.block.proj = nn.Linear(8, 8)
        self.block.emb = nn.Embedding(8, 8)
        self.block.norm = nn.LayerNorm(8)


def _filled_with_rank(module):
    with torch.no_grad():
        for param in module.parameters():
            param.fill_(float(rank()))
    return module


def _local_values(module):
    """{parameter name: sorted distinct values of this rank's local shard}."""
    return {name: sorted(set(_full_local(p).flatten().tolist())) for name, p in module.named_parameters()}


def _full_local(p):
    return p.to_local() if isinstance(p, DTensor) else p


# case: (module factory, plan)
_SRC_DATA_RANK_CASES = {
    "root_dict_colwise": (lambda: nn.Linear(8, 8), lambda: {"": ColwiseParallel()}),
    "root_style_colwise": (lambda: nn.Linear(8, 8), lambda: ColwiseParallel()),
    "root_dict_upstream_colwise": (lambda: nn.Linear(8, 8), lambda: {"": upstream.ColwiseParallel()}),
    "root_dict_sequence_parallel": (lambda: RMSNorm(8), lambda: {"": SequenceParallel()}),
    "nested_colwise": (Nested, lambda: {"block.proj": ColwiseParallel()}),
    "nested_rowwise": (Nested, lambda: {"block.proj": RowwiseParallel()}),
    "nested_embedding_rowwise": (Nested, lambda: {"block.emb": RowwiseParallel()}),
    "nested_glob_colwise": (Nested, lambda: {"*proj": ColwiseParallel()}),
    "nested_sequence_parallel": (Nested, lambda: {"block.norm": SequenceParallel()}),
    "nested_upstream_rowwise": (Nested, lambda: {"block.proj": upstream.RowwiseParallel()}),
}


@pytest.mark.parametrize("case", list(_SRC_DATA_RANK_CASES))
@_SRC_DATA_RANKS
@on_ranks(2)
def test_src_data_rank_reaches_every_style_including_the_root_key(src_data_rank, case):
    build, plan = _SRC_DATA_RANK_CASES[case]
    module = _filled_with_rank(build())
    parallelize_module(module, tp_mesh(), plan(), src_data_rank=src_data_rank)
    placed = {
        name: values for name, values in _local_values(module).items() if isinstance(module.get_parameter(name), DTensor)
    }
    assert placed, "nothing was parallelized"
    # 0: scattered / broadcast from rank 0; None: every rank keeps its own values.
    expected = [0.0] if src_data_rank == 0 else [float(rank())]
    assert placed == {name: expected for name in placed}


# ------------------------------------------------------ upstream code, changed import


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x, *, scale):
        # ``scale`` (a local replicated tensor) multiplies the replicated output: applied to
        # the column-sharded hidden state its grad would be a partial sum that to_local's
        # backward takes for a replicated one.
        return self.down(F.relu(self.up(x))) * scale


class FeedForwardWrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()

    def forward(self, x, scale):
        return self.gate(x, scale=scale)


class Toy(nn.Module):
    """Embedding -> norm -> gated MLP (keyword input) -> residual -> head -> identity."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.ffn = FeedForwardWrapper()
        self.head = nn.Linear(8, 16)
        self.post = nn.Identity()

    def forward(self, tokens):
        h = self.norm(self.emb(tokens))
        scale = torch.sigmoid(h.sum(-1, keepdim=True))
        h = h + self.ffn(h, scale)
        return self.post(self.head(h))


def _all_styles_plan(lib):
    """A sequence-parallel plan for :class:`Toy` using every style and every keyword argument
    of upstream's API; ``lib`` is ``torch.distributed.tensor.parallel`` or ``torch_tp``."""
    return {
        "emb": lib.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=True),
        "norm": lib.SequenceParallel(sequence_dim=1, use_local_output=False),
        "ffn": lib.PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        ),
        "ffn.gate": lib.PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            input_kwarg_layouts={"scale": Shard(1)},
            desired_input_kwarg_layouts={"scale": Replicate()},
            use_local_output=True,
        ),
        "ffn.gate.up": lib.ColwiseParallel(),
        "ffn.gate.down": lib.RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate()),
        "head": lib.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False),
        "post": lib.PrepareModuleInputOutput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(1),),
            input_kwarg_layouts=None,
            desired_input_kwarg_layouts=None,
            use_local_input=False,
            output_layouts=(Shard(1),),
            desired_output_layouts=(Replicate(),),
            use_local_output=True,
        ),
    }


def _upstream_program(library):
    lib = importlib.import_module(library)
    torch.manual_seed(0)
    reference = Toy()
    model = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lib.parallelize_module(model, tp_mesh(), _all_styles_plan(lib))
    tokens = torch.randint(0, 16, (2, 8))
    out, ref_out = model(tokens), reference(tokens)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, ref_out, **TOL)
    out.pow(2).mean().backward()
    ref_out.pow(2).mean().backward()
    grads = {}
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(param, DTensor), name
        grads[name] = full_tensor(param.grad)
        torch.testing.assert_close(grads[name], ref_param.grad, **TOL, msg=lambda m: f"grad {name}: {m}")
    return out.detach(), grads


@world_sizes(2, 4)
def test_upstream_code_runs_unchanged_after_switching_the_import_to_torch_tp(world_size):
    by_upstream = run_on_ranks(_upstream_program, world_size, "torch.distributed.tensor.parallel")
    by_torch_tp = run_on_ranks(_upstream_program, world_size, "torch_tp")
    for (out_up, grads_up), (out_tp, grads_tp) in zip(by_upstream, by_torch_tp):
        torch.testing.assert_close(out_tp, out_up, **TOL)
        assert grads_tp.keys() == grads_up.keys()
        for name in grads_up:
            torch.testing.assert_close(grads_tp[name], grads_up[name], **TOL)


# Defaults torch_tp documents as different in kind but not in effect: None in upstream's
# signature may be shown as the placement it stands for.
DOCUMENTED_DEFAULTS = {
    ("ColwiseParallel", "input_layouts"): Replicate(),
    ("ColwiseParallel", "output_layouts"): Shard(-1),
    ("RowwiseParallel", "input_layouts"): None,
}


@pytest.mark.parametrize("name", STYLE_NAMES + ["parallelize_module"])
def test_styles_and_parallelize_module_take_upstream_arguments_and_defaults(name):
    ours, theirs = getattr(torch_tp, name), getattr(upstream, name)
    if inspect.isclass(ours):
        assert issubclass(ours, upstream.ParallelStyle)
        ours, theirs = ours.__init__, theirs.__init__
    params = inspect.signature(ours).parameters
    upstream_params = inspect.signature(theirs).parameters
    # Every upstream argument, in upstream's order; torch_tp may only add keyword-only
    # options with defaults after them (additive: upstream calls still mean the same).
    assert list(params)[: len(upstream_params)] == list(upstream_params)
    for extra in list(params)[len(upstream_params):]:
        assert params[extra].kind is inspect.Parameter.KEYWORD_ONLY, extra
        assert params[extra].default is not inspect.Parameter.empty, extra
    for arg, upstream_param in upstream_params.items():
        param = params[arg]
        assert param.kind == upstream_param.kind, arg
        if (name, arg) in DOCUMENTED_DEFAULTS:
            assert param.default in (upstream_param.default, DOCUMENTED_DEFAULTS[name, arg]), arg
        else:
            assert param.default == upstream_param.default, arg


def test_every_style_accepts_upstream_keyword_arguments():
    plan = _all_styles_plan(torch_tp)
    assert {type(style).__name__ for style in plan.values()} == set(STYLE_NAMES)
    assert all(isinstance(style, upstream.ParallelStyle) for style in plan.values())
    # Same keyword arguments -> equal styles, whichever way the defaults were spelled.
    assert ColwiseParallel() == ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))
    assert SequenceParallel() == SequenceParallel(sequence_dim=1, use_local_output=False)
    assert PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()) == PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
