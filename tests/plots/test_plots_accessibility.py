"""dtlib.plots, read by a person: every figure titled, its axes labelled with units, its series in a
legend, its text large enough and inside the figure.

The functions are found by introspection: every public function defined in ``dtlib.plots`` or a
submodule is drawn from each of its cases in ``INPUTS`` (small results of the kind the notebooks
pass, built without launching a process), so a new plot function without inputs fails
``test_every_plot_function_has_inputs``. Each check returns its problems as sentences; the
``test_check_*`` tests feed the checks broken figures to show that they can fail.

Run: ``.venv/bin/python -m pytest tests/plots/test_plots_accessibility.py -q``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.axis import Axis  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from dtlib import plots, ring  # noqa: E402
from dtlib.bench.bandwidth import Row  # noqa: E402
from dtlib.bench.startup import LaunchTiming  # noqa: E402
from dtlib.measure.machine import MachineInfo  # noqa: E402
from dtlib.sim import failures  # noqa: E402
from dtlib.train import data, fsdp_compare, guide
from dtlib.train.ddp import RankResult  # noqa: E402
from dtlib.train.fsdp_compare import StrategyRow  # noqa: E402

# 7 pt is the smallest text we accept. matplotlib's default is 10 pt and its "x-small" 6.9 pt; at the
# 100 dpi the notebooks render at, 7 pt is about 10 px tall, and Jupyter and GitHub shrink a figure
# wider than the page further, so anything smaller stops being legible.
MIN_FONT_PT = 7.0
# Figure width in inches: under 4 in, 10 pt labels crowd the axes; over 14 in (1400 px at 100 dpi),
# every viewer scales the figure down to its column and the text with it.
MIN_WIDTH_IN, MAX_WIDTH_IN = 4.0, 14.0
# Text may reach this far past the figure's edge (antialiasing, a descender), in pixels at 100 dpi.
OVERFLOW_TOLERANCE_PX = 2.0

# A quantity's label names its unit as its first word ("ms per step") or first inside brackets
# ("model state per rank (GB)", "message size S (bytes, log scale)").
UNITS = {"s", "ms", "us", "seconds", "minutes", "hours", "B", "bytes", "kB", "MB", "GB", "KiB", "MiB", "GiB", "MB/s",
         "GB/s", "%"}
# Counts, indices and dimensionless numbers need no unit: a label that begins with one of these.
UNITLESS = {
    "rank", "ranks", "world size", "step", "steps", "epoch", "element", "elements", "position", "index",
    "chunk", "chunks", "bucket", "buckets", "rows", "columns", "inputs", "calls", "micro-batches", "tokens",
    "loss",  # dimensionless: mean squared error or cross-entropy
}


# -- the cases ------------------------------------------------------------------------------------

Call = tuple[tuple[Any, ...], dict[str, Any]]


def call(*args: Any, **kwargs: Any) -> Call:
    """The arguments of one call of a plot function."""
    return args, kwargs


def _machine(gpus: int, cpus: int) -> MachineInfo:
    return MachineInfo(python="3.11.7", torch="2.13.0+cpu" if not gpus else "2.13.0+cu128",
                       cuda_build="12.8" if gpus else None, gpu_count=gpus, gpu_names=["NVIDIA H100"] * gpus,
                       backends={"gloo": True, "nccl": bool(gpus), "mpi": False}, cpu_count=cpus, usable_cpus=cpus,
                       start_methods=["fork", "spawn", "forkserver"], platform="Linux")


def _rank_results(world_size: int) -> list[dict[str, Any]]:
    return [{"rank": r, "local_rank": r, "pid": 4100 + r} for r in range(world_size)]


def _launch_timings() -> list[LaunchTiming]:  # docs/results/launch_cpu.md
    medians = {"forkserver-first": 3.154, "forkserver": 0.076, "fork": 0.066, "spawn": 2.319, "mp.spawn": 2.404}
    return [LaunchTiming(method, [median * 0.95, median, median * 1.05]) for method, median in medians.items()]


@functools.cache
def _trace(world_size: int) -> ring.Trace:  # notebook 03: 8 elements per rank
    return ring.simulate_all_reduce([[10 * rank + i for i in range(8)] for rank in range(world_size)])


def _busbw_rows(algo: str) -> list[Row]:
    link = ring.AlphaBeta(1e-4, 2e9)
    rows = []
    for size in (2**10, 2**14, 2**18, 2**22):
        seconds = link.time("ring all-reduce", 2, size)
        rows.append(Row("allreduce", algo, 2, size, size // 4, "float32", seconds * 1e6, size / seconds / 1e9,
                        size / seconds / 1e9))
    return rows


def _starting_values(world_size: int) -> list[list[float]]:
    return [[10.0 * rank + i for i in range(world_size)] for rank in range(world_size)]


def _all_reduce_sum(world_size: int) -> tuple[list, list, str]:
    before = _starting_values(world_size)
    total = [sum(column) for column in zip(*before, strict=True)]
    return before, [list(total) for _ in range(world_size)], "all_reduce(x, op=SUM)"


def _all_gather(world_size: int) -> tuple[list, list, str]:
    before = _starting_values(world_size)
    return before, [before for _ in range(world_size)], "all_gather(pieces, x)"


def _gather() -> tuple[list, list, str]:  # only rank 0 receives
    return [[0.0, 1.0], [10.0, 11.0]], [[0.0, 1.0, 10.0, 11.0], None], "gather(x, pieces, dst=0)"


S = 112_256  # fp32 bytes of the tiny transformer's parameters (docs/results/fsdp_cpu.md)


def _strategy(label: str, world_size: int, shard_group: int, at_rest: int, peak: int | None, estimate: float,
              comm: dict[str, int], step_ms: float) -> StrategyRow:
    shard = S // shard_group
    parts = {"parameters": shard, "gradients": shard, "optimizer_state": at_rest - 2 * shard}
    calls = {"all_gather": 6, "reduce_scatter": 3, "all_reduce": 1}
    return StrategyRow(label, world_size, shard_group, at_rest, parts, peak, estimate,
                       {kind: {"calls": calls[kind], "bytes": nbytes} for kind, nbytes in comm.items()},
                       step_ms, 2.0, [])


def _strategies(world_size: int) -> list[StrategyRow]:  # docs/results/fsdp_cpu.md
    if world_size == 2:
        return [
            _strategy("DDP", 2, 1, 449144, 449144, 449024, {"all_reduce": S}, 10.9),
            _strategy("FSDP2 full shard", 2, 2, 224632, 224632, 224512,
                      {"all_gather": 2 * S, "reduce_scatter": S}, 39.5),
            _strategy("FSDP2 no reshard after forward", 2, 2, 224632, 280760, 280640,
                      {"all_gather": S, "reduce_scatter": S}, 35.1),
            _strategy("FSDP1 FULL_SHARD", 2, 2, 224524, None, 224512,
                      {"all_gather": 213888, "reduce_scatter": S}, 28.1),
            _strategy("FSDP1 SHARD_GRAD_OP", 2, 2, 224524, None, 280640, {"all_gather": S, "reduce_scatter": S}, 25.1),
        ]
    return [
        _strategy("DDP", 4, 1, 449144, 449144, 449024, {"all_reduce": S}, 25.0),
        _strategy("FSDP2 full shard", 4, 4, 112376, 112376, 112256, {"all_gather": 2 * S, "reduce_scatter": S}, 105),
        _strategy("FSDP2 no reshard after forward", 4, 4, 112376, 196568, 196448,
                  {"all_gather": S, "reduce_scatter": S}, 91.4),
        _strategy("FSDP2 HSDP (2 x 2 mesh)", 4, 2, 224632, 224632, 224512,
                  {"all_gather": 2 * S, "reduce_scatter": S, "all_reduce": S // 2}, 90.1),
    ]


def _sent(rows: list[StrategyRow]) -> dict[str, float]:
    return {row.label: fsdp_compare.bytes_sent_per_rank(row) for row in rows}


def _train_results(world_size: int, steps: int, first_step: int = 0) -> list[RankResult]:
    return [RankResult(rank, world_size, "gloo", first_step,
                       losses=[1.0 / (1 + 0.3 * step) + 0.02 * rank for step in range(steps)])
            for rank in range(world_size)]


def _reference(steps: int) -> RankResult:
    return RankResult(0, 1, "none", 0, losses=[1.0 / (1 + 0.3 * step) + 0.01 for step in range(steps)])


def _timeline_results(buckets: int) -> list[RankResult]:
    results = []
    for rank in range(2):
        start, compute_end = 100.0, 100.012 + 0.001 * rank  # seconds: a 12 ms backward
        comm = [(start + 0.004 * (b + 1), start + 0.004 * (b + 1) + 0.003, 2**19) for b in range(buckets)]
        results.append(RankResult(rank, 2, "gloo", 0, hidden_share=[0.6], timeline={
            "step": 4, "start_s": start, "compute_end_s": compute_end, "end_s": compute_end + 0.004, "comm": comm}))
    return results


def _records(nnodes: int, nproc_per_node: int) -> list[dict[str, object]]:  # as dtlib.launch.torchrun.env_records
    world_size = nnodes * nproc_per_node
    return [{"RANK": str(node * nproc_per_node + local), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world_size),
             "LOCAL_WORLD_SIZE": str(nproc_per_node), "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "29500"} for node in range(nnodes) for local in range(nproc_per_node)]


def _simulated() -> dict:
    from dtlib.sim.llama import LLAMA
    from dtlib.sim.step import simulate

    return {f"{n} ranks": simulate(LLAMA["tiny"], dp=n, seq_len=64, depths=None) for n in (2, 4)}


def _fsdp_calls(sizes: list[int]) -> list[Any]:  # notebook 15: FSDP2's collectives on rank 0, as the stepper saw them
    from dtlib.live.stepper import Call

    return [Call(index + 1, "all_gather_single" if size > 0 else "reduce_scatter_single", "0", (0, 1),
                 (f"float32[{abs(size)}]", f"float32[{abs(size) // 2}]")) for index, size in enumerate(sizes)]


def _restart_records() -> list[dict[str, float]]:  # notebook 16: killed after step 6, checkpoints every 4
    first = [{"t": 0.1 * step, "attempt": 0, "rank": rank, "step": step} for rank in (0, 1) for step in range(1, 7)]
    again = [{"t": 5 + 0.1 * step, "attempt": 1, "rank": rank, "step": step} for rank in (0, 1)
             for step in range(5, 13)]
    return first + again


def _tokens_beyond() -> object:
    from dtlib.sim.llama import LLAMA

    return guide.recommend(LLAMA["7B"].params, 80, 8, shape=LLAMA["7B"], tokens_per_gpu=131_072)


# {function name: {case: the call's arguments}}: what the notebooks pass, shrunk where that is cheaper.
INPUTS: dict[str, dict[str, Callable[[], Call]]] = {
    "machine": {"laptop": lambda: call(_machine(0, 2)), "8 GPUs": lambda: call(_machine(8, 32))},
    "ranks": {"2 ranks, port": lambda: call(_rank_results(2), port=29500), "4 ranks": lambda: call(_rank_results(4))},
    "dp_vs_ddp": {"3 devices": lambda: call(n_devices=3), "2 devices": lambda: call(n_devices=2)},
    "launch_times": {"5 methods": lambda: call(_launch_timings())},
    "ring_step": {"start": lambda: call(_trace(4), 0), "step 1": lambda: call(_trace(4), 1),
                  "last step, 8 ranks": lambda: call(_trace(8), 14)},
    "ring_grid": {"4 ranks": lambda: call(_trace(4)), "8 ranks": lambda: call(_trace(8))},
    "traffic": {"2 to 64 ranks": lambda: call([2, 4, 8, 16, 32, 64], ring.traffic_table([2, 4, 8, 16, 32, 64]))},
    "busbw": {"sweep and fit": lambda: call(_busbw_rows("library"), ring.AlphaBeta(1e-4, 2e9)),
              "ring sweep only": lambda: call(_busbw_rows("ring"))},
    "before_after": {"all_reduce_sum": lambda: call(*_all_reduce_sum(4)), "all_gather": lambda: call(*_all_gather(4)),
                   "gather": lambda: call(*_gather())},
    "pipeline": {"1F1B on 2 ranks": lambda: call([[("F", 0, 0, 0.00, 0.01), ("F", 0, 1, 0.01, 0.02),
                                                    ("B", 0, 0, 0.04, 0.06), ("B", 0, 1, 0.07, 0.09)],
                                                   [("F", 1, 0, 0.01, 0.02), ("B", 1, 0, 0.02, 0.04),
                                                    ("F", 1, 1, 0.04, 0.05), ("B", 1, 1, 0.05, 0.07)]]),
                 "interleaved": lambda: call([[("F", 0, 0, 0.0, 0.01), ("F", 2, 0, 0.02, 0.03)],
                                              [("F", 1, 0, 0.01, 0.02), ("F", 3, 0, 0.03, 0.04)]], "two stages each")},
    "dispatch": {"4 ranks": lambda: call([[7, 5, 6, 6], [4, 9, 5, 6], [6, 6, 4, 8], [5, 7, 6, 6]]),
                 "2 ranks": lambda: call([[12, 12], [20, 4]], "skewed")},
    "expert_load": {"8 experts on 4 ranks": lambda: call([[3, 4, 2, 3, 4, 3, 2, 3]] * 4, 15.0),
                    "no capacity": lambda: call([[10, 2, 0, 12], [9, 3, 1, 11]])},
    "bubble_curve": {"4 stages": lambda: call([1, 2, 4, 8, 16], [0.76, 0.62, 0.45, 0.3, 0.17], 4)},
    "mesh": {"2 x 2": lambda: call((2, 2), ("dp", "tp")),
             "2 nodes of 4": lambda: call((2, 4), ("dp", "tp"), gpus_per_node=4),
             "tp across nodes": lambda: call((4, 2), ("tp", "dp"), gpus_per_node=4)},
    "placements": {"notebook 09 MLP": lambda: call({"up.weight": ((64, 16), "Shard(0)"),
                                                    "down.weight": ((16, 64), "Shard(1)"),
                                                    "x": ((4, 16), "Replicate()"), "y": ((4, 16), "Partial(sum)")}, 2),
                   "four ranks, 1-D": lambda: call({"norm.weight": ((32,), "Shard(0)"),
                                                    "w": ((12, 5), "Shard(1)")}, 4)},
    "shard": {"notebook 05": lambda: call((96, 32), world_size=2, name="blocks.0.qkv.weight"),
              "uneven": lambda: call((10, 4), world_size=4)},
    "memory_bars": {"2 ranks": lambda: call(_strategies(2)), "4 ranks": lambda: call(_strategies(4))},
    "comm_bars": {"2 ranks, ring": lambda: call(_strategies(2), _sent(_strategies(2))),
                  "4 ranks": lambda: call(_strategies(4))},
    "zero_stages": {"7.5B on 64": lambda: call(7.5e9, 64), "1B on 8": lambda: call(1e9, 8)},
    "cluster_memory": {"notebook 14": lambda: call(_simulated(), gpu_gib=79),
                       "no GPU line": lambda: call(_simulated())},
    "guide_bars": {"7B on 8": lambda: call(guide.recommend(7e9, 80, 8)),
                   "70B on 2 nodes": lambda: call(guide.recommend(70e9, 80, 16, nodes=2)),
                   "activations over the GPU": lambda: call(_tokens_beyond())},
    "guide_grid": {"notebook 06": lambda: call(guide.table(sizes_b=(0.5, 1, 3, 7, 13, 30, 70), gpu_memory_gb=(40, 80))),
                   "three memories": lambda: call(guide.table(sizes_b=(1, 7), gpu_memory_gb=(24, 40, 80)))},
    "loss_curves": {"with reference": lambda: call(_train_results(2, 8), reference=_reference(8)),
                    "resumed": lambda: call(_train_results(4, 5, first_step=3))},
    "ddp_timeline": {"3 buckets": lambda: call(_timeline_results(3)), "1 bucket": lambda: call(_timeline_results(1))},
    "ring_attention_blocks": {"notebook 12": lambda: call(world_size=4), "8 ranks, zigzag": lambda: call(8, ["zigzag"]),
                              "2 ranks": lambda: call(2)},
    "sampler_grid": {"notebook 04": lambda: call(data.sampler_indices(12, world_size=2, epochs=3), "with set_epoch"),
                     "notebook 08": lambda: call(data.sampler_indices(12, world_size=2, epochs=3, set_epoch=False),
                                                 "set_epoch forgotten: epoch 0's order, three times"),
                     "default title": lambda: call(data.sampler_indices(10, world_size=4, epochs=2))},
    "bars": {  # the notebooks' calls
        "log scale": lambda: call({"all-gather the logits": 128000, "loss_parallel": 768},
                                  "What the loss communicates", "bytes (log scale)", "{:,.0f}", log=True),
        "hooks": lambda: call({"allreduce (default)": 1.07, "fp16": 0.54, "bf16": 0.54, "powersgd": 0.05},
                              "Bytes all-reduced per step, per rank", "MiB (2^20 bytes)", "{:.2f}"),
        "step time": lambda: call({row.label: row.step_ms for row in _strategies(4)},
                                  "Median step time, 4 ranks on this machine", "ms per step"),
        "meta": lambda: call({f"{name}\n{when}": 112.3 for name in ("normal", "meta") for when in ("before", "after")},
                             "Rank 1's parameter bytes around fully_shard", "kB (1e3 bytes)", "{:.1f}"),
    },
    "nodes": {"1 node": lambda: call(_records(1, 2)), "2 nodes": lambda: call(_records(2, 2))},
    "collective_order": {
        "notebook 15": lambda: call({"reshard_after_forward=False": _fsdp_calls([108, 78, -78, -108]),
                                     "reshard_after_forward=True": _fsdp_calls([108, 78, 78, 108, -78, -108])},
                                    title="FSDP2's collectives on rank 0, one forward and backward of two blocks"),
        "one row, labelled": lambda: call({"rank 0": _fsdp_calls([108, -108])}, labels=["block 0", "block 0"]),
        "a long trace": lambda: call({"rank 0": _fsdp_calls([28, 78, 108] * 6)})},
    "restart_timeline": {"notebook 16": lambda: call(_restart_records(), every=4),
                         "no restart": lambda: call([r for r in _restart_records() if r["attempt"] == 0])},
    "job_time": {"one job": lambda: call(failures.simulate(20 * 3600, 1800, 4 * 3600, 60, 300, seed=1).events)},
    "waste_curve": {"exact and simulated": lambda: call([300, 900, 1800, 3600], [0.2, 0.11, 0.12, 0.19],
                                                        [0.21, 0.1, 0.12, 0.2], {"Young": 1315.0, "best": 1275.0}),
                    "exact only": lambda: call([60, 600, 6000], [0.5, 0.1, 0.4])},
}


def plot_functions() -> dict[str, Callable[..., Any]]:
    """Every public function defined in dtlib.plots or one of its submodules that returns a Figure, by name
    (helpers such as ``tick_names`` return something else)."""
    modules = [plots] + [importlib.import_module(f"{plots.__name__}.{info.name}")
                         for info in pkgutil.iter_modules(plots.__path__)]
    return {name: value for module in modules for name, value in vars(module).items()
            if not name.startswith("_") and inspect.isfunction(value) and value.__module__ == module.__name__
            and inspect.signature(value).return_annotation in ("Figure", Figure)}


CASES = [(name, case) for name in sorted(plot_functions()) for case in INPUTS.get(name, {"no inputs": None})]


@functools.cache
def figure(name: str, case: str) -> Figure:
    """The figure of one case, drawn once for all the checks."""
    if INPUTS.get(name, {}).get(case) is None:
        pytest.fail(f"dtlib.plots.{name} has no inputs: add a case to INPUTS in {__name__}")
    args, kwargs = INPUTS[name][case]()
    fig = plot_functions()[name](*args, **kwargs)
    assert isinstance(fig, Figure), f"dtlib.plots.{name} returned {type(fig).__name__}, not a Figure"
    return fig


@pytest.fixture(scope="module", autouse=True)
def _figures_closed_at_the_end():
    with plt.rc_context({"figure.max_open_warning": 0}):  # every case's figure stays open for the checks
        yield
    figure.cache_clear()
    rendered.cache_clear()
    plt.close("all")


def cases() -> Any:
    return pytest.mark.parametrize(("name", "case"), CASES, ids=[f"{name}[{case}]" for name, case in CASES])


# -- the checks: each returns its problems, one sentence each -------------------------------------


def is_colorbar(ax: Axes) -> bool:
    return ax.get_label() == "<colorbar>"


def shows_something(ax: Axes) -> bool:
    return ax.get_visible() and bool(ax.lines or ax.patches or ax.images or ax.collections or ax.texts)


def where(ax: Axes) -> str:
    fig = ax.get_figure()
    return f"axes {fig.axes.index(ax)}" + (f" ({ax.get_title()!r})" if ax.get_title() else "")


def title_problems(fig: Figure) -> list[str]:
    """A figure is titled by its suptitle, or else every panel that shows something has a title."""
    if fig.get_suptitle().strip():
        return []
    return [f"{where(ax)} shows something but has no title, and the figure has no suptitle"
            for ax in fig.axes if not is_colorbar(ax) and shows_something(ax)
            and not any(ax.get_title(loc).strip() for loc in ("center", "left", "right"))]


def unit_problem(label: str) -> str | None:
    """None if ``label`` names a unit (first word or first in brackets) or begins with a count; else why not."""
    text = " ".join(label.split())
    candidates = [text] + re.findall(r"\(([^()]*)\)", text)
    if any(re.split(r"[\s,;]+", candidate.strip())[0] in UNITS for candidate in candidates):
        return None
    if any(re.match(rf"{re.escape(word)}\b", text.lower()) for word in UNITLESS):
        return None
    return f"{label!r} has no unit: write it first or first in brackets, e.g. 'time (ms)'"


def shows_ticks(axis: Axis) -> bool:
    return axis.get_visible() and any(label.get_visible() and label.get_text() for label in axis.get_ticklabels())


def is_number(tick_label: str) -> bool:
    """True for what a numeric formatter writes: "0.5", "1e6", "50%", U+2212 minus, log-scale mathtext."""
    text = re.sub(r"\\mathdefault|[${}\s]", "", tick_label).replace("\u2212", "-")
    number = r"[-+]?[\d.]+(?:e[-+]?\d+)?(?:(?:\\times)?\d*\^[-+]?[\d.]+)?%?"  # 2.5, 1e6, 2^10, 2\times10^3, 50%
    return re.fullmatch(number, text, re.IGNORECASE) is not None


def names_its_ticks(axis: Axis) -> bool:
    """True for a categorical axis: its tick labels are names (strategies, ranks), not numbers."""
    return any(label.get_text() and not is_number(label.get_text()) for label in axis.get_ticklabels())


def label_problems(fig: Figure) -> list[str]:
    """Every axis that shows numbered ticks has a label; every label gives a unit or counts something.

    A categorical axis, whose tick labels name each bar or row, needs no axis label.
    """
    problems = []
    for ax in fig.axes:
        if not ax.axison:
            continue
        for letter, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            label = axis.get_label_text().strip()
            if not label:
                if shows_ticks(axis) and not names_its_ticks(axis):
                    problems.append(f"{where(ax)}: the {letter} axis shows numbers but has no label")
            elif (problem := unit_problem(label)) is not None:
                problems.append(f"{where(ax)}: {letter} label {problem}")
    return problems


def is_data_line(ax: Axes, line: Any) -> bool:
    """A line through data points (not an axhline/axvline reference, not an empty legend proxy)."""
    return line.get_transform() == ax.transData and len(line.get_xdata()) >= 2


def legend_problems(fig: Figure) -> list[str]:
    """An axes with more than one data series (lines, bar groups, scatters) labels each and shows them
    in a legend."""
    problems = []
    legends = [*fig.legends]
    for ax in fig.axes:
        series = [line for line in ax.get_lines() if is_data_line(ax, line)] + list(ax.containers)
        series += [c for c in ax.collections if c.__class__.__name__ == "PathCollection"]  # scatter
        if len(series) <= 1:
            continue
        labels = [s.get_label() for s in series]
        unlabelled = sum(label.startswith("_") or not label.strip() for label in labels)
        if unlabelled:
            problems.append(f"{where(ax)}: {unlabelled} of its {len(series)} series have no label")
        shown = {text.get_text() for legend in [ax.get_legend(), *legends] if legend for text in legend.get_texts()}
        missing = [label for label in labels if not label.startswith("_") and label not in shown]
        if missing or not shown:
            problems.append(f"{where(ax)}: {len(series)} series but the legend lacks {missing or 'all of them'}")
        if len(set(labels)) < len(labels):
            problems.append(f"{where(ax)}: series share a label: {labels}")
    return problems


@dataclass(frozen=True)
class DrawnText:
    """One line of text as the renderer drew it: the string, its size in points, its extent in pixels."""

    text: str
    size_pt: float
    extent: Any  # matplotlib Bbox in display pixels


@functools.cache
def rendered(fig: Figure) -> tuple[Any, tuple[DrawnText, ...]]:
    """Draw ``fig`` once: the renderer (text extents are final after it) and every text it drew (titles,
    labels, ticks, legends, annotations), recorded at draw time.

    Recording the draw calls sees exactly what is shown: no stale tick label out of view, no empty title.
    """
    canvas = FigureCanvasAgg(fig)  # its own canvas: pyplot's is gone if another test closed the figure
    renderer = canvas.get_renderer()
    drawn: list[DrawnText] = []
    original = renderer.draw_text

    def record(gc: Any, x: float, y: float, s: str, prop: Any, angle: float, ismath: Any = False,
               mtext: Any = None) -> None:
        if s.strip():
            extent = mtext.get_window_extent(renderer) if mtext is not None else None
            drawn.append(DrawnText(s, prop.get_size_in_points(), extent))
        original(gc, x, y, s, prop, angle, ismath=ismath, mtext=mtext)

    renderer.draw_text = record
    try:
        fig.draw(renderer)
    finally:
        del renderer.draw_text
    return renderer, tuple(drawn)


def drawn_texts(fig: Figure) -> tuple[DrawnText, ...]:
    return rendered(fig)[1]


def size_problems(fig: Figure) -> list[str]:
    """Text at least MIN_FONT_PT; the figure between MIN_WIDTH_IN and MAX_WIDTH_IN wide."""
    problems = [f"{t.text!r} is {t.size_pt:g} pt, under {MIN_FONT_PT:g}" for t in drawn_texts(fig)
                if t.size_pt < MIN_FONT_PT]
    width = fig.get_size_inches()[0]
    if not MIN_WIDTH_IN <= width <= MAX_WIDTH_IN:
        problems.append(f"the figure is {width:.1f} in wide, outside {MIN_WIDTH_IN:g} to {MAX_WIDTH_IN:g}")
    return problems


def overflow_problems(fig: Figure) -> list[str]:
    """No text reaches more than OVERFLOW_TOLERANCE_PX past the figure's edges.

    ``savefig`` cuts such text off; Jupyter's inline backend (``bbox_inches="tight"``) grows the image
    instead, so the figure comes out wider than asked and is shrunk to fit the page.
    """
    bounds = fig.bbox.padded(OVERFLOW_TOLERANCE_PX * fig.dpi / 100)
    problems = []
    for t in drawn_texts(fig):
        if t.extent is None:
            continue
        if not (bounds.x0 <= t.extent.x0 and t.extent.x1 <= bounds.x1 and bounds.y0 <= t.extent.y0
                and t.extent.y1 <= bounds.y1):
            problems.append(f"{t.text!r} spans x {t.extent.x0:.0f}..{t.extent.x1:.0f}, y {t.extent.y0:.0f}.."
                            f"{t.extent.y1:.0f} px, outside the figure's {fig.bbox.width:.0f} x "
                            f"{fig.bbox.height:.0f} px")
    return problems


def tick_overlap_problems(fig: Figure) -> list[str]:
    """No two tick labels of one axis overlap (long category names run into each other unless wrapped)."""
    renderer = rendered(fig)[0]
    problems = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = [label for label in axis.get_ticklabels() if label.get_visible() and label.get_text().strip()]
            placed = [(label, label.get_window_extent(renderer).shrunk(0.98, 0.98)) for label in labels]
            for (first, first_extent), (second, second_extent) in itertools.combinations(placed, 2):
                if first_extent.overlaps(second_extent):
                    problems.append(f"{where(ax)}: tick labels {first.get_text()!r} and {second.get_text()!r} overlap")
    return problems


# -- the tests --------------------------------------------------------------------------------------


def test_every_plot_function_has_inputs():
    found = plot_functions()
    assert len(found) >= 20, f"introspection found only {sorted(found)}"
    assert not set(found) - set(INPUTS), f"plot functions without inputs here: {sorted(set(found) - set(INPUTS))}"
    assert not set(INPUTS) - set(found), f"inputs for functions dtlib.plots lacks: {sorted(set(INPUTS) - set(found))}"
    for name, function in found.items():
        assert getattr(plots, name) is function, f"dtlib.plots.{name} is not the function of {function.__module__}"


CHECKS = (title_problems, label_problems, legend_problems, size_problems, overflow_problems, tick_overlap_problems)


@cases()
def test_figure_reads_well(name, case):
    """Titled; axes labelled with units; series named in a legend; text of MIN_FONT_PT or more, inside the
    figure, tick labels apart; a readable width. Every check runs, so one failure lists every problem."""
    problems = {check.__name__: found for check in CHECKS if (found := check(figure(name, case)))}
    assert problems == {}


# -- the checks can fail ----------------------------------------------------------------------------


UNIT_RULE = {  # label: does it pass the unit rule?
    "model state per rank (GB)": True, "ms per step": True, "message size S (bytes, log scale)": True,
    "bus bandwidth (GB/s, 1 GB = 1e9 B)": True, "world size N (ranks)": True, "step": True,
    "MiB (2^20 bytes)": True, "Rank": True,
    "model state per rank": False, "time (median)": False, "bandwidth": False,
    "size in bytes": False, "stepwise time": False,
}


def test_unit_rule():
    judged = {label: unit_problem(label) is None for label in UNIT_RULE}
    assert judged == UNIT_RULE


def test_check_finds_missing_title_labels_and_legend():
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([0, 1, 2], [1, 2, 3], label="rank 0")
    ax.plot([0, 1, 2], [2, 3, 4])
    ax.set_ylabel("time")
    assert title_problems(fig) == ["axes 0 shows something but has no title, and the figure has no suptitle"]
    assert [p.split(": ", 1)[1] for p in label_problems(fig)] == [
        "the x axis shows numbers but has no label",
        "y label 'time' has no unit: write it first or first in brackets, e.g. 'time (ms)'"]
    assert [p.split(": ", 1)[1] for p in legend_problems(fig)] == [
        "1 of its 2 series have no label", "2 series but the legend lacks ['rank 0']"]
    fig.suptitle("Two lines")
    ax.set_xlabel("step")
    ax.set_ylabel("time (ms)")
    ax.get_lines()[1].set_label("rank 1")
    ax.legend()
    assert title_problems(fig) == label_problems(fig) == legend_problems(fig) == []
    plt.close(fig)


def test_check_tells_numbered_ticks_from_named_ones():
    fig, (linear, log2, log10, named, bars) = plt.subplots(1, 5, figsize=(12, 3))
    linear.plot([-3, 2], [-0.5, 0.25])
    log2.plot([2**10, 2**22], [1, 2])
    log2.set_xscale("log", base=2)
    log10.plot([1e-3, 1e6], [1e-2, 0.5])
    log10.set_xscale("log")
    log10.set_yscale("log")
    named.imshow([[0, 1], [2, 3]])
    named.set_yticks(range(2), ["rank 0", "rank 1"])
    bars.barh(["DDP", "FSDP"], [3, 4])
    fig.canvas.draw()
    numbered = [linear.xaxis, linear.yaxis, log2.xaxis, log10.xaxis, log10.yaxis, named.xaxis, bars.xaxis]
    assert [names_its_ticks(axis) for axis in numbered] == [False] * len(numbered)
    assert names_its_ticks(named.yaxis) and names_its_ticks(bars.yaxis)
    plt.close(fig)


def test_check_finds_small_text_a_wide_figure_and_text_outside():
    fig, ax = plt.subplots(figsize=(16, 3))
    ax.text(0.5, 0.5, "tiny", fontsize=6)
    ax.text(1.5, 0.5, "beyond the right edge", transform=ax.transAxes)
    assert size_problems(fig) == ["'tiny' is 6 pt, under 7", "the figure is 16.0 in wide, outside 4 to 14"]
    assert [p.split(" spans")[0] for p in overflow_problems(fig)] == ["'beyond the right edge'"]
    plt.close(fig)


def test_check_finds_overlapping_tick_labels():
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(["a long category name", "another long category name"], [1, 2])
    assert len(tick_overlap_problems(fig)) == 1
    plt.close(fig)
