"""The one int8 rule (``torch_tp._tokens``): properties over any float rows, NaN and inf included,
then its users on real gloo ranks against one process.

The properties are drawn by hypothesis (CI: the seeded "ci" profile of ``tests/conftest.py``):
every non-finite value comes back as itself (NaN as NaN, +-inf with its sign), every finite one
within half a quantization step of its row, and a row without NaN or inf is quantized exactly by
the plain symmetric rule (``scale = amax / 127``). On ranks: the int8 collectives keep NaN and
inf where the float collectives have them, a NaN or inf token through an int8-communication
MLP (forward, and a NaN output gradient backward) gives what one process gives, and W8A8 gives a
NaN row for a non-finite token.
"""

import copy

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

import torch_tp.overlap  # noqa: F401  (registers torch.ops.torch_tp.int8_*)
from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp._tokens import QMAX, dequantize_tokens, marked_rows, packed_tokens, quantize_tokens, unpacked_tokens
from torch_tp.testing import on_ranks, rank, tp_mesh, world_size

_FLOATS = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),   # anything float32 holds
    st.floats(-4.0, 4.0, width=32),                             # ordinary activations
    st.sampled_from([0.0, -0.0, 1e-45, -3e38, 3e38]),           # zeros, a subnormal, near the largest
)
_ROWS = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=9), elements=_FLOATS)


def _finite_amax(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x.abs(), 0).amax(-1, keepdim=True) if x.shape[-1] else x.new_zeros(
        *x.shape[:-1], 1)


@given(_ROWS)
def test_property_non_finite_values_come_back_as_themselves_and_finite_ones_within_half_a_step(rows):
    x = torch.from_numpy(rows)
    q, scale = quantize_tokens(x)
    back = dequantize_tokens(q, scale, torch.float32)
    assert q.dtype == torch.int8 and back.shape == x.shape
    assert torch.equal(back.isnan(), x.isnan())
    assert torch.equal(back == torch.inf, x == torch.inf) and torch.equal(back == -torch.inf, x == -torch.inf)
    finite = torch.isfinite(x)
    marked = ~finite.all(-1, keepdim=True) if x.shape[-1] else torch.zeros(*x.shape[:-1], 1, dtype=torch.bool)
    assert torch.equal(marked_rows(scale), marked)
    step = _finite_amax(x) / torch.where(marked, QMAX - 1.0, float(QMAX))
    error = torch.where(finite, (back - x).abs(), 0)
    assert (error <= step / 2 * (1 + 1e-6) + 1e-38).all(), (error.max(), step)


@given(_ROWS.filter(lambda a: np.isfinite(a).all()))
def test_property_a_finite_row_is_quantized_by_the_plain_symmetric_rule(rows):
    x = torch.from_numpy(rows)
    q, scale = quantize_tokens(x)
    amax = _finite_amax(x)
    want_scale = torch.where(amax / QMAX > 0, amax / QMAX, 1.0)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q, torch.clamp(torch.round(x / want_scale), -QMAX, QMAX).to(torch.int8))


@given(_ROWS.filter(lambda a: a.ndim >= 2))
def test_property_packing_moves_the_values_and_scales_bit_for_bit(rows):
    x = torch.from_numpy(rows)
    q, scale = quantize_tokens(x)
    assert torch.equal(unpacked_tokens(packed_tokens(x), list(x.shape), torch.float32).nan_to_num(),
                       dequantize_tokens(q, scale, torch.float32).nan_to_num())


# --------------------------------------------------------------------------------------------- on ranks

_NAN, _INF = float("nan"), float("inf")


