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
from torch.distributed.tensor.parallel.style import ParallelStyle as UpstreamParallelStyle

__all__ = ["PlanEntry", "resolve_plan", "match_pattern"]

_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class PlanEntry:
    """One module the plan parallelizes: its path, the pattern that matched it, the style.

    Example::

        >>> from torch_tp import ColwiseParallel
        >>> entry = resolve_plan(nn.Sequential(nn.Linear(2, 2)), {"0": ColwiseParallel()})[0]
        >>> entry.path, entry.pattern
        ('0', '0')
    """

    path: str
    pattern: str
    style: UpstreamParallelStyle


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


def _closest_paths(pattern: str, paths: list[str]) -> list[str]:
    candidates = [p for p in paths if p]
    literal = pattern.replace("*", "").replace("?", "")
    close = difflib.get_close_matches(pattern, candidates, n=3, cutoff=0.4)
    close += [p for p in difflib.get_close_matches(literal, candidates, n=3, cutoff=0.4) if p not in close]
    return close[:3] or candidates[:3]


def _unmatched_error(pattern: str, root: nn.Module, paths: list[str]) -> ValueError:
    near = _closest_paths(pattern, paths)
    return ValueError(
        f"plan key {pattern!r} matched no submodule of {type(root).__name__}; closest module "
        f"paths: {near}. Keys are exact dotted paths or globs over the full path where '*' "
        f"may cross dots (e.g. 'layers.*.attention.wq', '*self.query')"
    )


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
    chosen: dict[str, PlanEntry] = {}
    for pattern, style in plan.items():
        _check_style(pattern, style)
        matched = match_pattern(pattern, paths)
        if not matched:
            raise _unmatched_error(pattern, root, paths)
        for path in matched:
            first = chosen.get(path)
            if first is None:
                chosen[path] = PlanEntry(path, pattern, style)
            elif first.style != style:
                raise _conflict_error(path, first, pattern, style)
    return list(chosen.values())
