"""A small Llama-style transformer and its tensor-parallel plans.

The model is what tests, the demo and the tutorials parallelize: token embedding,
pre-norm blocks of attention (``wq``/``wk``/``wv``/``wo``, rotary positions, causal) and a
SwiGLU feed-forward (``w1``/``w2``/``w3``), an ``RMSNorm`` written in Python, and an output
head. Attention works out its local head count from its input, so it runs unchanged
whether ``wq`` is whole or sharded.

:func:`tensor_parallel_plan` is torch_tp's documented Llama plan. It differs from the
usual upstream plan in one place: each attention and feed-forward module turns its input
into a DTensor *once* (``PrepareModuleInput``), so ``wq``/``wk``/``wv`` (and ``w1``/``w3``)
share one input and their input gradients are summed before a single collective: 2
backward all-reduces per block instead of 5.

Example::

    >>> model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64))
    >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 64])
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import torch_tp.parallel as _torch_tp_styles
from torch_tp.parallel import ParallelStyle

__all__ = [
    "ModelArgs",
    "RMSNorm",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Transformer",
    "tensor_parallel_plan",
    "block_tensor_parallel_plan",
]


@dataclass(frozen=True)
class ModelArgs:
    """Sizes of :class:`Transformer`. ``dim`` must be divisible by ``n_heads``.

    ``tie_embeddings``: the output head shares the token embedding's weight (Gemma, small
    Llamas). ``qk_norm``: a per-head RMSNorm on queries and keys, as in Qwen3.

    Example::

        >>> ModelArgs(dim=64, n_heads=8).head_dim
        8
    """

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 128
    ffn_hidden: int = 96
    norm_eps: float = 1e-5
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim with a learned per-feature ``weight``.

    Example::

        >>> y = RMSNorm(4)(torch.tensor([[3.0, 3.0, 3.0, 3.0]]))
        >>> torch.allclose(y, torch.ones(1, 4))
        True
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """``(max_seq_len, head_dim // 2, 2)`` table of cos/sin rotations for rotary positions."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs of ``x`` (``batch, seq, heads, head_dim``) by position."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = rope[: x.shape[1], None, :, 0], rope[: x.shape[1], None, :, 1]
    real = pairs[..., 0] * cos - pairs[..., 1] * sin
    imag = pairs[..., 0] * sin + pairs[..., 1] * cos
    return torch.stack([real, imag], dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal multi-head self-attention; the head count follows ``wq``'s (local) output size.

    With ``args.qk_norm`` a per-head RMSNorm (``q_norm``, ``k_norm``) runs on the queries and
    keys, Qwen3-style. ``tensor_parallel_units`` tells torch_tp's plan check that a shard of
    ``wq``/``wk``/``wv``/``wo`` must hold whole heads.

    Example::

        >>> args = ModelArgs(dim=16, n_heads=2, max_seq_len=8)
        >>> Attention(args)(torch.randn(1, 8, 16), rotary_table(8, 8, 1e4)).shape
        torch.Size([1, 8, 16])
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        # forward splits features into heads: a tensor-parallel shard must hold whole heads
        self.tensor_parallel_units = {f"{name}.weight": args.head_dim for name in ("wq", "wk", "wv", "wo")}

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seqlen = x.shape[0], x.shape[1]
        # heads from the features, not -1: a batch of 0 tokens has no size to infer
        q, k, v = (self._heads(proj(x), bsz, seqlen) for proj in (self.wq, self.wk, self.wv))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, out.shape[1] * self.head_dim))

    def _heads(self, projected: torch.Tensor, bsz: int, seqlen: int) -> torch.Tensor:
        """``(B, S, heads * head_dim)`` as ``(B, S, heads, head_dim)`` (this rank's heads under TP)."""
        return projected.view(bsz, seqlen, projected.shape[-1] // self.head_dim, self.head_dim)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1(x)) * w3(x))``.

    Example::

        >>> FeedForward(ModelArgs(dim=16, ffn_hidden=24))(torch.randn(2, 16)).shape
        torch.Size([2, 16])
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then feed-forward.

    Example::

        >>> args = ModelArgs(dim=16, n_heads=2, max_seq_len=8)
        >>> TransformerBlock(args)(torch.randn(1, 8, 16), rotary_table(8, 8, 1e4)).shape
        torch.Size([1, 8, 16])
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm and output head (logits).

    Example::

        >>> model = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32))
        >>> model(torch.zeros(2, 4, dtype=torch.long)).shape
        torch.Size([2, 4, 32])
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer(
            "rope", rotary_table(args.head_dim, args.max_seq_len, args.rope_theta), persistent=False
        )

    def reset_parameters(self) -> None:
        """Recompute the rotary table (a model built on ``meta`` has none until this runs)."""
        args = self.args
        with torch.no_grad():
            self.rope.copy_(rotary_table(args.head_dim, args.max_seq_len, args.rope_theta))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def _require_torch_tp_options(sequence_parallel: bool, overlap: bool, qk_norm: bool, styles: ModuleType,
                              comm_dtype: torch.dtype | None = None) -> None:
    if comm_dtype is not None and (not sequence_parallel or styles is not _torch_tp_styles):
        raise ValueError(
            f"torch_tp.models.llama: comm_dtype={comm_dtype} quantizes the sequence-parallel collectives of "
            f"torch_tp's styles; pass sequence_parallel=True (and torch_tp's styles), or comm_dtype=None"
        )
    if overlap and not sequence_parallel:
        raise ValueError(
            "overlap=True fuses the sequence-parallel all-gathers and reduce-scatters into the "
            "matmuls; pass sequence_parallel=True as well"
        )
    if overlap and styles is not _torch_tp_styles:
        raise ValueError(f"overlap=True needs torch_tp's styles; {styles.__name__} has no overlap option")
    if qk_norm and styles is not _torch_tp_styles:
        raise ValueError(f"qk_norm=True needs torch_tp's ReplicateParallel; {styles.__name__} has none")


