"""``dtlib.LiveRanks``: values, output, push and pull, errors, hangs explained, interrupts, close.

The oracle for values is torch itself (an all-reduce's sum); for the hang doctor, the collective
each rank was made to wait in; for clean-up, the process table.
"""

from __future__ import annotations

import os
import re
import signal
import threading

import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib.live import doctor
from dtlib.live.doctor import Collective
from dtlib.live.rankview import RankValues, compare

pytestmark = pytest.mark.timeout(300)


def test_values_are_each_ranks_last_expression_and_output_is_prefixed(ranks, capsys):
    assert ranks.run("x = torch.tensor([rank + 1.0])\nprint('hello from', rank)\nx") == [
        torch.tensor([1.0]), torch.tensor([2.0])]
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert ranks.run("dist.all_reduce(x); x") == [torch.tensor([3.0])] * 2  # 1 + 2 on every rank
    assert ranks.run("y = 5") == [None, None]  # no last expression
    assert ranks.run("world_size, str(device), torch.distributed.get_rank()") == [(2, "cpu", 0), (2, "cpu", 1)]
    weights = ranks.run("torch.manual_seed(0)\nnn.Linear(3, 1).weight[0] * 1")  # a graph cannot leave a rank
    assert all(w.grad_fn is None and not w.requires_grad for w in weights) and torch.equal(*weights)


def test_torchs_own_calls_through_the_ranks_notes_are_left_alone_by_strict_mode(ranks):
    """FSDP2's unshard all-gathers through a ProcessGroup method that the live ranks' notes wrap: strict mode must
    see torch's call behind the note, not the note, or it holds the gathered weights back as NaN (05's cells did).
    Oracle: the weights FSDP2 was given, whole, on every rank."""
    gathered = ranks.run("from torch.distributed.fsdp import fully_shard\n"
                         "torch.manual_seed(0)\nlayer = nn.Linear(4, 8)\nwhole = layer.weight.detach().clone()\n"
                         "fully_shard(layer)\nlayer.unshard()\nrow = layer.weight[0].detach().clone()\n"
                         "layer.reshard()\nrow, whole[0]")
    for row, expected in gathered:
        assert torch.equal(row, expected)


def test_push_sends_values_and_functions_by_value_and_pull_returns_them_by_rank(ranks):
    offset = 7
    ranks.push(scale=10, shift=lambda v: v + offset)
    assert ranks.run("z = shift(rank * scale)\nz") == [7, 17]
    assert ranks.pull("z") == [7, 17]
    with pytest.raises(dtlib.WorkerError, match="name 'never_defined' is not defined on this rank"):
        ranks.pull("never_defined")
    with pytest.raises(ValueError, match="identifier"):
        ranks.pull("not a name")
    with pytest.raises(TypeError, match="cannot push 'lock'"):
        ranks.push(lock=threading.Lock())


def test_an_error_on_one_rank_names_it_with_its_cell_line_and_keeps_every_namespace(ranks):
    ranks.run("kept = rank * 100")
    with pytest.raises(dtlib.WorkerError) as caught:
        ranks.run("a = 1\nif rank == 1:\n    raise ValueError('bad on 1')\n")
    err = caught.value
    assert [f.rank for f in err.failures] == [1] and err.failures[0].exc_type == "ValueError"
    assert "line 3" in err.failures[0].traceback and "raise ValueError('bad on 1')" in err.failures[0].traceback
    assert "still running, with their variables" in str(err)
    assert ranks.pull("kept") == [0, 100]
    with pytest.raises(SyntaxError):  # refused here, before any rank runs it
        ranks.run("def broken(:")


def test_a_value_that_cannot_travel_comes_back_as_its_repr(ranks):
    values = ranks.run("import threading\nthreading.Lock()")
    assert all("lock" in repr(value).lower() for value in values)


def test_a_rank_zero_only_collective_is_explained_and_the_ranks_restart_with_a_fresh_group(ranks):
    ranks.run("before = 1\nt = torch.ones(4)\ndist.all_reduce(t)")  # collectives #n on both ranks
    with pytest.raises(dtlib.WorkerTimeout) as caught:
        ranks.run("if rank == 0:\n    dist.all_reduce(t)\n", timeout=3)
    message = str(caught.value)
    assert "rank 0 waits in all_reduce #" in message and "(float32[4])" in message
    assert "rank 0 is alone in collective #" in message and "rank 1 never called it" in message
    assert "variables are gone" in message
    assert "dist.all_reduce(t)" in caught.value.stacks[0]  # the cell's line, shown under its frame
    with pytest.raises(dtlib.WorkerError, match="not defined"):
        ranks.pull("before")
    assert [t.tolist() for t in ranks.run("t = torch.ones(2)\ndist.all_reduce(t)\nt")] == [[2.0, 2.0]] * 2


