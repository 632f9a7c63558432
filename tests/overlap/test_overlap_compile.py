"""``torch.compile(fullgraph=True)`` of the TP + SP Llama-style model, with and without overlap.

Four variants (float32 / int8 weights x ``overlap`` off / on), each compiled with the
``aot_eager`` and ``inductor`` CPU backends on 2 gloo ranks. Compiled forward output and
every gradient after backward must equal eager's (1e-5), and ``torch._dynamo.explain``
must see one graph and no graph break (``fullgraph=True`` would also fail on a break).
The compiled model runs as many P2P ring steps as eager, forward and backward. The fused ops appear in the graphs as single
``torch_tp`` custom-op nodes (checked on the ``aot_eager`` forward and backward graphs).
"""

import copy

import pytest
import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from torch_tp import parallelize_module
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.testing import (
    TOL,
    assert_params_and_grads_match,
    on_ranks,
    quantize_weights,
    record_p2p,
    small_llama,
    small_llama_args,
    tp_mesh,
)

VOCAB = small_llama_args().vocab_size
# torch's own import of inductor warns about torch.jit.script_method; nothing to act on here
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _model(quantized, overlap):
    model = small_llama(seed=0, n_layers=1)
    if quantized:
        quantize_weights(model)
    return parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=True, overlap=overlap))


def _loss(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def _loss_and_backward_counting_sends(model, tokens, targets):
    """The loss, and the P2P sends of the forward and of the backward (the fused ops' ring steps)."""
    with record_p2p() as forward:
        loss = _loss(model, tokens, targets)
    with record_p2p() as backward:
        loss.backward()
    return loss, tuple(sum(kind == "send" for kind, _, _ in records) for records in (forward, backward))


def _recording(graphs):
    """``aot_eager`` (same partitioner) that also keeps the forward and backward graphs."""

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    return aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)


def _custom_op_nodes(graphs):
    return sorted(
        str(node.target) for gm in graphs for node in gm.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("torch_tp.")
    )


def _compiled_matches_eager(quantized, overlap, backend):
    torch._dynamo.reset()
    eager = _model(quantized, overlap)
    compiled_model = copy.deepcopy(eager)
    tokens = torch.randint(0, VOCAB, (2, 8))
    targets = torch.randint(0, VOCAB, (2, 8))
    graphs = []
    compiler = _recording(graphs) if backend == "aot_eager" else backend
    # No AOTAutograd cache (its key does not cover this library's op code); one compile thread
    # (no compile-worker subprocesses left in the reused rank workers).
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(compile_threads=1):
        compiled = torch.compile(compiled_model, backend=compiler, fullgraph=True)
        loss, compiled_sends = _loss_and_backward_counting_sends(compiled, tokens, targets)
    want, eager_sends = _loss_and_backward_counting_sends(eager, tokens, targets)
    torch.testing.assert_close(loss, want, **TOL)
    assert_params_and_grads_match(compiled_model, eager, **TOL, params=False, what=backend)
    # the compiled graphs run the fused ops' ring steps that eager runs: none added, none lost
    assert compiled_sends == eager_sends, (compiled_sends, eager_sends)

    if backend == "aot_eager":  # dynamo's capture does not depend on the backend: check it once
        torch._dynamo.reset()
        explained = torch._dynamo.explain(eager)(tokens)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1
    return _custom_op_nodes(graphs)


@pytest.mark.parametrize("overlap", [False, True], ids=["unfused", "overlap"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@on_ranks(2)
def test_compiled_tp_sp_llama_matches_eager_with_no_graph_break(backend, quantized, overlap):
    nodes = _compiled_matches_eager(quantized, overlap, backend)
    if backend != "aot_eager":
        return
    if not overlap:
        assert nodes == []
        return
    # forward: 3 fused gathers (wq/wk/wv shared, w1/w3 shared, the output head) and 2 fused
    # reduce-scatters (wo, w2); backward: each reduce-scatter's input gradient is a fused
    # gather (2), each gather's one fused reduce-scatter (3: the siblings' gradients and
    # weights are concatenated, int8 weights too since their scales follow the joined rows)
    gathers = "torch_tp.all_gather_int8_matmul.default" if quantized else "torch_tp.all_gather_matmul.default"
    scatters = "torch_tp.int8_matmul_reduce_scatter.default" if quantized else "torch_tp.matmul_reduce_scatter.default"
    assert nodes.count(gathers) == 3 + 2, nodes
    assert nodes.count(scatters) == 2 + 3, nodes
    assert len(nodes) == nodes.count(gathers) + nodes.count(scatters), nodes
