"""What many tests share: tolerances, the small Llama they parallelize, int8 weights.

``torch_tp.models`` and ``torch_tp.quant`` (hence torchao) are imported only when a helper
that needs them is called, so importing :mod:`torch_tp.testing` stays light.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

__all__ = ["TOL", "block_linear_fraction", "quantize_weights", "small_llama", "small_llama_args", "tolerance"]

#: float32 agreement between a parallel result and its single-process reference: the two
#: differ only by the order in which partial results are summed.
TOL = dict(rtol=1e-5, atol=1e-5)

# bfloat16 keeps 8 bits of mantissa: partial sums rounded on each rank differ by a
# rounding step of values of magnitude ~1.
_BFLOAT16_TOL = dict(rtol=2e-2, atol=2e-2)

# The sizes of the Llama-style model most tests parallelize: divisible by 2 and 4 ranks
# (4 heads, ffn 48), two layers, short sequences.
_SMALL_LLAMA = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=48, max_seq_len=16)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``rtol``/``atol`` for comparing a sharded result with its unsharded reference in ``dtype``.

    float32: :data:`TOL` (summation order only); bfloat16: ``2e-2`` (partial results are
    rounded to 8 bits before they are summed).

    Example::

        >>> tolerance(torch.float32)
        {'rtol': 1e-05, 'atol': 1e-05}
        >>> torch.testing.assert_close(torch.tensor(1.01), torch.tensor(1.0), **tolerance(torch.bfloat16))
    """
    by_dtype = {torch.float32: TOL, torch.bfloat16: _BFLOAT16_TOL}
    if dtype not in by_dtype:
        raise ValueError(
            f"no shared tolerance for {dtype}; use tolerance(torch.float32) or "
            f"tolerance(torch.bfloat16), or pass rtol/atol chosen for {dtype} explicitly"
        )
    return dict(by_dtype[dtype])


def small_llama_args(**overrides: Any) -> Any:
    """The tests' small :class:`~torch_tp.models.llama.ModelArgs`, with ``overrides`` replacing fields.

    ``dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=48, max_seq_len=16``: every
    sharded size divides by 2 and 4 ranks.

    Example::

        >>> args = small_llama_args(n_layers=1)
        >>> args.dim, args.n_layers, args.n_heads, args.vocab_size, args.ffn_hidden, args.max_seq_len
        (32, 1, 4, 64, 48, 16)
    """
    from torch_tp.models.llama import ModelArgs

    return dataclasses.replace(ModelArgs(**_SMALL_LLAMA), **overrides)


def small_llama(*, seed: int | None = None, **overrides: Any) -> nn.Module:
    """A :class:`~torch_tp.models.llama.Transformer` of :func:`small_llama_args` (``overrides`` apply).

    With ``seed`` it first calls ``torch.manual_seed(seed)``, so a reference and its copy
    to parallelize (or every rank) start from the same weights.

    Example::

        >>> model = small_llama(seed=0, n_layers=1)
        >>> len(model.layers), model(torch.zeros(2, 8, dtype=torch.long)).shape
        (1, torch.Size([2, 8, 64]))
    """
    from torch_tp.models.llama import Transformer

    if seed is not None:
        torch.manual_seed(seed)
    return Transformer(small_llama_args(**overrides))


def quantize_weights(model: nn.Module, *, embeddings: bool = True, activations: str = "float") -> nn.Module:
    """Quantize every ``nn.Linear`` (and ``nn.Embedding``) weight of ``model`` to int8, in place.

    ``torchao.quantize_`` with :class:`torch_tp.quant.Int8SymmetricWeightConfig` and a
    filter on the module type; ``model`` itself is quantized when it matches.
    ``activations="int8"`` makes the weights W8A8 (the activations quantized per token too).
    Returns ``model``.

    Example::

        >>> model = quantize_weights(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4)))
        >>> [type(m.weight).__name__ for m in model]
        ['Int8SymmetricTensor', 'Int8SymmetricTensor']
        >>> type(quantize_weights(nn.Embedding(10, 8), embeddings=False).weight).__name__
        'Parameter'
    """
    from torch_tp.quant import Int8SymmetricWeightConfig  # imports torchao quietly first

    from torchao import quantize_

    kinds = (nn.Linear, nn.Embedding) if embeddings else (nn.Linear,)
    quantize_(model, Int8SymmetricWeightConfig(activations=activations),
              filter_fn=lambda module, fqn: isinstance(module, kinds))
    return model


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in ``text`` (a benchmark's report), as a list of ``{column: cell}`` rows.

    Each row also maps ``"__header__"`` to the table's column names, in order.

    Example::

        >>> rows = markdown_tables("| a | b |\\n|---|---|\\n| 1 | 2 |\\n")[0]
        >>> rows[0]["a"], rows[0]["__header__"]
        ('1', ['a', 'b'])
    """
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif block:
            header, _separator, *rows = block
            tables.append([dict(zip(header, row)) | {"__header__": header} for row in rows])
            block = []
    return tables


def block_linear_fraction(model: nn.Module, plan: dict, prefix: str | tuple[str, ...]) -> float:
    """The share of the bytes of ``model``'s linear layers under ``prefix`` (its blocks; a tuple: any of them) that
    ``plan`` splits (``ColwiseParallel`` / ``RowwiseParallel``); ``Conv1D`` counts as linear.

    Example::

        >>> from torch_tp import ColwiseParallel
        >>> block_linear_fraction(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), {"0": ColwiseParallel()}, "")
        0.5
    """
    from torch_tp.parallel import rules

    sizes = {name: sum(p.numel() * p.element_size() for p in m.parameters())
             for name, m in model.named_modules() if name.startswith(prefix) and rules.is_linear_layer(m)}
    split = sum(size for name, size in sizes.items() if type(plan.get(name)).__name__ in ("ColwiseParallel", "RowwiseParallel"))
    return split / sum(sizes.values()) if sizes else 0.0
