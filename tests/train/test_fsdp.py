"""dtlib.train.fsdp: FSDP2, FSDP1 and DDP train alike; each rank holds and sends what the ZeRO arithmetic says.

Also dtlib.train.fsdp_compare's rows of real jobs: built from this file's jobs, not from 11 more."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import dtlib
from dtlib.launch.spawn import resolve_backend
from dtlib.measure import memory
from dtlib.train import data, fsdp, fsdp_compare, models
from dtlib.train.fsdp import FSDPConfig
from dtlib.train.fsdp_compare import bytes_sent_per_rank

STEPS = FSDPConfig().steps  # 4
NUM_PARAMS = sum(p.numel() for p in models.build("transformer").parameters())  # 28,064: every size divides by 4
NUM_TENSORS = len(list(models.build("transformer").parameters()))  # 30: Adam keeps one fp32 step scalar each
UNITS = len(models.build("transformer").blocks) + 1  # fully_shard on each block, then on the root
S = 4 * NUM_PARAMS  # bytes of the whole model (or of its gradients) in fp32


# The configs this file's tests and the strategy table train, by world size, trained in one launch per world
# size (fsdp.run_many: each config builds its own model and optimizer in the same ranks) rather than one launch
# each: a launch's start-up is most of a job here (about 1.5 s on 2 ranks, 4 s on 4, on two busy cores). Not
# among them: the three that test_run_many_equals_one_run_per_config compares run_many against, which run alone
# (fsdp.run), as does any config not listed.
TOGETHER = {
    2: (FSDPConfig(api="fsdp1"), FSDPConfig(strategy="shard_grad_op"), FSDPConfig(grad_accum=2),
        FSDPConfig(mixed_precision=True), FSDPConfig(activation_checkpointing=True), FSDPConfig(meta_init=True),
        FSDPConfig(cpu_offload=True), FSDPConfig(root_reshard_after_forward=None), FSDPConfig(prefetch=True),
        FSDPConfig(api="fsdp1", prefetch=True)),
    4: (FSDPConfig(), FSDPConfig(api="ddp"), FSDPConfig(api="fsdp1"), FSDPConfig(strategy="shard_grad_op"),
        FSDPConfig(reshard_after_forward=2), FSDPConfig(strategy="hybrid_shard"),
        FSDPConfig(strategy="hybrid_shard_zero2"), FSDPConfig(api="fsdp1", strategy="hybrid_shard_zero2"),
        FSDPConfig(api="fsdp1", strategy="shard_grad_op")),
}


@pytest.fixture(scope="module")
def jobs():
    """``jobs(config, world_size)``: every rank's results of one job, run once per module and shared (the
    strategy table's rows below are built from the same jobs). The first time a config of :data:`TOGETHER` is
    asked for, all of its world size's train, in one launch; if that launch fails, each config runs alone, so
    that a failure shows in its own tests."""
    cache: dict[tuple[int, str], list[fsdp.FSDPResult]] = {}
    launched: set[int] = set()

    def job(config: FSDPConfig, world_size: int) -> list[fsdp.FSDPResult]:
        key = (world_size, repr(config))
        together = TOGETHER.get(world_size, ())
        if key not in cache and world_size not in launched and key in {(world_size, repr(c)) for c in together}:
            launched.add(world_size)
            with contextlib.suppress(dtlib.WorkerError):  # then each config runs alone, below
                for each, results in zip(together, fsdp.run_many(list(together), world_size, output="none",
                                                                 timeout=600), strict=True):
                    cache[(world_size, repr(each))] = results
        if key not in cache:
            cache[key] = fsdp.run(config, world_size, output="none")
        return cache[key]

    return job


@pytest.fixture(scope="module")
def runs(jobs):
    """``runs(world_size, **changes)``: the results of ``FSDPConfig(**changes)`` (see ``jobs``)."""
    return lambda world_size=2, **changes: jobs(FSDPConfig(**changes), world_size)


def _losses(results: list[fsdp.FSDPResult]) -> list[float]:
    """The losses, checked to be the same on every rank (each is the mean over all ranks)."""
    for result in results[1:]:
        assert result.losses == results[0].losses, f"rank {result.rank} reports other losses"
    assert [r.rank for r in results] == list(range(len(results)))
    assert {r.world_size for r in results} == {len(results)}
    return results[0].losses


def _assert_close(actual, expected, what, atol=1e-5):
    assert len(actual) == len(expected) > 0, what
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol, err_msg=what)


def single_process_losses(steps: int = STEPS, global_batch: int = 16) -> list[float]:
    """The oracle: one process, the whole global batch per step, plain Adam, no wrapper."""
    config = FSDPConfig()
    model = models.build("transformer", seed=config.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    dataset = data.for_model("transformer", config.num_samples, seed=config.seed)
    batches = data.batches(dataset, world_size=1, rank=0, batch_size=global_batch, seed=config.seed)
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        loss = models.loss_fn("transformer", model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# --- the same training under every wrapper ------------------------------------------------------------------


@pytest.mark.timeout(300)  # the first to ask for each world size's jobs: it trains all of TOGETHER's, in one launch
@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_full_shard_matches_ddp_and_fsdp1(runs, world_size):
    fsdp2 = _losses(runs(world_size))
    _assert_close(fsdp2, _losses(runs(world_size, api="ddp")), f"FSDP2 vs DDP on {world_size}")
    _assert_close(fsdp2, _losses(runs(world_size, api="fsdp1")), f"FSDP2 vs FSDP1 on {world_size}")
    assert len(fsdp2) == STEPS and fsdp2[-1] < fsdp2[0] - 0.5  # it trained


@pytest.mark.timeout(180)
def test_fsdp2_matches_a_single_process_with_the_whole_batch(runs):
    reference = single_process_losses()
    assert reference[0] == pytest.approx(np.log(models.VOCAB), rel=0.1)  # near uniform before any update
    for world_size in (2, 4):
        _assert_close(_losses(runs(world_size)), reference, f"FSDP2 x{world_size} vs one process")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size, changes", [
    (2, {"strategy": "shard_grad_op"}),
    (4, {"strategy": "shard_grad_op"}),
    (4, {"reshard_after_forward": 2}),  # reshard to groups of 2 after forward: a legal divisor of 4
    (4, {"strategy": "hybrid_shard"}),  # 2 replicas x shard groups of 2
], ids=["shard_grad_op-2", "shard_grad_op-4", "reshard_to_2-4", "hybrid_shard-4"])
def test_other_sharding_layouts_match_ddp(runs, world_size, changes):
    _assert_close(_losses(runs(world_size, **changes)), _losses(runs(world_size, api="ddp")),
                  f"{changes} on {world_size} vs DDP")


@pytest.mark.timeout(120)
def test_gradient_accumulation_gives_the_same_losses(runs):
    _assert_close(_losses(runs(2, grad_accum=2)), _losses(runs(2)), "grad_accum=2 vs 1")


# --- memory: what a rank holds ------------------------------------------------------------------------------


def _formula(parameters: float, gradients: float, optimizer_state: float) -> dict[str, float]:
    return {"parameters": parameters, "gradients": gradients, "optimizer_state": optimizer_state}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_full_shard_holds_one_shard_of_everything(runs, world_size):
    for result in runs(world_size):
        at_rest, n = result.memory_at_rest, world_size
        assert result.num_params == NUM_PARAMS
        assert at_rest == _formula(S // n, S // n, 2 * S // n + 4 * NUM_TENSORS)  # Adam: two moments + steps
        assert result.parameters_after_forward == S // n  # resharded after forward: nothing stays gathered


@pytest.mark.timeout(180)
def test_shard_grad_op_keeps_the_gathered_parameters_until_backward(runs):
    for world_size in (2, 4):
        result = runs(world_size, strategy="shard_grad_op")[0]
        assert result.parameters_after_forward == S  # every unit gathered, the whole model on each rank
        assert result.memory_at_rest["parameters"] == S // world_size  # resharded after backward
    reshard_to_2 = runs(4, reshard_after_forward=2)[0]
    assert reshard_to_2.memory_at_rest["parameters"] == S // 4
    assert reshard_to_2.parameters_after_forward == S // 2  # kept sharded over 2 ranks between the passes


@pytest.mark.timeout(120)
def test_ddp_holds_everything(runs):
    for result in runs(2, api="ddp"):
        assert result.memory_at_rest == _formula(S, S, 2 * S + 4 * NUM_TENSORS)  # 16 bytes/parameter + steps
        assert result.parameters_after_forward == S
        assert result.estimate == _formula(S, S, 2 * S)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size, changes, expected", [
    # fp32 weights and gradients (4 bytes each), Adam's two fp32 moments (8 bytes) per parameter
    (2, {"api": "ddp"}, _formula(S, S, 2 * S)),
    (2, {}, _formula(S / 2, S / 2, 2 * S / 2)),  # ZeRO-3
    (4, {}, _formula(S / 4, S / 4, 2 * S / 4)),
    (2, {"strategy": "shard_grad_op"}, _formula(S, S / 2, 2 * S / 2)),  # ZeRO-2: weights whole
    (4, {"strategy": "hybrid_shard"}, _formula(S / 2, S / 2, 2 * S / 2)),  # ZeRO-3 within a group of 2
    (2, {"mixed_precision": True}, _formula(S / 2, S / 2, 2 * S / 2)),  # the shards stay fp32
    (2, {"api": "fsdp1"}, _formula(S / 2, S / 2, 2 * S / 2)),
])
def test_estimate_is_the_zero_formula(runs, world_size, changes, expected):
    result = runs(world_size, **changes)[0]
    assert result.estimate == pytest.approx(expected, rel=1e-12)
    assert list(result.estimate) == list(memory.breakdown(1, 1, "ddp")) == list(result.memory_at_rest)
    # That what a rank holds at its fullest is this formula is proven once, for every strategy, in
    # test_each_strategys_peak_is_its_formula below.


@pytest.mark.timeout(120)
def test_mixed_precision_keeps_fp32_shards(runs):
    assert runs(2, mixed_precision=True)[0].memory_at_rest == runs(2)[0].memory_at_rest


@pytest.mark.timeout(180)
def test_hybrid_shard_splits_within_groups_of_two(runs):
    for result in runs(4, strategy="hybrid_shard"):
        assert result.memory_at_rest["parameters"] == S // 2
        assert result.shard_example["local_shape"] == (16 // 2, 32)
        assert "Replicate" in result.shard_example["placements"] and "Shard" in result.shard_example["placements"]


# --- communication: what a rank sends -----------------------------------------------------------------------


def _comm(results: list[fsdp.FSDPResult]) -> dict[str, dict[str, int]]:
    """The last step's collectives, checked to be the same on every rank and in every step."""
    last = results[0].comm[-1]
    for result in results:
        assert len(result.comm) == STEPS
        assert all(step == last for step in result.comm), f"rank {result.rank}: {result.comm}"
    return last


