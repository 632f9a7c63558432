"""Smoke test of ``benchmarks/spatial_cnn.py --quick``: a U-Net trained on strips of one image.

Times are machine noise here. What the one-line spatial plan fixes is checked: the loss equals
one process's, every saved activation is a strip (per-rank activation memory 1/world of one
process's, within the issue's goals), and the convolutions send exactly ``halo_bytes``.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_quick_spatial_unet_benchmark_saves_strips_and_sends_only_halos():
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "benchmarks/spatial_cnn.py", "--quick"], capture_output=True, text=True, cwd=ROOT,
        timeout=300, env={**os.environ, "PYTHONPATH": pythonpath},
    )
    out = done.stdout
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "none: every saved activation is a strip" in out, out
    worst = float(re.search(r"largest \|Δ\| (\S+),", out).group(1))
    assert worst <= 1e-5, out
    goals = {2: 0.6, 4: 0.35}
    for world, goal in goals.items():
        ratio = float(re.search(rf"- World {world}: each rank saves \S+ MiB for backward, (\S+)x", out).group(1))
        assert ratio <= goal, (world, ratio, out)
        layers = re.search(rf"- World {world} communication:.*?measured equals halo_bytes for (\d+) of the (\d+) conv",
                           out, flags=re.S)
        assert layers and layers.group(1) == layers.group(2) and int(layers.group(1)) > 0, out
