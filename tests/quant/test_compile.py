"""``torch.compile(fullgraph=True)`` of quantized models, unsharded and tensor-parallel.

Each case compiles with the ``aot_eager`` and ``inductor`` (CPU) backends, checks the
compiled output against eager (float32: 1e-5; bfloat16: a bfloat16 rounding step, since
inductor fuses the pointwise tail in float32) and that dynamo's counters of the compile see one
graph and no graph break. These cases are inference; quantized weights are frozen
(``requires_grad=False``), and compiled training through int8 layers (gradients reaching
norms and activations) is tested in ``tests/overlap/test_overlap_compile.py``. The subclass's
``__tensor_flatten__``/``__tensor_unflatten__`` round trip, and its class registry, are
tested here too.

Durations on 2 CPU cores, with an empty / a warm inductor cache (the first inductor compile
in a process also pays ~5 s of inductor start-up, ~10 s on 2 ranks sharing the cores; it
lands on whichever case runs first in that process); the file: ~77 s / ~50 s.

- unsharded MLP, both backends: float32 8 s / 2.5 s (with start-up), bfloat16 3 s / 0.6 s
- compiled function in/out ``Int8SymmetricTensor``: inductor 2.5 s / 0.4 s, aot_eager 0.4 s
- sharded MLP, world size 2, both backends, float32 + bfloat16: 18 s / 16 s (with pool and
  inductor start-up); world size 4, ``aot_eager``, float32 only: 5-8 s
- sharded Llama (quantized Linear + Embedding), world size 2, both backends: 17 s / 7-8 s per plan
"""

from unittest import mock

import pytest
import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd

from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.quant import Int8SymmetricTensor
from torch_tp.testing import TOL, quantize_weights, run_on_ranks, small_llama, small_llama_args, tp_mesh

BACKENDS = ("aot_eager", "inductor")
# compiled vs eager; bfloat16: inductor computes the pointwise tail in float32, one rounding step
COMPILED_TOL = {torch.float32: TOL, torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
VOCAB = small_llama_args().vocab_size
aten = torch.ops.aten
# torch's own import of inductor warns about torch.jit.script_method; nothing to act on here
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _quantized_mlp(dtype=torch.float32):
    return quantize_weights(nn.Sequential(nn.Linear(16, 40), nn.ReLU(), nn.Linear(40, 16)).to(dtype))


def _compile_settings():
    # No AOTAutograd cache: its key covers the traced module, not this library's op code, so a
    # stale entry would hide a change to the quantized ops. One compile thread: no compile-worker
    # subprocesses left behind in the reused rank workers.
    return torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(
        compile_threads=1
    )


def _compile(fn, backend):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, backend=backend, fullgraph=True)


def _assert_compiled_matches_eager(model, inputs_list, backends, dtype=torch.float32):
    """Compile ``model`` once per backend; every input must give eager's output. Returns the outputs."""
    outputs = []
    no_cache, one_thread = _compile_settings()
    with torch.no_grad(), no_cache, one_thread:
        expected = [model(*inputs) for inputs in inputs_list]
        for backend in backends:
            compiled = _compile(model, backend)
            for inputs, want in zip(inputs_list, expected):  # later inputs reuse the compiled graph
                got = compiled(*inputs)
                assert got.dtype == want.dtype
                torch.testing.assert_close(got, want, **COMPILED_TOL[dtype], msg=lambda m, b=backend: f"{b}: {m}")
                outputs.append(got)
            _assert_one_graph_and_no_break()
    return outputs


def _assert_one_graph_and_no_break():
    """What the compile just counted (``_compile`` cleared the counters): one graph, no break.
    ``fullgraph=True`` raises at a break already; this reads it off the run, with no second trace."""
    from torch._dynamo.utils import counters

    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _recording_aot_eager(graphs):
    """``aot_eager`` that also keeps the (post-dispatch) graphs it runs."""

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    return aot_autograd(fw_compiler=keep)


def _int8_packed_matmuls(graphs):
    """The ``_weight_int8pack_mm`` calls in ``graphs`` whose weight operand is int8."""
    return [
        node for gm in graphs for node in gm.graph.nodes
        if node.target is aten._weight_int8pack_mm.default and node.args[1].meta["val"].dtype == torch.int8
    ]


# ------------------------------------------------------------------ unsharded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_quantized_mlp_matches_eager(dtype):
    torch.manual_seed(0)
    model = _quantized_mlp(dtype)
    inputs = [(torch.randn(4, 16, dtype=dtype),), (torch.randn(4, 16, dtype=dtype),)]
    _assert_compiled_matches_eager(model, inputs, BACKENDS, dtype)


@pytest.mark.cpu_only(reason="_weight_int8pack_mm is the CPU path of int8 x float32 (quant/_ops_matmul.py)")
def test_compiled_float32_mlp_keeps_the_weights_int8_in_the_graph():
    torch.manual_seed(0)
    model, graphs, x = _quantized_mlp(), [], torch.randn(4, 16)
    with torch.no_grad():
        got = _compile(model, _recording_aot_eager(graphs))(x)
        torch.testing.assert_close(got, model(x), **TOL)
    # one int8 x float32 matmul per Linear, and nothing turns a weight back into float
    assert len(_int8_packed_matmuls(graphs)) == 2
    assert not any(node.target is aten.mm.default for gm in graphs for node in gm.graph.nodes)


