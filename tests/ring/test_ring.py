"""dtlib.ring: every algorithm's result against numpy's sum, its traffic against the published formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtlib import ring

ALL_REDUCES = [
    ring.simulate_all_reduce,
    ring.simulate_naive_all_reduce,
    ring.simulate_star_all_reduce,
    ring.simulate_recursive_doubling_all_reduce,
    ring.simulate_halving_doubling_all_reduce,
]

world_sizes = st.integers(min_value=1, max_value=9)
lengths = st.integers(min_value=0, max_value=40)


def _inputs(world_size: int, length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-100, 100, size=length) for _ in range(world_size)]  # integers: sums are exact


@settings(max_examples=60, deadline=None)
@given(world_size=world_sizes, length=lengths, algorithm=st.sampled_from(ALL_REDUCES))
def test_every_all_reduce_gives_every_rank_the_sum(world_size, length, algorithm):
    inputs = _inputs(world_size, length)
    trace = algorithm(inputs)
    expected = np.sum(inputs, axis=0) if length else np.zeros(0)
    assert len(trace.outputs) == world_size
    for output in trace.outputs:
        np.testing.assert_array_equal(output, expected)
    assert (trace.steps[-1].contributions == world_size).all() if trace.steps else world_size == 1


@settings(max_examples=60, deadline=None)
@given(world_size=world_sizes, length=lengths)
def test_ring_all_reduce_steps_and_bytes(world_size, length):
    trace = ring.simulate_all_reduce(_inputs(world_size, length), itemsize=4)
    assert len(trace.steps) == 2 * (world_size - 1)
    assert [s.phase for s in trace.steps] == ["reduce-scatter"] * (world_size - 1) + ["all-gather"] * (world_size - 1)
    bounds = ring.chunk_bounds(length, world_size)
    for step in trace.steps:
        assert sorted(t.src for t in step.transfers) == list(range(world_size))
        for t in step.transfers:  # to the right-hand neighbour, one chunk, its size in bytes
            assert t.dst == (t.src + 1) % world_size
            assert t.elements == bounds[t.chunk][1] - bounds[t.chunk][0]
            assert t.bytes == 4 * t.elements
    buffer_bytes = 4 * length
    assert trace.buffer_bytes == buffer_bytes
    assert trace.bytes_sent.sum() == trace.bytes_received.sum() == 2 * (world_size - 1) * buffer_bytes
    # Each rank sends 2(N-1) of the N chunks: at most one element per chunk above the even share.
    even_share = 2 * (world_size - 1) / world_size * buffer_bytes if world_size else 0
    assert np.all(np.abs(trace.bytes_sent - even_share) <= 2 * (world_size - 1) * 4)
    if length % world_size == 0:
        assert np.all(trace.bytes_sent == even_share)


def test_reduce_scatter_and_all_gather_are_the_two_halves():
    inputs = _inputs(5, 13, seed=3)  # 13 elements on 5 ranks: chunks of 3, 3, 3, 2, 2
    total = np.sum(inputs, axis=0)
    scattered = ring.simulate_reduce_scatter(inputs)
    assert len(scattered.steps) == 4
    assert [len(o) for o in scattered.outputs] == [3, 3, 3, 2, 2]
    np.testing.assert_array_equal(np.concatenate(scattered.outputs), total)
    gathered = ring.simulate_all_gather(scattered.outputs)
    for output in gathered.outputs:
        np.testing.assert_array_equal(output, total)
    both = ring.simulate_all_reduce(inputs)
    np.testing.assert_array_equal(scattered.bytes_sent + gathered.bytes_sent, both.bytes_sent)


def test_contributions_grow_by_one_per_reduce_scatter_step():
    trace = ring.simulate_all_reduce(_inputs(4, 8))
    for s, step in enumerate(trace.steps[:3]):
        # After step s, the chunk each rank just received holds s + 2 ranks' inputs.
        for t in step.transfers:
            assert step.contributions[t.dst, t.chunk] == s + 2
    assert (trace.steps[2].contributions.max(axis=1) == 4).all()  # each rank owns one finished chunk


def test_snapshots_show_each_step_and_can_be_skipped():
    inputs = [[1, 2], [10, 20]]
    trace = ring.simulate_all_reduce(inputs)
    np.testing.assert_array_equal(trace.steps[0].buffers[0], [11, 2])  # rank 0 added chunk 0 from rank 1
    np.testing.assert_array_equal(trace.steps[0].buffers[1], [10, 22])  # rank 1 added chunk 1 from rank 0
    np.testing.assert_array_equal(trace.steps[1].buffers[0], [11, 22])  # all-gather: rank 1 copied chunk 1 back
    assert all(step.buffers is None for step in ring.simulate_all_reduce(inputs, keep_buffers=False).steps)
    assert inputs == [[1, 2], [10, 20]]  # the caller's data is never changed


def test_tensors_numpy_and_lists_are_accepted_alike():
    as_list = ring.simulate_all_reduce([[1.5, 2.0], [3.0, 4.0]]).outputs
    as_tensor = ring.simulate_all_reduce([torch.tensor([1.5, 2.0], requires_grad=True), torch.tensor([3.0, 4.0])])
    np.testing.assert_array_equal(as_list[0], as_tensor.outputs[0])


def test_recursive_doubling_takes_log2_n_steps():
    assert len(ring.simulate_recursive_doubling_all_reduce(_inputs(8, 4)).steps) == 3
    assert len(ring.simulate_recursive_doubling_all_reduce(_inputs(6, 4)).steps) == 2 + 2  # fold in, hand back


def test_halving_doubling_sends_the_rings_bytes_in_2_log2_n_steps_as_its_cost_terms_say():
    """Rabenseifner's algorithm (Thakur, Rabenseifner and Gropp, 2005): the ring's 2(N-1)/N x S per rank."""
    length = 32 * 7 * 5  # even chunks for every N below
    for world_size in (2, 4, 8, 16, 32):
        inputs = _inputs(world_size, length)
        halving = ring.simulate_halving_doubling_all_reduce(inputs)
        np.testing.assert_array_equal(halving.bytes_sent, ring.simulate_all_reduce(inputs).bytes_sent)
        assert len(halving.steps) == 2 * (world_size.bit_length() - 1)
        assert all(t.dst == t.src ^ int(step.phase.split()[-1]) for step in halving.steps for t in step.transfers)
        messages, bytes_factor = ring.COST_TERMS["halving-doubling all-reduce"](world_size)
        assert messages == len(halving.steps)
        assert bytes_factor == pytest.approx(halving.bytes_sent.max() / halving.buffer_bytes)
    six = ring.simulate_halving_doubling_all_reduce(_inputs(6, length))
    assert [s.phase for s in six.steps] == ["fold in", "halving at distance 2", "halving at distance 1",
                                            "doubling at distance 1", "doubling at distance 2", "hand back"]


@pytest.mark.parametrize(
    ("inputs", "error", "match"),
    [
        ([], ValueError, "at least one rank"),
        ([[1, 2], [3]], ValueError, r"same length; got lengths \[2, 1\]"),
        ([["a", "b"], ["c", "d"]], TypeError, "not numeric"),
        ([[[1, 2]], [[3, 4]]], ValueError, "one flat sequence"),
        ("abc", TypeError, "one sequence per rank"),
    ],
)
def test_bad_input_gets_a_clear_error(inputs, error, match):
    with pytest.raises(error, match=match):
        ring.simulate_all_reduce(inputs)


def test_alpha_beta_formulas():
    model = ring.AlphaBeta(alpha_s=1e-5, bandwidth_bytes_per_s=1e9)
    n, s = 4, 1e6
    assert model.time("ring all-reduce", n, s) == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * s / 1e9)
    assert model.time("ring reduce-scatter", n, s) == pytest.approx(model.time("ring all-reduce", n, s) / 2)
    assert model.time("ring all-gather", n, s) == pytest.approx(model.time("ring all-reduce", n, s) / 2)
    with pytest.raises(ValueError, match="unknown algorithm"):
        model.time("butterfly", n, s)


@pytest.mark.parametrize("algorithm", sorted(ring.COST_TERMS))
def test_fit_recovers_a_known_model(algorithm):
    truth = ring.AlphaBeta(alpha_s=2e-5, bandwidth_bytes_per_s=5e9)
    sizes = [2**k for k in range(10, 27, 2)]
    times = [truth.time(algorithm, 4, size) for size in sizes]
    fitted = ring.fit_alpha_beta(sizes, times, algorithm=algorithm, world_size=4)
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(truth.bandwidth_bytes_per_s, rel=1e-6)


def test_fit_reads_alpha_off_the_small_end_and_bandwidth_off_the_large_end():
    """A CPU sweep whose middle sizes ran twice as fast as the model: the fit still meets both ends."""
    truth = ring.AlphaBeta(alpha_s=3e-4, bandwidth_bytes_per_s=0.7e9)
    sizes = [2**k for k in range(10, 25)]  # 1 KiB to 16 MiB, as the notebooks sweep
    times = [truth.time("ring all-reduce", 2, s) * (0.5 if 2**16 <= s <= 2**21 else 1.0) for s in sizes]
    fitted = ring.fit_alpha_beta(sizes, times)
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=1e-9)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(truth.bandwidth_bytes_per_s, rel=1e-9)
    spike = list(times)
    spike[-1] *= 3  # one slow measurement at an end moves the median of its quarter only a little
    assert ring.fit_alpha_beta(sizes, spike).bandwidth_bytes_per_s > 0.8 * truth.bandwidth_bytes_per_s


@pytest.mark.parametrize(
    ("sizes", "times", "options", "match"),
    [
        ([1024, 1024], [1e-4, 1.1e-4], {}, "two or more different sizes"),
        ([1024, 2048, 4096, 8192], [1e-4] * 4, {"share": 0.75}, "share is the part"),
        ([1024, 2048], [1e-4, 2e-4], {"world_size": 1}, "one rank sends nothing"),
        ([1024, 2048], [2e-4, 1e-4], {}, "do not grow with size"),
    ],
)
def test_fit_refuses_what_it_cannot_fit(sizes, times, options, match):
    with pytest.raises(ValueError, match=match):
        ring.fit_alpha_beta(sizes, times, **options)


def test_traffic_table_matches_the_formulas():
    world_sizes = [2, 3, 4, 5, 7, 8]
    table = ring.traffic_table(world_sizes)
    for i, n in enumerate(world_sizes):
        assert table["ring all-reduce"][i] == pytest.approx(2 * (n - 1) / n)
        assert table["naive all-reduce"][i] == n - 1
        assert table["reduce + broadcast"][i] == n - 1  # rank 0 sends the result to the N-1 others
        star = ring.simulate_star_all_reduce([np.zeros(4)] * n, keep_buffers=False)
        assert star.bytes_received[0] == (n - 1) * star.buffer_bytes  # ... and receives every rank's buffer
    assert table["recursive doubling all-reduce"][world_sizes.index(8)] == 3  # log2(8) whole buffers
    powers = [2, 4, 8, 16, 32, 64]  # the default length divides evenly: ring and halving-doubling agree exactly
    table = ring.traffic_table(powers)
    assert table["halving-doubling all-reduce"] == table["ring all-reduce"] == [2 * (n - 1) / n for n in powers]
