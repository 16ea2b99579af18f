"""dtlib.sim: the simulated step against live ranks (the oracle: the same code on real gloo ranks), the
depth rule against a full-depth simulation, the presets against the published sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtlib.sim.llama import LLAMA, Llama, Shape
from dtlib.sim.proof import on_live_ranks
from dtlib.sim.step import Simulated, check_layout, simulate, step_on_fake_ranks, train_step
from dtlib.sim.world import fake_world


def test_a_llama_like_shape_of_a_size_is_llama_2s_where_llama_2_has_one():
    from dtlib.sim.llama import llama_like

    assert llama_like(LLAMA["7B"].params) == LLAMA["7B"] and llama_like(LLAMA["13B"].params) == LLAMA["13B"]
    for size in (1e8, 1.3e9, 3e10, 1e12):
        assert llama_like(size).params == pytest.approx(size, rel=0.15)


def test_the_presets_have_llama_2s_sizes():
    """Touvron et al. (2023): 6.7B, 13.0B and 69.0B parameters; the module holds exactly what the shape counts."""
    assert [round(LLAMA[name].params / 1e9, 1) for name in ("7B", "13B", "70B")] == [6.7, 13.0, 69.0]
    with torch.device("meta"):
        model = Llama(LLAMA["70B"])
    assert sum(p.numel() for p in model.parameters()) == LLAMA["70B"].params


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dp", "tp", "checkpointing"), [(2, 2, False), (4, 1, True), (4, 2, False)])
def test_the_simulated_step_equals_the_same_step_on_live_ranks(dp, tp, checkpointing):
    """Rank 0 on 4 and 8 live gloo ranks: the same collectives with the same bytes, the same peak by category."""
    args = {"dp": dp, "tp": tp, "seq_len": 64, "micro_batch": 2, "checkpointing": checkpointing}
    real = on_live_ranks(LLAMA["tiny"], **args)
    fake = simulate(LLAMA["tiny"], depths=None, kernels=real.kernels, **args)
    assert fake.traffic == real.traffic
    assert fake.memory == real.memory


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("pp", "dp", "tp", "micro_batches", "checkpointing"),
                         [(2, 2, 2, 4, False), (4, 2, 1, 6, True), (2, 1, 1, 1, False), (2, 2, 2, 3, True)])
def test_a_pipeline_simulated_equals_the_same_pipeline_on_live_ranks(pp, dp, tp, micro_batches, checkpointing):
    """PP x FSDP x TP on 2 to 8 live gloo ranks, every stage running the 1F1B step: rank 0, the first stage,
    makes the same transfers and collectives with the same bytes and holds the same model state. The peaks
    differ by at most one activation tensor one way and 1.5 times the reduce-scatters' input the other: a fake
    rank can keep a tensor-parallel all-reduce's input alive a little longer, and gloo's reduce-scatter allocates
    a copy of its input and a temporary output (NCCL's does not, nor do fake ranks)."""
    shape = Shape(layers=4, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=256)
    args = {"pp": pp, "dp": dp, "tp": tp, "seq_len": 16, "micro_batches": micro_batches,
            "checkpointing": checkpointing}
    real = on_live_ranks(shape, **args)
    fake = simulate(shape, depths=None, kernels=real.kernels, **args)
    assert fake.traffic == real.traffic
    assert (fake.memory["weights"], fake.memory["optimizer"]) == (real.memory["weights"], real.memory["optimizer"])
    scattered = sum(row.payload for row in real.traffic if row.call.startswith("reduce_scatter"))
    one_activation = 2 * args["seq_len"] * shape.hidden  # a micro-batch of one sequence, in bf16
    assert fake.peak - one_activation <= real.peak <= fake.peak + 1.5 * scattered
    sent = {(row.group, row.call): row.calls for row in real.traffic}
    assert sent[("pp", "send")] == sent[("pp", "recv")] == micro_batches  # activations out, their gradients in


def test_the_1f1b_order_keeps_at_most_the_stages_in_flight():
    from dtlib.sim.pipeline import one_f_one_b

    assert one_f_one_b(0, 2, 3) == ["F", "F", "B", "F", "B", "B"]
    assert one_f_one_b(3, 4, 2) == ["F", "B", "F", "B"]  # the last stage runs each micro-batch straight through
    for stage in range(4):
        order, in_flight, most = one_f_one_b(stage, 4, 8), 0, 0
        for op in order:
            in_flight += 1 if op == "F" else -1
            most = max(most, in_flight)
        assert order.count("F") == order.count("B") == 8 and most == 4 - stage


def test_the_stages_of_a_pipeline_hold_the_whole_model_between_them():
    shape = LLAMA["tiny"].with_layers(4)
    with torch.device("meta"):
        stages = [Llama(shape, stage=s, stages=2) for s in range(2)]
    assert sum(p.numel() for stage in stages for p in stage.parameters()) == shape.params
    assert stages[0].embedding is not None and stages[0].head is None and stages[1].embedding is None
    with pytest.raises(ValueError, match="pp=3 must divide the 4 layers"):
        simulate(shape, pp=3, seq_len=8)


@pytest.mark.timeout(300)
def test_a_pipeline_simulated_at_two_depths_and_scaled_equals_every_layer_simulated():
    """The rule on a small job that still tests it: 6 blocks per stage, past the 3 and 4 simulated by twice their
    gap (an extrapolation, not a depth simulated), and 3 micro-batches on 2 stages, so that stage 0 alternates
    forwards and backwards in 1F1B's steady state."""
    shape = Shape(layers=12, hidden=256, heads=8, kv_heads=2, ffn=688, vocab=1000)
    args = {"pp": 2, "dp": 4, "tp": 2, "seq_len": 128, "micro_batches": 3, "checkpointing": True}
    scaled, full = simulate(shape, **args), simulate(shape, depths=None, **args)
    assert scaled.depths == (6, 8) and full.depths == (12,)
    assert scaled.traffic == full.traffic
    for name, value in full.memory.items():
        assert scaled.memory[name] == pytest.approx(value, rel=0.001, abs=1024), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [
    {"pp": 2, "dp": 2, "tp": 2, "micro_batch": 2, "micro_batches": 4, "checkpointing": True,
     "sequence_parallel": True, "loss_parallel": True, "kernels": "cuda"},
    {"pp": 4, "dp": 2, "micro_batches": 6, "checkpointing": False, "kernels": "cpu"},
    {"dp": 2, "tp": 2, "micro_batches": 3, "checkpointing": False, "kernels": "cuda"},  # several, no pipeline
], ids=["2 stages, 4 micro-batches, sp and lp, fused norm", "4 stages, 6 micro-batches", "3 micro-batches"])
def test_a_first_step_of_one_micro_batch_leaves_the_measured_step_what_a_whole_first_step_leaves(layout):
    """The simulator's first step, which only creates Adam's and FSDP's state, runs the first micro-batch alone:
    the measured step's memory at every moment and its collectives are those after a first step of all of them
    (the one-micro-batch step runs first, as in a learner's process)."""
    layout = dict(layout)
    checkpointing, kernels = layout.pop("checkpointing"), layout.pop("kernels")
    shape = Shape(layers=4 * layout.get("pp", 1), hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512)
    args = {"dp": 1, "tp": 1, "micro_batch": 1, "pp": 1, "sequence_parallel": False, "loss_parallel": False,
            **layout}
    shaped = check_layout(shape, args["dp"], args["tp"], 32, args["micro_batch"], args["pp"], args["micro_batches"],
                          args["sequence_parallel"], args["loss_parallel"])
    one, whole = (step_on_fake_ranks(shape, shaped, checkpointing, kernels=kernels, whole_first_step=first)
                  for first in (False, True))
    assert one == whole


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_deep_model_simulated_at_two_depths_and_scaled_equals_every_layer_simulated(checkpointing):
    """The rule on a small job that still tests it: 6 layers, past the 3 and 4 simulated by twice their gap."""
    shape = Shape(layers=6, hidden=256, heads=8, kv_heads=2, ffn=688, vocab=1000)
    args = {"dp": 8, "tp": 2, "seq_len": 256, "micro_batch": 2, "checkpointing": checkpointing}
    scaled, full = simulate(shape, **args), simulate(shape, depths=None, **args)
    assert scaled.depths == (3, 4) and full.depths == (6,)
    assert scaled.traffic == full.traffic
    for name, value in full.memory.items():
        assert scaled.memory[name] == pytest.approx(value, rel=0.001, abs=1024), name