MISMATCHED = "if rank == 0:\n    dist.all_reduce(torch.ones(3))\nelse:\n    dist.barrier()\n"
SHORTER = "x = torch.ones(4 if rank == 0 else 3)\ndist.all_reduce(x)\n"


def test_mismatched_collectives_are_named_by_number(unchecked):
    with pytest.raises(dtlib.WorkerTimeout) as caught:
        unchecked.run(MISMATCHED, timeout=3)
    assert "the ranks disagree at collective #" in str(caught.value)
    assert "rank 0 calls all_reduce (float32[3]), rank 1 calls barrier" in str(caught.value)
    assert unchecked.run("rank") == [0, 1]


@pytest.fixture(scope="module")
def checked():
    live = dtlib.LiveRanks(2, backend="gloo", timeout=60, check_collectives=True)  # the default from torch 2.13
    try:
        yield live
    finally:
        live.close()


def test_checked_ranks_refuse_a_mismatch_before_any_data_moves(checked):
    """Each collective is compared across ranks first: a mismatch raises at once on every rank, each naming
    its own call, and the ranks keep their variables (nothing was sent)."""
    ranks = checked
    ranks.run("kept = rank + 70")
    for code, mine in ((MISMATCHED, ("all_reduce (float32[3])", "barrier")),
                       (SHORTER, ("all_reduce (float32[4])", "all_reduce (float32[3])"))):
        with pytest.raises(dtlib.WorkerError) as caught:
            ranks.run(code, timeout=10)
        for rank, call in enumerate(mine):
            assert f"rank {rank} raised RuntimeError: this rank's {call} does not match" in str(caught.value)
        assert "before any data moved" in str(caught.value) and "--no-check" in str(caught.value)
        assert ranks.pull("kept") == [70, 71]


def test_a_shorter_tensor_on_one_rank_is_named_and_its_wrong_result_said(unchecked):
    """gloo lets the rank with the shorter tensor through; the doctor compares its finished record too."""
    with pytest.raises(dtlib.WorkerTimeout) as caught:
        unchecked.run(SHORTER, timeout=3)
    assert re.search(r"the ranks disagree at collective #\d+: rank 0 calls all_reduce \(float32\[4\]\), rank 1 calls "
                     r"all_reduce \(float32\[3\]\); rank 1 got past it, so what it received is wrong",
                     str(caught.value)), str(caught.value)
    assert "with the same arguments" not in str(caught.value)


def test_a_loop_that_runs_too_long_is_interrupted_and_the_ranks_keep_their_variables(ranks):
    ranks.run("kept = rank + 40")
    with pytest.raises(dtlib.WorkerTimeout) as caught:
        ranks.run("while True:\n    pass\n", timeout=2)
    assert "no rank waits in a collective" in str(caught.value)
    assert "kept their variables" in str(caught.value)
    assert ranks.pull("kept") == [40, 41]


def test_interrupting_the_kernel_interrupts_every_rank(ranks):
    ranks.run("kept = rank + 50")
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        ranks.run("import time\nfor _ in range(600):\n    time.sleep(0.05)\n")
    timer.join()
    assert ranks.pull("kept") == [50, 51]


@pytest.mark.timeout(240)
def test_an_interrupt_while_the_doctor_asks_waits_until_the_ranks_are_restarted(monkeypatch, capsys, leftovers):
    """Ctrl-C while the hang doctor asked the ranks skipped the restart: rank 0 stayed in the timed-out cell's
    all-reduce, the next cell's all-reduce on rank 1 let it finish, and its answer, 'previous', came back as the
    next cell's value. Now the interrupt is held until the ranks are restarted, then raised."""
    from dtlib.live.generation import Generation

    ask_doctor, asked = Generation.ask_doctor, []

    def interrupted_while_asking(self):
        if not asked:  # the first question: the doctor explaining the timeout
            asked.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, through this process's own SIGINT handler
        return ask_doctor(self)

    monkeypatch.setattr(Generation, "ask_doctor", interrupted_while_asking)
    with dtlib.LiveRanks(2, backend="gloo", timeout=60) as live:
        pids = live.run("import os\nos.getpid()")
        live.run("t = torch.ones(2)")
        with pytest.raises(KeyboardInterrupt) as caught:
            live.run("x = 'previous'\nif rank == 0:\n    dist.all_reduce(t)\nx", timeout=3)
        assert asked
        assert live.run("dist.all_reduce(torch.ones(2))\n'next'", timeout=30) == ["next", "next"]
        assert isinstance(caught.value.__context__, dtlib.WorkerTimeout)  # the doctor's explanation still comes
        assert "variables are gone" in str(caught.value.__context__)
        assert "interrupted; the interrupt waited until the ranks were out of the cell" in capsys.readouterr().err
        with pytest.raises(dtlib.WorkerError, match="not defined"):
            live.pull("x")  # restarted: the timed-out cell's variables are gone on every rank
        pids += live.run("import os\nos.getpid()")
    leftovers.assert_clean(pids)


