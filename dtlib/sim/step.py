"""The simulated training step: a Llama-shaped model laid out as pp x dp x tp (a pipeline of stages over "pp",
notebook 10's 1F1B; FSDP2 over "dp"; tensor parallelism inside each block over "tp", notebook 11's 2-D layout,
with sequence parallelism between the blocks and loss parallelism in the head where asked for),
stepped on fake tensors as rank 0 of the world (the first stage), its memory at the peak by category and its
collectives by mesh dimension measured as on live ranks.

A deep model is simulated shallow and scaled: every block is alike, so each memory category and each
collective row grows by the same amount per block. :func:`simulate` runs the model at two depths and extends
the line to the real depth (``tests/sim`` checks the rule against a full-depth run).

Example::

    result = simulate(LLAMA["7B"], dp=64, seq_len=4096)
    result.memory["activations"] / 2**30     # GiB per rank at the peak
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtlib.arguments import whole
from dtlib.measure.peak import CATEGORIES, STEP_MOMENT, PeakTracker
from dtlib.measure.traffic import Row, Traffic, sent_by_group, traffic
from dtlib.sim.forked import alongside
from dtlib.sim.llama import KERNELS, Llama, Shape, next_token_loss, vocabulary_sharded
from dtlib.sim.pipeline import pipeline_step
from dtlib.sim.world import fake_world

#: Notebook 09's plan for a Llama block: q, k, v, gate and up split by columns, o and down by rows.
TP_PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
           "gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
#: The same with sequence parallelism (notebook 09's ``SequenceParallel``, done by hand in the blocks): ``o`` and
#: ``down`` reduce-scatter their sums along the sequence instead of all-reducing them, so that the norms and the
#: residual stream hold a share of the sequence.
SP_PLAN = {**TP_PLAN, "o": RowwiseParallel(output_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))}
#: Loss parallelism (torchtitan's ``loss_parallel``): the output head split by columns, each tp rank holding a
#: share of the vocabulary's rows and computing that share of the logits, kept sharded into the loss.
HEAD_PLAN = {"head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)}
#: The same with sequence parallelism, torchtitan's plan: the final norm runs on this rank's share of the sequence,
#: and the head all-gathers its input, the norm's output, along the sequence (in backward it reduce-scatters that
#: input's gradient back to a share).
HEAD_SP_PLAN = {"head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}


def parallelize(model: nn.Module, mesh: DeviceMesh, checkpointing: bool = False,
                sequence_parallel: bool = False, loss_parallel: bool = False) -> nn.Module:
    """Tensor parallelism inside each block over ``mesh["tp"]``, then each block and the root sharded with
    FSDP2 over ``mesh["dp"]``, in bf16 with fp32 gradient reduction; ``checkpointing`` recomputes each block.
    ``sequence_parallel``: the blocks' norms and the activations between blocks hold each tp rank's share of the
    sequence (:class:`dtlib.sim.llama.Block`); each norm's weight is one on every tp rank, its gradient all-reduced.
    ``loss_parallel``: the output head, where this stage has it, split over the vocabulary (:data:`HEAD_PLAN`; with
    sequence parallelism :data:`HEAD_SP_PLAN`, after a final norm of this rank's share): its logits stay sharded
    into the loss (:func:`train_step`)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tp = mesh["tp"]
    if tp.size() > 1 and loss_parallel and getattr(model, "head", None) is not None:
        parallelize_module(model, tp, HEAD_SP_PLAN if sequence_parallel else HEAD_PLAN)
        model.loss_parallel = True  # what train_step and the pipeline's last stage read (vocabulary_sharded)
        if sequence_parallel:  # the final norm, used on a share: its gradient is a partial sum, as the blocks' are
            model.norm.weight = nn.Parameter(distribute_tensor(model.norm.weight, tp, [Replicate()]))
    for block in model.blocks:
        block.checkpointing = checkpointing
        if tp.size() > 1:
            parallelize_module(block, tp, SP_PLAN if sequence_parallel else TP_PLAN)
        if tp.size() > 1 and sequence_parallel:
            for norm in (block.attention_norm, block.mlp_norm):  # used on a share: its gradient is a partial sum
                norm.weight = nn.Parameter(distribute_tensor(norm.weight, tp, [Replicate()]))
            block.sequence_mesh = tp
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    if tp.size() > 1 and sequence_parallel:
        model.sequence_mesh = tp
    return fully_shard(model, mesh=mesh["dp"], mp_policy=policy)


def lay_out(parallelize: Callable[..., nn.Module], model: nn.Module, mesh: DeviceMesh, layout: Layout,
            checkpointing: bool) -> nn.Module:
    """``parallelize(model, mesh, checkpointing)``, with ``sequence_parallel=True`` and ``loss_parallel=True``
    where the layout asks for them (a layout of one's own that has no such argument is told so)."""
    asked = {name: True for name in ("sequence_parallel", "loss_parallel") if getattr(layout, name)}
    try:
        parameters = list(inspect.signature(parallelize).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call say
        parameters = None
    for name in asked:
        if parameters is not None and not any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters):
            called = getattr(parallelize, "__name__", type(parallelize).__name__)
            raise TypeError(f"{name}=True needs a parallelize that takes {name}=..., as dtlib.sim.step.parallelize "
                            f"does; {called}{inspect.signature(parallelize)} does not")
    return parallelize(model, mesh, checkpointing, **asked)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    """One step of next-token training (the targets are the tokens themselves: the simulator needs shapes).
    Logits sharded over the vocabulary (loss parallelism) go into the loss sharded, forward and backward."""
    with vocabulary_sharded(model):
        logits = model(tokens)  # held through backward, as a loop that logs or inspects them holds them
        next_token_loss(logits, tokens).backward()
    optimizer.step()
    optimizer.zero_grad()



@dataclass(frozen=True)
class Layout:
    """How the ranks are laid out and what one step computes: pp x dp x tp ranks, each step ``micro_batches``
    micro-batches of ``micro_batch`` sequences of ``seq_len`` tokens per data-parallel rank;
    ``sequence_parallel``: with tensor parallelism, the activations between blocks split along the sequence;
    ``loss_parallel``: the output head and its logits split along the vocabulary."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    seq_len: int = 4096
    micro_batch: int = 1
    micro_batches: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False  # with tp: the head split over the vocabulary, its logits sharded into the loss

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp


@dataclass
class Simulated:
    """Rank 0's step: bytes at the peak by category (:data:`dtlib.measure.peak.CATEGORIES`), the collectives
    by mesh dimension, and how it was obtained."""

    shape: Shape
    layout: Layout
    checkpointing: bool
    memory: dict[str, int]
    traffic: list[Row]
    depths: tuple[int, ...] = ()  # the depths simulated: two, scaled to shape.layers, or the real one
    seconds: float = 0.0  # how long the simulation took here
    kernels: str = "cuda"  # whose kernels kept the tensors for backward: a GPU's or this CPU's (llama.KERNELS)
    # bytes by category at the fullest moment before the optimizer's step (forward, the loss, backward): the peak
    # of the same step with an optimizer that holds nothing but its state at the update; empty if not simulated
    before_step: dict[str, int] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def peak(self) -> int:
        return sum(self.memory.values())

    def model_state(self) -> int:
        return self.memory["weights"] + self.memory["gradients"] + self.memory["optimizer"]

    def sent(self) -> dict[str, int]:
        """Bytes rank 0 sends per step along each mesh dimension ("pp", "dp", "tp")."""
        return sent_by_group(self.traffic)


def check_layout(shape: Shape, dp: int, tp: int, seq_len: int, micro_batch: int, pp: int = 1,
                 micro_batches: int = 1, sequence_parallel: bool = False, loss_parallel: bool = False) -> Layout:
    """The layout, every number checked: whole and positive, tp dividing the heads and the MLP, pp the layers,
    with sequence parallelism the sequence, and with loss parallelism the vocabulary."""
    for name, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    layout = Layout(whole("dp", dp), whole("tp", tp), whole("pp", pp), whole("seq_len", seq_len),
                    whole("micro_batch", micro_batch), whole("micro_batches", micro_batches), sequence_parallel,
                    loss_parallel)
    if loss_parallel and shape.vocab % layout.tp:
        raise ValueError(f"loss parallelism splits the vocabulary of {shape.vocab} tokens over tp={tp} ranks: tp "
                         "must divide it")
    if sequence_parallel and layout.seq_len % layout.tp:
        raise ValueError(f"sequence parallelism splits the {seq_len} positions of a sequence over tp={tp} ranks: "
                         "tp must divide seq_len")
    if shape.heads % layout.tp or shape.kv_heads % layout.tp or shape.ffn % layout.tp:
        raise ValueError(f"tp={tp} must divide the heads ({shape.heads}), the key/value heads ({shape.kv_heads}) "
                         f"and the MLP width ({shape.ffn}): each rank holds whole heads")
    if shape.layers % layout.pp:
        raise ValueError(f"pp={pp} must divide the {shape.layers} layers: each stage holds as many blocks")
    return layout


def mesh_of(layout: Layout, device_type: str) -> DeviceMesh:
    """The world as a (pp, dp, tp) mesh: tensor-parallel ranks next to each other (one machine's NVLink), then
    data parallelism, then the pipeline's stages, the outermost."""
    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))


