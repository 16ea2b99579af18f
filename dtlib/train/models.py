"""Toy models for the DDP and FSDP notebooks: small, deterministic, nothing downloaded.

``build(name, seed)`` gives the same weights on every rank and in a single process,
which is what the equivalence proofs need::

    model = dtlib.train.models.build("mlp", seed=0)       # (B, 16) -> (B, 1)
    model = dtlib.train.models.build("transformer")       # (B, T) tokens -> (B, T, vocab) logits
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("mlp", "wide_mlp", "transformer", "branchy", "batchnorm")
IN_FEATURES = 16  # inputs of the MLP-like models
VOCAB, SEQ_LEN = 32, 16  # the transformer's tokens


class MLP(nn.Module):
    """``depth`` Linear layers with ReLU between them: (B, in_features) -> (B, out_features)."""

    def __init__(self, in_features: int = IN_FEATURES, hidden: int = 64, out_features: int = 1, depth: int = 3):
        super().__init__()
        sizes = [in_features] + [hidden] * (depth - 1) + [out_features]
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
            layers.append(nn.Linear(fan_in, fan_out))
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape  # (B, T, C)
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        heads = self.heads
        q, k, v = (t.view(batch, seq, heads, dim // heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, C/H)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Token embedding, ``blocks`` identical :class:`Block` s, a final norm and a head: (B, T) -> (B, T, vocab)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, blocks: int = 2, seq_len: int = SEQ_LEN):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        # Linear on (B, T, C) returns a view; FSDP2 warns when a sharded root returns one (an in-place op
        # on it would skip its backward hook), so hand back a tensor of its own. (B, T, vocab)
        return self.head(self.norm(x)).clone()


class BranchyMLP(nn.Module):
    """An MLP with a second head that is used only when ``use_branch`` is True.

    With the branch off, the branch's parameters get no gradient: the case that
    DDP's ``find_unused_parameters`` exists for.
    """

    def __init__(self, in_features: int = IN_FEATURES, hidden: int = 64):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 1)
        self.branch = nn.Linear(hidden, 1)
        self.use_branch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        return self.head(h) + self.branch(h) if self.use_branch else self.head(h)


class BatchNormMLP(nn.Module):
    """Linear, BatchNorm1d, ReLU, Linear: a model with buffers (running mean and variance)."""

    def __init__(self, in_features: int = IN_FEATURES, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build(name: str = "mlp", seed: int = 0) -> nn.Module:
    """A fresh model, the same weights for the same ``seed`` in every process.

    ``"wide_mlp"`` has 797,185 parameters (3.2 MB of float32 gradients), enough to
    fill several DDP buckets. Example: ``build("transformer", seed=0)``.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "mlp":
            return MLP()
        if name == "wide_mlp":
            return MLP(hidden=512, depth=5)
        if name == "transformer":
            return TinyTransformer()
        if name == "branchy":
            return BranchyMLP()
        return BatchNormMLP()


def loss_fn(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error for the MLP-like models, cross-entropy over tokens for the transformer."""
    if name == "transformer":
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output, target)
