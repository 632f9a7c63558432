"""Bad arguments to the fused ops raise a named error on every rank, before any transfer.

With ``check_shapes=True`` each rank checks its own arguments and the ranks all-gather one
8-byte digest each (``torch_tp._agreement``): ranks that differ in dtype, shape, contracted
dim ``K``, ``gather_dim``/``scatter_dim``, ``reduce_op`` or their matrices' shapes and kinds
all raise ``ValueError`` naming what differs and each rank's value, in rank order (with the
global ranks for a sub-group); a rank whose own arguments are wrong raises its own error and
the others a ``ValueError`` naming it. Without those checks, fp16
against bf16 computed garbage, fp32 against fp64 aborted gloo, and ``K = 0`` failed inside
the ring and left the group's next collective blocked until its timeout. Each call here must
fail within seconds, and the group must work afterwards (a collective, then a fused call).
"""

import time
from unittest import mock

import torch
import torch.distributed as dist

from torch_tp import overlap
from torch_tp.testing import mesh_2x2, run_on_ranks, tp_mesh, world_size, world_sizes

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def _ag(a, bs, dim=0, **kwargs):
    return lambda group: overlap.all_gather_matmul(a, bs, dim, group, **kwargs)


def _rs(a, b, dim=0, reduce_op="sum", **kwargs):
    return lambda group: overlap.matmul_reduce_scatter(a, b, dim, group, reduce_op, **kwargs)


def _int8(b):
    from torch_tp.quant import Int8SymmetricTensor

    return Int8SymmetricTensor.from_hp(b.t()).t()


def _x(*shape, dtype=F32):
    return torch.randn(*shape, dtype=dtype)


def _outcome(call, group) -> tuple[str, float]:
    """``("Type: message", seconds)`` of a call that must raise."""
    start = time.perf_counter()
    try:
        call(group)
    except Exception as error:  # noqa: BLE001  the test compares type and message
        return f"{type(error).__name__}: {error}", time.perf_counter() - start
    return "no error", time.perf_counter() - start


def _outcomes(cases: dict, group) -> dict:
    """Run each case on this rank: the last rank of the group calls ``case(True)``, the others ``case(False)``."""
    odd = group.rank() == group.size() - 1
    return {name: _outcome(case(odd), group) for name, case in cases.items()}


def _assert_outcomes(results: list[dict], expected: dict, world: int) -> None:
    for case, (on_odd_rank, on_others) in expected.items():
        for r, outcomes in enumerate(results):
            error, seconds = outcomes[case]
            want = on_odd_rank if r == world - 1 else on_others
            assert want in error, f"{case}, rank {r}: expected {want!r} in {error!r}"
            assert seconds < 5, f"{case}, rank {r} took {seconds:.1f} s"


# ------------------------------------------------------------------ the ranks disagree


# case: the call, given whether this rank is the one that differs
_DIFFERENCES = {
    "fp16_vs_bf16": lambda odd: _ag(_x(4, 8, dtype=F16 if odd else BF16), [_x(8, 2, dtype=F16 if odd else BF16)]),
    "fp32_vs_fp64": lambda odd: _rs(_x(4, 8, dtype=F64 if odd else F32), _x(8, 2, dtype=F64 if odd else F32)),
    "k": lambda odd: _ag(_x(4, 6 if odd else 8), [_x(6 if odd else 8, 2)]),
    "rows": lambda odd: _ag(_x(4 if odd else 2, 8), [_x(8, 2)]),
    "b_shape": lambda odd: _ag(_x(4, 8), [_x(8, 3 if odd else 2)]),
    "n_bs": lambda odd: _ag(_x(4, 8), [_x(8, 2)] * (2 if odd else 1)),
    "gather_dim": lambda odd: _ag(_x(4, 4, 8), [_x(8, 2)], dim=1 if odd else 0),
    "reduce_op": lambda odd: _rs(_x(4, 8), _x(8, 2), reduce_op="avg" if odd else "sum"),
    "int8_vs_float": lambda odd: _rs(_x(4, 8), _int8(_x(8, 2)) if odd else _x(8, 2)),
}


