"""Ties: one Parameter shared by several modules (a tied embedding and output head) stays one.

The rule: every module that shares a parameter must place it the same way, so it stays one
Parameter after ``parallelize_module`` (sharding one copy would untie it and the copies would
train apart); anything else raises before anything changes, naming both modules and a style
that places it alike. Within one call, :func:`check_ties` checks the plan and returns the ties
to keep, and :func:`retie` makes each one Parameter again after the styles ran.

A call on a submodule (a base model holding the embedding) cannot see a sharer outside it (the
head): the tie is split across calls. :func:`remember_replaced` marks each Parameter a call
replaced with its replacement; a later call whose module holds a marked Parameter must place it
as the earlier call did (:func:`earlier_ties`), and then holds the earlier replacement there
(:func:`keep_earlier_ties`): the tie is whole again.

Example::

    >>> import torch.nn as nn
    >>> model = nn.ModuleDict({"embed": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False)})
    >>> model["head"].weight = model["embed"].weight
    >>> check_ties(model, {"embed.weight": None, "head.weight": None})  # both plain: nothing to retie
    []
"""

from __future__ import annotations

import weakref

import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from torch_tp._module_state import ensure_state, state_of
from torch_tp.parallel import rules

__all__ = [
    "check_ties",
    "earlier_ties",
    "keep_earlier_ties",
    "owned_parameters",
    "remember_replaced",
    "retie",
]


def owned_parameters(root: nn.Module):
    """``(path, parameter)`` for every module's own parameters, a shared parameter once per owner.

    Example::

        >>> model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2, bias=False)})
        >>> model["b"].weight = model["a"].weight  # tied: listed under both owners
        >>> [path for path, _ in owned_parameters(model)]
        ['a.weight', 'a.bias', 'b.weight']
    """
    for module_path, module in root.named_modules():
        for name, param in module._parameters.items():
            if param is not None:
                yield (f"{module_path}.{name}" if module_path else name), param


def check_ties(root: nn.Module, placements: dict[str, Placement | None]) -> list[list[str]]:
    """Raise unless every parameter shared by several modules gets one placement from all of them.

    Returns the ties to keep, as lists of parameter paths holding one parameter; after the
    styles ran, :func:`retie` makes them one Parameter again.

    Example::

        >>> from torch_tp import ColwiseParallel, RowwiseParallel
        >>> from torch_tp.parallel.plan import planned_placements, resolve_plan
        >>> model = nn.ModuleDict({"embed": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False)})
        >>> model["head"].weight = model["embed"].weight
        >>> plan = {"embed": RowwiseParallel(), "head": ColwiseParallel()}
        >>> entries = resolve_plan(model, plan)
        >>> check_ties(model, planned_placements(model, entries, [e.style for e in entries]))
        [['embed.weight', 'head.weight']]
    """
    owners: dict[int, list[str]] = {}
    for path, param in owned_parameters(root):
        owners.setdefault(id(param), []).append(path)
    ties = [paths for paths in owners.values() if len(paths) > 1]
    for paths in ties:
        if len({repr(placements.get(path)) for path in paths}) > 1:
            raise _broken_tie_error(root, paths, placements)
    return [paths for paths in ties if placements.get(paths[0]) is not None]


def _styles_placing(root: nn.Module, path: str, placement: Placement | None) -> list[str]:
    """The Colwise/Rowwise styles that would place the parameter at ``path`` as ``placement``."""
    owner, _, name = path.rpartition(".")
    module = root.get_submodule(owner)
    candidates = {"ColwiseParallel()": rules.colwise_placements, "RowwiseParallel()": rules.rowwise_placements}
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        return []
    return [style for style, where in candidates.items() if where(module).get(name) == placement]


def _broken_tie_error(root: nn.Module, paths: list[str], placements: dict) -> ValueError:
    described = ", ".join(f"{path!r} -> {_placement_text(placements.get(path))}" for path in paths)
    target = next((placements[p] for p in paths if placements.get(p) is not None), None)
    fixes = []
    for path in paths:
        if placements.get(path) != target:
            styles = _styles_placing(root, path, target)
            fixes.append(f"{path.rpartition('.')[0]!r}: {' or '.join(styles) or 'a style placing it as ' + repr(target)}")
    return ValueError(
        f"one parameter is shared (tied) by {len(paths)} modules, but the plan places it "
        f"differently: {described}. Sharding one copy would untie it and the copies would train "
        f"apart; give every module that shares it a style that places it as {target!r}"
        + (f", e.g. {'; '.join(fixes)}" if fixes else "")
    )


