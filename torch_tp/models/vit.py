"""A small vision transformer in timm's layout, written here so the tests need no model package.

timm's ``VisionTransformer`` (which needs torchvision to import) in its own names: a strided
convolution cuts the image into patches, a class token and learned positions join them, and each
:class:`Block` runs :class:`Attention` and :class:`Mlp` behind a ``LayerNorm`` and a residual.
The attention is timm's: one fused ``qkv`` projection whose output is reshaped to
``(batch, tokens, 3, heads, head_dim)`` with the whole model's head count, permuted, and
unbound into ``q``, ``k``, ``v``. It ships no tensor-parallel plan: :func:`torch_tp.suggest_plan`
derives one from its dataflow (``qkv`` split part by part, ``proj`` rowwise, the MLP split).

Example::

    >>> vit(num_classes=5)(torch.randn(2, 3, 16, 16)).shape
    torch.Size([2, 5])
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Attention", "Block", "Mlp", "VisionTransformer", "vit"]


class Attention(nn.Module):
    """timm's multi-head self-attention: a fused ``qkv`` linear, per-head ``q_norm`` / ``k_norm``.

    Example::

        >>> Attention(32, num_heads=4)(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, dim: int, num_heads: int, *, qk_norm: bool = False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class Mlp(nn.Module):
    """timm's MLP: ``fc1``, GELU, ``fc2``.

    Example::

        >>> Mlp(32, 64)(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm attention and MLP, each with a residual.

    Example::

        >>> Block(32, num_heads=4)(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, dim: int, num_heads: int, *, mlp_ratio: int = 4, qk_norm: bool = False):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, qk_norm=qk_norm)
        self.mlp = Mlp(dim, mlp_ratio * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """Patch embedding, class token and positions, ``depth`` :class:`Block` s, a norm, a linear head on the class token.

    Example::

        >>> VisionTransformer(image_size=16, patch=4, dim=32, depth=1, num_heads=4, num_classes=3)(
        ...     torch.randn(1, 3, 16, 16)).shape
        torch.Size([1, 3])
    """

    def __init__(self, *, image_size: int, patch: int, dim: int, depth: int, num_heads: int, num_classes: int,
                 in_channels: int = 3, qk_norm: bool = False):
        super().__init__()
        tokens = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, tokens + 1, dim))
        self.blocks = nn.Sequential(*(Block(dim, num_heads, qk_norm=qk_norm) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (batch, patches, dim)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def vit(num_classes: int = 10, *, image_size: int = 16, patch: int = 4, dim: int = 32, depth: int = 2,
        num_heads: int = 4, qk_norm: bool = False) -> VisionTransformer:
    """A 2-block ViT on 16x16 images (16 patches of 4x4 and a class token, 32 features, 4 heads): CPU-test sized.

    Example::

        >>> sum(p.numel() for p in vit().parameters()) > 0
        True
    """
    return VisionTransformer(image_size=image_size, patch=patch, dim=dim, depth=depth, num_heads=num_heads,
                             num_classes=num_classes, qk_norm=qk_norm)
