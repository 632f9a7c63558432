"""torch_tp: tensor parallelism on PyTorch DTensor.

Code written for ``torch.distributed.tensor.parallel`` works by changing the import::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> from torch_tp import parallelize_module, ColwiseParallel, RowwiseParallel
    >>> parallelize_module(model, mesh, {"*.w1": ColwiseParallel(), "*.w2": RowwiseParallel()})

Importing torch_tp does not import torchao and changes no global PyTorch state.
"""

from torch_tp.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    explain_plan,
    init_parameters,
    parallelize_module,
)

__version__ = "0.1.0"

__all__ = [
    "parallelize_module",
    "explain_plan",
    "init_parameters",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
]
