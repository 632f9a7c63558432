"""Decode-sized linear timings of the int8 modes, and what inductor does with the int8 weight.

:func:`decode_linear_timings` times one ``F.linear`` per shape and mode on a device (CPU or
CUDA) and, for each compiled mode, reads inductor's generated code
(:func:`torch._inductor.utils.run_and_get_code`) to tell whether the int8 weight is read
directly by the kernel that multiplies (:func:`weight_reads`): the question behind issue 26,
whether a weight-only int8 layer makes a float copy of its weight on every call. It runs on
CPU with tiny shapes (``tests/quant/test_w8a8.py``), so it is verified before a GPU runs it.

The modes (:data:`MODES`):

| mode | what runs |
| --- | --- |
| ``float`` | ``F.linear`` with the float weight, in ``dtype`` (the baseline: bf16 for ``dtype=torch.bfloat16``) |
| ``int8-weight-only-eager`` / ``-compiled`` | an ``Int8SymmetricTensor`` weight, ``activations="float"``; compiled: ``torch.compile(fullgraph=True)`` with inductor |
| ``int8-weight-only-compiled-cdt`` | compiled with ``coordinate_descent_tuning``: on CUDA an ``M = 1`` product becomes a fused multiply-reduce over the int8 weight |
| ``int8-weight-only-autotune`` | compiled with ``mode="max-autotune-no-cudagraphs"``: Triton matmul templates, the int8 conversion fused as a prologue (only when named: autotuning takes minutes) |
| ``w8a8-eager`` / ``-compiled`` | the same weight with ``activations="int8"`` (``torch._int_mm``, padded on CUDA) |

Each record also holds the output's relative error against the ``float`` mode (norm of the
difference over the norm), so a GPU run checks the numbers as well as the time.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F

from torch_tp.quant.int8_tensor import Int8SymmetricTensor

__all__ = ["DEFAULT_MODES", "DEFAULT_SHAPES", "MODES", "relative_error", "decode_linear_timings", "weight_reads"]

#: The modes :func:`decode_linear_timings` knows (see the module docstring).
MODES = ("float", "int8-weight-only-eager", "int8-weight-only-compiled", "int8-weight-only-compiled-cdt",
         "int8-weight-only-autotune", "w8a8-eager", "w8a8-compiled")
#: The modes it times when none are named: all but the autotuned one (minutes of autotuning on a GPU).
DEFAULT_MODES = tuple(mode for mode in MODES if mode != "int8-weight-only-autotune")
# torch.compile's arguments per compiled mode: "-cdt" turns on coordinate descent tuning, under
# which inductor decomposes an M = 1 (or N = 1) mm into a fused multiply-reduce that can read the
# int8 weight and convert it in registers (torch/_inductor/decomposition.py, `mm`; CUDA only);
# "-autotune" lets inductor choose Triton matmul templates, into which it can fuse the int8 -> float
# conversion as a prologue.
_COMPILE_ARGS = {
    "int8-weight-only-compiled": {}, "w8a8-compiled": {},
    "int8-weight-only-compiled-cdt": {"options": {"coordinate_descent_tuning": True}},
    "int8-weight-only-autotune": {"mode": "max-autotune-no-cudagraphs"},
}
#: ``(M tokens, K in_features, N out_features)``: decode steps of 1-16 tokens through 4096- and 8192-wide layers.
DEFAULT_SHAPES = ((1, 4096, 4096), (4, 4096, 4096), (16, 4096, 4096),
                  (1, 8192, 8192), (4, 8192, 8192), (16, 8192, 8192), (1, 4096, 14336))

_INPUT = re.compile(r"(\w+) = rand_strided\(\(([\d, ]*)\), \([\d, ]*\), device='[\w:]+', dtype=torch\.(\w+)\)")
_ALLOCATION = re.compile(r"empty_strided_\w+\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)")
_CALL = re.compile(r"^\s*(?:\w+ = )?([A-Za-z_][\w.]*)\((.*)\)\s*$")
_NOT_KERNELS = {"assert_size_stride", "assert_alignment", "empty_strided_cpu", "empty_strided_cuda",
                "reinterpret_tensor", "print", "len"}
_FLOAT_DTYPES = {"float32", "float", "bfloat16", "float16", "half", "float64"}


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.replace(" ", "").split(",") if part)


def weight_reads(code: str, weight_shape: Sequence[int]) -> dict[str, Any]:
    """What inductor's generated ``code`` (a wrapper module's source) does with an int8 graph
    input of ``weight_shape``: ``{"int8_weight": [its names], "read_by": [the kernels and extern
    calls it is passed to], "float_weight_copy": whether a float buffer of the weight's size is
    allocated, "reads_int8_directly": read by some kernel and no float copy made}``.

    The inputs are found in the wrapper's ``get_args`` (name, shape and dtype of each), the
    allocations in its ``empty_strided_*`` calls. A float buffer with the weight's number of
    elements is a float copy of the weight (the caller picks shapes where no activation or
    output has that size, as decode shapes are: ``M`` is far below ``K`` and ``N``).

    Example::

        >>> code = '''
        ...     buf0 = extern_kernels._int_mm(buf1, reinterpret_tensor(arg0_1, (16, 24), (1, 16), 0), out=buf2)
        ...     arg0_1 = rand_strided((24, 16), (16, 1), device='cpu', dtype=torch.int8)
        ... '''
        >>> weight_reads(code, (24, 16))["read_by"], weight_reads(code, (24, 16))["reads_int8_directly"]
        (['extern_kernels._int_mm'], True)
    """
    shape = tuple(weight_shape)
    names = [name for name, sizes, dtype in _INPUT.findall(code) if dtype == "int8" and _sizes(sizes) == shape]
    numel = _numel(shape)
    read_by: list[str] = []
    for line in code.splitlines():
        call = _CALL.match(line)
        if call is None or call.group(1) in _NOT_KERNELS or "rand_strided" in line:
            continue
        if any(re.search(rf"\b{re.escape(name)}\b", call.group(2)) for name in names):
            read_by.append(call.group(1).removesuffix(".run"))
    copies = [sizes for sizes, dtype in _ALLOCATION.findall(code)
              if dtype in _FLOAT_DTYPES and _numel(_sizes(sizes)) == numel]
    return {"int8_weight": names, "read_by": read_by, "float_weight_copy": bool(copies),
            "reads_int8_directly": bool(names and read_by) and not copies}


def _numel(sizes: Iterable[int]) -> int:
    n = 1
    for size in sizes:
        n *= size
    return n


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def _compiled(weight: Int8SymmetricTensor, x: torch.Tensor, mode: str = "w8a8-compiled") -> tuple[Any, dict[str, Any]]:
    """``torch.compile(F.linear)`` for this weight and input (a fresh compile, with ``mode``'s
    arguments), and :func:`weight_reads`."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()  # a fresh compile per case: no recompile limit, no code of another case
    fn = torch.compile(_linear, fullgraph=True, dynamic=False, **_COMPILE_ARGS[mode])
    _, codes = run_and_get_code(fn, x, weight)
    return fn, weight_reads("\n".join(codes), weight.shape)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms, in float32): how far a result is from its reference.

    Example::

        >>> relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0]))
        0.0
    """
    want32 = want.float()
    return ((got.float() - want32).norm() / want32.norm().clamp_min(1e-30)).item()


def _check_modes(modes: Sequence[str]) -> None:
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise ValueError(f"torch_tp.quant.bench.decode_linear_timings: unknown modes {unknown}; the modes are {MODES}")


def decode_linear_timings(
    device: str | torch.device,
    dtype: torch.dtype = torch.bfloat16,
    shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES,
    modes: Sequence[str] = DEFAULT_MODES,
    *,
    min_run_time: float = 0.2,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Time ``F.linear`` of ``(M, K)`` inputs and ``(N, K)`` weights per shape and mode.

    Keyword Args:
        min_run_time: seconds each measurement runs at least
            (``torch.utils.benchmark.Timer.blocked_autorange``, which synchronizes CUDA).
        seed: the weights' and inputs' seed.

    Returns:
        One record per shape and mode: ``{"shape": (M, K, N), "mode", "dtype", "device",
        "seconds"`` (the median time of one call), ``"relative_error"`` (against the ``float``
        mode's output), ``"weight_reads"`` (compiled modes: :func:`weight_reads` of inductor's
        code; ``None`` for eager ones)``}``. Runs under ``torch.no_grad()``; each compiled
        case is a fresh ``torch.compile(fullgraph=True, dynamic=False)`` after
        ``torch._dynamo.reset()`` (so a graph break raises, and no recompile limit is hit).

    Example::

        >>> records = decode_linear_timings("cpu", torch.float32, [(2, 16, 24)],
        ...                                 ("float", "w8a8-eager"), min_run_time=0.001)
        >>> [(r["mode"], r["seconds"] > 0, r["relative_error"] < 0.05) for r in records]
        [('float', True, True), ('w8a8-eager', True, True)]
    """
    from torch.utils.benchmark import Timer

    _check_modes(modes)
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    records = []
    with torch.no_grad():
        for m, k, n in shapes:
            weight = (torch.randn(n, k, generator=generator) / k**0.5).to(device=device, dtype=dtype)
            x = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
            reference = _linear(x, weight)
            for mode in modes:
                w: torch.Tensor = weight
                if mode != "float":
                    w = Int8SymmetricTensor.from_hp(weight, activations="int8" if mode.startswith("w8a8") else "float")
                fn, reads = (_compiled(w, x, mode) if mode in _COMPILE_ARGS else (_linear, None))
                out = fn(x, w)
                timer = Timer(stmt="fn(x, w)", globals={"fn": fn, "x": x, "w": w})
                seconds = timer.blocked_autorange(min_run_time=min_run_time).median
                records.append({"shape": (m, k, n), "mode": mode, "dtype": dtype, "device": str(device),
                                "seconds": seconds, "relative_error": relative_error(out, reference),
                                "weight_reads": reads})
    return records