def test_a_rank_that_dies_is_reported_and_the_ranks_restart(ranks):
    ranks.run("kept = 1")
    with pytest.raises(dtlib.WorkerError) as caught:
        ranks.run("import os\nif rank == 1:\n    os._exit(3)\n")
    assert caught.value.failures[0].rank == 1 and "exited with code 3" in str(caught.value)
    assert "variables are gone" in str(caught.value)
    assert ranks.run("rank") == [0, 1]


def test_auto_gloo_live_ranks_on_a_gpu_machine_see_no_gpu(monkeypatch, leftovers):
    """As with dtlib.spawn: CPU ranks that backend="auto" chose on a machine with GPUs see none."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with dtlib.LiveRanks(2, timeout=60) as live:
        pids = live.run("import os\nos.getpid()")
        assert live.run("import os\nos.environ.get('CUDA_VISIBLE_DEVICES')") == ["", ""]
    leftovers.assert_clean(pids)


def test_close_ends_every_rank_and_leaves_nothing(leftovers):
    live = dtlib.LiveRanks(2, backend="gloo")
    pids = live.run("import os\nos.getpid()")
    with live:
        assert live.run("rank * 2") == [0, 2]
    assert live.closed
    live.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        live.run("1")
    leftovers.assert_clean(pids)


@pytest.mark.timeout(90)
def test_close_from_another_thread_stops_a_running_cell_at_once_and_leaves_nothing(leftovers):
    live = dtlib.LiveRanks(2, backend="gloo")
    pids = live.run("import os\nos.getpid()")
    closer = threading.Timer(0.5, live.close)
    closer.start()
    with pytest.raises(RuntimeError, match="closed by close\\(\\) from another thread while this run ran"):
        live.run("import time\ntime.sleep(20)\nrank")
    closer.join(timeout=30)  # a hang guard: close() returns once the call has stopped the ranks
    assert not closer.is_alive()
    assert live.closed
    with pytest.raises(RuntimeError, match="closed"):
        live.run("1")
    live.close()
    leftovers.assert_clean(pids)


def test_bad_arguments_are_refused_before_any_rank_starts(no_process_start):
    with pytest.raises(ValueError, match="world_size"):
        dtlib.LiveRanks(0)
    with pytest.raises(ValueError, match="timeout"):
        dtlib.LiveRanks(2, timeout=-1)
    with pytest.raises(ValueError, match="backend"):
        dtlib.LiveRanks(2, backend="tcp")


# -- the hang doctor's reasoning, on records made by hand ----------------------------------
def _c(call: str, seq: int, done: bool, *tensors: str, **arguments: str) -> Collective:
    """A record made by hand; ``arguments`` (``op="SUM"``) as the rank notes them, else not recorded."""
    return Collective(call, seq, "default_pg", tensors, done, arguments=tuple(arguments.items()) if arguments else None)


def _core(record: Collective | None) -> tuple | None:
    """What the Flight Recorder's own fields say: the call, its number, group, input tensors and whether it is done."""
    return None if record is None else (record.op, record.seq, record.group, record.tensors, record.done)


