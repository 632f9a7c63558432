"""The forward-kind table of ColwiseParallel / RowwiseParallel, every row against one process.

The grid is every combination the table's keys take: style x module (``nn.Linear``, a linear
with a forward of its own, ``nn.Embedding``) x ``overlap`` x ``comm_dtype`` x ``packed`` x weight
(float, int8 weight-only, W8A8). Each combination either trains like one process for two SGD
steps (outputs, losses, parameters, gradients), on 2 and 4 ranks, or raises the refusal the
table names for it, on every rank. The table itself is not trusted to pick the forward: a
forward that computes the wrong thing fails the comparison, and the count of combinations that
run is pinned, so a refusal that grows to cover a working case fails too.
"""

import copy
import functools
import itertools
import re

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp.parallel import _forward_kinds
from torch_tp.testing import assert_trains_like, local_chunk, on_ranks, quantize_weights, tp_mesh, wire_bytes, world_size

STYLES, MODULES, WEIGHTS = ("colwise", "rowwise"), ("linear", "own", "embedding"), ("float", "int8", "w8a8")
GRID = list(itertools.product(STYLES, MODULES, (False, True), ("float", "int8"), (False, True), WEIGHTS))
SGD = functools.partial(torch.optim.SGD, lr=0.1)
FEATURES, WIDE, VOCAB, BATCH, SEQ = 16, 32, 32, 2, 8  # WIDE: 2 packed parts of 16, 4 per rank on 4 ranks


def _id(case):
    style, module, overlap, comm, packed, weight = case
    return "-".join([style, module, "overlap" if overlap else "plain", f"comm_{comm}", "packed" if packed else "whole",
                     weight])


class _Scaled(nn.Linear):
    """A linear layer with a forward of its own (the table's ``own``)."""

    def forward(self, x):
        return super().forward(x) * 0.5


def _layer(style, module):
    torch.manual_seed(0)
    if module == "embedding":
        return nn.Embedding(VOCAB, WIDE if style == "colwise" else FEATURES)
    make = nn.Linear if module == "linear" else _Scaled
    return make(FEATURES, WIDE) if style == "colwise" else make(WIDE, FEATURES)


def _style(style, overlap, comm, packed):
    options = dict(overlap=overlap, comm_dtype=torch.int8 if comm == "int8" else None, packed=2 if packed else 1,
                   use_local_output=False)
    sequence_sharded = overlap or comm == "int8"
    if style == "colwise":
        return ColwiseParallel(input_layouts=Shard(1) if sequence_sharded else Replicate(),
                               output_layouts=Replicate(), **options)
    return RowwiseParallel(output_layouts=Shard(1) if sequence_sharded else Replicate(), **options)


def _expected(case):
    """What the table says for ``case``: a Forward, or the Refusal (made without a process group)."""
    style, module, overlap, comm, packed, weight = case
    for row in _forward_kinds.TABLE:
        if row.matches_style(style, overlap, comm, packed) and row.matches_module(module, weight):
            return row.then
    raise AssertionError(f"no row of the table matches {case}")


def test_every_combination_has_a_row_and_the_rows_that_run_are_the_ones_counted():
    outcomes = [_expected(case) for case in GRID]
    runs = [case for case, then in zip(GRID, outcomes) if isinstance(then, _forward_kinds.Forward)]
    # 144 combinations: 59 run (the int8 ring with int8 weights among them), 85 are refused by name
    assert (len(GRID), len(runs)) == (144, 59), len(runs)
    assert ("colwise", "linear", True, "int8", False, "int8") in runs
    assert ("rowwise", "linear", True, "int8", False, "int8") in runs


def _inputs(case):
    style, module, overlap, comm, packed, _ = case
    if module == "embedding":
        return torch.randint(0, VOCAB, (BATCH, SEQ))
    return torch.randn(BATCH, SEQ, FEATURES if style == "colwise" else WIDE)


def _this_ranks_input(case):
    """What one rank's module is given for a whole input ``x``."""
    style, module, overlap, comm, packed, _ = case
    if module == "embedding":
        return lambda ids: ids
    if style == "colwise":
        return (lambda x: local_chunk(x, 1)) if overlap or comm == "int8" else (lambda x: x)
    if packed:  # each rank's slice of every part, in part order
        return lambda x: torch.cat([local_chunk(part, -1) for part in x.chunk(2, -1)], -1)
    return lambda x: local_chunk(x, -1)


def _tolerance(case):
    """Exact up to float reassociation, unless int8 moves or multiplies the activations: then within
    the quantization error (half a step of each token's amax per element, a few per cent of the
    output here), as tests/parallel/test_int8_comm.py bounds the int8 Llama."""
    *_, comm, _, weight = case
    return dict(rtol=0.05, atol=0.03) if comm == "int8" or weight == "w8a8" else dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", GRID, ids=[_id(case) for case in GRID])
@on_ranks(2, 4)
def test_each_combination_trains_like_one_process_or_is_refused_by_name_on_every_rank(case):
    style, module, overlap, comm, packed, weight = case
    expected = _expected(case)
    if isinstance(expected, _forward_kinds.Refusal) and expected is _forward_kinds.TABLE[0].then:
        with pytest.raises(ValueError, match=r"is not supported: the fused ops exchange one contiguous shard"):
            _style(style, overlap, comm, packed)
        return
    reference = nn.Sequential(_layer(style, module))
    if weight != "float":
        quantize_weights(reference, activations="int8" if weight == "w8a8" else "float")
    plan = {"0": _style(style, overlap, comm, packed)}
    if isinstance(expected, _forward_kinds.Refusal):
        with pytest.raises(expected.error, match=_refusal_pattern(expected)):
            parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
        return
    model = parallelize_module(copy.deepcopy(reference), tp_mesh(), plan)
    torch.manual_seed(1)
    batches = [(_inputs(case), None) for _ in range(2)]
    assert_trains_like(model, reference, batches, lambda y, _: y.square().mean(), optimizer=SGD,
                       module_inputs=_this_ranks_input(case), what=_id(case), **_tolerance(case))


def _refusal_pattern(refusal) -> str:
    """The refusal's reason (after the class name it may start with) and its fix, as a pattern."""
    return re.escape(refusal.why.split("{cls}")[-1][:60]) + ".*" + re.escape(refusal.fix)


@pytest.mark.cpu_only(reason="wire_bytes reads gloo's profiler events; NCCL's collectives have none")
@on_ranks(2)
def test_int8_weights_on_the_int8_ring_move_the_bytes_of_int8_communication():
    # per token E int8 bytes and a 4-byte scale against 4E float32 bytes: (E + 4) / 4E = 0.27 at E = 128
    torch.manual_seed(0)
    reference = quantize_weights(nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128)))
    x = torch.randn(BATCH, 8 * world_size(), 128)
    sent = {}
    for comm in (None, torch.int8):
        model = parallelize_module(copy.deepcopy(reference), tp_mesh(), {
            "0": ColwiseParallel(input_layouts=Shard(1), overlap=True, comm_dtype=comm),
            "1": RowwiseParallel(output_layouts=Shard(1), overlap=True, comm_dtype=comm),
        })
        piece = local_chunk(x, 1).requires_grad_()
        counts = wire_bytes(lambda: model(piece).square().sum().backward())
        sent["float32" if comm is None else "int8"] = sum(counts.values())
    assert sent["int8"] <= 0.3 * sent["float32"], sent
