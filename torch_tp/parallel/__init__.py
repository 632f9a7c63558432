"""Tensor parallelism over DTensor: styles, plans and ``parallelize_module``.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> from torch_tp.parallel import ColwiseParallel, parallelize_module
    >>> parallelize_module(model, mesh, {"*.w1": ColwiseParallel()})
"""

from torch_tp.parallel.activation_checkpoint import checkpoint_by_pattern, save_collectives_and_matmuls
from torch_tp.parallel.api import parallelize_module
from torch_tp.parallel.experts import ExpertParallel, ExpertTensorParallel, Routing, routing_summary
from torch_tp.parallel.explain import ParamRow, PlanReport, explain_plan
from torch_tp.parallel.fsdp import fully_shard_by_pattern, predict_placements
from torch_tp.parallel.init import init_parameters, module_seed
from torch_tp.parallel.parameter import ShardParameter
from torch_tp.parallel.plan import PlanEntry, match_pattern, outermost_matches, resolve_plan
from torch_tp.parallel.predict import predict_dp_placement
from torch_tp.parallel.prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from torch_tp.parallel.rules import UnsupportedModuleError
from torch_tp.parallel.replicate import ReplicateParallel
from torch_tp.parallel.style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from torch_tp.parallel.suggest import PlanDerivationError, SuggestedPlan, suggest_plan
from torch_tp.parallel.verify import VerificationReport, verify_plan

__all__ = [
    "parallelize_module",
    "explain_plan",
    "fully_shard_by_pattern",
    "predict_placements",
    "predict_dp_placement",
    "checkpoint_by_pattern",
    "save_collectives_and_matmuls",
    "verify_plan",
    "VerificationReport",
    "suggest_plan",
    "SuggestedPlan",
    "PlanDerivationError",
    "init_parameters",
    "module_seed",
    "PlanReport",
    "ParamRow",
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
