"""The forward kinds of ``ColwiseParallel`` / ``RowwiseParallel``: one table, from a combination
of settings to the forward it installs or the refusal it raises.

A linear style's forward depends on six things: the style, the module, ``overlap``,
``comm_dtype``, ``packed`` and the weight kind. ``TABLE`` holds one row per case; ``*``
matches anything and the first matching row wins:

=======  =========  =======  =====  ======  ======  ====================================================
style    module     overlap  comm   packed  weight  forward, or refusal
=======  =========  =======  =====  ======  ======  ====================================================
\\*       \\*         yes      \\*     yes     \\*      refused (ValueError): the fused ops exchange one
                                                    contiguous shard per rank
\\*       embedding  yes      \\*     \\*      \\*      refused: overlap fuses an ``nn.Linear``'s matmul
\\*       own        yes      \\*     \\*      \\*      refused: a forward of its own would be replaced
\\*       embedding  \\*        \\*     yes     \\*      refused: packed splits a fused ``nn.Linear`` weight
colwise  embedding  no       int8   \\*      \\*      refused: the int8 gather runs ``nn.Linear``'s matmul
colwise  own        no       int8   \\*      \\*      refused: a forward of its own would be replaced
\\*       linear     yes      \\*     no      w8a8    refused: the ring multiplies float activation chunks
colwise  linear     yes      float  no      \\*      ``all_gather_matmul`` ring (``_overlap``)
colwise  linear     yes      int8   no      \\*      ``int8_all_gather_matmul`` ring: int8 tokens
colwise  linear     no       int8   \\*      \\*      ``int8_all_gather``, then ``F.linear`` (``_int8_comm``)
colwise  \\*         no       float  \\*      \\*      the input redistributed in a pre-hook, the module's
                                                    forward
rowwise  linear     yes      float  no      \\*      ``matmul_reduce_scatter`` ring (``_overlap``)
rowwise  linear     yes      int8   no      \\*      ``matmul_int8_reduce_scatter``: int8 partial sums
rowwise  \\*         no       float  \\*      \\*      the module's forward (an embedding: the vocab-parallel
                                                    lookup), the partial sums reduced in a post-hook
rowwise  \\*         no       int8   \\*      \\*      the same, reduce-scattered by ``int8_reduce_scatter``
=======  =========  =======  =====  ======  ======  ====================================================

The module kinds: ``linear`` is an ``nn.Linear`` running ``nn.Linear.forward``; ``own`` a
linear layer with a forward of its own (an ``nn.Linear`` subclass that scales its output,
transformers' ``Conv1D``); ``embedding`` an ``nn.Embedding``. The weight kinds: ``float``,
``int8`` (:class:`~torch_tp.quant.Int8SymmetricTensor`, weight-only) and ``w8a8`` (the same
with ``activations="int8"``). Every row of the grid is tested against one process
(``tests/parallel/test_forward_kinds.py``): a forward trains like it, a refusal is raised on
every rank.

A style resolves its rows once, when it is made (:func:`kinds_of`): a refusal that holds for
every module (packed with overlap) is raised there, where the style is written; the rest is
resolved per module by ``check`` and ``apply_to`` (:meth:`StyleKinds.forward_for`). The module
rules that do not depend on the combination (module types, sizes, parameters) stay in
:mod:`torch_tp.parallel.rules`.

Example::

    >>> import torch.nn as nn
    >>> from torch.distributed.tensor import Shard
    >>> from torch_tp import ColwiseParallel
    >>> kinds_of(ColwiseParallel(input_layouts=Shard(1), overlap=True)).forward_for(nn.Linear(4, 8), "up").name
    'all_gather_matmul ring'
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_tp._layouts import agreed_dtensor, finish_output, packed_dtensor, redistribute_to, replace_forward
from torch_tp.parallel import _int8_comm, _overlap, rules
from torch_tp.parallel._empty_linear import flatten_empty_input, restore_empty_output
from torch_tp.parallel._shared_input import shared_input_of
from torch_tp.parallel._vocab_parallel import vocab_parallel_lookup

__all__ = [
    "TABLE",
    "Forward",
    "Refusal",
    "Row",
    "StyleKinds",
    "kinds_of",
    "module_kind",
    "output_to",
    "weight_kind",
]

ANY = "*"


# ------------------------------------------------------------------- what a row leads to


@dataclass(frozen=True)
class Forward:
    """A forward a linear style installs: ``install(style, module, device_mesh, module_path)``."""

    name: str
    install: Callable[..., None]


@dataclass(frozen=True)
class Refusal:
    """A combination torch_tp does not run: ``error`` with ``why`` and ``fix`` (what to change)."""

    error: type[Exception]
    why: str
    fix: str

    def raise_for(self, style, module: nn.Module | None, module_path: str | None) -> None:
        where = "" if module is None else f" cannot handle {rules.describe(module, module_path)}:"
        why = self.why.format(cls=type(module).__qualname__)
        raise self.error(f"{_settings(style)}{where} {why}; {self.fix}")


def _settings(style) -> str:
    """``ColwiseParallel(overlap=True, comm_dtype=torch.int8)``: the settings a refusal is about."""
    shown = [f"packed={style.packed}" if style.packed > 1 else "",
             f"overlap={style.overlap}" if style.overlap else "",
             "comm_dtype=torch.int8" if style.comm_dtype is not None else ""]
    return f"{type(style).__name__}({', '.join(s for s in shown if s)})"


@dataclass(frozen=True)
class Row:
    """One case of :data:`TABLE`: the keys (``"*"`` matches anything) and what they lead to."""

    style: str
    module: str
    overlap: object
    comm: str
    packed: object
    weight: str
    then: Forward | Refusal

    def matches_style(self, style: str, overlap: bool, comm: str, packed: bool) -> bool:
        return all(want == ANY or want == got for want, got in
                   ((self.style, style), (self.overlap, overlap), (self.comm, comm), (self.packed, packed)))

    def matches_module(self, module: str, weight: str) -> bool:
        return self.module in (ANY, module) and self.weight in (ANY, weight)


# ------------------------------------------------------------------- the forwards' hooks


def _sharded_input(module, args, *, device_mesh, layout, desired, sharded_dim_size, module_path, style, packed=1):
    if args and isinstance(args[0], DTensor) and args[0].placements == (_packed(desired, packed, args[0].ndim),):
        return None  # already in place (e.g. after PrepareModuleInput): leave the args as they are
    x = rules.require_first_input(args, module, module_path, style)
    size = sharded_dim_size if _shards_last_dim(layout, x.ndim) else None
    layout, desired = _packed(layout, packed, x.ndim), _packed(desired, packed, x.ndim)
    what = f"{style} on {rules.describe(module, module_path)}"

    def convert():
        return redistribute_to(_as_dtensor(x, device_mesh, layout, size, packed, what), desired)

    shared = shared_input_of(module)  # siblings reading one input: one DTensor, one reduction back
    return (convert() if shared is None else shared.converted(module, x, convert), *args[1:])


def _as_dtensor(x, device_mesh, layout: Placement, last_dim_size: int | None, packed: int, what: str) -> DTensor:
    """``to_dtensor``, plus the global size of a packed last dim, which ``to_dtensor`` cannot rebuild.

    A last-dim size is known only when ``layout`` shards the last dim, which ``packed > 1``
    made the packed shard. (``packed`` is passed, not read off the placement: ``torch.compile``
    cannot trace ``_StridedShard.split_factor``.)
    """
    if packed > 1 and last_dim_size is not None and not isinstance(x, DTensor):
        return packed_dtensor(x, device_mesh, layout, (*x.shape[:-1], last_dim_size))
    return agreed_dtensor(x, device_mesh, layout, sharded_dim_size=last_dim_size, what=what)


def _shards_last_dim(layout: Placement, ndim: int) -> bool:
    return isinstance(layout, Shard) and layout.dim % ndim == ndim - 1


def _packed(layout: Placement | None, packed: int, ndim: int) -> Placement | None:
    """``layout``, where a shard of the last dim means the packed shard of ``packed`` parts."""
    if packed > 1 and _shards_last_dim(layout, ndim):
        return rules.packed_shard(ndim - 1, packed)
    return layout


def output_to(module, inputs, output, *, layout, use_local_output, packed=1):
    """The forward hook that hands a style's output on: redistributed to ``layout`` (``None``:
    as it is), local when ``use_local_output``."""
    if layout is not None:
        output = redistribute_to(output, _packed(layout, packed, output.ndim))
    return finish_output(output, use_local_output)


# ------------------------------------------------------------------- the installers


def _gather_then_forward(style, module, device_mesh, module_path):
    module.register_forward_pre_hook(partial(
        _sharded_input, device_mesh=device_mesh, layout=style.input_layouts, desired=Replicate(),
        sharded_dim_size=None, module_path=module_path, style="ColwiseParallel",
    ))
    _empty_inputs_on_local_pieces(module)
    _colwise_output(style, module)


def _empty_inputs_on_local_pieces(module) -> None:
    """An input of no elements reaches an ``nn.Linear``'s own forward as 2-D, and its output gets
    its leading dims back, on this rank's pieces (:mod:`torch_tp.parallel._empty_linear`); the
    class's forward still runs. Registered between the input pre-hook and the output hooks."""
    if isinstance(module, nn.Linear):
        module.register_forward_pre_hook(flatten_empty_input)
        module.register_forward_hook(restore_empty_output)