@pytest.mark.parametrize(("states", "last", "verdict"), [
    ({0: "running", 1: "finished"}, {0: _c("all_reduce", 3, False, "float32[4]"), 1: _c("all_reduce", 2, True)},
     "rank 0 is alone in collective #3: rank 1 never called it"),
    ({0: "running", 1: "running"}, {0: _c("all_reduce", 1, False, "float32[4]"), 1: _c("all_reduce", 1, False,
                                                                                       "float32[5]")},
     "the ranks disagree at collective #1: rank 0 calls all_reduce (float32[4]), rank 1 calls all_reduce (float32[5])"),
    ({0: "running", 1: "running"}, {0: _c("all_reduce", 4, False), 1: _c("all_reduce", 3, False)},
     "the ranks are at different collectives (collective #3, rank 0 at #4)"),
    ({0: "running", 1: "running"}, {0: None, 1: None}, "no rank waits in a collective that the Flight Recorder"),
    ({0: "running", 1: "running"}, {0: _c("barrier", 2, False), 1: _c("barrier", 2, False)},
     "every rank waits in collective #2 with the same arguments"),
    ({0: "running", 1: "running"}, {0: _c("all_reduce", 3, False, "float32[4]"), 1: _c("all_reduce", 2, True)},
     "rank 0 is alone in collective #3: rank 1 is late: it has not called it yet and still runs Python code"),
    # a shorter tensor on rank 1: gloo lets rank 1 through with wrong numbers while rank 0 waits
    ({0: "running", 1: "finished"}, {0: _c("all_reduce", 1, False, "float32[4]"),
                                     1: _c("all_reduce", 1, True, "float32[3]")},
     "the ranks disagree at collective #1: rank 0 calls all_reduce (float32[4]), rank 1 calls all_reduce "
     "(float32[3]); rank 1 got past it, so what it received is wrong"),
    ({0: "running", 1: "running"}, {0: _c("all_reduce", 1, False, "float32[4]"),
                                    1: _c("all_reduce", 1, False, "float64[4]")},
     "the ranks disagree at collective #1: rank 0 calls all_reduce (float32[4]), rank 1 calls all_reduce (float64[4])"),
    ({0: "running", 1: "running"}, {0: _c("all_reduce", 1, False, "float32[4]"),
                                    1: _c("broadcast", 1, False, "float32[4]")},
     "the ranks disagree at collective #1: rank 0 calls all_reduce (float32[4]), rank 1 calls broadcast"),
    ({0: "running", 1: "finished", 2: "running"}, {0: _c("all_reduce", 1, False, "float32[4]", op="SUM"),
                                                   1: _c("all_reduce", 1, True, "float32[4]", op="SUM"),
                                                   2: _c("all_reduce", 1, False, "float32[4]", op="SUM")},
     "ranks 0 and 2 wait in collective #1, which rank 1 finished with the same arguments"),
    # the reduce op was not noted: the doctor does not call the arguments the same, and says what it could not see
    ({0: "running", 1: "finished"}, {0: _c("all_reduce", 1, False, "float32[4]"), 1: _c("all_reduce", 1, True,
                                                                                       "float32[4]")},
     "rank 0 waits in collective #1, which rank 1 finished with the same call, tensors and group (op was not "
     "recorded: check on every rank that it is the same)"),
])
def test_the_doctor_finds_where_the_ranks_disagree(states, last, verdict):
    lines, found = doctor.explain(states, last)
    assert found.startswith(verdict), found
    assert len(lines) == len(states)


def _stack(call: str) -> str:
    """A rank's stack as faulthandler prints it, inside torch's blocking ``call``."""
    return (f'  File "/venv/torch/distributed/distributed_c10d.py", line 2753 in {call}\n'
            '  File "/venv/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
            '  File "<rank cell 1>", line 4 in <module>\n')


@pytest.mark.parametrize(("stacks", "lines", "verdict"), [
    ({0: _stack("send"), 1: _stack("send")}, ["rank 0 waits in send", "rank 1 waits in send"],
     "every running rank waits in a blocking send, and none in a recv"),
    ({0: _stack("recv"), 1: _stack("recv")}, ["rank 0 waits in recv", "rank 1 waits in recv"],
     "every running rank waits in a blocking recv, and none sends"),
    ({0: _stack("send"), 1: _stack("recv")}, ["rank 0 waits in send", "rank 1 waits in recv"],
     "the ranks wait in sends and recvs that do not pair up"),
    ({0: _stack("send"), 1: "  File \"<rank cell 1>\", line 2 in <module>\n"},  # rank 1 is in a Python loop
     ["rank 0 waits in send", "rank 1 runs Python code before any collective"],
     "no rank waits in a collective that the Flight Recorder saw"),
    ({0: _stack("sendall"), 1: _stack("recv_into")}, ["rank 0 runs Python code before any collective",
                                                      "rank 1 runs Python code before any collective"],
     "no rank waits in a collective"),  # other functions of the same prefix are not send or recv
])
def test_the_doctor_reads_a_blocked_send_or_recv_from_the_stacks(stacks, lines, verdict):
    """gloo's Flight Recorder records no point-to-point call: the stacks say where such a rank waits."""
    found_lines, found = doctor.explain({0: "running", 1: "running"}, {0: None, 1: None}, stacks)
    assert found_lines == lines
    assert found.startswith(verdict), found


def test_a_send_first_ring_on_live_ranks_is_named_by_the_doctor_and_its_fix_runs(ranks):
    send_first = ("x = torch.full((4,), float(rank), device=device)\nreceived = torch.empty_like(x)\n"
                  "dist.send(x, dst=(rank + 1) % world_size)\ndist.recv(received, src=(rank - 1) % world_size)\n")
    with pytest.raises(dtlib.WorkerTimeout) as caught:
        ranks.run(send_first, timeout=3)
    assert caught.value.collectives == ["rank 0 waits in send", "rank 1 waits in send"]
    assert "every running rank waits in a blocking send" in str(caught.value)
    both = ("x = torch.full((4,), float(rank), device=device)\nreceived = torch.empty_like(x)\n"
            "requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % world_size),\n"
            "                                   dist.P2POp(dist.irecv, received, (rank - 1) % world_size)])\n"
            "for request in requests:\n    request.wait()\nreceived.tolist()")
    assert ranks.run(both) == [[1.0] * 4, [0.0] * 4]  # each one's left-hand neighbour's