@pytest.mark.timeout(300)
def test_a_peak_whose_moment_moves_as_the_model_deepens_is_found_at_the_real_depth():
    """At 3 and 4 layers this job peaks at its loss (the logits of 16,000 words), at 10 in AdamW's step, whose
    state and temporary grow with every block while the logits do not. Scaling the shallow peak alone read
    301 MiB, in the loss's categories (no gradients), against the 304 of every layer simulated (70B on 2 stages
    in notebook 14: 80.6 GiB against 84.7)."""
    shape = Shape(layers=10, hidden=256, heads=8, kv_heads=2, ffn=688, vocab=16_000)
    args = {"seq_len": 512, "checkpointing": True}
    shallow = simulate(shape.with_layers(4), depths=None, **args)
    scaled, full = simulate(shape, **args), simulate(shape, depths=None, **args)
    assert full.memory["activations"] < shallow.memory["activations"] / 1000  # the loss, then the step
    for name, value in full.memory.items():
        assert scaled.memory[name] == pytest.approx(value, rel=0.001, abs=1024), name


def test_the_fake_world_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match="rank must be in 0..3"):
        with fake_world(4, rank=4):
            pass
    with fake_world(2), pytest.raises(RuntimeError, match="already runs in this process"):
        with fake_world(2):
            pass
    with pytest.raises(ValueError, match="tp=3 must divide the heads"):
        simulate(LLAMA["tiny"], dp=1, tp=3, seq_len=8)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernels", ["cuda", "cpu"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_activation_formula_is_within_its_stated_error_of_the_simulator(checkpointing, kernels):
    """dtlib.measure.memory.activation_bytes against the simulated peak minus model state, with a GPU's kernels
    and this CPU's: 7% without checkpointing, 8% with (its docstring's claim), on two Llama shapes and a shape of
    other proportions."""
    from dtlib.measure.memory import activation_bytes

    odd = Shape(layers=12, hidden=2048, heads=16, kv_heads=4, ffn=5632, vocab=50_000)
    for shape, seq_len in ((LLAMA["7B"], 2048), (LLAMA["70B"], 8192), (odd, 4096)):
        result = simulate(shape, dp=64, seq_len=seq_len, checkpointing=checkpointing, kernels=kernels)
        formula = activation_bytes(shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab,
                                   seq_len, checkpointing=checkpointing, kernels=kernels)
        assert formula == pytest.approx(result.peak - result.model_state(), rel=0.08 if checkpointing else 0.07)


