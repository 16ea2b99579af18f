"""Predict, then measure: the learner types what a key figure will be, then the course measures it on this machine
and says how far off the prediction was, and why.

Each prediction owns its inputs, as every checker does: the measurement runs dtlib's own code on sizes fixed here
(a ring of 4 ranks and 1 MiB, DDP's runner on its ``wide_mlp``), so the figure is this machine's and the
reasoning under it holds for any learner. A guess is read as typed answers are (:func:`dtlib.checks.typed.number`:
``"1.5"``, or ``"1.5 MiB"`` with the unit). Close enough is within ``rtol`` of the measured value; a count must
be exact.

Example (a notebook cell; the widget shows the question, a box for the guess and a button that measures)::

    dtlib.checks.predict("ring bytes")

Without a browser, :func:`judge` gives the same verdict: ``judge(PREDICTIONS["ring bytes"], "3 MiB", 1.5)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtlib import compat
from dtlib.checks import stepping, typed
from dtlib.checks.feedback import Feedback
from dtlib.launch import torchrun
from dtlib.launch.entry import rank_device
from dtlib.launch.spawn import spawn
from dtlib.measure.counting import count_collectives, watching
from dtlib.ring.send_recv import ring_all_reduce
from dtlib.sim import failures
from dtlib.sim.llama import LLAMA
from dtlib.sim.step import simulate
from dtlib.train import ddp, fsdp_compare

RING_RANKS = 4
GATHERED = 1000  # float32 numbers per rank in notebook 02's all-gather
JOB_HOURS = 2000  # about 500 failures: the simulated share within a point of the exact one, in a second
MOE_RANKS, MOE_EXPERTS, MOE_TOKENS, MOE_DIM = 4, 8, 1024, 16
_FRACTION = re.compile(r"(-?\d+)\s*/\s*(\d+)")
RING_ELEMENTS = 2**18  # float32: 1 MiB per rank


@dataclass(frozen=True)
class Prediction:
    """One figure to predict: the question, its unit, how to measure it here, why it comes out as it does, and what
    a common wrong guess usually missed (``hints``: a ratio of guess to measurement, and what it means)."""

    question: str
    unit: str
    measure: Callable[[], float]
    why: str
    hints: tuple[tuple[float, str], ...] = field(default_factory=tuple)
    whole: bool = False
    rtol: float = 0.05
    how_far: bool = True  # False for a number that names something (a rank): no "33% below" then


def judge(prediction: Prediction, guess: Any, measured: float) -> Feedback:
    """The verdict on ``guess`` against ``measured``: right within ``prediction.rtol`` (exact for a count), else how
    far off, by what factor, and what that factor usually means; the reason follows either way."""
    if guess is None or (isinstance(guess, str) and not guess.strip()):
        kind = f"a number of {prediction.unit}" if prediction.unit else "a number"
        return Feedback(False, f"Type your prediction first, {kind}, then measure.")
    fraction = _FRACTION.fullmatch(guess.strip()) if isinstance(guess, str) else None
    if fraction and int(fraction.group(2)):
        guess = int(fraction.group(1)) / int(fraction.group(2))  # "4/3", as a person writes a ratio
    value = typed.number(guess, prediction.unit, prediction.whole)
    if isinstance(value, str):
        return Feedback(False, value.replace("Answer with", "Predict"))
    if prediction.whole and not float(value).is_integer():
        return Feedback(False, f"Predict a whole number{' of ' + prediction.unit if prediction.unit else ''}, "
                               f"not {value:g}.")
    unit = prediction.unit if prediction.unit in ("%", "") else f" {prediction.unit}"
    said = f"You predicted {_shown(value)}; this machine measured {_shown(measured)}{unit}."
    close = value == measured if prediction.whole else abs(value - measured) <= prediction.rtol * abs(measured)
    if close:
        return Feedback(True, f"{said} {prediction.why}")
    if measured and value and (value > 0) == (measured > 0):
        ratio = value / measured
        if ratio >= 2:
            far = f"{ratio:.2g} times the measurement"
        elif ratio <= 0.5:
            far = f"the measurement divided by {1 / ratio:.2g}"
        else:
            far = f"{abs(ratio - 1):.0%} {'above' if ratio > 1 else 'below'} the measurement"
        near = max(0.02, prediction.rtol / 2)  # a drawn measurement moves a common mistake's ratio a little
        hint = next((text for factor, text in prediction.hints if abs(ratio / factor - 1) <= near), "")
        far = f"Yours is {far}. " if prediction.how_far else ""
        return Feedback(False, f"{said} {far}{hint + ' ' if hint else ''}{prediction.why}")
    return Feedback(False, f"{said} {prediction.why}")


def _shown(number: float) -> str:
    """A number as a person reads it: whole ones with thousands separated, others to 3 significant digits."""
    return f"{number:,.0f}" if float(number).is_integer() or abs(number) >= 100 else f"{number:.3g}"


# -- the measurements --------------------------------------------------------------------------------------------


def _ring_sent(rank: int, world_size: int, elements: int) -> int:
    """Bytes this rank sends in dtlib's ring all-reduce of ``elements`` float32 numbers, as c10d's ``send`` sees
    them (``batch_isend_irecv`` posts one per ring step)."""
    sent: list[int] = []

    def see(namespace: str, name: str, args: tuple) -> None:
        if namespace == "c10d" and name == "send":
            sent.append(sum(tensor.nbytes for tensor in args[0]))

    with watching(see):
        ring_all_reduce(torch.ones(elements, device=rank_device()))
    return sum(sent)


def _ring_mib() -> float:
    return max(spawn(_ring_sent, world_size=RING_RANKS, args=(RING_ELEMENTS,), output="none")) / 2**20


def _ddp_calls() -> float:
    first = ddp.run(ddp.TrainConfig(model="wide_mlp", steps=3), world_size=2, output="none")[0]
    return first.comm_calls[-1]


def _model_state_gib() -> float:
    return simulate(LLAMA["7B"], dp=64, seq_len=4096).model_state() / 2**30  # dtlib's layout: kept for the checker


def _fsdp_all_gathers() -> float:
    return sum(op == "all_gather" for op, _ in stepping.observed())  # notebook 15's trace, on 2 live ranks


def _hsdp_over_ddp() -> float:
    ddp_row, hsdp_row = fsdp_compare.strategies(world_size=4, labels=("DDP", "FSDP2 HSDP (2 x 2 mesh)"))
    return fsdp_compare.bytes_sent_per_rank(hsdp_row) / fsdp_compare.bytes_sent_per_rank(ddp_row)


def _tp_mlp_calls(rank: int, world_size: int) -> int:
    """All-reduces of one forward and backward of a Megatron MLP under torch's tensor parallelism, its input
    needing a gradient as inside a model."""
    device = rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).to(device)
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 16).to(device).requires_grad_()
    y, forward = count_collectives(mlp, x)
    _, backward = count_collectives(lambda: y.sum().backward())
    return forward.get("all_reduce", 0) + backward.get("all_reduce", 0)


def _tp_all_reduces() -> float:
    return spawn(_tp_mlp_calls, world_size=2, output="none")[0]


def _moe_copies_sent() -> float:
    """Copies of rank 0's tokens that a random router sends to other ranks' experts (its own generator: the
    notebook's random state is left as it was)."""
    generator = torch.Generator().manual_seed(0)
    router = torch.randn(MOE_DIM, MOE_EXPERTS, generator=generator)
    tokens = torch.randn(MOE_TOKENS, MOE_DIM, generator=generator)
    chosen = (tokens @ router).topk(2, dim=-1).indices  # each token's 2 experts
    return float((chosen // (MOE_EXPERTS // MOE_RANKS) != 0).sum())  # experts 2r and 2r + 1 live on rank r


def _dtensor_calls(rank: int, world_size: int) -> int:
    """Collectives of ``distribute_tensor`` with ``Shard(0)`` and then ``full_tensor()``, on this rank."""
    device = rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    x, made = count_collectives(lambda: distribute_tensor(torch.arange(16.0).view(4, 4).to(device), mesh, [Shard(0)]))
    _, gathered = count_collectives(x.full_tensor)
    return sum(made.values()) + sum(gathered.values())


def _dtensor_collectives() -> float:
    return spawn(_dtensor_calls, world_size=2, output="none")[0]


def _job_waste_percent() -> float:
    """The share of a long simulated job's wall time that made no new work, in percent (failures drawn at random,
    one fixed seed)."""
    run = failures.simulate(work_s=JOB_HOURS * 3600, interval_s=3600, mtbf_s=4 * 3600, checkpoint_s=60, restart_s=300)
    return 100 * (1 - JOB_HOURS * 3600 / run.wall_s)


def _summed(rank: int, world_size: int) -> float:
    total = torch.tensor([rank + 1.0], device=rank_device())
    dist.all_reduce(total)
    return total.item()


def _sum_on_rank_2() -> float:
    return spawn(_summed, world_size=4, output="none")[2]


def _gathered_bytes(rank: int, world_size: int, elements: int) -> int:
    device = rank_device()
    gathered = torch.empty(world_size * elements, device=device)
    compat.all_gather_single(gathered, torch.full((elements,), float(rank), device=device))
    return gathered.nbytes


def _gathered_kb() -> float:
    return spawn(_gathered_bytes, world_size=4, args=(GATHERED,), output="none")[0] / 1000


def _torchrun_rank() -> float:
    records = torchrun.env_records(torchrun.simulate_nodes(["-m", "dtlib.examples.env"], nnodes=2,
                                                           nproc_per_node=2, rendezvous="static"))
    return next(int(r["RANK"]) for r in records if r["GROUP_RANK"] == "1" and r["LOCAL_RANK"] == "1")


#: Every prediction a notebook asks, by name.
PREDICTIONS: dict[str, Prediction] = {
    "all-reduced value": Prediction(
        question=("4 ranks each hold total = torch.tensor([rank + 1.0]) and call dist.all_reduce(total), with no "
                  "other argument. What does total hold on rank 2 afterwards?"),
        unit="", measure=_sum_on_rank_2, how_far=False,
        why=("all_reduce sums by default (op=ReduceOp.SUM) and leaves the result on every rank, in place: "
             "1 + 2 + 3 + 4 = 10 on rank 2, and on every other rank."),
        hints=((0.3, "3 is rank 2's own value; all_reduce combines every rank's."),
               (0.25, "2.5 is the mean; the default op is SUM (ReduceOp.AVG gives the mean)."),
               (0.4, "4 is the number of ranks; all_reduce adds their values, 1 to 4.")),
    ),
    "gathered bytes": Prediction(
        question=(f"4 ranks each hold {GATHERED:,} float32 numbers and call dist.all_gather_single. How many kB "
                  "(1,000 bytes) does each rank's output tensor hold?"),
        unit="kB", measure=_gathered_kb,
        why=(f"Every rank ends with every rank's {GATHERED:,} numbers, its own included, side by side: 4 x "
             f"{GATHERED:,} x 4 bytes = 16 kB on each rank. The output grows with the ranks; the input does not."),
        hints=((0.25, "4 kB is one rank's input; the output holds all four."),
               (0.75, "12 kB leaves out the rank's own part; the output holds it too, in its rank's slot."),
               (4.0, "64 kB counts every rank's output; the question asks for one rank's.")),
    ),
    "torchrun rank": Prediction(
        question=("torchrun starts 2 nodes of 2 processes (--nnodes=2 --nproc_per_node=2, node ranks 0 and 1). What "
                  "RANK does the process with LOCAL_RANK 1 on node 1 get?"),
        unit="", measure=_torchrun_rank, whole=True, how_far=False,
        why=("RANK counts every process of the job, node after node: node_rank x nproc_per_node + LOCAL_RANK = "
             "1 x 2 + 1 = 3. LOCAL_RANK counts on one machine only, and picks the GPU there."),
        hints=((1 / 3, "1 is its LOCAL_RANK, its number on its own machine; RANK numbers the whole job."),
               (2 / 3, "2 is node 1's first process; LOCAL_RANK 1 is its second."),
               (4 / 3, "4 would number from 1; ranks start at 0.")),
    ),
    "ring bytes": Prediction(
        question=(f"{RING_RANKS} ranks each hold 1 MiB of float32 and all-reduce it with the ring (a reduce-scatter, "
                  "then an all-gather). How many MiB does each rank send in all?"),
        unit="MiB", measure=_ring_mib,
        why=("In each phase a rank sends N-1 chunks of 1/N of the tensor: 2(N-1)/N x 1 MiB = 1.5 MiB with 4 ranks. "
             "It grows towards twice the tensor as N grows, never past it, which is why the ring scales."),
        hints=((2.0, "3 MiB is the whole tensor to each of the 3 others: the naive all-reduce, not the ring."),
               (0.5, "That is one phase: the all-gather sends as much again."),
               (2 / 3, "1 MiB is the tensor once; the ring sends 3/4 of it in each of its two phases."),
               (4 / 3, "2 MiB is the limit for many ranks; with 4 it is 2 x 3/4.")),
    ),
    "ddp all-reduces": Prediction(
        question=("DDP trains notebook 04's wide_mlp (3.04 MiB of float32 gradients) on 2 ranks with the default "
                  "bucket_cap_mb=25. How many all-reduces does one step make, once the first step is over?"),
        unit="all-reduces", measure=_ddp_calls, whole=True,
        why=("After step 0 DDP rebuilds its buckets in the order the gradients arrived, and closes the first one "
             "after about 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) so that communication starts early in backward: "
             "3.04 MiB go in 2 all-reduces, though all would fit under the 25 MB cap."),
        hints=((0.5, "1 is step 0's layout, one bucket for everything; DDP rebuilds the buckets after it."),
               (5.0, "10 is one per parameter, NaiveDDP's way; DDP packs gradients into buckets.")),
    ),
    "fsdp all-gathers": Prediction(
        question=("Three Linear layers, each its own fully_shard unit with reshard_after_forward=True, then the root, "
                  "which holds no parameter of its own, train on 2 ranks. How many all-gathers does one forward and "
                  "backward make?"),
        unit="all-gathers", measure=_fsdp_all_gathers, whole=True,
        why=("Each unit gathers its weights just before its forward and frees them after; backward needs them "
             "again, so each unit gathers them a second time: 2 x 3 = 6. The last unit too, though its backward "
             "comes right after its forward. reshard_after_forward=False would keep them and save the second three."),
        hints=((0.5, "3 is forward only: the weights are freed after each forward, so backward gathers them again."),
               (5 / 6, "5 keeps the last unit's weights between its forward and its backward; fully_shard frees "
                       "them like every other unit's when reshard_after_forward=True."),
               (1.5, "9 counts the reduce-scatters too (one per unit, in backward); the question asks for "
                     "all-gathers."),
               (4 / 3, "8 gathers the root as well; the root holds no parameter here, so it gathers nothing.")),
    ),
    "hsdp traffic": Prediction(
        question=("4 ranks train the same model with DDP and with HSDP on a 2 x 2 mesh (each parameter sharded over a "
                  "pair of ranks, the two pairs holding copies). How many times DDP's bytes does one HSDP rank send "
                  "per step, every collective a ring?"),
        unit="times DDP's bytes", measure=_hsdp_over_ddp,
        why=("DDP all-reduces the gradients S over 4 ranks: 2 x 3/4 x S = 1.5 S. HSDP all-gathers the weights twice "
             "and reduce-scatters the gradients once within its pair (1/2 x S each: 1.5 S), then all-reduces its "
             "half of the gradients with the other pair (2 x 1/2 x S/2 = 0.5 S): 2 S, which is 4/3 of DDP's."),
        hints=((0.75, "1.0 is DDP itself, or FSDP without resharding after forward: HSDP gathers the weights again "
                      "for backward, and adds an all-reduce between the pairs."),
               (1.125, "1.5 is full sharding over all 4 ranks; HSDP's pair sends less in each collective but adds "
                       "the all-reduce between the pairs."),
               (1.5, "2 is HSDP's bytes over the gradients' size S; DDP's own are 1.5 S, not S.")),
    ),
    "tp all-reduces": Prediction(
        question=("An MLP, its first Linear ColwiseParallel and its second RowwiseParallel (Megatron's split), runs "
                  "on 2 ranks; its input needs a gradient, as inside a model. How many all-reduces do one forward "
                  "and its backward make?"),
        unit="all-reduces", measure=_tp_all_reduces, whole=True,
        why=("Forward: the column-parallel layer leaves each rank whole, different hidden features, which the "
             "row-parallel layer turns into summands of the output: one all-reduce adds them. Backward mirrors it: "
             "the gradient of the output arrives whole on every rank, and the gradient of the input is a sum of "
             "each rank's share through its columns: one all-reduce. 2 in all."),
        hints=((0.5, "1 is forward only; the input's gradient is summed over the ranks in backward too."),
               (2.0, "4 counts each layer in each direction; between the two layers nothing is sent: that is the "
                     "point of pairing the splits.")),
    ),
    "moe copies": Prediction(
        question=(f"Rank 0 of {MOE_RANKS} holds {MOE_TOKENS:,} tokens; a router sends each to its top 2 of "
                  f"{MOE_EXPERTS} experts, 2 experts per rank (rank r holds 2r and 2r + 1). How many copies of "
                  "rank 0's tokens leave it for other ranks in the dispatch?"),
        unit="copies", measure=_moe_copies_sent, rtol=0.05,
        why=(f"Each token is copied once per chosen expert, {MOE_TOKENS:,} x 2 assignments, and 3 of the 4 ranks "
             f"are elsewhere: about {MOE_TOKENS * 2 * 3 // 4:,} copies leave, as many as a fair router spreads "
             "evenly. A router that favours some experts moves the count, and the busiest rank sets the step's "
             "time: hence the balancing loss further on."),
        hints=((4 / 3, "2,048 counts the copies for rank 0's own experts too; a quarter of the assignments stay."),
               (2 / 3, "1,024 sends each token once; a token goes to each of its 2 experts."),
               (0.5, "768 is 3/4 of the tokens; each token is copied once per chosen expert, 2 of them.")),
    ),
    "dtensor collectives": Prediction(
        question=("On 2 ranks, x = distribute_tensor(t, mesh, [Shard(0)]) for a 4 x 4 tensor t, then "
                  "x.full_tensor(). How many collectives does each rank call in all?"),
        unit="collectives", measure=_dtensor_collectives, whole=True,
        why=("distribute_tensor scatters t from rank 0, each rank receiving its rows (1 scatter); full_tensor "
             "brings every rank's rows to every rank (1 all-gather). Neither shows in your code: the stepper finds "
             "them for you."),
        hints=((0.5, "1 misses the scatter: distribute_tensor sends each rank its rows from rank 0."),
               (1.5, "3 would gather or broadcast once more; one all-gather gives every rank every row."),
               (2.0, "4 counts each call twice; each rank calls one scatter and one all-gather.")),
    ),
    "job waste": Prediction(
        question=("A long job checkpoints after every hour of work (a checkpoint takes 1 minute), restarts in 5 "
                  "minutes, and fails every 4 hours on average, at random. What percentage of its wall time makes "
                  "no new work?"),
        unit="%", measure=_job_waste_percent, rtol=0.1,
        why=("Three costs: the checkpoints (1 minute per hour of work, about 1.7%), the restarts (5 minutes per 4 "
             "hours, about 2%), and the work lost, on average half an interval per failure (30 minutes per 4 "
             "hours, about 12%): about 15% in all. The simulation drew 2,000 hours of work and about 500 failures; "
             "the exact expectation, dtlib.sim.failures.waste, is 15.4%."),
        hints=((12.5 / 15, "12.5% counts the lost work alone; the checkpoints and the restarts cost time too."),
               (25 / 15, "25% loses a whole interval at each failure; on average a failure strikes halfway through."),
               (1.7 / 15, "1.7% is the checkpoints alone; most of the waste is work lost to failures.")),
    ),
    "model state": Prediction(
        question=("Llama 2 7B (6.74 billion parameters) trains on 64 ranks with FSDP, in bf16 with fp32 weights and "
                  "AdamW. How many GiB of model state (weights, gradients, optimizer) does rank 0 hold at the step's "
                  "peak memory?"),
        unit="GiB", measure=_model_state_gib,
        why=("At the peak rank 0 holds its shard of the fp32 weights and of Adam's two moments, 12 bytes per "
             "parameter divided by the 64 ranks: 12 x 6.74e9 / 64 bytes = 1.18 GiB. The gradients' 4 bytes come later "
             "in backward, as the activations are freed, so the peak does not hold them."),
        hints=((4 / 3, "16 bytes per parameter counts the gradients too; at the peak they do not exist yet."),
               (64.0, "That is the whole model's state: FSDP divides it by the 64 ranks."),
               (256 / 3, "That is 16 bytes for every parameter on one rank: FSDP divides it by the 64 ranks.")),
    ),
}


def predict(name: str) -> object:
    """A widget for the prediction ``name`` (a key of :data:`PREDICTIONS`): its question, a box for the guess and
    a button that measures on this machine (a few seconds) and shows :func:`judge`'s verdict under it. The
    measurement runs once; later guesses are judged against it. Show it as a notebook cell's value."""
    if name not in PREDICTIONS:
        raise ValueError(f"no prediction named {name!r}: choose one of {sorted(PREDICTIONS)}")
    import ipywidgets as widgets

    prediction = PREDICTIONS[name]
    guess = widgets.Text(placeholder=prediction.unit, description="predict", continuous_update=False)
    button = widgets.Button(description="measure", tooltip="measure it on this machine, then judge the prediction")
    shown = widgets.Output()
    measured: list[float] = []

    def measure(_: Any) -> None:
        with shown:
            shown.clear_output()
            if not measured:
                print("measuring on this machine ...")
                try:
                    measured.append(prediction.measure())
                except Exception as err:  # a measurement that fails says so here, and the button tries again
                    shown.clear_output()
                    print(f"The measurement failed, so nothing was judged: {type(err).__name__}: {err}")
                    return
                shown.clear_output()
            print(repr(judge(prediction, guess.value, measured[0])))

    button.on_click(measure)
    box = widgets.VBox([widgets.HTML(f"<b>Predict first.</b> {prediction.question}"), widgets.HBox([guess, button]),
                        shown])
    box.add_class("dtlib-prediction")
    return box
