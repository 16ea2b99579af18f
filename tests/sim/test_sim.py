"""dtlib.sim: the simulated step against live ranks (the oracle: the same code on real gloo ranks), the
depth rule against a full-depth simulation, the presets against the published sizes."""

from __future__ import annotations

import pytest
import torch

from dtlib.sim.live import on_live_ranks
from dtlib.sim.llama import LLAMA, Llama, Shape
from dtlib.sim.step import simulate
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
    fake = simulate(LLAMA["tiny"], depths=None, **args)
    assert fake.traffic == real.traffic
    assert fake.memory == real.memory


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_deep_model_simulated_at_two_depths_and_scaled_equals_every_layer_simulated(checkpointing):
    shape = Shape(layers=9, hidden=256, heads=8, kv_heads=2, ffn=688, vocab=1000)
    args = {"dp": 8, "tp": 2, "seq_len": 256, "micro_batch": 2, "checkpointing": checkpointing}
    scaled, full = simulate(shape, **args), simulate(shape, depths=None, **args)
    assert scaled.depths == (3, 4) and full.depths == (9,)
    assert scaled.traffic == full.traffic
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
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_activation_formula_is_within_its_stated_error_of_the_simulator(checkpointing):
    """dtlib.measure.memory.activation_bytes against the simulated peak minus model state: 5% without
    checkpointing, 15% with (its docstring's claim), on two Llama shapes and a shape of other proportions."""
    from dtlib.measure.memory import activation_bytes

    odd = Shape(layers=12, hidden=2048, heads=16, kv_heads=4, ffn=5632, vocab=50_000)
    for shape, seq_len in ((LLAMA["7B"], 2048), (LLAMA["70B"], 8192), (odd, 4096)):
        result = simulate(shape, dp=64, seq_len=seq_len, checkpointing=checkpointing)
        formula = activation_bytes(shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab,
                                   seq_len, checkpointing=checkpointing)
        assert formula == pytest.approx(result.peak - result.model_state(), rel=0.15 if checkpointing else 0.05)
