"""Stepping live ranks collective by collective (``run(code, step=True)``, ``%%ranks --step``).

The oracle for what runs is the same cell run without stepping: stepping must end in the same values. The
oracle for what each rank calls is the code itself: each kind of collective is named as the cell calls it.
"""

from __future__ import annotations

import re

import pytest

from dtlib.errors import WorkerError, WorkerTimeout
from dtlib.live.server import RemoteRepr
from dtlib.live.stepper import Call
from dtlib.live.stepping import RankStep, StepView, disagreements, will_wait

pytestmark = pytest.mark.timeout(120)

TWO_CALLS = """
before = rank
x = torch.tensor([rank + 1.0] * 4)
dist.all_reduce(x)
y = x * (rank + 1)
dist.broadcast(y, src=1)
y.sum()
"""


def _drive(ranks, view):
    while not view.finished:
        view = ranks.step()
    return view


def test_a_stepped_cell_pauses_before_each_collective_and_ends_with_the_values_of_a_plain_run(ranks):
    plain = ranks.run(TWO_CALLS)
    view = ranks.run(TWO_CALLS, step=True)
    assert ranks.paused
    assert view.states() == {0: "paused before all_reduce #1 (SUM, float32[4])",
                             1: "paused before all_reduce #1 (SUM, float32[4])"}
    assert [row.call.line.split(":")[1] for row in view.rows.values()] == ["4", "4"]
    assert all(row.call.source == "dist.all_reduce(x)" for row in view.rows.values())
    assert "the ranks agree" in repr(view) and "&lt;rank cell" in view._repr_html_()
    assert [t.tolist() for t in ranks.peek("x")] == [[1.0] * 4, [2.0] * 4]  # nothing sent yet
    view = ranks.step()
    assert view.states()[0] == "paused before broadcast #2 (src=1, float32[4])"
    assert [t.tolist() for t in ranks.peek("x")] == [[3.0] * 4, [3.0] * 4]  # the all-reduce ran
    assert _drive(ranks, view).values == plain
    assert not ranks.paused


def test_one_rank_stepped_alone_waits_inside_its_collective_for_the_rank_still_paused(ranks):
    ranks.run(TWO_CALLS, step=True)
    view = ranks.step(rank=1)  # returns at once: rank 1 cannot finish the all-reduce without rank 0
    assert view.states() == {0: "paused before all_reduce #1 (SUM, float32[4])",
                             1: "waits in all_reduce #1 (SUM, float32[4]) for rank 0, still paused before it"}
    assert ranks.peek("before")[0] == 0 and isinstance(ranks.peek("before")[1], RemoteRepr)
    with pytest.raises(RuntimeError, match="nothing to step: rank 1 waits in all_reduce #1"):
        ranks.step(rank=1)
    view = ranks.step(rank=0)  # both now in the all-reduce: it runs, and both pause before the broadcast
    assert set(view.states().values()) == {"paused before broadcast #2 (src=1, float32[4])"}
    assert ranks.resume() == ranks.run(TWO_CALLS)


@pytest.mark.parametrize(("cell", "problem"), [
    ("dist.all_reduce(torch.ones(3 + rank))", "different tensors: rank 0 calls all_reduce #1 (SUM, float32[3]), "
                                              "rank 1 calls all_reduce #1 (SUM, float32[4])"),
    ("dist.broadcast(torch.ones(2), src=rank)", "different roots: rank 0 calls broadcast #1 (src=0, float32[2])"),
    ("dist.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM)", "different reduce ops"),
    ("dist.all_reduce(torch.ones(2)) if rank else dist.broadcast(torch.ones(2), src=0)", "different operations"),
    ("if rank == 0:\n    dist.all_reduce(torch.ones(2))",
     "rank 0 will wait for ever in all_reduce #1 (SUM, float32[2]): rank 1 has finished the cell"),
    ("if rank == 0:\n    dist.send(torch.ones(2), 1)\nelse:\n    dist.all_reduce(torch.ones(2))",
     "rank 0's send #1 (dst=1, float32[2]) is not matched: rank 1 calls all_reduce #1"),
    ("dist.send(torch.ones(2), 1 - rank)", "ranks 0 and 1 both send to each other before either receives: a deadlock"),
    ("if rank == 0:\n    dist.send(torch.ones(2), 1)\nelse:\n    dist.recv(torch.ones(3), 0)",
     "rank 0's send #1 (dst=1, float32[2]) and rank 1's recv #1 (src=0, float32[3]) move different tensors"),
])
def test_a_disagreement_is_named_before_anything_is_sent_and_abort_keeps_the_variables(ranks, cell, problem):
    view = ranks.run("kept = rank * 7\n" + cell, step=True)
    assert any(problem in line for line in view.problems), view.problems
    assert repr(view).splitlines()[-1].startswith("before anything is sent: ")
    said = ranks.abort()
    assert not ranks.paused
    assert ranks.run("kept") == [0, 7], said  # nothing ran, so nothing was lost


