"""A tensor-parallel plan derived from what the model computes, not from its module names.

:func:`suggest_plan` exports the model (``torch.export``, on the example inputs), then follows
each linear layer's output features through the graph (:mod:`torch_tp.tools._dataflow`, one
rule per op): a layer whose features reach other linear layers' input features only through
ops that keep them split (pointwise ops, activations, attention within each head) starts a
group; the group's first layers are ``ColwiseParallel``, the layers it ends in
``RowwiseParallel``. Every other linear layer stays replicated, with the op that needs its
features whole as the reason.

Between the two ends the values are plain local slices (upstream's default outputs) when the
model's own code, run once on every rank on the example inputs, gives its outputs that way (code
that reshapes with ``-1``); otherwise they stay DTensors (``ColwiseParallel(use_local_output=
False)``), so code written with the whole model's sizes (a ``view`` to ``n_heads`` heads)
keeps its meaning on each rank's slice.

The plan is proven in both modes, training and eval: the model is exported in each
(:mod:`torch_tp.tools._suggest_modes`; a group of layers is split only where it is split alike
in both graphs), and the probe compares the outputs in each mode whose graph differs, within the
tolerance of the outputs' dtype (:mod:`torch_tp.tools._suggest_probe`). Every verdict that
decides the next step is agreed across the ranks first (:mod:`torch_tp.tools._suggest_ranks`:
their models' state dicts and example inputs, how the derivation ended, each probe), so every
rank returns the same plan or raises the same error.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> plan = suggest_plan(model, mesh, (tokens,))
    >>> print(plan)              # module, style, why; the share of parameter bytes split
    >>> parallelize_module(model, mesh, plan)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from torch_tp.parallel import rules
from torch_tp.tools._dataflow import Packed, Stop, rule_for
from torch_tp.tools._suggest_modes import MODES, exported_in_each_mode, in_every_mode
from torch_tp.tools._suggest_probe import Failure, runs_like_the_model
from torch_tp.tools._suggest_shapes import proven_shapes
from torch_tp.tools._suggest_ranks import (
    PlanDerivationError,
    RanksDisagreeError,
    agree,
    derivation_fact,
    input_facts,
    outcome_of,
    probe_fact,
    state_facts,
)
from torch_tp.parallel.replicate import ReplicateParallel
from torch_tp.parallel.style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = ["PlanDerivationError", "RanksDisagreeError", "SuggestedPlan", "suggest_plan"]

#: The ops a linear layer runs as, and (input, weight) positions in their arguments: an
#: ``nn.Linear``'s ``linear(x, weight)``; transformers' ``Conv1D`` (GPT-2's linear, weight
#: stored ``(in, out)``) runs ``addmm(bias, x.view(-1, in), weight)``.
_LINEAR_OPS = {torch.ops.aten.linear.default: (0, 1), torch.ops.aten.addmm.default: (1, 2)}


@dataclasses.dataclass
class _Group:
    """Linear layers split together: ``starts`` colwise, ``ends`` rowwise, or why not."""

    starts: list[str]
    ends: list[str] = dataclasses.field(default_factory=list)
    ops: list[str] = dataclasses.field(default_factory=list)
    touches: dict[str, int] = dataclasses.field(default_factory=dict)  # module: split dim of its input
    packed: dict[str, int] = dataclasses.field(default_factory=dict)  # start: parts of its fused output
    stop: str | None = None


class SuggestedPlan(dict):
    """A plan (``{module: style}``, accepted by ``parallelize_module`` as it is) with its reasons.

    ``reasons`` holds a line per linear layer: why it is split, or why it stays replicated.
    ``sharded_fraction`` is the share of the model's parameter bytes that the plan splits.
    ``modes`` are the modes the plan is proven in (``suggest_plan``'s: ``("train", "eval")``;
    none for a plan built by hand). ``shapes`` are the conditions on the input sizes it is
    proven for, where the model's code compares a size (``"input 0 dim 1 in [2, 8]"``: see
    :mod:`torch_tp.tools._suggest_shapes`); none: any size. ``str(plan)`` is a table of the
    reasons, then a line for the share, one for the modes and one for the sizes.

    Example::

        >>> plan = SuggestedPlan({"up": ColwiseParallel()}, reasons={"up": "feeds down"}, sharded_fraction=0.5)
        >>> print(plan)
        module  style            why
        ------  ---------------  ----------
        up      ColwiseParallel  feeds down
        50.0% of the parameter bytes split
    """

    def __init__(self, styles: dict[str, ParallelStyle], *, reasons: dict[str, str], sharded_fraction: float,
                 modes: tuple[str, ...] = (), shapes: tuple[str, ...] = ()) -> None:
        super().__init__(styles)
        self.reasons, self.sharded_fraction, self.modes = reasons, sharded_fraction, tuple(modes)
        self.shapes = tuple(shapes)

    def __str__(self) -> str:
        rows = [(name, type(self[name]).__name__ if name in self else "replicated", why) for name, why in self.reasons.items()]
        header = ("module", "style", "why")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, tuple("-" * w for w in widths), *rows]]
        if not rows:
            return "no linear layer in the model: nothing to split (an empty plan)"
        proven = [f"proven in {' and '.join(self.modes)} mode"] if self.modes else []
        if self.shapes:
            proven.append(f"proven for {'; '.join(self.shapes)} only: the traced code depends on these "
                          f"sizes (other sizes run other code, or fail; derive the plan again on them)")
        return "\n".join([*lines, f"{100 * self.sharded_fraction:.1f}% of the parameter bytes split", *proven])


def suggest_plan(
    model: nn.Module, mesh: DeviceMesh, example_inputs: tuple[Any, ...], *, sequence_parallel: bool = False
) -> SuggestedPlan:
    """Derive a tensor-parallel plan for ``model`` on the 1-D ``mesh`` from its dataflow.

    ``model`` is exported with ``torch.export`` on ``example_inputs`` (the model is not
    changed); its ``nn.Linear`` layers are paired as described in the module docstring. Every
    dim split along the way must divide by the mesh size (heads not divisible by the ranks keep
    their attention replicated, with that reason).

    ``sequence_parallel=True`` also splits the residual stream between the split layers along
    the sequence (dim 1): the embedding and every ``RowwiseParallel`` layer hand it on
    ``Shard(1)`` (a reduce-scatter) as a DTensor (code reading its shape sees the whole
    sequence: masks, positions), the norms on it run as ``SequenceParallel``, and every
    layer reading it gathers it (``ColwiseParallel(input_layouts=Shard(1))``). The stream is
    followed through the graph with the same rules; where it cannot be split (the model
    returns it, an op mixes the positions, a layer kept whole reads it),
    :class:`PlanDerivationError` names the op.

    The plan holds in training and in eval mode, whichever mode ``model`` is in (its modes are
    restored): ``model`` is exported in each; where the two graphs differ (code that branches on
    ``self.training``) each is derived on its own, a group of layers is split only if it is split
    the same way in both (else it stays whole with the mode's reason), and the probe compares
    the outputs in both modes (in training mode under one seed, dropout off).
    ``plan.modes`` is ``("train", "eval")``. The plan is derived on the example inputs' sizes:
    where the model's code compares a batch, sequence or spatial size (``if x.shape[1] > 8``),
    ``plan.shapes`` and ``str(plan)`` state the sizes it is proven for (one more export, with
    those sizes symbolic: :mod:`torch_tp.tools._suggest_shapes`).

    The probe compares each output with the model's within the tolerance of its dtype,
    ``|got - want| <= atol + rtol * |want|``: ``rtol=1e-4, atol=1e-5`` (float32 and any other
    dtype); ``rtol=1e-3`` (float16) and ``rtol=1.6e-2`` (bfloat16), torch.testing's defaults,
    with ``atol = 4 * eps * max|want|`` (the split sums round at the output's scale; see
    :mod:`torch_tp.tools._suggest_probe`).

    Every rank must hold the same model and the same example inputs: the ranks first agree on a
    digest of each tensor of ``model.state_dict()`` and of each example input, and on how the
    derivation ended (one all-gather of 8 bytes), then on each probe's verdict (one more per
    probe), so every rank returns the same plan or raises the same error.

    Raises:
        RanksDisagreeError: on every rank, when the ranks' models or example inputs differ (it
            names the first that differs: seed every rank alike before building the model, or
            build it on rank 0 and broadcast it), or a step ended differently on the ranks.
        PlanDerivationError: on every rank, when the model cannot be traced or no candidate
            plan gives the model's outputs (it names the failures).

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> plan = suggest_plan(model, tp_mesh, (torch.randint(0, 128, (2, 8)),))
        >>> plan["layers.0.attention.wq"]
        ColwiseParallel(...)
    """
    if mesh.ndim != 1:
        raise ValueError(f"torch_tp.suggest_plan: a 1-D mesh is needed, got {mesh.ndim} dims: pass mesh['tp']")
    example_inputs = tuple(example_inputs)
    derived, error, ended = outcome_of(lambda: _derive(model, mesh.size(), example_inputs, sequence_parallel),
                                       lambda d: f"a candidate plan {_digest(d.first)}")
    agree(mesh, [*state_facts(model), *input_facts(example_inputs), derivation_fact(ended)])
    if error is not None:
        raise error
    probe = functools.partial(_agreed_probe, model, mesh, example_inputs, derived)
    candidate, local = probe(local_output=True)
    if local is None:
        return candidate  # upstream's default outputs: code that reshapes with -1
    candidate, dtensors = probe(local_output=False)
    if dtensors is None:
        return candidate  # code that reshapes with the whole model's sizes
    while local.module is not None and _keep_whole(model, derived.groups, local.module, f"on local slices: {local}; on DTensors: {dtensors}"):
        candidate, local = probe(local_output=True)
        if local is None:
            return candidate  # the groups whose code runs on local slices
    raise PlanDerivationError(
        f"torch_tp.suggest_plan: the derived plan's forward does not give the model's outputs on local slices: "
        f"{local}; on DTensors: {dtensors}. Pass a plan of your own for the layers named, or report the op"
    )


@dataclasses.dataclass
class _Derivation:
    """What the exported graphs give: the groups, the candidate plans (``plan(local_output=...)``),
    the modes to probe (eval only when both modes' graphs run the same ops), the first candidate."""

    groups: list[_Group]
    plan: Callable[..., SuggestedPlan]
    probe_modes: tuple[str, ...]
    first: SuggestedPlan


def _derive(model: nn.Module, ranks: int, example_inputs: tuple[Any, ...], sequence_parallel: bool) -> _Derivation:
    """The groups of every mode's graph (:func:`in_every_mode`), the tables, the stream: no collective."""
    programs = exported_in_each_mode(model, lambda: _exported(model, example_inputs))
    derived, graphs = [], []
    for modes, program in programs:
        weights = dict(program.graph_signature.inputs_to_parameters)
        linears = _linear_layers(model, program.graph, weights)
        derived.append((modes, _groups(program.graph, linears, weights, ranks), set(linears.values())))
        graphs.append((modes, program.graph, linears, weights))
    groups = in_every_mode(derived) if len(derived) > 1 else derived[0][1]
    tables = {table: rows for _, graph, _, weights in graphs for table, rows in _embeddings(graph, weights).items()}
    _stop_at_holders(model, groups, [table for table, rows in tables.items() if rows % ranks == 0])
    layers = list(dict.fromkeys(name for _, _, linears, _ in graphs for name in linears.values()))
    stream = functools.partial(_split_stream, graphs, ranks) if sequence_parallel else None
    plan = functools.partial(_plan, model, layers, groups, tables, ranks, stream=stream,
                             shapes=proven_shapes(model, example_inputs))
    return _Derivation(groups, plan, ("eval",) if len(programs) == 1 else MODES, plan(local_output=True))


def _stop_at_holders(model: nn.Module, groups: list[_Group], tables: list[str]) -> None:
    """Keep whole each group whose split features meet a parameter of a module that holds placed
    layers (a learned scale beside the split ``up``/``down``, the model's own parameter): the one
    copy with gradients summed (``ReplicateParallel`` on that module) would place its split
    children's parameters too, and a plan key naming the parameter is no module
    (``parallelize_module`` refused such plans: "placed by two plan entries", "names a
    parameter"). The reason lists the holder's own parameters. Stopping a group can free a
    holder of another group's layers: repeated until nothing changes."""
    own = {name: [p for p, _ in module.named_parameters(recurse=False)] for name, module in model.named_modules()}
    changed = True
    while changed:
        placed = [*tables, *(layer for g in groups if g.stop is None for layer in g.starts + g.ends)]
        changed = False
        for group in (g for g in groups if g.stop is None):
            holder = next((m for m in group.touches if m == "" or any(p.startswith(f"{m}.") for p in placed)), None)
            if holder is not None:
                names = ", ".join(repr(f"{holder}.{p}".lstrip(".")) for p in own.get(holder, []))
                group.stop = (f"its split features meet a parameter of {holder or 'the model'} itself ({names}), which "
                              f"holds split layers: no style gives a module's own parameters one copy apart from its "
                              f"children's. To have these layers split, move the parameter into a small module whose "
                              f"forward applies it (as Qwen3's q_norm): it gets ReplicateParallel")
                changed = True


def _agreed_probe(model: nn.Module, mesh: DeviceMesh, example_inputs: tuple[Any, ...], derived: _Derivation, *,
                  local_output: bool) -> tuple[SuggestedPlan, Failure | None]:
    """The candidate plan and its probe's verdict, agreed across the ranks before any acts on it."""
    def run() -> tuple[SuggestedPlan, Failure | None]:
        candidate = derived.plan(local_output=local_output)
        return candidate, runs_like_the_model(model, mesh, example_inputs, candidate, derived.probe_modes)

    def describe(result: tuple[SuggestedPlan, Failure | None]) -> str:
        candidate, failure = result
        where = f" (raised in {type(failure.module).__qualname__})" if failure is not None and failure.module is not None else ""
        return f"{'matched' if failure is None else failure}{where}, candidate {_digest(candidate)}"

    result, error, ended = outcome_of(run, describe)
    agree(mesh, [probe_fact("on local slices" if local_output else "on DTensors", ended)])
    if error is not None:
        raise error
    return result


def _digest(plan: SuggestedPlan) -> str:
    """12 hex digits of SHA-256 over the plan's styles, reasons and proven sizes."""
    text = "\n".join([*(f"{name}: {style!r}" for name, style in plan.items()), *map(str, plan.reasons.items()),
                      *plan.shapes])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _keep_whole(model: nn.Module, groups: list[_Group], failed: nn.Module, why: str) -> bool:
    """Stop the groups whose layers sit inside a module of ``failed``'s type (its code does
    not run on each rank's slice, nor on DTensors: e.g. it cuts or reshapes them with the
    whole model's sizes); whether any group was stopped."""
    kind = type(failed)
    inside = [name for name, m in model.named_modules() if type(m) is kind]
    stopped = False
    for group in (g for g in groups if g.stop is None):
        if any(layer.startswith(f"{name}.") for layer in group.starts + group.ends for name in inside):
            group.stop = (f"{kind.__name__}'s forward does not run on each rank's slice of these features "
                          f"({why}): the layers it holds stay whole")
            stopped = True
    return stopped


def _exported(model: nn.Module, example_inputs: tuple[Any, ...]) -> torch.export.ExportedProgram:
    try:
        return torch.export.export(model, example_inputs, strict=False)
    except Exception as error:  # noqa: BLE001 - any tracing failure: named, with its first line
        raise PlanDerivationError(
            f"torch_tp.suggest_plan: torch.export could not trace {type(model).__name__} on the example inputs "
            f"({type(error).__name__}: {str(error).splitlines()[0][:300]}; in {'train' if model.training else 'eval'} mode). "
            "The plan is derived from the graphs traced in train and in eval mode: make the forward traceable (e.g. a transformers model with config.use_cache=False), or write a plan"
        ) from error


def _linear_layers(model: nn.Module, graph: torch.fx.Graph, weights: dict[str, str]) -> dict[Node, str]:
    """``{the op a linear layer ran as: its module}``, for the layers Colwise and Rowwise shard
    (``nn.Linear``, ``Conv1D``); a weight another module multiplies its own way stays out (that
    module is listed, kept whole)."""
    modules = dict(model.named_modules())
    found = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _LINEAR_OPS:
            weight = node.args[_LINEAR_OPS[node.target][1]]
            if getattr(weight, "name", None) in weights:
                name = _module_of(node, weights, weight_arg=_LINEAR_OPS[node.target][1])
                if rules.is_linear_layer(modules.get(name, nn.Identity())):
                    found[node] = name
    return found


def _input_of(linear: Node) -> Node:
    """The activation a linear layer's op reads (not its weight or bias)."""
    return linear.args[_LINEAR_OPS[linear.target][0]]


def _module_of(node: Node, weights: dict[str, str], weight_arg: int = 1) -> str:
    """The module that ran ``node`` (export's module stack: a tied weight has one name only)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return path.removeprefix("L['self'].").replace("L['self']", "")
    return weights[node.args[weight_arg].name].removesuffix(".weight")


#: Ops that check and return nothing a later op reads: a split value passes them by.
_CHECKS = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default}


def _groups(graph: torch.fx.Graph, linears: dict[Node, str], weights: dict[str, str], ranks: int) -> list[_Group]:
    """One forward pass over ``graph``: every linear layer's output starts a group; a value
    computed from split values joins their groups (union-find); an op with no rule for the
    split, or a split that does not divide by ``ranks``, stops the groups it touches."""
    parent: dict[Node, Node] = {}  # union-find over the starting linear nodes

    def root(node: Node) -> Node:
        while parent[node] is not node:
            node = parent[node]
        return node

    split: dict[Node, tuple[int, Node]] = {}  # value -> (its split dim, a start of its group)
    ends: list[tuple[Node, Node]] = []  # (linear reading split features, a start of that group)
    stops: dict[Node, str] = {}
    ops: dict[Node, list[str]] = {}
    touches: dict[Node, dict[str, int]] = {}  # start: {module whose parameter meets the split: dim}
    packed: dict[Node, int] = {}  # start: the parts its fused output is split into

    def stop(starts: list[Node], why: str) -> None:
        for start in starts:
            stops.setdefault(root(start), why)

    for node in graph.nodes:
        if node.op != "call_function" or node.target in _CHECKS:
            if node.op == "output":
                stop([split[a][1] for a in _tensor_args(node) if a in split], "the model returns it")
            continue
        inputs = {a: split[a] for a in _tensor_args(node) if a in split}
        starts = [start for _, start in inputs.values()]
        for other in starts[1:]:
            parent[root(other)] = root(starts[0])
        if node in linears and _input_of(node) in inputs:
            dim, start = inputs[_input_of(node)]
            if dim != len(_shape(_input_of(node))) - 1:
                stop(starts, f"{linears[node]} reads it along another dim")
            ends.append((node, start))
        elif inputs:
            try:
                dim = rule_for(node)(node, {a: d for a, (d, _) in inputs.items()})
                _require_divisible(node, dim, ranks)
                if isinstance(dim, Packed):
                    _note_parts(node, dim, inputs, linears, packed, ranks)
                    dim = int(dim)  # each part: split as any value
            except Stop as why:
                stop(starts, str(why))
                continue
            split[node] = (dim, starts[0])
            if node.target is not operator.getitem:  # one output of a split: not an op of its own
                ops.setdefault(root(starts[0]), []).append(str(node.target).removeprefix("aten.").split(".")[0])
            for param in (a for a in _tensor_args(node) if a.name in weights):  # a per-head norm's weight
                touches.setdefault(starts[0], {})[weights[param.name].rpartition(".")[0]] = next(iter(inputs.values()))[0]
        if node in linears:
            parent[node] = node
            try:
                _require_divisible(node, len(_shape(node)) - 1, ranks)
                split[node] = (len(_shape(node)) - 1, node)
            except Stop as why:
                stops[node] = str(why)
    return _collect(linears, parent, root, ends, stops, ops, touches, packed)


def _note_parts(node: Node, dim: Packed, inputs: dict[Node, tuple[int, Node]], linears: dict[Node, str],
                packed: dict[Node, int], ranks: int) -> None:
    """A split into equal parts is a fused projection's (``[q; k; v]``) only if it cuts the very
    features of one linear layer, once, and nothing else reads them before the cut (that would
    read the packed layout, each rank's slice of every part, as one slice); each part must
    divide by ``ranks``."""
    (source, (source_dim, start)), = inputs.items()
    features = _shape(start)[-1]
    if _shape(source)[source_dim] != features or start in packed:
        raise Stop(f"{node.target} cuts a split dim that is not {linears[start]}'s output features, once")
    if not _only_path(start, source):
        raise Stop(f"{linears[start]}'s fused output features are read whole before {node.target} cuts them into parts")
    if (features // dim.parts) % ranks:
        raise Stop(f"{node.target} cuts {features} features into {dim.parts} parts of {features // dim.parts}, "
                   f"which {ranks} ranks cannot split evenly")
    packed[start] = dim.parts


def _only_path(start: Node, value: Node) -> bool:
    """Whether ``value`` is ``start`` or follows from it through ops each of which (``start``
    included) has that one user: no other op sees the values in between."""
    while value is not start:
        args = _tensor_args(value)
        if len(args) != 1 or len(args[0].users) != 1:
            return False
        value = args[0]
    return len(start.users) == 1


def _collect(linears, parent, root, ends, stops, ops, touches, packed) -> list[_Group]:
    """The groups by their final root. What was noted under a start (its stop, its ops, the
    modules it touches) belongs to the group the start ended in: a group that stopped and later
    joined another stops the union."""
    members: dict[Node, list[Node]] = {}
    for start in parent:
        members.setdefault(root(start), []).append(start)
    groups = {key: _Group(starts=[linears[s] for s in starts]) for key, starts in members.items()}
    for end, start in ends:
        groups[root(start)].ends.append(linears[end])
    for key, group in groups.items():
        starts = members[key]
        group.ops = list(dict.fromkeys(op for s in starts for op in ops.get(s, [])))
        for s in starts:
            group.touches.update(touches.get(s, {}))
            if s in packed:
                group.packed[linears[s]] = packed[s]
        stopped = [stops[s] for s in starts if s in stops]
        group.stop = stopped[0] if stopped else None if group.ends else "no linear layer reads its output features"
    return _choose(list(groups.values()))


def _tensor_args(node: Node) -> list[Node]:
    """Every value ``node`` reads, positional or keyword (a split value read through a keyword
    must meet a rule too), lists flattened."""
    values = [*node.args, *node.kwargs.values()]
    flat = [a for a in values if isinstance(a, Node)]
    flat += [x for a in values if isinstance(a, (list, tuple)) for x in a if isinstance(x, Node)]
    return flat


def _shape(node: Node) -> tuple[int, ...]:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _require_divisible(node: Node, dim: int, ranks: int) -> None:
    size = _shape(node)[dim] if _shape(node) else 0
    if size % ranks:
        raise Stop(f"{node.target} has {size} there, which {ranks} ranks cannot split evenly (e.g. heads)")


def _choose(groups: list[_Group]) -> list[_Group]:
    """The groups that hold, in graph order; a layer an earlier group placed keeps its place (a
    later group that would place it again is dropped, with that reason)."""
    placed: dict[str, str] = {}
    for group in groups:
        if group.stop is None:
            taken = [m for m in group.starts + group.ends if m in placed]
            if taken:
                group.stop = f"{taken[0]} is already {placed[taken[0]]}"
            else:
                placed.update({m: "ColwiseParallel" for m in group.starts})
                placed.update({m: "RowwiseParallel" for m in group.ends})
    return groups


def _table_of(node: Node, weights: dict[str, str]) -> str | None:
    """The embedding module ``node`` looks tokens up in (a lookup in a parameter), else ``None``."""
    if (node.op == "call_function" and node.target is torch.ops.aten.embedding.default
            and getattr(node.args[0], "name", None) in weights):
        return _module_of(node, weights, weight_arg=0)
    return None


def _embeddings(graph: torch.fx.Graph, weights: dict[str, str]) -> dict[str, int]:
    """``{embedding module: rows}`` of the tables the model looks tokens up in."""
    return {table: _shape(node.args[0])[0] for node in graph.nodes if (table := _table_of(node, weights))}


_HEAD = "the model returns it"


def _plan(
    model: nn.Module, layers: list[str], groups: list[_Group], tables: dict[str, int], ranks: int, *,
    local_output: bool, stream: Callable[[dict, dict], None] | None = None, shapes: tuple[str, ...] = ()
) -> SuggestedPlan:
    styles: dict[str, ParallelStyle] = {}
    reasons: dict[str, str] = {}
    for group in (g for g in groups if g.stop is None):
        through = ", ".join(group.ops) or "nothing"
        for start in group.starts:
            parts = group.packed.get(start, 1)
            styles[start] = ColwiseParallel(use_local_output=local_output, packed=parts)
            fused = f" (a fused projection of {parts} parts, split part by part)" if parts > 1 else ""
            reasons[start] = f"its output features{fused} reach {', '.join(group.ends)} only through {through}"
        for end in group.ends:
            styles[end] = RowwiseParallel() if local_output else RowwiseParallel(input_layouts=Shard(-1))
            reasons[end] = f"its input features come split from {', '.join(group.starts)}"
        for module, dim in group.touches.items():  # its parameters meet the split: one copy, gradients summed
            styles[module] = ReplicateParallel(input_layouts=Shard(dim))
            reasons[module] = f"its parameters meet the split features of {group.starts[0]} (dim {dim}): kept whole, gradients summed"
    for group in groups:
        (head,) = group.starts if group.stop == _HEAD and not group.ends and len(group.starts) == 1 else (None,)
        if head is not None and head not in styles:  # the output head: gathered where it is returned
            styles[head] = ColwiseParallel(output_layouts=Replicate())
            reasons[head] = "the output head: its split output features are gathered whole, as the model returns them"
        for layer in group.starts + group.ends:
            reasons.setdefault(layer, f"{group.stop}")
    for table, rows in tables.items():
        if table not in styles and rows % ranks == 0:
            styles[table] = RowwiseParallel(input_layouts=Replicate())
            reasons[table] = "vocabulary-parallel embedding: each rank looks up its rows, the sum is the whole lookup"
        else:
            reasons.setdefault(table, f"{rows} rows, which {ranks} ranks cannot split evenly")
    _place_tied_copies(model, styles, reasons)
    if stream is not None:
        stream(styles, reasons)
    _name_other_weights(model, reasons)
    order = list(dict.fromkeys([*tables, *layers, *reasons]))
    return SuggestedPlan(styles, reasons={n: reasons[n] for n in order if n in reasons},
                         sharded_fraction=_sharded_fraction(model, styles), modes=MODES, shapes=shapes)


_SEQUENCE = 1  # the sequence dim of (batch, sequence, features)


def _split_stream(graphs: list[tuple[tuple[str, ...], torch.fx.Graph, dict[Node, str], dict[str, str]]], ranks: int,
                  styles: dict[str, ParallelStyle], reasons: dict[str, str]) -> None:
    """Sequence parallelism on the values between the split layers (the residual stream):
    what the embeddings and ``RowwiseParallel`` layers hand on, followed through the graph
    split along the sequence; every op it meets must keep that split (the rules of
    :mod:`torch_tp.tools._dataflow`), every linear layer reading it must be
    ``ColwiseParallel`` (it gathers the sequence), and the model must not return it; each
    mode's graph (``graphs``: ``(modes, graph, linears, weights)``) must split it alike. The
    styles change in place; anything else raises :class:`PlanDerivationError`."""
    found = {}
    for modes, graph, linears, weights in graphs:
        try:
            found[" and ".join(modes)] = _stream(graph, linears, weights, ranks, styles)
        except Stop as why:
            where = "" if len(graphs) == 1 else f" (in {' and '.join(modes)} mode)"
            raise PlanDerivationError(
                f"torch_tp.suggest_plan(sequence_parallel=True): the residual stream cannot be split along the sequence{where}: "
                f"{why}. Derive the plan without sequence_parallel, or write the sequence-parallel entries yourself"
            ) from None
    if len(set(map(repr, found.values()))) > 1:
        raise PlanDerivationError(
            "torch_tp.suggest_plan(sequence_parallel=True): the residual stream is split differently in train and in eval "
            f"mode ({found}). Derive the plan without sequence_parallel, or write the sequence-parallel entries yourself")
    producers, readers, norms = next(iter(found.values()))
    for name in producers:
        styles[name] = dataclasses.replace(styles[name], output_layouts=Shard(_SEQUENCE), use_local_output=False)
        reasons[name] += "; hands on the residual stream split along the sequence (a reduce-scatter)"
    for name in readers:
        styles[name] = dataclasses.replace(styles[name], input_layouts=Shard(_SEQUENCE))
        reasons[name] += "; gathers the residual stream, split along the sequence"
    for name in norms:
        styles[name] = SequenceParallel()
        reasons[name] = "runs on the residual stream, split along the sequence: one copy, gradients summed"


def _stream(graph: torch.fx.Graph, linears: dict[Node, str], weights: dict[str, str], ranks: int,
            styles: dict[str, ParallelStyle]) -> tuple[list[str], list[str], list[str]]:
    """(producers, readers, norms) of the residual stream, or :class:`Stop` with the op that
    cannot take it split along the sequence."""
    def placed(name: str, style: type) -> bool:
        return isinstance(styles.get(name), style) and not isinstance(styles[name], ReplicateParallel)

    split: dict[Node, int] = {}
    producers, readers, norms = [], [], {}
    for node in graph.nodes:
        if node.op == "output" and any(a in split for a in _tensor_args(node)):
            raise Stop("the model returns it (its hidden states) split along the sequence")
        if node.op != "call_function" or node.target in _CHECKS:
            continue
        inputs = {a: split[a] for a in _tensor_args(node) if a in split}
        if node in linears and _input_of(node) in inputs:
            if not placed(linears[node], ColwiseParallel):
                raise Stop(f"{linears[node]} reads it but is not split by features ({styles.get(linears[node]) or 'kept whole'})")
            if inputs[_input_of(node)] == len(_shape(_input_of(node))) - 1:
                raise Stop(f"{linears[node]} reads it along the sequence")
            readers.append(linears[node])
            continue
        if inputs:
            dim = rule_for(node)(node, inputs)
            if isinstance(dim, Packed):
                raise Stop(f"{node.target} cuts the sequence into parts")
            _require_divisible(node, dim, ranks)
            split[node] = dim
            for param in (a for a in _tensor_args(node) if a.name in weights):  # a norm's weight
                norms[weights[param.name].rsplit(".", 1)[0]] = None
        produced = _table_of(node, weights) or linears.get(node)
        if produced is not None and placed(produced, RowwiseParallel):
            if len(_shape(node)) != 3 or _shape(node)[_SEQUENCE] % ranks:
                raise Stop(f"{produced} hands on {tuple(_shape(node))}, not (batch, sequence, features) with a sequence the {ranks} ranks split evenly")
            split[node] = _SEQUENCE
            producers.append(produced)
    return list(dict.fromkeys(producers)), list(dict.fromkeys(readers)), list(norms)


def _place_tied_copies(model: nn.Module, styles: dict[str, ParallelStyle], reasons: dict[str, str]) -> None:
    """A table or head whose weight another module shares (T5's ``shared``, a tied head): that
    module gets the style that places the weight alike (both ``Shard(0)``), so the tie holds."""
    modules = dict(model.named_modules())
    owners: dict[int, list[str]] = {}
    for name, module in modules.items():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and isinstance(module, (nn.Embedding, nn.Linear)):
            owners.setdefault(id(weight), []).append(name)
    for names in owners.values():
        placed = [n for n in names if n in styles and not isinstance(styles[n], ReplicateParallel)]
        for name in (n for n in names if n not in styles and placed):
            if isinstance(modules[name], nn.Embedding):
                styles[name] = RowwiseParallel(input_layouts=Replicate())
            else:
                styles[name] = ColwiseParallel(output_layouts=Replicate())
            reasons[name] = f"shares its weight with {placed[0]}: placed alike, so the tie holds"


def _name_other_weights(model: nn.Module, reasons: dict[str, str]) -> None:
    """Every other module with a matrix (or larger) weight is listed too, kept whole: GPT-2's
    patch embedding's ``Conv2d``. No rule derives them yet."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name not in reasons and isinstance(weight, nn.Parameter) and weight.dim() >= 2:
            reasons[name] = f"kept whole: no rule derives a {type(module).__name__} yet (only nn.Linear, Conv1D and nn.Embedding)"


def _sharded_fraction(model: nn.Module, styles: dict[str, ParallelStyle]) -> float:
    """The share of the parameter bytes (a tied weight counted once) that ``styles`` split."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    split = {
        id(p): p.numel() * p.element_size()
        for name, module in model.named_modules() if isinstance(styles.get(name), (ColwiseParallel, RowwiseParallel))
        for pname, p in module.named_parameters(recurse=False)
        if not (isinstance(styles[name], RowwiseParallel) and pname == "bias")  # a rowwise bias stays whole
    }
    return sum(split.values()) / total if total else 0.0