def test_a_group_is_broken_when_a_rank_is_stuck_or_the_ranks_did_different_numbers_of_collectives():
    assert doctor.group_is_broken({0: "running", 1: "finished"}, {0: None, 1: None})
    assert doctor.group_is_broken({0: "finished", 1: "finished"}, {0: _c("x", 2, True), 1: _c("x", 1, True)})
    assert not doctor.group_is_broken({0: "finished", 1: "finished"}, {0: _c("x", 2, True), 1: _c("x", 2, True)})


def test_flight_recorder_entries_become_collectives():
    dump = {"entries": [
        {"record_id": 0, "collective_seq_id": 1, "profiling_name": "gloo:all_reduce", "time_created_ns": 1,
         "input_sizes": [[4]], "input_dtypes": ["Float"], "retired": True, "process_group": ("0", "default_pg")},
        {"record_id": 1, "collective_seq_id": 2, "profiling_name": "gloo:broadcast", "time_created_ns": 2,
         "input_sizes": [[2, 3]], "input_dtypes": ["BFloat16"], "retired": False, "process_group": ("1", "tp")}]}
    assert _core(doctor.from_flight_recorder(dump)) == ("broadcast", 2, "tp", ("bfloat16[2, 3]",), False)
    assert doctor.from_flight_recorder(dump).describe() == "broadcast #2 (bfloat16[2, 3]) on group tp"
    assert _core(doctor.from_flight_recorder(dump).others[0]) == ("all_reduce", 1, "default_pg", ("float32[4]",),
                                                                   True)  # its newest on every other group
    assert doctor.from_flight_recorder({"entries": []}) is None


# -- side by side ----------------------------------------------------------------------------
def test_rank_values_line_tensors_up_and_say_whether_the_ranks_agree():
    same = RankValues([torch.tensor([1.0, 2.0])] * 2)
    assert repr(same).splitlines() == ["rank 0 │ tensor([1., 2.])", "rank 1 │ tensor([1., 2.])",
                                       "the same on every rank"]
    differ = repr(RankValues([torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])], name="g"))
    assert differ.splitlines()[1:] == ["rank 0 │ tensor([1.0, 2.0])", "rank 1 │ tensor([1.0, 2.5])",
                                       "rank 1 differs from rank 0 (by up to 0.5)"]
    assert compare([1, 1, 2]) == "rank 2 differs from rank 0 (by up to 1)"
    assert compare([0, 3, 1]) == "ranks 1, 2 differ from rank 0 (by up to 3)"
    assert compare(["a", "b"]) == "rank 1 differs from rank 0"
    assert "<table>" in RankValues([1, 2])._repr_html_()



def test_ranks_that_wait_for_a_rank_that_failed_are_explained_in_its_error(ranks):
    with pytest.raises(dtlib.WorkerError) as caught:
        ranks.run("if rank == 1:\n    raise KeyError('x')\ndist.all_reduce(torch.ones(2))\n", timeout=60)
    assert not isinstance(caught.value, dtlib.WorkerTimeout)
    assert [f.rank for f in caught.value.failures] == [1]
    assert "rank 0 waits in all_reduce #" in str(caught.value) and "rank 1 raised an error" in str(caught.value)
    assert ranks.run("rank") == [0, 1]


def test_the_live_benchmark_reports_every_row_with_its_target(tmp_path):
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "dtlib.bench", "live", "--samples", "3", "--starts", "1", "--json"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = {row["what"]: row for row in json.loads(done.stdout)}
    assert rows["ranks.run round trip"]["target_ms"] == 20.0 and rows["ranks.run round trip"]["samples"] == 3
    assert rows["%%ranks cell round trip"]["median_ms"] > 0
    assert "warm LiveRanks start and close" in rows and any(name.startswith("nbdistributed") for name in rows)


@pytest.mark.parametrize("line", ["start 0", "start -1", "start 2 --timeout -5", "start 2 --timeout 0",
                                  "start 2 --backend mpi"])
def test_a_refused_start_leaves_the_running_ranks_and_their_variables_alone(line):
    """%ranks start validates before it stops anything; the running ranks (here a stand-in) stay."""
    from IPython.core.error import UsageError
    from IPython.testing.globalipapp import get_ipython

    from dtlib.live.magics import RanksMagics

    class Running:
        closed = False

        def close(self):
            raise AssertionError("the running ranks were stopped by a start that was then refused")

    magics = RanksMagics(shell=get_ipython())
    magics.live = running = Running()
    with pytest.raises(UsageError, match="%ranks start: .*the running ranks, if any, keep going"):
        magics.ranks(line)
    assert magics.live is running


