"""A plan proven in both modes: :func:`~torch_tp.tools.suggest_plan` derives it from the graph
``torch.export`` traces in training mode and from the one it traces in eval mode.

A model's forward may branch on ``self.training`` (training-only code that sums the split
features, BatchNorm's batch statistics): a plan proven on one branch can compute the other one
wrong. So the model is exported in each mode (``model.train()``, then ``model.eval()``; each
module's own flag is restored afterwards), and:

- when the two graphs run the same ops (dropout's ``train`` flag aside: dropout is pointwise and
  keeps any split), one derivation serves both modes, and the probe runs in eval mode (dropout
  off, so the runs compare);
- otherwise each graph is derived on its own, and a group of layers is split only if it is split
  the same way in every mode that runs its layers (:func:`in_every_mode`); the others stay
  whole with the mode's reason. The probe then runs in both modes.

Example::

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)).eval()
    >>> with modes_kept(model):
    ...     _ = model.train()
    >>> model.training, model[1].training
    (False, False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.fx import Node

__all__ = ["MODES", "exported_in_each_mode", "in_every_mode", "modes_kept", "same_computation"]

#: The modes a plan is proven in, in the order they are derived and probed.
MODES = ("train", "eval")

_DROPOUT = torch.ops.aten.dropout.default  # (input, p, train): ``train`` is the mode's, not the op's


@contextlib.contextmanager
def modes_kept(model: nn.Module) -> Iterator[None]:
    """Restore every module's own ``training`` flag on exit (a frozen BatchNorm in eval inside a
    training model stays so).

    Example::

        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> _ = net[1].eval()
        >>> with modes_kept(net):
        ...     _ = net.train()
        >>> net[1].training
        False
    """
    flags = [(module, module.training) for module in model.modules()]
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


def exported_in_each_mode(model: nn.Module, export: Callable[[], Any]) -> list[tuple[tuple[str, ...], Any]]:
    """``[(modes, program)]``: ``export()`` run with ``model`` in each of :data:`MODES`; one
    entry for both modes when the two graphs run the same ops (:func:`same_computation`).

    Example::

        >>> net = torch.nn.Linear(4, 4)
        >>> found = exported_in_each_mode(net, lambda: torch.export.export(net, (torch.randn(2, 4),), strict=False))
        >>> [modes for modes, _ in found]
        [('train', 'eval')]
    """
    programs = []
    with modes_kept(model):
        for mode in MODES:
            model.train(mode == "train")
            programs.append(export())
    (train, evaluate) = programs
    if same_computation(train.graph, evaluate.graph):
        return [(MODES, evaluate)]
    return [(("train",), train), (("eval",), evaluate)]


def same_computation(first: torch.fx.Graph, second: torch.fx.Graph) -> bool:
    """Whether the graphs run the same ops on the same values in the same order, ``dropout``'s
    ``train`` flag aside.

    Example::

        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
        >>> graphs = []
        >>> for mode in (True, False):
        ...     graphs.append(torch.export.export(net.train(mode), (torch.randn(2, 4),), strict=False).graph)
        >>> same_computation(*graphs)
        True
    """
    return _ops(first) == _ops(second)


def _ops(graph: torch.fx.Graph) -> list[tuple]:
    """Each node as (kind, target, arguments), the values it reads by their position."""
    position = {node: i for i, node in enumerate(graph.nodes)}

    def plain(value: Any) -> Any:
        if isinstance(value, Node):
            return ("value", position[value])
        if isinstance(value, (list, tuple)):
            return tuple(plain(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, plain(v)) for k, v in value.items())
        return repr(value)

    ops = []
    for node in graph.nodes:
        args = node.args[:2] if node.target is _DROPOUT else node.args
        ops.append((node.op, str(node.target), plain(args), plain(node.kwargs)))
    return ops


def in_every_mode(derived: list[tuple[tuple[str, ...], list, set[str]]]) -> list:
    """The groups (``suggest._Group``) of every mode's derivation, each layout once: a group that
    holds in one mode holds only if every other mode that runs any of its layers has the same
    group (the same layers split the same way) and it holds there too; else it stops with that
    mode's reason. A group stopped in its own mode that holds in another says in which mode it
    stopped. ``derived``: ``(modes, groups, the linear layers those modes ran)`` per graph.

    Example::

        >>> from types import SimpleNamespace as G
        >>> train = [G(starts=["up"], ends=["down"], packed={}, touches={}, stop="aten.sum has no rule")]
        >>> evaluate = [G(starts=["up"], ends=["down"], packed={}, touches={}, stop=None)]
        >>> [g.stop for g in in_every_mode([(("train",), train, {"up", "down"}), (("eval",), evaluate, {"up", "down"})])]
        ['in train mode: aten.sum has no rule']
    """
    own = {id(g): g.stop for _, groups, _ in derived for g in groups}
    for modes, groups, _ in derived:
        for group in groups:
            layers = set(group.starts + group.ends)
            for other_modes, others, ran in derived:
                if other_modes is modes or not layers & ran:
                    continue  # the other mode does not run these layers: nothing to prove there
                same = next((g for g in others if _layout(g) == _layout(group)), None)
                if own[id(group)] is not None:
                    if same is not None and own[id(same)] is None:
                        group.stop = f"in {' and '.join(modes)} mode: {own[id(group)]}"
                elif same is None or own[id(same)] is not None:
                    group.stop = f"in {' and '.join(other_modes)} mode: {_why_not(same, others, layers, own)}"
    merged, earlier = [], set()
    for _, groups, _ in derived:
        merged += [g for g in groups if _layout(g) not in earlier]
        earlier |= {_layout(g) for g in groups}
    return merged


def _layout(group: Any) -> tuple:
    return (tuple(sorted(group.starts)), tuple(sorted(group.ends)), tuple(sorted(group.packed.items())),
            tuple(sorted(group.touches.items())))


def _why_not(same: Any, others: list, layers: set[str], own: dict[int, str | None]) -> str:
    """Why the layers are not split as this group there: that mode's reason, or the group they join."""
    if same is not None:
        return own[id(same)]
    other = next((g for g in others if layers & set(g.starts + g.ends)), None)
    if other is not None and own[id(other)] is not None:
        return own[id(other)]
    joined = ", ".join(sorted(set(other.starts + other.ends) - layers)) if other is not None else ""
    return f"these layers are split together with {joined or 'other layers'}"
