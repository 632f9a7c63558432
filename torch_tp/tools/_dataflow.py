"""Where a linear layer's split output features go: one rule per op of an exported graph.

A ``ColwiseParallel`` linear leaves each rank a slice of its output features. Followed through
the graph (``torch.export``'s ATen ops), that slice stays a slice of one dim of every value it
reaches, until a linear layer reads it as its input features (that layer is then
``RowwiseParallel``: it sums the ranks' partial products). Each rule below says, for one op,
which dim of its output holds the slice, given the dims of its inputs; or why the op needs the
whole dim (then nothing in the group is split). An op not in the table is not proven: it stops
the group with its name (an allowlist, not a denylist).

===============================================  ===============================================
op                                               the split dim
===============================================  ===============================================
unary pointwise (gelu, silu, relu, tanh,         stays where it is
dropout, casts, copies, scalar arithmetic,
isfinite / isnan, ``~``)
add / sub / mul / div of two tensors,            stays, if the other operands are split the same
masked_fill (a scalar), where                    way or broadcast (size 1) along that dim
view / reshape / unflatten / flatten            the first dim of the group it splits into
                                                 (features -> heads x head_dim: the heads; the
                                                 heads must divide by the ranks), or the merged
                                                 dim when it leads the merged group; into three
                                                 dims or more (features -> parts x heads x
                                                 head_dim): each part's heads (``Packed``)
transpose / permute / unsqueeze / expand,       follows the dim
view_as_complex / view_as_real (not the split)
softmax, slice, select, unbind, cat, stack,      stays, along any other dim (a norm over the
mean / sum / amax, rms_norm / layer_norm         last dims: the head's, not the heads')
split / split_with_sizes / chunk                 stays, along any other dim; along the split dim
                                                 into equal parts: each part keeps it, and the
                                                 layer is a fused projection of that many parts
                                                 (``Packed``: ``ColwiseParallel(packed=k)``)
scaled_dot_product_attention, matmul / bmm       a batch dim split alike in the operands stays
linear (as its input)                            the last dim: that linear is the group's
                                                 RowwiseParallel end
===============================================  ===============================================
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
from torch.fx import Node

__all__ = ["Packed", "Split", "Stop", "rule_for"]

aten = torch.ops.aten


class Stop(Exception):
    """The op reads the split dim whole: the group cannot be split (the message says why)."""


#: ``Split(dim)``: the output's dim that holds each rank's slice.
Split = int


class Packed(int):
    """The split dim of a ``split`` / ``chunk`` that cut it into ``parts`` equal parts: each part
    holds a slice of its own, so the layer the features came from is a fused projection
    (``[q; k; v]``), sharded part by part.

    Example::

        >>> Packed(2, parts=3), Packed(2, parts=3).parts
        (2, 3)
    """

    parts: int

    def __new__(cls, dim: int, *, parts: int) -> "Packed":
        packed = super().__new__(cls, dim)
        packed.parts = parts
        return packed


def _shape(value) -> tuple[int, ...]:
    val = value.meta.get("val") if isinstance(value, Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# -- rules: (node, {input node: its split dim}) -> the output's split dim -----------------------


def _same(node: Node, split: dict[Node, int]) -> int:
    return next(iter(split.values()))


def _pointwise(node: Node, split: dict[Node, int]) -> int:
    out = _shape(node)
    dims = {len(out) - len(_shape(a)) + d for a, d in split.items()}
    if len(dims) != 1:
        raise Stop(f"{node.target} combines slices of different dims")
    (dim,) = dims
    for arg in node.args:
        if isinstance(arg, Node) and arg not in split and isinstance(arg.meta.get("val"), torch.Tensor):
            shape = _shape(arg)
            at = dim - (len(out) - len(shape))
            if at >= 0 and shape[at] != 1:
                raise Stop(f"{node.target} combines it with a tensor not split like it ({tuple(shape)})")
    return dim


def _reshape(node: Node, split: dict[Node, int]) -> int:
    """The split dim leads its group, so it leads the output's too: features -> (heads,
    head_dim) splits the heads. Into three dims or more, features -> (parts, heads, head_dim)
    is a fused projection's output cut into its parts (timm's ``qkv``): each part's heads are
    split (``Packed``)."""
    (source, dim), = split.items()
    before, after = _shape(source), _shape(node)
    group_in, group_out = _groups(before, after, dim)
    if group_in[0] == dim and len(group_out) >= 3 and after[group_out[0]] > 1:
        return Packed(group_out[1], parts=after[group_out[0]])
    if group_in[0] == dim and group_out:
        return group_out[0]
    raise Stop(f"{node.target} reshapes the split dim {before} -> {after} so that its slices interleave")


def _groups(before: Sequence[int], after: Sequence[int], dim: int) -> tuple[list[int], list[int]]:
    """The dims of ``before`` and of ``after`` that hold the same elements as ``before[dim]``'s group."""
    i = j = 0
    while i < len(before) or j < len(after):
        gi, gj = [i], [j]
        pi = before[i] if i < len(before) else 1
        pj = after[j] if j < len(after) else 1
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= before[i]
            else:
                j += 1
                gj.append(j)
                pj *= after[j]
        if dim in gi:
            return gi, [d for d in gj if d < len(after)]
        i, j = gi[-1] + 1, gj[-1] + 1
    raise Stop(f"reshape {tuple(before)} -> {tuple(after)}: no group holds dim {dim}")