@pytest.mark.timeout(120)
def test_gloos_reduce_scatter_allocates_what_fake_ranks_do_not():
    """Why a live gloo rank can peak above the simulated one: inside it, reduce_scatter_tensor allocates a copy of its
    input and a temporary output, which the PeakTracker sees."""
    import dtlib

    def measured(rank, world_size):
        import torch.distributed as dist
        from torch import nn

        from dtlib.measure.peak import PeakTracker

        x, out = torch.ones(1024 * world_size), torch.empty(1024)
        with PeakTracker(nn.Linear(1, 1, bias=False)) as peak:
            dist.reduce_scatter_tensor(out, x)
        return peak.categories()["gathered and temporary"]

    assert dtlib.spawn(measured, 2, output="none", strict=False) == [3 * 4096, 3 * 4096]


def test_the_trackers_parameter_storages_read_without_dispatch_give_what_dispatching_them_gave(monkeypatch):
    """PeakTracker reads the parameters' storages at each saved tensor without dispatching a DTensor's to_local()
    view (the views made the tracker several times slower): the same tables as dispatching them, on a pipeline
    with tensor parallelism (parameters that are DTensors, gathered and sharded) and no checkpointing."""
    from dtlib.measure.peak import PeakTracker, _storages
    from dtlib.sim.step import parallelize

    def mine(model, mesh, checkpointing=False):  # not dtlib's own: simulated each time, never a kept answer
        return parallelize(model, mesh, checkpointing)

    args = {"pp": 2, "dp": 2, "tp": 2, "seq_len": 12, "micro_batches": 3, "depths": None, "parallelize": mine}
    simulate(LLAMA["tiny"], **args)  # the first sharding of an op by DTensor here adds temporaries: not measured
    read = simulate(LLAMA["tiny"], **args)
    monkeypatch.setattr(PeakTracker, "_weight_storages",
                        lambda self: {id(s) for p in self.model.parameters() for s in _storages(p)})
    dispatched = simulate(LLAMA["tiny"], **args)
    assert (read.memory, read.traffic) == (dispatched.memory, dispatched.traffic)


def test_the_trackers_tables_read_with_autograd_off_are_those_read_with_it_on(monkeypatch):
    """The simulator reads the tracker's tables with autograd off, where a DTensor's to_local() hands back its local
    tensor instead of dispatching a view of it (the views of the optimizer's state, at every moment, were a tenth of
    a 7B simulation): the same tables as read with autograd on, on a pipeline with FSDP and tensor parallelism,
    whose parameters, gradients and optimizer state are DTensors."""
    from dtlib.sim import step
    from dtlib.sim.step import parallelize

    def mine(model, mesh, checkpointing=False):  # not dtlib's own: simulated, never a kept answer
        return parallelize(model, mesh, checkpointing)

    readings = []
    read_off = step._tables

    def both(peak, seen):
        with torch.enable_grad():
            on = peak.categories(), seen.rows(), peak.moments()
        readings.append((on, read_off(peak, seen)))
        return readings[-1][1]

    monkeypatch.setattr(step, "_tables", both)
    simulate(LLAMA["tiny"], pp=2, dp=2, tp=2, seq_len=12, micro_batches=3, depths=None, parallelize=mine)
    [(on, off)] = readings
    assert on == off and off[0]["optimizer"] > 0 and off[2]["optimizer step"]["optimizer"] > 0


