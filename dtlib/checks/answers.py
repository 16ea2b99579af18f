"""Checkers of values typed into a cell: a backend's name (notebook 00), bytes (05), a strategy (06).

Nothing here starts processes. The strategy checker asks :mod:`dtlib.train.guide`'s recommendation. A command
line typed into a cell (07) is :mod:`dtlib.checks.commands`'s.

Example::

    dtlib.checks.backend_choice("gloo", world_size=2)   # ✓ or ✗ with a hint
"""

from __future__ import annotations

from typing import Any

from dtlib.checks.feedback import Feedback
from dtlib.checks.shapes import BYTE_UNITS, Choice, Known, judge_choice, judge_known, shown
from dtlib.launch.spawn import resolve_backend
from dtlib.measure import memory
from dtlib.train import guide

#: Backends torch knows besides gloo and NCCL, which ``backend="auto"`` never picks, and what they are for.
_OTHER_BACKENDS = {"mpi": "MPI, which needs a torch built against an MPI library",
                   "ucc": "UCC, an experimental backend torch must be built with",
                   "xccl": "XCCL, for Intel GPUs", "hccl": "HCCL, for Huawei's Ascend NPUs",
                   "fake": "the fake backend, which moves no data (for tests and simulations)"}
#: Devices a learner may name instead of a backend, and the backend that runs on them.
_DEVICES = {"cpu": "gloo", "cuda": "nccl", "gpu": "nccl"}


def backend_choice(answer: Any, world_size: int = 2) -> Feedback:
    """Notebook 00: which backend does ``dtlib.spawn(backend="auto")`` pick for ``world_size`` ranks here?

    Any spelling of the name is taken ("gloo", " Gloo", ``dist.Backend.GLOO``). A device, "auto" itself, a
    backend that "auto" never picks, or more than one name is refused with what it is.
    """
    expected = resolve_backend("auto", world_size)

    def slip(text: str) -> str | None:
        if text == "auto":
            return ("'auto' is what you ask dtlib.spawn for; the question is which backend it then picks on this "
                    "machine: 'gloo' or 'nccl'.")
        if text in _DEVICES:
            return (f"{text!r} is a device, not a backend: a backend is the library that moves the bytes between "
                    f"ranks ({_DEVICES[text]} is the one for {text} tensors). Which backend does 'auto' pick here?")
        if text in _OTHER_BACKENDS:
            return f"{text!r} is {_OTHER_BACKENDS[text]}; 'auto' never picks it: it chooses between NCCL and gloo."
        if "gloo" in text and "nccl" in text:
            return ("Pick one: 'auto' takes NCCL when every rank can have a GPU of its own and gloo otherwise, so "
                    "on this machine only one of the two is right.")
        return None

    why = "one GPU per rank is available" if expected == "nccl" else "there are not enough GPUs for NCCL"
    return judge_choice(answer, Choice(
        "a backend", ("gloo", "nccl"), expected, f"Right: {expected}, because {why} for {world_size} ranks.",
        why_not=lambda name: (f"NCCL needs one CUDA GPU per rank; this machine cannot give {world_size} ranks a "
                              "GPU each (look at the GPU count above)." if name == "nccl" else
                              f"This machine has enough GPUs for {world_size} ranks, so 'auto' picks NCCL."),
        slip=slip, none_of_them=lambda text: f"{text!r} is not a backend name; the choices are 'gloo' and 'nccl'."))