def block_tensor_parallel_plan(
    *,
    sequence_parallel: bool = False,
    overlap: bool = False,
    qk_norm: bool = False,
    prefix: str = "",
    styles: ModuleType = _torch_tp_styles,
    comm_dtype: torch.dtype | None = None,
) -> dict[str, ParallelStyle]:
    """The plan for one :class:`TransformerBlock` (keys relative to the block, or under ``prefix``).

    Without sequence parallelism activations between blocks are replicated; with it they
    are sharded on the sequence dim (1) and the norms run on sequence shards. ``styles`` is
    the module the style classes come from: torch_tp's by default, or
    ``torch.distributed.tensor.parallel`` for the same plan in upstream's styles.

    ``overlap=True`` (with ``sequence_parallel=True``) fuses each Colwise layer's input
    all-gather and each Rowwise layer's reduce-scatter into its matmul
    (``ColwiseParallel(overlap=True)``, ``RowwiseParallel(overlap=True)``). wq/wk/wv
    (w1/w3) read one input, so they share one fused all-gather (see
    ``docs/overlap.md``): the same bytes as the unfused plan,
    every transfer overlapping a matmul.

    ``comm_dtype=torch.int8`` (with ``sequence_parallel=True``) moves every sequence-parallel
    all-gather and reduce-scatter as int8 with one float32 scale per token (the styles'
    ``comm_dtype``): the block inputs stay sequence-sharded and wq/wk/wv (w1/w3) share one
    int8 gather, so the collectives are the unfused plan's, a quarter of the bytes.

    ``qk_norm=True`` (a model built with ``ModelArgs(qk_norm=True)``) runs the per-head
    ``q_norm``/``k_norm`` on the local heads with replicated weights whose gradients are
    summed over the ranks: ``ReplicateParallel(input_layouts=Shard(2))``.

    Example::

        >>> sorted(block_tensor_parallel_plan())[:2]
        ['attention', 'attention.w[kqv]']
        >>> block_tensor_parallel_plan(sequence_parallel=True, overlap=True)["attention.wo"]
        RowwiseParallel(input_layouts=None, output_layouts=Shard(dim=1), use_local_output=True, overlap=True)
    """
    _require_torch_tp_options(sequence_parallel, overlap, qk_norm, styles, comm_dtype)
    between = Shard(1) if sequence_parallel else Replicate()
    # Unfused: one DTensor input per module, gathered once: wq/wk/wv (w1/w3) share it, so
    # their input grads are summed as partial sums and reduced by a single collective.
    # Fused (or int8): the input stays sequence-sharded; the sibling Colwise layers gather it
    # in one shared op, and their input grads are reduce-scattered in one op.
    gathers_itself = overlap or comm_dtype is not None
    block_input = between if gathers_itself else Replicate()
    fused = {**(dict(overlap=True) if overlap else {}), **(dict(comm_dtype=comm_dtype) if comm_dtype is not None else {})}
    colwise = styles.ColwiseParallel(input_layouts=between, **fused) if gathers_itself else styles.ColwiseParallel()
    plan: dict[str, ParallelStyle] = {
        "attention": styles.PrepareModuleInput(
            input_layouts=(between, None), desired_input_layouts=(block_input, None)
        ),
        "attention.w[kqv]": colwise,
        "attention.wo": styles.RowwiseParallel(output_layouts=between, **fused),
        "feed_forward": styles.PrepareModuleInput(
            input_layouts=(between,), desired_input_layouts=(block_input,)
        ),
        "feed_forward.w[13]": colwise,
        "feed_forward.w2": styles.RowwiseParallel(output_layouts=between, **fused),
    }
    if sequence_parallel:
        plan["attention_norm"] = styles.SequenceParallel()
        plan["ffn_norm"] = styles.SequenceParallel()
    if qk_norm:  # (batch, seq, heads, head_dim) on the local heads
        plan["attention.[qk]_norm"] = styles.ReplicateParallel(input_layouts=Shard(2))
    return {f"{prefix}{key}": style for key, style in plan.items()}


