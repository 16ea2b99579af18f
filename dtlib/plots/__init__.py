"""Every drawing the notebooks show. Functions take plain results and return a Figure.

Nothing here launches processes; call a dtlib function first, then draw its result::

    fig = dtlib.plots.ranks(dtlib.spawn(dtlib.examples.hello.sum_of_ranks, 2))
"""

from dtlib.plots.attention import ring_attention_blocks
from dtlib.plots.cluster import cluster_memory
from dtlib.plots.collectives import before_after, busbw, ring_grid, ring_step, traffic
from dtlib.plots.experts import dispatch, expert_load
from dtlib.plots.faults import job_time, restart_timeline, waste_curve
from dtlib.plots.parallel import mesh, placements
from dtlib.plots.pipeline import bubble_curve, pipeline
from dtlib.plots.processes import dp_vs_ddp, launch_times, machine, ranks
from dtlib.plots.sharding import comm_bars, guide_bars, guide_calculator, guide_grid, memory_bars, shard, zero_stages
from dtlib.plots.stepping import collective_order
from dtlib.plots.training import bars, ddp_timeline, loss_curves, nodes, sampler_grid

__all__ = ["bars", "before_after", "bubble_curve", "busbw", "cluster_memory", "collective_order", "comm_bars",
           "ddp_timeline", "dispatch", "dp_vs_ddp", "expert_load", "guide_bars", "guide_calculator", "guide_grid",
           "job_time", "launch_times", "loss_curves", "machine", "memory_bars", "mesh", "nodes", "pipeline",
           "placements", "ranks", "restart_timeline", "ring_attention_blocks", "ring_grid", "ring_step",
           "sampler_grid", "shard", "traffic", "waste_curve", "zero_stages"]
