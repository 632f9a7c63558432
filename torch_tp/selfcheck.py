"""``python -m torch_tp.selfcheck --device cuda``: what one GPU can check of torch_tp, in one prepared run.

Four checks, each timed, each one table, then a summary (and ``--out DIR/selfcheck.json``):

| check | what it runs | passes when |
| --- | --- | --- |
| ``decode`` | :func:`torch_tp.quant.bench.decode_linear_timings`: ``F.linear`` at decode shapes, bf16 vs the int8 modes | every int8 output within 3% of bf16's; the table says which compiled code reads the int8 weight and the speedups |
| ``llama`` | the zoo Llama with its TP + SP plan on a 1-rank mesh (NCCL on CUDA), float and int8 weights: eager vs inductor | compiled loss and gradients = eager's, one graph and no break; step ms and peak memory listed |
| ``fake8`` | :func:`torch_tp.testing.fake_world_memory`: rank 0 and rank 7 of an 8-rank world on PyTorch's fake process group, float and int8, traced (``aot_eager``) | held parameter bytes = ``predict_placements``'s, no graph break |
| ``tests`` | the test suite with ``TORCH_TP_TEST_DEVICE=<device>`` (``pytest tests -q -rs -m "not slow"``, from a checkout), in the time left of ``--budget`` | pytest exits 0; its counts, the skip reasons and the failed tests are listed, the log written to ``--out`` |

The checks never depend on each other: a check that raises is a failed row naming the error,
and the others still run. ``--device cpu`` runs the same code on CPU (the test suite's smoke
test runs ``--device cpu --quick --only decode,llama,fake8``), so a GPU session spends its
minutes on one command that has already run.

Example::

    >>> # xdoctest: +SKIP("runs the checks")
    >>> from torch_tp.selfcheck import main
    >>> main(["--device", "cpu", "--quick", "--only", "fake8"])
    0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from torch_tp._layouts import inner_tensors
from torch_tp.testing import ROOT  # the checkout holding tests/, in a clone

__all__ = ["CHECKS", "CheckResult", "main", "run_checks"]


@dataclass
class CheckResult:
    """One check's outcome: ``ok``, a one-line ``summary``, its ``rows`` (a table) and ``seconds``.

    Example::

        >>> CheckResult("decode", True, "3 shapes").ok
        True
    """

    name: str
    ok: bool
    summary: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Run:
    """What every check is given: the device, tiny sizes or not, where files go, when time is up."""

    device: str
    quick: bool
    out: pathlib.Path | None
    deadline: float  # time.monotonic() by which the whole self-check should end

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


# ---------------------------------------------------------------- tests


def _check_tests(run: _Run) -> CheckResult:
    if not (ROOT / "tests").is_dir():
        return CheckResult("tests", False, f"no tests/ beside {ROOT / 'torch_tp'}: run it from a checkout")
    where = ["tests/testing"] if run.quick else ["tests"]
    command = [sys.executable, "-m", "pytest", *where, "-q", "-rs", "-p", "no:cacheprovider", "-m", "not slow"]
    env = {**os.environ, "TORCH_TP_TEST_DEVICE": run.device,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    allowed = max(30.0, run.seconds_left())
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        out, timed_out = process.communicate(timeout=allowed)[0], False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        out, timed_out = process.communicate()[0], True
    if run.out is not None:
        (run.out / "tests.log").write_text(out)
    rows = _test_outcomes(out, timed_out)
    lines = out.strip().splitlines()
    summary = (f"stopped after {allowed:.0f} s (the self-check's time): {_progress(out)}" if timed_out else
               lines[-1] if lines else f"pytest printed nothing (exit {process.returncode})")
    return CheckResult("tests", not timed_out and process.returncode == 0, summary, rows)


def _test_outcomes(out: str, timed_out: bool) -> list[dict[str, Any]]:
    """Rows of counts: passed/failed/skipped (from pytest's last line, or its progress dots if it was
    stopped), each skip reason without its numbers, the failed tests' ids."""
    lines = out.strip().splitlines()
    last = "" if timed_out or not lines else lines[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", last)}
    if not counts:
        counts = {f"{kind} (so far)": n for kind, n in _progress_counts(out).items()}
    reasons: Counter[str] = Counter()
    for n, reason in re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", out, flags=re.M):
        reasons[re.sub(r"\d+", "N", reason)[:140]] += int(n)
    rows = [{"outcome": kind, "tests": n} for kind, n in counts.items()]
    rows += [{"outcome": f"skipped: {reason}", "tests": n} for reason, n in reasons.most_common()]
    rows += [{"outcome": f"failed: {name}", "tests": 1} for name in re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)[:40]]
    return rows


