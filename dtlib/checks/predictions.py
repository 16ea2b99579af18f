"""Predict, then measure: the learner types what a key figure will be, then the course measures it on this machine
and says how far off the prediction was, and why.

Each prediction owns its inputs, as every checker does: its measurement (:mod:`dtlib.checks.measured`) runs dtlib's
or torch's own code on sizes fixed there (a ring of 4 ranks and 1 MiB, DDP's runner on its ``wide_mlp``), so the
figure is this machine's and the reasoning under it holds for any learner. A guess is read as typed answers are
(:func:`dtlib.checks.typed.number`: ``"1.5"``, or ``"1.5 MiB"`` with the unit). Close enough is within ``rtol`` of
the measured value; a count must be exact, and so must a common mistake's count for its hint to be shown.

Example (a notebook cell; the widget shows the question, a box for the guess and a button that measures)::

    dtlib.checks.predict("ring bytes")

Without a browser, :func:`judge` gives the same verdict: ``judge(PREDICTIONS["ring bytes"], "3 MiB", 1.5)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtlib.checks import measured, typed
from dtlib.checks.feedback import Feedback
from dtlib.checks.measured import (
    GATHERED,
    KV_HEAD_DIM,
    KV_HEADS,
    KV_SEQUENCE,
    MOE_EXPERTS,
    MOE_RANKS,
    MOE_TOKENS,
    PIPELINE_MICRO_BATCHES,
    PIPELINE_STAGES,
    RING_RANKS,
    SAMPLES,
    SPAWNED,
)

_FRACTION = re.compile(r"(-?\d+)\s*/\s*(\d+)")


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
    measured_by: str = "this machine"  # what gives the figure: "20 simulated jobs" where it is a simulation's


def judge(prediction: Prediction, guess: Any, measured: float) -> Feedback:
    """The verdict on ``guess`` against ``measured``: right within ``prediction.rtol`` (exact for a count), else how
    far off, by what factor, and what that factor usually means; the reason follows either way."""
    if guess is None or (isinstance(guess, str) and not guess.strip()):
        kind = f"a number of {prediction.unit}" if prediction.unit else "a number"
        return Feedback(False, f"Type your prediction first, {kind}, then measure.")
    fraction = _FRACTION.fullmatch(guess.strip()) if isinstance(guess, str) else None
    if fraction and int(fraction.group(2)):
        guess = int(fraction.group(1)) / int(fraction.group(2))  # "4/3", as a person writes a ratio
    percent = isinstance(guess, str) and prediction.unit.startswith("times ") and guess.strip().endswith("%")
    value = typed.number(guess.strip().removesuffix("%") if percent else guess, prediction.unit, prediction.whole)
    if isinstance(value, str):
        return Feedback(False, value.replace("Answer with", "Predict"))
    if percent:
        value /= 100  # "133%" of DDP's bytes: 1.33 times them
    if prediction.whole and not float(value).is_integer():
        return Feedback(False, f"Predict a whole number{' of ' + prediction.unit if prediction.unit else ''}, "
                               f"not {value:g}.")
    unit = prediction.unit if prediction.unit in ("%", "") else f" {prediction.unit}"
    said = f"You predicted {float(value):,.6g}; {prediction.measured_by} measured {_shown(measured)}{unit}."  # as typed

    def close(number: float) -> bool:
        return number == measured if prediction.whole else abs(number - measured) <= prediction.rtol * abs(measured)

    if close(value):
        return Feedback(True, f"{said} {prediction.why}")
    if measured and value and (value > 0) == (measured > 0):
        ratio = value / measured
        if ratio >= 2:
            far = f"{ratio:.2g} times the measurement"
        elif ratio <= 0.5:
            far = f"the measurement divided by {measured / value:.2g}"  # not 1 / ratio: it may round to 0
        else:
            far = f"{abs(ratio - 1):.0%} {'above' if ratio > 1 else 'below'} the measurement"
        near = max(0.02, prediction.rtol / 2)  # a drawn measurement moves a common mistake's ratio a little

        def matches(factor: float) -> bool:  # a count's mistake is one exact number; a measurement's, near one
            return value == round(factor * measured) if prediction.whole else abs(ratio / factor - 1) <= near

        hint = next((text for factor, text in prediction.hints if matches(factor)), "")
        if prediction.unit == "%" and value < 1 <= measured:  # a share written as a fraction
            hint = (f"{_shown(value)} looks like a fraction, not a percentage: {_shown(value)} of the whole is "
                    f"{_shown(100 * value)}%{', which would be right' if close(100 * value) else ''}.")
        far = f"Yours is {far}. " if prediction.how_far else ""
        return Feedback(False, f"{said} {far}{hint + ' ' if hint else ''}{prediction.why}")
    return Feedback(False, f"{said} {prediction.why}")


def _shown(number: float) -> str:
    """A number as a person reads it: whole ones with thousands separated, others (and those past 10^15) to 3
    significant digits."""
    if abs(number) >= 1e15:
        return f"{number:.3g}"
    return f"{number:,.0f}" if float(number).is_integer() or abs(number) >= 100 else f"{number:.3g}"


_ONE_COST_LEFT_OUT = ("Leaving one of the three costs out gives that: the checkpoints cost about 1.6 points and the "
                      "restarts about 2.")

#: Every prediction a notebook asks, by name.
PREDICTIONS: dict[str, Prediction] = {
    "spawned processes": Prediction(
        question=(f"dtlib.spawn(fn, world_size={SPAWNED}) runs fn once per rank, and each call returns os.getpid(), "
                  "the ID of the process it runs in. How many different IDs are in the list spawn returns?"),
        unit="IDs", measure=measured.spawned_processes, whole=True,
        why=(f"Every rank is a process of its own, with its own Python, its own memory and its own copy of every "
             f"variable: {SPAWNED} ranks, {SPAWNED} IDs. That is why ranks share nothing unless they send it, and why "
             "a rank's print shows up tagged with its rank."),
        hints=((1 / SPAWNED, "1 would be one process running every rank, threads say; each rank is a process."),
               ((SPAWNED + 1) / SPAWNED, f"{SPAWNED + 1} counts the notebook's kernel too; it starts the ranks and "
                                         "waits for them, but runs no rank itself.")),
    ),
    "sampler orders": Prediction(
        question=(f"DistributedSampler(dataset of {SAMPLES}, num_replicas=2, rank=0, shuffle=True) is iterated "
                  "once per epoch for 3 epochs, and sampler.set_epoch(epoch) is never called. How many different "
                  "orders of indices does rank 0 get over the 3 epochs?"),
        unit="", measure=measured.sampler_orders, whole=True, how_far=False,
        why=("The sampler shuffles with a generator seeded by seed + epoch, and its epoch stays 0 until set_epoch "
             "changes it: every epoch repeats epoch 0's order, on every rank. Nothing fails and the loss still "
             "falls, a little worse than it should: only reading the order shows it."),
        hints=((3.0, "3 is what set_epoch(epoch) gives; without it the sampler's seed never changes."),
               (2.0, "2 would reshuffle once; the seed is seed + epoch, and the epoch never moves from 0.")),
    ),
    "micro-batches held": Prediction(
        question=(f"torch's Schedule1F1B runs {PIPELINE_STAGES} stages on {PIPELINE_STAGES} ranks with "
                  f"{PIPELINE_MICRO_BATCHES} micro-batches. At most how many micro-batches' activations does stage 0 "
                  "hold at once (their forward run, their backward not yet)?"),
        unit="micro-batches", measure=measured.micro_batches_held, whole=True,
        why=(f"Stage 0 runs forwards until the first micro-batch's backward comes back from the last stage: "
             f"{PIPELINE_STAGES} forwards, one per stage of the pipeline, then one forward per backward. Stage s "
             f"holds at most p - s, whatever the number of micro-batches; GPipe would hold all "
             f"{PIPELINE_MICRO_BATCHES}."),
        hints=((PIPELINE_MICRO_BATCHES / PIPELINE_STAGES, "That is GPipe: every forward before any backward. 1F1B "
                                                          "starts backwards as soon as the last stage can."),
               (1 / PIPELINE_STAGES, "1 would start a backward right after each forward; the first backward must "
                                     "wait until its micro-batch has gone through every stage."),
               ((PIPELINE_STAGES - 1) / PIPELINE_STAGES, "p - 1 is the warm-up alone; stage 0 then runs one more "
                                                         "forward before the first backward reaches it.")),
    ),
    "numbers on rank 0": Prediction(
        question=("On a 2 x 2 mesh (dp, tp), nn.Sequential(nn.Linear(64, 256, bias=False), nn.LayerNorm(256, "
                  "bias=False)) is split with parallelize_module(model, mesh['tp'], {'0': ColwiseParallel()}) (the "
                  "norm is not in the plan), then fully_shard(model, mesh=mesh['dp']). How many numbers of the two "
                  "weights does rank 0 hold?"),
        unit="numbers", measure=measured.numbers_on_rank_0, whole=True,
        why=("The Linear's 256 x 64 = 16,384 are cut twice, by tp and then by dp: 4,096. The norm's 256 are cut once: "
             "tensor parallelism left them whole, and fully_shard shards them over dp only: 128. 4,224 in all."),
        hints=((4160 / 4224, "4,160 cuts the norm four ways too; tp left it whole, so only dp shards it."),
               (4352 / 4224, "4,352 leaves the norm whole; fully_shard shards every parameter of the model, the "
                             "norm's over dp."),
               (8320 / 4224, "8,320 cuts once; fully_shard shards tensor parallelism's slice again, along dp."),
               (16640 / 4224, "That is the whole model; each rank holds a quarter of the Linear and half the norm.")),
    ),
    "ring attention bytes": Prediction(
        question=(f"Ring attention on {RING_RANKS} ranks: a sequence of {KV_SEQUENCE:,} tokens, {KV_HEADS} heads of "
                  f"{KV_HEAD_DIM} dimensions, K and V in bf16, each rank holding 1/{RING_RANKS} of them. How many MiB "
                  "of K and V does each rank send in one forward?"),
        unit="MiB", measure=measured.kv_mib_sent,
        why=(f"A rank's K/V block is 2 x {KV_SEQUENCE // RING_RANKS:,} tokens x {KV_HEADS} x {KV_HEAD_DIM} x 2 "
             f"bytes = 4 MiB, and it is sent on at each step but the last: {RING_RANKS - 1} x 4 = 12 MiB, "
             "(p - 1)/p of the whole sequence's K and V, what a ring all-gather of them sends."),
        rtol=0.02,  # bytes counted exactly: under half of MB's 4.9% over MiB, so 12.6 (12 MiB in MB) is refused
        hints=((4 / 3, "16 MiB sends at every step; after the last step no rank needs another block."),
               (2**20 / 1e6, "12.6 is 12 MiB counted in MB (10^6 bytes); the question asks for MiB (2^20 bytes)."),
               (0.5, "6 MiB counts K or V alone; both go round, together."),
               (1 / 3, "4 MiB is one block; it is passed on once per step, 3 times."),
               (2.0, "24 MiB counts 4-byte numbers; bf16 takes 2 bytes.")),
    ),
    "all-reduced value": Prediction(
        question=("4 ranks each hold total = torch.tensor([rank + 1.0]) and call dist.all_reduce(total), with no "
                  "other argument. What does total hold on rank 2 afterwards?"),
        unit="", measure=measured.sum_on_rank_2, how_far=False,
        why=("all_reduce sums by default (op=ReduceOp.SUM) and leaves the result on every rank, in place: "
             "1 + 2 + 3 + 4 = 10 on rank 2, and on every other rank."),
        hints=((0.3, "3 is rank 2's own value; all_reduce combines every rank's."),
               (0.25, "2.5 is the mean; the default op is SUM (ReduceOp.AVG gives the mean)."),
               (0.4, "4 is the number of ranks; all_reduce adds their values, 1 to 4.")),
    ),
    "gathered bytes": Prediction(
        question=(f"4 ranks each hold {GATHERED:,} float32 numbers and call dist.all_gather_single. How many kB "
                  "(1,000 bytes) does each rank's output tensor hold?"),
        unit="kB", measure=measured.gathered_kb,
        why=(f"Every rank ends with every rank's {GATHERED:,} numbers, its own included, side by side: 4 x "
             f"{GATHERED:,} x 4 bytes = 16 kB on each rank. The output grows with the ranks; the input does not."),
        hints=((0.25, "4 kB is one rank's input; the output holds all four."),
               (0.75, "12 kB leaves out the rank's own part; the output holds it too, in its rank's slot."),
               (4.0, "64 kB counts every rank's output; the question asks for one rank's.")),
    ),
    "torchrun rank": Prediction(
        question=("torchrun starts 2 nodes of 2 processes (--nnodes=2 --nproc_per_node=2, node ranks 0 and 1). What "
                  "RANK does the process with LOCAL_RANK 1 on node 1 get?"),
        unit="", measure=measured.torchrun_rank, whole=True, how_far=False,
        why=("RANK counts every process of the job, node after node: node_rank x nproc_per_node + LOCAL_RANK = "
             "1 x 2 + 1 = 3. LOCAL_RANK counts on one machine only, and picks the GPU there."),
        hints=((1 / 3, "1 is its LOCAL_RANK, its number on its own machine; RANK numbers the whole job."),
               (2 / 3, "2 is node 1's first process; LOCAL_RANK 1 is its second."),
               (4 / 3, "4 would number from 1; ranks start at 0.")),
    ),
    "ring bytes": Prediction(
        question=(f"{RING_RANKS} ranks each hold 1 MiB of float32 and all-reduce it with the ring (a reduce-scatter, "
                  "then an all-gather). How many MiB does each rank send in all?"),
        unit="MiB", measure=measured.ring_mib,
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
        unit="all-reduces", measure=measured.ddp_calls, whole=True,
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
        unit="all-gathers", measure=measured.fsdp_all_gathers, whole=True,
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
        unit="times DDP's bytes", measure=measured.hsdp_over_ddp,
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
        unit="all-reduces", measure=measured.tp_all_reduces, whole=True,
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
        unit="copies", measure=measured.moe_copies_sent, rtol=0.05,
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
        unit="collectives", measure=measured.dtensor_collectives, whole=True,
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
        # under half of the smallest cost's share of the waste (the checkpoints', 1.4 of 15.4 points: 9%), so that
        # leaving any cost out is refused, and over the 2.4% between 15.4% and its rounding, 15%
        unit="%", measure=measured.job_waste_percent, rtol=0.035, measured_by="20 simulated jobs",
        why=("Three costs: the checkpoints (1 minute per hour of work, about 1.7%), the restarts (5 minutes per 4 "
             "hours, about 2%), and the work lost, on average half an interval per failure (30 minutes per 4 "
             "hours, about 12%): about 15% in all. The simulation drew 20 jobs of 2,000 hours of work, about 10,000 "
             "failures; the exact expectation, dtlib.sim.failures.waste, is 15.4%."),
        hints=((12.5 / 15.4, "12.5% counts the lost work alone; the checkpoints and the restarts cost time too."),
               (25 / 15.4, "25% loses a whole interval at each failure; on average a failure strikes halfway "
                           "through."),
               (1.7 / 15.4, "1.7% is the checkpoints alone; most of the waste is work lost to failures."),
               *((left / 15.4, _ONE_COST_LEFT_OUT) for left in (13.7, 14.17, 14.58)),  # exactly, then roughly
               (16.25 / 15.4, "16.25% adds the three costs as shares of the work (1.7 + 2.1 + 12.5); as shares of "
                              "the wall time, which they all lengthen, each is smaller.")),
    ),
    "model state": Prediction(
        question=("Llama 2 7B (6.74 billion parameters) trains on 64 ranks with FSDP, in bf16 with fp32 weights and "
                  "AdamW. How many GiB of model state (weights, gradients, optimizer) does rank 0 hold at the step's "
                  "peak memory?"),
        unit="GiB", measure=measured.model_state_gib, measured_by="the simulator on this machine",
        why=("At the peak rank 0 holds its shard of the fp32 weights and of Adam's two moments, 12 bytes per "
             "parameter divided by the 64 ranks: 12 x 6.74e9 / 64 bytes = 1.18 GiB. The gradients' 4 bytes come later "
             "in backward, as the activations are freed, so the peak does not hold them."),
        hints=((4 / 3, "16 bytes per parameter counts the gradients too; at the peak they do not exist yet."),
               (2**30 / 1e9, "That is the right amount in GB (10^9 bytes); the question asks for GiB (2^30 bytes)."),
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
