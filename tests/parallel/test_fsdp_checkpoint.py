"""DCP checkpoints of a 2-D (FSDP2 x TP) model reshard across (dp, tp) meshes bit for bit.

The Llama is trained one AdamW step on (dp 2, tp 2) and saved with ``torch_tp.checkpoint``
(DCP), model and optimizer (``get_model_state_dict`` / ``get_optimizer_state_dict``); a
model with other values, built on (dp 1, tp 4), on (dp 4, tp 1) (FSDP alone, a 1-D mesh) or
on (dp 2, tp 2) again, loads it and then holds exactly the saved values (every parameter
and AdamW moment as a full tensor, ``torch.equal``), including the small parameters FSDP
leaves replicated.
"""

import pytest
import torch
import torch.distributed as dist
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
from torch_tp.testing import full_tensor, mesh_2x2, run_on_ranks, small_llama, small_llama_args

ARGS = small_llama_args()
MIN_SIZE = 256


def _two_d_model(dp, tp, seed):
    model = small_llama(seed=seed)
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
    """Every parameter and AdamW moment as a full tensor (collectives: call on every rank)."""
    state = {name: full_tensor(param.detach()).clone() for name, param in model.named_parameters()}
    for name, param in model.named_parameters():
        for moment in ("exp_avg", "exp_avg_sq"):
            state[f"{name}.{moment}"] = full_tensor(optimizer.state[param][moment]).clone()
    return state


def _train_and_save(path):
    model = _two_d_model(2, 2, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    tp_checkpoint.save(state, path)
    saved = _full_state(model, optimizer)
    return saved if dist.get_rank() == 0 else None


def _load(path, dp, tp):
    model = _two_d_model(dp, tp, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    tp_checkpoint.load(state, path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    loaded = _full_state(model, optimizer)
    return loaded if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def saved_on_2x2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp_tp_checkpoint"))
    return path, run_on_ranks(_train_and_save, 4, path)[0]


@pytest.mark.parametrize("dp, tp", [(1, 4), (4, 1), (2, 2)], ids=["dp1-tp4", "dp4-tp1", "dp2-tp2"])
def test_checkpoint_saved_on_2x2_loads_bit_for_bit_on_another_mesh(saved_on_2x2, dp, tp):
    path, saved = saved_on_2x2
    loaded = run_on_ranks(_load, 4, path, dp, tp)[0]
    assert list(loaded) == list(saved) and len(saved) == 3 * len(list(small_llama().parameters()))
    different = [name for name in saved if not torch.equal(loaded[name], saved[name])]
    assert different == []
    fresh = small_llama(seed=1)
    assert not torch.equal(fresh.layers[0].attention.wq.weight, saved["layers.0.attention.wq.weight"])
