"""Small CNNs for spatial parallelism: ResNet-, ConvNeXt- and EfficientNet-like classifiers and a U-Net.

The building blocks are the ones third-party model zoos use, written here so the tests need
no model package: a BatchNorm subclass that applies its activation in its own forward
(timm's ``BatchNormAct2d``), a channels-last ``LayerNorm2d`` (ConvNeXt), squeeze-excite
(a spatial mean inside a block), depthwise and strided convolutions, Hardswish / SiLU /
GELU, max and average pooling, global pooling and a linear head, and a U-Net's skip
concatenations and upsampling. Each model is small enough to train on a CPU in a test.

With :class:`~torch_tp.SpatialParallel` on the root module, every layer runs on a strip of
the image and the classifiers' heads on the pooled features::

    parallelize_module(model, mesh, SpatialParallel(dim=3))

Example::

    >>> resnet(num_classes=5)(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 5])
    >>> unet(in_channels=3, num_classes=2)(torch.randn(1, 3, 32, 48)).shape
    torch.Size([1, 2, 32, 48])
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "BatchNormAct2d",
    "LayerNorm2d",
    "ConvBNAct",
    "BasicBlock",
    "ConvNeXtBlock",
    "SqueezeExcite",
    "InvertedResidual",
    "UNetBlock",
    "ClassifierNet",
    "UNet",
    "resnet",
    "convnext",
    "efficientnet",
    "unet",
]


class BatchNormAct2d(nn.BatchNorm2d):
    """BatchNorm followed by an activation, in the norm's own ``forward`` (as timm writes it).

    Example::

        >>> BatchNormAct2d(4, act=nn.SiLU)(torch.randn(2, 4, 3, 3)).shape
        torch.Size([2, 4, 3, 3])
    """

    def __init__(self, num_features: int, act: type[nn.Module] = nn.ReLU):
        super().__init__(num_features)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an ``(N, C, H, W)`` tensor, through channels-last (ConvNeXt, timm).

    Example::

        >>> LayerNorm2d(4)(torch.randn(2, 4, 3, 3)).shape
        torch.Size([2, 4, 3, 3])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvBNAct(nn.Sequential):
    """Convolution (no bias), :class:`BatchNormAct2d`: the unit of ResNets and EfficientNets.

    Example::

        >>> ConvBNAct(3, 8, 3, stride=2)(torch.randn(1, 3, 8, 8)).shape
        torch.Size([1, 8, 4, 4])
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act=nn.ReLU):
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
            BatchNormAct2d(cout, act=act) if act is not None else nn.BatchNorm2d(cout),
        )


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 ConvBN(Act)s and a (strided 1x1 ConvBN) shortcut.

    Example::

        >>> BasicBlock(8, 16, stride=2)(torch.randn(1, 8, 8, 8)).shape
        torch.Size([1, 16, 4, 4])
    """

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = ConvBNAct(cin, cout, 3, stride=stride)
        self.conv2 = ConvBNAct(cout, cout, 3, act=None)
        self.shortcut = ConvBNAct(cin, cout, 1, stride=stride, act=None) if stride > 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(self.conv1(x)) + self.shortcut(x))


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: depthwise 7x7, :class:`LayerNorm2d`, pointwise 4x expansion, GELU,
    pointwise projection, layer scale, residual.

    Example::

        >>> ConvNeXtBlock(8)(torch.randn(1, 8, 9, 9)).shape
        torch.Size([1, 8, 9, 9])
    """

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = LayerNorm2d(dim)
        self.pwconv1 = nn.Conv2d(dim, 4 * dim, 1)
        self.act = nn.GELU()
        self.pwconv2 = nn.Conv2d(4 * dim, dim, 1)
        self.gamma = nn.Parameter(torch.full((dim, 1, 1), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.pwconv2(self.act(self.pwconv1(self.norm(self.dwconv(x)))))


class SqueezeExcite(nn.Module):
    """Squeeze-excite: a spatial mean inside the block gates the channels (MobileNetV3, EfficientNet).

    Example::

        >>> SqueezeExcite(8)(torch.randn(1, 8, 5, 5)).shape
        torch.Size([1, 8, 5, 5])
    """

    def __init__(self, channels: int, reduced: int | None = None):
        super().__init__()
        reduced = reduced or max(channels // 4, 1)
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.act = nn.ReLU()
        self.expand = nn.Conv2d(reduced, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.expand(self.act(self.reduce(x.mean((2, 3), keepdim=True)))))


class InvertedResidual(nn.Module):
    """MobileNetV3 / EfficientNet block: pointwise expansion, depthwise 3x3 (maybe strided),
    squeeze-excite, pointwise projection, residual when shapes allow.

    Example::

        >>> InvertedResidual(8, 8, stride=1)(torch.randn(1, 8, 6, 6)).shape
        torch.Size([1, 8, 6, 6])
    """

    def __init__(self, cin: int, cout: int, stride: int = 1, expand: int = 4, act=nn.Hardswish):
        super().__init__()
        hidden = cin * expand
        self.expand = ConvBNAct(cin, hidden, 1, act=act)
        self.depthwise = ConvBNAct(hidden, hidden, 3, stride=stride, groups=hidden, act=act)
        self.se = SqueezeExcite(hidden)
        self.project = ConvBNAct(hidden, cout, 1, act=None)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.se(self.depthwise(self.expand(x))))
        return x + out if self.residual else out


class ClassifierNet(nn.Module):
    """``stem`` -> ``stages`` -> ``pool`` (global average) -> ``head``: the three classifiers' shape.

    Example::

        >>> net = ClassifierNet(nn.Conv2d(3, 4, 3), nn.Identity(), nn.Linear(4, 2))
        >>> net(torch.randn(1, 3, 6, 6)).shape
        torch.Size([1, 2])
    """

    def __init__(self, stem: nn.Module, stages: nn.Module, head: nn.Module):
        super().__init__()
        self.stem, self.stages = stem, stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.stages(self.stem(x))).flatten(1))


