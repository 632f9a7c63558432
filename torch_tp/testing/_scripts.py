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
import threading
from collections.abc import Iterable, Mapping
from typing import ClassVar

__all__ = ["ROOT", "ScriptRun", "run_script"]

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
    return _finish(_start_script(argv, env), argv, timeout, check)


def _start_script(argv: tuple[str, ...], env: Mapping[str, str] | None) -> subprocess.Popen:
    variables = {**os.environ, **(env or {})}
    variables["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), variables.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, *argv], cwd=ROOT, env=variables, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: a timeout ends the ranks it spawned too
    )


def _finish(process: subprocess.Popen, argv: tuple[str, ...], timeout: float, check: bool) -> subprocess.CompletedProcess:
    """Wait for ``process`` (killed with its group past ``timeout``); assert it exited 0 if ``check``."""
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
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check and done.returncode != 0:
        raise AssertionError(f"{_shown(argv)} exited {done.returncode}\n{_tails(stdout, stderr)}")
    return done


class ScriptRun:
    """One :func:`run_script` run that tests read, started ahead of them so that two run at once.

    A script's start is single-threaded for seconds (importing torch in the script, again in
    the fork server, the rendezvous), so two scripts side by side take little longer than one.
    Declare the run at module level and mark the tests that read it with
    ``@pytest.mark.script_runs(RUN)``: the repository's ``conftest.py`` moves those tests to the
    end of the session and hands their runs, in that order, to :meth:`plan`, then calls
    :meth:`begin` as the tests start: the runs start one at a time beside the other tests (a
    core those leave idle), in order. When a test asks for :meth:`result`, its run starts (if it
    has not) and so do the planned runs after it, up to :attr:`IN_FLIGHT` at a time. Each run
    happens once, however many tests read it.

    Example::

        >>> # xdoctest: +SKIP("runs the main job")
        >>> MAIN_JOB = ScriptRun("-m", "torch_tp.demo")
        >>> @pytest.mark.script_runs(MAIN_JOB)
        ... def test_main_job_trains():
        ...     assert "loss curve matches" in MAIN_JOB.result().stdout
    """

    #: Runs allowed to be running at once once the tests reading them have begun (this one and
    #: those started ahead).
    IN_FLIGHT: ClassVar[int] = 2
    #: Runs allowed to be running while the session's other tests still run (:meth:`begin`):
    #: one script fills the core those tests leave idle (1-rank tests, waits on timeouts).
    IN_FLIGHT_BESIDE_TESTS: ClassVar[int] = 1
    _planned: ClassVar[list["ScriptRun"]] = []
    _in_flight: ClassVar[int] = 0  # the limit now: 0 until begin() or a result() is asked for
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, *argv: str, timeout: float = 240.0, env: Mapping[str, str] | None = None) -> None:
        self.argv, self.timeout, self.env = argv, timeout, dict(env or {})
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._outcome: subprocess.CompletedProcess | AssertionError | None = None

    def __repr__(self) -> str:
        return f"ScriptRun({_shown(self.argv)!r})"

    @classmethod
    def plan(cls, runs: Iterable["ScriptRun"]) -> None:
        """The runs the session's tests will read, in the order they read them (once each)."""
        cls._planned = list(dict.fromkeys(runs))
        cls._in_flight = 0

    @classmethod
    def begin(cls) -> None:
        """Start the planned runs now, :attr:`IN_FLIGHT_BESIDE_TESTS` at a time, each next one
        as the last ends, while the tests that do not read them run; the first :meth:`result`
        raises the limit to :attr:`IN_FLIGHT`."""
        with cls._lock:
            cls._in_flight = max(cls._in_flight, cls.IN_FLIGHT_BESIDE_TESTS)
            cls._start_planned(cls._planned)

    @classmethod
    def stop_all(cls) -> None:
        """End every planned run still running (with the processes of its group), e.g. when the
        session ends before its tests read them."""
        for run in cls._planned:
            if run._process is not None and run._process.poll() is None:
                _kill_group(run._process)

    def result(self) -> subprocess.CompletedProcess:
        """The finished process (as :func:`run_script` returns it); raises its ``AssertionError``
        if the script failed or ran past its timeout."""
        __tracebackhide__ = True
        with ScriptRun._lock:
            ScriptRun._in_flight = ScriptRun.IN_FLIGHT
            self._start()
            self._start_ahead()
        assert self._thread is not None
        self._thread.join()
        if isinstance(self._outcome, AssertionError):
            raise AssertionError(str(self._outcome))
        assert self._outcome is not None
        return self._outcome

    def _start(self) -> None:
        if self._thread is None:
            self._process = _start_script(self.argv, self.env)
            self._thread = threading.Thread(target=self._wait, name=f"script {_shown(self.argv)}", daemon=True)
            self._thread.start()

    def _start_ahead(self) -> None:
        planned = ScriptRun._planned
        ScriptRun._start_planned(planned[planned.index(self) + 1:] if self in planned else [])

    @staticmethod
    def _start_planned(runs: list["ScriptRun"], ending: "ScriptRun | None" = None) -> None:
        """Start ``runs`` in order while fewer than the limit run, ``ending`` (a run whose thread
        is finishing) not counted. The caller holds the lock."""
        for run in runs:
            if sum(r._running() for r in ScriptRun._planned if r is not ending) >= ScriptRun._in_flight:
                return
            run._start()

    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _wait(self) -> None:
        assert self._process is not None
        try:
            self._outcome = _finish(self._process, self.argv, self.timeout, check=True)
        except AssertionError as failed:
            self._outcome = failed
        with ScriptRun._lock:  # the next planned run takes this one's place
            ScriptRun._start_planned(ScriptRun._planned, ending=self)


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