@pytest.mark.parametrize(("cell", "first"), [
    ("dist.all_reduce(torch.ones(2))", "all_reduce #1"),
    ("dist.barrier()", "barrier #1"),
    ("t = torch.ones(2)\nif rank == 0:\n    dist.send(t, 1)\nelse:\n    dist.recv(t, 0)", ("send #1", "recv #1")),
    ("t = torch.ones(2)\nw = dist.isend(t, 1) if rank == 0 else dist.irecv(t, 0)\nw.wait()", ("isend #1", "irecv #1")),
    ("t = torch.ones(2)\nop = dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, 1 - rank)\n"
     "[w.wait() for w in dist.batch_isend_irecv([op])]", ("isend #1", "irecv #1")),
    ("from torch.distributed._functional_collectives import all_reduce as fr\n"
     "fr(torch.ones(2), 'sum', dist.group.WORLD)", "all_reduce (functional) #1"),
    ("m = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))", "all_gather #1"),
    ("from torch.distributed.tensor import init_device_mesh, distribute_tensor, Shard\n"
     "d = distribute_tensor(torch.arange(4.0), init_device_mesh('cpu', (2,)), [Shard(0)])", "scatter #1"),
])
def test_each_kind_of_collective_is_seen_as_the_cell_called_it(ranks, cell, first):
    view = ranks.run(cell, step=True)
    expected = (first, first) if isinstance(first, str) else first
    for rank, want in enumerate(expected):
        assert view.states()[rank].startswith(f"paused before {want}"), view.states()
    assert ranks.resume() is not None and not ranks.paused


def test_ddp_fsdp_and_dtensor_collectives_are_seen_inside_torch_with_the_frame_that_issued_them(ranks):
    ranks.run("torch.manual_seed(0)\nddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))")
    view = ranks.run("ddp(torch.randn(3, 4)).sum().backward()", step=True)  # DDP's one bucket, in backward
    assert view.states()[0] == "paused before all_reduce #1 (SUM, float32[10])"
    assert "autograd" in view.rows[0].call.issuer
    ranks.resume()
    ranks.run("from torch.distributed.fsdp import fully_shard\n"
              "fsdp = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))\n"
              "[fully_shard(layer) for layer in fsdp]\nfsdp = fully_shard(fsdp)")
    view = ranks.run("fsdp(torch.randn(2, 4)).sum().backward()", step=True)
    calls = [view.rows[0].call]
    while not view.finished:
        view = ranks.step()
        if not view.finished:
            calls.append(view.rows[0].call)
    ops = [call.op for call in calls]  # torch 2.13's FSDP2 calls all_gather_single and reduce_scatter_single
    assert [op.startswith("all_gather") for op in ops] == [True] * 4 + [False] * 2, ops  # forward, then backward's
    assert [op.startswith("reduce_scatter") for op in ops] == [False] * 4 + [True] * 2, ops  # one of each a layer
    assert all("fsdp" in call.issuer for call in calls), [call.issuer for call in calls]
    view = ranks.run("from torch.distributed.tensor import init_device_mesh, distribute_tensor, Shard\n"
                     "d = distribute_tensor(torch.arange(4.0), init_device_mesh('cpu', (2,)), [Shard(0)])\n"
                     "d.full_tensor()", step=True)
    view = ranks.step()
    assert view.states()[0].startswith("paused before all_gather_into_tensor (functional) #2")
    assert view.rows[0].call.source == "d.full_tensor()"
    assert [t.tolist() for t in ranks.resume()] == [[0.0, 1.0, 2.0, 3.0]] * 2


def test_bad_input_while_stepping_gets_a_clear_message_and_leaves_no_rank_blocked(ranks):
    with pytest.raises(RuntimeError, match="nothing is paused, so there is nothing to step"):
        ranks.step()
    with pytest.raises(RuntimeError, match="nothing is paused"):
        ranks.peek("rank")
    with pytest.raises(RuntimeError, match="nothing is paused"):
        ranks.abort()
    ranks.run(TWO_CALLS, step=True)
    with pytest.raises(ValueError, match="peek takes an expression"):
        ranks.peek("z = 1")
    with pytest.raises(RuntimeError, match="a stepped cell is paused on the ranks"):
        ranks.run("1")
    with pytest.raises(RuntimeError, match="a stepped cell is paused on the ranks"):
        ranks.push(a=1)
    with pytest.raises(ValueError, match="rank must be one of 0..1"):
        ranks.step(rank=5)
    with pytest.raises(ValueError):
        ranks.step(0)
    assert isinstance(ranks.peek("dist.group.WORLD")[0], RemoteRepr)  # cannot travel: its repr comes
    with pytest.raises(WorkerError, match="NameError"):
        ranks.peek("no_such_name")
    assert ranks.pull("before") == [0, 1]  # pull works while paused
    assert ranks.resume() == ranks.run(TWO_CALLS)


def test_peek_reads_a_functions_locals_and_gives_a_dtensor_as_each_ranks_shard(ranks):
    """The paused frame is the innermost one of the cell: a function's locals are there; a DTensor comes back as
    the rank's LocalShard, as pull gives it."""
    from dtlib.launch.shards import LocalShard

    ranks.run("def scaled(t):\n    inside = t * 10\n    dist.all_reduce(inside)\n    return inside\n"
              "scaled(torch.ones(2) * (rank + 1))", step=True)
    assert [t.tolist() for t in ranks.peek("inside")] == [[10.0, 10.0], [20.0, 20.0]]
    assert [t.tolist() for t in ranks.resume()] == [[30.0, 30.0], [30.0, 30.0]]
    ranks.run("from torch.distributed.device_mesh import init_device_mesh\n"
              "from torch.distributed.tensor import Shard, distribute_tensor\n"
              "mesh = init_device_mesh('cpu', (world_size,))\n"
              "d = distribute_tensor(torch.arange(4.0).reshape(4, 1), mesh, [Shard(0)])")
    ranks.run("dist.barrier()", step=True)
    shards = ranks.peek("d")
    assert all(isinstance(shard, LocalShard) for shard in shards), shards
    assert [shard.local.flatten().tolist() for shard in shards] == [[0.0, 1.0], [2.0, 3.0]]
    ranks.resume()