def test_dtlibs_own_layout_is_simulated_once_and_a_learners_every_time(monkeypatch):
    from dtlib.sim import step
    from dtlib.sim.step import parallelize

    def mine(model, mesh, checkpointing=False):
        return parallelize(model, mesh, checkpointing)

    runs = []
    stepped = step.step_on_fake_ranks
    monkeypatch.setattr(step, "step_on_fake_ranks", lambda *args, **kwargs: runs.append(1) or stepped(*args, **kwargs))
    args = {"dp": 2, "seq_len": 20, "depths": None}  # a layout no other test simulates: this one runs it first
    assert simulate(LLAMA["tiny"], **args) == simulate(LLAMA["tiny"], **args) and len(runs) == 1
    theirs = [simulate(LLAMA["tiny"], parallelize=mine, **args) for _ in range(2)]
    assert theirs[0].memory == theirs[1].memory and len(runs) == 3


def test_the_presets_a_checker_looks_up_cannot_be_changed():
    with pytest.raises(TypeError):
        LLAMA["7B"] = LLAMA["7B"]  # the same shape: harmless where the table is a dict
    with pytest.raises(dataclasses.FrozenInstanceError):
        LLAMA["7B"].layers = 32  # type: ignore[misc]


def _in_gib_in_place(result: Simulated) -> None:
    """What a learner may do to the results a cell holds: every byte count divided by 2**30, in place."""
    for category in result.memory:
        result.memory[category] /= 2**30
    result.traffic[:] = [dataclasses.replace(row, payload=row.payload / 2**30, sent=row.sent / 2**30)
                         for row in result.traffic]


def test_a_result_edited_in_place_leaves_the_next_simulate_its_own_numbers():
    args = {"dp": 2, "seq_len": 24, "micro_batch": 2}
    first = simulate(LLAMA["tiny"], **args)  # the run (or, after another test's, the kept answer)
    memory, rows, peak = dict(first.memory), list(first.traffic), first.peak
    _in_gib_in_place(first)
    again = simulate(LLAMA["tiny"], **args)  # the kept answer
    assert (again.memory, again.traffic, again.peak) == (memory, rows, peak) and peak > 2**20
    _in_gib_in_place(again)
    third = simulate(LLAMA["tiny"], **args)
    assert (third.memory, third.traffic, third.peak) == (memory, rows, peak)


def test_a_pipelines_transfers_get_seconds_of_their_own():
    from dtlib.ring.cost import LINKS
    from dtlib.sim.network import network_seconds

    piped = simulate(LLAMA["tiny"], pp=2, dp=2, seq_len=16, micro_batches=2, depths=None)
    link = LINKS["InfiniBand NDR"]
    seconds = network_seconds(piped, {"pp": link, "dp": link, "tp": LINKS["NVLink 4"]})
    sends = next(row for row in piped.traffic if (row.group, row.call) == ("pp", "send"))
    assert set(seconds) == {"pp", "dp", "tp"}
    assert seconds["pp"] == pytest.approx(sends.calls * link.alpha_s + sends.sent / link.bandwidth_bytes_per_s)
    with pytest.raises(ValueError, match="no link given for the 'pp' dimension"):
        network_seconds(piped, {"dp": link, "tp": link})


