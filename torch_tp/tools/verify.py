"""``verify_plan``: train a parallelized model beside its single-process twin and report every difference.

A plan can be accepted by every check and still compute something else: a tie broken by a
new ``Parameter``, a per-head norm whose gradient only sees this rank's heads, a module that
hands on the bare local piece of a partial sum, a forward swapped for its base class's.
:func:`verify_plan` finds these the only sure way: it builds the model twice on every rank
(once whole, once parallelized), runs a few training steps on both with the same inputs, and
compares outputs, gradients and updated parameters, parameter by parameter. It also flags
ties the parallel model broke, replicated parameters whose gradients differ between ranks,
and plain parameters whose module ran on DTensor inputs. The report is the same on every rank.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping, MutableMapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel.style import ParallelStyle as UpstreamParallelStyle

from torch_tp.parallel import rules
from torch_tp.tools._verify_report import (
    BUFFER,
    EVAL,
    GRADIENT,
    INITIAL,
    INPUTS,  # noqa: F401  (re-exported with the other finding kinds)
    NAMES,
    OUTPUT,
    PLAIN,
    RANK_GRADIENT,
    TIE,
    UPDATED,
    Finding,
    VerificationReport,
    display_order,
    input_findings,
    merged,
)
from torch_tp.parallel.api import parallelize_module

__all__ = ["MAX_STEPS", "Finding", "VerificationReport", "verify_plan"]

#: The most steps ``verify_plan(steps=None)`` runs while steps still move new parameters.
MAX_STEPS = 8

def verify_plan(
    build_model: Callable[[], nn.Module],
    mesh: DeviceMesh,
    plan: Any,
    example_inputs: tuple | Callable[[int], tuple],
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    steps: int | None = None,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.SGD,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    raise_on_mismatch: bool = True,
    replicate_unplanned_params: bool = False,
    shard_inputs: Callable[[tuple], tuple] | None = None,
    gather_outputs: Callable[[Any], Any] | None = None,
    seed: int = 0,
) -> VerificationReport:
    """Check that a parallelization trains exactly like the single-process model; call on every rank.

    On every rank, ``build_model()`` is called twice under ``torch.manual_seed(seed)``: once
    for the reference, once for the copy that ``plan`` parallelizes. Both then run ``steps``
    training steps on the same inputs (forward, ``loss_fn``, backward, ``optimizer`` step),
    and after each step verify_plan compares every output, every parameter gradient, every
    updated parameter and every buffer (running statistics), paired by name, DTensors as full
    tensors; then both models run one forward in eval mode on the next inputs, compared too.
    It also reports ties broken (parameters that are one object in the reference but not in
    the parallel model), replicated parameters (plain or ``Replicate()``) whose gradients
    differ between ranks, and plain parameters whose module ran on DTensor inputs. Findings
    are gathered over the mesh, so every rank returns (or raises) the same report.

    Args:
        build_model: builds the single-process model; it must build the same model each time
            it is called under the same torch seed (verify_plan seeds before each call).
        mesh (DeviceMesh): a 1-D mesh over the ranks that run the parallel model.
        plan: a plan for :func:`torch_tp.parallelize_module` (a dict or a style), or any
            callable ``plan(model, mesh) -> model`` that parallelizes ``model`` (upstream's
            ``parallelize_module`` with its plan, or your own code).
        example_inputs: a tuple of positional arguments, or ``example_inputs(step) -> tuple``.
            Every rank must get the same values: verify_plan calls it under
            ``torch.manual_seed(seed + 1 + step)``.

    Keyword Args:
        loss_fn: ``loss_fn(output) -> scalar``. Default: the sum of every floating tensor in
            the output (a tensor, tuple, list, dict or ``ModelOutput``).
        steps (int, optional): training steps. Default ``None``: until a step moves no
            parameter that the steps before it had not moved, at least 2 and at most
            ``MAX_STEPS``. So every parameter a step changed (a zero-initialized output
            projection after its first update) has run in a forward and a backward with its new
            value before verify_plan stops: an error that only shows once a parameter moved
            is found. A chain of ``d`` layers initialized to zero needs ``d + 1`` steps.
        optimizer: ``optimizer(parameters) -> Optimizer``, called for each model. Default
            ``torch.optim.SGD`` (lr 1e-3); e.g. ``functools.partial(torch.optim.AdamW, lr=1e-2)``.
        atol, rtol (float): a tensor agrees when every element is within
            ``atol + rtol * max|single-process tensor|`` (summation-order noise scales with
            the tensor). The defaults suit float32; try ``2e-2`` for bfloat16.
        raise_on_mismatch (bool): raise ``AssertionError`` with the report if anything was
            found. Default ``True``.
        replicate_unplanned_params (bool): passed to :func:`torch_tp.parallelize_module`
            (only with a dict or style plan).
        shard_inputs: ``shard_inputs(args) -> args`` for the parallel model only, for models
            that take this rank's piece of the input (a sequence or spatial shard).
        gather_outputs: ``gather_outputs(output) -> output`` turns the parallel model's local
            pieces back into whole tensors before comparison and loss (DTensor outputs are
            made whole without it). It must be differentiable, e.g.
            ``DTensor.from_local(out, mesh, [Shard(1)]).full_tensor()``.
        seed (int): the seed of both builds and of the inputs. Default 0.

    Returns:
        A :class:`VerificationReport` (``report.ok``; ``print(report)`` for the table).

    Raises:
        AssertionError: something differs and ``raise_on_mismatch`` is true; the message is
            the report, with what each kind of finding usually means and how to fix it.

    .. note::
        The reference is a full copy of the model on every rank, and every parameter and
        gradient is gathered whole: run it on a small config of the real model (few
        layers, small widths) before a long run, not on the model you train. The models
        run in the mode ``build_model`` leaves them in; dropout should be off, as the two
        models cannot draw the same masks on sharded activations.

    Example::

        >>> # xdoctest: +SKIP("needs an initialized process group")
        >>> from torch_tp import verify_plan
        >>> from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
        >>> args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=48)
        >>> report = verify_plan(lambda: Transformer(args), mesh, tensor_parallel_plan(),
        ...                      (torch.randint(0, 64, (2, 8)),), steps=2)
        >>> report.ok
        True
    """
    _require_arguments(mesh, plan, steps, replicate_unplanned_params)
    found = _RankFindings(rank=mesh.get_local_rank(), atol=atol, rtol=rtol)
    with torch.random.fork_rng(devices=_cuda_devices_in_use()):  # the caller's RNG state comes back
        reference = _built(build_model, seed)
        parallel = _parallelized(_built(build_model, seed), mesh, plan, replicate_unplanned_params)
        run = _TrainingPair(reference, parallel, mesh, optimizer, loss_fn, shard_inputs, gather_outputs, found)
        run.compare_structure()
        ran = run.train(example_inputs, steps, seed)
        run.evaluate(ran, _inputs_of_step(example_inputs, ran, seed), seed)
    report = _agreed_report(found, mesh, ran, atol, rtol, notes=_notes(reference))
    if raise_on_mismatch and not report.ok:
        raise AssertionError(str(report))
    return report


# ------------------------------------------------------------------------- set-up


def _require_arguments(mesh: object, plan: object, steps: object, replicate_unplanned_params: object) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"verify_plan needs a DeviceMesh (e.g. init_device_mesh('cpu', (2,))), got {type(mesh).__name__}")
    rules.require_1d_mesh(mesh, "verify_plan")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ValueError(f"verify_plan: steps must be a positive int or None (until no new parameter moves), got {steps!r}")
    if _is_style_plan(plan):
        return
    if not callable(plan):
        raise TypeError(
            f"verify_plan: plan must be a torch_tp plan (a dict of styles or one style) or a callable "
            f"plan(model, mesh) -> model, got {type(plan).__name__}"
        )
    if replicate_unplanned_params:
        raise ValueError(
            "verify_plan: replicate_unplanned_params=True applies to a dict or style plan; a callable "
            "plan parallelizes the model itself, so replicate inside it"
        )


def _cuda_devices_in_use() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_initialized() else []


def _is_style_plan(plan: object) -> bool:
    return isinstance(plan, (dict, UpstreamParallelStyle))


def _built(build_model: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = build_model()
    if not isinstance(model, nn.Module):
        raise TypeError(f"verify_plan: build_model() must return an nn.Module, got {type(model).__name__}")
    return model


def _parallelized(model: nn.Module, mesh: DeviceMesh, plan: Any, replicate_unplanned_params: bool) -> nn.Module:
    if _is_style_plan(plan):
        return parallelize_module(model, mesh, plan, replicate_unplanned_params=replicate_unplanned_params)
    result = plan(model, mesh)
    return model if result is None else result


def _inputs_of_step(example_inputs: Any, step: int, seed: int) -> tuple:
    torch.manual_seed(seed + 1 + step)
    args = example_inputs(step) if callable(example_inputs) else example_inputs
    return args if isinstance(args, tuple) else (args,)


# ------------------------------------------------------------------ output trees


def _named_tensors(value: Any, path: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a (nested) tuple, list, dict or ``ModelOutput``, with its place."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, Mapping):
        return [pair for key, item in value.items() for pair in _named_tensors(item, f"{path}[{key!r}]")]
    if isinstance(value, (tuple, list)):
        return [pair for i, item in enumerate(value) for pair in _named_tensors(item, f"{path}[{i}]")]
    return []


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor; containers keep their type."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, MutableMapping):
        mapped = copy.copy(value)  # a ModelOutput stays a ModelOutput (its __setitem__ sets the attribute too)
        for key, item in value.items():
            mapped[key] = _map_tensors(item, fn)
        return mapped
    if isinstance(value, Mapping):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_map_tensors(item, fn) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor as its full tensor (a collective, differentiable), anything else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _sum_of_floating_tensors(output: Any) -> torch.Tensor:
    floats = [t for _, t in _named_tensors(output) if t.is_floating_point()]
    if not floats:
        raise ValueError(
            f"verify_plan: the model's output ({type(output).__name__}) holds no floating tensor to "
            f"sum into a loss; pass loss_fn=..."
        )
    return sum(t.sum() for t in floats)


# -------------------------------------------------------------------- comparing


def _difference(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> tuple[float | None, str | None]:
    """(largest absolute difference, what is wrong, or ``None`` when the tensors agree).

    Floating tensors agree when every element is within ``atol + rtol * max|expected|``: the
    noise of a different summation order scales with the tensor's values, not with each
    element's, so an element near zero in a large gradient is held to the tensor's scale.
    Other dtypes must be equal. NaN agrees with NaN.
    """
    if actual.shape != expected.shape:
        return None, f"shape {tuple(actual.shape)}, single process {tuple(expected.shape)}"
    actual, expected = _plain_values(actual), _plain_values(expected)
    actual = actual.to(device=expected.device, dtype=expected.dtype)
    if actual.numel() == 0:
        return 0.0, None
    if not expected.is_floating_point():
        equal = torch.equal(actual, expected)
        return (actual.double() - expected.double()).abs().max().item(), None if equal else "not equal"
    both_nan = actual.isnan() & expected.isnan()
    error = torch.where(both_nan, 0.0, (actual.double() - expected.double()).abs()).max().item()
    scale = expected.double().abs().nan_to_num(nan=0.0).max().item()
    if error <= atol + rtol * scale:  # False for NaN
        return error, None
    return error, f"largest |single-process value| {scale:.2e}"


def _plain_values(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``tensor``'s values: quantized weights (torchao subclasses) dequantized."""
    tensor = tensor.detach()
    if type(tensor).dequantize is not torch.Tensor.dequantize:  # a weight subclass's own
        return tensor.dequantize()
    return tensor


