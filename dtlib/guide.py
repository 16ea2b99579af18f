"""Which data-parallel strategy fits: a decision guide built on the ZeRO arithmetic of ``dtlib.memory``.

The rules, in order (model state only; activations get a reserved share of each GPU)::

    DDP                              model state of DDP fits the GPU's budget
    DDP + activation checkpointing   it fits only if activations are cut down
    FSDP, no reshard after forward   ZeRO-2's peak over all GPUs fits (1.0x DDP's traffic)
    HSDP                             several nodes, and full sharding within one node fits
    FSDP full sharding               ZeRO-3 over all GPUs fits (1.5x DDP's traffic)
    full sharding + CPU offload      the parameters' and gradients' shards fit, optimizer on the CPU
    tensor / pipeline parallelism    not even that fits

Example::

    dtlib.guide.recommend(7e9, gpu_memory_gb=80, num_gpus=8).choice   # "FSDP, no reshard after forward"
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtlib import memory

ACTIVATION_RESERVE = 0.3  # share of each GPU kept for activations, buffers and fragmentation
CHECKPOINTING_RESERVE = 0.1  # what is left for activations with activation checkpointing

CHOICES = ("DDP", "DDP + activation checkpointing", "FSDP, no reshard after forward", "HSDP",
           "FSDP full sharding", "FSDP full sharding + CPU offload", "tensor / pipeline parallelism")


@dataclass
class Recommendation:
    """The choice, the reason in one sentence, and the arithmetic behind it (GB = 1e9 bytes per GPU)."""

    choice: str
    reason: str
    gb_per_gpu: dict[str, float] = field(default_factory=dict)  # model state under each candidate
    budget_gb: float = 0.0  # what model state may use: the GPU minus the activation reserve

    def __str__(self) -> str:
        return f"{self.choice}: {self.reason}"


def bytes_per_param(mixed_precision: bool = True, optimizer: str = "adamw") -> dict[str, float]:
    """Bytes per parameter of weights, gradients and optimizer state.

    Mixed precision keeps 2-byte weights and gradients plus a 4-byte fp32 master copy in the
    optimizer state; Adam(W) adds two fp32 moments (8 bytes), SGD with momentum one (4).
    Example: ``bytes_per_param()`` gives 2, 2 and 12: the ZeRO paper's 16.
    """
    moments = {"adamw": 8, "adam": 8, "sgd": 4}
    if optimizer not in moments:
        raise ValueError(f"optimizer must be one of {', '.join(moments)}, got {optimizer!r}")
    if mixed_precision:
        return {"param_bytes": 2, "grad_bytes": 2, "optim_bytes_per_param": 4 + moments[optimizer]}
    return {"param_bytes": 4, "grad_bytes": 4, "optim_bytes_per_param": moments[optimizer]}


def recommend(num_params: float, gpu_memory_gb: float, num_gpus: int, *, nodes: int = 1,
              mixed_precision: bool = True, optimizer: str = "adamw") -> Recommendation:
    """The simplest strategy whose model state fits, with the numbers that decided it.

    ``num_gpus`` counts all GPUs; ``nodes`` of them share it equally. Example:
    ``recommend(1e9, 80, 8)`` is DDP (16 GB of model state per GPU fits 80 GB).
    """
    if num_params <= 0 or gpu_memory_gb <= 0:
        raise ValueError(f"num_params and gpu_memory_gb must be > 0, got {num_params} and {gpu_memory_gb}")
    if num_gpus < 1 or nodes < 1 or num_gpus % nodes:
        raise ValueError(f"need num_gpus >= 1 split evenly over nodes >= 1, got {num_gpus} GPUs on {nodes} nodes")
    sizes = bytes_per_param(mixed_precision, optimizer)
    per_node = num_gpus // nodes
    gb = {
        "DDP": memory.estimate(num_params, num_gpus, "ddp", **sizes) / 1e9,
        "FSDP, no reshard after forward": memory.estimate(num_params, num_gpus, "zero2", **sizes) / 1e9,
        "HSDP": memory.estimate(num_params, per_node, "zero3", **sizes) / 1e9,
        "FSDP full sharding": memory.estimate(num_params, num_gpus, "zero3", **sizes) / 1e9,
        # offload: the optimizer state (and its step) lives on the CPU; GPUs keep weight and gradient shards
        "FSDP full sharding + CPU offload": num_params * (sizes["param_bytes"] + sizes["grad_bytes"]) / num_gpus / 1e9,
    }
    budget = gpu_memory_gb * (1 - ACTIVATION_RESERVE)
    tight = gpu_memory_gb * (1 - CHECKPOINTING_RESERVE)

    def make(choice: str, reason: str) -> Recommendation:
        return Recommendation(choice, reason, gb, budget)

    if gb["DDP"] <= budget:
        return make("DDP", f"a full replica's model state ({gb['DDP']:.1f} GB) fits the {budget:.1f} GB budget; "
                           "DDP is the simplest and fastest")
    if gb["DDP"] <= tight:
        return make("DDP + activation checkpointing", f"a replica ({gb['DDP']:.1f} GB) fits only if activations "
                    f"stay under {gpu_memory_gb - gb['DDP']:.1f} GB: recompute them in backward")
    if gb["FSDP, no reshard after forward"] <= budget:
        return make("FSDP, no reshard after forward", f"sharding gradients and optimizer state over {num_gpus} GPUs "
                    f"leaves {gb['FSDP, no reshard after forward']:.1f} GB at the peak, with DDP's traffic")
    if nodes > 1 and gb["HSDP"] <= budget:
        return make("HSDP", f"full sharding within one node ({per_node} GPUs) needs {gb['HSDP']:.1f} GB; "
                    "replicating across nodes keeps the all-gathers on fast intra-node links")
    if gb["FSDP full sharding"] <= budget:
        return make("FSDP full sharding", f"only sharding the parameters too fits: {gb['FSDP full sharding']:.1f} "
                    f"GB per GPU over {num_gpus} GPUs, at 1.5x DDP's traffic")
    if gb["FSDP full sharding + CPU offload"] <= budget:
        return make("FSDP full sharding + CPU offload", f"even full sharding needs {gb['FSDP full sharding']:.1f} "
                    f"GB; with the optimizer state on the CPU the GPUs hold "
                    f"{gb['FSDP full sharding + CPU offload']:.1f} GB (slower: host transfers every step)")
    return make("tensor / pipeline parallelism", f"even the weight and gradient shards need "
                f"{gb['FSDP full sharding + CPU offload']:.1f} GB per GPU: add GPUs, or split layers with "
                "tensor or pipeline parallelism")


def table(sizes_b: tuple[float, ...] = (0.5, 1, 3, 7, 13, 30, 70), gpu_memory_gb: tuple[float, ...] = (40, 80),
          num_gpus: int = 8) -> list[dict[str, object]]:
    """Recommendations for common model sizes (billions of parameters) on one node of ``num_gpus``."""
    return [{"params_b": size, "gpu_gb": mem, "choice": recommend(size * 1e9, mem, num_gpus).choice}
            for size in sizes_b for mem in gpu_memory_gb]


def calculator() -> object:
    """An ipywidgets calculator: sliders for model size, GPU memory, GPU count and nodes; the callback
    draws :func:`dtlib.plots.guide_bars` for the current setting. Show it as a notebook cell's value."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from dtlib import plots

    def draw(params_b: float, gpu_memory_gb: int, num_gpus: int, nodes: int) -> None:
        if num_gpus % nodes:
            num_gpus = max(nodes, num_gpus // nodes * nodes)  # keep GPUs evenly split over nodes
        plots.guide_bars(recommend(params_b * 1e9, gpu_memory_gb, num_gpus, nodes=nodes),
                         title=f"{params_b:.3g}B parameters, {num_gpus} x {gpu_memory_gb} GB GPUs on {nodes} node(s)")
        plt.show()

    return widgets.interactive(
        draw,
        params_b=widgets.FloatLogSlider(value=7, base=10, min=-1, max=3, step=0.05, description="params (B)"),
        gpu_memory_gb=widgets.SelectionSlider(options=[16, 24, 40, 48, 80, 96, 141, 192], value=80,
                                              description="GPU GB"),
        num_gpus=widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256], value=8, description="GPUs"),
        nodes=widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32], value=1, description="nodes"),
    )


