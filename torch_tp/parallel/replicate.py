"""``ReplicateParallel`` and ``replicate``: modules with replicated parameters, whose gradients are
reduced over the ranks and whose outputs are what the single-process model computes.

A module between a Colwise and a Rowwise layer runs on local features (Qwen3's per-head
``q_norm``/``k_norm`` on the local heads); with plain parameters each rank's gradient would
cover only its own features. :class:`ReplicateParallel` reads its inputs as DTensors in
their true layout, so DTensor sums the gradients. :func:`replicate` is what
``parallelize_module(..., replicate_unplanned_params=True)`` applies to every module the plan
leaves out. Function forms: :func:`torch_tp.functional.replicate_parallel`,
:func:`torch_tp.functional.replicate`.

Example::

    >>> ReplicateParallel(input_layouts=Shard(2))
    ReplicateParallel(input_layouts=Shard(dim=2), desired_input_layouts=None, use_local_output=True)
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_tp._layouts import redistribute_to, to_dtensor
from torch_tp.parallel import rules
from torch_tp.parallel.style import ParallelStyle, distribute_parameters, name_plain_tensors_on_error

__all__ = ["ReplicateParallel", "check_replicate_parallel", "replicate"]


def check_replicate_parallel(
    module: nn.Module, device_mesh: DeviceMesh | int, module_path: str | None = None
) -> None:
    """Raise if ``ReplicateParallel`` cannot be applied (N-D mesh, parallelized or prepared before).

    Its rule lives beside the style (upstream has no ``ReplicateParallel``), built from
    :mod:`torch_tp.parallel.rules`' helpers.

    Example::

        >>> check_replicate_parallel(nn.LayerNorm(8), 2, "q_norm")
    """
    rules.require_1d_mesh(device_mesh, "ReplicateParallel")
    rules.require_plain_parameters(module, "ReplicateParallel", module_path)
    rules.require_unprepared(module, rules.BOTH_STAGES, "ReplicateParallel", module_path)


def _replicated_input(value, layout, desired, device_mesh):
    if layout is None or not isinstance(value, torch.Tensor):
        return value
    x = to_dtensor(value, device_mesh, layout)
    return redistribute_to(x, desired) if desired is not None else x


def _replicated_inputs(module, args, kwargs, *, style, device_mesh, module_path):
    layouts, desired = style.input_layouts, style.desired_input_layouts
    if isinstance(layouts, Placement):  # one layout for every tensor input, keywords included
        args = tuple(_replicated_input(a, layouts, desired, device_mesh) for a in args)
        kwargs = {k: _replicated_input(v, layouts, desired, device_mesh) for k, v in kwargs.items()}
        return args, kwargs
    if len(args) < len(layouts):
        raise ValueError(
            f"ReplicateParallel on {rules.describe(module, module_path)} has {len(layouts)} input "
            f"layouts {layouts} but the module got {len(args)} positional values"
        )
    wanted = desired or (None,) * len(layouts)
    converted = tuple(_replicated_input(a, lay, des, device_mesh) for a, lay, des in zip(args, layouts, wanted))
    return converted + tuple(args[len(layouts):]), kwargs


def _twin_value(value, kept: tuple[Placement, ...]):
    """What a replicated module hands on: what its single-process twin would, never a bare partial.

    A ``Partial`` output is reduced (its local piece is not a value of the twin); an output
    sharded like a declared input stays local (per-head norms hand on their local heads);
    any other sharded output is handed on as the DTensor it is, not as a strip.
    """
    if not isinstance(value, DTensor):
        return value
    placement = value.placements[0]
    if placement.is_partial():
        return value.redistribute(placements=(Replicate(),)).to_local()
    if placement.is_replicate() or any(_same_layout(placement, k, value.ndim) for k in kept):
        return value.to_local()
    return value


def _same_layout(a: Placement, b: Placement | None, ndim: int) -> bool:
    if isinstance(a, Shard) and isinstance(b, Shard):
        return a.dim % ndim == b.dim % ndim
    return a == b


def _twin_outputs(module, inputs, output, *, kept):
    if isinstance(output, (tuple, list)):
        return type(output)(_twin_value(o, kept) for o in output)
    return _twin_value(output, kept)


class ReplicateParallel(ParallelStyle):
    """Run a module with replicated parameters on (possibly sharded) inputs, gradients reduced.

    The module's parameters become ``Replicate()`` DTensors (broadcast from
    ``src_data_rank``). Its plain-tensor inputs are read as DTensors in ``input_layouts``,
    so DTensor computes each rank's part and sums the parameters' gradients over the ranks:
    the gradient a single process would get. This is the style for a module that runs
    between a Colwise and a Rowwise layer on local features, such as Qwen3's per-head
    ``q_norm``/``k_norm`` (``input_layouts=Shard(2)``: the local heads of a
    ``(batch, seq, heads, head_dim)`` tensor); left out of the plan, each rank's norm weight
    would only see its own heads' gradient and the ranks would drift apart. Hugging Face
    calls this ``replicated_with_grad_allreduce``. Function form:
    :func:`torch_tp.functional.replicate_parallel`.

    Keyword Args:
        input_layouts (Placement or tuple of Placement/None): layout of the plain-tensor
            inputs: one Placement for every tensor input (positional and keyword), or one
            entry per positional input (``None`` leaves it alone). Default ``Replicate()``.
        desired_input_layouts (Placement or tuple, optional): redistribute the inputs to
            these layouts first. Default ``None``: compute on the inputs as they are.
        use_local_output (bool): hand back local tensors: an output sharded like an input
            stays local (the local heads), a partial sum is reduced first, and any other
            sharded output stays a DTensor rather than becoming a bare strip. Default ``True``.

    Returns:
        A :class:`ParallelStyle` for :func:`torch_tp.parallelize_module`.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> parallelize_module(model, mesh, {"layers.*.self_attn.[qk]_norm":
        ...     ReplicateParallel(input_layouts=Shard(2))})
    """

    input_layouts: Placement | tuple[Placement | None, ...] | None = None
    desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None
    use_local_output: bool = True

    def __post_init__(self):
        name = "ReplicateParallel"
        if self.input_layouts is None or isinstance(self.input_layouts, Placement):
            self.input_layouts = rules.single_layout(self.input_layouts, "input_layouts", name, Replicate())
            self.desired_input_layouts = rules.single_layout(
                self.desired_input_layouts, "desired_input_layouts", name, None
            )
        else:
            self.input_layouts = rules.layout_tuple(self.input_layouts, "input_layouts")
            if self.desired_input_layouts is not None:
                self.input_layouts, self.desired_input_layouts = rules.paired_layouts(
                    self.input_layouts, self.desired_input_layouts, ("input_layouts", "desired_input_layouts")
                )
        self.use_local_output = rules.flag(self.use_local_output, "use_local_output", name)

    def param_placements(self, module):
        return rules.replicated_placements(module)

    def check(self, module, device_mesh, module_path=None):
        check_replicate_parallel(module, device_mesh, module_path)

    def apply_to(self, module, device_mesh, *, src_data_rank=0, module_path=None):
        distribute_parameters(module, rules.replicated_placements(module), device_mesh, src_data_rank)
        _reduce_gradients_in_backward(module.parameters())
        _install_replicated_hooks(module, self, device_mesh, module_path)
        name_plain_tensors_on_error(module, "ReplicateParallel", module_path)
        rules.mark_prepared(module, rules.BOTH_STAGES, "ReplicateParallel")
        return module

    def kept_layouts(self) -> tuple[Placement, ...]:
        """The layouts an output may keep when handed back locally: the inputs' layouts."""
        layouts = self.desired_input_layouts or self.input_layouts
        return (layouts,) if isinstance(layouts, Placement) else tuple(p for p in layouts if p is not None)


