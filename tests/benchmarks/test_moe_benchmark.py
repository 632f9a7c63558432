"""Smoke tests of ``benchmarks/moe.py --quick``: EP vs expert-TP vs replicated experts.

Times are machine noise here and are only checked to be positive. What the plans fix is
checked exactly: the variants match the single-process model (the script fails otherwise),
each sharded variant holds 1/world of the expert weights, the collectives outside the MoE
blocks are the same in all three (same attention plan), replicated experts send the fewest
bytes in the MoE blocks (nothing at all without sequence parallelism), expert-TP's and
replicated's bytes equal the script's model, EP's routing is dropless, and the script's
verdicts name the winners its own table shows.
"""

import re

import pytest

from torch_tp.testing import ScriptRun, markdown_tables

# subprocess runs of seconds to minutes: `pytest -m "not slow"` leaves them out
pytestmark = pytest.mark.slow

COLUMNS = [
    "world", "variant", "f+b comms", "f+b KiB", "sent KiB", "MoE comms", "MoE KiB", "MoE sent KiB",
    "param KiB", "expert KiB", "loss Δ", "grads max Δ", "step ms", "p25-p75", "CPU ms",
]
ROUTING_COLUMNS = ["world", "MoE layer", "EP copies per rank", "even share", "busiest/even"]
MODEL_COLUMNS = ["world", "variant", "MoE sent KiB", "model KiB", "per MoE layer"]
VARIANTS = ["EP", "expert-TP", "replicated"]
# --quick sizes: 2 layers, 8 experts, top-2, 32 tokens
LAYERS, TOKENS, TOP_K = 2, 32, 2
# Collectives issued by the MoE blocks in one step, per variant (both layers). EP, per layer:
# forward the expert-count exchange, dispatch and combine all-to-alls and the gather of the
# tokens back; backward both all-to-alls again and the gathers of the token and routing-weight
# gradients. expert-TP: the all-reduce of the partial sums forward, of the token and of the
# routing-weight gradients backward. Replicated: nothing (TP), or the block's gather of the
# sequence forward and of the output gradient backward (TP+SP).
MOE_COMMS = {
    False: {"EP": "6AG+10A2A", "expert-TP": "6AR", "replicated": "0"},
    True: {"EP": "10AG+10A2A", "expert-TP": "4AG+4AR+2RS", "replicated": "4AG"},
}


QUICK = ScriptRun("benchmarks/moe.py", "--quick")
QUICK_SEQUENCE_PARALLEL = ScriptRun("benchmarks/moe.py", "--quick", "--sequence-parallel", "--world-sizes", "2", "--iters", "2")


def _counts(cell: str) -> dict[str, int]:
    """``"6AG+10A2A"`` -> ``{"AG": 6, "A2A": 10}``."""
    if cell == "0":
        return {}
    return {name: int(n) for n, name in (re.fullmatch(r"(\d+)(\w+)", part).groups() for part in cell.split("+"))}


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {name: a.get(name, 0) - b.get(name, 0) for name in {*a, *b} if a.get(name, 0) != b.get(name, 0)}


