"""Repo-wide pytest configuration.

Distributed tests use the worker pools of ``torch_tp.testing`` (started lazily
by ``run_on_ranks``); this file only makes sure they are stopped when the
session ends. The tests marked ``script_runs`` (they read
``torch_tp.testing.ScriptRun`` runs of the tutorials, the demo and the
benchmarks) run last, in their order, which is the order their runs are started
ahead (``ScriptRun.plan``), so that two scripts run side by side and never
beside the in-process distributed tests. Nothing here spawns processes.
"""

import os
import sys

# Make ``import torch_tp`` work with a bare ``pytest`` run from a checkout.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


def pytest_collection_modifyitems(session, config, items):
    from torch_tp.testing import ScriptRun

    def runs_of(item):
        marker = item.get_closest_marker("script_runs")
        return marker.args if marker is not None else ()

    reading = [item for item in items if runs_of(item)]
    items[:] = [item for item in items if not runs_of(item)] + reading
    ScriptRun.plan(run for item in reading for run in runs_of(item))


def pytest_sessionfinish(session, exitstatus):
    scripts = sys.modules.get("torch_tp.testing._scripts")
    if scripts is not None:
        scripts.ScriptRun.stop_all()
    dist_harness = sys.modules.get("torch_tp.testing._dist")
    if dist_harness is not None:  # only if some test used the harness
        dist_harness.shutdown_pools()
