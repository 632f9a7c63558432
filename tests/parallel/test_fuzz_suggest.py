"""Property-based fuzzing of transformer-shaped models x plans (the styles', and ``suggest_plan``'s)
against one process (hypothesis): the second half of the plan fuzzer (``test_fuzz_plans.py`` draws
MLP stacks with the fused and int8 options).

hypothesis draws a :class:`Case` in the parent: a model of an ``nn.Embedding`` in front (its rows
divisible by the ranks or not) or float inputs, 1 or 2 blocks of a norm (``LayerNorm``,
``RMSNorm`` or none), a causal attention block (its heads split: ``wq``/``wk``/``wv``/``wo``;
with a learned scale on the query heads, its own parameter, under derived plans: issue 35's
module-owned parameter, tested on its own in ``tests/tools/test_suggest_owned_parameters.py``)
or not, and an MLP, then a final norm and a linear head; a plan for it, written from the styles
(tensor parallel, or sequence parallel with ``SequenceParallel`` norms) or derived by
``torch_tp.suggest_plan`` (with ``sequence_parallel=`` drawn too, on an example batch of 2
sequences the ranks divide); a world size (2 or 4), a dtype (float32, float64, bfloat16) and two
training batches (sizes that divide or not, one token, none, NaN or inf in a float input). The
ranks build the model from the case's seed, parallelize it and train it for 2 SGD steps beside
the single-process model; a case passes if it trains like one process, or if every rank raises
the same named error (a ``torch_tp`` refusal, ``suggest_plan``'s ``PlanDerivationError``
included) before anything diverges.

Tolerances: 1e-4 / 1e-5 (float32), 1e-10 (float64), and for bfloat16 ``rtol=atol=0.02``
against the one-process model *in bfloat16*: the claim is "trains like one process", and the
only difference between the two is where the split sums round (each rank's partial sum, then
their sum: half a unit in the last place of the output's scale, 2**-8 of it). Measured on 14
drawn bfloat16 cases of both fuzzers, 2 SGD steps, attention and norms included: every one
matched within 0.008, most within 0.004; 0.02 leaves room for deeper draws. A float64
reference would fold bfloat16's own rounding (which one process makes too, ~0.4% per op) into
the bound and hide a wrong plan behind it.

CI runs the seeded "ci" budget of ``tests/conftest.py`` (``FUZZ_EXAMPLES`` cases); a longer hunt:
``TORCH_TP_HYPOTHESIS=hunt python3 -m pytest tests/parallel/test_fuzz_suggest.py``. Each case it
finds wrong is kept below as a named regression test.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from torch_tp import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module, suggest_plan
from torch_tp.testing import assert_trains_like, local_chunk, tp_mesh

from fuzzing import TOLERANCE, NonFiniteAsNaN, named_refusal, outcomes_on_ranks

# per CI run (on warm pools a styles case takes under a second, a derived one 1-3 s; 3-16 s on 2 busy cores); else the hunt's
FUZZ_EXAMPLES = 4 if os.environ.get("TORCH_TP_HYPOTHESIS", "ci") == "ci" else settings.default.max_examples


@dataclasses.dataclass(frozen=True)
class Case:
    """One fuzzed model, plan and pair of batches (drawn in the parent, built on every rank)."""

    world: int
    vocab: int  # rows of the embedding in front; 0: float inputs
    blocks: int
    heads: int  # 0: no attention block
    head_dim: int
    q_scale: bool  # a learned scale on the query heads, the attention module's own parameter (issue 35)
    hidden: int
    bias: bool
    norm: str  # "", "layer", "rms"
    plan: str  # "styles", "suggest"
    sequence_parallel: bool
    dtype: str
    batch: int
    seq: int
    special: str  # "", "nan", "inf": one value of a float batch
    seed: int

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim if self.heads else self.head_dim * self.world


@st.composite
def cases(draw) -> Case:
    world = draw(st.sampled_from([2, 4]))
    plan = draw(st.sampled_from(["styles", "suggest"]))
    vocab = draw(st.sampled_from([0, 0, world * 4, world * 4 + 1]))
    heads = draw(st.sampled_from([0, world, 2 * world] + ([world + 1] if plan == "suggest" else [])))
    return Case(
        world=world,
        vocab=vocab,
        blocks=draw(st.integers(1, 2)),
        heads=heads,
        head_dim=draw(st.integers(1, 3)),
        q_scale=bool(heads) and plan == "suggest" and draw(st.booleans()),  # a plan by hand would have to place it
        hidden=world * draw(st.integers(1, 3)),
        bias=draw(st.booleans()),
        norm=draw(st.sampled_from(["", "layer", "rms"])),
        plan=plan,
        # derived on float inputs, the stream meets the whole input in the first residual add: refused, by name
        sequence_parallel=draw(st.booleans()) if vocab or plan == "styles" else False,
        dtype=draw(st.sampled_from(["float32", "float64", "bfloat16"])),
        batch=draw(st.sampled_from([0, 1, 2])),
        seq=draw(st.sampled_from([1, world, 2 * world, 2 * world + 1])),
        special="" if vocab else draw(st.sampled_from(["", "", "nan", "inf"])),
        seed=draw(st.integers(0, 2**16)),
    )


def _norm(case: Case) -> nn.Module:
    return {"": nn.Identity, "layer": nn.LayerNorm, "rms": nn.RMSNorm}[case.norm](case.dim)


class _Attention(nn.Module):
    """Causal self-attention whose head count follows from the local features (``-1``)."""

    def __init__(self, case: Case):
        super().__init__()
        self.head_dim = case.head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(case.dim, case.dim, bias=case.bias) for _ in range(4))
        if case.q_scale:
            self.q_scale = nn.Parameter(torch.rand(case.head_dim) + 0.5)

    def forward(self, x):
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if hasattr(self, "q_scale"):
            q = q * self.q_scale
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2))


class _Block(nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        if case.heads:
            self.attention_norm, self.attention = _norm(case), _Attention(case)
        self.ffn_norm = _norm(case)
        self.up = nn.Linear(case.dim, case.hidden, bias=case.bias)
        self.down = nn.Linear(case.hidden, case.dim, bias=case.bias)

    def forward(self, x):
        if hasattr(self, "attention"):
            x = x + self.attention(self.attention_norm(x))
        return x + self.down(F.gelu(self.up(self.ffn_norm(x))))


class _Model(nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        if case.vocab:
            self.embedding = nn.Embedding(case.vocab, case.dim)
        self.blocks = nn.Sequential(*(_Block(case) for _ in range(case.blocks)))
        self.norm = _norm(case)
        self.head = nn.Linear(case.dim, case.world * 2, bias=case.bias)
        self.finite = NonFiniteAsNaN()

    def forward(self, x):
        if hasattr(self, "embedding"):
            x = self.embedding(x)
        return self.finite(self.head(self.norm(self.blocks(x))))


def _model(case: Case) -> nn.Module:
    torch.manual_seed(case.seed)
    return _Model(case).to(getattr(torch, case.dtype))


def _styles_plan(case: Case) -> dict:
    """The plan a user writes from the styles: heads and MLP split, the embedding vocabulary-parallel
    (rows that do not divide too: its shards are uneven), the head gathered; under sequence
    parallelism the residual stream on ``Shard(1)`` between them and the norms ``SequenceParallel``."""
    between = Shard(1) if case.sequence_parallel else Replicate()
    plan = {"blocks.*.up": ColwiseParallel(input_layouts=between),
            "blocks.*.down": RowwiseParallel(output_layouts=between),
            "head": ColwiseParallel(input_layouts=between, output_layouts=Replicate())}
    if case.heads:
        plan["blocks.*.attention.w[qkv]"] = ColwiseParallel(input_layouts=between)
        plan["blocks.*.attention.wo"] = RowwiseParallel(output_layouts=between)
    if case.vocab:
        plan["embedding"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if case.sequence_parallel and case.norm:
        plan.update({"blocks.*.*_norm": SequenceParallel(), "norm": SequenceParallel()})
    return plan


def _batch(case: Case, step: int, batch: int | None = None, seq: int | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case.seed + step)
    shape = (case.batch if batch is None else batch, case.seq if seq is None else seq)
    if case.vocab:
        return torch.randint(0, case.vocab, shape, generator=generator)
    x = torch.randn(*shape, case.dim, generator=generator, dtype=getattr(torch, case.dtype))
    if case.special and x.numel() and batch is None:
        x.view(-1)[x.numel() // 2] = float(case.special)
    return x


def _plan(case: Case, reference: nn.Module) -> dict:
    if case.plan == "styles":
        return _styles_plan(case)
    example = _batch(case, -1, batch=2, seq=2 * case.world)  # derived once on a batch the ranks divide
    return suggest_plan(reference, tp_mesh(), (example,), sequence_parallel=case.sequence_parallel)


def _mean_square(out, _):
    return out.pow(2).sum() / max(out.numel(), 1)


def _train_case(case: Case) -> str:
    """On every rank: ``"trained"`` if the case trains like one process, else this rank's named error."""
    reference = _model(case)
    try:
        model = parallelize_module(copy.deepcopy(reference), tp_mesh(), _plan(case, reference))
        # a hand-written sequence-parallel plan takes this rank's strip of float inputs (an embedding splits its own)
        strip = case.plan == "styles" and case.sequence_parallel and not case.vocab
        assert_trains_like(model, reference, [(_batch(case, step), None) for step in range(2)], _mean_square,
                           optimizer=functools.partial(torch.optim.SGD, lr=0.05), **TOLERANCE[case.dtype],
                           module_inputs=functools.partial(local_chunk, dim=1) if strip else None, what=str(case))
    except Exception as error:  # an AssertionError (a mismatch) is never a named refusal
        if not named_refusal(error, also=("PlanDerivationError",)):
            raise
        return f"{type(error).__name__}: {str(error).split(';')[0][:300]}"
    return "trained"


