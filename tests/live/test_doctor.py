"""The hang doctor compares every field of a collective across the ranks, and names each rank's state.

One test per kind of disagreement (root, group, call, sizes and dtypes, reduce op, split sizes) and per rank state
(finished, raised inside the call, late, never called). Where a hang can be made on gloo the test makes it on
real live ranks; the rest go through :func:`dtlib.live.doctor.explain` with records shaped as torch 2.13's Flight
Recorder dumps them (``_dump_fr_trace(True, True, False)``), and the oracle for those shapes and for what each
rank notes is a real recorder, in :func:`test_a_real_recorder_and_the_ranks_notes_name_every_call_and_argument`.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib.live import doctor

pytestmark = pytest.mark.timeout(300)

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _hang(ranks: dtlib.LiveRanks, code: str) -> str:
    """The message of the hang (or of the error that left the others waiting) that ``code`` makes."""
    with pytest.raises(dtlib.WorkerError) as caught:
        ranks.run(code, timeout=3)
    return str(caught.value).split("\n--- ")[0] + "\n" + caught.value.note


# -- on real live ranks ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("code", "calls"), [
    ("x = torch.ones(4)\ndist.broadcast(x, src=0 if rank == 0 else 1)\n",
     "rank 0 calls broadcast (float32[4], src=0), rank 1 calls broadcast (float32[4], src=1)"),
    ("x = torch.ones(4)\ndist.reduce(x, dst=rank)\n",
     "rank 0 calls reduce (float32[4], dst=0), rank 1 calls reduce (float32[4], dst=1)"),
])
def test_a_different_root_on_each_rank_is_named(ranks, code, calls):
    """The Flight Recorder does not record a root: each rank notes it, and the doctor compares it."""
    message = _hang(ranks, code)
    assert re.search(r"the ranks disagree at collective #\d+: " + re.escape(calls), message), message
    assert "same arguments" not in message


def test_different_split_sizes_are_named_and_the_rank_that_raised_inside_the_call_too(ranks):
    """gloo's all-to-all refuses rank 1's split on rank 1 (it raises) and leaves rank 0 waiting."""
    message = _hang(ranks, "out = torch.empty(3)\ndist.all_to_all_single(out, torch.ones(3), [1, 2], "
                           "input_split_sizes=[1, 2] if rank == 0 else [2, 1])\n")
    assert re.search(r"rank 1 raised RuntimeError inside all_to_all_single #\d+ \(float32\[3\]\)", message), message
    assert re.search(r"the ranks disagree at collective #\d+: rank 0 calls all_to_all_single \(float32\[3\], "
                     r"input_split_sizes=\[1, 2\]\), rank 1 calls all_to_all_single \(float32\[3\], "
                     r"input_split_sizes=\[2, 1\]\); rank 1 raised an error inside it", message), message
    assert "never called" not in message


def test_a_rank_that_raised_inside_the_call_is_not_said_to_have_never_called_it(ranks):
    message = _hang(ranks, "x = torch.ones(4, dtype=torch.complex64 if rank == 1 else torch.float32)\n"
                           "dist.all_reduce(x, op=dist.ReduceOp.MAX)\n")  # torch refuses MAX on complex numbers
    assert re.search(r"rank 1 raised ValueError inside all_reduce #(\d+)", message), message
    assert re.search(r"rank 0 waits in collective #\d+, inside which rank 1 raised an error", message), message
    assert "never called" not in message


def test_a_reduce_scatter_is_named_as_called_not_as_gloo_runs_it(ranks):
    """gloo runs reduce_scatter_tensor as an all-reduce (its recorder says "gloo:all_reduce"); its stack names it."""
    message = _hang(ranks, "out = torch.empty(2)\nif rank == 0:\n    dist.reduce_scatter_tensor(out, torch.ones(4))\n")
    assert re.search(r"rank 0 waits in reduce_scatter_tensor #\d+ \(float32\[", message), message
    assert "all_reduce" not in message and "rank 1 never called it" in message


def test_a_late_rank_is_named_late(ranks):
    message = _hang(ranks, "import time\nif rank == 1:\n    time.sleep(30)\ndist.barrier()\n")
    assert re.search(r"rank 0 is alone in collective #\d+: rank 1 is late: it has not called it yet", message), message


def test_a_sub_group_is_named_by_its_ranks_and_ranks_outside_it_are_not_missing():
    with dtlib.LiveRanks(3, backend="gloo", timeout=60) as three:
        three.run("group = dist.new_group([0, 1])")
        message = _hang(three, "x = torch.ones(4)\nif rank == 0:\n    dist.all_reduce(x, group=group)\n")
        assert ("rank 0 is alone in collective #1 on group [0, 1]: rank 1 never called it (a collective under "
                "`if rank == ...`, or a rank that returned early?); rank 2 is not in that group") in message, message
        assert "undefined" not in message and "same arguments" not in message
        three.run("group = dist.new_group([0, 1])")  # the ranks restarted: a fresh group
        message = _hang(three, "x = torch.ones(4)\ndist.all_reduce(x, group=group if rank == 0 else None)\n")
        assert re.search(r"rank 0 is alone in collective #1 on group \[0, 1\]: rank 1 waits in all_reduce #\d+ "
                         r"\(float32\[4\]\) on the world group instead \(a group= left out", message), message


# -- on records shaped as the Flight Recorder dumps them ---------------------------------------------------------
def _entry(seq: int, name: str, inputs: list, outputs: list, done: bool, *, group=("0", "default_pg"),
           dtype: str = "Float", stack: tuple[str, ...] = ()) -> dict:
    """One record as torch 2.13's gloo Flight Recorder dumps it; ``stack``: its distributed_c10d frames, inner first."""
    frames = [{"name": call, "filename": C10D, "line": 1} for call in stack or (name,)]
    return {"record_id": seq - 1, "pg_id": int(group[0]), "process_group": group, "thread_name": "python",
            "thread_id": "1", "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"gloo:{name}",
            "time_created_ns": 1_000 + seq, "input_sizes": inputs, "input_dtypes": [dtype] * len(inputs),
            "output_sizes": outputs, "output_dtypes": [dtype] * len(outputs), "state": "scheduled",
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": done,
            "timeout_ms": 1800000, "is_p2p": False,
            "frames": [*frames, {"name": "<module>", "filename": "<rank cell 1>", "line": 2}]}


