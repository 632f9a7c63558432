"""``checkpoint_by_pattern``: activation checkpointing of the modules a pattern selects.

Each selected module's forward runs under :func:`torch.utils.checkpoint.checkpoint`
(non-reentrant): its activations are dropped after forward and recomputed in backward.
The module's forward is replaced on the instance (hooks still run around it, FSDP2's
included), so parameter names and ``state_dict`` keys do not change, unlike torch's
``checkpoint_wrapper`` which adds a ``_checkpoint_wrapped_module.`` level.

Under tensor parallelism a plain recompute re-runs the block's collectives (the
sequence-parallel all-gathers, the row-parallel all-reduces). The selective policy
:func:`save_collectives_and_matmuls` keeps the results of every collective and matmul, so
the backward issues the same collectives as without checkpointing, and only cheap
pointwise ops (norms, activations, rotary) are recomputed.

Example::

    >>> from torch_tp.models.llama import ModelArgs, Transformer
    >>> model = Transformer(ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=32))
    >>> names = [name for name, _ in model.named_parameters()]
    >>> checkpoint_by_pattern(model, "layers.*", policy=save_collectives_and_matmuls) is model
    True
    >>> [name for name, _ in model.named_parameters()] == names
    True
    >>> model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torch_tp._layouts import replace_forward
from torch_tp._order import mark_checkpointed, require_before
from torch_tp.parallel.plan import outermost_matches

__all__ = ["checkpoint_by_pattern", "save_collectives_and_matmuls"]

_aten = torch.ops.aten
#: matmuls and attention kernels whose results the selective policy keeps
_MATMULS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)
#: op namespaces whose results the selective policy keeps: the functional collectives (and
#: their waits) DTensor issues, and torch_tp's fused collective matmuls
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "torch_tp"})


def save_collectives_and_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: keep collective and matmul results, recompute the rest.

    Pass it as ``checkpoint_by_pattern(model, patterns, policy=save_collectives_and_matmuls)``
    (it is a :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts` policy).
    The recompute then issues no collective: what the backward communicates is what it
    communicates without checkpointing.

    Example::

        >>> save_collectives_and_matmuls(None, torch.ops.aten.mm.default)
        <CheckpointPolicy.MUST_SAVE: 0>
        >>> save_collectives_and_matmuls(None, torch.ops.aten.silu.default)
        <CheckpointPolicy.PREFER_RECOMPUTE: 3>
    """
    if op in _MATMULS or getattr(op, "namespace", None) in _COLLECTIVE_NAMESPACES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_by_pattern(model: nn.Module, patterns: str | list[str], *, policy=None) -> nn.Module:
    """Checkpoint the activations of every module ``patterns`` select (the outermost matches).

    Apply it after ``parallelize_module`` and before :func:`fully_shard_by_pattern`
    (torchtitan's order); another order raises. Changes ``model`` in place and returns it;
    parameter names and ``state_dict`` keys are unchanged. Works with ``torch.compile``.

    Args:
        model: the model.
        patterns: module paths or globs (``*`` crosses dots), e.g. ``"layers.*"``; a match
            inside another match is skipped. Every pattern must match.

    Keyword Args:
        policy: ``None`` recomputes the whole forward of each module in backward (the most
            memory saved). A selective-checkpoint policy (a function
            ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``, or a list of ops to save)
            keeps some results: :func:`save_collectives_and_matmuls` keeps every collective
            and matmul, so backward re-runs no collective.

    Raises:
        ValueError: a pattern matches nothing, or the model was already checkpointed (call it
            once, with every pattern) or fully sharded (FSDP must come last).

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        >>> checkpoint_by_pattern(model, ["0", "2"])[0]
        Linear(in_features=4, out_features=4, bias=True)
        >>> checkpoint_by_pattern(model, "0")
        Traceback (most recent call last):
        ValueError: checkpoint_by_pattern: module '0' (Linear) already went through checkpoint_by_pattern; ...
    """
    context_fn = _context_fn(policy)
    paths = outermost_matches(model, patterns, what="checkpoint_by_pattern pattern")
    require_before(model, "checkpoint_by_pattern", later=("fully_shard", "checkpoint_by_pattern"))
    for path in paths:
        module = model.get_submodule(path)
        replace_forward(module, _checkpointed_forward, inner=module.forward, context_fn=context_fn)
        mark_checkpointed(module)
    return model


def _context_fn(policy):
    if policy is None:
        return None
    if callable(policy) or isinstance(policy, (list, tuple)):
        return partial(create_selective_checkpoint_contexts, policy)
    raise TypeError(
        f"checkpoint_by_pattern(policy={policy!r}): give None (recompute everything), a "
        f"selective-checkpoint policy function such as save_collectives_and_matmuls, or a list of ops to save"
    )


def _checkpointed_forward(module: nn.Module, *args, inner, context_fn, **kwargs):
    """``module``'s own forward under non-reentrant activation checkpointing."""
    if context_fn is None:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
