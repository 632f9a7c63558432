"""Imported first by every process of a run whose PYTHONPATH starts here (spawned ranks too):
transformers' process group check then fails, as it would where torch.distributed cannot be set
up for it. Used by ``tests/benchmarks/test_transformers_benchmark.py``."""

import transformers.distributed.utils as utils


def _refuse(device_type=None):
    raise OSError("injected by the test: no process group for transformers")


utils._ensure_torch_distributed = _refuse
