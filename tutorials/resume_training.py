"""Tutorial: save a tensor-parallel training run, lose it, resume it, and get the same model.

Run on 2 CPU ranks (gloo)::

    python tutorials/resume_training.py

or ``torchrun --nproc-per-node 2 tutorials/resume_training.py`` (NCCL on GPUs).

Three jobs train the zoo Llama (tensor + sequence parallel) with AdamW on the same batches:

1. the job that dies: it saves every 3 steps with :func:`torch_tp.checkpoint.save_training_state`
   and stops after step 5, as a job whose rank was killed would: step 4 and 5 are lost;
2. the job started again: :func:`torch_tp.checkpoint.load_training_state` restores the model,
   the optimizer, the step and the data position from the newest complete checkpoint (step 3),
   and it trains steps 4 to 8;
3. the job that never stopped: steps 1 to 8.

The resumed job ends with the parameters of the one that never stopped, bit for bit: their
SHA-256 over the whole parameters (gathered from the shards, in name order) is equal. The job
that never stopped also trains the whole model in one process beside it: the last line says
whether the resumed job has the never-stopped one's parameters and whether those train like one
process (the exit status is 1 if not).
"""

import hashlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import init_parameters, parallelize_module
from torch_tp._verdict import check, compare, conclude
from torch_tp.checkpoint import (
    latest_checkpoint,
    load_training_state,
    save_training_state,
)
from torch_tp.launch import launch, launched_by_torchrun, rank_device
from torch_tp.models.llama import ModelArgs, Transformer, tensor_parallel_plan

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, ffn_hidden=128, max_seq_len=32)
STEPS, EVERY = 8, 3


def _batch(step):
    """The data position is the step: batch ``step`` is the same in every job."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, ARGS.vocab_size, (4, 16), generator=generator)
    return tokens.to(rank_device()), ((5 * tokens + 3) % ARGS.vocab_size).to(rank_device())


def _model_and_optimizer():
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = Transformer(ARGS)
    parallelize_module(model, mesh, tensor_parallel_plan(sequence_parallel=True))
    model.to_empty(device=rank_device())
    init_parameters(model, seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _sha256(model):
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode() + param.full_tensor().detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def _single_process_losses(last_step):
    """The whole model in one process (on each rank), from the same init_parameters values."""
    reference = Transformer(ARGS).to(rank_device())
    init_parameters(reference, seed=0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    return [_train_step(reference, optimizer, step) for step in range(1, last_step + 1)]


def _train_step(model, optimizer, step):
    """One AdamW step on step ``step``'s batch; the loss as a float."""
    tokens, targets = _batch(step)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def job(directory, last_step, name, digest_file):
    """Train steps (resumed from ``directory``'s newest checkpoint, if any) to ``last_step``.

    Without ``directory`` (the job that never stopped), compare with the digest the resumed job
    wrote to ``digest_file`` and with one process, and end with the verdict."""
    model, optimizer = _model_and_optimizer()
    state = load_training_state(directory, model, optimizer) if directory else None
    first = state.step + 1 if state else 1
    losses = []
    for step in range(first, last_step + 1):
        losses.append(_train_step(model, optimizer, step))
        if directory and step % EVERY == 0:
            save_training_state(directory, step, model, optimizer, extra={"data_position": step})
    digest = _sha256(model)
    if dist.get_rank() == 0:
        resumed = f"resumed from {state.path.name}, " if state else ""
        kept = f"; newest checkpoint: {latest_checkpoint(directory).name}" if directory else ""
        print(f"{name}: {resumed}trained steps {first}-{last_step}{kept}")
        print(f"  parameters sha256 {digest}")
    if directory:
        if dist.get_rank() == 0:
            with open(digest_file, "w") as f:
                f.write(digest)
        return
    with open(digest_file) as f:  # rank 0 wrote it; every rank runs on this machine
        resumed_digest = f.read()
    conclude([
        check("resumed job's parameters vs the never-stopped job's (SHA-256 digests that differ)",
              int(resumed_digest != digest), 0),
        compare("never-stopped job's loss per step", losses, _single_process_losses(last_step),
                rtol=1e-5, index_name="step"),
    ])


def main():
    # under torchrun every rank runs this file: the directory's name comes from the job's id
    run = os.environ.get("TORCHELASTIC_RUN_ID") if launched_by_torchrun() else None
    directory = os.path.join(tempfile.gettempdir(), f"torch_tp_resume_{run}") if run else tempfile.mkdtemp()
    digest_file = os.path.join(directory, "resumed.sha256")
    try:
        launch(job, directory, 5, "job 1 (dies after step 5)", digest_file, nproc=2)
        launch(job, directory, STEPS, "job 2 (started again)", digest_file, nproc=2)
        launch(job, None, STEPS, "job 3 (never stopped)", digest_file, nproc=2)
    finally:
        if not launched_by_torchrun() or int(os.environ.get("RANK", "0")) == 0:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