def groups_of(mesh: DeviceMesh) -> dict[str, Any]:
    """The process group of each mesh dimension, by name: the labels of the traffic table."""
    return {name: mesh[name].get_group() for name in ("pp", "dp", "tp")}


def tokens_for(shape: Shape, layout: Layout, generator: torch.Generator | None = None) -> torch.Tensor:
    """A step's tokens: (micro_batch, seq_len), or (micro_batches, micro_batch, seq_len) for a pipeline or for
    several micro-batches."""
    size = (layout.micro_batch, layout.seq_len)
    if layout.pp > 1 or layout.micro_batches > 1:
        size = (layout.micro_batches, *size)
    return torch.randint(0, shape.vocab, size, generator=generator)


def run_step(step: Callable[..., Any] | None, model: nn.Module, optimizer: torch.optim.Optimizer,
             tokens: torch.Tensor, mesh: DeviceMesh) -> None:
    """``step(model, optimizer, tokens)``, or, for a pipeline or several micro-batches (tokens of three
    dimensions), ``step(model, optimizer, tokens, mesh)``; None: :func:`train_step` or :func:`pipeline_step`."""
    if tokens.dim() == 3:
        (step or pipeline_step)(model, optimizer, tokens, mesh)
    else:
        (step or train_step)(model, optimizer, tokens)