def test_a_dtype_alone_differing_is_named_before_anything_is_sent(ranks):
    view = ranks.run("dist.all_reduce(torch.ones(2, dtype=torch.float64 if rank else torch.float32))", step=True)
    assert any("different tensors" in problem and "float32[2]" in problem and "float64[2]" in problem
               for problem in view.problems), view.problems
    ranks.abort()


def test_a_rank_that_raises_while_its_peer_is_paused_is_shown_and_abort_restarts_the_waiting_one(ranks):
    view = ranks.run("if rank == 1:\n    raise ValueError('boom')\ndist.all_reduce(torch.ones(1))", step=True)
    assert view.states()[1] == "raised ValueError: boom"
    assert "rank 0 will wait for ever in all_reduce #1 (SUM, float32[1]): rank 1 raised ValueError: boom" in \
        view.problems
    view = ranks.step()
    assert view.states()[0].startswith("waits in all_reduce #1 (SUM, float32[1]) for rank 1, which raised")
    assert "rank 0 waited inside a collective" in ranks.abort()
    assert ranks.run("rank") == [0, 1]  # restarted, and usable


def test_many_collectives_step_k_at_a_time_and_continue_to_the_end_saying_how_many_ran_unseen(unchecked):
    """The issue's cell of 10,000 collectives: continue finishes it, and says how many ran after the pause.
    Without the collective check: under it each all-reduce of gloo costs about 2.8 ms here (10,000 take 28 s,
    stepped or not), without it 0.2 ms."""
    cell = "for i in range(10_000):\n    dist.all_reduce(torch.ones(1))\n'done'"
    unchecked.run(cell, step=True)
    assert unchecked.step(5).states()[0] == "paused before all_reduce #6 (SUM, float32[1])"
    view = unchecked._resumed(None)
    assert view.values == ["done", "done"]
    assert view.note == ("every rank finished the cell: 9,995 more collectives each after the pause, 10,000 "
                         "collectives in all")
    assert view.states()[1] == "finished the cell after 10,000 collectives"
    unchecked.run(cell, step=True)
    assert unchecked.resume() == ["done", "done"]  # resume() gives the values alone, as a plain run does


def _call(op, members=(0, 1), tensors=("float32[4]",), root=None, transfer="", group="0"):
    return Call(1, op, group, members, tensors, root, "src" if root is not None else "", "", "", "", "", "",
                transfer)


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("transfer", ["send", "recv"])
def test_a_ring_of_blocking_transfers_is_named_once_as_a_deadlock(world_size, transfer):
    """Each rank sends to the next (or receives from the previous) with a blocking call: on gloo it hangs (each
    send waits for its receive, checked with dtlib.spawn), and it is one deadlock, not one unmatched call per rank."""
    step = 1 if transfer == "send" else -1
    rows = {rank: RankStep(rank, "paused", _call(transfer, members=tuple(range(world_size)),
                                                 root=(rank + step) % world_size, transfer=transfer))
            for rank in range(world_size)}
    problems = disagreements(rows)
    first, then = ("send", "receive") if transfer == "send" else ("receive", "send")
    ranks = ", ".join(map(str, range(world_size)))
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"ranks {ranks} each {first} before they {then}, in a ring: a deadlock"), problems
    assert "dist.batch_isend_irecv" in problems[0] and problems[0].count(f"{transfer} #1") == world_size
    rows[0] = RankStep(0, "paused", _call("i" + transfer, members=tuple(range(world_size)), root=step % world_size,
                                          transfer=transfer))
    assert not any("a deadlock" in problem for problem in disagreements(rows))  # a posted isend breaks the ring


def test_a_transfer_whose_ends_differ_in_shape_alone_is_no_disagreement():
    """A 0-d tensor sent into a buffer of one element moves the same bytes as the same dtype (torch 2.11's pipeline
    schedules do it); another element count or dtype is named."""
    def pair(sent, received):
        return disagreements({0: RankStep(0, "paused", _call("send", root=1, transfer="send", tensors=(sent,))),
                              1: RankStep(1, "paused", _call("recv", root=0, transfer="recv", tensors=(received,)))})

    assert pair("float32[]", "float32[1]") == [] and pair("float32[2, 3]", "float32[6]") == []
    assert "move different tensors" in pair("float32[2]", "float32[3]")[0]
    assert "move different tensors" in pair("float32[2]", "float64[2]")[0]


def test_will_wait_knows_which_stepped_ranks_block_before_any_rank_moves():
    rows = {0: RankStep(0, "paused", _call("all_reduce")), 1: RankStep(1, "paused", _call("all_reduce")),
            2: RankStep(2, "paused", _call("all_reduce", members=(0, 1, 2)))}
    assert will_wait(rows, {0, 1}) == {}  # a 2-rank group, both moving
    rows[1] = RankStep(1, "paused", _call("all_reduce", members=(0, 1, 2)))
    rows[0] = RankStep(0, "paused", _call("all_reduce", members=(0, 1, 2)))
    assert will_wait(rows, {0, 1}) == {0: (2,), 1: (2,)}
    assert will_wait(rows, {0, 1, 2}) == {}
    send, recv = _call("send", root=1, transfer="send"), _call("recv", root=0, transfer="recv")
    assert will_wait({0: RankStep(0, "paused", send), 1: RankStep(1, "paused", recv)}, {0}) == {0: (1,)}
    assert will_wait({0: RankStep(0, "paused", send), 1: RankStep(1, "waiting", recv)}, {0}) == {}
    isend = _call("isend", root=1, transfer="send")
    assert will_wait({0: RankStep(0, "paused", isend), 1: RankStep(1, "paused", recv)}, {0}) == {}
    late = Call(1, "all_reduce", "0", (0, 1), ("float32[2]",), async_op=True)  # async_op=True returns at once
    assert will_wait({0: RankStep(0, "paused", late), 1: RankStep(1, "paused", _call("barrier"))}, {0}) == {}
    differ = {0: RankStep(0, "paused", _call("barrier")), 1: RankStep(1, "paused", _call("all_reduce"))}
    assert will_wait(differ, {0, 1}) == {0: (1,), 1: (0,)}  # unchecked: a deadlock
    assert will_wait(differ, {0, 1}, checked=True) == {}  # checked: both raise at once, nobody waits
    assert will_wait(differ, {0}, checked=True) == {0: (1,)}  # the peer stays paused: a wait, checked or not