def largest_model(strategy: str, gpu_memory_gb: float = 80, num_gpus: int = 8, *, mixed_precision: bool = True,
                  optimizer: str = "adamw") -> float:
    """The most parameters whose model state fits the budget under ``strategy`` (a ``dtlib.memory``
    name: "ddp", "zero2", "zero3", ...). Example: ``largest_model("ddp") / 1e9`` is 3.5 (billion)."""
    per_param = memory.estimate(1, num_gpus, strategy, **bytes_per_param(mixed_precision, optimizer))
    return gpu_memory_gb * (1 - ACTIVATION_RESERVE) * 1e9 / per_param


def _two_gb(needed: float, budget: float) -> tuple[str, str]:
    """Both in GB with enough decimals that two different numbers never print the same."""
    decimals = 1
    while f"{needed:.{decimals}f}" == f"{budget:.{decimals}f}" and decimals < 6:
        decimals += 1
    return f"{needed:.{decimals}f}", f"{budget:.{decimals}f}"


def _why_not(answer: str, advice: Recommendation, gpu_memory_gb: float, nodes: int) -> str | None:
    """Why ``answer`` fails its own rule of :func:`recommend` on this job, or None where it would work."""
    if answer == "HSDP" and nodes == 1:
        return ("HSDP shards the model within each node and replicates it across nodes; this job has one node, "
                "so there is nothing to replicate across (on one node HSDP is just full sharding).")
    if answer == "tensor / pipeline parallelism":
        return None  # splitting layers always fits; the guide keeps it for when nothing simpler does
    checkpointing = answer == "DDP + activation checkpointing"
    needed = advice.gb_per_gpu["DDP" if checkpointing else answer]
    reserve = CHECKPOINTING_RESERVE if checkpointing else ACTIVATION_RESERVE
    budget = gpu_memory_gb * (1 - reserve)
    if needed <= budget:
        return None
    shown_needed, shown_budget = _two_gb(needed, budget)
    activations = "activations: checkpointing keeps few, recomputing the rest" if checkpointing else "activations"
    return (f"{answer} needs {shown_needed} GB of model state per GPU, more than the {shown_budget} GB budget "
            f"(the GPU minus {reserve:.0%} for {activations}).")


def check_choice(answer: object, num_params: float, gpu_memory_gb: float, num_gpus: int, nodes: int = 1) -> object:
    """Notebook 06's exercise: is ``answer`` (one of :data:`CHOICES`) what :func:`recommend` picks?

    A wrong answer gets the reason it fails (it does not fit its budget, or HSDP on one node), or, where it
    would work, the simpler choice that works too. Example: ``check_choice("HSDP", 20e9, 80, 8)`` says one node.
    """
    from dtlib.checks import Feedback

    advice = recommend(num_params, gpu_memory_gb, num_gpus, nodes=nodes)
    if answer not in CHOICES:
        return Feedback(False, f"Answer with one of: {', '.join(repr(choice) for choice in CHOICES)}.")
    if answer == advice.choice:
        return Feedback(True, f"Right: {advice}")
    why = _why_not(str(answer), advice, gpu_memory_gb, nodes)
    if why:
        return Feedback(False, why)
    return Feedback(False, f"{answer} would fit, but a simpler strategy fits too: {advice}")