def _run(case: Case) -> list[str]:
    return outcomes_on_ranks(_train_case, case, timeout=120)


@settings(max_examples=FUZZ_EXAMPLES)
@given(cases())
def test_property_a_fuzzed_transformer_plan_trains_like_one_process_or_every_rank_raises_the_same_named_error(case):
    outcome = _run(case)[0]
    event(f"{case.plan}: {'trained' if outcome == 'trained' else outcome.split(':')[0]}")


# --------------------------------------------------------------------------------------------- regressions
# Each case the fuzzer found wrong, kept as it found it (before the fix: the outcome in the comment).

_FOUND = {
    # PlanDerivationError: "the residual stream cannot be split along the sequence: head reads it but is not
    # split by features": the head's output reaches the return through isfinite, ~ and masked_fill, which had
    # no rule, so the head was no output head (kept whole). Now pointwise rules (tools/_dataflow.py)
    "derived_sequence_parallel_head_before_a_non_finite_mask": Case(
        world=2, vocab=8, blocks=1, heads=2, head_dim=2, q_scale=False, hidden=4, bias=False, norm="", plan="suggest",
        sequence_parallel=True, dtype="bfloat16", batch=1, seq=5, special="", seed=5684),
    "derived_sequence_parallel_one_token_ws4": Case(
        world=4, vocab=16, blocks=1, heads=0, head_dim=2, q_scale=False, hidden=12, bias=False, norm="rms",
        plan="suggest", sequence_parallel=True, dtype="bfloat16", batch=2, seq=1, special="", seed=26869),
}