def _placement_text(placement: Placement | None) -> str:
    return "left plain (not in the plan)" if placement is None else repr(placement)


def retie(root: nn.Module, ties: list[list[str]]) -> None:
    """Make the modules of each kept tie hold one Parameter again (the first owner's, now a DTensor).

    Example::

        >>> # xdoctest: +SKIP("runs inside parallelize_module, after the styles")
        >>> retie(model, [["tok_embeddings.weight", "output.weight"]])
        >>> model.output.weight is model.tok_embeddings.weight
        True
    """
    for paths in ties:
        shared = root.get_parameter(paths[0])
        for path in paths[1:]:
            owner, _, name = path.rpartition(".")
            root.get_submodule(owner).register_parameter(name, shared)


# Ties split across parallelize_module calls: a call on a submodule (a base model holding the
# embedding) cannot see a sharer outside it (the head). It marks each Parameter it replaced with
# its replacement (the Parameter's ModuleState.placed_as); a later call whose module holds a
# marked Parameter must place it the same way, and then holds the earlier replacement there.

def remember_replaced(root: nn.Module, before: dict[str, nn.Parameter]) -> None:
    """Mark each Parameter of ``before`` (path -> parameter, taken before the styles ran) that
    ``root`` now holds as another (a DTensor) with its replacement, for later calls.

    Example::

        >>> # xdoctest: +SKIP("runs inside parallelize_module, after the styles")
        >>> remember_replaced(model, before)
    """
    for path, param in before.items():
        now = root.get_parameter(path)
        if now is not param and isinstance(now, DTensor):
            ensure_state(param).placed_as = (weakref.ref(now), path)


def earlier_ties(root: nn.Module, placements: dict[str, Placement | None], mesh) -> list[tuple[str, nn.Parameter]]:
    """The plain parameters of ``root`` tied to one an earlier call replaced (the tie split there),
    with that replacement; raise unless this plan places each exactly as the earlier call did.

    Example::

        >>> model = nn.Linear(2, 2)
        >>> earlier_ties(model, {"weight": None, "bias": None}, mesh=None)
        []
    """
    kept = []
    for path, param in owned_parameters(root):
        state = None if isinstance(param, DTensor) else state_of(param)
        mark = state.placed_as if state is not None else None
        placed = mark[0]() if mark else None
        if placed is None:
            continue
        earlier = placed.placements[0] if placed.device_mesh == mesh and len(placed.placements) == 1 else None
        if earlier is None or placements.get(path) != earlier:
            raise _split_tie_error(root, path, mark[1], placed, placements.get(path))
        kept.append((path, placed))
    return kept


def _split_tie_error(root: nn.Module, path: str, earlier_path: str, placed: DTensor, placement) -> ValueError:
    want = placed.placements[0] if len(placed.placements) == 1 else placed.placements
    styles = " or ".join(_styles_placing(root, path, want)) or f"a style placing it as {want!r}"
    return ValueError(
        f"parallelize_module: parameter {path!r} is tied to the one an earlier parallelize_module call "
        f"placed as {want!r} on {placed.device_mesh} (there at {earlier_path!r}: that call's module did not "
        f"hold {path!r}, so the tie was split), but this plan {'leaves it plain' if placement is None else f'places it as {placement!r}'}. "
        f"Place {path.rpartition('.')[0]!r} with {styles} on the same mesh, and torch_tp ties the two again; "
        f"or parallelize one module holding both in one call"
    )


def keep_earlier_ties(root: nn.Module, kept: list[tuple[str, nn.Parameter]]) -> None:
    """Make each path of :func:`earlier_ties` hold the earlier call's Parameter: one tie again.

    Example::

        >>> keep_earlier_ties(nn.Linear(2, 2), [])
    """
    for path, placed in kept:
        owner, _, name = path.rpartition(".")
        root.get_submodule(owner).register_parameter(name, placed)