def test_an_all_to_all_whose_split_sizes_do_not_pair_up_is_named():
    """What rank r expects from rank j must be what j sends to r: splits differ by rank by design, but must pair up
    (a mismatch returned wrong numbers with no error, checked or not)."""
    def row(rank, out, into):
        return RankStep(rank, "paused", Call(1, "all_to_all_single", "0", (0, 1), ("float32[4]", "float32[4]"),
                                             splits=f"splits out {out} in {into}", kind="c10d.alltoall_base_"))

    assert disagreements({0: row(0, [1, 3], [1, 3]), 1: row(1, [3, 1], [3, 1])}) == []  # pairs up
    (problem,) = disagreements({0: row(0, [1, 3], [2, 2]), 1: row(1, [2, 2], [3, 1])})
    assert problem.endswith("split sizes that do not pair up: rank 0 expects 1 from rank 0 (output_split_sizes[0]), "
                            "and rank 0 sends it 2 (input_split_sizes[0])"), problem


def test_a_difference_in_the_fourth_tensor_is_shown_whole():
    """The table cuts a call's tensors after three; a disagreement on them names every one, or the one that
    differs would hide behind the '…'."""
    rows = {rank: RankStep(rank, "paused", Call(1, "all_gather", "0", (0, 1),
                                                 ("float32[2]",) * 3 + (f"float32[{2 + rank}]",)))
            for rank in (0, 1)}
    (problem,) = disagreements(rows)
    assert "float32[2], float32[2], float32[2], float32[3]" in problem and "…" not in problem, problem


def test_disagreements_name_ranks_in_other_groups_and_calls_that_differ():
    rows = {0: RankStep(0, "paused", _call("all_reduce", group="1")), 1: RankStep(1, "paused", _call("all_reduce"))}
    rows[0] = RankStep(0, "paused", _call("all_reduce", group="1", members=(0, 1)))
    problems = disagreements(rows)
    assert problems and "will wait for ever" in problems[0]
    same = {r: RankStep(r, "paused", _call("all_reduce")) for r in (0, 1)}
    assert disagreements(same) == [] and StepView(same).finished is False
    done = {r: RankStep(r, "finished", value=r) for r in (0, 1)}
    assert StepView(done).values == [0, 1] and repr(StepView(done)).endswith("every rank finished the cell")


def test_the_magics_step_peek_continue_and_abort_from_cells(capsys):
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "dtlib")
    capsys.readouterr()
    shell.run_cell("%%ranks --step\n" + TWO_CALLS)  # before any ranks: said, not raised from inside dtlib
    assert "no live ranks: start them first with %ranks start 2" in capsys.readouterr().err
    shell.run_line_magic("ranks", "start 2 --backend gloo --timeout 30")
    try:
        capsys.readouterr()
        shell.run_cell("%%ranks --step\n" + TWO_CALLS)
        shown = capsys.readouterr().out
        assert "rank 1  paused before all_reduce #1 (SUM, float32[4])" in shown and "the ranks agree" in shown
        shell.run_cell("%ranks peek x.sum() * 10")
        assert "40" in capsys.readouterr().out  # rank 1's x is [2, 2, 2, 2]
        shell.run_cell("%ranks step --rank 0")
        assert "rank 0  waits in all_reduce #1 (SUM, float32[4]) for rank 1, still paused before it" in \
            capsys.readouterr().out
        shell.run_cell("%ranks step 2")
        assert "every rank finished the cell" in capsys.readouterr().out
        shell.run_cell("%%ranks --step\n" + TWO_CALLS)
        shell.run_cell("%ranks continue")
        assert "tensor(24.)" in capsys.readouterr().out
        shell.run_cell("%ranks abort")
        assert "nothing is paused; run a cell with %%ranks --step first" in capsys.readouterr().err
        shell.run_cell("%%ranks --step\n" + TWO_CALLS)
        shell.run_cell("%ranks abort")
        assert "aborted the cell on every rank; the ranks keep their variables" in capsys.readouterr().out
        shell.run_cell("%ranks peek")
        assert "give an expression" in capsys.readouterr().err
        shell.run_cell("%%ranks --trace two\n" + TWO_CALLS)
        assert "#2 broadcast (src=1, float32[4]), line 6" in capsys.readouterr().out
        shell.run_cell("traces = %ranks traces")
        assert [call.op for call in shell.user_ns["traces"]["two"].calls[1]] == ["all_reduce", "broadcast"]
    finally:
        shell.run_line_magic("ranks", "stop")