def _expected_differences(world: int) -> dict:
    def values(usual, odd):  # each rank's value, in rank order: the last rank is the odd one
        return "[" + ", ".join(str(value) for value in [usual] * (world - 1) + [odd]) + "]"

    ag, rs = "ValueError: all_gather_matmul: the ranks'", "ValueError: matmul_reduce_scatter: the ranks'"
    same = "every rank must pass the same"
    expected = {
        "fp16_vs_bf16": f"{ag} inputs have different dtypes {values(BF16, F16)}; {same} dtype (convert with",
        "fp32_vs_fp64": f"{rs} inputs have different dtypes {values(F32, F64)}; {same} dtype",
        "k": f"{ag} inputs have different contracted (last) dims K {values(8, 6)}; every rank must multiply by one",
        "rows": f"{ag} inputs have different shapes {values((2, 8), (4, 8))}; {same} shape (shard the gathered dim",
        "b_shape": f"{ag} matrices bs[0] have different shapes {values((8, 2), (8, 3))}; {same} weights",
        "n_bs": f"{ag} calls pass different numbers of matrices in bs {values(1, 2)}; {same} weights",
        "gather_dim": f"{ag} calls pass different gather_dim values {values(0, 1)}; {same} gather_dim",
        "reduce_op": f"{rs} calls pass different reduce_op values {values('sum', 'avg')}; {same} reduce_op",
        "int8_vs_float": (
            f"{rs} matrices b are of different kinds {values('plain', 'Int8SymmetricTensor')}; quantize it on "
            f"every rank or on none"
        ),
    }
    return {case: (message, message) for case, message in expected.items()}


def _disagreeing_calls():
    outcomes = _outcomes(_DIFFERENCES, tp_mesh().get_group())
    if world_size() == 4:  # a sub-group: ranks {0, 1} and {2, 3} each disagree inside
        sub = mesh_2x2()["tp"].get_group()
        outcomes["sub_group"] = _outcome(_DIFFERENCES["fp16_vs_bf16"](sub.rank() == 1), sub)
    return outcomes


@world_sizes(2, 4)
def test_ranks_that_disagree_all_raise_naming_what_differs_and_which_ranks(world_size):
    results = run_on_ranks(_disagreeing_calls, world_size, timeout=60)
    _assert_outcomes(results, _expected_differences(world_size), world_size)
    if world_size == 4:  # a sub-group that is not ranks 0, 1 also names its global ranks
        for r, outcomes in enumerate(results):
            where = " on ranks [2, 3]" if r >= 2 else ""
            expected = f"dtypes [torch.bfloat16, torch.float16]{where}; every rank must pass the same dtype"
            assert expected in outcomes["sub_group"][0], outcomes["sub_group"]


# ------------------------------------------------------------------ one rank's own arguments are wrong


_REFUSED = {
    "k0": lambda odd: _ag(_x(4, 0 if odd else 8), [_x(0 if odd else 8, 2)]),
    "no_rows": lambda odd: _rs(_x(0 if odd else 4, 8), _x(8, 2)),
    "b_dtype": lambda odd: _rs(_x(4, 8), _x(8, 2, dtype=F64 if odd else F32)),
    "gather_dim": lambda odd: _ag(_x(4, 8), [_x(8, 2)], dim=1 if odd else 0),
    "b_rows": lambda odd: _ag(_x(4, 8), [_x(8, 2), _x(6 if odd else 8, 2)]),
}