def test_the_fused_rmsnorm_computes_torchs_and_keeps_what_the_cuda_kernel_keeps():
    """FusedRMSNorm against F.rms_norm: the same values and gradients (float64 to gradcheck's precision, bf16 to
    a few of bf16's roundings). What it keeps for backward is what torch declares CUDA's fused kernel needs,
    ``aten._fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, ...)``: the input as it came
    and one fp32 rstd per row."""
    import torch.nn.functional as F

    from dtlib.sim.llama import FusedRMSNorm

    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: FusedRMSNorm.apply(x, w, 1e-6), (x, weight))
    assert torch.allclose(FusedRMSNorm.apply(x, weight, 1e-6), F.rms_norm(x, (16,), weight, 1e-6))
    half = torch.randn(2, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    ours, torchs = FusedRMSNorm.apply(half, None, None), F.rms_norm(half, (64,), None, None)
    assert ours.dtype == torch.bfloat16  # within 2%: torch's CPU composite rounds to bf16 between its steps
    assert torch.allclose(ours.float(), torchs.float(), rtol=0.02, atol=1e-3)
    arguments = [argument.name for argument in torch.ops.aten._fused_rms_norm_backward.default._schema.arguments]
    assert arguments[:5] == ["grad_out", "input", "normalized_shape", "rstd", "weight"]
    kept = ours.grad_fn.saved_tensors
    assert [(tuple(t.shape), t.dtype) for t in kept if t is not None] == [((2, 5, 64), torch.bfloat16),
                                                                         ((2, 5, 1), torch.float32)]


def test_a_gpus_kernels_keep_12_bytes_per_token_and_width_less_in_each_block():
    """Each block's two RMSNorms keep their bf16 inputs on a GPU (2h each), against two fp32 copies each on the
    CPU (8h each): 12h fewer bytes per token and block, and 6h for the final norm; nothing else changes."""
    args = {"seq_len": 64, "micro_batch": 2, "depths": None}
    cpu, cuda = (simulate(LLAMA["tiny"], kernels=kernels, **args) for kernels in ("cpu", "cuda"))
    tokens, hidden = 128, LLAMA["tiny"].hidden
    assert cpu.memory["activations"] - cuda.memory["activations"] == tokens * hidden * (12 * LLAMA["tiny"].layers + 6)
    assert {name: value for name, value in cpu.memory.items() if name != "activations"} == \
        {name: value for name, value in cuda.memory.items() if name != "activations"}
    assert (cpu.kernels, cuda.kernels, simulate(LLAMA["tiny"], **args).kernels) == ("cpu", "cuda", "cuda")
    with pytest.raises(ValueError, match="kernels must be one of"):
        simulate(LLAMA["tiny"], kernels="gpu", **args)


@pytest.mark.timeout(120)
def test_a_pipelines_gradients_accumulated_unsharded_are_gradients():
    """Between the micro-batches of a pipeline step FSDP2 accumulates each stage's gradients unsharded, in fp32,
    until the last one reduce-scatters them: at the peak they are gradients, the stage's whole parameters' worth
    whatever dp shards (4 bytes each, what the fp32 weights take at dp=1 and twice their shard at dp=2)."""
    shape = Shape(layers=4, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=256)
    alone, sharded = (simulate(shape, pp=2, dp=dp, seq_len=16, micro_batches=3, depths=None) for dp in (1, 2))
    assert alone.memory["gradients"] == alone.memory["weights"] > 0
    assert sharded.memory["gradients"] == 2 * sharded.memory["weights"] == alone.memory["gradients"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "shape"), [
    ({"dp": 2, "tp": 2, "seq_len": 64, "micro_batch": 2}, LLAMA["tiny"]),
    ({"dp": 1, "tp": 2, "seq_len": 64, "checkpointing": True}, LLAMA["tiny"]),
    ({"pp": 2, "dp": 1, "tp": 2, "seq_len": 16, "micro_batches": 3},
     Shape(layers=4, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=256)),
], ids=["fsdp-tp", "checkpointed", "pipeline"])
def test_sequence_parallelism_simulated_equals_it_on_live_ranks(layout, shape):
    """With sequence parallelism too, rank 0 of live gloo ranks and of fake ones: the same all-gathers and
    reduce-scatters with the same bytes, the same peak by category (a pipeline's stages pass shares)."""
    real = on_live_ranks(shape, sequence_parallel=True, **layout)
    fake = simulate(shape, depths=None, kernels=real.kernels, sequence_parallel=True, **layout)
    assert fake.traffic == real.traffic
    assert fake.memory == real.memory
    calls = {row.call for row in real.traffic if row.group == "tp"}
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= calls


