"""Tensor parallelism over DTensor: styles, plans and ``parallelize_module``."""

from torch_tp.parallel import functional
from torch_tp.parallel.api import parallelize_module
from torch_tp.parallel.explain import ParamRow, PlanReport, explain_plan
from torch_tp.parallel.init import init_parameters, module_seed
from torch_tp.parallel.plan import PlanEntry, match_pattern, resolve_plan
from torch_tp.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    SpatialParallel,
)

__all__ = [
    "parallelize_module",
    "explain_plan",
    "init_parameters",
    "module_seed",
    "PlanReport",
    "ParamRow",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "SpatialParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "PlanEntry",
    "match_pattern",
    "resolve_plan",
    "functional",
]