def test_closing_ranks_paused_or_waiting_inside_a_collective_leaves_no_process(leftovers):
    import dtlib

    live = dtlib.LiveRanks(2, backend="gloo", timeout=30)
    pids = live.run("import os\nos.getpid()")
    live.run(TWO_CALLS, step=True)
    live.step(rank=1)  # rank 1 now blocks inside gloo, where no command reaches it
    live.close()
    assert live.closed and not live.paused
    leftovers.assert_clean(pids)


def test_where_shows_each_ranks_state_and_stack_even_inside_a_collective(ranks):
    assert ranks.where() == {0: "idle, between cells", 1: "idle, between cells"}
    ranks.run(TWO_CALLS, step=True)
    ranks.step(rank=1)
    where = ranks.where()
    assert where[0].startswith("paused before all_reduce #1") and where[1].startswith("waits in all_reduce #1")
    for said in where.values():  # the cell's line, then torch's call: the rank blocked in gloo answered too
        assert '"<rank cell' in said and "dist.all_reduce(x)" in said and "distributed_c10d.py" in said, said
        assert "dtlib/live" not in said and "strict.py" not in said
    ranks.step(rank=0)
    assert ranks.resume() == ranks.run(TWO_CALLS)


def test_trace_lists_every_collective_in_order_and_the_figure_draws_one_box_each(ranks):
    from dtlib import plots

    trace = ranks.trace(TWO_CALLS)
    assert trace.lines() == ["#1 all_reduce (SUM, float32[4]), line 4", "#2 broadcast (src=1, float32[4]), line 6"]
    assert trace.values == ranks.run(TWO_CALLS)
    figure = plots.collective_order({"rank 0": trace.calls[0], "rank 1": trace.calls[1]})
    boxes = [patch for patch in figure.axes[0].patches if type(patch).__name__ == "Rectangle"]
    assert len(boxes) == 4 and {text.get_text() for text in figure.axes[0].texts} >= {"AR", "BC", "4"}
    with pytest.raises(RuntimeError, match="the trace stopped before anything was sent: .*different tensors"):
        ranks.trace("kept = 1\ndist.all_reduce(torch.ones(1 + rank))")
    assert ranks.run("kept") == [1, 1] and not ranks.paused


def test_a_pause_is_not_a_hang_but_a_hang_after_continue_still_is(leftovers):
    import time

    import dtlib
    from dtlib.errors import WorkerTimeout

    with dtlib.LiveRanks(2, backend="gloo", timeout=2) as live:
        pids = live.run("import os\nos.getpid()")
        live.run("dist.all_reduce(torch.ones(1))\nif rank == 0:\n    dist.barrier()", step=True)
        time.sleep(3)  # longer than the timeout, paused: nothing runs, so nothing times out
        view = live.step()
        assert view.states() == {0: "paused before barrier #2", 1: "finished the cell after 1 collective"}
        assert view.problems == ["rank 0 will wait for ever in barrier #2: rank 1 has finished the cell"]
        with pytest.raises(WorkerTimeout, match="barrier"):
            live.resume()  # run on, rank 0 waits in the barrier for rank 1, which finished: a hang
        assert not live.paused and live.run("rank") == [0, 1]  # restarted, usable
        pids += live.run("import os\nos.getpid()")
    leftovers.assert_clean(pids)


@pytest.mark.parametrize("world_size", [1, 8])
def test_stepping_one_rank_alone_and_eight_ranks(world_size):
    import dtlib

    with dtlib.LiveRanks(world_size, backend="gloo", timeout=120) as live:
        view = live.run("x = torch.ones(2) * rank\ndist.all_reduce(x)\nx.sum()", step=True)
        assert set(view.states().values()) == {"paused before all_reduce #1 (SUM, float32[2])"}
        assert len(view.rows) == world_size
        if world_size > 1:
            assert live.step(rank=world_size - 1).states()[world_size - 1] == (
                "waits in all_reduce #1 (SUM, float32[2]) for ranks 0, 1, 2, 3, 4, 5, 6, still paused before it")
        assert live.resume() == [float(sum(range(world_size)) * 2)] * world_size


def test_what_is_right_is_not_called_a_disagreement(ranks):
    """An uneven all-to-all (splits differ by rank, as they must), and the old and new names of one collective."""
    uneven = ("inputs = torch.arange(3.0) + 10 * rank\nsplit_in = [1, 2] if rank == 0 else [2, 1]\n"
              "out = torch.empty(3)\ndist.all_to_all_single(out, inputs, split_in, split_in)\nout")
    trace = ranks.trace(uneven)
    assert [call.op for call in trace.calls[0]] == ["all_to_all_single"]
    assert [t.tolist() for t in trace.values] == [[0.0, 10.0, 11.0], [1.0, 2.0, 12.0]]
    names = ("out = torch.empty(4)\nif rank == 0:\n    dist.all_gather_into_tensor(out, torch.ones(2))\n"
             "else:\n    dist.all_gather_single(out, torch.ones(2))\nout.sum()")
    view = ranks.run(names, step=True)
    assert view.problems == [], view.problems
    assert ranks.resume() == ranks.run(names)


def test_a_dtensor_op_that_redistributes_inside_its_handler_is_paused_before_and_peek_refuses_it(ranks):
    """Adding a row-sharded DTensor to a column-sharded one redistributes inside DTensor's op handler, below the
    cell's line; the stepper must see that collective as it sees a ``full_tensor()``, and peek must not run it."""
    ranks.run("from torch.distributed.tensor import init_device_mesh, distribute_tensor, Shard\n"
              "mesh = init_device_mesh('cpu', (2,))\n"
              "rows = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])\n"
              "cols = distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])")
    view = ranks.run("total = rows + cols\ntotal.full_tensor().sum().item()", step=True)
    assert view.rows[0].call.source == "total = rows + cols", view
    assert view.states()[0].startswith("paused before all_"), view.states()
    with pytest.raises(WorkerError, match="peek only looks"):
        ranks.peek("(rows + cols).to_local()")
    assert ranks.resume() == [32.0, 32.0]


