"""``Int8SymmetricWeightConfig``: the torchao config that quantizes weights to ``Int8SymmetricTensor``.

Registered with torchao's module-handler registry, so the usual torchao call works::

    torchao.quantize_(model, Int8SymmetricWeightConfig())               # every nn.Linear
    torchao.quantize_(model, Int8SymmetricWeightConfig(),
                      filter_fn=lambda m, fqn: isinstance(m, (nn.Linear, nn.Embedding)))
    torchao.quantize_(model, Int8SymmetricWeightConfig(activations="int8"))  # W8A8 linears
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from torch_tp.quant._torchao import import_torchao
from torch_tp.quant.int8_tensor import Int8SymmetricTensor, check_activations

__all__ = ["Int8SymmetricWeightConfig", "quantize_module_weight"]

_AOBaseConfig = import_torchao("torchao.core.config").AOBaseConfig
_register_handler = import_torchao("torchao.quantization.transform_module").register_quantize_module_handler


@dataclass
class Int8SymmetricWeightConfig(_AOBaseConfig):
    """Int8 weights, symmetric, one scale per output row (``nn.Linear``) or per token row
    (``nn.Embedding``). Biases stay in float.

    Keyword Args:
        activations: ``"float"`` (the default: weight-only, a linear layer's float input is
            multiplied by the int8 weight, exactly ``x @ (q * s).T`` up to float summation
            order) or ``"int8"`` (W8A8: the input is quantized per token, dynamically and
            symmetrically, and the product is the exact int32 ``torch._int_mm`` of the int8
            operands times both scales; the input gradient stays weight-only). An embedding
            lookup multiplies nothing: the mode does not change it.

    Example::

        >>> import torch.nn as nn
        >>> from torchao import quantize_
        >>> model = nn.Sequential(nn.Linear(8, 4))
        >>> quantize_(model, Int8SymmetricWeightConfig())
        >>> type(model[0].weight).__name__, model[0].weight.requires_grad
        ('Int8SymmetricTensor', False)
        >>> quantize_(model, Int8SymmetricWeightConfig(activations="int8"))  # the same int8, W8A8
        >>> model[0].weight.activations
        'int8'
    """

    activations: str = "float"

    def __post_init__(self):
        check_activations(self.activations, "torch_tp.quant.Int8SymmetricWeightConfig")


def quantize_module_weight(module: nn.Module, *, activations: str = "float") -> nn.Module:
    """Replace ``module.weight`` (2-D float) with an ``Int8SymmetricTensor`` parameter, in place.

    A weight that is already an ``Int8SymmetricTensor`` keeps its int8 values and scales and
    takes ``activations`` (so quantizing again switches the mode without re-rounding).

    Example::

        >>> layer = quantize_module_weight(nn.Embedding(10, 4))
        >>> layer.weight.qdata.shape, layer.weight.scale.shape
        (torch.Size([10, 4]), torch.Size([10, 1]))
    """
    check_activations(activations, "torch_tp.quant.quantize_module_weight")
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) and weight is None:
        raise TypeError(
            f"Int8SymmetricWeightConfig quantizes modules with a 2-D `weight` (nn.Linear, "
            f"nn.Embedding); {type(module).__name__} has none — narrow quantize_'s filter_fn"
        )
    if isinstance(weight, Int8SymmetricTensor):
        if weight.activations != activations:
            module.weight = nn.Parameter(weight.with_activations(activations), requires_grad=False)
        return module
    quantized = Int8SymmetricTensor.from_hp(weight.detach(), activations=activations)
    module.weight = nn.Parameter(quantized, requires_grad=False)
    return module


@_register_handler(Int8SymmetricWeightConfig)
def _quantize_with_int8_symmetric(module: nn.Module, config: Int8SymmetricWeightConfig) -> nn.Module:
    return quantize_module_weight(module, activations=config.activations)
