"""Resolving a parallelize plan against a module tree: matching, strictness, conflicts.

A plan is one style (applied to the root module) or a dict ``{pattern: style}``. A
pattern is matched against full dotted module paths:

* ``""`` is the root module;
* an exact path (``"layers.0.attention.wq"``) names one module;
* otherwise it is a glob over the whole path, where ``*`` may cross dots
  (``"layers.*.attention.wq"``, ``"*self.query"``), ``?`` is one character and
  ``[13]`` a character class (``"*.w[13]"``). Matching is case-sensitive.

Every pattern must match at least one module, and two patterns may only reach the same
module with equal styles. Resolution changes nothing; :func:`resolve_plan` returns the
(path, style) pairs to apply, in plan order.

Two rules look at the whole plan at once, given where it puts every parameter
(:func:`planned_placements`):

* **ties** (:func:`~torch_tp.parallel._ties.check_ties`, in ``_ties.py``, which also keeps
  ties split across calls): a parameter shared by several modules (a tied embedding and
  output head) must be placed the same way by every module's style, so it stays one
  Parameter; anything else raises, naming both modules and their placements;
* **whole units** (:func:`check_whole_units`): a module may declare, as
  ``tensor_parallel_units = {"wq.weight": head_dim, ...}``, that a descendant parameter is
  made of indivisible units along any dim a style shards (attention heads); every rank's
  shard must then hold whole units.

Example::

    >>> import torch.nn as nn
    >>> from torch_tp import ColwiseParallel
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    >>> [e.path for e in resolve_plan(model, {"*": ColwiseParallel()})]
    ['0', '1']
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel.style import ParallelStyle as UpstreamParallelStyle
from torch.distributed.tensor.placement_types import Placement

from torch_tp._layouts import shard_sizes
from torch_tp.parallel import rules
from torch_tp.parallel._style_base import ParallelStyle
from torch_tp.parallel._ties import owned_parameters
from torch_tp.parallel._upstream import UpstreamStyle

__all__ = [
    "PlanEntry",
    "resolve_plan",
    "match_pattern",
    "outermost_matches",
    "planned_placements",
    "check_whole_units",
]

_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class PlanEntry:
    """One module the plan parallelizes: its path, the pattern that matched it, the style.

    A key naming a parameter gives the entry of the module that owns it, with the parameter
    style bound to that parameter (``ShardParameter(dim=2) on 'down_proj'``).

    Example::

        >>> from torch_tp import ColwiseParallel
        >>> entry = resolve_plan(nn.Sequential(nn.Linear(2, 2)), {"0": ColwiseParallel()})[0]
        >>> entry.path, entry.pattern
        ('0', '0')
    """

    path: str
    pattern: str
    style: UpstreamParallelStyle

    @property
    def checked_style(self) -> ParallelStyle:
        """The torch_tp style that checks and applies this entry: ``style`` itself, or an upstream
        style (``torch.distributed.tensor.parallel``'s) behind its torch_tp rule."""
        return self.style if isinstance(self.style, ParallelStyle) else UpstreamStyle(self.style)


def _is_glob(pattern: str) -> bool:
    return any(ch in _GLOB_CHARS for ch in pattern)


def match_pattern(pattern: str, paths: list[str]) -> list[str]:
    """The module paths (in order) that ``pattern`` selects: exact name first, else glob.

    Example::

        >>> match_pattern("layers.*.wq", ["layers.0.wq", "layers.0.wk", "layers.1.wq"])
        ['layers.0.wq', 'layers.1.wq']
    """
    if pattern in paths:
        return [pattern]
    if not _is_glob(pattern):
        return []
    return [path for path in paths if path and fnmatchcase(path, pattern)]


def outermost_matches(root: nn.Module, patterns: str | list[str], *, what: str) -> list[str]:
    """The module paths ``patterns`` select (plan-key glob rules), without those nested in another.

    Strict like a plan: a pattern that matches no module raises ``ValueError`` naming it and
    the closest paths. A match inside another match is dropped, so ``"layers.*"`` gives each
    block, not the block's children. ``what`` names the patterns in errors
    (``"fully_shard_by_pattern pattern"``). Paths come in model order.

    Example::

        >>> model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
        >>> outermost_matches(model, ["*"], what="pattern")
        ['0', '1']
    """
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{what}s must be a non-empty list of module paths or glob patterns (str), got {patterns!r}")
    paths = [name for name, _ in root.named_modules()]
    matched: set[str] = set()
    unmatched = []
    for pattern in patterns:
        found = [""] if pattern == "" else match_pattern(pattern, paths)
        matched.update(found)
        if not found:
            unmatched.append(pattern)
    if unmatched:
        raise ValueError(
            "; ".join(
                f"{what} {p!r} matched no submodule of {type(root).__name__}; closest module paths: "
                f"{_closest_paths(p, paths)}" for p in unmatched
            ) + ". Patterns are exact dotted paths or globs over the full path where '*' may cross dots"
        )
    return [path for path in paths if path in matched and not _inside_any(path, matched)]


def _inside_any(path: str, others: set[str]) -> bool:
    if path == "":
        return False
    return "" in others or any(path.startswith(other + ".") for other in others if other)


def _closest_paths(pattern: str, paths: list[str]) -> list[str]:
    candidates = [p for p in paths if p]
    literal = pattern.replace("*", "").replace("?", "")
    close = difflib.get_close_matches(pattern, candidates, n=3, cutoff=0.4)
    close += [p for p in difflib.get_close_matches(literal, candidates, n=3, cutoff=0.4) if p not in close]
    return close[:3] or candidates[:3]


def _unmatched_message(pattern: str, root: nn.Module, paths: list[str], params: list[str]) -> str:
    named = match_pattern(pattern, params)
    if named:
        owner = named[0].rpartition(".")[0]
        return (
            f"plan key {pattern!r} names a parameter ({named[0]!r}), not a module; give it a "
            f"parameter style (ShardParameter(dim=...)), or give the module that owns it "
            f"({owner!r}, or a pattern for it) a module style"
        )
    return (
        f"plan key {pattern!r} matched no submodule of {type(root).__name__}; closest module "
        f"paths: {_closest_paths(pattern, paths)}. Keys are exact dotted paths or globs over the "
        f"full path where '*' may cross dots (e.g. 'layers.*.attention.wq', '*self.query')"
    )


def _unmatched_error(patterns: list[str], root: nn.Module, paths: list[str]) -> ValueError:
    params = [name for name, _ in root.named_parameters()]
    messages = [_unmatched_message(pattern, root, paths, params) for pattern in patterns]
    if len(messages) == 1:
        return ValueError(messages[0])
    return ValueError(f"{len(messages)} plan keys match no module:\n" + "\n".join(messages))


def _conflict_error(path: str, first: PlanEntry, pattern: str, style) -> ValueError:
    return ValueError(
        f"module {path!r} is given two different styles: {first.style!r} by plan key "
        f"{first.pattern!r} and {style!r} by plan key {pattern!r}; make the patterns "
        f"disjoint (or use PrepareModuleInputOutput to combine input and output preparation)"
    )


def _check_style(pattern: object, style: object) -> None:
    if not isinstance(pattern, str):
        raise TypeError(f"plan keys must be module paths or glob patterns (str), got {pattern!r}")
    if not isinstance(style, UpstreamParallelStyle):
        raise TypeError(
            f"plan key {pattern!r} maps to {style!r}, which is not a ParallelStyle "
            f"(ColwiseParallel(), RowwiseParallel(), ...)"
        )


def resolve_plan(root: nn.Module, plan: UpstreamParallelStyle | dict) -> list[PlanEntry]:
    """Match every plan key against ``root``'s module paths; raise on unmatched keys or conflicts.

    Returns one :class:`PlanEntry` per (module, style) to apply, in plan order.

    Example::

        >>> from torch_tp import ColwiseParallel, RowwiseParallel
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        >>> plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        >>> [(e.path, type(e.style).__name__) for e in resolve_plan(model, plan)]
        [('0', 'ColwiseParallel'), ('2', 'RowwiseParallel')]
    """
    if isinstance(plan, UpstreamParallelStyle):
        return [PlanEntry("", "", plan)]
    if not isinstance(plan, dict):
        raise TypeError(
            f"parallelize_plan must be a ParallelStyle or a dict {{pattern: ParallelStyle}}, "
            f"got {type(plan).__name__}"
        )
    paths = [name for name, _ in root.named_modules()]
    params = [name for name, _ in root.named_parameters()]
    chosen: dict[str, PlanEntry] = {}
    for pattern, style in plan.items():
        _check_style(pattern, style)
    unmatched = [pattern for pattern, style in plan.items() if not _targets(pattern, style, paths, params)]
    if unmatched:
        raise _unmatched_error(unmatched, root, paths)
    for pattern, style in plan.items():
        for target in _targets(pattern, style, paths, params):
            entry = _entry(target, pattern, style)
            first = chosen.get(target)
            if first is None:
                chosen[target] = entry
            elif first.style != entry.style:
                raise _conflict_error(target, first, pattern, entry.style)
    return list(chosen.values())


def _names_parameters(style: object) -> bool:
    """A parameter style (``ShardParameter``): its keys name parameters, not modules."""
    return getattr(style, "targets_parameters", False)


def _targets(pattern: str, style: object, paths: list[str], params: list[str]) -> list[str]:
    return match_pattern(pattern, params if _names_parameters(style) else paths)


def _entry(target: str, pattern: str, style) -> PlanEntry:
    """A module entry, or for a parameter style the owning module's entry with the bound style."""
    if not _names_parameters(style):
        return PlanEntry(target, pattern, style)
    owner, _, name = target.rpartition(".")
    return PlanEntry(owner, pattern, style.on(name))


# ---------------------------------------------------------------------- plan-wide rules


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def planned_placements(root: nn.Module, entries: list[PlanEntry], styles: list, *, replicate_unplanned: bool = False) -> dict[str, Placement | None]:
    """Every parameter path of ``root`` and the placement the plan gives it (``None``: left plain).

    ``styles`` are the entries' styles as torch_tp styles (``param_placements`` says where
    each puts its module's parameters); ``replicate_unplanned`` gives the rest ``Replicate()``.

    Example::

        >>> from torch_tp import ColwiseParallel
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
        >>> entries = resolve_plan(model, {"0": ColwiseParallel()})
        >>> planned_placements(model, entries, [e.style for e in entries])
        {'0.weight': Shard(dim=0), '0.bias': Shard(dim=0), '1.weight': None, '1.bias': None}
    """
    rest = Replicate() if replicate_unplanned else None
    placements: dict[str, Placement | None] = {name: rest for name, _ in owned_parameters(root)}
    placed_by: dict[str, PlanEntry] = {}
    for entry, style in zip(entries, styles):
        module = root.get_submodule(entry.path)
        for name, placement in style.param_placements(module).items():
            path = _join(entry.path, name)
            if path in placed_by:
                raise _placed_twice_error(path, placed_by[path], entry)
            placed_by[path], placements[path] = entry, placement
    return placements


def _placed_twice_error(path: str, first: PlanEntry, second: PlanEntry) -> ValueError:
    return ValueError(
        f"parameter {path!r} is placed by two plan entries: {first.style!r} (key {first.pattern!r}) "
        f"and {second.style!r} (key {second.pattern!r}); give it one style"
    )


def check_whole_units(root: nn.Module, placements: dict[str, Placement | None], num_ranks: int) -> None:
    """Raise if a shard would cut a unit a module declared in ``tensor_parallel_units``.

    An attention module whose forward splits features into heads declares
    ``tensor_parallel_units = {"wq.weight": head_dim, ...}``; sharding ``wq`` must then give
    every rank whole heads (3 heads on 2 ranks cannot be split).

    Example::

        >>> from torch_tp import ColwiseParallel
        >>> attention = nn.ModuleDict({"wq": nn.Linear(24, 24)})
        >>> attention.tensor_parallel_units = {"wq.weight": 8, "wq.bias": 8}
        >>> entries = resolve_plan(attention, {"wq": ColwiseParallel()})
        >>> check_whole_units(attention, planned_placements(attention, entries, [e.style for e in entries]), 2)
        Traceback (most recent call last):
        ValueError: ModuleDict ('<root>') declares units of 8 elements in 'wq.weight' ...
    """
    for path, placement in placements.items():
        if rules.sharded_dim(placement) is not None:
            for owner, unit in _declared_units(root, path):
                _require_whole_units(root, owner, path, placement, unit, num_ranks)


def _declared_units(root: nn.Module, path: str):
    """``(ancestor path, unit)`` for every ancestor of ``path`` that declares a unit for it."""
    parts = path.split(".")
    for i in range(len(parts)):
        owner = ".".join(parts[:i])
        units = getattr(root.get_submodule(owner), "tensor_parallel_units", None) or {}
        unit = units.get(".".join(parts[i:]))
        if unit:
            yield owner, unit


def _require_whole_units(root, owner: str, path: str, placement: Placement, unit: int, num_ranks: int) -> None:
    # a packed weight (k stacked parts) is sharded part by part: each part must split whole
    parts = rules.parts_of(placement)
    size = root.get_parameter(path).shape[rules.sharded_dim(placement)] // parts
    sizes = shard_sizes(size, num_ranks)
    if all(n % unit == 0 for n in sizes):
        return
    module = root.get_submodule(owner)
    relative = path[len(owner) + 1:] if owner else path
    raise ValueError(
        f"{type(module).__name__} ({owner or '<root>'!r}) declares units of {unit} elements in "
        f"{relative!r} (e.g. attention heads), but {placement!r} over {num_ranks} ranks splits "
        f"{'each part of ' if parts > 1 else 'its '}{size} elements ({size // unit} units) as {list(sizes)}, cutting a unit. Use a "
        f"tensor-parallel size that divides {size // unit}, or leave the module out of the plan"
    )