def test_peek_sends_nothing_and_where_marks_a_paused_rank(ranks):
    ranks.run(TWO_CALLS, step=True)
    with pytest.raises(WorkerError, match="peek only looks: all_reduce is a collective"):
        ranks.peek("dist.all_reduce(torch.ones(1))")
    assert "(paused by %ranks --step before this call runs)" in ranks.where()[0]
    assert ranks.resume() == ranks.run(TWO_CALLS)


def test_a_peer_busy_on_another_group_is_a_wait_and_a_cycle_of_groups_is_a_deadlock():
    rows = {0: RankStep(0, "paused", _call("all_reduce", members=(0, 1), group="1")),
            1: RankStep(1, "paused", _call("all_reduce", members=(1, 2), group="2")),
            2: RankStep(2, "paused", _call("all_reduce", members=(1, 2), group="2"))}
    assert disagreements(rows) == []  # rank 1 finishes group 2's call with rank 2, then comes to group 1's
    rows[2] = RankStep(2, "paused", _call("all_reduce", members=(0, 2), group="3"))
    rows[0] = RankStep(0, "paused", _call("all_reduce", members=(0, 1), group="1"))
    cycle = disagreements(rows)  # 0 waits for 1 (group 1), 1 for 2 (group 2), 2 for 0 (group 3)
    assert cycle and all("will wait for ever" in problem for problem in cycle), cycle


def test_a_pipeline_schedules_sends_and_receives_are_seen_too(ranks):
    trace = ranks.trace(
        "from torch.distributed.pipelining import PipelineStage, ScheduleGPipe\n"
        "torch.manual_seed(0)\n"
        "stage = PipelineStage(nn.Linear(4, 4), rank, world_size, device)\n"
        "schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, target: ((out - target) ** 2).mean())\n"
        "losses = []\n"
        "schedule.step(torch.randn(4, 4)) if rank == 0 else schedule.step(target=torch.randn(4, 4), losses=losses)\n"
        "len(losses)")
    sent = [call.tensors for call in trace.calls[0] if call.op == "isend"]
    # each micro-batch's activations, to rank 1 (torch 2.11's schedule first exchanges a 0-d tensor, a handshake
    # whose ends differ in shape alone, and infers the shapes by object lists)
    assert sent.count(("float32[2, 4]",)) == 2 and set(sent) <= {("float32[2, 4]",), ("float32[]",)}, sent
    assert all("pipelining" in call.issuer for call in trace.calls[0])
    assert trace.values == [0, 2]  # the last stage holds the two micro-batches' losses


def test_an_interrupt_while_a_step_waits_ends_the_cell_as_a_plain_cells_does(capsys):
    """Ctrl-C while a step waits for ranks spinning in Python: they are interrupted and keep their variables, as
    in a plain cell; while continue waits and a rank is inside a collective, nothing reaches it: a restart."""
    import os
    import signal
    import threading

    import dtlib

    with dtlib.LiveRanks(2, backend="gloo", timeout=60) as live:
        live.run("kept = rank + 100")
        for cell, end, said in [
            ("dist.all_reduce(torch.ones(1))\nwhile True:\n    pass", live.step, "kept their variables"),
            ("dist.all_reduce(torch.ones(1))\nif rank == 1:\n    while True:\n        pass\n"
             "dist.all_reduce(torch.ones(1))", live.resume, "restarted"),
        ]:
            live.run(cell, step=True)
            timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                end()  # both ranks, or rank 1, spin: the step or continue waits until the Ctrl-C
            timer.join()
            err = capsys.readouterr().err
            assert "interrupted while stepping" in err and said in err, err
            assert not live.paused and live.run("rank") == [0, 1]
        assert live.run("'kept' in globals()") == [False, False]  # the restart took them


def test_a_step_into_calls_the_check_refuses_ends_the_cell_with_its_error_and_keeps_the_variables(
        ranks, needs_the_check):
    """Under the collective check, ranks stepped into different collectives of one group raise at once: the step
    waits for their errors instead of calling them a deadlock, and the ranks keep their variables."""
    view = ranks.run("kept = rank + 100\nif rank == 0:\n    dist.barrier()\nelse:\n    dist.all_reduce(torch.ones(1))",
                     step=True)
    assert "the collective check would raise on every rank of the group" in repr(view)
    with pytest.raises(WorkerError, match="does not match") as caught:
        ranks.step()
    assert "the stepped cell ended; the ranks keep their variables" in str(caught.value)
    assert not ranks.paused and ranks.run("kept") == [100, 101]


def test_a_cell_that_raises_after_its_collectives_raises_at_its_end_stepped_continued_or_traced(ranks):
    """A plain cell that raises gives its traceback and keeps the ranks; so do a step, continue and trace into
    the same raise (they said "every rank finished the cell", or restarted the ranks and lost the variables)."""
    ranks.run("kept = rank + 100")
    cell = "dist.all_reduce(torch.ones(1))\nraise ValueError(f'raised on {rank}')"
    for end in (ranks.step, ranks.resume, None):
        if end is None:
            with pytest.raises(WorkerError, match="raised on 1"):
                ranks.trace(cell)
        else:
            ranks.run(cell, step=True)
            with pytest.raises(WorkerError, match="raised on 0") as caught:
                end()
            assert "ValueError" in str(caught.value)
        assert not ranks.paused and ranks.run("kept") == [100, 101], end


