"""Model-state memory per rank: the ZeRO formulas, FSDP2's own layout, and the bytes a rank really holds.

Model state is parameters, gradients and optimizer state; activations, temporary buffers and the
allocator's fragmentation come on top and are *not* in the formulas. P is the parameter count, N the
ranks that share the state. Every formula depends on the precision, so each names its own:

    ZeRO paper, mixed-precision Adam (2 bytes of bf16 or fp16 weights, 2 of gradients, 12 of fp32 master
    weights, momentum and variance): DDP 16P, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N
    fp32 Adam (4 + 4 + 8 bytes):       DDP 16P, ZeRO-1 8P + 8P/N,  ZeRO-2 4P + 12P/N, ZeRO-3 16P/N
    FSDP2 (fsdp_estimate), which keeps fp32 shards of parameters and gradients and Adam's fp32 moments:
    16P/N at rest in either precision; without resharding after forward also the gathered weights,
    2P + 16P/N with bf16 compute, 4P + 16P/N in fp32

    dtlib.measure.memory.estimate(7.5e9, 64, "zero3") / 1e9    # 1.875 GB per rank (the paper: 1.9 GB)

GB here is 1e9 bytes, GiB 2**30.

On a GPU, :func:`allocator` reads what CUDA's caching allocator says beside this bookkeeping: the formulas
predict :func:`measured` (model state); ``max_memory_allocated`` adds activations, the gathered weights and the
communication buffers (all-gather outputs, reduce-scatter inputs) at their peak, and ``memory_reserved`` adds
the blocks the allocator keeps cached for reuse.
"""

from __future__ import annotations

from typing import Any

import torch

from dtlib.arguments import finite, whole

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
#: fp32 Adam, as PyTorch's DDP and FSDP2 keep a model's state: 4 bytes of weights, 4 of gradients, 8 of Adam's two
#: moments per parameter (16 in all). ``breakdown(P, N, stage, **FP32_ADAM)``.
FP32_ADAM = {"param_bytes": 4, "grad_bytes": 4, "optim_bytes_per_param": 8}
ALIASES = {"no_shard": "ddp", "zero0": "ddp", "shard_grad_op": "zero2", "full_shard": "zero3",
           "hybrid_shard": "zero3"}


def canonical(strategy: str) -> str:
    """``"full_shard"`` -> ``"zero3"``; unknown names get a clear error."""
    name = ALIASES.get(strategy.lower(), strategy.lower())
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES + tuple(ALIASES))}")
    return name


