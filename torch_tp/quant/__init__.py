"""torch_tp.quant: int8 symmetric weight quantization that composes with DTensor and the TP styles.

Weight-only by default; ``Int8SymmetricWeightConfig(activations="int8")`` is W8A8 (each linear
layer's input quantized per token, an exact int8 x int8 product; see ``_ops_matmul.py``).

Importing this module imports torchao (quietly: its CPU-only "Failed to load ... .so"
warnings are suppressed). ``import torch_tp`` alone does not import it.

Example::

    >>> import torch
    >>> from torch_tp.quant import Int8SymmetricTensor
    >>> q = Int8SymmetricTensor.from_hp(torch.randn(8, 4))
    >>> q.qdata.dtype, q.shape
    (torch.int8, torch.Size([8, 4]))
"""

from torch_tp.quant.int8_tensor import Int8SymmetricTensor

# The op tables: each registers its aten ops on Int8SymmetricTensor.implements.
from torch_tp.quant import _ops_checkpoint, _ops_collective, _ops_fsdp, _ops_matmul, _ops_overlap, _ops_shape  # noqa: E402,F401,I001
from torch_tp.quant.config import Int8SymmetricWeightConfig, quantize_module_weight

__all__ = ["Int8SymmetricTensor", "Int8SymmetricWeightConfig", "quantize_module_weight"]
