"""Tensor-parallel transformations as plain functions, for users who prefer them to styles.

``torch_tp.functional.colwise(module, mesh, **layouts)`` runs exactly the code that
``parallelize_module(root, mesh, {path: ColwiseParallel(**layouts)})`` runs for that
module: each style's ``apply_to`` calls the function of the same name here. Like every
``torch.nn`` transform they change the module in place and return it.

Example::

    >>> # xdoctest: +SKIP("needs an initialized process group")
    >>> import torch_tp.functional as tpf
    >>> tpf.colwise(model.ffn.w1, mesh)
    >>> tpf.rowwise(model.ffn.w2, mesh, output_layouts=Shard(1))
    >>> tpf.prepare_input(model.ffn, mesh, input_layouts=Shard(1), desired_input_layouts=Replicate())
"""

from torch_tp.parallel.functional import (
    colwise,
    prepare_input,
    prepare_input_output,
    prepare_output,
    replicate,
    rowwise,
    sequence_parallel,
    spatial,
)

__all__ = [
    "colwise",
    "rowwise",
    "sequence_parallel",
    "spatial",
    "prepare_input",
    "prepare_output",
    "prepare_input_output",
    "replicate",
]