def breakdown(num_params: float, world_size: int, strategy: str, *, param_bytes: float = 2, grad_bytes: float = 2,
              optim_bytes_per_param: float = 12) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer state under ``strategy``, in the ZeRO paper's
    layout: the defaults are its mixed-precision Adam (2 + 2 + 12 bytes per parameter); pass 4, 4 and 8
    for fp32 Adam.

    ZeRO-1 shards the optimizer state over the ``world_size`` ranks, ZeRO-2 also the
    gradients, ZeRO-3 also the parameters. ``"hybrid_shard"`` counts as ZeRO-3 within
    one shard group: pass the shard group's size as ``world_size``.
    Example: ``breakdown(1e9, 8, "zero2")["gradients"] == 2e9 / 8``.
    """
    num_params = finite("num_params", num_params)
    world_size = whole("world_size", world_size)
    sizes = [finite(name, value) for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                                                     ("optim_bytes_per_param", optim_bytes_per_param))]
    level = STRATEGIES.index(canonical(strategy))  # 0 = DDP ... 3 = ZeRO-3
    share = 1 / world_size
    return {
        "parameters": num_params * sizes[0] * (share if level >= 3 else 1),
        "gradients": num_params * sizes[1] * (share if level >= 2 else 1),
        "optimizer_state": num_params * sizes[2] * (share if level >= 1 else 1),
    }


def estimate(num_params: float, world_size: int, strategy: str, *, param_bytes: float = 2, grad_bytes: float = 2,
             optim_bytes_per_param: float = 12) -> float:
    """Bytes of model state per rank in the ZeRO paper's layout. With the defaults (mixed-precision Adam):
    16P (DDP), 4P + 12P/N (ZeRO-1), 2P + 14P/N (ZeRO-2), 16P/N (ZeRO-3). With fp32 Adam (4, 4, 8):
    16P, 8P + 8P/N, 4P + 12P/N, 16P/N.

    Example: ``round(estimate(7.5e9, 64, "zero1") / 1e9, 1) == 31.4`` (the ZeRO paper's figure).
    """
    return sum(breakdown(num_params, world_size, strategy, param_bytes=param_bytes, grad_bytes=grad_bytes,
                         optim_bytes_per_param=optim_bytes_per_param).values())


def fsdp_breakdown(num_params: float, world_size: int, *, reshard_after_forward: bool = True,
                   compute_bytes: float = 2, moment_bytes: float = 8) -> dict[str, float]:
    """Bytes per rank that FSDP2 (``fully_shard``) holds at its peak, over a shard group of ``world_size``.

    FSDP2 keeps each parameter's shard in fp32 (4P/N: with a ``MixedPrecisionPolicy`` it is also the
    master copy the optimizer updates) and each gradient's shard in fp32 (4P/N, whatever ``reduce_dtype``),
    and the optimizer keeps its moments beside them (``moment_bytes``: 8 for Adam(W), 4 for SGD with
    momentum), so 16P/N at rest. With ``reshard_after_forward=False`` the gathered weights stay from
    forward to backward, a second copy beside the shards, in the compute dtype (``compute_bytes``: 2 for
    ``param_dtype=torch.bfloat16``, 4 in fp32): 2P + 16P/N or 4P + 16P/N. Like the ZeRO formulas, this
    counts every piece at once, and leaves out the one unit that full sharding gathers at a time.
    Example: ``sum(fsdp_breakdown(7e9, 8, reshard_after_forward=False).values()) / 1e9 == 28.0``.
    """
    num_params = finite("num_params", num_params)
    world_size = whole("world_size", world_size)
    compute_bytes = finite("compute_bytes", compute_bytes)
    moment_bytes = finite("moment_bytes", moment_bytes)
    share = num_params / world_size
    return {"parameters": 4 * share, "gradients": 4 * share, "optimizer_state": moment_bytes * share,
            "gathered": 0.0 if reshard_after_forward else compute_bytes * num_params}


def fsdp_estimate(num_params: float, world_size: int, *, reshard_after_forward: bool = True,
                  compute_bytes: float = 2, moment_bytes: float = 8) -> float:
    """The sum of :func:`fsdp_breakdown`: 16P/N, or 2P + 16P/N without resharding after forward (bf16
    compute, Adam). Example: ``fsdp_estimate(1e9, 8) / 1e9 == 2.0``."""
    return sum(fsdp_breakdown(num_params, world_size, reshard_after_forward=reshard_after_forward,
                              compute_bytes=compute_bytes, moment_bytes=moment_bytes).values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def nbytes(tensors: Any) -> int:
    """Bytes of storage behind ``tensors`` on this rank (a DTensor's local shard), each storage once."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        local = _local(tensor)
        if local.device.type == "meta":
            continue
        key = local.untyped_storage().data_ptr()
        if key in seen and key != 0:
            continue  # views of one storage (FSDP1's flat parameter) count once
        seen.add(key)
        total += local.untyped_storage().nbytes()
    return total


def allocator(device: torch.device) -> dict[str, int] | None:
    """CUDA's own numbers for ``device``, in bytes: ``allocated`` now, ``peak`` (``max_memory_allocated``
    since the last ``torch.cuda.reset_peak_memory_stats``) and ``reserved`` (held by the caching allocator).
    None on any other device: a CPU has no such allocator to ask.

    On one H100 (docs/results/gpu_run.md) the peak sat above :func:`measured`'s model state, as the module
    docstring says it must (tests/gpu/test_gpu_training.py, tests/measure/test_memory.py).
    """
    if device.type != "cuda":
        return None
    return {"allocated": torch.cuda.memory_allocated(device), "peak": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device)}