def _loss_and_gradients(rank: int, world_size: int, switches: dict[str, bool]) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward of a tiny Llama on tp=2 ranks, every rank starting from the same weights, laid out
    with ``switches`` (``sequence_parallel``, ``loss_parallel``, and ``fused_norm``: the RMSNorm that keeps what
    CUDA's kernel keeps, which the simulator runs by default): the loss and every gradient, whole."""
    from dtlib.sim.llama import next_token_loss, vocabulary_sharded
    from dtlib.sim.step import check_layout, lay_out, mesh_of, parallelize, tokens_for

    shape = LLAMA["tiny"]
    fused = switches.pop("fused_norm", False)
    layout = check_layout(shape, dp=1, tp=2, seq_len=64, micro_batch=2, **switches)
    mesh = mesh_of(layout, "cpu")
    torch.manual_seed(0)
    model = lay_out(parallelize, Llama(shape, fused_norm=fused), mesh, layout, checkpointing=False)
    tokens = tokens_for(shape, layout, torch.Generator().manual_seed(0))
    with vocabulary_sharded(model):
        loss = next_token_loss(model(tokens), tokens)
        loss.backward()
    whole = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return whole.item(), {name: p.grad.full_tensor().float() for name, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_sequence_parallelism_computes_the_loss_and_gradients_tensor_parallelism_alone_does():
    """The oracle for the layout itself: the same weights and tokens give the same loss and every gradient
    (bf16 compute: to its rounding), including the norms' weights, whose partial sums over the shares of the
    sequence are all-reduced. A missing or doubled reduction is off by a factor of tp."""
    from dtlib.launch.spawn import spawn

    (alone, grads_alone), _ = spawn(_loss_and_gradients, 2, args=({},), backend="gloo", timeout=90)
    (split, grads_split), _ = spawn(_loss_and_gradients, 2, args=({"sequence_parallel": True},), backend="gloo",
                                    timeout=90)
    assert split == pytest.approx(alone, rel=1e-3)
    assert grads_split.keys() == grads_alone.keys()
    for name, grad in grads_alone.items():
        assert torch.allclose(grads_split[name], grad, rtol=0.05, atol=0.02 * grad.abs().max().item()), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_sequence_parallelism_keeps_a_share_of_what_the_norms_keep_and_nothing_else_changes(checkpointing):
    """7B on tp=4: each block's two norms keep their bf16 input and an fp32 rstd per token (a GPU's kernels) for a
    quarter of the sequence; checkpointed, each block keeps a quarter of its input. Model state is unchanged, and
    the tp traffic is all-gathers and reduce-scatters, no larger than the all-reduces they replace."""
    shape, tokens, tp = LLAMA["7B"], 4096, 4
    whole, split = (simulate(shape, dp=8, tp=tp, seq_len=tokens, checkpointing=checkpointing, sequence_parallel=sp)
                    for sp in (False, True))
    kept = tokens * 2 * shape.hidden if checkpointing else 2 * tokens * (2 * shape.hidden + 4)
    assert whole.memory["activations"] - split.memory["activations"] == shape.layers * kept * (tp - 1) // tp
    assert whole.model_state() == split.model_state()
    assert split.sent()["tp"] <= whole.sent()["tp"] and split.sent()["dp"] == whole.sent()["dp"]
    assert {row.call for row in whole.traffic if row.group == "tp"} == {"all_reduce"}


def test_sequence_parallelism_refuses_what_it_cannot_split_and_a_layout_that_cannot_ask():
    with pytest.raises(ValueError, match="tp must divide seq_len"):
        simulate(LLAMA["tiny"], tp=2, seq_len=63, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel must be True or False"):
        simulate(LLAMA["tiny"], tp=2, seq_len=64, sequence_parallel="yes")

    def mine(model, mesh, checkpointing):
        return model

    with pytest.raises(TypeError, match="needs a parallelize that takes sequence_parallel"):
        simulate(LLAMA["tiny"], tp=2, seq_len=64, depths=None, sequence_parallel=True, parallelize=mine)
    alone = simulate(LLAMA["tiny"], seq_len=64, depths=None)
    assert simulate(LLAMA["tiny"], seq_len=64, depths=None, sequence_parallel=True).memory == alone.memory


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "shape"), [
    ({"dp": 2, "tp": 2, "seq_len": 64, "micro_batch": 2}, LLAMA["tiny"]),
    ({"dp": 1, "tp": 2, "seq_len": 64, "sequence_parallel": True, "checkpointing": True}, LLAMA["tiny"]),
], ids=["fsdp-tp", "sequence-parallel-checkpointed"])
def test_loss_parallelism_simulated_equals_it_on_live_ranks(layout, shape):
    """The head split over the vocabulary, on rank 0 of live gloo ranks and of fake ones: the same collectives with
    the same bytes (loss_parallel's all-reduces of a few numbers per token among them), the same peak by category."""
    real = on_live_ranks(shape, loss_parallel=True, **layout)
    fake = simulate(shape, depths=None, kernels=real.kernels, loss_parallel=True, **layout)
    assert fake.traffic == real.traffic
    assert fake.memory == real.memory


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("sequence_parallel", "fused_norm"), [(False, False), (True, False), (True, True)],
                         ids=["tp", "sequence-parallel", "sequence-parallel-fused-norm"])
def test_loss_parallelism_computes_the_loss_and_gradients_of_a_whole_head(sequence_parallel, fused_norm):
    """The oracle for the layout: the same weights and tokens give the same loss and every gradient, the head's
    among them (bf16 compute: to its rounding), whether the logits are gathered whole or kept split over the
    vocabulary; with sequence parallelism too, the final norm's weight among them (used on a share), also with
    the fused norm's own backward (torch 2.11 refused to flatten its sequence-sharded input there)."""
    from dtlib.launch.spawn import spawn

    (whole, grads_whole), _ = spawn(_loss_and_gradients, 2, args=({"fused_norm": fused_norm},), backend="gloo",
                                    timeout=90)
    switches = {"loss_parallel": True, "sequence_parallel": sequence_parallel, "fused_norm": fused_norm}
    (split, grads_split), _ = spawn(_loss_and_gradients, 2, args=(switches,), backend="gloo", timeout=90)
    assert split == pytest.approx(whole, rel=1e-3)
    assert grads_split.keys() == grads_whole.keys()
    for name, grad in grads_whole.items():
        assert torch.allclose(grads_split[name], grad, rtol=0.05, atol=0.02 * grad.abs().max().item()), name