def _colwise_ring(style, module, device_mesh, module_path):
    _overlap.install_colwise(module, device_mesh, layout=style.input_layouts, module_path=module_path,
                             int8_comm=style.comm_dtype is not None)
    _colwise_output(style, module)


def _int8_gather_then_linear(style, module, device_mesh, module_path):
    _int8_comm.install_colwise(module, device_mesh, layout=style.input_layouts, module_path=module_path,
                               packed=style.packed)
    _colwise_output(style, module)


def _colwise_output(style, module):
    module.register_forward_hook(partial(
        output_to, layout=style.output_layouts, use_local_output=style.use_local_output, packed=style.packed
    ))


def _rowwise_input(style, module, device_mesh, module_path):
    is_embedding = isinstance(module, nn.Embedding)
    desired = Replicate() if is_embedding else Shard(-1)
    module.register_forward_pre_hook(partial(
        _sharded_input, device_mesh=device_mesh, layout=style.input_layouts or desired, desired=desired,
        sharded_dim_size=None if is_embedding else rules.in_features(module), module_path=module_path,
        style="RowwiseParallel", packed=style.packed,
    ))
    if is_embedding and type(module).forward is nn.Embedding.forward:
        # a subclass's own forward (Gemma scales the rows) keeps DTensor's embedding rule
        replace_forward(module, vocab_parallel_lookup, device_mesh=device_mesh)