def step_on_fake_ranks(shape: Shape, layout: Layout, checkpointing: bool = False,
                       parallelize: Callable[..., Any] = parallelize, step: Callable[..., Any] | None = None,
                       kernels: str = "cuda", whole_first_step: bool = False
                       ) -> tuple[dict[str, int], list[Row], dict[Any, dict[str, int]]]:
    """Rank 0 of the layout's fake ranks, the first pipeline stage: lay the model out with
    ``parallelize(model, mesh, checkpointing)``, then run the step (:func:`run_step`) twice, the first to create
    Adam's state, and measure the second. The first must be a whole step (Adam's state made from zero gradients
    after a forward alone leaves FSDP's first backward to the measured step), but of the first micro-batch alone
    where the step has several: every op costs the same on fake tensors whatever its size, so a first step of all
    m micro-batches cost as much as the measured one, and one of a single micro-batch leaves the same state
    behind (``whole_first_step`` runs all of them; ``tests/sim`` checks that the tables are the same, and the
    live-rank proofs that they are the live ranks'). ``kernels``: what the model keeps for backward
    (:data:`dtlib.sim.llama.KERNELS`). Returns the memory at the peak by category, the collectives, and the memory
    at each moment (:class:`Position`; :meth:`~dtlib.measure.peak.PeakTracker.moments`)."""
    with fake_world(layout.world_size):
        mesh = mesh_of(layout, "cpu")  # fails inside FakeTensorMode
        with torch.device("meta"):
            model = Llama(shape, stage=0, stages=layout.pp, fused_norm=kernels == "cuda")
        model = lay_out(parallelize, model, mesh, layout, checkpointing)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            optimizer = adamw(model, kernels)
            tokens = tokens_for(shape, layout)
            run_step(step, model, optimizer, tokens if whole_first_step or tokens.dim() == 2 else tokens[:1], mesh)
            position = Position(model)
            try:
                with PeakTracker(model, optimizer, moment=position) as peak, traffic(groups_of(mesh)) as seen:
                    run_step(step, model, optimizer, tokens, mesh)
            finally:
                position.remove()
        return _tables(peak, seen)