@pytest.mark.timeout(120)
def test_ddp_all_reduces_the_gradients_once(runs):
    assert _comm(runs(2, api="ddp")) == {"all_reduce": {"calls": 1, "bytes": S}}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_full_shard_gathers_twice_and_reduce_scatters_once(runs, world_size):
    # Forward gathers each unit's weights, backward gathers them again (they were resharded), then
    # reduce-scatters the gradients: S counts the whole buffer, whatever the number of ranks.
    assert _comm(runs(world_size)) == {"all_gather": {"calls": 2 * UNITS, "bytes": 2 * S},
                                       "reduce_scatter": {"calls": UNITS, "bytes": S}}


@pytest.mark.timeout(120)
def test_shard_grad_op_gathers_once(runs):
    assert _comm(runs(2, strategy="shard_grad_op")) == {"all_gather": {"calls": UNITS, "bytes": S},
                                                        "reduce_scatter": {"calls": UNITS, "bytes": S}}


@pytest.mark.timeout(120)
def test_mixed_precision_gathers_bf16_and_reduces_fp32(runs):
    assert _comm(runs(2, mixed_precision=True)) == {"all_gather": {"calls": 2 * UNITS, "bytes": 2 * S // 2},
                                                    "reduce_scatter": {"calls": UNITS, "bytes": S}}


@pytest.mark.timeout(180)
def test_hybrid_shard_all_reduces_each_shard_across_replicas(runs):
    assert _comm(runs(4, strategy="hybrid_shard")) == {"all_gather": {"calls": 2 * UNITS, "bytes": 2 * S},
                                                       "reduce_scatter": {"calls": UNITS, "bytes": S},
                                                       "all_reduce": {"calls": UNITS, "bytes": S // 2}}


@pytest.mark.timeout(120)
def test_gradient_accumulation_gathers_per_micro_batch_but_reduces_once(runs):
    # set_requires_gradient_sync(False) on the first micro-batch: no reduce-scatter until the last.
    assert _comm(runs(2, grad_accum=2)) == {"all_gather": {"calls": 2 * 2 * UNITS, "bytes": 2 * 2 * S},
                                            "reduce_scatter": {"calls": UNITS, "bytes": S}}


# --- what each option shows -------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_shard_example_shows_the_local_rows(runs):
    for world_size in (2, 4):
        for result in runs(world_size):
            example = result.shard_example
            assert example["name"] == "position" and example["full_shape"] == (models.SEQ_LEN, 32)
            assert example["local_shape"] == (models.SEQ_LEN // world_size, 32)
            assert "Shard(dim=0)" in example["placements"]
    ddp = runs(2, api="ddp")[0].shard_example
    assert ddp["local_shape"] == ddp["full_shape"] == (models.SEQ_LEN, 32) and ddp["placements"] == "replicated"
    fsdp1 = runs(2, api="fsdp1")[0].shard_example
    assert fsdp1["placements"] == "flat parameter" and len(fsdp1["local_shape"]) == 1


@pytest.mark.timeout(120)
def test_activation_checkpointing_runs_each_block_twice(runs):
    blocks = UNITS - 1
    assert runs(2)[0].block_forward_calls == blocks
    assert runs(2, activation_checkpointing=True)[0].block_forward_calls == 2 * blocks  # recomputed in backward
    assert runs(2, grad_accum=2)[0].block_forward_calls == 2 * blocks  # two micro-batches, no recompute
    _assert_close(_losses(runs(2, activation_checkpointing=True)), _losses(runs(2)), "activation checkpointing")


@pytest.mark.timeout(120)
def test_meta_init_trains_like_normal_init(runs):
    meta = runs(2, meta_init=True)
    _assert_close(_losses(meta), _losses(runs(2)), "meta init")
    assert meta[0].memory_at_rest == runs(2)[0].memory_at_rest
    assert any("meta device" in note for note in meta[0].notes)
    assert not any("meta" in note for note in runs(2)[0].notes)


@pytest.mark.timeout(120)
def test_cpu_offload_under_fsdp2(runs):
    offloaded = runs(2, cpu_offload=True)
    _assert_close(_losses(offloaded), _losses(runs(2)), "CPU offload")
    # What the ranks compute on, not whether the machine has a GPU: with fewer GPUs than ranks they get gloo.
    on_gpus = resolve_backend("auto", 2) == "nccl"
    policy = "pin_memory=True" if on_gpus else "pin_memory=False"
    assert [note.split(":")[0] for note in offloaded[0].notes] == [f"CPUOffloadPolicy({policy})"], offloaded[0].notes


@pytest.mark.timeout(120)
def test_fsdp1_no_shard_notes_its_deprecation_instead_of_printing_it(runs, capsys):
    results = fsdp.run(FSDPConfig(api="fsdp1", strategy="no_shard"), 2, output="all")
    printed = capsys.readouterr()
    for result in results:
        deprecated = [note for note in result.notes if "deprecated" in note]
        assert len(deprecated) == 1 and "NO_SHARD" in deprecated[0], result.notes
        assert deprecated[0].startswith(f"torch {torch.__version__} says: ")
    assert "FutureWarning" not in printed.err + printed.out and "deprecated" not in printed.err + printed.out
    _assert_close(_losses(results), _losses(runs(2, api="ddp")), "FSDP1 NO_SHARD vs DDP")
    assert results[0].memory_at_rest["parameters"] == S  # nothing sharded


@pytest.mark.timeout(120)
def test_mixed_precision_is_close_but_not_equal(runs):
    bf16, fp32 = _losses(runs(2, mixed_precision=True)), _losses(runs(2))
    _assert_close(bf16, fp32, "bf16 compute vs fp32", atol=0.05)
    assert max(abs(a - b) for a, b in zip(bf16, fp32, strict=True)) > 1e-5  # bf16 really was used


# --- settings refused before any process starts -------------------------------------------------------------


def _refused_before_any_process(monkeypatch, config, world_size, pattern):
    def no_processes(*args, **kwargs):
        raise AssertionError("fsdp.run started processes for a config it should refuse")

    monkeypatch.setattr(sys.modules["dtlib.launch.entry"], "spawn", no_processes)
    monkeypatch.setattr(sys.modules["dtlib.launch.spawn"], "spawn", no_processes)
    with pytest.raises(ValueError, match=pattern):  # and spawn, patched above, was never called
        fsdp.run(config, world_size, output="none")


@pytest.mark.parametrize("config, world_size, pattern", [
    (FSDPConfig(api="deepspeed"), 2, r"api must be one of .*'fsdp2'.*got 'deepspeed'"),
    (FSDPConfig(strategy="zero3"), 2, r"unknown strategy 'zero3'; choose one of full_shard"),
    (FSDPConfig(api="fsdp2", strategy="no_shard"), 2, r"FSDP2 has no no_shard.*DDP \(api='ddp'\)"),
    (FSDPConfig(strategy="hybrid_shard"), 3, r"world_size divisible by shard_group_size: 3 ranks"),
    (FSDPConfig(api="fsdp1", strategy="hybrid_shard", shard_group_size=4), 6, r"cannot form groups of 4"),
    # one rank more than there are GPUs (here 0 + 1): dtlib runs the ranks on the CPU, where offload cannot work
    (FSDPConfig(api="fsdp1", cpu_offload=True), torch.cuda.device_count() + 1,
     r"CPUOffload needs an accelerator.*GPU\(s\) for \d+ ranks the ranks compute on the CPU"),
    (FSDPConfig(api="fsdp1", meta_init=True), 2, r"FSDP2 only \(api='fsdp2'\)"),
    (FSDPConfig(api="ddp", activation_checkpointing=True), 2, r"FSDP2 only"),
    (FSDPConfig(model="mlp"), 2, r"model must be 'transformer', got 'mlp'"),
    (FSDPConfig(auto_wrap="everything"), 2, r"auto_wrap must be 'transformer' or 'size'"),
    (FSDPConfig(checkpoint_kind="zip"), 2, r"checkpoint_kind must be 'sharded' or 'full', got 'zip'"),
    (FSDPConfig(resume=True), 2, r"saving or resuming needs checkpoint_dir"),
    (FSDPConfig(save_after_step=2), 2, r"saving or resuming needs checkpoint_dir"),
    (FSDPConfig(global_batch=15), 2, r"global_batch=15 must be a positive multiple of .* = 2"),
    (FSDPConfig(global_batch=16, grad_accum=3), 2, r"multiple of world_size x grad_accum = 6"),
    (FSDPConfig(global_batch=0), 2, r"global_batch=0 must be a positive multiple"),
])
def test_bad_settings_are_refused_before_any_process_starts(monkeypatch, config, world_size, pattern):
    _refused_before_any_process(monkeypatch, config, world_size, pattern)


@pytest.mark.parametrize("config, world_size, pattern", [
    (FSDPConfig(grad_accum=0), 2, "grad_accum must be >= 1"),  # was a ZeroDivisionError
    (FSDPConfig(grad_accum=-1), 2, "grad_accum must be >= 1"),  # 16 % -2 == 0 used to pass
    (FSDPConfig(steps=0), 2, "steps and grad_accum must be >= 1"),
    (FSDPConfig(reshard_after_forward=3), 4, r"must divide the 4 ranks .* \[1, 2, 4\]"),  # fully_shard's own error
    (FSDPConfig(api="fsdp1", reshard_after_forward=False), 2, "reshard_after_forward is FSDP2's"),
    (FSDPConfig(global_batch=512), 2, "exceeds the 256 samples"),  # used to fail in data.batches, in every rank
], ids=["grad_accum=0", "grad_accum=-1", "steps=0", "reshard_after_forward=3-of-4", "reshard-with-fsdp1",
        "global_batch>num_samples"])
def test_settings_that_used_to_fail_inside_the_ranks(monkeypatch, config, world_size, pattern):
    _refused_before_any_process(monkeypatch, config, world_size, pattern)


def _refused_without_processes(monkeypatch, config, world_size, pattern):
    """Like _refused_before_any_process, without a wall-clock bound: the patched spawn is the proof."""
    def no_processes(*args, **kwargs):
        raise AssertionError("fsdp.run started processes for a config it should refuse")

    monkeypatch.setattr(sys.modules["dtlib.launch.entry"], "spawn", no_processes)
    monkeypatch.setattr(sys.modules["dtlib.launch.spawn"], "spawn", no_processes)
    with pytest.raises(ValueError, match=pattern):
        fsdp.run(config, world_size, output="none")


@pytest.mark.parametrize("config, world_size, pattern", [
    (FSDPConfig(steps=2.5), 2, r"^steps must be a whole number \(an int\), got 2.5$"),
    (FSDPConfig(global_batch=32.0), 2, r"^global_batch must be a whole number \(an int\), got 32.0$"),
    (FSDPConfig(shard_group_size=2.0, strategy="hybrid_shard"), 4, r"^shard_group_size must be a whole number"),
    (FSDPConfig(threads=None), 2, r"^threads must be a whole number \(an int\), got None$"),
    (FSDPConfig(), 2.0, r"^world_size must be a whole number \(an int\), got 2.0$"),
    (FSDPConfig(reshard_after_forward=2.0), 2, r"reshard_after_forward must be True, False, None or an int, got 2.0"),
    (FSDPConfig(save_after_step=5, checkpoint_dir="ckpt"), 2,
     r"save_after_step=5 is not one of the steps 1..4, so nothing would be saved; use a value from 1 to steps=4"),
    (FSDPConfig(save_after_step=0, checkpoint_dir="ckpt"), 2, r"save_after_step=0 is not one of the steps 1..4"),
    (FSDPConfig(save_after_step=2), 2, r"needs checkpoint_dir, e.g. dtlib.train.fsdp_checkpoint.default_directory\(\)"),
], ids=["steps=2.5", "global_batch=32.0", "shard_group_size=2.0", "threads=None", "world_size=2.0",
        "reshard_after_forward=2.0", "save_after_step>steps", "save_after_step=0", "no-checkpoint_dir"])
def test_settings_that_fail_inside_every_rank_or_save_nothing_are_refused(monkeypatch, config, world_size, pattern):
    _refused_without_processes(monkeypatch, config, world_size, pattern)


def test_validate_accepts_numpy_integers_and_stores_them_as_ints():
    config = FSDPConfig(steps=np.int64(4), global_batch=np.int32(16), save_after_step=np.int64(4),
                        checkpoint_dir="ckpt", reshard_after_forward=np.int64(2))
    fsdp.validate(config, np.int64(2))
    for name in ("steps", "global_batch", "save_after_step", "reshard_after_forward"):
        assert type(getattr(config, name)) is int, name  # torch's samplers and fully_shard want ints
    with pytest.raises(ValueError, match=r"reshard_after_forward=3: an integer must divide the 4 ranks"):
        fsdp.validate(FSDPConfig(reshard_after_forward=np.int64(3)), 4)  # checked like an int


@pytest.mark.timeout(120)
def test_numpy_integers_train_like_ints(runs):
    config = FSDPConfig(steps=np.int64(2), global_batch=np.int64(16), grad_accum=np.int8(1))
    results = fsdp.run(config, 2, output="none")
    assert _losses(results) == _losses(runs(2))[:2]


def test_validate_accepts_what_runs():
    for config, world_size in [(FSDPConfig(), 2), (FSDPConfig(api="fsdp1", strategy="no_shard"), 2),
                               (FSDPConfig(strategy="hybrid_shard"), 4), (FSDPConfig(reshard_after_forward=2), 4),
                               (FSDPConfig(api="ddp", strategy="hybrid_shard", global_batch=24), 3),  # no groups
                               (FSDPConfig(global_batch=24, grad_accum=3), 4)]:
        fsdp.validate(config, world_size)


# --- the strategies side by side: dtlib.train.fsdp_compare's rows, built from the jobs above --------------


def _table(jobs, world_size: int) -> dict[str, fsdp_compare.StrategyRow]:
    """What ``fsdp_compare.strategies(world_size)`` returns, one row per setting that fits, from shared jobs."""
    return {label: fsdp_compare.strategy_row(label, jobs(FSDPConfig(**fsdp_compare.SETTINGS[label]), world_size))
            for label in fsdp_compare.settings_for(world_size)}


@pytest.fixture(scope="module")
def two(jobs):
    return _table(jobs, 2)


@pytest.fixture(scope="module")
def four(jobs):
    return _table(jobs, 4)


@pytest.fixture(params=[2, 4])
def rows(request):
    return request.getfixturevalue({2: "two", 4: "four"}[request.param])


@pytest.mark.timeout(180)
def test_strategies_run_the_settings_that_fit(two, four):
    hsdp = "FSDP2 HSDP (2 x 2 mesh)"
    assert list(two) == [label for label in fsdp_compare.SETTINGS if label != hsdp]  # 2 ranks: no 2 x 2 mesh
    assert list(four) == list(fsdp_compare.SETTINGS) == list(fsdp_compare.settings_for(8))
    for world_size, rows in ((2, two), (4, four)):
        for row in rows.values():
            assert row.world_size == world_size and row.step_ms > 0
        assert rows["DDP"].shard_group == 1 and rows["FSDP2 full shard"].shard_group == world_size
    assert four[hsdp].shard_group == 2


@pytest.mark.timeout(180)
def test_each_row_carries_its_runs_memory_and_ddp_holds_the_most(rows):
    ddp = rows["DDP"]
    assert all(ddp.at_rest > row.at_rest for label, row in rows.items() if label != "DDP")
    assert ddp.estimate == 4 * S  # the row's formula: 4 + 4 + 8 bytes per parameter (S is 4), all replicated
    for row in rows.values():
        assert sum(row.at_rest_parts.values()) == row.at_rest and set(row.at_rest_parts) == {
            "parameters", "gradients", "optimizer_state"}
    assert ddp.at_rest_parts["parameters"] == ddp.at_rest_parts["gradients"] == S


@pytest.mark.timeout(180)
def test_each_strategys_peak_is_its_formula(rows):
    """The one place the formulas meet measured peaks: what rank 0 holds at its fullest (at rest, plus the
    weights gathered between forward and backward) is its setting's formula, Adam's step counters and
    padding on top. FSDP2 without resharding holds the gathered fp32 weights (S) beside its fp32 shards of
    weights and gradients and Adam's moments (4S/n): 4P + 16P/N, more than ZeRO-2's 4P + 12P/N in fp32."""
    n = rows["DDP"].world_size
    no_reshard = rows["FSDP2 no reshard after forward"]
    assert no_reshard.estimate == pytest.approx(S + 4 * S / n)
    zero2 = memory.estimate(S / 4, n, "zero2", param_bytes=4, grad_bytes=4, optim_bytes_per_param=8)
    assert no_reshard.estimate - zero2 == pytest.approx(S / n)  # 4P/N more: a shard beside the gathered copy
    assert no_reshard.peak - no_reshard.at_rest == S  # the whole weights, gathered between forward and backward
    full = rows["FSDP2 full shard"]
    assert full.peak == full.at_rest and full.estimate == pytest.approx(4 * S / n)
    for label, row in rows.items():
        assert (row.peak is None) == label.startswith("FSDP1"), label  # FSDP1's gathered weights are hidden
        if row.peak is not None:
            assert 1 <= row.peak / row.estimate <= 1.05, label  # DDP, every FSDP2 setting, HSDP on 4 ranks


@pytest.mark.timeout(180)
def test_bytes_sent_per_rank_relative_to_ddp(two, four):
    # Ring traffic per rank, with S the fp32 model size. DDP all-reduces S over n ranks: 2(n-1)/n S.
    # FSDP all-gathers 2S (forward and backward) and reduce-scatters S over n ranks: 3(n-1)/n S, so 1.5x DDP
    # for any n. Without reshard it gathers once: 2(n-1)/n S, exactly DDP.
    for rows in (two, four):
        ddp = bytes_sent_per_rank(rows["DDP"])
        assert ddp == 2 * (rows["DDP"].world_size - 1) / rows["DDP"].world_size * S
        assert bytes_sent_per_rank(rows["FSDP2 full shard"]) / ddp == 1.5
        assert bytes_sent_per_rank(rows["FSDP2 no reshard after forward"]) / ddp == 1.0
    # HSDP on 4 ranks, shard groups of g=2, r=2 replicas: all-gather 2S and reduce-scatter S within the group,
    # (g-1)/g each: 1.5 S; then all-reduce of each S/2 shard over 2 replicas, 2(r-1)/r: S/2. Total 2S,
    # against DDP's 2 * 3/4 S = 1.5 S: 4/3.
    assert bytes_sent_per_rank(four["FSDP2 HSDP (2 x 2 mesh)"]) == 2 * S
    assert bytes_sent_per_rank(four["FSDP2 HSDP (2 x 2 mesh)"]) / bytes_sent_per_rank(four["DDP"]) == \
        pytest.approx(4 / 3, rel=1e-12)


def test_comparison_table_fits_a_notebook_and_quotes_the_rows(four):
    """Notebook 06's table: at most 110 characters a line (JupyterLab's output area at 1280 px), so it keeps its
    columns; the traffic row is bytes_sent_per_rank against DDP's, the memory row each strategy's bytes."""
    labels = ("DDP", "FSDP2 full shard", "FSDP2 no reshard after forward", "FSDP2 HSDP (2 x 2 mesh)")
    rows = [four[label] for label in labels]
    lines = fsdp_compare.comparison_table(rows)
    assert max(map(len, lines)) <= 110, "\n".join(lines)
    header = " ".join(line for line in lines if not line[0].strip()).split()  # wrapped strategy names
    assert all(word in header for label in labels for word in label.split())
    by_aspect = {line.split("  ")[0].strip(): line.split()[-len(rows):] for line in lines if line[0].strip()}
    ddp_sent = bytes_sent_per_rank(rows[0])
    assert by_aspect["traffic vs DDP"] == [f"{bytes_sent_per_rank(r) / ddp_sent:.2f}x" for r in rows]
    assert by_aspect["state per rank (kB)"] == [f"{r.at_rest / 1e3:.1f}" for r in rows]


# --- the command line ---------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_command_line_prints_the_losses(runs):
    completed = subprocess.run([sys.executable, "-m", "dtlib.train", "fsdp", "--world-size", "2", "--api", "fsdp2",
                                "--steps", "2"], capture_output=True, text=True, timeout=100)
    assert completed.returncode == 0, completed.stderr
    match = re.search(r"^fsdp2 full_shard on 2 ranks: losses ([-\d.]+) ([-\d.]+)$", completed.stdout, re.MULTILINE)
    assert match, completed.stdout
    printed = [float(value) for value in match.groups()]
    np.testing.assert_allclose(printed, runs(2)[0].losses[:2], rtol=0, atol=1e-4)  # printed to 4 decimals
    at_rest = sum(runs(2)[0].memory_at_rest.values())
    assert f"model state on rank 0: {at_rest} bytes (formula {2 * S})" in completed.stdout
    assert f"'reduce_scatter': {{'calls': {UNITS}, 'bytes': {S}}}" in completed.stdout


# --- on GPUs ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(180)
def test_fsdp1_cpu_offload_on_gpus_trains_like_fsdp2():
    fsdp1 = fsdp.run(FSDPConfig(api="fsdp1", cpu_offload=True), 2, output="none")
    fsdp2 = fsdp.run(FSDPConfig(api="fsdp2", cpu_offload=True), 2, output="none")
    _assert_close(_losses(fsdp1), _losses(fsdp2), "CPU offload on GPUs", atol=1e-4)
    assert [note.split(":")[0] for note in fsdp2[0].notes] == ["CPUOffloadPolicy(pin_memory=True)"], fsdp2[0].notes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(180)
def test_cuda_memory_sits_above_the_model_state_on_one_gpu():
    """NCCL at world size 1: the allocator's peak holds the model state the formula counts, and more."""
    for config in (FSDPConfig(api="fsdp2"), FSDPConfig(api="fsdp1"), FSDPConfig(api="ddp")):
        (result,) = fsdp.run(config, 1, output="none")
        assert result.cuda_memory is not None, config.api
        assert result.cuda_memory["peak"] > sum(result.memory_at_rest.values()), (config.api, result.cuda_memory)


def test_cpu_ranks_report_no_cuda_memory(runs):
    assert runs(2)[0].cuda_memory is None


# --- the root's setting, the groups of the all-gathers, several configs in one launch ------------------------

ROOT_PARAMS = NUM_PARAMS - sum(p.numel() for block in models.build("transformer").blocks for p in block.parameters())


@pytest.mark.timeout(120)
def test_fully_shards_default_keeps_the_root_gathered_after_forward(runs):
    """fully_shard's reshard_after_forward=None is False for the root: its backward all-gather goes."""
    default, resharded = runs(2, root_reshard_after_forward=None)[0], runs(2)[0]
    assert resharded.comm[-1]["all_gather"] == {"calls": 2 * UNITS, "bytes": 2 * S}
    assert default.comm[-1]["all_gather"] == {"calls": 2 * UNITS - 1, "bytes": 2 * S - 4 * ROOT_PARAMS}
    # between forward and backward the root's weights are whole, every block's a shard
    assert default.parameters_after_forward == 4 * ROOT_PARAMS + (S - 4 * ROOT_PARAMS) // 2
    _assert_close(_losses(runs(2, root_reshard_after_forward=None)), _losses(runs(2)), "root kept gathered")


@pytest.mark.timeout(180)
def test_all_gather_groups_show_partial_resharding_and_hsdp(runs):
    assert runs(4)[0].all_gather_group_sizes == [4] * 2 * UNITS
    partial = runs(4, reshard_after_forward=2)[0]
    assert partial.all_gather_group_sizes == [4] * UNITS + [2] * UNITS  # forward over 4 ranks, backward over pairs
    assert partial.parameters_after_forward == 2 * runs(4)[0].parameters_after_forward  # half a unit, not a quarter
    assert runs(4, strategy="hybrid_shard")[0].all_gather_group_sizes == [2] * 2 * UNITS
    assert runs(4, api="fsdp1")[0].all_gather_group_sizes == [4] * (2 * UNITS - 1)  # FSDP1 keeps its root gathered
    assert runs(4, api="ddp")[0].all_gather_group_sizes == []


@pytest.mark.timeout(240)
def test_hybrid_shard_zero2_in_fsdp1_and_fsdp2(runs):
    ddp = _losses(runs(4, api="ddp"))
    for api in ("fsdp1", "fsdp2"):
        results = runs(4, api=api, strategy="hybrid_shard_zero2")
        _assert_close(_losses(results), ddp, f"{api} _HYBRID_SHARD_ZERO2 vs DDP")
        comm = results[0].comm[-1]
        assert comm["all_gather"] == {"calls": UNITS, "bytes": S}  # forward only: kept for backward
        assert comm["all_reduce"] == {"calls": UNITS, "bytes": S // 2}  # each shard across the 2 replicas
    assert runs(4, strategy="hybrid_shard_zero2")[0].parameters_after_forward == S
    assert runs(4, strategy="hybrid_shard_zero2")[0].estimate == memory.breakdown(
        NUM_PARAMS, 2, "zero2", param_bytes=4, grad_bytes=4, optim_bytes_per_param=8)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("api", ["fsdp1", "fsdp2"])
def test_explicit_prefetch_changes_no_result(runs, api):
    prefetched, plain = runs(2, api=api, prefetch=True), runs(2, api=api)
    _assert_close(_losses(prefetched), _losses(plain), f"{api} with prefetch")
    assert prefetched[0].comm[-1] == plain[0].comm[-1]


@pytest.mark.timeout(120)
def test_activation_checkpointing_cuts_the_bytes_saved_for_backward(runs):
    plain, checkpointed = runs(2)[0], runs(2, activation_checkpointing=True)[0]
    micro_batch_activation = 8 * 16 * 32 * 4  # (B, T, C) fp32: the global batch of 16 over 2 ranks
    assert checkpointed.saved_for_backward_bytes < plain.saved_for_backward_bytes / 4
    # what remains includes each checkpointed block's input
    assert checkpointed.saved_for_backward_bytes > len(models.build("transformer").blocks) * micro_batch_activation


@pytest.mark.timeout(240)
def test_run_many_equals_one_run_per_config(runs, tmp_path):
    configs = [FSDPConfig(), FSDPConfig(api="fsdp1", strategy="shard_grad_op"), FSDPConfig(api="ddp"),
               FSDPConfig(steps=2, save_after_step=2, checkpoint_dir=str(tmp_path)),
               FSDPConfig(resume=True, checkpoint_dir=str(tmp_path))]
    together = fsdp.run_many(configs, 2, output="none")
    assert len(together) == len(configs) and all(len(results) == 2 for results in together)
    assert not {repr(c) for c in configs[:3]} & {repr(c) for c in TOGETHER[2]}  # runs() gives fsdp.run's own
    for results, changes in zip(together[:3], ({}, {"api": "fsdp1", "strategy": "shard_grad_op"}, {"api": "ddp"}),
                                strict=True):
        alone = runs(2, **changes)
        assert _losses(results) == _losses(alone), changes
        assert results[0].comm == alone[0].comm and results[0].memory_at_rest == alone[0].memory_at_rest
    # the config after the save resumes from it, in the same launch
    assert together[4][0].first_step == 2
    _assert_close(_losses(together[3]) + _losses(together[4]), _losses(runs(2)), "saved, then resumed")


@pytest.mark.parametrize("configs, world_size, pattern", [
    ([FSDPConfig(), FSDPConfig(api="fsdp1", root_reshard_after_forward=None)], 2, "root_reshard_after_forward is"),
    ([FSDPConfig(root_reshard_after_forward="none")], 2, "must be 'blocks', None"),
    ([FSDPConfig(api="ddp", prefetch=True)], 2, "prefetch is FSDP's"),
    ([FSDPConfig(strategy="hybrid_shard_zero2", shard_group_size=4, global_batch=24)], 6, "cannot form groups of 4"),
    ([FSDPConfig(api="nope")], 2, "api must be one of"),
])
def test_run_many_refuses_every_bad_config_before_any_process_starts(monkeypatch, configs, world_size, pattern):
    def no_processes(*args, **kwargs):
        pytest.fail("a process was started")

    monkeypatch.setattr(sys.modules["dtlib.launch.entry"], "spawn", no_processes)
    with pytest.raises(ValueError, match=pattern):
        fsdp.run_many(configs, world_size)


@pytest.mark.parametrize("strategy", ["hybrid_shard", "hybrid_shard_zero2"])
def test_both_hybrid_strategies_need_whole_shard_groups(monkeypatch, strategy):
    _refused_before_any_process(monkeypatch, FSDPConfig(strategy=strategy, shard_group_size=3), 4,
                                f"{strategy} needs world_size divisible by shard_group_size")
    _refused_before_any_process(monkeypatch, FSDPConfig(strategy=strategy, reshard_after_forward=4), 4,
                                "must divide the 2 ranks that shard")


def _gradient_bytes_over_micro_batches(rank, world_size, reduce_dtype):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dtlib
    from dtlib.measure.held import gradient_bytes

    device = dtlib.rank_device()
    model = models.build("transformer", seed=0).to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) if reduce_dtype else None
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **({"mp_policy": policy} if policy else {}))
    fully_shard(model, mesh=mesh, **({"mp_policy": policy} if policy else {}))
    x, y = (t.to(device) for t in next(data.batches(data.tokens(256), world_size, rank, batch_size=6)))
    held = [gradient_bytes(model)]
    for i, (xs, ys) in enumerate(zip(x.chunk(3), y.chunk(3), strict=True)):
        model.set_requires_gradient_sync(i == 2)
        torch.nn.functional.cross_entropy(model(xs).float().flatten(0, 1), ys.flatten()).backward()
        held.append(gradient_bytes(model))
    return held


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_gradient_bytes_are_whole_while_the_sync_is_held_back_and_sharded_after(reduce_dtype):
    """Oracle: 4P bytes of fp32 gradient while set_requires_gradient_sync(False) holds (FSDP keeps them
    unsharded, on the unsharded parameter or, with a reduce_dtype of its own, in its accumulator), 4P/N once
    the last micro-batch reduce-scatters; nothing before the first backward."""
    import dtlib

    parameters = sum(p.numel() for p in models.build("transformer").parameters())
    for held in dtlib.spawn(_gradient_bytes_over_micro_batches, world_size=2, args=(reduce_dtype,), timeout=90):
        assert held == [0, 4 * parameters, 4 * parameters, 4 * parameters // 2]


def _bookkeeping_per_step(rank: int, world_size: int) -> dict[str, object]:
    """In a rank: train FSDP2 for 5 steps, noting the step each of the runner's own measurements ran in."""
    from dtlib.measure import memory
    from dtlib.train import fsdp

    steps: list[int] = []
    current = {"step": -1}

    def counted(function):
        def wrapper(*args, **kwargs):
            steps.append(current["step"])
            return function(*args, **kwargs)
        return wrapper

    real_zero_grad = torch.optim.Optimizer.zero_grad

    def zero_grad(self, *args, **kwargs):  # marks the end of each step: the next measurement is the next step's
        current["step"] += 1
        return real_zero_grad(self, *args, **kwargs)

    memory.measured = counted(memory.measured)
    fsdp.saved_for_backward = counted(fsdp.saved_for_backward)
    torch.optim.Optimizer.zero_grad = zero_grad
    current["step"] = 0
    result = fsdp.train(rank, world_size, FSDPConfig(steps=5))
    return {"steps": steps, "times": len(result.step_times_s), "saved": result.saved_for_backward_bytes,
            "at_rest": sum(result.memory_at_rest.values()), "after_forward": result.parameters_after_forward}


def test_the_runners_measure_memory_in_the_first_step_only_which_the_step_time_median_leaves_out():
    """The measurements walk every tensor and hook every saved one: inside later steps they would be timed as
    training (the FSDP2 step time of notebook 05 included them). Step 0 is left out of the median anyway."""
    from dtlib import spawn

    counted = spawn(_bookkeeping_per_step, world_size=2, output="none", timeout=120)[0]
    assert counted["steps"] == [0, 0, 0], counted  # saved_for_backward, then measured after forward and at rest
    assert counted["times"] == 5 and counted["saved"] > 0 and counted["at_rest"] > counted["after_forward"] > 0