def test_object_collectives_and_a_transfer_into_another_dtype_are_judged_by_what_runs(ranks):
    """gather_object and scatter_object_list run a gather and a scatter, whose tensors differ by rank by design;
    a send into a buffer of another dtype is named once, with what gloo does (no error: the bytes reread)."""
    cells = ["out = [None] * world_size if rank == 0 else None\ndist.gather_object(rank, out, dst=0)\nout",
             "got = [None]\ndist.scatter_object_list(got, ['a', 'b'] if rank == 0 else None, src=0)\ngot[0]"]
    for cell in cells:
        trace = ranks.trace(cell)  # a disagreement would stop it
        assert trace.values == ranks.run(cell)
    view = ranks.run("if rank == 0:\n    dist.send(torch.ones(2), 1)\nelse:\n"
                     "    dist.recv(torch.zeros(2, dtype=torch.float64), 0)", step=True)
    assert len(view.problems) == 1 and "read as its own dtype and shape, and no error" in view.problems[0]
    ranks.abort()


def test_a_step_that_times_out_on_a_slow_rank_interrupts_it_aborts_the_paused_and_keeps_the_variables(ranks):
    """Rank 1 sleeps between two all-reduces past the step's timeout while rank 0 is paused before the second:
    nobody is inside a collective, so the cell ends as a plain cell's would, by an interrupt (and an abort of the
    paused rank), and the variables stay; the doctor says rank 0 is paused, not waiting in the all-reduce."""
    ranks.run("kept = rank + 100")
    ranks.run("import time\ndist.all_reduce(torch.ones(1))\nif rank == 1:\n    time.sleep(60)\n"
              "dist.all_reduce(torch.ones(1))", step=True)
    with pytest.raises(WorkerTimeout) as caught:
        ranks.step(timeout=5)
    said = str(caught.value)
    assert "rank 0 is paused before its next collective (nothing sent)" in said, said
    assert re.search(r"rank 1 runs Python code after all_reduce #\d+", said) and "kept their variables" in said, said
    assert not ranks.paused and ranks.run("kept") == [100, 101]


def test_peek_refuses_to_wait_for_a_functional_collectives_result(unchecked):
    """A functional all-reduce returns at once (its wait comes when the value is read), so a rank stepped alone
    goes on to its next pause; peeking its result would wait for the peer still paused before the all-reduce."""
    unchecked.run("from torch.distributed._functional_collectives import all_reduce as fr\n"
                  "a = fr(torch.ones(2) * (rank + 1), 'sum', dist.group.WORLD)\ndist.barrier()\na", step=True)
    view = unchecked.step(rank=0)
    assert view.states()[0].startswith("paused before barrier #2"), view.states()
    with pytest.raises(WorkerError, match=r"peek only looks: .wait\(\) waits until every rank has finished"):
        unchecked.peek("a.wait().sum()")
    for expression in ("a.sum()", "a"):
        with pytest.raises(WorkerError, match="rank 0 raised RuntimeError: peek only looks: this value is a "
                                              "functional collective's result") as caught:
            unchecked.peek(expression)
        assert "rank 1 raised NameError: name 'a' is not defined" in str(caught.value)  # not yet assigned there
    unchecked.abort()
    unchecked.run("t = torch.ones(2)\nw = dist.all_reduce(t, async_op=True)\ndist.barrier()\nw.wait()", step=True)
    unchecked.step(rank=0)
    with pytest.raises(WorkerError, match=r"peek only looks: .wait\(\) waits until every rank has finished"):
        unchecked.peek("w.wait()")
    assert "posted and never met" in unchecked.abort()  # rank 0's all-reduce: the ranks are restarted


def test_a_transfer_is_compared_with_its_other_end_posted_earlier_in_a_batch(ranks):
    """Inside batch_isend_irecv each rank posts its isend, then its irecv: the two ends of one transfer are never
    paused at once, so the posted end is kept and compared when its peer comes to the other (rank 1 received into
    a buffer of 4 what rank 0 sent as 2, silently, before)."""
    cell = ("s, v = torch.full((2,), rank + 1.0), torch.zeros(2 + 2 * rank)\n"
            "ops = [dist.P2POp(dist.isend, s, 1 - rank), dist.P2POp(dist.irecv, v, 1 - rank)]\n"
            "for work in dist.batch_isend_irecv(ops):\n    work.wait()\nv")
    view = ranks.run(cell, step=True)
    assert view.problems == [], view.problems  # two isends: each waits for an irecv to come
    view = ranks.step()
    assert view.states()[1].startswith("paused before irecv"), view.states()
    assert ["rank 1's irecv #2 (src=0, float32[4]) and rank 0's isend #1 (dst=1, float32[2]), posted earlier, move "
            "different tensors: the receiver gets the sender's bytes read as its own dtype and shape, and no error "
            "(gloo); on NCCL the result is undefined"] == view.problems, view.problems
    said = ranks.abort()  # the isends are posted: a process group cannot take them back
    assert "rank 0's isend #1 (dst=1, float32[2]), rank 1's isend #1 (dst=0, float32[2]) were posted and never met" \
        in said and "restarted" in said, said
    right = cell.replace("torch.zeros(2 + 2 * rank)", "torch.zeros(2)")
    traced = ranks.trace(right)  # the same calls, the same shapes: no disagreement
    assert [t.tolist() for t in traced.values] == [[2.0, 2.0], [1.0, 1.0]]