def resnet(num_classes: int = 10, width: int = 8) -> ClassifierNet:
    """A two-stage ResNet: 3x3 stride-2 stem, 3x3 stride-2 max pool, basic blocks, global pool, linear.

    Example::

        >>> resnet(num_classes=3)(torch.randn(1, 3, 16, 16)).shape
        torch.Size([1, 3])
    """
    stem = nn.Sequential(ConvBNAct(3, width, 3, stride=2), nn.MaxPool2d(3, stride=2, padding=1))
    stages = nn.Sequential(BasicBlock(width, width), BasicBlock(width, 2 * width, stride=2))
    return ClassifierNet(stem, stages, nn.Linear(2 * width, num_classes))


def convnext(num_classes: int = 10, width: int = 8) -> ClassifierNet:
    """A two-stage ConvNeXt: 4x4 stride-4 patchify stem, blocks, a LayerNorm2d + 2x2 stride-2
    downsampling, global pool, LayerNorm, linear.

    Example::

        >>> convnext(num_classes=3)(torch.randn(1, 3, 32, 32)).shape
        torch.Size([1, 3])
    """
    stem = nn.Sequential(nn.Conv2d(3, width, 4, stride=4), LayerNorm2d(width))
    stages = nn.Sequential(
        ConvNeXtBlock(width),
        nn.Sequential(LayerNorm2d(width), nn.Conv2d(width, 2 * width, 2, stride=2)),
        ConvNeXtBlock(2 * width),
    )
    return ClassifierNet(stem, stages, nn.Sequential(nn.LayerNorm(2 * width), nn.Linear(2 * width, num_classes)))


def efficientnet(num_classes: int = 10, width: int = 8) -> ClassifierNet:
    """An EfficientNet/MobileNetV3-like net: stride-2 stem (SiLU), inverted residuals with
    squeeze-excite (Hardswish), an average pool, a 1x1 head convolution, global pool, linear.

    Example::

        >>> efficientnet(num_classes=3)(torch.randn(1, 3, 16, 16)).shape
        torch.Size([1, 3])
    """
    stem = ConvBNAct(3, width, 3, stride=2, act=nn.SiLU)
    stages = nn.Sequential(
        InvertedResidual(width, width),
        InvertedResidual(width, 2 * width, stride=2),
        nn.AvgPool2d(3, stride=1, padding=1),
        ConvBNAct(2 * width, 4 * width, 1, act=nn.SiLU),
    )
    return ClassifierNet(stem, stages, nn.Linear(4 * width, num_classes))


class UNetBlock(nn.Sequential):
    """Two 3x3 ConvBN(ReLU)s: one level of a U-Net.

    Example::

        >>> UNetBlock(3, 8)(torch.randn(1, 3, 8, 8)).shape
        torch.Size([1, 8, 8, 8])
    """

    def __init__(self, cin: int, cout: int):
        super().__init__(ConvBNAct(cin, cout, 3), ConvBNAct(cout, cout, 3))


class UNet(nn.Module):
    """A U-Net of ``depth`` levels: max-pool down, upsample (bilinear, or a 2x2 stride-2
    transposed convolution) up, skip connections concatenated on the channels; per-pixel logits.

    Example::

        >>> UNet(3, 2, width=4, depth=2)(torch.randn(1, 3, 16, 16)).shape
        torch.Size([1, 2, 16, 16])
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 8, depth: int = 2, transposed: bool = False):
        super().__init__()
        widths = [width * 2**level for level in range(depth + 1)]
        self.down = nn.ModuleList([UNetBlock(in_channels, widths[0])])
        self.down.extend(UNetBlock(widths[i], widths[i + 1]) for i in range(depth))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(widths[i + 1], widths[i + 1], 2, stride=2) if transposed
            else nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
            for i in reversed(range(depth))
        )
        self.merge = nn.ModuleList(UNetBlock(widths[i + 1] + widths[i], widths[i]) for i in reversed(range(depth)))
        self.out = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for level, block in enumerate(self.down):
            x = block(x if level == 0 else self.pool(x))
            skips.append(x)
        x = skips.pop()
        for up, merge in zip(self.up, self.merge):
            x = merge(torch.cat([up(x), skips.pop()], dim=1))
        return self.out(x)


def unet(in_channels: int = 3, num_classes: int = 2, width: int = 8, depth: int = 2, transposed: bool = False) -> UNet:
    """:class:`UNet` with these sizes (input height and width divisible by ``2 ** depth``).

    Example::

        >>> unet(width=4)(torch.randn(1, 3, 16, 32)).shape
        torch.Size([1, 2, 16, 32])
    """
    return UNet(in_channels, num_classes, width=width, depth=depth, transposed=transposed)