def _progress_counts(out: str) -> dict[str, int]:
    marks = "".join(re.findall(r"^([.sFExX]+)(?:\s+\[\s*\d+%\])?$", out, flags=re.M))
    return {"passed": marks.count("."), "skipped": marks.count("s"), "failed": marks.count("F"), "errors": marks.count("E")}


def _progress(out: str) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in _progress_counts(out).items())


# ---------------------------------------------------------------- decode


def _check_decode(run: _Run) -> CheckResult:
    from torch_tp.quant import bench

    device, quick = run.device, run.quick

    shapes = ((1, 256, 256), (4, 256, 256)) if quick else ((1, 4096, 4096), (4, 4096, 4096), (16, 4096, 4096),
                                                            (1, 8192, 8192), (4, 8192, 8192), (16, 8192, 8192))
    modes = bench.DEFAULT_MODES
    records = bench.decode_linear_timings(device, torch.bfloat16, shapes, modes, min_run_time=0.01 if quick else 0.2)
    if device == "cuda" and not quick:  # Triton templates with the int8 conversion as a prologue: minutes, so two shapes
        records += bench.decode_linear_timings(device, torch.bfloat16, shapes[:3:2], ("int8-weight-only-autotune",))
    rows, ok = [], True
    for shape in shapes:
        of_shape = {r["mode"]: r for r in records if r["shape"] == shape}
        base = of_shape["float"]["seconds"]  # the autotuned mode's own "float" rows are left out: the first stands
        for mode, r in of_shape.items():
            reads = r["weight_reads"]
            ok &= mode == "float" or r["relative_error"] < 0.03
            rows.append({
                "M,K,N": ",".join(map(str, shape)), "mode": mode, "us": round(r["seconds"] * 1e6, 2),
                "speedup vs bf16": round(base / r["seconds"], 2), "rel err": f"{r['relative_error']:.2e}",
                "reads int8 in kernel": "-" if reads is None else ("yes" if reads["reads_int8_directly"] else
                                                                   "no (float copy)" if reads["float_weight_copy"] else "no"),
            })
    best_m1 = max((row["speedup vs bf16"] for row in rows if row["M,K,N"].startswith("1,") and row["mode"] != "float"), default=0)
    return CheckResult("decode", ok, f"{len(shapes)} shapes x {len(modes)} modes; best int8 speedup at M = 1: {best_m1}x", rows)


# ---------------------------------------------------------------- llama on one rank


def _llama_args(quick: bool):
    from torch_tp.models.llama import ModelArgs

    if quick:
        return ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64, ffn_hidden=48, max_seq_len=16), (2, 16)
    return ModelArgs(dim=2048, n_layers=2, n_heads=16, vocab_size=32000, ffn_hidden=5632, max_seq_len=1024), (4, 1024)