def test_under_the_check_only_differing_operations_or_shapes_are_said_to_raise(ranks, needs_the_check):
    """torch's collective check compares each call's operation and its tensors' shapes and dtypes, not its root
    or reduce op: different roots are still a wait until the timeout."""
    view = ranks.run("dist.broadcast(torch.ones(2), src=rank)", step=True)
    assert repr(view).endswith("a step would run these calls, and wait until the timeout restarts the ranks")
    ranks.abort()
    view = ranks.run("dist.all_reduce(torch.ones(2 + rank))", step=True)
    assert "the collective check raises where it compares the tensors that differ" in repr(view)
    ranks.abort()


def test_under_the_check_an_async_collective_blocks_a_rank_stepped_alone_and_continue_finishes(ranks, needs_the_check):
    """The collective check compares every collective before it starts, async_op=True or not: rank 0 stepped alone
    waits inside its all-reduce (it hung, and restarted the ranks, when taken for non-blocking), and continue
    carries the waiting rank on too, past the pause its next collective makes."""
    ranks.run("kept = rank + 100")
    cell = "t = torch.ones(2)\nw = dist.all_reduce(t, async_op=True)\ndist.barrier()\nw.wait()\nt.sum()"
    ranks.run(cell, step=True)
    view = ranks.step(rank=0)
    assert view.states()[0].startswith("waits in all_reduce #1 (SUM, float32[2]) for rank 1"), view.states()
    assert [value.item() for value in ranks.resume()] == [4.0, 4.0]
    assert not ranks.paused and ranks.run("kept") == [100, 101]


def test_a_complex_tensor_is_shown_as_the_cell_passed_it(ranks):
    """c10d all-reduces a complex tensor as its real view (float32[2, 2] for complex64[2]); the table shows what
    the cell wrote, and the values equal a plain run's."""
    cell = "z = torch.ones(2, dtype=torch.complex64) * (1 + rank * 1j)\ndist.all_reduce(z)\nz"
    view = ranks.run(cell, step=True)
    assert view.states() == {0: "paused before all_reduce #1 (SUM, complex64[2])",
                             1: "paused before all_reduce #1 (SUM, complex64[2])"}, view.states()
    assert [z.tolist() for z in ranks.resume()] == [z.tolist() for z in ranks.run(cell)]


def test_a_waiting_rank_whose_call_ends_by_itself_ends_the_cell_at_the_next_command(ranks):
    """monitored_barrier raises after its own timeout on the rank left waiting: the next command says the cell
    ended, with that error, and the ranks keep their variables (it stayed 'paused', and nothing said why)."""
    import time

    ranks.run("kept = rank + 100\nchecker = dist.new_group(backend='gloo')")  # strict mode: a gloo group of its own
    view = ranks.run("if rank == 0:\n    dist.monitored_barrier(checker, timeout=__import__('datetime').timedelta("
                     "seconds=1))", step=True)
    assert view.states()[0] == "paused before monitored_barrier #1", view.states()  # no placeholder tensor shown
    deadline = time.monotonic() + 60
    while True:  # the first step: rank 1 finishes the cell; rank 0 waits inside the barrier until its 1 s
        try:
            ranks.step()
            continue
        except WorkerError as ended:  # (a RuntimeError too: caught first)
            assert "failed to pass monitoredBarrier" in str(ended) and "the stepped cell ended" in str(ended)
            break
        except RuntimeError as still:  # "nothing to step: rank 0 waits in monitored_barrier ...", until it raises
            assert "waits in monitored_barrier" in str(still) and time.monotonic() < deadline, str(still)
            time.sleep(0.2)
    assert not ranks.paused and ranks.run("kept") == [100, 101]


def test_an_abort_the_cell_keeps_catching_is_named_as_such(ranks):
    """A cell that catches everything around its collective pauses again after each abort: the ranks are
    restarted, and the message says why (it said they waited inside a collective)."""
    cell = ("n = 0\nwhile n < 100:\n    try:\n        dist.all_reduce(torch.ones(1))\n        break\n"
            "    except BaseException:\n        n += 1")
    ranks.run(cell, step=True)
    said = ranks.abort()
    assert "caught the abort three times and paused again" in said and "restarted" in said, said
    assert not ranks.paused and ranks.run("rank") == [0, 1]


def test_a_collective_posted_with_async_op_stands_for_its_rank_until_the_peers_come(unchecked):
    """Unchecked, rank 0 stepped alone past its async all-reduce goes on to the barrier: rank 1's all-reduce is
    compared with rank 0's posted one, not called a disagreement with rank 0's barrier, and does not wait; a
    posted collective never met makes an abort restart the ranks."""
    cell = "t = torch.ones(2) * (rank + 1)\nw = dist.all_reduce(t, async_op=True)\ndist.barrier()\nw.wait()\nt.sum()"
    unchecked.run(cell, step=True)
    view = unchecked.step(rank=0)
    assert view.states()[0].startswith("paused before barrier #2") and view.problems == [], view.problems
    view = unchecked.step(rank=1)  # its all-reduce meets rank 0's: both now before the barrier
    assert set(view.states().values()) == {"paused before barrier #2"}, view.states()
    assert [value.item() for value in unchecked.resume()] == [6.0, 6.0]
    unchecked.run("t = torch.ones(2 + rank)\nw = dist.all_reduce(t, async_op=True)\ndist.barrier()", step=True)
    view = unchecked.step(rank=0)
    assert any("different tensors" in problem for problem in view.problems), view.problems  # against the posted
    said = unchecked.abort()
    assert "rank 0's all_reduce #1 (SUM, float32[2]) was posted and never met" in said, said
    assert unchecked.run("rank") == [0, 1]
