"""Llama-shaped models to simulate: the shape presets (7B, 70B) and the module, built on any device.

The block is the one of Llama 2: RMSNorm, attention with grouped-query heads and rotary positions left out
(they add no parameters and few bytes), RMSNorm, a SwiGLU MLP. ``shape.params`` counts what the module holds.

Example::

    LLAMA["7B"].params / 1e9            # 6.74
    with torch.device("meta"):
        model = Llama(LLAMA["7B"])      # no memory: the simulator fills it with fake tensors
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from dtlib.measure.memory import llama_block_params


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped transformer: ``layers`` blocks of width ``hidden``, ``heads`` query heads sharing
    ``kv_heads`` key/value heads, an MLP of width ``ffn`` and a vocabulary of ``vocab`` tokens."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 32_000

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden ({self.hidden}) must divide by heads ({self.heads}), and heads by kv_heads "
                             f"({self.kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def block_params(self) -> int:
        """Parameters of one block (:func:`dtlib.measure.memory.llama_block_params`)."""
        return llama_block_params(self.hidden, self.heads, self.kv_heads, self.ffn)

    @property
    def params(self) -> int:
        """Every parameter: the blocks, the embedding, the final norm and the output head (not tied)."""
        return self.layers * self.block_params + 2 * self.vocab * self.hidden + self.hidden

    def with_layers(self, layers: int) -> Shape:
        """The same model, ``layers`` deep (the simulator runs a shallow copy and scales by depth)."""
        return replace(self, layers=layers)


#: The shapes of Llama 2 7B and 70B (Touvron et al., 2023), and a tiny one that live ranks can run. Read-only:
#: notebook 14's checkers look their problem up here, so no cell's assignment can change it.
LLAMA: Mapping[str, Shape] = MappingProxyType({
    "7B": Shape(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11_008),
    "13B": Shape(layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13_824),
    "70B": Shape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28_672),
    "tiny": Shape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=256),
})


#: Whose kernels the simulator keeps tensors for backward as: "cuda", a GPU's (CUDA's fused RMSNorm), or "cpu",
#: this CPU's (torch's composite RMSNorm). Attention needs no choice: on this CPU, as on an A100 or H100 in bf16,
#: SDPA runs a flash kernel that keeps q, k and v (k and v at their own heads under GQA), its output and one fp32
#: log-sum-exp per head and token. CUDA's memory-efficient kernel, which SDPA takes where flash cannot run (before
#: the A100, say), keeps the same, its log-sum-exp padded to a multiple of 32 tokens: at the simulated lengths, all
#: multiples of 32, the same bytes (tests/sim/test_sim.py holds this to torch's own shapes). It takes no GQA (its
#: shape checks in torch's ``sdp_utils.cpp`` refuse unequal heads), so there SDPA falls back to its math kernel, which
#: keeps the whole attention matrix: 70B on such a GPU is not what the simulator answers for.
KERNELS = ("cuda", "cpu")


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm keeping for backward what CUDA's fused kernel (``aten._fused_rms_norm``) keeps: its input as it
    came (bf16 under mixed precision) and one fp32 reciprocal RMS per row. The CPU's composite RMSNorm keeps two
    fp32 copies of its input instead (the input cast up, and the normalised input): 8 bytes per number against 2.

    Example: ``FusedRMSNorm.apply(x, weight, 1e-6)`` equals ``F.rms_norm(x, x.shape[-1:], weight, 1e-6)``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 arithmetic for 16-bit inputs, as CUDA's
        rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        y = wide * rstd
        return (y if weight is None else y * weight).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        normed, grad = x.to(rstd.dtype) * rstd, grad.to(rstd.dtype)
        scaled = grad if weight is None else grad * weight.to(rstd.dtype)
        grad_x = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        grad_weight = None
        if weight is not None and ctx.needs_input_grad[1]:
            # summed over every dimension but the last, not flattened first: under sequence parallelism x is a
            # DTensor sharded along the sequence, which torch 2.11 refuses to flatten (2.13 redistributes it)
            grad_weight = (grad * normed).sum(dim=tuple(range(x.dim() - 1))).to(weight.dtype)
        return grad_x.to(x.dtype), grad_weight, None


def rms_norm(norm: nn.RMSNorm, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``norm(x)``: torch's own RMSNorm (the kernel of the device it runs on), or, ``fused``, one that keeps what
    CUDA's fused kernel keeps, on any device (:class:`FusedRMSNorm`)."""
    return FusedRMSNorm.apply(x, norm.weight, norm.eps) if fused else norm(x)