@contextlib.contextmanager
def _one_rank_group(device: str):
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("torch_tp.selfcheck: a default process group already exists; run the self-check in a fresh process")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _timed_ms(step: Callable[[], Any], device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        step()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _llama_case(device: str, quick: bool, int8: bool) -> dict[str, Any]:
    import copy

    import torch._dynamo
    import torch.nn.functional as F
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from torch_tp import parallelize_module
    from torch_tp.models.llama import Transformer, tensor_parallel_plan
    from torch_tp.quant.bench import relative_error
    from torch_tp.testing import quantize_weights

    args, (batch, seq) = _llama_args(quick)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with torch.device(device):
        model = Transformer(args).to(dtype)
    if int8:
        quantize_weights(model)
    mesh = init_device_mesh(device, (1,), mesh_dim_names=("tp",))
    eager = parallelize_module(model, mesh, tensor_parallel_plan(sequence_parallel=True))
    compiled_model = copy.deepcopy(eager)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), device=device)

    def step(m):
        loss = F.cross_entropy(m(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        return loss

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(compiled_model, backend="inductor", fullgraph=True)
    start = time.perf_counter()
    got = step(compiled)
    compile_s = time.perf_counter() - start
    want = step(eager)
    differences = [relative_error(got.detach(), want.detach())]
    for a, b in zip(compiled_model.parameters(), eager.parameters()):
        if a.grad is not None or b.grad is not None:  # a missing gradient on one side is a difference of 1
            differences.append(1.0 if a.grad is None or b.grad is None else
                               relative_error(a.grad.full_tensor(), b.grad.full_tensor()))
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    repeats = 3 if quick else 10
    eager_ms = _timed_ms(lambda: step(eager), device, repeats)
    compiled_ms = _timed_ms(lambda: step(compiled), device, repeats)
    params = sum(_bytes_of(p) for p in eager.parameters())
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    del eager, compiled, compiled_model
    torch._dynamo.reset()
    return {"weights": "int8" if int8 else str(dtype).removeprefix("torch."), "graphs": graphs, "graph breaks": breaks,
            "max rel diff vs eager": f"{max(differences):.1e}", "within": max(differences) <= _TOLERANCE[dtype],
            "compile s": round(compile_s, 1), "eager step ms": round(eager_ms, 2), "compiled step ms": round(compiled_ms, 2),
            "speedup": round(eager_ms / compiled_ms, 2), "param MiB": round(params / 2**20, 2),
            "peak MiB": "-" if peak is None else round(peak / 2**20, 1)}


#: How far the compiled loss and gradients may be from eager's (norm of the difference over the norm).
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _bytes_of(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return sum(t.numel() * t.element_size() for t in inner_tensors(local))


def _check_llama(run: _Run) -> CheckResult:
    device, quick = run.device, run.quick
    with _one_rank_group(device):
        rows = [_llama_case(device, quick, int8) for int8 in (False, True)]
    ok = all(row["graph breaks"] == 0 and row["graphs"] == 1 and row["within"] for row in rows)
    args, (batch, seq) = _llama_args(quick)
    return CheckResult("llama", ok, f"zoo Llama dim {args.dim} x {args.n_layers} layers, {batch}x{seq} tokens, "
                       f"TP+SP plan on 1 rank: compiled within tolerance of eager {[r['within'] for r in rows]}, "
                       f"graph breaks {[r['graph breaks'] for r in rows]}", rows)


# ---------------------------------------------------------------- an 8-rank world, faked


def _check_fake8(run: _Run) -> CheckResult:
    device, quick = run.device, run.quick
    from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
    from torch_tp.testing import fake_world_memory, quantize_weights

    args = (ModelArgs(dim=64, n_layers=1, n_heads=8, vocab_size=128, ffn_hidden=128, max_seq_len=16) if quick else
            ModelArgs(dim=1024, n_layers=2, n_heads=16, vocab_size=32768, ffn_hidden=2816, max_seq_len=512))
    tokens = torch.zeros(2, args.max_seq_len, dtype=torch.long)
    backend = "aot_eager"  # traced through AOTAutograd (graph breaks, the backward); inductor is the llama check's
    rows = []
    for int8 in (False, True):
        for rank in (0, 7):
            build = (lambda: quantize_weights(Transformer(args))) if int8 else (lambda: Transformer(args))
            m = fake_world_memory(build, tensor_parallel_plan(sequence_parallel=True), 8, inputs=tokens, rank=rank,
                                  device=device, compile_backend=backend)
            rows.append({"weights": "int8" if int8 else "float32", "rank": rank, "held B": m.held_bytes,
                         "predicted B": m.predicted_bytes, "equal": m.matches(), "graph breaks": m.graph_breaks,
                         "peak MiB": "-" if m.peak_allocated_bytes is None else round(m.peak_allocated_bytes / 2**20, 1)})
    ok = all(row["equal"] and row["graph breaks"] == 0 for row in rows)
    return CheckResult("fake8", ok, f"world size 8 (fake process group), zoo Llama dim {args.dim}, TP+SP, {backend}: "
                       f"held = predicted on {sum(r['equal'] for r in rows)} of {len(rows)}", rows)


#: The checks, in the order they run (the figures first; the test suite takes the time left).
CHECKS: dict[str, Callable[[_Run], CheckResult]] = {
    "decode": _check_decode, "llama": _check_llama, "fake8": _check_fake8, "tests": _check_tests,
}


def run_checks(device: str, names: list[str], quick: bool = False, *, out: str | os.PathLike | None = None,
               budget_s: float = 450.0) -> list[CheckResult]:
    """Run the checks ``names`` on ``device``, within about ``budget_s`` seconds (the test suite,
    last, is stopped when they are up); a check that raises is a failed result naming the error.
    ``out``: a directory for the test suite's log.

    Example::

        >>> # xdoctest: +SKIP("runs a check")
        >>> [r.ok for r in run_checks("cpu", ["fake8"], quick=True)]
        [True]
    """
    run = _Run(device, quick, None if out is None else pathlib.Path(out), time.monotonic() + budget_s)
    if run.out is not None:
        run.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        start = time.perf_counter()
        try:
            result = CHECKS[name](run)
        except Exception as error:  # noqa: BLE001 -- reported as the check's failure, the next still runs
            last = traceback.format_exc().strip().splitlines()
            result = CheckResult(name, False, f"raised {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}",
                                 [{"traceback": line} for line in last[-12:]])
        result.seconds = round(time.perf_counter() - start, 1)
        results.append(result)
        _print_result(result)
    return results


def _print_result(result: CheckResult) -> None:
    print(f"\n## {result.name}: {'ok' if result.ok else 'FAILED'} ({result.seconds} s) -- {result.summary}", flush=True)
    if result.rows:
        print(_markdown(result.rows), flush=True)


def _markdown(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _environment(device: str) -> str:
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return f"torch {torch.__version__}, {card}, python {sys.version.split()[0]}"


def _quiet_compile_caches() -> None:
    """This process compiles graphs holding process groups and int8 subclasses, which the AOTAutograd
    and FX graph caches cannot save: no AOTAutograd cache, and the FX cache's warning silenced."""
    import logging

    import torch._functorch.config

    torch._functorch.config.enable_autograd_cache = False
    logging.getLogger("torch._inductor.codecache").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    """The command line: run the checks, print their tables and a summary; 0 when every check passed.

    Example::

        >>> # xdoctest: +SKIP("runs the checks")
        >>> main(["--device", "cpu", "--quick", "--only", "decode"])
        0
    """
    parser = argparse.ArgumentParser(prog="python -m torch_tp.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated checks (default all: {','.join(CHECKS)})")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU smoke test)")
    parser.add_argument("--out", help="a directory to write selfcheck.json (and the test suite's log) to")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (default 450); the test suite gets what is left")
    options = parser.parse_args(argv)
    names = [name for name in options.only.split(",") if name]
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}; the checks are {list(CHECKS)}")
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False: run it on a GPU machine, or pass --device cpu")
    _quiet_compile_caches()
    print(f"# torch_tp self-check on {options.device}: {_environment(options.device)}", flush=True)
    results = run_checks(options.device, names, options.quick, out=options.out, budget_s=options.budget)
    print("\n## summary\n" + _markdown([{"check": r.name, "result": "ok" if r.ok else "FAILED", "s": r.seconds,
                                          "summary": r.summary} for r in results]), flush=True)
    if options.out:
        path = pathlib.Path(options.out) / "selfcheck.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"environment": _environment(options.device), "device": options.device,
                                    "results": [asdict(r) for r in results]}, indent=1, default=str))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