def _rowwise_ring(style, module, device_mesh, module_path):
    _rowwise_input(style, module, device_mesh, module_path)
    _overlap.install_rowwise(module, device_mesh, layout=style.output_layouts, module_path=module_path,
                             int8_comm=style.comm_dtype is not None)
    module.register_forward_hook(partial(output_to, layout=style.output_layouts, use_local_output=style.use_local_output))


def _forward_then_reduce(style, module, device_mesh, module_path):
    _rowwise_input(style, module, device_mesh, module_path)
    _empty_inputs_on_local_pieces(module)
    module.register_forward_hook(partial(output_to, layout=style.output_layouts, use_local_output=style.use_local_output))


def _forward_then_int8_reduce_scatter(style, module, device_mesh, module_path):
    _rowwise_input(style, module, device_mesh, module_path)
    _empty_inputs_on_local_pieces(module)
    _int8_comm.install_rowwise_output(module, device_mesh, layout=style.output_layouts,
                                      use_local_output=style.use_local_output, module_path=module_path)


# ------------------------------------------------------------------- the table

_OWN_FORWARD = ("{cls} has its own forward (not nn.Linear's), which the fused all-gather/matmul would "
                "replace with nn.Linear's (whatever else it computes would be lost)")

#: Every combination of the linear styles' settings, in order: the first matching row wins.
TABLE: tuple[Row, ...] = (
    Row(ANY, ANY, True, ANY, True, ANY, Refusal(
        ValueError, "is not supported: the fused ops exchange one contiguous shard per rank, and a packed "
        "weight's shard is a slice of each part", "use overlap=False for the packed layer")),
    Row(ANY, "embedding", True, ANY, ANY, ANY, Refusal(
        rules.UnsupportedModuleError, "it fuses an nn.Linear's matmul with its communication",
        "use overlap=False for this module")),
    Row(ANY, "own", True, ANY, ANY, ANY, Refusal(
        rules.UnsupportedModuleError, _OWN_FORWARD, "use overlap=False for this module")),
    Row(ANY, "embedding", ANY, ANY, True, ANY, Refusal(
        rules.UnsupportedModuleError, "it shards the parts of a fused nn.Linear weight", "use packed=1 for this module")),
    Row("colwise", "embedding", False, "int8", ANY, ANY, Refusal(
        rules.UnsupportedModuleError, "it gathers the input as int8 and runs nn.Linear's matmul on it",
        "use comm_dtype=None for this module")),
    Row("colwise", "own", False, "int8", ANY, ANY, Refusal(
        rules.UnsupportedModuleError, _OWN_FORWARD.replace("the fused all-gather/matmul", "the int8 gather"),
        "use comm_dtype=None for this module")),
    Row(ANY, "linear", True, ANY, False, "w8a8", Refusal(
        NotImplementedError, "its weight is W8A8 (activations='int8'); the fused ring multiplies float "
        "activation chunks by int8 weights, weight-only",
        "use overlap=False for W8A8 layers, or quantize them with Int8SymmetricWeightConfig(activations='float')")),
    Row("colwise", "linear", True, "float", False, ANY, Forward("all_gather_matmul ring", _colwise_ring)),
    Row("colwise", "linear", True, "int8", False, ANY, Forward("int8_all_gather_matmul ring", _colwise_ring)),
    Row("colwise", "linear", False, "int8", ANY, ANY, Forward("int8 gather, then F.linear", _int8_gather_then_linear)),
    Row("colwise", ANY, False, "float", ANY, ANY, Forward("gather, then the module's forward", _gather_then_forward)),
    Row("rowwise", "linear", True, "float", False, ANY, Forward("matmul_reduce_scatter ring", _rowwise_ring)),
    Row("rowwise", "linear", True, "int8", False, ANY, Forward("matmul_int8_reduce_scatter ring", _rowwise_ring)),
    Row("rowwise", ANY, False, "float", ANY, ANY, Forward("the module's forward, then the reduction",
                                                          _forward_then_reduce)),
    Row("rowwise", ANY, False, "int8", ANY, ANY, Forward("the module's forward, then the int8 reduce-scatter",
                                                         _forward_then_int8_reduce_scatter)),
)