def _tables(peak: PeakTracker, seen: Traffic) -> tuple[dict[str, int], list[Row], dict[Any, dict[str, int]]]:
    """What a measured step leaves: the memory at the peak by category, the collectives, and the memory at each
    moment. Read with autograd off, where a DTensor's ``to_local()`` hands back its local tensor instead of
    dispatching a (fake) view of it: the same storages, so the same tables, without a view of every optimizer
    state at every moment, which took about a tenth of the CPU time of simulating 7B on 64 to 512 ranks
    (``tests/sim`` compares the two readings)."""
    with torch.no_grad():
        return peak.categories(), seen.rows(), peak.moments()


class Position:
    """Where a step of a :class:`~dtlib.sim.llama.Llama` is, called: ``("forward", i)`` from block ``i``'s forward
    on (``-1``: the embedding, before any block; the head and the loss come after the last block),
    ``("backward", i)`` from the gradient of block ``i``'s output on (a checkpointed block's recomputation
    included). The tracker's moments (:class:`~dtlib.measure.peak.PeakTracker`): the most bytes held at each."""

    def __init__(self, model: nn.Module) -> None:
        self.now: tuple[str, int] = ("forward", -1)
        self._handles = [model.register_forward_pre_hook(lambda *_: self._at("forward", -1))]
        for index, block in enumerate(model.blocks):
            self._handles.append(block.register_forward_pre_hook(lambda *_, i=index: self._at("forward", i)))
            self._handles.append(block.register_forward_hook(lambda _, __, out, i=index: self._on_backward(out, i)))

    def __call__(self) -> tuple[str, int]:
        return self.now

    def _at(self, phase: str, index: int) -> None:
        self.now = (phase, index)

    def _on_backward(self, output: torch.Tensor, index: int) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda _: self._at("backward", index))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def adamw(model: nn.Module, kernels: str) -> torch.optim.Optimizer:
    """AdamW as torch runs it by default on the kernels' device: on a GPU its foreach implementation, which takes
    the square root of every second moment at once (a temporary of 4 bytes per parameter held, in the step), on
    this CPU one parameter at a time (torch picks foreach only for CUDA tensors)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=kernels == "cuda")


def _anchored(moments: dict[Any, dict[str, int]], blocks: int) -> dict[Any, dict[str, int]]:
    """The moments of a step through ``blocks`` blocks (:class:`Position`), each named by its distance from the
    first block and again from the last: a moment near the model's start is the same moment at any depth when
    counted from the first block, one near its end (the loss, the start of backward) when counted from the last.
    Neither count reaches the other end: the last block is not the first's kind (FSDP prefetches no block after
    it, and the loss follows it), so block 2 of a model of 3 blocks is not block 2 of a model of 4."""
    anchored: dict[Any, dict[str, int]] = {}
    for key, memory in moments.items():
        if isinstance(key, tuple):
            phase, index = key
            if index < blocks - 1:
                anchored[(phase, "from the first block", index)] = memory
            if 0 < index < blocks:
                anchored[(phase, "from the last block", blocks - 1 - index)] = memory
        else:
            anchored[key] = memory  # the optimizer's step
    return anchored


def _deepest_moments(low: dict[Any, dict[str, int]], high: dict[Any, dict[str, int]], low_depth: int,
                     high_depth: int, depth: int) -> dict[Any, dict[str, int]]:
    """Each moment's memory at the two depths simulated, by category, extended to ``depth``. The peak is the
    fullest of them (:func:`_fullest`). The peak's own moment at a shallow depth may not be the deep model's (a
    shallow model peaks where its activations are largest, in the loss or in backward, a deep one in the
    optimizer's step, whose state grows with every block), so every moment is extended, not the shallow peak
    alone."""
    return {key: {name: _extend(low[key][name], high[key][name], low_depth, high_depth, depth) for name in CATEGORIES}
            for key in low.keys() & high.keys()}


def _fullest(moments: dict[Any, dict[str, int]]) -> dict[str, int]:
    """The moment that holds the most bytes, taken in one order so that a tie goes the same way every time."""
    return max((moments[key] for key in sorted(moments, key=str)), key=lambda memory: sum(memory.values()))


def _before_step(moments: dict[Any, dict[str, int]]) -> dict[str, int]:
    """The fullest moment before the optimizer's step (:meth:`dtlib.measure.peak.PeakTracker.moments`)."""
    earlier = {key: memory for key, memory in moments.items() if key != STEP_MOMENT}
    return _fullest(earlier) if earlier else {}


def _extend(low: float, high: float, low_depth: int, high_depth: int, depth: int) -> int:
    """The line through (low_depth, low) and (high_depth, high), read at ``depth``."""
    return round(low + (high - low) * (depth - low_depth) / (high_depth - low_depth))


def simulate(shape: Shape, dp: int = 1, tp: int = 1, seq_len: int = 4096, micro_batch: int = 1,
             checkpointing: bool = False, *, pp: int = 1, micro_batches: int = 1, sequence_parallel: bool = False,
             loss_parallel: bool = False, depths: tuple[int, int] | None = (3, 4),
             parallelize: Callable[..., Any] = parallelize, step: Callable[..., Any] | None = None,
             kernels: str = "cuda") -> Simulated:
    """Rank 0's memory and traffic for one training step of ``shape`` on pp x dp x tp ranks (rank 0 is the
    pipeline's first stage: the embedding, its share of the blocks, and the most micro-batches in flight).

    ``depths``: the two depths (blocks per stage) simulated and scaled to ``shape.layers`` (a few seconds whatever
    the depth; on Linux with two cores, both at once: :mod:`dtlib.sim.forked`); None simulates every layer (about
    a second per layer here). ``parallelize`` and ``step`` are the layout and the step, notebook 11's and
    :func:`dtlib.sim.pipeline.pipeline_step` by default; pass your own to simulate them (a step for a pipeline, or
    for several micro-batches, also takes the mesh). With dtlib's own layout and step, a question asked again in
    this process is answered from the first run, and every caller gets a copy of its own: converting one's result
    in place (to GiB, say) changes no other caller's.
    ``kernels``: what the model keeps for backward, as a GPU's kernels keep it ("cuda", a cluster's question) or
    as this CPU's do ("cpu", what live ranks here measure); :data:`dtlib.sim.llama.KERNELS`.
    ``sequence_parallel``: with ``tp`` over 1, the norms and the activations between blocks hold a share of the
    sequence (:func:`parallelize`). ``loss_parallel``: with ``tp`` over 1, the head on the last stage holds a share
    of the vocabulary, and its logits stay split into the loss (torchtitan's ``loss_parallel``).
    """
    started = time.perf_counter()
    layout = check_layout(shape, dp, tp, seq_len, micro_batch, pp, micro_batches, sequence_parallel, loss_parallel)
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    key = (shape, layout, checkpointing, depths, kernels)
    if parallelize is _parallelize and step is None and key in _ANSWERED:  # dtlib's own layout and step, again
        return copy.deepcopy(_ANSWERED[key])  # the kept answer is never handed out: a checker reads it next
    if depths is None or shape.layers <= max(depths) * pp:
        memory, rows, moments = step_on_fake_ranks(shape, layout, checkpointing, parallelize, step, kernels)
        used = (shape.layers,)
    else:
        low_depth, high_depth = (depth * pp for depth in depths)  # layers in all: each stage holds depth blocks
        def at(depth: int) -> Callable[[], tuple[dict[str, int], list[Row], dict[Any, dict[str, int]]]]:
            return lambda: step_on_fake_ranks(shape.with_layers(depth), layout, checkpointing, parallelize, step,
                                              kernels)

        low, high = alongside(at(low_depth), at(high_depth))  # at once on two cores: a forked copy runs the lower
        moments = _deepest_moments(_anchored(low[2], depths[0]), _anchored(high[2], depths[1]), low_depth,
                                   high_depth, shape.layers)
        memory = _fullest(moments)
        lows = {(row.group, row.call): row for row in low[1]}
        rows = [Row(row.group, row.call,
                    *(_extend(getattr(lows[(row.group, row.call)], name), getattr(row, name), low_depth,
                              high_depth, shape.layers) if (row.group, row.call) in lows else getattr(row, name)
                      for name in ("calls", "payload", "sent")))
                for row in high[1]]
        used = (low_depth, high_depth)
    result = Simulated(shape, layout, checkpointing, memory, rows, used, time.perf_counter() - started, kernels,
                       _before_step(moments))
    if parallelize is _parallelize and step is None:
        _ANSWERED[key] = copy.deepcopy(result)  # kept apart from the caller's, which they may edit
    return result


_parallelize = parallelize  # dtlib's own layout: the one whose results are kept
#: Results of dtlib's own layout and step, by (shape, layout, checkpointing, depths, kernels): a checker asking what a
#: cell already simulated gets the answer at once (its ``seconds`` are the first run's). Only copies leave it.
_ANSWERED: dict[tuple[Any, ...], Simulated] = {}