@pytest.mark.timeout(120)
def test_a_ranks_cell_error_shows_the_ranks_traceback_not_dtlibs_frames(capsys):
    """IPython hides the frames dtlib marks with __tracebackhide__: the magic, LiveRanks.run and its helpers."""
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "dtlib")
    shell.run_line_magic("ranks", "start 2 --backend gloo --timeout 30")
    try:
        capsys.readouterr()
        shell.run_cell("%%ranks\nraise ValueError(f'boom on {rank}')\n")
        shown = capsys.readouterr().out
    finally:
        shell.run_line_magic("ranks", "stop")
    assert "ValueError: boom on 1" in shown and '<rank cell' in shown
    assert "magics.py" not in shown and "def run(" not in shown
    assert shown.count("dtlib/live/ranks.py") <= 1  # the frame that raised, which IPython always shows


# -- under NCCL: the GPU's queue, and NCCL's own recorder ------------------------------------
def _nccl_entry(record_id: int, name: str, seq: int, state: str, p2p: bool = True) -> dict:
    """A record as NCCL's Flight Recorder writes it: a transfer is named with its peers, "nccl:send 0->1"."""
    return {"record_id": record_id, "time_created_ns": 100 + record_id, "profiling_name": name, "is_p2p": p2p,
            "p2p_seq_id": seq if p2p else 0, "collective_seq_id": 0 if p2p else seq, "input_sizes": [[4]],
            "input_dtypes": ["Float"], "state": state, "retired": state == "completed",
            "process_group": ("0", "default_pg")}


def _as_torchs_tests_write_it(name: str, seq: int, state: str, p2p: bool = False) -> dict:
    """A record shaped as torch's own Flight Recorder tests build one (test/distributed/flight_recorder): sequence
    numbers as strings, one dtype string for every tensor, output sizes, and no frames."""
    return {"profiling_name": f"nccl:{name}", "state": state, "process_group": ("0", "default"),
            "input_sizes": [[4, 4]], "output_sizes": [[4, 4]], "input_dtypes": "float32", "output_dtypes": "float32",
            "collective_seq_id": "0" if p2p else str(seq), "p2p_seq_id": str(seq) if p2p else "0",
            "time_created_ns": 0, "frames": [], "is_p2p": p2p}


def test_records_in_the_shape_torchs_own_tests_give_them_are_read_and_merged():
    nccl = [_as_torchs_tests_write_it("all_reduce", 1, "completed"),
            _as_torchs_tests_write_it("all_reduce", 2, "scheduled"),
            _as_torchs_tests_write_it("send 0->1", 1, "completed", p2p=True)]
    assert _core(doctor.from_flight_recorder({"entries": nccl})) == ("all_reduce", 2, "default",
                                                                     ("float32[4, 4]",), False)
    noted_send = {"process_group": ("0", "default"), "profiling_name": "send", "is_p2p": True, "p2p_seq_id": 2,
                  "collective_seq_id": 0, "input_sizes": [[4]], "input_dtypes": ["float32"], "retired": False}
    merged = doctor.merge_nccl([noted_send], nccl)
    assert merged[-1] is noted_send  # transfer #2, which NCCL never recorded, though it recorded transfer #1


def test_under_nccl_the_oldest_unfinished_record_is_where_the_rank_waits():
    """Under NCCL the CPU queues a send and a recv and runs on; the GPU is held by the send, the older one."""
    dump = {"entries": [_nccl_entry(0, "nccl:all_reduce", 1, "completed", p2p=False),
                        _nccl_entry(1, "nccl:send 0->1", 1, "scheduled"),
                        _nccl_entry(2, "nccl:recv 0<-1", 2, "scheduled")]}
    assert _core(doctor.from_flight_recorder(dump)) == ("send", 1, "default_pg", ("float32[4]",), False)
    dump["entries"][1].update(state="completed", retired=True)
    assert _core(doctor.from_flight_recorder(dump)) == ("recv", 2, "default_pg", ("float32[4]",), False)
    dump["entries"][2].update(state="completed", retired=True)
    assert doctor.from_flight_recorder(dump).describe() == "recv #2 (float32[4])"  # all done: the newest


def test_a_send_first_ring_under_nccl_is_named_from_nccls_records():
    """The CPUs wait on the GPUs (in .tolist()), not in send: the records, not the stacks, name the sends, in
    the words gloo's stacks give (notebook 02 checks that output, whichever backend runs it)."""
    last = {0: _c("send", 1, False, "float32[4]"), 1: _c("send", 1, False, "float32[4]")}
    stacks = {0: _stack("tolist"), 1: _stack("tolist")}
    lines, verdict = doctor.explain({0: "running", 1: "running"}, last, stacks)
    assert lines == ["rank 0 waits in send", "rank 1 waits in send"]
    assert verdict.startswith("every running rank waits in a blocking send, and none in a recv")
    last[1] = _c("recv", 1, False, "float32[4]")
    assert doctor.explain({0: "running", 1: "running"}, last, stacks)[1].startswith(
        "the ranks wait in sends and recvs that do not pair up")