def _with_non_finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a NaN, a +inf and a -inf in three tokens (the same on every rank)."""
    x = x.clone()
    x[0, 1, 3], x[0, 2, 0], x[1, -1, 5] = _NAN, _INF, -_INF
    return x


def _same_non_finite(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    for name, test in (("NaN", torch.isnan), ("+inf", lambda t: t == _INF), ("-inf", lambda t: t == -_INF)):
        assert torch.equal(test(got), test(want)), f"{what}: {name} at {test(got).nonzero().tolist()}, one process " \
                                                   f"at {test(want).nonzero().tolist()}"


@on_ranks(2, 4)
def test_the_int8_collectives_keep_nan_and_inf_where_the_float_collectives_have_them():
    ranks, me, group = world_size(), rank(), tp_mesh().get_group().group_name
    torch.manual_seed(0)
    whole = _with_non_finite(torch.randn(2, 2 * ranks, 8))
    gathered = torch.ops.torch_tp.int8_all_gather(whole.chunk(ranks, dim=1)[me].contiguous(), 1, group)
    _same_non_finite(gathered, whole, "int8_all_gather")
    finite = torch.isfinite(whole)
    assert ((gathered - whole).abs()[finite] <= 4 / 252 + 1e-6).all()
    partials = [_with_non_finite(torch.randn(2, 2 * ranks, 8)) if r == ranks - 1 else torch.randn(2, 2 * ranks, 8)
                for r in range(ranks)]
    reduced = torch.ops.torch_tp.int8_reduce_scatter(partials[me], 1, group)
    _same_non_finite(reduced, sum(partials).chunk(ranks, dim=1)[me], "int8_reduce_scatter")


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _int8_plan(overlap: bool) -> dict:
    return {
        "up": ColwiseParallel(input_layouts=Shard(1), comm_dtype=torch.int8, overlap=overlap),
        "down": RowwiseParallel(output_layouts=Shard(1), comm_dtype=torch.int8, overlap=overlap),
    }


@pytest.mark.parametrize("overlap", [False, True], ids=["unfused", "overlap"])
@on_ranks(2, 4)
def test_a_nan_or_inf_token_under_int8_communication_gives_what_one_process_gives(overlap):
    # forward: the token holding NaN gives a NaN row, the +-inf tokens inf or NaN where one
    # process has them; backward from an output gradient holding NaN: the weight gradients'
    # NaN where one process has them. The finite values: within the int8 rounding.
    torch.manual_seed(0)
    reference = _MLP()
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), _int8_plan(overlap))
    ranks, me = world_size(), rank()
    x = _with_non_finite(torch.randn(2, 2 * ranks, 8))
    dy = torch.randn(2, 2 * ranks, 8)
    dy[1, 0, 2] = _NAN
    want = reference(x)
    want.backward(dy)
    got = model(x.chunk(ranks, dim=1)[me])  # this rank's tokens in, its tokens out
    got.backward(dy.chunk(ranks, dim=1)[me])
    want = want.detach().chunk(ranks, dim=1)[me]
    _same_non_finite(got, want, "output")
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05, equal_nan=True)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        _same_non_finite(p.grad.full_tensor(), q.grad, f"{name}.grad")


@on_ranks(2)
def test_w8a8_gives_a_nan_row_for_a_token_holding_nan_or_inf_and_leaves_the_others_as_they_were():
    from torch_tp.quant import Int8SymmetricTensor

    torch.manual_seed(0)
    linear = nn.Linear(8, 6)
    linear.weight = nn.Parameter(Int8SymmetricTensor.from_hp(linear.weight.detach(), activations="int8"),
                                 requires_grad=False)
    x = torch.randn(5, 8)
    clean = linear(x)
    x[1, 2], x[3, 0] = _NAN, -_INF
    y = linear(x)
    assert y[[1, 3]].isnan().all()
    torch.testing.assert_close(y[[0, 2, 4]], clean[[0, 2, 4]], rtol=0, atol=0)
    model = parallelize_module(copy.deepcopy(linear), tp_mesh(), ColwiseParallel(use_local_output=False))
    torch.testing.assert_close(model(x).full_tensor(), y, rtol=0, atol=0, equal_nan=True)


@on_ranks(2)
def test_int8_communication_of_an_empty_batch_is_an_empty_batch():
    # before: the packing's reshape(0, -1) failed inside _tokens.py
    group, ranks = tp_mesh().get_group().group_name, world_size()
    empty = torch.randn(0, 3, 8, requires_grad=True)
    gathered = torch.ops.torch_tp.int8_all_gather(empty, 1, group)
    assert gathered.shape == (0, 3 * ranks, 8)
    assert torch.ops.torch_tp.int8_reduce_scatter(torch.randn(0, 2 * ranks, 8), 1, group).shape == (0, 2, 8)
    gathered.sum().backward()
    assert empty.grad.shape == empty.shape