def tensor_parallel_plan(
    *,
    sequence_parallel: bool = False,
    overlap: bool = False,
    qk_norm: bool = False,
    styles: ModuleType = _torch_tp_styles,
    comm_dtype: torch.dtype | None = None,
) -> dict[str, ParallelStyle]:
    """torch_tp's documented tensor-parallel plan for :class:`Transformer`.

    The output head returns replicated logits, so the loss is computed as in a
    single-process model. ``overlap``, ``qk_norm``, ``comm_dtype`` and ``styles`` as in
    :func:`block_tensor_parallel_plan` (with ``overlap=True`` the output head fuses its input
    all-gather too; with ``comm_dtype=torch.int8`` the embedding's reduce-scatter and the
    head's all-gather move int8 too). A model with ``tie_embeddings`` keeps its tie: the embedding
    (``RowwiseParallel``) and the head (``ColwiseParallel``) both place the weight as ``Shard(0)``.

    Example::

        >>> plan = tensor_parallel_plan(sequence_parallel=True)
        >>> plan["norm"]
        SequenceParallel(sequence_dim=1, use_local_output=False)
    """
    _require_torch_tp_options(sequence_parallel, overlap, qk_norm, styles, comm_dtype)
    between = Shard(1) if sequence_parallel else Replicate()
    fused = dict(overlap=True) if overlap else {}
    int8 = dict(comm_dtype=comm_dtype) if comm_dtype is not None else {}
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": styles.RowwiseParallel(input_layouts=Replicate(), output_layouts=between, **int8),
        **block_tensor_parallel_plan(
            sequence_parallel=sequence_parallel, overlap=overlap, qk_norm=qk_norm, prefix="layers.*.", styles=styles,
            comm_dtype=comm_dtype,
        ),
        "output": styles.ColwiseParallel(input_layouts=between, output_layouts=Replicate(), **fused, **int8),
    }
    if sequence_parallel:
        plan["norm"] = styles.SequenceParallel()
    return plan