def _unflatten(node: Node, split: dict[Node, int]) -> int:
    (source, dim), = split.items()
    at, sizes = _dim(int(node.args[1]), len(_shape(source))), node.args[2]
    if at == dim:  # the split leads the new dims
        return dim
    return dim + len(sizes) - 1 if at < dim else dim


def _flatten(node: Node, split: dict[Node, int]) -> int:
    (source, dim), = split.items()
    ndim = len(_shape(source))
    start = _dim(int(node.args[1]) if len(node.args) > 1 else 0, ndim)
    end = _dim(int(node.args[2]) if len(node.args) > 2 else -1, ndim)
    if dim < start:
        return dim
    if dim > end:
        return dim - (end - start)
    if dim == start:
        return start
    raise Stop(f"{node.target} merges the split dim behind another")


def _complex_view(node: Node, split: dict[Node, int]) -> int:
    (source, dim), = split.items()
    if dim >= len(_shape(source)) - (1 if node.target is aten.view_as_complex.default else 0):
        raise Stop(f"{node.target} reinterprets the split dim")
    return dim


def _transpose(node: Node, split: dict[Node, int]) -> int:
    (source, dim), = split.items()
    ndim = len(_shape(source))
    a, b = (_dim(int(d), ndim) for d in node.args[1:3])
    return b if dim == a else a if dim == b else dim


def _permute(node: Node, split: dict[Node, int]) -> int:
    (source, dim), = split.items()
    ndim = len(_shape(source))
    return [_dim(int(d), ndim) for d in node.args[1]].index(dim)


def _unsqueeze(node: Node, split: dict[Node, int]) -> int:
    (source, dim), = split.items()
    at = _dim(int(node.args[1]), len(_shape(source)) + 1)
    return dim + 1 if at <= dim else dim


def _expand(node: Node, split: dict[Node, int]) -> int:
    (source, dim), = split.items()
    offset = len(_shape(node)) - len(_shape(source))
    if _shape(node)[dim + offset] != _shape(source)[dim]:
        raise Stop(f"{node.target} repeats the split dim")
    return dim + offset


def _along_other_dim(position: int, default: int) -> Callable[[Node, dict[Node, int]], int]:
    def rule(node: Node, split: dict[Node, int]) -> int:
        dim = _same(node, split) if len(split) == 1 else _pointwise(node, split)
        ndim = len(_shape(node.args[0]))
        along = node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)
        if _dim(int(along), ndim) == dim:
            raise Stop(f"{node.target} works along the split dim")
        return dim
    return rule


def _split(node: Node, split: dict[Node, int]) -> int:
    """``split`` / ``split_with_sizes`` / ``chunk``: along another dim the slice stays; along the
    split dim only into equal parts (a fused projection's parts), each holding its own slice."""
    (source, dim), = split.items()
    size = _shape(source)[dim]
    along = _dim(int(node.args[2]) if len(node.args) > 2 else int(node.kwargs.get("dim", 0)), len(_shape(source)))
    if along != dim:
        return dim
    sizes = _part_sizes(node, size)
    if len(sizes) < 2 or len(set(sizes)) != 1:
        raise Stop(f"{node.target} cuts the split dim into parts of sizes {sizes}, not equal parts of a fused projection")
    return Packed(dim, parts=len(sizes))


def _part_sizes(node: Node, size: int) -> list[int]:
    if node.target is aten.split_with_sizes.default:
        return [int(s) for s in node.args[1]]
    if node.target is aten.chunk.default:
        chunks = int(node.args[1])
        return [size // chunks] * chunks if size % chunks == 0 else [size]
    step = int(node.args[1])
    return [step] * (size // step) + ([size % step] if size % step else [])


def _unbind(node: Node, split: dict[Node, int]) -> int:
    """``unbind`` along another dim: every piece keeps the slice (one dim fewer before it)."""
    (source, dim), = split.items()
    along = _dim(int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0)), len(_shape(source)))
    if along == dim:
        raise Stop(f"{node.target} takes the split dim apart element by element")
    return dim - 1 if along < dim else dim


def _select(node: Node, split: dict[Node, int]) -> int:
    (source, dim), = split.items()
    along = _dim(int(node.args[1]), len(_shape(source)))
    if along == dim:
        raise Stop(f"{node.target} picks one element of the split dim")
    return dim - 1 if along < dim else dim


