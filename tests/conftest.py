"""Repo-wide pytest configuration.

Distributed tests use the worker pools of ``torch_tp.testing`` (started lazily
by ``run_on_ranks``); this file only makes sure they are stopped when the
session ends. The tests marked ``script_runs`` (they read
``torch_tp.testing.ScriptRun`` runs of the tutorials, the demo and the
benchmarks) run last, in their order, which is the order their runs start
(``ScriptRun.plan``): one at a time beside the other tests from the session's
start (``ScriptRun.begin``, in ``pytest_runtestloop``), two side by side once
the tests reading them begin.

``TORCH_TP_TEST_DEVICE=cuda`` (default ``cpu``) runs the suite on GPUs: checked
at startup, made the default device here, and each test the device cannot run
is skipped with its reason (``torch_tp.testing._device``).
"""

import os
import sys

import pytest

# Make ``import torch_tp`` work with a bare ``pytest`` run from a checkout.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

# Property-based tests (hypothesis): CI draws a fixed, seeded budget ("ci", the default); a
# longer hunt is `TORCH_TP_HYPOTHESIS=hunt python3 -m pytest tests -k property` (DEVELOPERS.md),
# 5000 examples per test unless TORCH_TP_HUNT_EXAMPLES says how many.
try:
    from hypothesis import settings

    settings.register_profile("ci", max_examples=60, derandomize=True, deadline=None, print_blob=True)
    settings.register_profile("hunt", max_examples=int(os.environ.get("TORCH_TP_HUNT_EXAMPLES", "5000")), deadline=None,
                              print_blob=True)
    settings.load_profile(os.environ.get("TORCH_TP_HYPOTHESIS", "ci"))
except ImportError:  # the test extra installs it; without it only the property tests fail to import
    pass

_DEVICE = pytest.StashKey[str]()
_SKIPPED_FOR_DEVICE = pytest.StashKey[int]()


def pytest_configure(config):
    from torch_tp.testing._device import DeviceSelectionError, harness_device

    try:
        device = harness_device()
    except DeviceSelectionError as error:
        raise pytest.UsageError(f"{type(error).__name__}: {error}") from None
    config.stash[_DEVICE] = device
    if device != "cpu":  # in-process tests' factory calls make tensors there
        import torch

        torch.set_default_device(device)


def pytest_collection_modifyitems(session, config, items):
    from torch_tp.testing import ScriptRun

    skipped = _skip_what_the_device_cannot_run(config, items)

    def runs_of(item):
        marker = item.get_closest_marker("script_runs")
        return marker.args if marker is not None and item not in skipped else ()

    reading = [item for item in items if runs_of(item)]
    items[:] = [item for item in items if not runs_of(item)] + reading
    ScriptRun.plan(run for item in reading for run in runs_of(item))


def pytest_runtestloop(session):
    if not session.config.option.collectonly:  # the scripts start beside the other tests
        from torch_tp.testing import ScriptRun

        ScriptRun.begin()


def _skip_what_the_device_cannot_run(config, items):
    device = config.stash.get(_DEVICE, "cpu")
    if device == "cpu":
        return set()
    from torch_tp.testing._device import device_count, item_skip_reason

    count, skipped = device_count(device), set()
    for item in items:
        reason = item_skip_reason(item, device, count)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
            skipped.add(item)
    config.stash[_SKIPPED_FOR_DEVICE] = len(skipped)
    return skipped


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    device = config.stash.get(_DEVICE, "cpu")
    if device != "cpu":
        from torch_tp.testing._device import device_count

        skipped = config.stash.get(_SKIPPED_FOR_DEVICE, 0)
        terminalreporter.write_line(
            f"torch_tp: the tests ran on {device} (TORCH_TP_TEST_DEVICE={device}, "
            f"{device_count(device)} {device} devices visible); {skipped} skipped at collection for the device (-rs: why)"
        )


def pytest_sessionfinish(session, exitstatus):
    scripts = sys.modules.get("torch_tp.testing._scripts")
    if scripts is not None:
        scripts.ScriptRun.stop_all()
    dist_harness = sys.modules.get("torch_tp.testing._dist")
    if dist_harness is not None:  # only if some test used the harness
        dist_harness.shutdown_pools()
