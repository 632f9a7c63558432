"""A small MLP-Mixer (timm's layout), written here so the tests need no model package.

Patches come from a strided convolution; each :class:`MixerBlock` mixes the tokens with an MLP
over the transposed patches, then the channels with an MLP, each behind a ``LayerNorm`` and a
residual; the classifier reads the mean over the patches. It ships no tensor-parallel plan:
:func:`torch_tp.suggest_plan` derives one from its dataflow (both MLPs of every block split).

Example::

    >>> mlp_mixer(num_classes=5)(torch.randn(2, 3, 16, 16)).shape
    torch.Size([2, 5])
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MixerBlock", "MlpMixer", "mlp_mixer"]


class MixerBlock(nn.Module):
    """Token mixing (an MLP across the patches) then channel mixing (an MLP across the features).

    Example::

        >>> MixerBlock(tokens=16, dim=32)(torch.randn(2, 16, 32)).shape
        torch.Size([2, 16, 32])
    """

    def __init__(self, tokens: int, dim: int, token_hidden: int | None = None, channel_hidden: int | None = None):
        super().__init__()
        token_hidden, channel_hidden = token_hidden or 2 * tokens, channel_hidden or 4 * dim
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_fc1, self.token_fc2 = nn.Linear(tokens, token_hidden), nn.Linear(token_hidden, tokens)
        self.channel_fc1, self.channel_fc2 = nn.Linear(dim, channel_hidden), nn.Linear(channel_hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.token_fc2(F.gelu(self.token_fc1(self.norm1(x).transpose(1, 2)))).transpose(1, 2)
        x = x + mixed
        return x + self.channel_fc2(F.gelu(self.channel_fc1(self.norm2(x))))


class MlpMixer(nn.Module):
    """Patch embedding, ``depth`` :class:`MixerBlock` s, a final norm, mean pooling, a linear head.

    Example::

        >>> MlpMixer(image_size=16, patch=4, dim=32, depth=1, num_classes=3)(torch.randn(1, 3, 16, 16)).shape
        torch.Size([1, 3])
    """

    def __init__(self, *, image_size: int, patch: int, dim: int, depth: int, num_classes: int, in_channels: int = 3):
        super().__init__()
        tokens = (image_size // patch) ** 2
        self.stem = nn.Conv2d(in_channels, dim, kernel_size=patch, stride=patch)
        self.blocks = nn.Sequential(*(MixerBlock(tokens, dim) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(2).transpose(1, 2)  # (batch, patches, dim)
        return self.head(self.norm(self.blocks(x)).mean(1))


def mlp_mixer(num_classes: int = 10, *, image_size: int = 16, patch: int = 4, dim: int = 32, depth: int = 2) -> MlpMixer:
    """A 2-block MLP-Mixer on 16x16 images (16 patches of 4x4, 32 features): CPU-test sized.

    Example::

        >>> sum(p.numel() for p in mlp_mixer().parameters()) > 0
        True
    """
    return MlpMixer(image_size=image_size, patch=patch, dim=dim, depth=depth, num_classes=num_classes)
