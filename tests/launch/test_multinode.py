"""The main job as a two-node ``torchrun`` job (two agents on 127.0.0.1, c10d rendezvous: dp across
the nodes, tp within each), run to the end, with one node lost, and with the node hosting the
rendezvous store lost under ``python -m torch_tp.run`` (``tests/launch/two_nodes.py``)."""

import re

import pytest

from torch_tp.testing import ScriptRun

pytestmark = pytest.mark.slow

TWO_NODES = ScriptRun("tests/launch/two_nodes.py", "run", "--dp", "2", "--steps", "6")
NODE_LOST = ScriptRun("tests/launch/two_nodes.py", "kill", "--dp", "2", "--steps", "50")
HOST_LOST = ScriptRun("tests/launch/two_nodes.py", "kill-host", "--dp", "2", "--steps", "50")


@pytest.mark.script_runs(TWO_NODES)
def test_two_node_2d_job_shows_the_2d_table_holds_the_predicted_bytes_and_trains_like_one_process():
    out = TWO_NODES.result().stdout
    assert "===== node 0: agent exited 0 =====" in out and "===== node 1: agent exited 0 =====" in out, out
    assert "Warning" not in out.replace("node_rank is only used", ""), out  # FSDP2's root-returned-a-view warning: silenced
    assert "4 ranks (gloo), 2-D: FSDP2 over dp 2 x tensor + sequence parallel over tp 2, 6 steps" in out, out
    assert "fsdp units: layers.0, layers.1, <root>" in out and "too small: 64 < min_weight_size 1024" in out, out
    worst = float(re.search(r"max relative difference (\S+) over 6 steps", out).group(1))
    assert "loss curve matches the single-process run" in out and worst <= 1e-5, out
    held = re.search(r"parameter bytes per rank: (.*) \(predicted: (.*)\)", out)
    assert [int(b.split(": ")[1]) for b in held.group(1).split(", ")] == [int(b) for b in held.group(2).split(", ")], out
    rows = re.findall(r"rank (\d): parameters (\d+), gradients (\d+), optimizer state (\d+), saved activations (\d+)", out)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3], out
    for _, params, grads, state, saved in rows:  # AdamW: two moments per element (plus its step counts)
        assert int(grads) == int(params) and 2 * int(params) <= int(state) and int(saved) > 0, out
    assert re.search(r"final parameters sha256: [0-9a-f]{64}$", out, flags=re.M), out


@pytest.mark.script_runs(NODE_LOST)
def test_a_lost_node_takes_its_workers_the_other_agent_names_its_ranks_within_60_s_and_nothing_is_left():
    out = NODE_LOST.result().stdout
    killed = re.search(r"node 1's agent \(ranks (\d), (\d)\) killed; node 0's agent exited (\d+) (\S+) s later", out)
    assert killed, out
    lost = [int(killed.group(1)), int(killed.group(2))]
    alive = sorted({0, 1, 2, 3} - set(lost))
    assert int(killed.group(3)) != 0 and float(killed.group(4)) < 60, out
    named = re.findall(r"torch_tp.launch: rank (\d) lost ranks (\d), (\d): no heartbeat from them .*; ranks (\d), (\d) are alive", out)
    assert named, out
    for rank, *ranks in named:  # every surviving rank that says it names the same ranks
        assert int(rank) in alive and [int(r) for r in ranks] == lost + alive, out
    assert "processes of the job left 10 s later: none" in out, out


@pytest.mark.script_runs(HOST_LOST)
def test_losing_the_store_host_ends_the_other_agent_in_one_line_naming_the_lost_ranks_and_nothing_is_left():
    out = HOST_LOST.result().stdout
    killed = re.search(r"node 0's agent \(ranks (\d), (\d)\) killed; node 1's agent exited (\d+) (\S+) s later", out)
    assert killed, out
    lost = [int(killed.group(1)), int(killed.group(2))]
    kept = sorted({0, 1, 2, 3} - set(lost))
    assert int(killed.group(3)) == 1 and float(killed.group(4)) < 60, out
    last = out.rstrip().splitlines()[-1]  # the surviving agent's last word: one line, no traceback
    named = re.fullmatch(r"torch_tp.run: this node \(ranks (\d), (\d)\) lost the job's rendezvous store at "
                         r"127.0.0.1:\d+: the agent that hosted it is gone, and with it the other node's ranks (\d), "
                         r"(\d); this node's ranks were stopped. Restart the job on every node from its newest "
                         r"checkpoint .*--rdzv-conf is_host=false .*", last)
    assert named and [int(r) for r in named.groups()] == kept + lost, out
    assert not re.search(r"^Traceback", out, flags=re.M), out  # the agent's (its workers' read "[rankN]: ...")
    assert "processes of the job left 10 s later: none" in out, out