@pytest.mark.parametrize("name", list(_FOUND))
def test_a_transformer_case_the_fuzzer_found_trains_like_one_process(name):
    case = _FOUND[name]
    assert _run(case) == ["trained"] * case.world


# Found: a hand-written sequence-parallel plan on a sequence the ranks do not divide. Each rank's strip
# is its torch.chunk (3 and 2 of 5 tokens), but a plain tensor is read as an even shard (this rank's
# size x ranks, as DTensor.from_local reads it: torch_tp/_layouts.py), so the ranks disagree on the
# whole and every rank raises "ColwiseParallel on 'blocks.0.attention.wq' (Linear): the ranks' inputs,
# as one sharded tensor, have different shapes [(2, 6, 4), (2, 4, 4)]; ... pad dim 1 to a multiple of
# 2, or pass a DTensor". Named, so the property passes; kept here until plain uneven strips are agreed
# (their lengths gathered). suggest_plan's sequence-parallel plans hand the stream on as DTensors: they train.
_FAILING_FOR_NOW = {
    "styles_sequence_parallel_uneven_sequence": Case(
        world=2, vocab=0, blocks=1, heads=2, head_dim=2, q_scale=False, hidden=6, bias=False, norm="",
        plan="styles", sequence_parallel=True, dtype="float64", batch=2, seq=5, special="", seed=10073),
}


@pytest.mark.xfail(strict=True, reason="torch_tp/_layouts.py: an uneven local strip under Shard(1) is refused")
@pytest.mark.parametrize("name", list(_FAILING_FOR_NOW))
def test_a_case_the_fuzzer_found_refused_for_now_trains_like_one_process(name):
    case = _FAILING_FOR_NOW[name]
    assert _run(case) == ["trained"] * case.world
