"""``PrepareModuleInput`` / ``PrepareModuleOutput`` / ``PrepareModuleInputOutput``: convert a
module's inputs or outputs between layouts, and the forward hooks that do it.

A layout tuple has one entry per positional input (or output): ``None`` leaves that value
alone, a Placement annotates it (plain tensor -> DTensor) and the matching *desired*
placement is what the module (or its caller) receives. Function forms:
:func:`torch_tp.functional.prepare_input`, :func:`~torch_tp.functional.prepare_output` and
:func:`~torch_tp.functional.prepare_input_output`.

Example::

    >>> PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    PrepareModuleInput(input_layouts=(Shard(dim=1),), desired_input_layouts=(Replicate(),), input_kwarg_layouts={}, desired_input_kwarg_layouts={}, use_local_output=False)
"""

from __future__ import annotations

from functools import partial

from torch.distributed.tensor import Replicate, Shard  # noqa: F401  (doctest names)
from torch.distributed.tensor.placement_types import Placement

from torch_tp._layouts import agreed_dtensor, finish_output, redistribute_to
from torch_tp.parallel import rules
from torch_tp.parallel._style_base import ParallelStyle

__all__ = ["PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "LayoutMismatchError"]

Layouts = Placement | tuple[Placement | None, ...] | None


class LayoutMismatchError(ValueError, AssertionError):
    """A ``PrepareModule*`` style's layouts and desired layouts do not describe the same values.

    Raised when one of a pair is given without the other, or the two have different lengths
    (or, for keyword inputs, ``desired_input_kwarg_layouts`` names a key that
    ``input_kwarg_layouts`` does not). A ``ValueError`` like torch_tp's other argument errors,
    and an ``AssertionError``, the type upstream's ``PrepareModuleInput`` and
    ``PrepareModuleOutput`` raise for the same mistakes, so ``except AssertionError`` written
    for upstream still catches it.

    Example::

        >>> try:
        ...     PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=Replicate())
        ... except AssertionError as error:  # upstream's type
        ...     print(type(error).__name__, isinstance(error, ValueError))
        LayoutMismatchError True
    """


def _paired(layouts: object, desired: object, names: tuple[str, str]) -> tuple[tuple | None, tuple | None]:
    """:func:`rules.paired_layouts`, raising :class:`LayoutMismatchError` when the two do not pair up."""
    layouts, desired = rules.layout_tuple(layouts, names[0]), rules.layout_tuple(desired, names[1])  # TypeError as is
    try:
        return rules.paired_layouts(layouts, desired, names)
    except ValueError as err:
        raise LayoutMismatchError(str(err)) from None


def _paired_kwargs(layouts: object, desired: object) -> tuple[dict, dict]:
    """:func:`rules.kwarg_layouts`, raising :class:`LayoutMismatchError` when the two do not pair up."""
    try:
        return rules.kwarg_layouts(layouts, desired)
    except ValueError as err:
        raise LayoutMismatchError(str(err)) from None


# ------------------------------------------------------------------- forward hooks


def _prepare_value(value, layout, desired, *, device_mesh, use_local, position, module, module_path, style):
    if layout is None:
        return value
    tensor = rules.require_tensor_input(value, position, module, module_path, style)
    dvalue = agreed_dtensor(tensor, device_mesh, layout, what=f"{style} on {rules.describe(module, module_path)}")
    if desired is not None:
        dvalue = redistribute_to(dvalue, desired)
    return finish_output(dvalue, use_local)


def _prepare_positional(values, layouts, desired, **where):
    if layouts is None:
        return tuple(values)
    if len(values) != len(layouts):
        raise ValueError(
            f"{where['style']} on {rules.describe(where['module'], where['module_path'])} has "
            f"{len(layouts)} layouts {layouts} but the module got {len(values)} positional values; "
            f"give one entry per value (None for those to leave alone)"
        )
    return tuple(
        _prepare_value(value, layout, want, position=str(i), **where)
        for i, (value, layout, want) in enumerate(zip(values, layouts, desired))
    )


def _input_hook(module, args, kwargs, *, style: PrepareModuleInput | PrepareModuleInputOutput, device_mesh, module_path):
    use_local = style.use_local_input if isinstance(style, PrepareModuleInputOutput) else style.use_local_output
    where = dict(device_mesh=device_mesh, use_local=use_local, module=module, module_path=module_path,
                 style="PrepareModuleInput")
    args = _prepare_positional(args, style.input_layouts, style.desired_input_layouts, **where)
    if style.input_kwarg_layouts:
        kwargs = {
            key: _prepare_value(value, style.input_kwarg_layouts.get(key),
                                style.desired_input_kwarg_layouts.get(key), position=repr(key), **where)
            for key, value in kwargs.items()
        }
    return args, kwargs


def _output_hook(module, inputs, outputs, *, style, device_mesh, module_path):
    where = dict(device_mesh=device_mesh, use_local=style.use_local_output, module=module,
                 module_path=module_path, style="PrepareModuleOutput")
    single = not isinstance(outputs, tuple)
    prepared = _prepare_positional((outputs,) if single else outputs, style.output_layouts,
                                   style.desired_output_layouts, **where)
    return prepared[0] if single else prepared


def _install_input_hook(style, module, device_mesh, module_path) -> None:
    hook = partial(_input_hook, style=style, device_mesh=device_mesh, module_path=module_path)
    module.register_forward_pre_hook(hook, with_kwargs=True)
    rules.mark_prepared(module, ("input",), "PrepareModuleInput")


def _install_output_hook(style, module, device_mesh, module_path) -> None:
    module.register_forward_hook(partial(_output_hook, style=style, device_mesh=device_mesh, module_path=module_path))
    rules.mark_prepared(module, ("output",), "PrepareModuleOutput")


def _require_flags(style: ParallelStyle) -> None:
    for name in ("use_local_input", "use_local_output"):
        if hasattr(style, name):
            setattr(style, name, rules.flag(getattr(style, name), name, type(style).__name__))


def _required_output_layouts(layouts: object, desired: object) -> tuple[tuple, tuple]:
    if layouts is None:
        raise ValueError("PrepareModuleOutput needs output_layouts (one entry per output)")
    return _paired(layouts, desired, ("output_layouts", "desired_output_layouts"))


# ------------------------------------------------------------------- styles


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs to DTensors (``input_layouts``) and redistribute them
    (``desired_input_layouts``) before its ``forward``.

    Keyword Args:
        input_layouts (Placement or tuple of Placement/None): one entry per positional input;
            ``None`` leaves a value (e.g. a non-tensor) alone.
        desired_input_layouts (Placement or tuple of Placement/None): same length; the layouts
            ``forward`` receives.
        input_kwarg_layouts (dict[str, Placement]): layouts of keyword inputs.
        desired_input_kwarg_layouts (dict[str, Placement]): desired layouts of keyword inputs.
        use_local_output (bool): hand ``forward`` local tensors instead of DTensors. Default ``False``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> PrepareModuleInput(input_layouts=(Shard(1), None),
        ...                    desired_input_layouts=(Replicate(), None))
    """

    input_layouts: Layouts = None
    desired_input_layouts: Layouts = None
    input_kwarg_layouts: dict[str, Placement] | None = None
    desired_input_kwarg_layouts: dict[str, Placement] | None = None
    use_local_output: bool = False

    def __post_init__(self):
        self.input_layouts, self.desired_input_layouts = _paired(
            self.input_layouts, self.desired_input_layouts, ("input_layouts", "desired_input_layouts")
        )
        self.input_kwarg_layouts, self.desired_input_kwarg_layouts = _paired_kwargs(
            self.input_kwarg_layouts, self.desired_input_kwarg_layouts
        )
        _require_flags(self)

    def check(self, module, device_mesh, module_path=None):
        rules.check_prepare_input(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        _install_input_hook(self, module, device_mesh, module_path)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs to DTensors (``output_layouts``) and redistribute them
    (``desired_output_layouts``) after its ``forward``.

    Keyword Args:
        output_layouts (Placement or tuple of Placement/None): one entry per output.
        desired_output_layouts (Placement or tuple of Placement/None): same length.
        use_local_output (bool): return local tensors instead of DTensors. Default ``True``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
    """

    output_layouts: Layouts
    desired_output_layouts: Layouts
    use_local_output: bool = True

    def __post_init__(self):
        self.output_layouts, self.desired_output_layouts = _required_output_layouts(
            self.output_layouts, self.desired_output_layouts
        )
        _require_flags(self)

    def check(self, module, device_mesh, module_path=None):
        rules.check_prepare_output(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        _install_output_hook(self, module, device_mesh, module_path)
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module.

    Keyword Args:
        input_layouts, desired_input_layouts, input_kwarg_layouts,
        desired_input_kwarg_layouts: as :class:`PrepareModuleInput`.
        use_local_input (bool): hand ``forward`` local tensors. Default ``False``.
        output_layouts, desired_output_layouts: as :class:`PrepareModuleOutput`.
        use_local_output (bool): return local tensors. Default ``True``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
        ...                          output_layouts=Replicate(), desired_output_layouts=Shard(1))
    """

    input_layouts: Layouts = None
    desired_input_layouts: Layouts = None
    input_kwarg_layouts: dict[str, Placement] | None = None
    desired_input_kwarg_layouts: dict[str, Placement] | None = None
    use_local_input: bool = False
    output_layouts: Layouts
    desired_output_layouts: Layouts
    use_local_output: bool = True

    def __post_init__(self):
        PrepareModuleInput.__post_init__(self)
        PrepareModuleOutput.__post_init__(self)

    def check(self, module, device_mesh, module_path=None):
        rules.check_prepare_input(module, device_mesh, module_path)
        rules.check_prepare_output(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        _install_input_hook(self, module, device_mesh, module_path)
        _install_output_hook(self, module, device_mesh, module_path)
        return module