@pytest.mark.timeout(300)
def test_loss_parallelism_keeps_a_share_of_the_logits_and_of_the_head():
    """7B on tp=4, 8 ranks of FSDP, one 4096-token sequence: the head's weights (and Adam's state of them) and
    what the loss keeps of the logits fall to a quarter; the blocks are untouched. Oracle: the logits' bytes,
    4096 x 32,000 numbers, and the head's parameters, 32,000 x 4096."""
    shape, tokens, tp, dp = LLAMA["7B"], 4096, 4, 8
    whole, split = (simulate(shape, dp=dp, tp=tp, seq_len=tokens, loss_parallel=lp) for lp in (False, True))
    head = shape.vocab * shape.hidden
    assert whole.memory["weights"] - split.memory["weights"] == pytest.approx(4 * head * (tp - 1) / tp / dp, rel=0.01)
    saved = whole.memory["activations"] - split.memory["activations"]
    logits = tokens * shape.vocab
    assert saved >= 4 * logits * (tp - 1) / tp  # at least the fp32 logits the loss keeps, a quarter now
    assert split.peak < whole.peak
    assert {row.call for row in split.traffic if row.group == "tp"} == {"all_reduce"}


def test_loss_parallelism_refuses_what_it_cannot_split_and_a_layout_that_cannot_ask():
    with pytest.raises(ValueError, match="tp must divide it"):
        simulate(Shape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=255), tp=2, seq_len=64,
                 loss_parallel=True)
    with pytest.raises(ValueError, match="loss_parallel must be True or False"):
        simulate(LLAMA["tiny"], tp=2, seq_len=64, loss_parallel=1)

    def mine(model, mesh, checkpointing, sequence_parallel=False):
        return model

    with pytest.raises(TypeError, match="needs a parallelize that takes loss_parallel"):
        simulate(LLAMA["tiny"], tp=2, seq_len=64, depths=None, loss_parallel=True, parallelize=mine)
    alone = simulate(LLAMA["tiny"], seq_len=64, depths=None)
    assert simulate(LLAMA["tiny"], seq_len=64, depths=None, loss_parallel=True).memory == alone.memory  # tp=1


def test_a_link_shared_by_a_nodes_gpus_gives_each_its_share_and_costs_them_that_much_longer():
    """One 100 Gbit/s NIC for a node of 8 GPUs: each GPU gets 1.5625 GB/s and the same alpha; a dp dimension
    across such nodes spends 8 times the bandwidth seconds of a NIC per GPU, and the same latency."""
    from dtlib.ring.cost import LINKS
    from dtlib.sim.network import network_seconds

    ethernet = LINKS["100G Ethernet"]
    node = ethernet.shared(8)
    assert (node.alpha_s, node.bandwidth_bytes_per_s) == (ethernet.alpha_s, 12.5e9 / 8)
    assert ethernet.shared(1) == ethernet
    result = simulate(LLAMA["tiny"], dp=4, seq_len=64, depths=None)
    apart, together = (network_seconds(result, {"dp": link, "tp": link})["dp"] for link in (ethernet, node))
    sent = sum(row.sent for row in result.traffic if row.group == "dp")
    assert together - apart == pytest.approx(sent / node.bandwidth_bytes_per_s - sent / ethernet.bandwidth_bytes_per_s)
    for wrong in (0, 2.5, True, "8"):
        with pytest.raises(ValueError, match="gpus must be a whole number"):
            ethernet.shared(wrong)