def _check(out: str, worlds: tuple[int, ...], sequence_parallel: bool) -> dict:
    main, routing, model = markdown_tables(out)
    assert main[0]["__header__"] == COLUMNS, out
    assert routing[0]["__header__"] == ROUTING_COLUMNS, out
    assert model[0]["__header__"] == MODEL_COLUMNS, out
    assert [(int(r["world"]), r["variant"]) for r in main] == [(w, v) for w in worlds for v in VARIANTS], out
    row = {(int(r["world"]), r["variant"]): r for r in main}

    whole_experts = float(row[(worlds[0], "replicated")]["expert KiB"])
    for world in worlds:
        ep, tp, rep = (row[(world, v)] for v in VARIANTS)
        for r in (ep, tp, rep):
            assert float(r["loss Δ"]) <= 1e-5 and float(r["grads max Δ"]) <= 1e-5, (world, r, out)
            assert float(r["step ms"]) > 0 and float(r["CPU ms"]) > 0, (world, r, out)
            assert r["MoE comms"] == MOE_COMMS[sequence_parallel][r["variant"]], (world, r, out)
        # memory: replicated holds every expert whole; EP and expert-TP 1/world of them
        assert float(rep["expert KiB"]) == pytest.approx(whole_experts), out
        for r in (ep, tp):
            assert float(r["expert KiB"]) == pytest.approx(whole_experts / world, abs=0.05), (world, out)
        rest = {float(r["param KiB"]) - float(r["expert KiB"]) for r in (ep, tp, rep)}
        assert max(rest) - min(rest) <= 0.15, (world, "non-expert parameters differ", out)
        # outside the MoE blocks the plans are the same, so are the collectives and their bytes
        assert len({repr(sorted(_minus(_counts(r["f+b comms"]), _counts(r["MoE comms"])).items()))
                    for r in (ep, tp, rep)}) == 1, (world, out)
        for total, part in (("f+b KiB", "MoE KiB"), ("sent KiB", "MoE sent KiB")):
            rest = [float(r[total]) - float(r[part]) for r in (ep, tp, rep)]
            assert max(rest) - min(rest) <= 0.15 and min(rest) > 0, (world, total, rest, out)
        # replicated experts send the fewest bytes in the MoE blocks; nothing under plain TP
        sent = {r["variant"]: float(r["MoE sent KiB"]) for r in (ep, tp, rep)}
        assert sent["replicated"] < min(sent["EP"], sent["expert-TP"]), (world, sent, out)
        assert (sent["replicated"] == 0) == (not sequence_parallel), (world, sent, out)

    for r in model:  # the byte model is exact where the bytes do not depend on the routing
        assert r["MoE sent KiB"] == row[(int(r["world"]), r["variant"])]["MoE sent KiB"], (r, out)
        if r["variant"] != "EP":
            assert r["MoE sent KiB"] == r["model KiB"], (r, out)

    assert [(int(r["world"]), r["MoE layer"]) for r in routing] == [
        (w, f"layers.{i}") for w in worlds for i in range(LAYERS)
    ], out
    for r in routing:  # dropless: every token copy is computed by exactly one rank
        copies = [int(n) for n in r["EP copies per rank"].split("/")]
        world = int(r["world"])
        assert len(copies) == world and sum(copies) == TOKENS * TOP_K, (r, out)
        assert float(r["even share"]) == TOKENS * TOP_K / world, (r, out)
        assert float(r["busiest/even"]) == pytest.approx(max(copies) * world / (TOKENS * TOP_K), abs=0.01), (r, out)

    # the verdicts name the winners the table shows
    text = " ".join(out.split())
    for world in worlds:
        sent = {v: float(row[(world, v)]["MoE sent KiB"]) for v in VARIANTS}
        sharded = min(("EP", "expert-TP"), key=sent.get)
        fastest = min(VARIANTS, key=lambda v: float(row[(world, v)]["step ms"]))
        assert (f"- world {world}: fewest bytes sent by the MoE blocks: replicated " in text
                and f"of the two that shard the experts: {sharded}. " in text
                and "Least expert memory per rank: EP and expert-TP " in text
                and f"Fastest step: {fastest} " in text), (world, out)
    return row


@pytest.mark.script_runs(QUICK)
def test_quick_benchmark_compares_the_three_expert_layouts_at_world_sizes_2_and_4():
    out = QUICK.result().stdout
    _check(out, (2, 4), sequence_parallel=False)
    assert "EP vs expert-TP." in out and "Replicated experts send nothing for the experts." in out, out


@pytest.mark.script_runs(QUICK_SEQUENCE_PARALLEL)
def test_quick_benchmark_under_sequence_parallelism_replicated_experts_still_gather_the_sequence():
    out = QUICK_SEQUENCE_PARALLEL.result().stdout
    _check(out, (2,), sequence_parallel=True)