def test_without_nccls_records_the_doctor_says_so_instead_of_a_verdict():
    last = {0: doctor.NO_NCCL_RECORD, 1: doctor.NO_NCCL_RECORD}
    lines, verdict = doctor.explain({0: "running", 1: "finished"}, last, {0: _stack("tolist")})
    assert lines == ["rank 0 runs Python code (no record of its NCCL calls)",
                     "rank 1 finished the cell (no record of its NCCL calls)"]
    assert verdict.startswith("no verdict: under NCCL") and "rank 0" in verdict
    assert doctor.explain({0: "running", 1: "running"}, last, {0: _stack("send"), 1: _stack("send")})[1].startswith(
        "every running rank waits in a blocking send")  # a CPU stuck in send is still read from its stack
    assert not doctor.group_is_broken({0: "finished", 1: "finished"}, last)


def test_a_rank_under_nccl_reads_nccls_recorder_or_says_it_has_none(monkeypatch):
    """In a rank (faked: this build has no NCCL): NCCL's dump is read beside gloo's, and its absence is said."""
    import pickle

    from torch._C import _distributed_c10d as c10d

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *a: pickle.dumps({"entries": []}), raising=False)
    monkeypatch.delattr(c10d, "_dump_nccl_trace", raising=False)
    assert doctor.last_collectives() is doctor.NO_NCCL_RECORD
    dump = {"entries": [_nccl_entry(0, "nccl:send 0->1", 1, "scheduled"), _nccl_entry(1, "nccl:recv 0<-1", 2,
                                                                                          "scheduled")]}
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *a: pickle.dumps(dump), raising=False)
    assert _core(doctor.last_collectives()) == ("send", 1, "default_pg", ("float32[4]",), False)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")  # gloo alone: NCCL's dump is not read
    assert doctor.last_collectives() is None


def _recorded(rank, world_size):
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    dist.all_reduce(torch.ones(2))
    return len(pickle.loads(_dump_fr_trace(True, False, False)).get("entries", []))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting, recorded", [(None, 1), ("0", 0)])
def test_the_flight_recorder_records_by_default_and_zero_switches_it_off(monkeypatch, setting, recorded):
    """Notebook 08's claim about torch's Flight Recorder, on this torch: no setting records; 0 does not."""
    if setting is None:
        monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    else:
        monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", setting)
    assert dtlib.spawn(_recorded, 2, timeout=45, output="none") == [recorded, recorded]


def test_a_pull_keeps_none_of_the_ranks_bytes_once_it_returns(ranks):
    """A pulled value arrives pickled; those bytes (here 2 x 40 MB) must not stay in the kernel until the next call."""
    import tracemalloc

    ranks.run("big = torch.ones(10_000_000)")  # 40 MB of float32 on each rank
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pulled = ranks.pull("big")
        kept = tracemalloc.get_traced_memory()[0] - before  # Python objects only: the tensors' storage is not traced
    finally:
        tracemalloc.stop()
    assert [value.numel() for value in pulled] == [10_000_000] * 2
    assert kept < 5_000_000, f"{kept:,} bytes of Python objects kept after the pull"
    ranks.run("del big")


DTENSORS = """from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
mesh = init_device_mesh(device.type, (world_size,))
w = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
r = distribute_tensor(torch.ones(3), mesh, [Replicate()])
"""


def test_dtensors_and_meshes_show_each_ranks_part_and_push_back_whole(ranks):
    """A DTensor as a cell's value raised '.numpy() is not supported for tensor subclasses'; pushed back after a
    pull, every rank got rank 0's shard. Now each rank's part shows, with its placement and mesh coordinate, and
    the pulled list rebuilds the same DTensor; one rank's shard alone is refused."""
    from dtlib.launch.shards import LocalMesh, LocalShard
    from dtlib.live.rankview import RankValues

    ranks.run(DTENSORS)
    shards = ranks.run("w")
    assert [type(s) for s in shards] == [LocalShard, LocalShard]
    assert [s.local.tolist() for s in shards] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert [s.coordinate for s in shards] == [(0,), (1,)] and shards[0].global_shape == (8,)
    shown = repr(RankValues(shards))
    assert "rank 1's local shard of a DTensor of shape (8,), placements (Shard(dim=0),)" in shown
    assert shown.endswith("one DTensor of shape (8,), placements (Shard(dim=0),): each rank holds its own part")
    assert repr(RankValues(ranks.run("r"))).endswith("one replicated DTensor: the same on every rank")
    meshes = ranks.run("mesh")
    assert [type(m) for m in meshes] == [LocalMesh, LocalMesh] and [m.coordinate for m in meshes] == [(0,), (1,)]
    ranks.push(again=ranks.pull("w"))
    assert ranks.run("again.full_tensor().tolist()") == [list(map(float, range(8)))] * 2
    with pytest.raises(ValueError, match=r"is rank 0's shard of a DTensor: pushed, every rank would hold"):
        ranks.push(one=shards[0])



