"""Tutorial: segment a wide image with a U-Net whose every layer runs on a strip of it.

Run on 2 CPU ranks (gloo)::

    python tutorials/spatial_unet.py

or ``torchrun --nproc-per-node 2 tutorials/spatial_unet.py`` (NCCL on GPUs).

Spatial parallelism is for images too large for one device (satellite and microscopy
tiles, 3-D volumes): each rank holds a vertical strip of the image and of every activation.
One line makes the whole U-Net spatial, in training mode: convolutions swap only the border
columns their windows need (the halo), BatchNorm normalizes with the statistics of the whole
image, pooling, upsampling and skip connections run on the strips, and each rank gets back
its strip of the per-pixel logits. The loss of the strips sums to the whole image's, so
training matches one process step for step (the last line says whether it did; the exit
status is 1 if not).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import SpatialParallel, parallelize_module
from torch_tp._verdict import compare, conclude
from torch_tp.launch import launch, rank_device
from torch_tp.models.cnn import unet

HEIGHT, WIDTH, CLASSES = 32, 192, 3  # a wide image: width is what we shard


def _segmentation_batch(device):
    """An image and a per-pixel class map to learn: the class is where the red channel lies."""
    image = torch.randn(1, 3, HEIGHT, WIDTH, device=device)
    target = torch.bucketize(image[:, 0], torch.tensor([-0.5, 0.5], device=device))
    return image, target


def main(steps=4):
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    reference = unet(in_channels=3, num_classes=CLASSES, width=8, depth=2).to(device)

    # 1. The whole model, in one line: every layer runs on a width strip (dim 3 of NCHW).
    model = parallelize_module(copy.deepcopy(reference), mesh, SpatialParallel(dim=3))

    # 2. Train both on the same batches. The model takes this rank's strip of the image and
    #    returns this rank's strip of the logits; the strips' summed losses are the image's.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    pixels = HEIGHT * WIDTH
    losses, single = [], []
    for step in range(steps):
        image, target = _segmentation_batch(device)
        strip, strip_target = image.chunk(world, dim=3)[rank], target.chunk(world, dim=2)[rank]
        logits = model(strip)
        loss = F.cross_entropy(logits, strip_target, reduction="sum") / pixels  # this strip's share
        ref_loss = F.cross_entropy(reference(image), target)
        for opt, value in ((optimizer, loss), (ref_optimizer, ref_loss)):
            value.backward()
            opt.step()
            opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)  # for printing and the verdict: the image's loss from the strips'
        losses.append(whole.item())
        single.append(ref_loss.item())
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f} (single process {single[-1]:.6f})")

    # 3. Each rank held a strip of every activation: the first level's feature maps are
    #    [1, 8, 32, 192 / world] per rank instead of [1, 8, 32, 192].
    if rank == 0:
        print(f"rank 0 logits strip {tuple(logits.shape)} of the image's {(1, CLASSES, HEIGHT, WIDTH)}")

    # 4. The verdict: float32, so summation order (and pooling ties) only.
    conclude([compare("loss per step", losses, single, rtol=1e-4, atol=1e-4, index_name="step")])


if __name__ == "__main__":
    launch(main, nproc=2)
