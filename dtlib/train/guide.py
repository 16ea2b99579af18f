"""Which data-parallel strategy fits: a decision guide built on the memory formulas of ``dtlib.measure.memory``.

Model state per GPU (GB = 1e9 bytes), as PyTorch's DDP and FSDP2 hold it with mixed-precision AdamW:
fp32 weights, fp32 gradients and Adam's two fp32 moments, 16 bytes per parameter, with bf16 compute
(P parameters, N GPUs in all, g GPUs per node)::

    DDP, bf16 autocast               22P                 a full replica, its gradient buckets (4P; none with
                                                         gradient_as_bucket_view=True: notebook 05 measures both)
                                                         and autocast's bf16 copies of the weights (2P, fwd to bwd:
                                                         notebook 06 measures them); 20P in fp32
    FSDP, no reshard after forward   2P + 16P/N          fp32 shards, bf16 weights gathered fwd to bwd
    HSDP                             16P/g               full sharding within each node, replicas across
    FSDP full sharding               16P/N               everything sharded over all GPUs
    full sharding + CPU offload      host: 16P in all    weights, gradients and the optimizer step in host RAM

Each figure is what is alive at the end of forward, when the activations peak, with the gradients of earlier
micro-batches still held (gradient accumulation); a loop that frees the gradients before each forward
(``zero_grad()``) holds none then, and for it the guide's figure is an upper bound.

Activations come on top, the same on every GPU whatever the strategy (each GPU runs the whole model on its
own tokens; notebook 14 shows that sharding does not cut them). Given the model's ``shape`` and the tokens per
GPU, they are :func:`dtlib.measure.memory.activation_bytes` (checked against the simulator of notebook 14),
with and without activation checkpointing; given ``activation_gb``, the figure you measured; given neither,
a rule of thumb: 30% of the GPU, 10% with checkpointing (:func:`rule_of_thumb_gb`).

The one rule of memory (:func:`budget_gb`): a strategy fits a GPU when its model state and its activations
together fit 90% of the GPU; the other 10% stays for buffers and fragmentation. With the rule of thumb, model
state may use 60% of the GPU, 80% with checkpointing.

The rules, in order: the simplest strategy that fits, trying first those that recompute nothing (DDP, FSDP
without resharding, HSDP, full sharding), then those with activation checkpointing, which run every block's
forward twice; then CPU offload, which moves model state, never activations, to host RAM (the node's RAM
minus 20% must hold it). On several nodes linked more slowly than 12.5 GB/s (100 Gbit/s) per GPU, HSDP comes
first wherever it fits: it keeps the all-gathers and reduce-scatters inside each node. Every choice says its
seconds of communication per step if none of it overlapped compute (``network_s``). Beyond that nothing fits
these GPUs: tensor and pipeline parallelism divide the same 16 bytes per parameter over the same GPUs, never
below full sharding's 16P/N, so the way out is more GPUs (``gpus_needed``, counted by the same rule), fewer
bytes per parameter, or a node with more RAM; where the activations alone do not fit even with checkpointing,
the way out is fewer tokens per GPU or splitting them (context or tensor parallelism with sequence
parallelism), since data parallelism of any kind leaves them whole.

Example::

    dtlib.train.guide.recommend(7e9, gpu_memory_gb=80, num_gpus=8).choice   # "FSDP, no reshard after forward"
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dtlib.arguments import finite, whole
from dtlib.measure import memory
from dtlib.ring.cost import BUS_FACTOR, LINKS

BUFFER_SHARE = 0.1  # share of each GPU always kept for buffers and fragmentation, whatever holds the rest
ACTIVATION_SHARE = 0.3  # the rule of thumb, when activations are neither counted nor measured: their share of a GPU
CHECKPOINTED_SHARE = 0.1  # the same with activation checkpointing, which keeps only each block's input
HOST_RESERVE = 0.2  # share of each node's RAM kept for the OS, data-loader workers and the ranks' processes
# The links are dtlib.ring.cost.LINKS, in GB/s per GPU: nominal, for the seconds of communication. Below the
# slow one, 100 Gbit/s per GPU (12.5), keep the big collectives inside nodes.
SLOW_LINK_GB_PER_S = LINKS["100G Ethernet"].bandwidth_bytes_per_s / 1e9
INTRA_NODE_GB_PER_S = LINKS["NVLink 4"].bandwidth_bytes_per_s / 1e9  # 450, each way (H100 SXM)
INTER_NODE_GB_PER_S = LINKS["InfiniBand NDR"].bandwidth_bytes_per_s / 1e9  # 50: a 400 Gbit/s NIC per GPU
BUCKET_BYTES = 4  # DDP's gradient buckets: a second fp32 copy of the gradients unless gradient_as_bucket_view


def budget_gb(gpu_memory_gb: float, activation_gb: float) -> float:
    """GB of model state one GPU may hold beside ``activation_gb`` of activations: the guide's one rule.
    10% of the GPU stays for buffers and fragmentation, the activations take theirs, model state the rest.

    Example: ``budget_gb(80, rule_of_thumb_gb(80))`` is 48.0 (80 - 8 for buffers - 24 for activations).
    """
    return gpu_memory_gb * (1 - BUFFER_SHARE) - activation_gb


def rule_of_thumb_gb(gpu_memory_gb: float, checkpointing: bool = False) -> float:
    """GB of activations per GPU that the guide assumes when they are neither counted nor measured: 30% of
    the GPU, 10% with activation checkpointing. Example: ``rule_of_thumb_gb(40, checkpointing=True)`` is 4.0."""
    return gpu_memory_gb * (CHECKPOINTED_SHARE if checkpointing else ACTIVATION_SHARE)


CHECKPOINTING = " + activation checkpointing"
CHOICES = ("DDP", "DDP" + CHECKPOINTING, "FSDP, no reshard after forward", "HSDP", "FSDP full sharding",
           "FSDP full sharding" + CHECKPOINTING, "FSDP full sharding + CPU offload",
           "more GPUs or fewer bytes per parameter", "fewer tokens per GPU, or split them")
OFFLOAD = "FSDP full sharding + CPU offload"
BEYOND = "more GPUs or fewer bytes per parameter"  # nothing fits: no split of the model over these GPUs does
TOKENS = "fewer tokens per GPU, or split them"  # the activations alone do not fit, even checkpointed
ON_GPU = ("DDP", "FSDP, no reshard after forward", "HSDP", "FSDP full sharding")  # what gb_per_gpu holds


@dataclass
class Recommendation:
    """The choice, the reason in one sentence, and the arithmetic behind it (GB = 1e9 bytes)."""

    choice: str
    reason: str
    gb_per_gpu: dict[str, float] = field(default_factory=dict)  # model state per GPU under each GPU candidate
    budget_gb: float = 0.0  # what model state may use beside the activations: budget_gb(GPU, activations)
    checkpointing_budget_gb: float = 0.0  # the same beside checkpointed activations (budget_gb with activation_gb)
    host_gb_per_node: float = 0.0  # CPU offload: host RAM each node needs (weight and gradient shards pinned)
    host_budget_gb: float = 0.0  # the node's RAM minus HOST_RESERVE
    activation_room_gb: dict[str, float] = field(default_factory=dict)  # 90% of the GPU minus the model state
    cross_node_gb: dict[str, float] = field(default_factory=dict)  # sent across nodes per GPU and step
    activation_gb: dict[str, float] = field(default_factory=dict)  # per GPU, without and with checkpointing
    network_s: dict[str, float] = field(default_factory=dict)  # communication per step, nothing overlapped
    gpus_needed: int | None = None  # nothing fits: the fewest GPUs of this size that full sharding fits, same rule

    def __str__(self) -> str:
        return f"{self.choice}: {self.reason}"


def bytes_per_param(mixed_precision: bool = True, optimizer: str = "adamw") -> dict[str, float]:
    """Bytes per parameter as PyTorch's DDP and FSDP2 keep them: fp32 weights and gradients (4 + 4), the
    optimizer's fp32 moments (8 for Adam(W), 4 for SGD with momentum), and the dtype the weights are
    gathered in for compute (2 with bf16 mixed precision, 4 in fp32).

    Example: ``bytes_per_param()`` gives 4, 4, 8 and 2: 16 bytes of model state per parameter.
    """
    moments = {"adamw": 8, "adam": 8, "sgd": 4}
    if optimizer not in moments:
        raise ValueError(f"optimizer must be one of {', '.join(moments)}, got {optimizer!r}")
    return {**memory.FP32_ADAM, "optim_bytes_per_param": moments[optimizer],
            "compute_bytes": 2 if mixed_precision else 4}


def model_state_gb(num_params: float, num_gpus: int, nodes: int = 1, *, mixed_precision: bool = True,
                   optimizer: str = "adamw", gradient_as_bucket_view: bool = False) -> dict[str, float]:
    """GB of model state per GPU under each of :data:`ON_GPU`, and the host GB per node under CPU offload.
    DDP's includes its gradient buckets (4 bytes per parameter) unless ``gradient_as_bucket_view``, and with
    ``mixed_precision`` (bf16 autocast) the bf16 copies of the weights that autocast casts and autograd keeps
    from forward to backward (2 bytes per parameter; a little less in a model whose embeddings and norms,
    which autocast leaves in fp32, hold many parameters).

    Example: ``model_state_gb(13e9, 8)["FSDP full sharding"] == 26.0`` (16 x 13 / 8); ``["DDP"]`` is 286.0 (22 x 13).
    """
    sizes = bytes_per_param(mixed_precision, optimizer)
    moments, compute = sizes["optim_bytes_per_param"], sizes["compute_bytes"]
    per_node = whole("num_gpus", num_gpus) // whole("nodes", nodes)

    def fsdp(group: int, reshard: bool = True) -> float:
        return memory.fsdp_estimate(num_params, group, reshard_after_forward=reshard, compute_bytes=compute,
                                    moment_bytes=moments) / 1e9

    return {
        "DDP": (memory.estimate(num_params, num_gpus, "ddp", param_bytes=4, grad_bytes=4,
                                optim_bytes_per_param=moments)
                + (0 if gradient_as_bucket_view else BUCKET_BYTES * num_params)
                + (compute if mixed_precision else 0) * num_params) / 1e9,  # autocast's bf16 weight copies
        "FSDP, no reshard after forward": fsdp(num_gpus, reshard=False),
        "HSDP": fsdp(per_node),
        "FSDP full sharding": fsdp(num_gpus),
        # Offload: every shard and the optimizer step live in the node's RAM, its GPUs' shares together
        OFFLOAD: fsdp(num_gpus) * per_node,
    }


def cross_node_gb(num_params: float, num_gpus: int, nodes: int, *, mixed_precision: bool = True) -> dict[str, float]:
    """GB that cross the link between nodes per GPU and step under each strategy, ring collectives (notebook 03).

    Like with like, per GPU link: a node of g GPUs has g links out (one NIC per GPU, as in the 50 GB/s per
    GPU default), and a collective's bytes are charged to the links they cross.
    - Over all N GPUs (DDP, FSDP): a ring's every link carries its per-link volume V, but only where it steps
      from one node to the next does it cross, once per node; NCCL runs one ring per NIC and splits V among
      them, so each GPU link carries V / g. DDP all-reduces fp32 gradients, V = 2(N-1)/N x 4P; FSDP
      all-gathers in the compute dtype (c bytes: twice with full sharding, once without resharding) and
      reduce-scatters fp32 gradients, V = (N-1)/N x (2c + 4)P or (c + 4)P.
    - HSDP all-reduces only each GPU's gradient shard (4P/g) among the r = nodes replicas, every step of
      that ring crossing: 2(r-1)/r x 4P/g per GPU link.
    So HSDP sends about (N-1)/N x r/(r-1) times fewer bytes across nodes than DDP: about 2 on two nodes,
    less on more. One node: all 0. Example: ``cross_node_gb(1e9, 16, 2)["HSDP"] == 0.5``.
    """
    compute = bytes_per_param(mixed_precision)["compute_bytes"]
    num_params = finite("num_params", num_params)
    num_gpus, nodes = whole("num_gpus", num_gpus), whole("nodes", nodes)
    if nodes == 1:
        return dict.fromkeys(CHOICES, 0.0)
    per_node = num_gpus // nodes
    spread = BUS_FACTOR["allgather"](num_gpus)  # the ring: (N - 1) / N of the bytes cross each link
    flat = num_params / per_node / 1e9  # a collective over all N: one crossing per node, over its g links
    ddp = BUS_FACTOR["allreduce"](num_gpus) * 4 * flat
    return {"DDP": ddp, "DDP + activation checkpointing": ddp,
            "FSDP, no reshard after forward": spread * (compute + 4) * flat,
            "HSDP": BUS_FACTOR["allreduce"](nodes) * 4 * num_params / per_node / 1e9,
            "FSDP full sharding": spread * (2 * compute + 4) * flat,
            "FSDP full sharding" + CHECKPOINTING: spread * (2 * compute + 4) * flat,
            OFFLOAD: spread * (2 * compute + 4) * flat,
            BEYOND: 0.0}  # nothing fits: no traffic to count


def _inputs(num_params: object, gpu_memory_gb: object, num_gpus: object, nodes: object, host_memory_gb: object,
            activation_gb: object, inter_node_gb_per_s: object) -> tuple[float, float, int, int, float, float | None,
                                                                          float]:
    """Every number checked: finite (NaN and infinity refused), positive, GPUs and nodes whole."""
    num_params = finite("num_params", num_params)
    gpu_memory_gb = finite("gpu_memory_gb", gpu_memory_gb)
    if num_params <= 0 or gpu_memory_gb <= 0:
        raise ValueError(f"num_params and gpu_memory_gb must be > 0, got {num_params} and {gpu_memory_gb}")
    num_gpus, nodes = whole("num_gpus", num_gpus), whole("nodes", nodes)
    if num_gpus % nodes:
        raise ValueError(f"need num_gpus >= 1 split evenly over nodes >= 1, got {num_gpus} GPUs on {nodes} nodes")
    host = finite("host_memory_gb", host_memory_gb)
    activations = None if activation_gb is None else finite("activation_gb", activation_gb)
    link = finite("inter_node_gb_per_s", inter_node_gb_per_s)
    if link <= 0:
        raise ValueError(f"inter_node_gb_per_s must be > 0, got {inter_node_gb_per_s!r}")
    return num_params, gpu_memory_gb, num_gpus, nodes, host, activations, link


def network_seconds(num_params: float, num_gpus: int, nodes: int = 1, *, mixed_precision: bool = True,
                    inter_node_gb_per_s: float = INTER_NODE_GB_PER_S, intra_node_gb_per_s: float = INTRA_NODE_GB_PER_S
                    ) -> dict[str, float]:
    """Seconds each GPU spends communicating per step under each strategy, if none of it overlapped compute:
    its ring bytes (notebook 03) over the links they cross, :func:`cross_node_gb` between nodes and the rest
    inside the node. Per GPU: DDP all-reduces the fp32 gradients, 2(N-1)/N x 4P; FSDP all-gathers in the compute
    dtype c and reduce-scatters fp32 gradients, (N-1)/N x (2c + 4)P (c + 4 without resharding); HSDP does that
    within a node of g and all-reduces its gradient shard across the r nodes, 2(r-1)/r x 4P/g.

    Example: ``network_seconds(7e9, 8)["DDP"]`` is 2 x 7/8 x 28 GB over 450 GB/s, about 0.11 s.
    """
    compute = bytes_per_param(mixed_precision)["compute_bytes"]
    per_node = num_gpus // nodes
    spread = BUS_FACTOR["allgather"](num_gpus)  # the ring: (N - 1) / N of the bytes cross each link
    ring = {"DDP": BUS_FACTOR["allreduce"](num_gpus) * 4 * num_params / 1e9,
            "FSDP, no reshard after forward": spread * (compute + 4) * num_params / 1e9,
            "HSDP": (BUS_FACTOR["allgather"](per_node) * (2 * compute + 4) * num_params
                     + BUS_FACTOR["allreduce"](nodes) * 4 * num_params / per_node) / 1e9,
            "FSDP full sharding": spread * (2 * compute + 4) * num_params / 1e9}
    ring["DDP" + CHECKPOINTING] = ring["DDP"]
    ring["FSDP full sharding" + CHECKPOINTING] = ring[OFFLOAD] = ring["FSDP full sharding"]
    across = cross_node_gb(num_params, num_gpus, nodes, mixed_precision=mixed_precision)
    return {name: across[name] / inter_node_gb_per_s + (volume - across[name]) / intra_node_gb_per_s
            for name, volume in ring.items()}


def _activations(shape: object, tokens_per_gpu: object, activation_gb: float | None, gpu_memory_gb: float
                 ) -> tuple[float, float | None, bool]:
    """GB of activations per GPU without and with checkpointing (None: not known), and whether they were
    counted or measured (False: the rule of thumb of :func:`rule_of_thumb_gb`)."""
    if shape is not None:
        if tokens_per_gpu is None:
            raise ValueError("give tokens_per_gpu (sequence length x micro-batch) with shape")
        if activation_gb is not None:
            raise ValueError("give shape and tokens_per_gpu (the activations counted) or activation_gb (measured), "
                             "not both")
        sizes = [getattr(shape, name) for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")]
        tokens = whole("tokens_per_gpu", tokens_per_gpu)
        return (memory.activation_bytes(*sizes, tokens) / 1e9,
                memory.activation_bytes(*sizes, tokens, checkpointing=True) / 1e9, True)
    if tokens_per_gpu is not None:
        raise ValueError("tokens_per_gpu counts the activations only with the model's shape: give shape too "
                         "(dtlib.sim.llama.LLAMA['7B'], or dtlib.sim.llama.llama_like(num_params) for a Llama-like "
                         "guess), or give activation_gb, the activations you measured")
    if activation_gb is not None:
        return activation_gb, None, True
    return rule_of_thumb_gb(gpu_memory_gb), rule_of_thumb_gb(gpu_memory_gb, checkpointing=True), False


def recommend(num_params: float, gpu_memory_gb: float, num_gpus: int, *, nodes: int = 1,
              mixed_precision: bool = True, optimizer: str = "adamw", host_memory_gb: float = 1000.0,
              activation_gb: float | None = None, inter_node_gb_per_s: float = INTER_NODE_GB_PER_S,
              shape: object = None, tokens_per_gpu: int | None = None,
              gradient_as_bucket_view: bool = False) -> Recommendation:
    """The simplest strategy that fits with its activations, with the numbers that decided it.

    A strategy fits when its model state (:func:`model_state_gb`) is within :func:`budget_gb` of the GPU
    and the activations: 90% of the GPU, minus the activations. ``num_gpus`` counts all GPUs; ``nodes`` of them
    share it equally, each node with ``host_memory_gb`` of RAM. The activations per GPU: from ``shape`` (a
    Llama-like shape with ``layers``, ``hidden``, ``heads``, ``kv_heads``, ``ffn`` and ``vocab``,
    ``dtlib.sim.llama.LLAMA["70B"]`` say) and ``tokens_per_gpu`` (sequence length x micro-batch), with and
    without checkpointing; or ``activation_gb``, the figure you measured for the batch you want (then
    checkpointing is not considered: measure with it on if you use it); or, given neither, the rule of thumb,
    30% of the GPU (10% with checkpointing). ``tokens_per_gpu`` without ``shape`` is refused (ValueError): the
    tokens alone do not say how many bytes each one needs. ``inter_node_gb_per_s``: bandwidth per GPU between
    nodes (50 for 400 Gbit/s InfiniBand per GPU). ``mixed_precision``: bf16 compute (autocast for DDP).
    ``gradient_as_bucket_view``: DDP without its second copy of the gradients.
    Example: ``recommend(1e9, 80, 8)`` is DDP (22 GB of model state per GPU, within the 48 GB budget).
    """
    num_params, gpu_memory_gb, num_gpus, nodes, host_memory_gb, activation_gb, link = _inputs(
        num_params, gpu_memory_gb, num_gpus, nodes, host_memory_gb, activation_gb, inter_node_gb_per_s)
    states = model_state_gb(num_params, num_gpus, nodes, mixed_precision=mixed_precision, optimizer=optimizer,
                            gradient_as_bucket_view=gradient_as_bucket_view)
    gb = {name: states[name] for name in ON_GPU}
    full, checkpointed, counted = _activations(shape, tokens_per_gpu, activation_gb, gpu_memory_gb)
    usable = budget_gb(gpu_memory_gb, 0)  # for model state and activations together
    budget = budget_gb(gpu_memory_gb, full)
    tight = budget_gb(gpu_memory_gb, checkpointed) if checkpointed is not None else budget
    host_budget = host_memory_gb * (1 - HOST_RESERVE)
    across = cross_node_gb(num_params, num_gpus, nodes, mixed_precision=mixed_precision)
    seconds = network_seconds(num_params, num_gpus, nodes, mixed_precision=mixed_precision,
                              inter_node_gb_per_s=link)
    per_node = num_gpus // nodes
    activations = ({"without checkpointing": full} | ({} if checkpointed is None else
                                                      {"with checkpointing": checkpointed})) if counted else {}

    def make(choice: str, reason: str, gpus_needed: int | None = None) -> Recommendation:
        talk = f"; {seconds[choice]:.2g} s of communication per step if none of it overlaps compute" \
            if choice in seconds else ""
        return Recommendation(choice, reason + talk, gb, budget, tight, states[OFFLOAD], host_budget,
                              {name: usable - value for name, value in gb.items()}, across, activations, seconds,
                              gpus_needed)

    def room(name: str) -> str:
        if counted:
            return f"; with {full:.1f} GB of activations it uses {gb[name] + full:.1f} of the {usable:.1f} GB usable"
        return (f"; it leaves {usable - gb[name]:.1f} GB per GPU for activations, where the rule of thumb "
                f"expects {full:.1f}")

    if nodes > 1 and link < SLOW_LINK_GB_PER_S and gb["HSDP"] <= budget:
        usual = recommend(num_params, gpu_memory_gb, num_gpus, nodes=nodes, mixed_precision=mixed_precision,
                          optimizer=optimizer, host_memory_gb=host_memory_gb, activation_gb=activation_gb,
                          shape=shape, tokens_per_gpu=tokens_per_gpu,
                          gradient_as_bucket_view=gradient_as_bucket_view).choice
        if usual != "HSDP" and usual in across:  # what a fast link would get sends more across nodes
            return make("HSDP", f"{nodes} nodes linked at {link:g} GB/s per GPU: {usual} would send "
                        f"{across[usual]:.1f} GB per GPU across nodes each step ({across[usual] / link:.1f} s), "
                        f"HSDP {across['HSDP']:.1f} GB ({across['HSDP'] / link:.1f} s), sharding within each node "
                        f"({gb['HSDP']:.1f} GB per GPU)" + room("HSDP"))
    held = [part for part, counted_in in (("its gradient buckets", not gradient_as_bucket_view),
                                          ("autocast's bf16 weight copies", mixed_precision)) if counted_in]
    held_text = f", {' and '.join(held)} included" if held else ""
    if gb["DDP"] <= budget:
        return make("DDP", f"a full replica's model state ({gb['DDP']:.1f} GB{held_text}) fits the {budget:.1f} GB "
                           "budget; DDP is the simplest and fastest" + room("DDP"))
    name = "FSDP, no reshard after forward"
    if gb[name] <= budget:
        return make(name, f"sharding over {num_gpus} GPUs, with the weights gathered from forward to backward, "
                    f"peaks at {gb[name]:.1f} GB per GPU, gathering once per step and recomputing nothing"
                    + room(name))
    if nodes > 1 and gb["HSDP"] <= budget:
        return make("HSDP", f"full sharding within one node ({per_node} GPUs) needs {gb['HSDP']:.1f} GB; "
                    "replicating across nodes keeps the all-gathers on fast intra-node links" + room("HSDP"))
    name = "FSDP full sharding"
    if gb[name] <= budget:
        return make(name, f"only sharding the parameters too fits: {gb[name]:.1f} GB per GPU over {num_gpus} GPUs, "
                    "gathering twice per step (1.5x DDP's bytes at equal precision)" + room(name))
    for name in ("DDP", "FSDP full sharding"):
        if checkpointed is not None and gb[name] <= tight:
            why = (f"the activations ({full:.1f} GB per GPU) do not fit beside {name}'s {gb[name]:.1f} GB of model "
                   f"state; checkpointed, each block keeps only its input and they are {checkpointed:.1f} GB"
                   if counted else f"{name}'s model state ({gb[name]:.1f} GB per GPU) leaves {usable - gb[name]:.1f} "
                   f"GB of the {usable:.1f} GB usable for activations (the rule of thumb expects {full:.1f} GB without "
                   f"checkpointing, {checkpointed:.1f} GB with it)")
            return make(name + CHECKPOINTING, f"{why}: recompute them in backward (every block's forward runs "
                        "twice; checkpoint each block before fully_shard wraps it)")
    least = checkpointed if checkpointed is not None else full
    if least >= usable:
        return make(TOKENS, f"the activations alone need {least:.1f} GB per GPU"
                    f"{' even with checkpointing' if checkpointed is not None else ''}, and the GPU has "
                    f"{usable:.1f} GB usable: no room is left for model state, and no data-parallel strategy and no "
                    "offload cuts them, since each GPU runs the whole model on its own tokens. Use fewer tokens per "
                    "GPU, or split them: sequence and tensor parallelism, or context parallelism (notebooks 09 and 12)")
    if states[OFFLOAD] <= host_budget:
        return make(OFFLOAD, f"even full sharding needs {gb['FSDP full sharding']:.1f} GB per GPU beside the "
                    f"activations; offloaded, weights, gradients and the optimizer step live in host RAM, "
                    f"{states[OFFLOAD]:.0f} GB per node of {host_budget:.0f} GB usable, and the GPUs keep the "
                    "activations and the layers being computed (slower: host transfers every step)")
    total = gb["FSDP full sharding"] * num_gpus
    room_per_gpu = budget_gb(gpu_memory_gb, least)
    gpus_needed = math.ceil(total / room_per_gpu - 1e-9)
    leaves = "even checkpointing leaves" if checkpointed is not None else "your activations leave"
    how = "fully sharded" + (", with checkpointing" if checkpointed is not None else "")
    each = total / gpus_needed
    return make(BEYOND, f"the model state is {total:.0f} GB in all: full sharding needs "
                f"{gb['FSDP full sharding']:.1f} GB per GPU, over the {room_per_gpu:.1f} GB {leaves}, and "
                f"offloading needs {states[OFFLOAD]:.0f} GB of host RAM per node, over the {host_budget:.0f} GB "
                "usable. Tensor and pipeline parallelism divide the same bytes over the same GPUs, so they cannot "
                f"fit it either: use at least {gpus_needed} GPUs of {gpu_memory_gb:g} GB ({how}: {total:.0f} GB "
                f"over {gpus_needed} GPUs is {each:.1f} GB each, beside {least:.1f} GB of activations), fewer "
                "bytes per parameter (bf16 moments, an 8-bit optimizer, SGD), or nodes with "
                f"{states[OFFLOAD] / (1 - HOST_RESERVE):.0f} GB of RAM or more for offload", gpus_needed)


def table(sizes_b: tuple[float, ...] = (0.5, 1, 3, 7, 13, 30, 70), gpu_memory_gb: tuple[float, ...] = (40, 80),
          num_gpus: int = 8, **options: object) -> list[dict[str, object]]:
    """Recommendations for common model sizes (billions of parameters) on one node of ``num_gpus``;
    ``options`` go to :func:`recommend` (``host_memory_gb=2000``, say)."""
    return [{"params_b": size, "gpu_gb": mem, "choice": recommend(size * 1e9, mem, num_gpus, **options).choice}
            for size in sizes_b for mem in gpu_memory_gb]


def largest_model(choice: str, gpu_memory_gb: float = 80, num_gpus: int = 8, *, nodes: int = 1,
                  mixed_precision: bool = True, optimizer: str = "adamw") -> float:
    """The most parameters whose model state fits the budget of the rule of thumb under ``choice``, one of
    :data:`ON_GPU`: :func:`budget_gb` beside :func:`rule_of_thumb_gb`'s activations, 60% of the GPU. Model
    state grows linearly with the parameters, so one parameter's bytes decide.
    Example: ``largest_model("DDP") / 1e9`` is 2.18 (billion: 48 GB over 22 bytes each, under bf16 autocast)."""
    if choice not in ON_GPU:
        raise ValueError(f"choice must be one of {', '.join(ON_GPU)}, got {choice!r}")
    if finite("gpu_memory_gb", gpu_memory_gb) <= 0:
        raise ValueError(f"gpu_memory_gb must be > 0, got {gpu_memory_gb!r}")
    one = model_state_gb(1, num_gpus, nodes, mixed_precision=mixed_precision, optimizer=optimizer)[choice] * 1e9
    return budget_gb(gpu_memory_gb, rule_of_thumb_gb(gpu_memory_gb)) * 1e9 / one


def _two_gb(needed: float, budget: float) -> tuple[str, str]:
    """Both in GB with enough decimals that two different numbers never print the same."""
    decimals = 1
    while f"{needed:.{decimals}f}" == f"{budget:.{decimals}f}" and decimals < 6:
        decimals += 1
    return f"{needed:.{decimals}f}", f"{budget:.{decimals}f}"


def why_not(answer: str, advice: Recommendation, gpu_memory_gb: float, nodes: int) -> str | None:
    """Why ``answer`` fails its own rule of :func:`recommend` on this job, or None where it would work."""
    if answer == "HSDP" and nodes == 1:
        return ("HSDP shards the model within each node and replicates it across nodes; this job has one node, "
                "so there is nothing to replicate across (on one node HSDP is just full sharding).")
    if answer == TOKENS:
        if advice.choice == TOKENS:
            return None
        return (f"this job's activations fit a GPU ({advice.choice} fits), so its tokens need not be cut or split; "
                "data parallelism leaves each GPU its own tokens whole, and here that is enough.")
    if answer == BEYOND:
        if advice.choice in (BEYOND, TOKENS):
            return None if advice.choice == BEYOND else (
                "more GPUs do not help here: the activations alone do not fit one GPU, and data parallelism gives "
                "every GPU the whole model's activations for its own tokens. Cut or split the tokens.")
        return (f"these GPUs can hold this model: {advice.choice} fits, so more GPUs or fewer bytes per parameter "
                "are not needed to make it fit.")
    if answer == OFFLOAD:
        if advice.host_gb_per_node <= advice.host_budget_gb:
            return None
        needed, budget = _two_gb(advice.host_gb_per_node, advice.host_budget_gb)
        return (f"{answer} needs {needed} GB of host RAM per node (16 bytes per parameter, shared by the node's "
                f"GPUs), more than the {budget} GB usable (the node's RAM minus {HOST_RESERVE:.0%}).")
    checkpointing = answer.endswith(CHECKPOINTING)
    needed = advice.gb_per_gpu[answer.removesuffix(CHECKPOINTING)]
    if checkpointing and "without checkpointing" in advice.activation_gb and \
            "with checkpointing" not in advice.activation_gb:
        return (f"{answer}: the activations you measured ({advice.activation_gb['without checkpointing']:.1f} GB) "
                "are without checkpointing, so the guide cannot tell what checkpointing leaves; measure with it on.")
    budget = advice.checkpointing_budget_gb if checkpointing else advice.budget_gb
    if needed <= budget:
        return None
    shown_needed, shown_budget = _two_gb(needed, budget)
    key = "with checkpointing" if checkpointing else "without checkpointing"
    activations = budget_gb(gpu_memory_gb, 0) - budget  # what budget_gb took for them
    if key in advice.activation_gb:
        why = (f"{1 - BUFFER_SHARE:.0%} of the GPU minus {activations:.1f} GB of activations"
               f"{', checkpointed' if checkpointing else ''}")
    else:
        share = CHECKPOINTED_SHARE if checkpointing else ACTIVATION_SHARE
        why = (f"the GPU minus {BUFFER_SHARE:.0%} for buffers and {share:.0%} for activations"
               f"{', checkpointed' if checkpointing else ''}")
    return f"{answer} needs {shown_needed} GB of model state per GPU, more than the {shown_budget} GB budget ({why})."
