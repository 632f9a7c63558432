"""``torch.compile(fullgraph=True)`` of the TP + SP Llama-style model, with and without overlap.

Six variants (float32 / int8 weights x ``overlap`` off / on; int8 communication
(``comm_dtype=torch.int8``) with int8 weights, and with ``overlap`` on float weights), each
compiled with the
``inductor`` CPU backend on 2 gloo ranks. Compiled forward output and every gradient after
backward must equal eager's (1e-5), and dynamo's counters of the compile must see one graph and no
graph break (``fullgraph=True`` would also fail on a break). The compiled model runs as many
P2P ring steps as eager, forward and backward. The fused ops appear in the graphs inductor
lowers as single ``torch_tp`` custom-op nodes (checked on the forward and backward graphs after
AOTAutograd's partition and inductor's post-grad passes, read by a custom post-grad pass; an
``aot_eager`` twin of each case added nothing that one inductor compile does not check).
"""

import copy

import pytest
import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
import torch.nn.functional as F

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
    options = {"int8 comm": dict(comm_dtype=torch.int8), "int8 comm overlap": dict(comm_dtype=torch.int8, overlap=True)}.get(
        overlap, dict(overlap=overlap))
    return parallelize_module(model, tp_mesh(), tensor_parallel_plan(sequence_parallel=True, **options))


def _loss(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def _loss_and_backward_counting_sends(model, tokens, targets):
    """The loss, and the P2P sends of the forward and of the backward (the fused ops' ring steps)."""
    with record_p2p() as forward:
        loss = _loss(model, tokens, targets)
    with record_p2p() as backward:
        loss.backward()
    return loss, tuple(sum(kind == "send" for kind, _, _ in records) for records in (forward, backward))


def _custom_op_nodes(graphs):
    return sorted(
        str(node.target) for graph in graphs for node in graph.nodes
        if node.op == "call_function" and str(node.target).startswith("torch_tp.")
    )


def _compiled_matches_eager(quantized, overlap):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = _model(quantized, overlap)
    compiled_model = copy.deepcopy(eager)
    tokens = torch.randint(0, VOCAB, (2, 8))
    targets = torch.randint(0, VOCAB, (2, 8))
    graphs = []  # the forward and backward graphs inductor lowers, kept by a post-grad pass
    # No AOTAutograd cache (its key does not cover this library's op code); one compile thread
    # (no compile-worker subprocesses left in the reused rank workers).
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(
            compile_threads=1, post_grad_custom_post_pass=graphs.append):
        compiled = torch.compile(compiled_model, backend="inductor", fullgraph=True)
        loss, compiled_sends = _loss_and_backward_counting_sends(compiled, tokens, targets)
    want, eager_sends = _loss_and_backward_counting_sends(eager, tokens, targets)
    torch.testing.assert_close(loss, want, **TOL)
    assert_params_and_grads_match(compiled_model, eager, **TOL, params=False, what="inductor")
    # the compiled graphs run the fused ops' ring steps that eager runs: none added, none lost
    assert compiled_sends == eager_sends, (compiled_sends, eager_sends)

    assert len(graphs) == 2, graphs  # one forward, one backward
    # fullgraph=True raises at a graph break; the compile's own counters say it once more
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    return _custom_op_nodes(graphs)


@pytest.mark.parametrize("quantized, overlap", [
    (False, False), (True, False), (False, True), (True, True), (True, "int8 comm"),
    (False, "int8 comm overlap"), (True, "int8 comm overlap"),
], ids=["float32-unfused", "int8-unfused", "float32-overlap", "int8-overlap", "int8-int8 comm",
        "float32-int8 comm overlap", "int8-int8 comm overlap"])
@on_ranks(2)
def test_compiled_tp_sp_llama_matches_eager_with_no_graph_break(quantized, overlap):
    nodes = _compiled_matches_eager(quantized, overlap)
    if not overlap:
        assert nodes == []
        return
    if overlap == "int8 comm":  # comm_dtype=torch.int8: each sequence-parallel collective one int8 op
        # forward: 3 gathers (wq/wk/wv shared, w1/w3 shared, the head), 3 reduce-scatters (the
        # embedding, wo, w2); backward: each one's gradient through the other (an int8 embedding
        # is frozen: nothing flows back to its reduce-scatter)
        gathers, scatters = nodes.count("torch_tp.int8_all_gather.default"), nodes.count("torch_tp.int8_reduce_scatter.default")
        assert (gathers, scatters) == (3 + (2 if quantized else 3), 3 + 3), nodes
        assert len(nodes) == gathers + scatters, nodes
        return
    if overlap == "int8 comm overlap" and quantized:  # int8 tokens on the ring, int8 weights multiplied:
        # the weights are flattened into the int8-weight ops; forward 3 gathers, 2 scatters (and the
        # embedding's int8 reduce-scatter), backward 2 gathers and 3 reduce-scatters; the frozen
        # int8 embedding takes no gradient (no int8_all_gather back to it)
        assert nodes.count("torch_tp.int8_all_gather_int8_matmul.default") == 3 + 2, nodes
        assert nodes.count("torch_tp.int8_matmul_int8_reduce_scatter.default") == 2, nodes
        assert nodes.count("torch_tp.int8_reduce_scatter.default") == 1 + 3, nodes
        assert len(nodes) == 5 + 2 + 4, nodes
        return
    if overlap == "int8 comm overlap":  # the fused ops, moving int8: forward 3 gathers, 2 scatters
        # (the embedding's own int8 reduce-scatter too); backward each one's gradient through the other
        assert nodes.count("torch_tp.int8_all_gather_matmul.default") == 3 + 2, nodes
        assert nodes.count("torch_tp.matmul_int8_reduce_scatter.default") == 2, nodes
        assert nodes.count("torch_tp.int8_reduce_scatter.default") == 1 + 3, nodes
        assert nodes.count("torch_tp.int8_all_gather.default") == 1, nodes
        assert len(nodes) == 5 + 2 + 4 + 1, nodes
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
