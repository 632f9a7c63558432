"""DCP checkpoints of a 2-D (FSDP2 x TP) model reshard across (dp, tp) meshes bit for bit, float and int8.

The Llama is trained one AdamW step on (dp 2, tp 2) and saved with ``torch_tp.checkpoint``
(DCP), model and optimizer (``get_model_state_dict`` / ``get_optimizer_state_dict``); a
model with other values, built on (dp 1, tp 4), on (dp 4, tp 1) (FSDP alone, a 1-D mesh) or
on (dp 2, tp 2) again, loads it and then holds exactly the saved values (every parameter
and AdamW moment as a full tensor, ``torch.equal``), including the small parameters FSDP
leaves replicated. The int8 variant quantizes every linear weight (frozen ``Int8SymmetricTensor``s,
their ``qdata`` and scales compared byte for byte); the float parameters train and reload alike.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import checkpoint as tp_checkpoint
from torch_tp import fully_shard_by_pattern, parallelize_module
from torch_tp.models.llama import tensor_parallel_plan
from torch_tp.quant import Int8SymmetricTensor
from torch_tp.testing import full_tensor, mesh_2x2, quantize_weights, run_on_ranks, small_llama, small_llama_args

ARGS = small_llama_args()
MIN_SIZE = 256


def _two_d_model(dp, tp, seed, int8):
    model = small_llama(seed=seed)
    if int8:
        quantize_weights(model, embeddings=False)
    if (dp, tp) == (2, 2):
        mesh = mesh_2x2()
    elif tp == 1:
        mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=True))
    return fully_shard_by_pattern(model, mesh, "layers.*", min_weight_size=MIN_SIZE)


def _full_state(model, optimizer):
    """Every parameter (an int8 one as its qdata and scale) and AdamW moment as a full tensor
    (collectives: call on every rank)."""
    state = {}
    for name, param in model.named_parameters():
        whole = full_tensor(param.detach())
        if isinstance(whole, Int8SymmetricTensor):
            state[f"{name}.qdata"], state[f"{name}.scale"] = whole.qdata.clone(), whole.scale.clone()
            continue
        state[name] = whole.clone()
        for moment in ("exp_avg", "exp_avg_sq"):
            state[f"{name}.{moment}"] = full_tensor(optimizer.state[param][moment]).clone()
    return state


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _train_and_save(path, int8):
    model = _two_d_model(2, 2, seed=0, int8=int8)
    optimizer = torch.optim.AdamW(_trainable(model), lr=1e-2)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    tp_checkpoint.save(state, path)
    saved = _full_state(model, optimizer)
    return saved if dist.get_rank() == 0 else None


def _load(path, dp, tp, int8):
    model = _two_d_model(dp, tp, seed=1, int8=int8)
    optimizer = torch.optim.AdamW(_trainable(model), lr=1e-2)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    tp_checkpoint.load(state, path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    loaded = _full_state(model, optimizer)
    return loaded if dist.get_rank() == 0 else None


@pytest.fixture(scope="module", params=["float", "int8"])
def saved_on_2x2(request, tmp_path_factory):
    int8 = request.param == "int8"
    path = str(tmp_path_factory.mktemp(f"fsdp_tp_checkpoint_{request.param}"))
    return path, int8, run_on_ranks(_train_and_save, 4, path, int8)[0]


@pytest.mark.parametrize("dp, tp", [(1, 4), (4, 1), (2, 2)], ids=["dp1-tp4", "dp4-tp1", "dp2-tp2"])
def test_checkpoint_saved_on_2x2_loads_bit_for_bit_on_another_mesh(saved_on_2x2, dp, tp):
    path, int8, saved = saved_on_2x2
    loaded = run_on_ranks(_load, 4, path, dp, tp, int8)[0]
    n_params = len(list(small_llama().parameters()))
    n_int8 = sum(isinstance(m, nn.Linear) for m in small_llama().modules()) if int8 else 0  # qdata + scale each
    assert list(loaded) == list(saved) and len(saved) == 2 * n_int8 + 3 * (n_params - n_int8)
    different = [name for name in saved if not torch.equal(loaded[name], saved[name])]
    assert different == []
    fresh = small_llama(seed=1)
    key = "layers.0.attention.wq.weight" + (".qdata" if int8 else "")
    fresh_value = Int8SymmetricTensor.from_hp(fresh.layers[0].attention.wq.weight.detach()).qdata if int8 else \
        fresh.layers[0].attention.wq.weight
    assert not torch.equal(fresh_value, saved[key])