def fsdp_memory(answer: Any, num_params: int = 28_064, world_size: int = 4, strategy: str = "full_shard") -> Feedback:
    """Notebook 05: bytes of model state per rank for ``num_params`` fp32 parameters trained with Adam
    (4 bytes of weights, 4 of gradients, 8 of Adam's two moments per parameter) under ``strategy``.

    Example: ``fsdp_memory(16 * 28_064)`` says that is DDP's figure, not FULL_SHARD's.
    """
    expected = memory.estimate(num_params, world_size, strategy, **memory.FP32_ADAM)
    p, n = num_params, world_size

    def right(answer: float) -> str:
        alike = {4: "the fp32 weights of the whole model", 2: "the whole model's weights in 16 bits"}
        coincidence = next((f" It is also {what}, {size} x {num_params:,}, which a rank does not hold: the same "
                            f"number only because 16 bytes over {world_size} ranks is {size} bytes per parameter."
                            for size, what in alike.items() if abs(size * num_params - expected) < 0.5), "")
        return (f"Right: {expected:,.0f} bytes per rank; the measured figure above is within 0.1% (Adam's step "
                f"counters are the difference).{coincidence}")

    return judge_known(answer, Known(
        "bytes", expected, right,
        otherwise=lambda answer: (f"{shown(answer)} bytes is off by a factor of {answer / expected:.3g}: count 16 "
                                  f"bytes per parameter (4 weights + 4 gradients + 8 Adam), then apply {strategy}'s "
                                  f"sharding over {world_size} ranks."),
        slips={
            16 * p: "that is every rank holding everything, as DDP does: FULL_SHARD divides all three by world_size.",
            4 * p / n: "that counts the parameters only: each rank also holds its shard of the gradients and of "
                       "Adam's two moments.",
            8 * p / n: "that misses Adam's state: exp_avg and exp_avg_sq, 8 bytes per parameter in fp32.",
            12 * p / n: "that misses the gradients: 4 bytes per parameter, sharded like the rest.",
            memory.estimate(p, n, "zero2", **memory.FP32_ADAM): "that is ZeRO-2: parameters whole on every rank, "
                                                                "gradients and Adam's state sharded. FULL_SHARD "
                                                                "shards the parameters too.",
        },
        units=BYTE_UNITS))


#: Other names for 06's strategies, as torch's FSDP1 enums, FSDP2's fully_shard (which reshards after forward by
#: default) and the ZeRO paper say them (compared by typed.key).
STRATEGY_SYNONYMS = {
    **{name: "FSDP full sharding" for name in ("FULL_SHARD", "FSDP full shard", "ZeRO-3", "ZeRO 3", "ZeRO3",
                                               "ZeRO stage 3", "full sharding", "FSDP, full sharding", "fully_shard")},
    **{name: "FSDP, no reshard after forward" for name in ("SHARD_GRAD_OP", "ZeRO-2", "ZeRO2", "ZeRO stage 2",
                                                           "FSDP no reshard", "FSDP no reshard after forward")},
    "HYBRID_SHARD": "HSDP",
    "DDP + checkpointing": "DDP" + guide.CHECKPOINTING,
    "FSDP full sharding + checkpointing": "FSDP full sharding" + guide.CHECKPOINTING,
    "FSDP full sharding + offload": "FSDP full sharding + CPU offload",
}


def strategy_choice(answer: Any, num_params: float, gpu_memory_gb: float, num_gpus: int, nodes: int = 1,
                    **job: Any) -> Feedback:
    """Notebook 06's exercise: is ``answer`` (one of :data:`dtlib.train.guide.CHOICES`) what
    :func:`dtlib.train.guide.recommend` picks?

    A wrong answer gets the reason it fails (it does not fit its budget, or HSDP on one node), or, where it
    would work, the simpler choice that works too. Example: ``strategy_choice("HSDP", 20e9, 80, 8)`` says one node.
    """
    advice = guide.recommend(num_params, gpu_memory_gb, num_gpus, nodes=nodes, **job)

    def why_not(answer: str) -> str:
        why = guide.why_not(answer, advice, gpu_memory_gb, nodes)
        if why:
            return why
        if answer.endswith(guide.CHECKPOINTING) and not advice.choice.endswith(guide.CHECKPOINTING):
            return (f"{answer} would fit, but {advice.choice} fits without recomputing every block's forward: "
                    f"{advice}")
        return f"{answer} would fit, but a simpler strategy fits too: {advice}"

    return judge_choice(answer, Choice("a strategy", guide.CHOICES, advice.choice, f"Right: {advice}", why_not,
                                       synonyms=STRATEGY_SYNONYMS))