def _rank(*entries: dict, noted: dict | None = None, members: dict | None = None, raised: tuple | None = None,
          world_size: int = 2):
    """What a rank answers the doctor: its recorder's dump, with what it noted (None: nothing noted)."""
    dump = {"entries": list(entries), "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}}}
    return doctor.from_flight_recorder(dump, noted, {"0": tuple(range(world_size)), **(members or {})}, raised)


def test_a_different_reduce_op_is_named():
    last = {0: _rank(_entry(1, "all_reduce", [[4]], [[4]], False), noted={("0", 1): (("op", "SUM"),)}),
            1: _rank(_entry(1, "all_reduce", [[4]], [[4]], True), noted={("0", 1): (("op", "MAX"),)})}
    lines, verdict = doctor.explain({0: "running", 1: "finished"}, last)
    assert lines == ["rank 0 waits in all_reduce #1 (float32[4])", "rank 1 finished the cell after all_reduce #1 "
                     "(float32[4])"]
    assert verdict == ("the ranks disagree at collective #1: rank 0 calls all_reduce (float32[4], op=SUM), rank 1 "
                       "calls all_reduce (float32[4], op=MAX); rank 1 got past it, so what it received is wrong")


def test_a_group_built_with_other_ranks_on_each_rank_is_named():
    """``new_group`` numbers groups by creation: two ranks can hold group "1" with different members."""
    group = ("1", "undefined")
    last = {0: _rank(_entry(1, "all_reduce", [[4]], [[4]], False, group=group), members={"1": (0, 1)}),
            1: _rank(_entry(1, "all_reduce", [[4]], [[4]], False, group=group), members={"1": (1, 2)}),
            2: _rank(_entry(1, "all_reduce", [[4]], [[4]], False, group=group), members={"1": (1, 2)})}
    verdict = doctor.explain({0: "running", 1: "running", 2: "running"}, last)[1]
    assert verdict == ("the ranks disagree at collective #1 on group [0, 1]: rank 0 calls all_reduce (float32[4]) on "
                       "group [0, 1], rank 1 calls all_reduce (float32[4]) on group [1, 2]")


@pytest.mark.parametrize(("outputs", "dtype", "calls"), [
    ([[[2, 4]], [[3, 4]]], "Float", "rank 0 calls all_gather (float32[4] -> float32[2, 4]), rank 1 calls all_gather "
                                    "(float32[4] -> float32[3, 4])"),  # the inputs agree, the outputs do not
    ([[[2, 4]], [[2, 4]]], "Half", "rank 0 calls all_gather (float32[4]), rank 1 calls all_gather (float16[4])"),
])
def test_different_sizes_or_dtypes_are_named(outputs, dtype, calls):
    last = {0: _rank(_entry(1, "all_gather", [[4]], outputs[0], False)),
            1: _rank(_entry(1, "all_gather", [[4]], outputs[1], False, dtype=dtype))}
    assert doctor.explain({0: "running", 1: "running"}, last)[1] == f"the ranks disagree at collective #1: {calls}"


def test_the_same_arguments_only_when_every_field_was_recorded_and_matched():
    broadcast = _entry(1, "broadcast", [[4]], [[4]], False)
    same = {rank: _rank(broadcast, noted={("0", 1): (("src", "0"),)}) for rank in (0, 1)}
    assert doctor.explain({0: "running", 1: "running"}, same)[1].startswith(
        "every rank waits in collective #1 with the same arguments: it is stuck below Python")
    unnoted = {rank: _rank(broadcast) for rank in (0, 1)}  # e.g. a call made without the notes installed
    verdict = doctor.explain({0: "running", 1: "running"}, unnoted)[1]
    assert verdict.startswith("every rank waits in collective #1 with the same call, tensors, output sizes and group "
                              "(src was not recorded: check on every rank that it is the same)"), verdict
    assert "same arguments" not in verdict


def test_each_ranks_state_is_named_finished_raised_inside_never_called():
    waiting = _entry(3, "all_reduce", [[4]], [[4]], False)
    before = _entry(2, "all_reduce", [[4]], [[4]], True)
    noted = {("0", 2): (("op", "SUM"),), ("0", 3): (("op", "SUM"),)}
    last = {0: _rank(before, waiting, noted=noted, world_size=4),
            1: _rank(before, _entry(3, "all_reduce", [[4]], [[4]], True), noted=noted, world_size=4),  # got through
            2: _rank(before, noted=noted, raised=("all_reduce", "0", "default_pg", 3, False, "ValueError"),
                     world_size=4),
            3: _rank(before, noted=noted, world_size=4)}
    states = {0: "running", 1: "finished", 2: "failed", 3: "finished"}
    lines, verdict = doctor.explain(states, last)
    assert lines == ["rank 0 waits in all_reduce #3 (float32[4])",
                     "rank 1 finished the cell after all_reduce #3 (float32[4])",
                     "rank 2 raised ValueError inside all_reduce #3",
                     "rank 3 finished the cell after all_reduce #2 (float32[4])"]
    assert verdict.startswith("rank 0 waits in collective #3, inside which rank 2 raised an error"), verdict
    last[2], states[2] = _rank(before, waiting, noted=noted, world_size=4), "running"  # rank 2 waits too: rank 3 ...
    assert doctor.explain(states, last)[1].startswith("ranks 0 and 2 are alone in collective #3: rank 3 never called "
                                                       "it")  # ... never called it; rank 1 finished it: not missing
    last[3], states[3] = _rank(before, noted=noted, world_size=4), "failed"  # raised, but not inside the call
    assert "rank 3 raised an error before calling it" in doctor.explain(states, last)[1]


def test_profiling_names_become_the_torch_distributed_call():
    """Without a stack (NCCL's C++-only records, say), gloo's and NCCL's names are mapped to the call."""
    for profiling, call in [("nccl:_reduce_scatter_base", "reduce_scatter_tensor"), ("nccl:all_reduce_barrier",
                            "barrier"), ("nccl:_allgather_base", "all_gather_into_tensor"),
                            ("gloo:all_reduce", "all_reduce")]:
        entry = {**_entry(1, "x", [[4]], [[4]], True), "profiling_name": profiling, "frames": []}
        assert doctor.from_flight_recorder({"entries": [entry]}).op == call
    gloo_reduce_scatter = _entry(1, "all_reduce", [[2]], [[2]], True, stack=(
        "reduce_scatter_single", "reduce_scatter_tensor"))  # as torch 2.13 records it: the outermost frame is the call
    assert doctor.from_flight_recorder({"entries": [gloo_reduce_scatter]}).op == "reduce_scatter_tensor"


# -- the oracle: a real recorder, and what each rank notes beside it ---------------------------------------------
def _every_collective(rank: int, world_size: int) -> list[tuple]:
    from dtlib.live.doctor import last_collectives
    from dtlib.live.notes import CallNotes

    notes = CallNotes()
    notes.install()
    x, out, group = torch.ones(4), torch.empty(2), dist.new_group([0, 1])
    calls = [lambda: dist.all_reduce(x, op=dist.ReduceOp.MAX), lambda: dist.broadcast(x, src=1),
             lambda: dist.reduce(x, dst=1, op=dist.ReduceOp.MIN),
             lambda: dist.reduce_scatter_tensor(out, torch.ones(4)),
             lambda: dist.reduce_scatter(out, [torch.ones(2), torch.ones(2)]),
             lambda: dist.all_gather_into_tensor(torch.empty(8), x),
             lambda: dist.gather(x, [torch.empty(4), torch.empty(4)] if rank == 1 else None, dst=1),
             lambda: dist.scatter(x, [torch.ones(4), torch.ones(4)] if rank == 1 else None, src=1),
             lambda: dist.all_to_all_single(torch.empty(2 + 2 * rank), torch.ones(3), [1 + rank] * 2, [1, 2]),
             lambda: dist.barrier(), lambda: dist.all_reduce(x, group=group),
             lambda: dist.broadcast_object_list([rank], src=1)]
    seen = []
    for call in calls:
        call()
        record = last_collectives(notes.arguments, notes.members, notes.raised)
        seen.append((record.op, record.group_label() if record.group != "default_pg" else "world",
                     dict(record.arguments), record.members))
    return seen


@pytest.mark.timeout(120)
def test_a_real_recorder_and_the_ranks_notes_name_every_call_and_argument(monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    seen = dtlib.spawn(_every_collective, 2, timeout=90, output="none")
    assert [(op, group, arguments) for op, group, arguments, _ in seen[1]] == [
        ("all_reduce", "world", {"op": "MAX"}), ("broadcast", "world", {"src": "1"}),
        ("reduce", "world", {"dst": "1", "op": "MIN"}), ("reduce_scatter_tensor", "world", {"op": "SUM"}),
        ("reduce_scatter", "world", {"op": "SUM"}), ("all_gather_into_tensor", "world", {}),
        ("gather", "world", {"dst": "1"}), ("scatter", "world", {"src": "1"}),
        ("all_to_all_single", "world", {"output_split_sizes": "[2, 2]", "input_split_sizes": "[1, 2]"}),
        ("barrier", "world", {}), ("all_reduce", "[0, 1]", {"op": "SUM"}),
        ("broadcast_object_list", "world", {"src": "1"})]
    assert all(members == (0, 1) for _, _, _, members in seen[0] + seen[1])
    assert [row[:3] for row in seen[0]][8] == ("all_to_all_single", "world", {"output_split_sizes": "[1, 1]",
                                                                              "input_split_sizes": "[1, 2]"})


# -- the collective check names itself where it holds a right program up ---------------------------------------
ASYNC_THEN_SEND = ("x = torch.ones(4) * (rank + 1)\n"
                   "if rank == 0:\n"
                   "    work = dist.all_reduce(x, async_op=True)\n"
                   "    dist.send(torch.tensor([7.0]), dst=1)\n"
                   "    work.wait()\n"
                   "else:\n"
                   "    dist.recv(torch.zeros(1), src=0)\n"
                   "    dist.all_reduce(x)\n"
                   "x.tolist()\n")


def test_the_check_names_itself_and_no_check_where_it_holds_a_right_program_up(ranks, needs_the_check):
    """Rank 0 posts an async all-reduce and sends; rank 1 receives, then all-reduces: right, and it runs unchecked.
    Under the check, rank 0's all-reduce waits for rank 1 to reach it first, and rank 1 waits for the send. The
    doctor said rank 1 "still runs Python code" and nothing of the check; it now says rank 1 waits in recv, and
    that the check holds the program up, with the way to run it unchecked."""
    message = _hang(ranks, ASYNC_THEN_SEND)
    assert "rank 1 waits in a blocking recv instead, before calling it" in message, message
    assert "runs Python code" not in message, message
    assert "the collective check is what holds it up" in message and "--no-check" in message, message


@pytest.mark.timeout(120)
def test_the_same_program_runs_unchecked():
    with dtlib.LiveRanks(2, timeout=60, check_collectives=False) as unchecked:
        assert unchecked.run(ASYNC_THEN_SEND) == [[3.0] * 4, [3.0] * 4]


def test_a_hang_without_a_transfer_does_not_blame_the_check():
    """Only a rank in a collective beside one in a send or recv points at the check: a rank left alone in a
    collective by a peer that returned is its own mistake."""
    last = {0: _rank(_entry(1, "all_reduce", [[4]], [[4]], False)), 1: None}
    verdict = doctor.explain({0: "running", 1: "finished"}, last, checked=True)[1]
    assert "never called it" in verdict and "collective check" not in verdict