class Block(nn.Module):
    """One Llama block. Under tensor parallelism each rank holds ``heads / tp`` heads: the reshapes below
    read the local width, so the same code runs whole and sharded. ``fused_norm``: see :func:`rms_norm`.

    ``sequence_mesh`` (set by sequence parallelism, :func:`dtlib.sim.step.parallelize`): the block's input and
    output are this rank's share of the sequence, and so is what its norms keep; each norm's output is gathered
    whole once, for the projections after it, and ``o`` and ``down`` reduce-scatter their sums back to a share."""

    def __init__(self, shape: Shape, fused_norm: bool = False) -> None:
        super().__init__()
        kv = shape.kv_heads * shape.head_dim
        self.head_dim, self.checkpointing, self.fused_norm = shape.head_dim, False, fused_norm
        self.sequence_mesh: DeviceMesh | None = None
        self.attention_norm, self.mlp_norm = nn.RMSNorm(shape.hidden), nn.RMSNorm(shape.hidden)
        self.q, self.k, self.v = (nn.Linear(shape.hidden, shape.hidden, bias=False),
                                  nn.Linear(shape.hidden, kv, bias=False), nn.Linear(shape.hidden, kv, bias=False))
        self.o = nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.gate = nn.Linear(shape.hidden, shape.ffn, bias=False)
        self.up = nn.Linear(shape.hidden, shape.ffn, bias=False)
        self.down = nn.Linear(shape.ffn, shape.hidden, bias=False)

    def _norm(self, norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)`` over the whole sequence, for the projections after it. Under sequence parallelism: the norm
        of this rank's share, gathered (one all-gather; in backward, one reduce-scatter of the gradient, to which
        each projection adds its part)."""
        if self.sequence_mesh is None:
            return rms_norm(norm, x, self.fused_norm)
        share = DTensor.from_local(x, self.sequence_mesh, [Shard(1)], run_check=False)
        return rms_norm(norm, share, self.fused_norm).redistribute(placements=[Replicate()])

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._norm(self.attention_norm, x)
        batch, seq, _ = y.shape
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (self.q(y), self.k(y), self.v(y)))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, seq, -1))
        y = self._norm(self.mlp_norm, x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():  # keep the input only; backward recomputes the rest
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Llama(nn.Module):
    """Embedding, ``shape.layers`` blocks, a final RMSNorm and the output head: (B, T) tokens -> (B, T, vocab).

    As stage ``stage`` of a pipeline of ``stages``, it holds its share of the blocks (``shape.layers / stages``
    of them), the embedding only on the first stage and the norm and head only on the last: a middle stage maps
    (B, T, hidden) activations to activations. ``fused_norm``: every RMSNorm keeps what CUDA's fused kernel
    keeps, on any device (:class:`FusedRMSNorm`); otherwise torch's own runs, the kernel of the device.
    ``sequence_mesh`` (sequence parallelism): between blocks, and between stages, each rank holds its share of the
    sequence; the first stage splits the embedding's output, the last gathers the whole before its norm (with
    ``loss_parallel``, the head split over the vocabulary, after it: the head's plan gathers).
    """

    def __init__(self, shape: Shape, stage: int = 0, stages: int = 1, fused_norm: bool = False) -> None:
        super().__init__()
        if not 0 <= stage < stages or shape.layers % stages:
            raise ValueError(f"stage {stage} of {stages}: the stages must divide the {shape.layers} layers evenly")
        share = shape.layers // stages
        self.hidden, self.first, self.last = shape.hidden, stage == 0, stage == stages - 1
        self.fused_norm = fused_norm
        self.sequence_mesh: DeviceMesh | None = None
        self.loss_parallel = False  # set with the head split over the vocabulary (dtlib.sim.step.parallelize)
        self.embedding = nn.Embedding(shape.vocab, shape.hidden) if self.first else None
        self.blocks = nn.ModuleList(Block(shape, fused_norm) for _ in range(share))
        self.norm = nn.RMSNorm(shape.hidden) if self.last else None
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False) if self.last else None

    def positions_held(self, seq_len: int) -> int:
        """How many of a sequence's ``seq_len`` positions the activations between blocks hold on this rank."""
        return seq_len if self.sequence_mesh is None else seq_len // self.sequence_mesh.size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.sequence_mesh
        if self.embedding is not None:  # tokens in; a later stage takes the previous stage's activations
            x = self.embedding(x)
            if mesh is not None:  # this rank's share of the sequence; in backward, the whole gradient gathered
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
                x = x.to_local()  # (every tp rank's embedding then gets the same gradient, as without the split)
        for block in self.blocks:
            x = block(x)
        if self.head is None or self.norm is None:
            return x
        if mesh is not None and self.loss_parallel:  # the norm of this rank's share; the head's plan gathers it
            share = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
            return self.head(rms_norm(self.norm, share, self.fused_norm))
        if mesh is not None:
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(placements=[Replicate()])
            x = x.to_local()  # the whole sequence, for the head every rank runs whole
        return self.head(rms_norm(self.norm, x, self.fused_norm))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of ``(B, T, vocab)`` logits against ``(B, T)`` targets, in fp32. Logits sharded over
    the vocabulary (a head laid out with loss parallelism: a DTensor, ``Shard(-1)`` on "tp") are never gathered:
    call it, and the backward, inside ``torch.distributed.tensor.parallel.loss_parallel()``, which computes the
    loss from each rank's share with all-reduces of a few numbers per token."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def vocabulary_sharded(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """torch's ``loss_parallel()`` where ``model``'s head was split over the vocabulary (``model.loss_parallel``,
    set by :func:`dtlib.sim.step.parallelize`), for the forward and backward of the loss; otherwise nothing."""
    return loss_parallel() if getattr(model, "loss_parallel", False) else contextlib.nullcontext()


def llama_like(num_params: float, vocab: int = 32_000) -> Shape:
    """A shape of about ``num_params`` parameters in Llama 2's proportions: 128 of width per layer of depth
    (7B is 4096 wide and 32 deep), heads of 128, an MLP 2.6875 times as wide (rounded to 256), one key/value head
    per query head. For a calculator that knows only the size; pass the real shape where you know it.

    Example: ``llama_like(6.74e9)`` is Llama 2 7B's shape.
    """
    if not num_params > 0:
        raise ValueError(f"num_params must be > 0, got {num_params!r}")
    hidden = max(128, 128 * round((128 * num_params / 12.06) ** (1 / 3) / 128))
    ffn = max(256, 256 * round(2.6875 * hidden / 256))
    one = Shape(layers=1, hidden=hidden, heads=hidden // 128, kv_heads=hidden // 128, ffn=ffn, vocab=vocab)
    layers = max(1, round((num_params - 2 * vocab * hidden - hidden) / one.block_params))
    return one.with_layers(layers)
