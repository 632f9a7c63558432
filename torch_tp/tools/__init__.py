"""Model-level tools over the tensor-parallel core: they read :mod:`torch_tp.parallel`, which
imports nothing from them.

- :func:`explain_plan`: each parameter's placement and bytes per rank, from shapes only.
- :func:`predict_placements`, :func:`fully_shard_by_pattern`: FSDP2 x TP (2-D) by pattern.
- :func:`checkpoint_by_pattern`: activation checkpointing by pattern, in the TP -> checkpoint -> FSDP order.
- :func:`verify_plan`: train the plan beside a single-process twin and report where they part.
- :func:`suggest_plan`: a plan derived from the model's exported graph.
- :func:`init_parameters`: initialize a meta-device model's shards as one process would.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> from torch_tp.tools import explain_plan
    >>> print(explain_plan(model, mesh, plan))
"""

from torch_tp.tools.activation_checkpoint import checkpoint_by_pattern, save_collectives_and_matmuls
from torch_tp.tools.explain import ParamRow, PlanReport, explain_plan
from torch_tp.tools.fsdp import fully_shard_by_pattern, predict_placements
from torch_tp.tools.init import init_parameters, module_seed
from torch_tp.tools.predict import predict_dp_placement
from torch_tp.tools.suggest import PlanDerivationError, SuggestedPlan, suggest_plan
from torch_tp.tools.verify import VerificationReport, verify_plan

__all__ = [
    "explain_plan",
    "PlanReport",
    "ParamRow",
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
]