def test_the_seconds_of_a_table_are_the_ring_models_own_and_a_fitted_link_is_a_link():
    """dtlib.ring.cost is the one home of the ring's terms: each row of a simulated table costs its calls times
    the ring's messages times alpha plus its bytes over the bandwidth, the bytes themselves counted with the
    ring's shares; and the AlphaBeta that notebook 03 fits on this machine is a link as it is."""
    from dtlib.measure.traffic import call_kind
    from dtlib.ring import AlphaBeta, ring_terms
    from dtlib.sim.network import network_seconds

    result = simulate(LLAMA["tiny"], dp=4, tp=2, seq_len=64, depths=None)
    link = AlphaBeta(1e-4, 2e9)
    expected = dict.fromkeys(("dp", "tp"), 0.0)
    for row in result.traffic:
        size = {"dp": 4, "tp": 2}[row.group]
        messages, share = ring_terms(call_kind(row.call), size)
        assert row.sent == pytest.approx(row.payload * share)
        expected[row.group] += row.calls * messages * 1e-4 + row.sent / 2e9
    assert network_seconds(result, {"dp": link, "tp": link}) == pytest.approx(expected)
    assert ring_terms("all_reduce", 4) == (6, 1.5) and ring_terms("gather", 4) == (3, 0.75)
    assert ring_terms("none", 4) == (0, 0.0) and ring_terms("send", 2) == (1, 1.0)
    assert ring_terms("gather", 1) == (0, 0.0)
    with pytest.raises(ValueError, match="unknown kind"):
        ring_terms("allreduce", 4)


def test_a_parallelize_of_ones_own_without_sequence_parallel_is_told_before_it_runs():
    from dtlib.sim.step import check_layout, lay_out

    def my_parallelize(model, mesh, checkpointing):
        raise AssertionError("called")  # it must not run: the layout asks for what it cannot do

    layout = check_layout(LLAMA["tiny"], dp=1, tp=2, seq_len=64, micro_batch=1, sequence_parallel=True)
    with pytest.raises(TypeError, match=r"takes sequence_parallel=.*my_parallelize\(model, mesh, checkpointing\)"):
        lay_out(my_parallelize, None, None, layout, checkpointing=False)
    plain = check_layout(LLAMA["tiny"], dp=1, tp=2, seq_len=64, micro_batch=1)
    with pytest.raises(AssertionError, match="called"):  # without SP it is called as it is
        lay_out(my_parallelize, None, None, plain, checkpointing=False)


def test_the_simulated_adamw_is_torchs_default_on_the_kernels_device():
    """Oracle: torch's own rule, foreach for CUDA tensors only (torch.optim.optimizer._default_to_fused_or_foreach
    asks whether the device supports foreach kernels), read from its list of such devices."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    from dtlib.sim.step import adamw

    model = torch.nn.Linear(2, 2)
    for kernels, device in (("cuda", "cuda"), ("cpu", "cpu")):
        assert adamw(model, kernels).defaults["foreach"] == (device in _get_foreach_kernels_supported_devices())


@pytest.mark.parametrize("tokens", [64, 8192])
def test_the_memory_efficient_attention_keeps_what_flash_keeps_at_lengths_of_32s(tokens):
    """dtlib.sim.llama.KERNELS' claim, from torch's own shape functions (meta tensors, no GPU needed): CUDA's
    memory-efficient kernel returns for backward the output and a log-sum-exp padded to 32 tokens, flash the output
    and one log-sum-exp per token; at a length of 32s (every simulated one), the same bytes."""
    query = torch.empty(2, tokens, 8, 128, device="meta", dtype=torch.bfloat16)  # (batch, tokens, heads, head_dim)
    efficient = torch.ops.aten._efficient_attention_forward(query, query, query, None, None, None, None, None, 0.0, 1,
                                                           True)
    flash = torch.ops.aten._flash_attention_forward(query, query, query, None, None, tokens, tokens, 0.0, True, False)
    kept = [sum(t.numel() * t.element_size() for t in outputs[:2]) for outputs in (efficient, flash)]
    assert kept[0] == kept[1] == 2 * tokens * 8 * (128 * 2 + 4)
    padded = torch.ops.aten._efficient_attention_forward(query[:, :tokens - 1], query, query, None, None, None, None,
                                                        None, 0.0, 1, True)[1]
    assert padded.shape[-1] == tokens  # 31 tokens past a multiple of 32 keep a whole 32's worth


def test_the_fullest_moment_before_the_step_is_the_peak_of_an_adamw_that_updates_one_parameter_at_a_time():
    """``Simulated.before_step``: the fullest moment before the optimizer's step. Oracle: the same job simulated
    with AdamW's ``foreach`` off, whose update holds one parameter's temporaries, not the shard's: its peak is
    that moment, to the byte. A checkpointed job of short sequences, whose default (``foreach``) step holds the
    most, so that the two peaks differ."""
    def one_parameter_at_a_time(model, optimizer, tokens):
        for group in optimizer.param_groups:
            group["foreach"] = False
        train_step(model, optimizer, tokens)

    job = {"dp": 8, "seq_len": 256, "checkpointing": True}
    default = simulate(LLAMA["7B"], **job)
    looped = simulate(LLAMA["7B"], **job, step=one_parameter_at_a_time)
    assert default.peak > looped.peak  # the default step holds foreach's temporary at its peak
    assert sum(default.before_step.values()) == looped.peak
    assert set(default.before_step) == set(default.memory)
