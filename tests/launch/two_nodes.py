"""A two-node ``torchrun`` job on this machine: two agents on 127.0.0.1 with a c10d rendezvous.

``python tests/launch/two_nodes.py run ARGS...``: both agents run ``torchrun --nnodes 2 --node-rank
0|1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT -m torch_tp.demo
ARGS...`` to the end; prints each agent's exit code and output.

``python tests/launch/two_nodes.py kill ARGS...``: once the job trains, node 1's agent is killed with
SIGKILL (a lost node) once the first training step is printed; prints the ranks its workers ran, how long node 0's agent took to exit,
the processes of either agent still alive 10 s later, and node 0's output.

Node 0's agent starts first, so it hosts the rendezvous store (the agent whose address is the
endpoint and binds it first: the node whose loss ends the job in torchrun's own
``RendezvousConnectionError``); node 1 is the node a job loses. ``tests/launch/test_multinode.py``
reads what this prints.
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

_UP_S = 60.0  # for the store, then for the first training steps
_ENDED_S = 60.0  # for node 0's agent after node 1's was killed
_LEFT_S = 10.0  # for every process of the job after that


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(node: int, port: int, args: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
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


def _start() -> tuple[list[subprocess.Popen], list[_Output]]:
    port, args = _free_port(), sys.argv[2:]
    first = _agent(0, port, args)
    _wait_for_store(port)
    agents = [first, _agent(1, port, args)]
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


def _kill() -> int:
    agents, outputs = _start()
    deadline = time.monotonic() + _UP_S
    while not any(re.search(r" \d+/\d+ loss", "".join(o.lines)) for o in outputs):
        if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
            print("two_nodes: the job printed no training step\n" + "".join(outputs[0].lines + outputs[1].lines))
            return 1
        time.sleep(0.1)
    job = {pid for pid in descendants([a.pid for a in agents])} | {a.pid for a in agents}
    workers = list(descendants([agents[1].pid]))
    lost = _ranks_of(workers)
    killed_at = time.monotonic()
    agents[1].send_signal(signal.SIGKILL)
    try:
        code = agents[0].wait(timeout=_ENDED_S)
        print(f"node 1's agent (ranks {', '.join(map(str, lost))}) killed; node 0's agent exited {code} "
              f"{time.monotonic() - killed_at:.1f} s later")
    except subprocess.TimeoutExpired:
        print(f"node 1's agent (ranks {', '.join(map(str, lost))}) killed; node 0's agent still ran {_ENDED_S:g} s later")
        agents[0].kill()
    agents[1].wait()
    deadline = time.monotonic() + _LEFT_S
    while (left := sorted(p for p in job if process_state(p) not in (None, "Z"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"processes of the job left {_LEFT_S:g} s later: {left or 'none'}")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    print(f"===== node 0 =====\n{outputs[0].text()}")
    return 0


if __name__ == "__main__":
    sys.exit({"run": _run, "kill": _kill}[sys.argv[1]]())
