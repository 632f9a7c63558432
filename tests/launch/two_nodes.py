"""A two-node ``torchrun`` job on this machine: two agents on 127.0.0.1 with a c10d rendezvous.

``python tests/launch/two_nodes.py run ARGS...``: both agents run ``torchrun --nnodes 2 --node-rank
0|1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT -m torch_tp.demo
ARGS...`` to the end; prints each agent's exit code and output.

``python tests/launch/two_nodes.py kill ARGS...``: once the job trains, node 1's agent is killed with
SIGKILL (a lost node) once the first training step is printed; prints the ranks its workers ran, how long node 0's agent took to exit,
the processes of either agent still alive 10 s later, and node 0's output.

``python tests/launch/two_nodes.py kill-host ARGS...``: the same, both agents started by
``python -m torch_tp.run`` (torchrun's arguments), and node 0's agent, the store's host, is the
one killed, as soon as all four workers run (have their ranks); prints node 1's agent's exit and
output.

Node 0's agent starts first, so it hosts the rendezvous store (the agent whose address is the
endpoint and binds it first: the node whose loss ends the other agent in torchrun's own
``RendezvousConnectionError``, which ``torch_tp.run`` names); ``kill`` loses node 1.
``tests/launch/test_multinode.py`` reads what this prints.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from torch_tp._supervise.orphans import descendants, process_state

_UP_S = 120.0  # for the store, then for the first training steps (minutes on a loaded machine)
_ENDED_S = 60.0  # for the surviving agent after the other was killed
_LEFT_S = 10.0  # for every process of the job after that


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(node: int, port: int, args: list[str], launcher: str) -> subprocess.Popen:
    command = [sys.executable, "-m", launcher, "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"two-nodes-{port}", "-m", "torch_tp.demo", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_store(port: int) -> None:
    deadline = time.monotonic() + _UP_S
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"two_nodes: node 0's agent did not open the store on port {port} in {_UP_S:g} s")


class _Output:
    """An agent's output, read on a thread as it comes."""

    def __init__(self, agent: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(agent.stdout), daemon=True)
        self._thread.start()

    def text(self) -> str:
        self._thread.join(timeout=_LEFT_S)
        return "".join(self.lines)


def _start(launcher: str = "torch.distributed.run") -> tuple[list[subprocess.Popen], list[_Output]]:
    port, args = _free_port(), sys.argv[2:]
    first = _agent(0, port, args, launcher)
    _wait_for_store(port)
    agents = [first, _agent(1, port, args, launcher)]
    return agents, [_Output(a) for a in agents]


def _run() -> int:
    agents, outputs = _start()
    codes = [a.wait() for a in agents]
    for node, (code, output) in enumerate(zip(codes, outputs)):
        print(f"===== node {node}: agent exited {code} =====\n{output.text()}")
    return max(codes, key=abs)


def _ranks_of(pids: list[int]) -> list[int]:
    ranks = []
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        if b"RANK" in env and b"LOCAL_RANK" in env:  # a worker (not, say, a compile helper)
            ranks.append(int(env[b"RANK"]))
    return sorted(ranks)


def _trains(agents: list[subprocess.Popen], outputs: list[_Output]) -> bool:
    return any(re.search(r" \d+/\d+ loss", "".join(o.lines)) for o in outputs)


def _ranked(agents: list[subprocess.Popen], outputs: list[_Output]) -> bool:
    try:
        return len(_ranks_of(list(descendants([a.pid for a in agents])))) == 4
    except OSError:  # a process that ended while read
        return False


def _kill(lost: int = 1, launcher: str = "torch.distributed.run", ready=_trains) -> int:
    """Kill node ``lost``'s agent with SIGKILL once ``ready`` (the job trains); report on the other node's."""
    agents, outputs = _start(launcher)
    kept = 1 - lost
    deadline = time.monotonic() + _UP_S
    while not ready(agents, outputs):
        if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
            both = "".join(outputs[0].lines + outputs[1].lines)
            print(f"two_nodes: the job did not get to {ready.__name__.lstrip('_')}\n{both}")
            return 1
        time.sleep(0.1)
    job = {pid for pid in descendants([a.pid for a in agents])} | {a.pid for a in agents}
    ranks = ", ".join(map(str, _ranks_of(list(descendants([agents[lost].pid])))))
    killed_at = time.monotonic()
    agents[lost].send_signal(signal.SIGKILL)
    try:
        code = agents[kept].wait(timeout=_ENDED_S)
        print(f"node {lost}'s agent (ranks {ranks}) killed; node {kept}'s agent exited {code} "
              f"{time.monotonic() - killed_at:.1f} s later")
    except subprocess.TimeoutExpired:
        print(f"node {lost}'s agent (ranks {ranks}) killed; node {kept}'s agent still ran {_ENDED_S:g} s later")
        agents[kept].kill()
    agents[lost].wait()
    deadline = time.monotonic() + _LEFT_S
    while (left := sorted(p for p in job if process_state(p) not in (None, "Z"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"processes of the job left {_LEFT_S:g} s later: {left or 'none'}")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    print(f"===== node {kept} =====\n{outputs[kept].text()}")
    return 0


def _kill_host() -> int:
    # as soon as every worker has its rank: the agent names them from then on, and a job that
    # has not imported torch yet keeps the test cheap
    return _kill(lost=0, launcher="torch_tp.run", ready=_ranked)


if __name__ == "__main__":
    sys.exit({"run": _run, "kill": _kill, "kill-host": _kill_host}[sys.argv[1]]())
