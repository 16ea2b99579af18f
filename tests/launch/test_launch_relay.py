"""The relay of rank output (dtlib.launch.relay.Relay): prefixes, batching, partial lines, and one
real job whose single line is 50 MB."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dtlib
from dtlib.launch.relay import FLUSH_INTERVAL_S, RECENT_STDERR_LINES, Relay

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Output:
    """Records the relay's writes, per stream."""

    def __init__(self) -> None:
        self.writes: dict[str, list[str]] = {"out": [], "err": []}

    def __call__(self, stream: str, text: str) -> None:
        self.writes[stream].append(text)

    def text(self, stream: str = "out") -> str:
        return "".join(self.writes[stream])


def relay_for(output: str = "all") -> tuple[Relay, Clock, Output]:
    clock, written = Clock(), Output()
    return Relay(output, clock, written), clock, written


def big_line(rank, world_size, size):
    sys.stdout.write("x" * size + "\n")
    return rank


# -- batching --------------------------------------------------------------------------------


def test_lines_of_many_reads_go_out_in_one_write_per_stream():
    """Whole lines wait for the next flush; then each stream gets one write, every line prefixed, in order."""
    relay, clock, written = relay_for()
    relay.flush()  # the first flush comes at once; the next one FLUSH_INTERVAL_S later
    for i in range(1000):
        relay.feed(i % 2, "out", f"line {i}\n".encode())
    relay.feed(1, "err", b"oops\n")
    relay.flush_if_due()
    assert written.writes == {"out": [], "err": []}
    clock.now += FLUSH_INTERVAL_S
    relay.flush_if_due()
    assert len(written.writes["out"]) == 1 and written.writes["err"] == ["[rank 1] oops\n"]
    assert written.text() == "".join(f"[rank {i % 2}] line {i}\n" for i in range(1000))


def test_a_line_split_across_reads_is_one_line():
    relay, _, written = relay_for()
    relay.feed(0, "out", b"hel")
    relay.feed(1, "out", b"other\n")
    relay.feed(0, "out", b"lo\nwor")
    relay.feed(0, "out", b"ld\n")
    relay.flush()
    assert written.text() == "[rank 1] other\n[rank 0] hello\n[rank 0] world\n"


def test_utf8_split_across_reads():
    relay, _, written = relay_for()
    data = "é → ü\n".encode()
    for i in range(len(data)):
        relay.feed(0, "out", data[i:i + 1])
    relay.flush()
    assert written.text() == "[rank 0] é → ü\n"


# -- partial lines ---------------------------------------------------------------------------


def test_partial_line_appears_after_a_short_wait_and_goes_on_without_a_second_prefix():
    relay, clock, written = relay_for()
    relay.feed(0, "out", b"loading")
    relay.flush()
    assert written.text() == ""  # not yet: the rest of the line may be on its way
    clock.now += FLUSH_INTERVAL_S
    relay.flush()
    assert written.text() == "[rank 0] loading"
    relay.feed(0, "out", b"... done\nnext\n")
    relay.flush()
    assert written.text() == "[rank 0] loading... done\n[rank 0] next\n"


def test_another_ranks_line_ends_an_unfinished_one_first():
    relay, clock, written = relay_for()
    relay.feed(0, "out", b"50%")
    clock.now += FLUSH_INTERVAL_S
    relay.flush()
    relay.feed(1, "out", b"hello\n")
    relay.feed(0, "out", b" 100%\n")
    relay.flush()
    assert written.text() == "[rank 0] 50%\n[rank 1] hello\n[rank 0]  100%\n"


def test_carriage_returns_keep_the_prefix():
    """A progress bar redraws its line after \\r; each redraw starts with the prefix again."""
    relay, clock, written = relay_for()
    relay.feed(0, "err", b"\r 10%\r 20%")
    clock.now += FLUSH_INTERVAL_S
    relay.flush()
    relay.feed(0, "err", b"\r100%\r\n")
    relay.flush(final=True)
    assert written.text("err") == "[rank 0] \r[rank 0]  10%\r[rank 0]  20%\r[rank 0] 100%\n"