def module_kind(module: nn.Module) -> str:
    """``"embedding"``, ``"linear"`` (an ``nn.Linear`` running ``nn.Linear.forward``) or ``"own"``
    (a linear layer with a forward of its own: a subclass, transformers' ``Conv1D``).

    Example::

        >>> module_kind(nn.Linear(2, 3)), module_kind(nn.Embedding(4, 2))
        ('linear', 'embedding')
    """
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return "linear"
    return "own"


def weight_kind(module: nn.Module) -> str:
    """``"float"``, ``"int8"`` (an int8 weight-only tensor) or ``"w8a8"`` (int8 activations too),
    read off ``module.weight`` before or after it is distributed.

    Example::

        >>> weight_kind(nn.Linear(2, 3))
        'float'
    """
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return "float"
    data = weight.data.to_local() if isinstance(weight.data, DTensor) else weight.data
    activations = getattr(data, "activations", None)  # torch_tp.quant's Int8SymmetricTensor
    if activations is None:
        return "float"
    return "w8a8" if activations == "int8" else "int8"


@dataclass(frozen=True)
class StyleKinds:
    """The rows of :data:`TABLE` one style object can reach, in order."""

    style: object
    rows: tuple[Row, ...]

    def forward_for(self, module: nn.Module, module_path: str | None) -> Forward:
        """The forward this style installs on ``module``, or its refusal raised (named by module path)."""
        module_key, weight_key = module_kind(module), weight_kind(module)
        for row in self.rows:
            if row.matches_module(module_key, weight_key):
                if isinstance(row.then, Refusal):
                    row.then.raise_for(self.style, module, module_path)
                return row.then
        raise AssertionError(f"torch_tp.parallel._forward_kinds: no row for {self.style} on {module_key} "
                             f"{weight_key} weights")  # TABLE's last rows match every module: unreachable


def kinds_of(style) -> StyleKinds:
    """The rows of :data:`TABLE` for ``style``'s settings; a refusal that holds for every module is
    raised now.

    Example::

        >>> from torch_tp import RowwiseParallel
        >>> [row.then.name for row in kinds_of(RowwiseParallel()).rows]
        ["the module's forward, then the reduction"]
    """
    key = (style.table_key, style.overlap, "float" if style.comm_dtype is None else "int8", style.packed > 1)
    rows = tuple(row for row in TABLE if row.matches_style(*key))
    first = rows[0]
    if first.module == ANY and first.weight == ANY and isinstance(first.then, Refusal):
        first.then.raise_for(style, None, None)
    return StyleKinds(style, rows)
