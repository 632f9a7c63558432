"""Small reference models used by tests, the demo and tutorials, with their TP plans."""

from torch_tp.models.llama import (
    ModelArgs,
    Transformer,
    TransformerBlock,
    block_tensor_parallel_plan,
    tensor_parallel_plan,
)

__all__ = [
    "ModelArgs",
    "Transformer",
    "TransformerBlock",
    "block_tensor_parallel_plan",
    "tensor_parallel_plan",
]