def _views_and_copies(q, x):
    return (
        F.linear(x, q),                      # plain output computed from the int8 input
        q[2:7].clone(),                      # slice: rows with their scales
        torch.cat(torch.chunk(q, 2, dim=0)),  # split + cat
        q.to(torch.bfloat16),                # a new logical dtype, same int8 data
        q.detach(),                          # an alias of the input (rebuilt after the graph)
        Int8SymmetricTensor.from_hp(q.dequantize() * 2),  # built inside the graph
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_function_takes_and_returns_int8_tensors(backend):
    torch.manual_seed(0)
    q, x = Int8SymmetricTensor.from_hp(torch.randn(10, 16)), torch.randn(3, 16)
    no_cache, one_thread = _compile_settings()
    with no_cache, one_thread:
        got = _compile(_views_and_copies, backend)(q, x)
    want = _views_and_copies(q, x)
    torch.testing.assert_close(got[0], want[0], **TOL)
    for g, w in zip(got[1:], want[1:]):
        assert type(g) is Int8SymmetricTensor and (g.shape, g.dtype) == (w.shape, w.dtype)
        assert torch.equal(g.qdata, w.qdata) and torch.equal(g.scale, w.scale)
    _assert_one_graph_and_no_break()


def test_flatten_unflatten_round_trip_rebuilds_the_same_tensor():
    q = Int8SymmetricTensor.from_hp(torch.randn(6, 4, dtype=torch.bfloat16))
    names, context = q.__tensor_flatten__()
    assert names == ["qdata", "scale"] and context["dtype"] == torch.bfloat16
    inner = {name: getattr(q, name) for name in names}
    rebuilt = Int8SymmetricTensor.__tensor_unflatten__(inner, context, q.shape, q.stride())
    assert type(rebuilt) is Int8SymmetricTensor and rebuilt.dtype == torch.bfloat16
    assert torch.equal(rebuilt.qdata, q.qdata) and torch.equal(rebuilt.scale, q.scale)


def test_compiled_graphs_rebuild_int8_tensors_through_the_registry():
    from torch_tp.quant import _registry

    q, x = Int8SymmetricTensor.from_hp(torch.randn(10, 16)), torch.randn(3, 16)
    no_cache, one_thread = _compile_settings()
    with no_cache, one_thread, mock.patch.object(_registry, "registered_class", wraps=_registry.registered_class) as spy:
        got = _compile(_views_and_copies, "aot_eager")(q, x)
    assert spy.call_count > 0  # the int8 outputs were rebuilt by __tensor_unflatten__
    assert {call.args[0] for call in spy.call_args_list} == {"torch_tp.quant.int8_tensor.Int8SymmetricTensor"}
    assert all(type(t) is Int8SymmetricTensor for t in got[1:])


class _ForeignInt8(Int8SymmetricTensor):
    """A subclass defined outside torch_tp: not in the unflatten registry."""


def test_unflatten_refuses_classes_that_torch_tp_did_not_register():
    q = Int8SymmetricTensor.from_hp(torch.randn(4, 4))
    inner = {"qdata": q.qdata, "scale": q.scale}
    for forged in ("os.system", "builtins.object", f"{__name__}._ForeignInt8"):
        with pytest.raises(TypeError, match=r"only builds torch_tp's registered classes \['torch_tp\.quant"):
            Int8SymmetricTensor.__tensor_unflatten__(inner, {"dtype": torch.float32, "class": forged}, q.shape, q.stride())
    foreign = _ForeignInt8(q.qdata, q.scale, torch.float32)
    with pytest.raises(Exception, match=r"registered classes"):
        _compile(lambda w: w.detach(), "aot_eager")(foreign)
    torch._dynamo.reset()


def test_compiled_function_returning_a_strided_view_of_an_input_says_to_copy():
    q = Int8SymmetricTensor.from_hp(torch.randn(10, 16))
    with pytest.raises(NotImplementedError, match=r"as_strided.*per-row scales.*\.clone\(\)"):
        _compile(lambda w: w.t(), "aot_eager")(q)
    torch._dynamo.reset()


# ------------------------------------------------------------------ tensor parallel


def _sharded_mlp_case(backends, dtype):
    torch._dynamo.reset()
    model = _quantized_mlp(dtype)
    parallelize_module(model, tp_mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    assert isinstance(model[0].weight.to_local(), Int8SymmetricTensor)
    inputs = [(torch.randn(4, 16, dtype=dtype),), (torch.randn(4, 16, dtype=dtype),)]
    return _assert_compiled_matches_eager(model, inputs, backends, dtype)


# world size 4 puts 4 ranks on the machine's cores: float32 and aot_eager only, to keep it short
@pytest.mark.parametrize(
    "world_size, dtype, backends",
    [(2, torch.float32, BACKENDS), (2, torch.bfloat16, BACKENDS), (4, torch.float32, ("aot_eager",))],
    ids=["ws2-float32", "ws2-bfloat16", "ws4-float32-aot_eager"],
)
def test_compiled_sharded_quantized_mlp_matches_eager(world_size, dtype, backends):
    outputs = run_on_ranks(_sharded_mlp_case, world_size, backends, dtype)
    for rank_outputs in outputs[1:]:  # the output is replicated: every rank has it
        for got, want in zip(rank_outputs, outputs[0]):
            assert torch.equal(got, want)


def _sharded_llama_case(sequence_parallel):
    torch._dynamo.reset()
    model = quantize_weights(small_llama(n_layers=1))
    parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=sequence_parallel))
    assert isinstance(model.layers[0].attention.wq.weight.to_local(), Int8SymmetricTensor)
    assert isinstance(model.tok_embeddings.weight.to_local(), Int8SymmetricTensor)
    tokens = [(torch.randint(0, VOCAB, (2, 8)),) for _ in range(2)]
    return _assert_compiled_matches_eager(model, tokens, BACKENDS)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_compiled_sharded_quantized_llama_matches_eager(sequence_parallel):
    outputs = run_on_ranks(_sharded_llama_case, 2, sequence_parallel)
    for got, want in zip(outputs[1], outputs[0]):
        assert torch.equal(got, want)