def test_collectives_that_disagree_across_ranks_raise_naming_both_sides(leftovers):
    """A float32 all-reduce on rank 0 against an int32 one on rank 1 returned garbage with no word; live ranks
    now compare each collective's signature across ranks first (torch's DETAIL mode), unless told not to."""
    code = "t = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int32)\ndist.all_reduce(t)\nt.sum().item()"
    with dtlib.LiveRanks(2, backend="gloo", timeout=60, check_collectives=True) as live:
        pids = live.run("import os\nos.getpid()")
        with pytest.raises(dtlib.WorkerError) as caught:
            live.run(code)
        assert "rank 0 raised RuntimeError: this rank's all_reduce (float32[4]) does not match" in str(caught.value)
        assert "rank 1 raised RuntimeError: this rank's all_reduce (int32[4]) does not match" in str(caught.value)
        assert "Detected mismatch between collectives on ranks" in str(caught.value)  # torch's, in the traceback
        assert live.run("t = torch.ones(2)\ndist.all_reduce(t)\nt.tolist()") == [[2.0, 2.0]] * 2  # still alive
    leftovers.assert_clean(pids)
    with dtlib.LiveRanks(2, backend="gloo", timeout=60, check_collectives=False) as live:
        live.run(code)  # unchecked: no error, whatever rank 1 now holds
    with pytest.raises(TypeError, match="check_collectives must be True, False or None"):
        dtlib.LiveRanks(2, check_collectives="yes")


def test_a_pulled_ddp_model_says_why_it_comes_as_text_and_not_that_rank_1_differs(ranks):
    """A DDP model pickled on its rank, then failed to unpickle in the kernel ("could not be unpickled") and the
    view said rank 1 differs; it now comes as text that says what to pull instead, and the ranks' texts agree."""
    ranks.run("from torch.nn.parallel import DistributedDataParallel as DDP\nwrapped = DDP(nn.Linear(4, 2))")
    shown = repr(RankValues(ranks.pull("wrapped"), name="wrapped"))
    assert "a DistributedDataParallel holds the ranks' process group" in shown and "model.module" in shown
    assert shown.endswith("shown as text, since these values cannot leave their ranks; the texts agree")
    assert "differs" not in shown
    assert ranks.run("wrapped.module.weight.shape") == [torch.Size([2, 4])] * 2  # what to pull instead travels


def test_under_detail_on_nccl_nccls_own_records_decide_where_a_rank_waits():
    """DETAIL's wrapper marks a call done when NCCL queues it: the notes say all_reduce #3 finished while NCCL's
    record of it is still scheduled, and DDP's reducer issued #4 from C++, which only NCCL recorded."""
    noted = [{"process_group": ("0", "default_pg"), "profiling_name": "allreduce", "collective_seq_id": 3,
              "time_created_ns": 150, "input_sizes": [[4]], "input_dtypes": ["float32"], "retired": True}]
    nccl = [_nccl_entry(0, "nccl:all_reduce", 2, "completed", p2p=False),
            _nccl_entry(1, "nccl:all_reduce", 3, "scheduled", p2p=False),
            _nccl_entry(2, "nccl:all_reduce", 4, "scheduled", p2p=False)]
    merged = doctor.merge_nccl(noted, nccl)
    assert merged == nccl  # every call NCCL recorded: its record, not the note that said "done"
    assert _core(doctor.from_flight_recorder({"entries": merged})) == ("all_reduce", 3, "default_pg",
                                                                        ("float32[4]",), False)
    raised_early = {**noted[0], "collective_seq_id": 5, "time_created_ns": 900}  # never reached NCCL
    assert doctor.merge_nccl([raised_early], nccl)[-1] is raised_early


def test_a_plain_cell_skips_the_parser_and_means_what_the_parser_would_give_it():
    """A cell without options skips argparse (a tenth of a plain cell's round trip): what it stands for must be
    what parsing an empty line gives, or an option's default would differ between ``%%ranks`` and
    ``%%ranks --timeout 30``'s neighbours."""
    from dtlib.live import magics

    assert vars(magics._cell_parser().parse_args([])) == vars(magics._PLAIN_CELL)
    assert magics._cell_parser() is magics._cell_parser()  # built once
