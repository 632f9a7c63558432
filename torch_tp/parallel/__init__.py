"""Tensor parallelism over DTensor: styles, plans and ``parallelize_module``.

The core only: the model-level tools that read it (``explain_plan``, ``suggest_plan``,
``verify_plan``, ``fully_shard_by_pattern``, ...) are :mod:`torch_tp.tools`, and this
package imports nothing from them.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> from torch_tp.parallel import ColwiseParallel, parallelize_module
    >>> parallelize_module(model, mesh, {"*.w1": ColwiseParallel()})
"""

from torch_tp.parallel.api import parallelize_module
from torch_tp.parallel.experts import ExpertParallel, ExpertTensorParallel, Routing, routing_summary
from torch_tp.parallel.parameter import ShardParameter
from torch_tp.parallel.plan import PlanEntry, match_pattern, outermost_matches, resolve_plan
from torch_tp.parallel.prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from torch_tp.parallel.rules import UnsupportedModuleError
from torch_tp.parallel.replicate import ReplicateParallel
from torch_tp.parallel.style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = [
    "parallelize_module",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "ReplicateParallel",
    "ShardParameter",
    "ExpertParallel",
    "ExpertTensorParallel",
    "Routing",
    "routing_summary",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "PlanEntry",
    "UnsupportedModuleError",
    "match_pattern",
    "outermost_matches",
    "resolve_plan",
]
