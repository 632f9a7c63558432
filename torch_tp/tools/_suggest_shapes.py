"""Which input sizes a derived plan is proven for: the sizes the model's code branches on.

``suggest_plan`` derives and probes its plan on the example inputs' sizes. A model whose code
branches on a size (``if x.shape[1] > 8``, ``if seq_len == 8``) runs other code on other sizes,
which the plan was not derived from. So the model is exported once more with its batch,
sequence and spatial dims left symbolic (``torch.export.Dim.AUTO``): a dim the code compares
comes back with a narrowed range, or specialized to the example's size, and the plan states
it (``SuggestedPlan.shapes``, and a line of ``str(plan)``). Where nothing is stated the plan
holds for any size of those dims.

| input | dims left symbolic (size >= 2 in the example) |
| --- | --- |
| 1-D | 0 (batch) |
| integer, 2-D or more | 0, 1 (batch, sequence of token ids) |
| float, 3-D | 0, 1 (batch, sequence; the last is the features, fixed by the weights) |
| float, 4-D / 5-D | 0 and the spatial dims 2.. (dim 1 is the channels) |
| float, 2-D | 0 |

Example::

    >>> class Branches(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x * 2 if x.shape[1] > 8 else x
    >>> proven_shapes(Branches(), (torch.randn(2, 4, 16),))
    ('input 0 dim 1 in [2, 8]',)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.export import Dim
from torch.utils import _pytree as pytree
from torch.utils._sympy.numbers import int_oo

__all__ = ["proven_shapes"]

_UNBOUNDED = 2  # a symbolic size's range when the code compares it with nothing: [2, oo)


def proven_shapes(model: nn.Module, example_inputs: tuple[Any, ...]) -> tuple[str, ...]:
    """The conditions on the example inputs' sizes under which the traced code is the code that
    runs: ``()`` when the model's code compares none of the sizes left symbolic (see the
    module's table), else one ``"input I dim D in [lo, hi]"`` or ``"input I dim D == n"`` per
    dim; a model that cannot be exported with symbolic sizes gives one line saying so (the plan
    is then stated for the example's sizes only).

    Example::

        >>> proven_shapes(torch.nn.Linear(16, 16), (torch.randn(2, 8, 16),))
        ()
    """
    tensors = [leaf for leaf in pytree.tree_leaves(example_inputs) if isinstance(leaf, torch.Tensor)]
    symbolic = [_symbolic_dims(t) for t in tensors]
    if not any(symbolic):
        return ()
    specs, leaves = iter(symbolic), iter(tensors)
    dynamic = pytree.tree_map(lambda leaf: {d: Dim.AUTO for d in next(specs)} if isinstance(leaf, torch.Tensor) else None,
                              example_inputs)
    try:
        program = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic, strict=False)
    except Exception as error:  # noqa: BLE001 - any failure: the plan holds for the example's sizes only
        sizes = ", ".join(str(tuple(next(leaves).shape)) for _ in tensors)
        return (f"the example's sizes only ({sizes}): torch.export with symbolic sizes failed "
                f"({type(error).__name__}: {str(error).splitlines()[0][:160]})",)
    return tuple(_conditions(program, tensors, symbolic))


def _symbolic_dims(t: torch.Tensor) -> list[int]:
    if t.ndim == 0:
        return []
    if t.ndim == 1 or (not t.is_floating_point() and t.ndim >= 2):
        dims = [0, 1][: t.ndim]
    elif t.ndim == 3:
        dims = [0, 1]
    elif t.ndim >= 4:
        dims = [0, *range(2, t.ndim)]
    else:
        dims = [0]
    return [d for d in dims if t.shape[d] >= 2]


def _conditions(program: torch.export.ExportedProgram, tensors: list[torch.Tensor], symbolic: list[list[int]]):
    """One condition per symbolic dim the code compared: read off the user inputs' placeholders."""
    user_inputs = [spec.arg.name for spec in program.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]
    nodes = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    values = [nodes[name].meta["val"] for name in user_inputs if isinstance(nodes[name].meta.get("val"), torch.Tensor)]
    for index, (tensor, value, dims) in enumerate(zip(tensors, values, symbolic)):
        for d in dims:
            size = value.shape[d]
            if not isinstance(size, torch.SymInt) or size.node.expr.is_number:  # specialized
                yield f"input {index} dim {d} == {tensor.shape[d]}"
                continue
            bounds = program.range_constraints.get(size.node.expr)
            bounded = bounds is not None and bounds.upper != int_oo
            if bounds is not None and (bounded or int(bounds.lower) > _UNBOUNDED):
                upper = int(bounds.upper) if bounded else "oo"
                yield f"input {index} dim {d} in [{int(bounds.lower)}, {upper}]"
