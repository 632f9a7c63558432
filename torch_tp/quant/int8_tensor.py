"""``Int8SymmetricTensor``: an int8 weight with one float32 scale per row, that DTensor can shard.

The tensor holds ``qdata`` (int8, the tensor's shape) and ``scale`` (float32, same number
of dims as ``qdata``). Its logical ``dtype`` is the float dtype it was quantized from.

The scale rule, used by every shape op (:meth:`Int8SymmetricTensor.scale_follows`)::

    along each dim d, scale.shape[d] is either qdata.shape[d] (the scale varies along d:
    per-row) or 1 (it broadcasts over d). dequantize() == qdata * scale.

So slicing, splitting or concatenating along a per-row dim does the same to ``scale``; along
a broadcast dim ``scale`` is left whole; transposing transposes both. A freshly quantized
weight of shape ``(rows, cols)`` has ``scale`` of shape ``(rows, 1)``. Along a dim of size 1
the two readings look alike (a one-column shard: ``qdata`` ``(8, 1)``, ``scale`` ``(8, 1)``);
such a dim is per-row only if no other dim is (the first one, if several): per-row scales
vary along one dim, so the shard pads, scatters and joins like its neighbours.

The activation mode (:attr:`Int8SymmetricTensor.activations`) says how a linear layer's
product treats its input: ``"float"`` (weight-only, the default: the float input times the
int8 matrix) or ``"int8"`` (W8A8: the input quantized per token, an exact int8 x int8 product;
see ``_ops_matmul.py``). Every op keeps it, like the logical dtype: shape ops and copies,
``__tensor_flatten__`` (``torch.compile``), collectives, checkpoints, FSDP2's gather.

The aten ops live in ``_ops_shape.py``, ``_ops_matmul.py``, ``_ops_collective.py`` and
``_ops_checkpoint.py`` (what ``torch.save`` and DCP need; see there for checkpoints) and
``_ops_overlap.py`` (the fused ops of :mod:`torch_tp.overlap` with int8 weights) and
``_ops_fsdp.py`` (FSDP2's all-gather of int8 bytes), each
registered on :attr:`Int8SymmetricTensor.implements` when :mod:`torch_tp.quant` loads them. An op that is not implemented raises
``NotImplementedError`` naming the op: nothing silently falls back to float.

**Int8 data is checked where it enters** (:func:`int8_values_problem`): ``qdata`` in
``[-127, 127]`` (the symmetric range that keeps W8A8's int32 sums exact up to its K) and
``scale`` finite and positive. Entry points: the constructor called from user code, ``copy_``
(``load_state_dict``, ``dcp.load``) and unpickling (``torch.load``). A tensor an op builds from
checked operands (inside ``__torch_dispatch__`` / ``__torch_function__``, FSDP2's gather,
``torch.compile``'s unflatten) is checked by construction and costs no scan.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from torch_tp.quant import _registry
from torch_tp.quant._primitives import dequantize_per_row, quantize_per_row
from torch_tp.quant._torchao import import_torchao

__all__ = ["ACTIVATIONS", "Int8SymmetricTensor", "built_from_checked_data", "check_activations", "int8_values_problem"]

TorchAOBaseTensor = import_torchao("torchao.utils").TorchAOBaseTensor

#: The activation modes: ``"float"`` (weight-only) and ``"int8"`` (W8A8, see ``_ops_matmul.py``).
ACTIVATIONS = ("float", "int8")


def check_activations(activations, where: str = "torch_tp.quant.Int8SymmetricTensor") -> str:
    """``activations`` if it is one of :data:`ACTIVATIONS`; ``ValueError`` naming ``where`` otherwise.

    Example::

        >>> check_activations("int8")
        'int8'
    """
    if not isinstance(activations, str) or activations not in ACTIVATIONS:
        raise ValueError(
            f"{where}(activations={activations!r}): the activation mode is one of {ACTIVATIONS} "
            f"('float': weight-only, the float input times the int8 weight; 'int8': W8A8, the "
            f"input quantized per token and an exact int8 x int8 product)"
        )
    return activations


def int8_values_problem(qdata: torch.Tensor, scale: torch.Tensor) -> str | None:
    """What keeps ``qdata``/``scale`` out of :class:`Int8SymmetricTensor`'s value range, or
    ``None``: ``qdata`` in ``[-127, 127]``, ``scale`` finite and positive. Reads the data (one
    scan); fake and meta tensors have none and pass.

    Example::

        >>> int8_values_problem(torch.tensor([[-128, 3]], dtype=torch.int8), torch.ones(1, 1))
        'qdata holds -128, outside the symmetric range [-127, 127]'
    """
    if any(t.device.type == "meta" or isinstance(t, FakeTensor) for t in (qdata, scale)):
        return None
    if qdata.dtype == torch.int8 and qdata.numel() and bool((qdata == -128).any()):
        return "qdata holds -128, outside the symmetric range [-127, 127]"
    if scale.numel() and not bool((torch.isfinite(scale) & (scale > 0)).all()):
        return "scale holds a value that is not finite and positive"
    return None


_CHECKED = threading.local()


@contextlib.contextmanager
def built_from_checked_data():
    """Within it, :class:`Int8SymmetricTensor` is built without a value scan: its data comes
    from checked tensors (an op's result, a gather of checked shards).

    Example::

        >>> with built_from_checked_data():
        ...     q = Int8SymmetricTensor(torch.ones(2, 2, dtype=torch.int8), torch.ones(2, 1), torch.float32)
    """
    depth = getattr(_CHECKED, "depth", 0)
    _CHECKED.depth = depth + 1
    try:
        yield
    finally:
        _CHECKED.depth = depth


def _require_int8_values(qdata: torch.Tensor, scale: torch.Tensor, where: str) -> None:
    if getattr(_CHECKED, "depth", 0) or torch.compiler.is_compiling():
        return
    problem = int8_values_problem(qdata, scale)
    if problem is not None:
        raise ValueError(
            f"torch_tp.quant.Int8SymmetricTensor ({where}): {problem}. Build int8 weights with "
            f"Int8SymmetricTensor.from_hp(float_weight), or check where this int8 data came from"
        )


@contextlib.contextmanager
def _an_op(cls: type, func) -> Iterator[None]:
    """Around one op of the class (``__torch_dispatch__`` or ``__torch_function__``): what it
    builds comes from its checked operands (no value scan), and an error it raises that does not
    name torch_tp gets the module path and the op in front, the same type, chained."""
    try:
        with built_from_checked_data():
            yield
    except (TypeError, ValueError, NotImplementedError) as error:
        if "torch_tp" in str(error) or type(error) not in (TypeError, ValueError, NotImplementedError):
            raise
        op = func if isinstance(func, torch._ops.OpOverload) else getattr(func, "__name__", func)  # aten.view.default
        where = f"torch_tp.quant.{cls.__name__} ({op})"
        raise type(error)(f"{where}: {error}") from error


_GRAD_SETTERS = (torch.Tensor.requires_grad_, torch.Tensor.requires_grad.__set__)


def _refuse_requires_grad(func, args, kwargs) -> None:
    wanted = args[1] if len(args) > 1 else kwargs.get("requires_grad", func is torch.Tensor.requires_grad_)
    if wanted:
        raise TypeError(
            f"torch_tp.quant.{type(args[0]).__name__}: an int8 weight is frozen (requires_grad=False): it has "
            f"no float values to train, and an optimizer step would write float updates into int8 data. Keep "
            f"it frozen (nn.Parameter(weight, requires_grad=False)), or train the float weight and quantize after"
        )


class Int8SymmetricTensor(TorchAOBaseTensor):
    """A weight stored as int8 ``qdata`` and per-row float32 ``scale`` (symmetric, zero-point 0).

    Build one with :meth:`from_hp` (or ``torchao.quantize_(model, Int8SymmetricWeightConfig())``).
    It behaves as a tensor of its original float ``dtype``: ``F.linear``, ``F.embedding``,
    ``mm``/``addmm``/``matmul`` compute in the input's dtype, and DTensor can shard,
    redistribute (moving int8 bytes), save and load it. :attr:`activations` is its
    activation mode (``"float"``: weight-only; ``"int8"``: W8A8), kept by every op.

    Example::

        >>> w = torch.tensor([[1.0, -0.5], [0.25, 0.0]])
        >>> q = Int8SymmetricTensor.from_hp(w)
        >>> q.dtype, q.qdata.dtype, q.scale.shape
        (torch.float32, torch.int8, torch.Size([2, 1]))
        >>> torch.allclose(q.dequantize(), w, atol=1e-2)
        True
    """

    tensor_data_names = ["qdata", "scale"]
    tensor_attribute_names = ["dtype"]
    #: Where the rows came from (see :meth:`layout_flags`): kept by copies, moves and detaches;
    #: and the activation mode (:data:`ACTIVATIONS`), kept by every op.
    optional_tensor_attribute_names = ["whole_rows", "shared_scale", "activations"]

    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                whole_rows: bool | None = True, shared_scale: bool | None = False,
                activations: str | None = "float"):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=dtype, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                 whole_rows: bool | None = True, shared_scale: bool | None = False,
                 activations: str | None = "float"):
        super().__init__()
        _require_int8_values(qdata, scale, "constructor")
        self.qdata = qdata
        self.scale = scale
        self.whole_rows = True if whole_rows is None else bool(whole_rows)
        self.shared_scale = False if shared_scale is None else bool(shared_scale)
        self.activations = "float" if activations is None else check_activations(activations)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)  # torchao sets cls.__setstate__ here: put ours back
        cls.__setstate__ = _setstate
        _registry.register(cls)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func not in getattr(cls, "_ATEN_OP_TABLE", {}).get(cls, ()):
            raise NotImplementedError(
                f"torch_tp.quant.{cls.__name__}: {func} is not implemented for int8 weights (an allowlist: "
                f"the ops docs/op_coverage.md lists, swept against the float op). For other math use "
                f"weight.dequantize(), a float copy"
            )
        with _an_op(cls, func):
            return super().__torch_dispatch__(func, types, args, kwargs)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _GRAD_SETTERS:
            _refuse_requires_grad(func, args, kwargs or {})
        with _an_op(cls, func):
            return super().__torch_function__(func, types, args, kwargs)

    def __tensor_flatten__(self):
        """``(["qdata", "scale"], context)``; the context names this tensor's registered class
        and carries its :meth:`layout_flags` and :attr:`activations`."""
        return list(self.tensor_data_names), {"dtype": self.dtype, "class": _registry.class_key(type(self)),
                                              **self.layout_flags(), "activations": self.activations}

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, context, outer_size, outer_stride):
        """Rebuild from :meth:`__tensor_flatten__`'s output; only torch_tp's registered classes."""
        target = _registry.registered_class(context["class"], Int8SymmetricTensor)
        with built_from_checked_data():
            return target(inner_tensors["qdata"], inner_tensors["scale"], context["dtype"],
                          context.get("whole_rows", True), context.get("shared_scale", False),
                          context.get("activations", "float"))

    @classmethod
    def from_hp(cls, weight: torch.Tensor, *, activations: str = "float") -> "Int8SymmetricTensor":
        """Quantize a 2-D float weight (float32, bfloat16 or float16), one scale per row.

        ``activations``: the activation mode, ``"float"`` (weight-only) or ``"int8"`` (W8A8:
        a linear layer's input is quantized per token too; see :mod:`torch_tp.quant`'s docs).

        Raises ``TypeError`` for a non-float tensor and ``ValueError`` for a weight that is
        not 2-D or holds NaN/inf, or for another ``activations``.

        Example::

            >>> Int8SymmetricTensor.from_hp(torch.ones(3, 4, dtype=torch.bfloat16)).dtype
            torch.bfloat16
            >>> Int8SymmetricTensor.from_hp(torch.ones(3, 4), activations="int8").activations
            'int8'
        """
        check_activations(activations, "torch_tp.quant.Int8SymmetricTensor.from_hp")
        qdata, scale = quantize_per_row(weight)
        with built_from_checked_data():
            return cls(qdata, scale, weight.dtype, activations=activations)

    def with_activations(self, activations: str) -> "Int8SymmetricTensor":
        """The same int8 values and scales (shared, not copied) under another activation mode.

        Example::

            >>> q = Int8SymmetricTensor.from_hp(torch.ones(3, 4))
            >>> w8a8 = q.with_activations("int8")
            >>> w8a8.activations, w8a8.qdata is q.qdata
            ('int8', True)
        """
        check_activations(activations, f"torch_tp.quant.{type(self).__name__}.with_activations")
        with built_from_checked_data():
            return type(self)(self.qdata, self.scale, self.dtype, self.whole_rows, self.shared_scale, activations)

    from_float = from_hp

    def dequantize(
        self, output_dtype: torch.dtype | None = None, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The float tensor this one stands for, as ``output_dtype`` (default: its own dtype).

        ``dtype=`` is accepted as another name for ``output_dtype`` (torchao's spelling).

        Example::

            >>> q = Int8SymmetricTensor.from_hp(torch.tensor([[2.0, -1.0]]))
            >>> q.dequantize()
            tensor([[ 2.0000, -1.0079]])
        """
        if output_dtype is not None and dtype is not None and output_dtype != dtype:
            raise ValueError(f"dequantize got output_dtype={output_dtype} and dtype={dtype}; pass one")
        return dequantize_per_row(self.qdata, self.scale, output_dtype or dtype or self.dtype)

    def scale_follows(self, dim: int) -> bool:
        """Whether ``scale`` varies along ``dim`` (so ops on that dim must apply to it too).

        A dim of size 1 follows only if no larger dim does (the first such dim, if several).

        Example::

            >>> q = Int8SymmetricTensor.from_hp(torch.ones(3, 4))
            >>> q.scale_follows(0), q.scale_follows(1), q.t().scale_follows(1)
            (True, False, True)
            >>> column = q[:, :1]                       # qdata (3, 1), scale (3, 1)
            >>> column.scale_follows(0), column.scale_follows(1)
            (True, False)
        """
        dims = range(self.qdata.ndim)
        followed = [d for d in dims if self.scale.shape[d] == self.qdata.shape[d]]
        dim = dim % self.qdata.ndim
        if dim not in followed or self.qdata.shape[dim] != 1:
            return dim in followed
        return dim == followed[0] and all(self.qdata.shape[d] == 1 for d in followed)

    def layout_problem(self) -> str | None:
        """What keeps ``qdata`` and ``scale`` from standing for this tensor, or ``None``: ``qdata``
        must be int8 of the tensor's shape, ``scale`` float32 following the scale rule.

        Example::

            >>> q = Int8SymmetricTensor.from_hp(torch.ones(3, 4))
            >>> q.layout_problem() is None
            True
            >>> q.qdata = q.qdata.float()
            >>> q.layout_problem()
            'qdata is torch.float32, not torch.int8'
        """
        qdata, scale = self.qdata, self.scale
        if qdata.dtype != torch.int8:
            return f"qdata is {qdata.dtype}, not torch.int8"
        if qdata.shape != self.shape:
            return f"qdata has shape {tuple(qdata.shape)}, not the tensor's {tuple(self.shape)}"
        if scale.dtype != torch.float32:
            return f"scale is {scale.dtype}, not torch.float32"
        if scale.ndim != qdata.ndim or any(s not in (q, 1) for s, q in zip(scale.shape, qdata.shape)):
            return (f"scale has shape {tuple(scale.shape)}, which breaks the scale rule for qdata of "
                    f"shape {tuple(qdata.shape)} (each dim of scale is qdata's size or 1)")
        return None

    def scale_shape_for(self, shape) -> torch.Size:
        """The ``scale`` shape a tensor of ``shape`` with this tensor's scale layout has."""
        return torch.Size(size if self.scale_follows(d) else 1 for d, size in enumerate(shape))

    def layout_flags(self) -> dict[str, bool]:
        """Where this tensor's rows came from, which decides what an all-gather must move.

        ``whole_rows``: it holds every row it was quantized with (true from :meth:`from_hp`;
        a cut along a row dim makes pieces that do not). ``shared_scale``: it is a piece cut
        along a feature dim (a dim the scale does not follow) from a tensor with whole rows, so
        its sibling pieces, which DTensor hands the other ranks (``Shard(1)``: a Rowwise
        weight), hold this very scale; gathering them moves only ``qdata``. Any other op's
        result has neither (its scales may differ between ranks: the gather moves them).

        Example::

            >>> q = Int8SymmetricTensor.from_hp(torch.ones(4, 6))
            >>> q.chunk(2, dim=1)[0].layout_flags(), q.chunk(2, dim=0)[0].layout_flags()
            ({'whole_rows': True, 'shared_scale': True}, {'whole_rows': False, 'shared_scale': False})
        """
        return {"whole_rows": self.whole_rows, "shared_scale": self.shared_scale}

    def with_data(self, qdata: torch.Tensor, scale: torch.Tensor, **flags: bool) -> "Int8SymmetricTensor":
        """A tensor of this class, dtype and :attr:`activations` around new ``qdata`` and ``scale``;
        its :meth:`layout_flags` are ``flags`` (default: neither, what an op's result may claim)."""
        flags = {"whole_rows": False, "shared_scale": False, **flags}
        with built_from_checked_data():
            return type(self)(qdata, scale, self.dtype, flags["whole_rows"], flags["shared_scale"], self.activations)

    def piece_flags(self, dim: int) -> dict[str, bool]:
        """The :meth:`layout_flags` of a piece cut from this tensor along ``dim``.

        Example::

            >>> Int8SymmetricTensor.from_hp(torch.ones(4, 6)).piece_flags(1)
            {'whole_rows': True, 'shared_scale': True}
        """
        if self.scale_follows(dim):  # a row cut: the pieces hold different rows
            return {"whole_rows": False, "shared_scale": False}
        return {"whole_rows": self.whole_rows, "shared_scale": self.whole_rows}

    def __repr__(self) -> str:
        mode = "" if self.activations == "float" else f", activations={self.activations}"
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"qdata=int8, scale={tuple(self.scale.shape)} float32{mode}, device={self.device})"
        )


_base_setstate = Int8SymmetricTensor.__setstate__  # torchao's: a missing optional attribute is None


def _setstate(self, state) -> None:
    """Unpickling (``torch.load``): torchao's, and a tensor pickled before the activation mode
    existed is weight-only, the only mode there was."""
    _base_setstate(self, state)
    if self.activations is None:
        self.activations = "float"
    _require_int8_values(self.qdata, self.scale, "torch.load")


Int8SymmetricTensor.__setstate__ = _setstate
_registry.register(Int8SymmetricTensor)
implements = Int8SymmetricTensor.implements
implements_torch_function = Int8SymmetricTensor.implements_torch_function

torch.serialization.add_safe_globals([Int8SymmetricTensor])