def _joined(node: Node, split: dict[Node, int]) -> tuple[int, int]:
    """``cat`` / ``stack``: the parts' common split dim and the dim they are joined along."""
    parts = node.args[0]
    dims = {split.get(p) for p in parts}
    if len(dims) != 1 or None in dims:
        raise Stop(f"{node.target} joins slices with tensors not split like them")
    added = 1 if node.target is aten.stack.default else 0
    return dims.pop(), _dim(int(node.args[1]) if len(node.args) > 1 else 0, len(_shape(parts[0])) + added)


def _cat(node: Node, split: dict[Node, int]) -> int:
    dim, along = _joined(node, split)
    if along == dim:
        raise Stop("cat joins along the split dim")
    return dim


def _stack(node: Node, split: dict[Node, int]) -> int:
    dim, at = _joined(node, split)
    return dim + 1 if at <= dim else dim


def _reduction(node: Node, split: dict[Node, int]) -> int:
    (source, dim), = split.items()
    ndim = len(_shape(source))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = list(range(ndim)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    reduced = {_dim(int(d), ndim) for d in dims}
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if dim in reduced:
        raise Stop(f"{node.target} sums over the split dim")
    return dim if keepdim else dim - sum(d < dim for d in reduced)


def _norm(node: Node, split: dict[Node, int]) -> int:
    (source, dim), = split.items()
    if source is not node.args[0]:
        raise Stop(f"{node.target} takes it as a weight")
    if dim >= len(_shape(source)) - len(node.args[1]):
        raise Stop(f"{node.target} normalizes over the split features")
    return dim


def _batched(node: Node, split: dict[Node, int]) -> int:
    operands = [a for a in node.args[:3 if "attention" in str(node.target) else 2] if isinstance(a, Node)]
    dims = {split.get(a) for a in operands}
    if len(dims) != 1 or None in dims:
        raise Stop(f"{node.target} multiplies a slice by a tensor not split like it")
    (dim,) = dims
    if dim >= len(_shape(operands[0])) - 2:
        raise Stop(f"{node.target} contracts or spans the split dim")
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, Node) and mask not in split and "attention" in str(node.target):
        shape, out = _shape(mask), _shape(node)
        at = dim - (len(out) - len(shape))
        if at >= 0 and shape[at] != 1:  # T5's relative position bias: a value per head, whole
            raise Stop(f"{node.target} adds a mask or bias with a value per head ({tuple(shape)}) that is not split like the heads")
    return dim


_UNARY = [
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.dropout.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default, aten.neg.default,
    aten.exp.default, aten.rsqrt.default, aten.sqrt.default, aten.mul.Scalar, aten.div.Scalar,
    aten.add.Scalar, aten.sub.Scalar, aten.pow.Tensor_Scalar, aten.gelu_.default, aten.relu_.default,
    aten.silu_.default, aten.detach.default, aten.isfinite.default, aten.isnan.default, aten.bitwise_not.default,
    aten.logical_not.default,
]

_RULES: dict[object, Callable[[Node, dict[Node, int]], int]] = {
    **dict.fromkeys(_UNARY, _same),
    **dict.fromkeys([aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.masked_fill.Scalar,
                     aten.where.self], _pointwise),
    **dict.fromkeys([aten.view.default, aten.reshape.default, aten._unsafe_view.default], _reshape),
    aten.transpose.int: _transpose,
    aten.unflatten.int: _unflatten,
    aten.flatten.using_ints: _flatten,
    **dict.fromkeys([aten.view_as_complex.default, aten.view_as_real.default], _complex_view),
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.expand.default: _expand,
    **dict.fromkeys([aten.softmax.int, aten._softmax.default, aten.log_softmax.int], _along_other_dim(1, -1)),
    **dict.fromkeys([aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default], _split),
    aten.slice.Tensor: _along_other_dim(1, 0),
    aten.select.int: _select,
    aten.unbind.int: _unbind,
    aten.cat.default: _cat,
    aten.stack.default: _stack,
    **dict.fromkeys([aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction], _reduction),
    **dict.fromkeys([aten.rms_norm.default, aten.layer_norm.default], _norm),
    **dict.fromkeys([aten.scaled_dot_product_attention.default, aten.matmul.default, aten.bmm.default], _batched),
}


def rule_for(node: Node) -> Callable[[Node, dict[Node, int]], int]:
    """The rule of ``node``'s op; raises :class:`Stop` naming the op when there is none.

    Example::

        >>> import torch.fx
        >>> graph = torch.fx.Graph()
        >>> x = graph.placeholder("x")
        >>> rule_for(graph.call_function(torch.ops.aten.gelu.default, (x,))).__name__
        '_same'
        >>> rule_for(graph.call_function(torch.ops.aten.sum.default, (x,)))
        Traceback (most recent call last):
        ...
        torch_tp.tools._dataflow.Stop: aten.sum.default has no rule for a split dim (torch_tp.tools._dataflow)
    """
    if node.target is operator.getitem:  # one output of split / chunk: split like them
        return _same
    rule = _RULES.get(node.target)
    if rule is None:
        raise Stop(f"{node.target} has no rule for a split dim (torch_tp.tools._dataflow)")
    return rule

