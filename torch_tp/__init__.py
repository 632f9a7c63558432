"""torch_tp: tensor parallelism on PyTorch DTensor.

Code written for ``torch.distributed.tensor.parallel`` works by changing the import::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> from torch_tp import parallelize_module, ColwiseParallel, RowwiseParallel
    >>> parallelize_module(model, mesh, {"*.w1": ColwiseParallel(), "*.w2": RowwiseParallel()})

Importing torch_tp does not import torchao and changes no global PyTorch state.
"""

from torch_tp._agreement import runtime_checks
from torch_tp.conv import SpatialParallel
from torch_tp.parallel import (
    ColwiseParallel,
    ExpertParallel,
    ExpertTensorParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    ReplicateParallel,
    RowwiseParallel,
    SequenceParallel,
    ShardParameter,
    UnsupportedModuleError,
    parallelize_module,
)
from torch_tp.tools import (
    VerificationReport,
    checkpoint_by_pattern,
    explain_plan,
    fully_shard_by_pattern,
    init_parameters,
    predict_placements,
    save_collectives_and_matmuls,
    suggest_plan,
    verify_plan,
)

__version__ = "0.1.0"

_LAZY = {"Int8SymmetricTensor": "torch_tp.quant", "Int8SymmetricWeightConfig": "torch_tp.quant"}


def __getattr__(name: str):
    # torch_tp.quant imports torchao; load it only when a quantization name is used.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torch_tp' has no attribute {name!r}")

__all__ = [
    # torch.distributed.tensor.parallel's names, with its signatures
    "parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput",
    # torch_tp's own styles, and the error every style raises on a module it cannot shard
    "ReplicateParallel", "ShardParameter", "SpatialParallel", "ExpertParallel", "ExpertTensorParallel",
    "UnsupportedModuleError",
    # model-level tools (torch_tp.tools): read a plan, derive one, check one, initialize, compose
    "explain_plan", "predict_placements", "suggest_plan", "verify_plan", "VerificationReport",
    "init_parameters", "fully_shard_by_pattern", "checkpoint_by_pattern", "save_collectives_and_matmuls",
    # runtime
    "runtime_checks",
]