def _expected_refusals(world: int) -> dict:
    ag, rs = "all_gather_matmul", "matmul_reduce_scatter"
    own = {  # case: (op, the refusing rank's error type and message without the op's name)
        "k0": (ag, "ValueError", "the input of shape (4, 0) is empty (its last (contracted) dim K is 0)"),
        "no_rows": (rs, "ValueError", "the input of shape (0, 8) is empty (it has no rows)"),
        "b_dtype": (rs, "TypeError", "b is torch.float64 but the input is torch.float32; use one dtype"),
        "gather_dim": (ag, "ValueError", "gather_dim=1 for an input of shape (4, 8): it must be one of the leading"),
        "b_rows": (ag, "ValueError", "bs[1] has 6 rows but the input's last (contracted) dim is 8"),
    }
    refused = "another rank refused its arguments"
    return {
        case: (f"{kind}: {op}: {text}", f"ValueError: {op}: {refused} (rank {world - 1}: {kind}: {text}")
        for case, (op, kind, text) in own.items()
    }


def _calls_refused_on_the_last_rank():
    return _outcomes(_REFUSED, tp_mesh().get_group())


@world_sizes(2, 4)
def test_a_rank_that_refuses_its_arguments_raises_its_error_and_the_others_name_it(world_size):
    results = run_on_ranks(_calls_refused_on_the_last_rank, world_size, timeout=60)
    _assert_outcomes(results, _expected_refusals(world_size), world_size)


# ------------------------------------------------------------------ K = 0 everywhere, and after


_EVERY_RANK = {
    "k0_checked": lambda odd: _ag(_x(4, 0), [_x(0, 2)]),
    "k0_unchecked": lambda odd: _ag(_x(4, 0), [_x(0, 2)], check_shapes=False),
    "k0_unchecked_rs": lambda odd: _rs(_x(4, 0), _x(0, 2), check_shapes=False),
    "no_rows_unchecked": lambda odd: _ag(_x(0, 3, 8), [_x(8, 2)], check_shapes=False),
}


def _k0_then_collectives():
    group = tp_mesh().get_group()
    outcomes = _outcomes(_EVERY_RANK, group)
    start = time.perf_counter()
    total = torch.ones(1)
    dist.all_reduce(total, group=group)  # blocked until the gloo timeout before the fix
    outcomes["next_all_reduce"] = (total.item(), time.perf_counter() - start)

    x, b = torch.randn(2, 8), torch.randn(8, 3)
    with mock.patch.object(dist, "all_gather", wraps=dist.all_gather) as gather, \
            mock.patch.object(dist, "all_gather_object", wraps=dist.all_gather_object) as details:
        gathered, (y,) = overlap.all_gather_matmul(x, [b], 0, tp_mesh())
    _, (expected,) = overlap.all_gather_then_matmul(x, [b], 0, tp_mesh())
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    outcomes["digest_bytes"] = [call.args[1].nbytes for call in gather.call_args_list]
    outcomes["detail_exchanges"] = details.call_count
    return outcomes


@world_sizes(2, 4)
def test_k0_raises_on_every_rank_and_the_next_collectives_succeed(world_size):
    results = run_on_ranks(_k0_then_collectives, world_size, timeout=60)
    k0 = "the input of shape (4, 0) is empty (its last (contracted) dim K is 0)"
    ag, rs = f"ValueError: all_gather_matmul: {k0}", f"ValueError: matmul_reduce_scatter: {k0}"
    no_rows = "ValueError: all_gather_matmul: the input of shape (0, 3, 8) is empty (it has no rows)"
    expected = {"k0_checked": ag, "k0_unchecked": ag, "k0_unchecked_rs": rs, "no_rows_unchecked": no_rows}
    _assert_outcomes(results, {case: (message, message) for case, message in expected.items()}, world_size)
    for outcomes in results:
        total, seconds = outcomes["next_all_reduce"]
        assert total == world_size and seconds < 5, outcomes["next_all_reduce"]
        assert outcomes["digest_bytes"] == [8], "one 8-byte all-gather per checked call"
        assert outcomes["detail_exchanges"] == 0, "the details travel only when something is wrong"