class _RankFindings:
    """This rank's findings and the largest difference it measured."""

    def __init__(self, rank: int, atol: float, rtol: float):
        self.rank, self.atol, self.rtol = rank, atol, rtol
        self.findings: dict[tuple, Finding] = {}
        self.compared = 0
        self.worst: tuple[float, str] = (0.0, "")
        self.input_digests: list[str] = []

    def add(self, kind: str, name: str, step: int | None, detail: str, error: float | None = None) -> None:
        self.findings.setdefault((kind, name, step), Finding(kind, name, step, error, detail, (self.rank,)))

    def compare(self, kind: str, name: str, step: int | None, actual: torch.Tensor, expected: torch.Tensor) -> None:
        self.compared += 1
        error, problem = _difference(actual, expected, self.atol, self.rtol)
        if error is not None and error > self.worst[0]:
            self.worst = (error, f"{name} ({kind})")
        if problem is not None:
            self.add(kind, name, step, problem, error)


# --------------------------------------------------------------------- training


class _TrainingPair:
    """The reference and the parallel model, trained side by side on this rank."""

    def __init__(self, reference, parallel, mesh, optimizer, loss_fn, shard_inputs, gather_outputs, found: _RankFindings):
        self.reference, self.parallel, self.mesh, self.found = reference, parallel, mesh, found
        self.loss_fn = loss_fn or _sum_of_floating_tensors
        self.shard_inputs, self.gather_outputs = shard_inputs, gather_outputs
        self.optimizers = (optimizer(reference.parameters()), optimizer(parallel.parameters()))
        self.reference_params = dict(reference.named_parameters(remove_duplicate=False))
        self.parallel_params = dict(parallel.named_parameters(remove_duplicate=False))

    def compare_structure(self) -> None:
        for name, detail in _broken_ties(self.reference_params, self.parallel_params):
            self.found.add(TIE, name, None, detail)
        for name in _only_in(self.reference_params, self.parallel_params):
            self.found.add(NAMES, name, None, "in the single-process model only")
        for name in _only_in(self.parallel_params, self.reference_params):
            self.found.add(NAMES, name, None, "in the parallel model only")
        self.compare_parameters(INITIAL, None)

    def train(self, example_inputs: Any, steps: int | None, seed: int) -> int:
        """Run ``steps`` training steps, or (``None``) until a step moves no parameter the steps
        before it had not moved (at least 2, at most ``MAX_STEPS``). Returns the steps run.

        Decided on the single-process model, the same on every rank."""
        initial = {name: _plain_values(p).clone() for name, p in self.reference_params.items()}
        moved: set[str] = set()
        step = 0
        while True:
            self.step(step, _inputs_of_step(example_inputs, step, seed), seed)
            step += 1
            now = {name for name, p in self.reference_params.items() if not torch.equal(_plain_values(p), initial[name])}
            newly, moved = now - moved, moved | now
            if step == steps or (steps is None and ((step >= 2 and not newly) or step == MAX_STEPS)):
                return step

    @torch.no_grad()
    def evaluate(self, step: int, args: tuple, seed: int) -> None:
        """One forward of both models in eval mode (their modes restored after), compared."""
        modes = [(m, m.training) for model in (self.reference, self.parallel) for m in model.modules()]
        try:
            self.reference.eval(), self.parallel.eval()
            torch.manual_seed(seed + 1 + step)
            reference_out = self.reference(*args)
            torch.manual_seed(seed + 1 + step)
            parallel_out = self.parallel_forward(args)
            for name, actual, expected in self.paired_outputs(parallel_out, reference_out):
                self.found.compare(EVAL, name, step, actual, expected)
        finally:
            for module, training in modes:
                module.training = training

    def step(self, step: int, args: tuple, seed: int) -> None:
        """One training step of both models, comparing outputs, gradients and updated parameters."""
        self.found.input_digests.append(_digest(args))
        torch.manual_seed(seed + 1 + step)  # unsharded random ops (dropout) draw alike in both
        reference_out = self.reference(*args)
        torch.manual_seed(seed + 1 + step)
        parallel_out = self.parallel_forward(args)
        for name, actual, expected in self.paired_outputs(parallel_out, reference_out):
            self.found.compare(OUTPUT, name, step, actual, expected)
        reference_loss, parallel_loss = self.loss_fn(reference_out), _whole(self.loss_fn(parallel_out))
        self.found.compare(OUTPUT, "loss", step, parallel_loss, reference_loss)
        for loss in (reference_loss, parallel_loss):
            if loss.requires_grad:
                loss.backward()
        whole_grads = self.compare_gradients(step)
        self.check_gradients_agree_across_ranks(whole_grads, step)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.compare_parameters(UPDATED, step)

    def parallel_forward(self, args: tuple) -> Any:
        if self.shard_inputs is not None:
            args = self.shard_inputs(args)
            args = args if isinstance(args, tuple) else (args,)
        with _modules_on_dtensor_inputs(self.parallel) as ran_on_dtensors:
            output = self.parallel(*args)
        for name, detail in _plain_parameters_of(ran_on_dtensors):
            self.found.add(PLAIN, name, None, detail)
        if self.gather_outputs is not None:
            output = self.gather_outputs(output)
        return _map_tensors(output, _whole)

    def paired_outputs(self, parallel_out: Any, reference_out: Any) -> list:
        actual, expected = dict(_named_tensors(parallel_out)), dict(_named_tensors(reference_out))
        for name in _only_in(expected, actual):
            self.found.add(OUTPUT, name, None, "missing from the parallel model's output")
        for name in _only_in(actual, expected):
            self.found.add(OUTPUT, name, None, "not in the single-process model's output")
        return [(name, actual[name], expected[name]) for name in expected if name in actual]

    @torch.no_grad()
    def compare_gradients(self, step: int) -> dict[str, torch.Tensor]:
        """Compare every gradient by name; return the parallel ones as whole tensors."""
        whole_grads = {name: _whole(p.grad) for name, p in self.parallel_params.items() if p.grad is not None}
        for name, param in self.parallel_params.items():
            if isinstance(param.grad, DTensor) and not isinstance(param, DTensor):
                detail = f"its gradient is a {param.grad.placements} DTensor, which the optimizer step fails on"
                self.found.add(PLAIN, name, None, detail)
                param.grad = whole_grads[name]  # so that the check can go on
        for name, expected in self.reference_params.items():
            actual = whole_grads.get(name)
            if name not in self.parallel_params or (actual is None and expected.grad is None):
                continue
            if actual is None or expected.grad is None:
                side = "parallel" if actual is None else "single-process"
                self.found.add(GRADIENT, name, step, f"no gradient in the {side} model")
            else:
                self.found.compare(GRADIENT, name, step, actual, expected.grad)
        return whole_grads

    def check_gradients_agree_across_ranks(self, whole_grads: dict[str, torch.Tensor], step: int) -> None:
        names = [name for name, param in self.parallel.named_parameters() if _replicated(param) and name in whole_grads]
        for name, spread in _spread_across_ranks([whole_grads[n] for n in names], names, self.mesh):
            kind = "a Replicate() DTensor" if isinstance(self.parallel_params[name], DTensor) else "a plain"
            self.found.add(RANK_GRADIENT, name, step, f"{kind} parameter; its gradient differs between ranks", spread)

    @torch.no_grad()
    def compare_parameters(self, kind: str, step: int | None) -> None:
        for name, expected in self.reference_params.items():
            if name in self.parallel_params:
                self.found.compare(kind, name, step, _whole(self.parallel_params[name]), expected)
        self.compare_buffers(step)

    @torch.no_grad()
    def compare_buffers(self, step: int | None) -> None:
        parallel_buffers = dict(self.parallel.named_buffers(remove_duplicate=False))
        for name, expected in self.reference.named_buffers(remove_duplicate=False):
            actual = parallel_buffers.get(name)
            if actual is None:
                self.found.add(BUFFER, name, None, "in the single-process model only")
            else:
                self.found.compare(BUFFER, name, step, _whole(actual), expected)


