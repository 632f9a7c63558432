"""Tutorial: int8 weights in a tensor-parallel Llama-style model, eager and compiled.

Run on 2 CPU ranks (gloo)::

    python tutorials/int8_tensor_parallel.py

or under a launcher::

    torchrun --nproc-per-node 2 tutorials/int8_tensor_parallel.py

1. Build a float32 model (the same values on every rank).
2. Quantize a copy: int8 weights with one float32 scale per row (torchao.quantize_).
3. Parallelize a copy of the quantized model with the TP + SP plan: the int8 weights are sharded.
4. Compare logits with the float model and with the unsharded quantized model.
5. Compile the sharded model in one graph and compare it with eager.
6. Count the weight bytes each rank holds.

The last line says whether the sharded int8 model matches the unsharded one in one process,
eager and compiled (the exit status is 1 if not).
"""

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import parallelize_module
from torch_tp._verdict import check, conclude
from torch_tp.launch import launch, rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan
from torch_tp.quant import Int8SymmetricTensor, Int8SymmetricWeightConfig
from torchao import quantize_  # after torch_tp.quant, which silences torchao's import warnings


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    args = ModelArgs(dim=128, n_layers=1, n_heads=4, vocab_size=256, ffn_hidden=256)

    # 1. A float32 model; the seed gives every rank the same weights.
    torch.manual_seed(0)
    reference = Transformer(args).to(device)

    # 2. Quantize a copy. quantize_ takes every nn.Linear by default; the filter adds the
    #    token embedding. Each weight becomes an Int8SymmetricTensor (int8 + row scales).
    quantized = copy.deepcopy(reference)
    quantize_(quantized, Int8SymmetricWeightConfig(),
              filter_fn=lambda module, fqn: isinstance(module, (nn.Linear, nn.Embedding)))

    # 3. Shard a copy of the quantized model with the same plan as a float one. Each rank
    #    keeps its rows (colwise) or features (rowwise) of every int8 weight.
    plan = tensor_parallel_plan(sequence_parallel=True)
    model = parallelize_module(copy.deepcopy(quantized), mesh["tp"], plan)

    # 4. The same tokens on every rank; the plan returns replicated logits.
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    with torch.no_grad():
        logits = model(tokens)
        vs_float = relative_error(logits, reference(tokens))
        vs_unsharded = relative_error(logits, quantized(tokens))

    # 5. One graph for the whole sharded model (inductor): the int8 matmuls, the
    #    sequence-parallel collectives and the norms are all inside it.
    #    torch.compile only wraps; the first call compiles (cold: minutes on a CPU).
    if rank == 0:
        print("compiling the sharded int8 model (fullgraph=True) with inductor "
              "(the first compile can take minutes) ...", flush=True)
    compiled = torch.compile(model, fullgraph=True)
    started = time.perf_counter()
    with torch.no_grad():
        compiled_logits = compiled(tokens)
    if rank == 0:
        print(f"compiled in {time.perf_counter() - started:.1f} s", flush=True)
    compiled_vs_eager = relative_error(compiled_logits, logits)

    # 6. What this rank stores for its quantized weights, and what float32 would take.
    held = as_float32 = 0
    for param in model.parameters():
        local = param.to_local()
        if isinstance(local, Int8SymmetricTensor):
            held += local.qdata.untyped_storage().nbytes() + local.scale.untyped_storage().nbytes()
            as_float32 += local.numel() * 4

    # Rank 0 prints every rank's numbers, so lines never interleave.
    results = [None] * world
    dist.all_gather_object(results, (vs_float, vs_unsharded, compiled_vs_eager, held, as_float32))
    if rank == 0:
        print("relative error of the sharded int8 logits (norm of difference / norm):")
        for r, (vs_float, vs_unsharded, compiled_vs_eager, _, _) in enumerate(results):
            print(f"  rank {r}: vs float model {vs_float:.2e}, vs unsharded int8 model {vs_unsharded:.2e}, "
                  f"compiled vs eager {compiled_vs_eager:.2e}")
        print("quantized weight bytes per rank (int8 qdata + float32 scales):")
        for r, (_, _, _, held, as_float32) in enumerate(results):
            print(f"  rank {r}: {held} bytes, float32 would take {as_float32} ({held / as_float32:.3f}x)")

    # 7. The verdict (relative errors, norm of difference / norm): the sharded int8 model
    #    against the unsharded one in one process, eager and compiled.
    conclude([
        check("logits vs the unsharded int8 model (relative error)", vs_unsharded, 1e-5),
        check("compiled logits vs eager (relative error)", compiled_vs_eager, 1e-5),
    ])


if __name__ == "__main__":
    launch(main, nproc=2)
