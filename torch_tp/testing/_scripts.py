"""Running the checkout's scripts (tutorials, benchmarks, ``python -m ...``) as users run them.

One runner for every subprocess test: the interpreter running the tests, the repository root as
working directory and first on ``PYTHONPATH``, a hard timeout that ends the script's whole
process group (the ranks it spawned too), and a failure message carrying the tail of what it
printed.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Mapping

__all__ = ["ROOT", "run_script"]

#: The repository root (the checkout holding ``torch_tp/``, ``tutorials/`` and ``benchmarks/``).
ROOT = pathlib.Path(__file__).resolve().parents[2]

_TAIL_LINES = 60  # of stdout and of stderr, in a failure message
_DRAIN_S = 10.0  # after a kill: how long to wait for the pipes to close


def run_script(
    *argv: str,
    timeout: float = 240.0,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``python *argv`` from the repository root and return the finished process.

    The script runs under ``sys.executable`` with ``cwd=ROOT`` and :data:`ROOT` first on
    ``PYTHONPATH`` (so it, and every rank it spawns, imports this checkout's ``torch_tp``),
    its output captured as text.

    Keyword Args:
        timeout: seconds before the script and every process of its session are killed;
            that fails the test (an ``AssertionError``) with the tail of what it printed.
        env: variables set on top of ``os.environ`` (a ``PYTHONPATH`` given here comes after
            :data:`ROOT`).
        check: assert that the script exited 0; the message names the command and exit code
            and ends with the last lines of its stdout and stderr. ``False`` returns any exit.

    Returns:
        ``subprocess.CompletedProcess`` with ``returncode``, ``stdout`` and ``stderr`` (str).

    Example::

        >>> run_script("-c", "print('hello')").stdout
        'hello\\n'
        >>> run_script("-c", "import sys; sys.exit(3)", check=False).returncode
        3
    """
    command = [sys.executable, *argv]
    variables = {**os.environ, **(env or {})}
    variables["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), variables.get("PYTHONPATH")]))
    process = subprocess.Popen(
        command, cwd=ROOT, env=variables, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: a timeout ends the ranks it spawned too
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        stdout, stderr = _drain(process)
        raise AssertionError(
            f"{_shown(argv)} ran past its {timeout:g} s timeout and was killed\n{_tails(stdout, stderr)}"
        ) from None
    finally:
        if process.poll() is None:  # interrupted (Ctrl-C): leave nothing running
            _kill_group(process)
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and done.returncode != 0:
        raise AssertionError(f"{_shown(argv)} exited {done.returncode}\n{_tails(stdout, stderr)}")
    return done


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def _drain(process: subprocess.Popen) -> tuple[str, str]:
    """What a killed script printed (a process that left the group may hold the pipes open)."""
    try:
        return process.communicate(timeout=_DRAIN_S)
    except subprocess.TimeoutExpired as still_open:
        return _text(still_open.stdout), _text(still_open.stderr)


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def _shown(argv: tuple[str, ...]) -> str:
    return " ".join(["python", *argv])


def _tails(stdout: str, stderr: str) -> str:
    sections = []
    for name, text in (("stdout", stdout), ("stderr", stderr)):
        lines = text.splitlines()
        cut = f", last {_TAIL_LINES} of {len(lines)} lines" if len(lines) > _TAIL_LINES else ""
        sections.append(f"----- {name}{cut} -----\n" + "\n".join(lines[-_TAIL_LINES:]))
    return "\n".join(sections)