def _reduced_gradient(param: torch.Tensor) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)


def _reduce_gradients_in_backward(params) -> None:
    """Reduce each parameter's partial-sum gradient once, when backward has accumulated it.

    Fed sharded activations, a replicated parameter's gradient comes back as a ``Partial``
    DTensor; left so, every optimizer op on it would all-reduce it again (3 times per AdamW
    step). One all-reduce per parameter in the backward instead, as transformers'
    ``replicated_with_grad_allreduce`` does, but on the gradient of this backward only.
    """
    for param in params:
        param.register_post_accumulate_grad_hook(_reduced_gradient)


def _install_replicated_hooks(module, style: ReplicateParallel, device_mesh, module_path) -> None:
    module.register_forward_pre_hook(
        partial(_replicated_inputs, style=style, device_mesh=device_mesh, module_path=module_path), with_kwargs=True
    )
    if style.use_local_output:
        module.register_forward_hook(partial(_twin_outputs, kept=style.kept_layouts()))


def replicate(
    module: nn.Module, device_mesh: DeviceMesh, *, src_data_rank: int | None = 0, module_path: str | None = None
) -> nn.Module:
    """Replicate ``module``'s own parameters as DTensors and run it on replicated inputs.

    This is what ``parallelize_module(..., replicate_unplanned_params=True)`` does to each
    module the plan leaves out, so every parameter of the model is a DTensor and
    ``clip_grad_norm_`` / optimizers see one kind of tensor. It is
    :class:`ReplicateParallel` with ``input_layouts=Replicate()`` restricted to the module's
    own parameters (children are left to their own styles): plain-tensor inputs are taken
    to be identical on every rank, DTensor inputs pass through, and outputs are what the
    module's single-process twin returns (a partial sum is reduced; a sharded DTensor output
    stays a DTensor, never a bare strip). If another style already converts this module's
    inputs/outputs, only the parameters are replicated.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> replicate(model.norm, mesh)
        >>> model.norm.weight.placements
        (Replicate(),)
    """
    rules.require_1d_mesh(device_mesh, "replicate")
    placements = {
        name: Replicate()
        for name, param in module.named_parameters(recurse=False)
        if not isinstance(param, DTensor)
    }
    distribute_parameters(module, placements, device_mesh, src_data_rank)
    _reduce_gradients_in_backward(module.parameters(recurse=False))
    if rules.is_prepared(module):
        return module  # its inputs/outputs are already converted by its style
    module.register_forward_pre_hook(partial(_children_take_dtensors, module_path=module_path))
    _install_replicated_hooks(module, ReplicateParallel(), device_mesh, module_path)
    rules.mark_prepared(module, rules.BOTH_STAGES, "replicate")
    return module


def _children_take_dtensors(module, args, *, module_path):
    """``replicate`` keeps DTensor inputs as DTensors, and replicates only the module's own
    parameters: a descendant still holding plain parameters would meet them in DTensor's words
    ("mixed torch.Tensor and DTensor"). Named here instead, before the forward runs."""
    if next(module.children(), None) is None or torch.compiler.is_compiling():
        return None  # a leaf has no descendants; a traced forward was checked when it ran eagerly
    if not any(isinstance(a, DTensor) for a in args):
        return None
    for name, child in module.named_modules():
        plain = [n for n, p in child.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if child is not module and plain:
            where = f"{module_path}.{name}" if module_path else name
            raise ValueError(
                f"torch_tp.parallel.replicate on {rules.describe(module, module_path)}: it got a DTensor input, "
                f"which it passes on as a DTensor, but {where!r} still holds plain parameters ({plain[0]!r}): "
                f"replicate only covers a module's own parameters. Replicate each descendant too "
                f"(parallelize_module(..., replicate_unplanned_params=True) does), or give {where!r} a style"
            )
    return None