def measured(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for ``model``'s parameters and gradients and ``optimizer``'s state.

    Counts the storage behind each tensor (a DTensor's local shard, FSDP1's flat
    parameter with its padding), each storage once.
    Example: ``measured(model, optimizer)["parameters"]``.
    """
    params = list(model.parameters())
    out = {"parameters": nbytes(params), "gradients": nbytes(p.grad for p in params if p.grad is not None)}
    states = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()
                                           if isinstance(v, torch.Tensor)]
    out["optimizer_state"] = nbytes(states)
    return out


def llama_block_params(hidden: int, heads: int, kv_heads: int, ffn: int) -> int:
    """Parameters of one Llama block: q and o (h x h), k and v (h x h kv_heads/heads), gate, up and down
    (h x ffn), two norms. Example: ``llama_block_params(4096, 32, 32, 11008)`` is 202,383,360 (Llama 2 7B's)."""
    kv = hidden * kv_heads // heads
    return 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden


def activation_bytes(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, tokens: int, *,
                     checkpointing: bool = False, kernels: str = "cuda") -> float:
    """Bytes a rank holds at its step's peak beyond model state, for a Llama-shaped model (bf16 compute, RMSNorm,
    SwiGLU MLP, grouped-query attention with fused SDPA) sharded with FSDP2, on ``tokens`` tokens per rank
    (sequence length x micro-batch), the ``layers`` blocks alike, with the kernels of a GPU (``"cuda"``) or of
    this CPU (``"cpu"``).

    Saved for backward, per block and token: A = 12h + 4h x kv_heads/heads + 8 ffn bytes on a GPU. This is
    Korthikanti et al.'s count (2022, "Reducing Activation Recomputation in Large Transformer Models": 34 sbh +
    5 a s^2 b for GPT) redone for this block as torch runs it: each RMSNorm saves its bf16 input (2h; CUDA's fused
    kernel, beside one fp32 number per token), the attention input and the MLP input in bf16 (2h each), q, k, v
    and the attention output (2h, 4h kv/heads, 2h; no s^2 term: the fused kernel saves its log-sum-exp, not the
    scores), and the MLP's gate, up, SiLU and product (8 ffn). On a CPU, torch's composite RMSNorm saves its input
    and its normalised input in fp32 instead, 8h each: A grows by 12h (24h + 4h kv/heads + 8 ffn). Beside them the
    logits, about 14 bytes per token and word (bf16, their fp32 copy for the loss, log-softmax's output and its
    gradient), and FSDP's transients, about 10 bytes per parameter of one block (two blocks' gathered bf16 weights
    and one block's unsharded gradients):

        no checkpointing:   tokens x (L A + 14 V) + 10 x block
        checkpointing:      tokens x (L 2h + max(14 V, 2 A)) + 10 x block     (each block keeps its bf16 input;
                            at the peak either the logits or one block recomputed, with its gradients, are live)

    Checked against the simulator of :mod:`dtlib.sim`, with either kernels: within 7% without checkpointing and
    8% with, for Llama 2 7B, 13B and 70B and another shape at 2k to 8k tokens (tests/sim checks three of them).
    Example::

        activation_bytes(32, 4096, 32, 32, 11008, 32000, 4096) / 2**30    # about 22 GiB: Llama 2 7B, 4k tokens
    """
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads),
                        ("ffn", ffn), ("vocab", vocab), ("tokens", tokens)):
        whole(name, value)
    if kernels not in ("cpu", "cuda"):
        raise ValueError(f"kernels must be 'cuda' (a GPU's) or 'cpu' (this CPU's), got {kernels!r}")
    norms = 4 * hidden if kernels == "cuda" else 16 * hidden  # two RMSNorms' saved inputs
    per_block = norms + 8 * hidden + 4 * hidden * kv_heads / heads + 8 * ffn
    block = llama_block_params(hidden, heads, kv_heads, ffn)
    logits = 14 * vocab
    if checkpointing:
        return tokens * (layers * 2 * hidden + max(logits, 2 * per_block)) + 10 * block
    return tokens * (layers * per_block + logits) + 10 * block