# ------------------------------------------------------------ structural findings


def _only_in(names: dict, other: dict) -> list[str]:
    return [name for name in names if name not in other]


def _broken_ties(reference_params: dict[str, nn.Parameter], parallel_params: dict[str, nn.Parameter]):
    """(name, detail) for each name that shares a parameter in the reference but not in the parallel model."""
    first_name_of: dict[int, str] = {}
    for name, param in reference_params.items():
        owner = first_name_of.setdefault(id(param), name)
        if owner == name or name not in parallel_params or owner not in parallel_params:
            continue
        if parallel_params[name] is not parallel_params[owner]:
            yield name, f"is {owner} in the single-process model; a separate parameter in the parallel model"


@contextmanager
def _modules_on_dtensor_inputs(model: nn.Module):
    """Record, while the block runs, which modules of ``model`` got a DTensor argument."""
    seen: dict[str, nn.Module] = {}

    def record(path, module, args, kwargs):
        if any(isinstance(t, DTensor) for _, t in _named_tensors((args, kwargs))):
            seen.setdefault(path, module)

    handles = [
        module.register_forward_pre_hook(partial(record, path), with_kwargs=True)
        for path, module in model.named_modules()
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _plain_parameters_of(modules_by_path: dict[str, nn.Module]):
    """(name, detail) for each plain parameter owned by a module that ran on DTensor inputs."""
    for path, module in modules_by_path.items():
        for name, param in module.named_parameters(recurse=False):
            if not isinstance(param, DTensor):
                where = f"module {rules.describe(module, path)}" if path else f"the root module ({type(module).__name__})"
                yield f"{path}.{name}" if path else name, f"{where} ran on DTensor inputs; this parameter is a plain tensor"


def _replicated(param: torch.Tensor) -> bool:
    """A parameter every rank holds whole: a plain one, or a DTensor replicated on every mesh dim."""
    return not isinstance(param, DTensor) or all(p.is_replicate() for p in param.placements)


def _spread_across_ranks(tensors: list[torch.Tensor], names: list[str], mesh: DeviceMesh) -> list[tuple[str, float]]:
    """(name, largest difference between ranks) for each tensor that is not identical on every rank.

    One all-gather of all ``tensors`` flattened together; every rank gets the same answer.
    """
    if mesh.size() == 1 or not tensors:
        return []
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    gathered = flat.new_empty(mesh.size() * flat.numel())
    dist.all_gather_single(gathered, flat, group=mesh.get_group())
    per_rank = gathered.view(mesh.size(), -1)
    spread = per_rank.max(dim=0).values - per_rank.min(dim=0).values
    found, offset = [], 0
    for name, tensor in zip(names, tensors):
        piece = spread[offset : offset + tensor.numel()]
        offset += tensor.numel()
        if piece.numel() and piece.max().item() > 0:
            found.append((name, piece.max().item()))
    return found


def _digest(args: tuple) -> str:
    """A fingerprint of the tensors in ``args``, to see whether every rank got the same inputs."""
    digest = hashlib.sha256()
    for name, tensor in _named_tensors(args, "args"):
        if isinstance(tensor, DTensor):
            continue
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- the one report


def _notes(reference: nn.Module) -> tuple[str, ...]:
    """What a report with findings should add about the model itself (the same on every rank)."""
    w8a8 = [name for name, p in reference.named_parameters() if getattr(p, "activations", None) == "int8"]
    if not w8a8:
        return ()
    return (f"the model holds W8A8 weights ({w8a8[0]}{' and more' if len(w8a8) > 1 else ''}): a RowwiseParallel "
            f"W8A8 layer quantizes each rank's slice of the features with its own per-token scale, so it is "
            f"not bit-equal to one process (docs/quantization.md, W8A8). A right plan differs within the "
            f"activation rounding: pass atol/rtol of about 1e-2, or compare the weight-only model",)


def _agreed_report(found: _RankFindings, mesh: DeviceMesh, steps: int, atol: float, rtol: float,
                   notes: tuple[str, ...] = ()) -> VerificationReport:
    """Gather every rank's findings (one object all-gather) and merge them into one report."""
    payload = (list(found.findings.values()), found.compared, found.worst, found.input_digests)
    gathered: list = [payload]
    if mesh.size() > 1:
        gathered = [None] * mesh.size()
        dist.all_gather_object(gathered, payload, group=mesh.get_group())
    findings = merged([f for rank_findings, *_ in gathered for f in rank_findings])
    findings += input_findings([digests for *_, digests in gathered])
    worst_error, worst_name = max((worst for _, _, worst, _ in gathered), key=lambda w: w[0])
    return VerificationReport(
        findings=tuple(sorted(findings, key=display_order)),
        steps=steps,
        world_size=mesh.size(),
        compared=max(compared for _, compared, _, _ in gathered),
        worst_error=worst_error,
        worst_name=worst_name,
        atol=atol,
        rtol=rtol,
        notes=notes,
    )
