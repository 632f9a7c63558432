"""Repo-wide pytest configuration.

Distributed tests use the worker pools of ``torch_tp.testing`` (started lazily
by ``run_on_ranks``); this file only makes sure they are stopped when the
session ends. Nothing here spawns processes.
"""

import os
import sys

# Make ``import torch_tp`` work with a bare ``pytest`` run from a checkout.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


def pytest_sessionfinish(session, exitstatus):
    dist_harness = sys.modules.get("torch_tp.testing._dist")
    if dist_harness is not None:  # only if some test used the harness
        dist_harness.shutdown_pools()