def test_final_flush_and_end_of_file_finish_every_line():
    relay, _, written = relay_for()
    relay.feed(0, "out", b"no newline")
    relay.feed(1, "out", b"also none")
    relay.feed(1, "out", b"")  # rank 1's pipe ended
    relay.feed(2, "out", b"")  # nothing at all from rank 2
    relay.flush(final=True)
    assert written.text() == "[rank 1] also none\n[rank 0] no newline\n"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab\né€"), max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
    flushes=st.lists(st.booleans(), min_size=13, max_size=13),
)
def test_one_rank_any_reads_any_flushes(text, cuts, flushes):
    """Property: however one rank's bytes are cut into reads, and whenever flushes happen, the
    output is its text with the prefix at the start of every line."""
    relay, clock, written = relay_for()
    data = text.encode()
    points = sorted({min(cut, len(data)) for cut in cuts} | {0, len(data)})
    for (start, end), flush in zip(zip(points, points[1:], strict=False), flushes, strict=False):
        relay.feed(0, "out", data[start:end])
        if flush:
            clock.now += FLUSH_INTERVAL_S
            relay.flush()
    relay.flush(final=True)
    lines = text.split("\n")
    expected = "".join(f"[rank 0] {line}\n" for line in lines[:-1])
    assert written.text() == expected + (f"[rank 0] {lines[-1]}\n" if lines[-1] else "")


# -- output modes and death reports ----------------------------------------------------------


def test_rank0_mode_hides_rank_1_but_keeps_its_stderr_for_a_death_report():
    relay, _, written = relay_for("rank0")
    relay.feed(0, "out", b"zero\n")
    relay.feed(1, "out", b"one\n")
    relay.feed(1, "err", b"Segmentation fault\n")
    relay.flush(final=True)
    assert (written.text(), written.text("err")) == ("[rank 0] zero\n", "")
    assert relay.recent_stderr(1) == "Segmentation fault"


def test_recent_stderr_keeps_the_last_lines_and_the_unfinished_one():
    relay, _, _ = relay_for("none")
    relay.feed(0, "err", "".join(f"e{i}\n" for i in range(50)).encode() + b"half")
    lines = relay.recent_stderr(0).split("\n")
    assert lines == [f"e{i}" for i in range(50 - RECENT_STDERR_LINES, 50)] + ["half"]


def test_a_native_abort_keeps_its_reason_however_much_faulthandler_writes_after_it():
    relay, _, _ = relay_for("none")
    assert relay.last_words(0) is None
    relay.feed(0, "err", b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                         b"  what():  [enforce fail at /src/gloo/transport/tcp/pair.cc:456] op.preamble.length <= "
                         b"op.nbytes. 8 vs 4. Received data size doesn't match expected size.\n")
    relay.feed(0, "err", "".join(f"  File \"x.py\", line {i}\n" for i in range(3 * RECENT_STDERR_LINES)).encode())
    reason = "op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size."
    assert relay.last_words(0) == reason
    assert "what():" not in relay.recent_stderr(0)  # the tail alone would have lost it
    assert relay.last_words(1) is None


def mismatched_dtypes(rank, world_size):
    import torch
    import torch.distributed as dist

    x = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)  # 16 bytes against 32
    dist.all_reduce(x)
    return x


@pytest.mark.timeout(120)
def test_a_rank_that_gloo_aborts_is_reported_with_gloos_reason():
    with pytest.raises(dtlib.WorkerError) as caught:
        dtlib.spawn(mismatched_dtypes, 2, output="none", timeout=60)
    said = [failure.message for failure in caught.value.failures if "it said:" in failure.message]
    assert said and "doesn't match expected size" in said[0], str(caught.value)


# -- a real job ------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_50_mb_line_arrives_whole(capsys):
    """One 50 MB line (no newline until the end) is relayed whole: the relay keeps no quadratic
    buffer (a hang guard, not a timing: it took 40 s before)."""
    size = 50_000_000
    assert dtlib.spawn(big_line, 1, args=(size,)) == [0]
    captured = capsys.readouterr()
    assert len(captured.out) == len("[rank 0] ") + size + 1
    assert captured.out == "[rank 0] " + "x" * size + "\n"
