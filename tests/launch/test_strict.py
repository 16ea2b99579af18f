"""Strict mode refuses, on gloo, what NCCL does not promise; code NCCL runs gives the same answers under it.

Oracle: the same rank function with strict mode off (gloo's own behaviour) and what torch documents for NCCL.
"""

from __future__ import annotations

import datetime
import math
import warnings

import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib.launch import strict

pytestmark = pytest.mark.timeout(90)


def _reduce_then_read(rank, world_size):
    x = torch.full((3,), float(rank + 1))
    dist.reduce(x, dst=0)
    counts = torch.full((2,), rank + 1, dtype=torch.int64)
    dist.reduce(counts, dst=1)
    return x.tolist(), counts.tolist()


def test_reduce_leaves_the_other_ranks_tensors_undefined():
    (x0, c0), (x1, c1) = dtlib.spawn(_reduce_then_read, 2, strict=True)
    assert x0 == [3.0] * 3 and c1 == [3, 3]  # the roots hold the sum
    assert all(math.isnan(v) for v in x1)  # gloo leaves the sum here too; NCCL promises nothing
    assert c0 == [torch.iinfo(torch.int64).min] * 2
    (x0, _), (x1, _) = dtlib.spawn(_reduce_then_read, 2, strict=False)
    assert not any(math.isnan(v) for v in x1)  # gloo leaves numbers there (a sum, or part of one) that read as valid


def _reduce_then_broadcast_from_the_wrong_rank(rank, world_size):
    """A wrong answer that gloo passes: the sum is reduced to 0 and broadcast from 1."""
    x = torch.tensor([float(rank + 1)])
    dist.reduce(x, dst=0)
    dist.broadcast(x, src=1)
    return x.item()


def test_a_broadcast_from_a_non_root_after_reduce_spreads_nan():
    lenient = dtlib.spawn(_reduce_then_broadcast_from_the_wrong_rank, 2, strict=False)
    assert not any(math.isnan(v) for v in lenient)  # a number, at times the right sum: a wrong answer that passes
    assert all(math.isnan(v) for v in dtlib.spawn(_reduce_then_broadcast_from_the_wrong_rank, 2, strict=True))


def _async_reads(rank, world_size):
    x = torch.full((4,), float(rank + 1))
    work = dist.all_reduce(x, async_op=True)
    before = x.clone()  # read before wait(): undefined
    work.wait()
    gathered = torch.empty(2 * world_size)
    work = dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)), async_op=True)
    gathered_before = gathered.clone()
    work.wait()
    y = torch.ones(2)
    chained = dist.all_reduce(y, async_op=True).get_future().then(lambda future: y * 10)  # a comm hook's idiom
    return before.tolist(), x.tolist(), gathered_before.tolist(), gathered.tolist(), chained.wait().tolist()


def _async_broadcast(rank, world_size):
    x = torch.full((2,), float(rank + 5))
    work = dist.broadcast(x, src=0, async_op=True)
    before = x.tolist()  # the source's own tensor: read, never written, by the broadcast
    work.wait()
    return before, x.tolist()


def test_an_async_broadcast_leaves_its_source_readable_and_the_others_undefined_until_wait():
    (source_before, source_after), (other_before, other_after) = dtlib.spawn(_async_broadcast, 2, strict=True)
    assert source_before == source_after == [5.0, 5.0]
    assert all(math.isnan(v) for v in other_before) and other_after == [5.0, 5.0]


def test_an_async_collectives_tensors_read_nan_until_wait_and_the_result_after():
    for rank, (before, after, gathered_before, gathered, chained) in enumerate(dtlib.spawn(_async_reads, 2,
                                                                                           strict=True)):
        assert all(math.isnan(v) for v in before + gathered_before), rank
        assert after == [3.0] * 4 and gathered == [0.0, 0.0, 1.0, 1.0] and chained == [20.0, 20.0]


def _refused(rank, world_size, what):
    try:
        if what == "bitwise":
            dist.all_reduce(torch.ones(1, dtype=torch.int32), op=dist.ReduceOp.BOR)
        elif what == "any source":
            (dist.recv if rank else dist.irecv)(torch.empty(1))  # from any rank: refused before anything is posted
        elif what == "non-contiguous":
            dist.all_reduce(torch.arange(10.0).view(2, 5)[:, ::2])  # gloo reduces it through a copy
        elif what == "non-contiguous input":
            dist.all_gather([torch.empty(3), torch.empty(3)], torch.ones(3, 2)[:, 0])
        elif what == "non-contiguous P2POp":
            dist.P2POp(dist.isend, torch.ones(2, 3).t(), 1 - rank)
        elif what == "sparse":
            dist.all_reduce(torch.eye(3).to_sparse())  # gloo would reduce it
        elif what == "int16 send":
            (dist.send(torch.ones(2, dtype=torch.int16), 1) if rank == 0 else
             dist.recv(torch.empty(2, dtype=torch.int16), 0))  # gloo sends the bytes
        elif what == "uint32 P2POp":
            dist.P2POp(dist.irecv, torch.empty(2, dtype=torch.uint32), 1 - rank)
        else:
            dist.send(torch.ones(2, 3).t(), dst=1 - rank)  # refused before anything is sent
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("what", "says"), [
    ("bitwise", "NCCL has no bitwise"), ("any source", "Name the sender: dist.recv"),
    ("non-contiguous", "dist.all_reduce: tensor is not contiguous (shape (2, 3)"),
    ("non-contiguous input", "dist.all_gather: tensor is not contiguous"),
    ("non-contiguous send", "dist.send: tensor is not contiguous"),
    ("non-contiguous P2POp", "dist.P2POp: tensor is not contiguous"),
    ("sparse", "dist.all_reduce: tensor is a sparse_coo tensor, which NCCL refuses"),
    ("int16 send", "the tensor is int16, which NCCL has no type for"),
    ("uint32 P2POp", "dist.P2POp: the tensor is uint32, which NCCL has no type for")])
def test_what_nccl_lacks_is_refused_with_its_reason(what, says):
    messages = dtlib.spawn(_refused, 2, args=(what,), strict=True)
    if what == "any source":  # rank 0 uses irecv, rank 1 recv
        assert "Name the sender: dist.irecv" in messages[0] and says in messages[1]
    else:
        assert all(says in message for message in messages), messages


def _contiguous_layouts_pass(rank, world_size):
    """What NCCL accepts passes: a contiguous slice of rows, and a channels-last image batch."""
    rows = torch.ones(4, 3)[1:3]
    image = torch.ones(1, 2, 2, 2).to(memory_format=torch.channels_last)
    dist.all_reduce(rows)
    dist.all_reduce(image)
    return rows.sum().item(), image.sum().item()


def test_contiguous_views_and_channels_last_pass():
    assert dtlib.spawn(_contiguous_layouts_pass, 2, strict=True) == [(12.0, 16.0)] * 2


def _gathered_into_columns(rank, world_size):
    """An all_gather into a list of columns, views of one matrix: NCCL copies each from a flat buffer."""
    matrix = torch.zeros(3, world_size)
    dist.all_gather(list(matrix.unbind(dim=1)), torch.full((3,), float(rank)))
    return matrix.tolist()


def test_a_list_of_views_to_gather_into_passes_and_is_filled():
    assert dtlib.spawn(_gathered_into_columns, 2, strict=True) == [[[0.0, 1.0]] * 3] * 2


def _tagged(rank, world_size):
    """Rank 0 sends 1 (tag 1) then 2 (tag 2); rank 1 receives tag 2 first. gloo matches by tag, NCCL by order.
    Returns what rank 1 received and the strict warnings about tags."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank == 0:  # gloo's send waits for its receive: posted together, as tags allow
            works = [dist.isend(torch.tensor([1.0]), dst=1, tag=1), dist.isend(torch.tensor([2.0]), dst=1, tag=2)]
            for work in works:
                work.wait()
            got = []
        else:
            first, second = torch.empty(1), torch.empty(1)
            dist.recv(first, src=0, tag=2)
            dist.recv(second, src=0, tag=1)
            got = [first.item(), second.item()]
    said = [str(w.message) for w in caught if issubclass(w.category, strict.StrictWarning)]
    return got, [message for message in said if "tag" in message]


def _tagged_in_a_batch(rank, world_size):
    """As :func:`_tagged`, every transfer a ``P2POp`` of one ``batch_isend_irecv``; also returns whether the
    learner's own ``P2POp`` objects still hold the tags they were given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank == 0:
            ops = [dist.P2POp(dist.isend, torch.tensor([1.0]), 1, tag=1),
                   dist.P2POp(dist.isend, torch.tensor([2.0]), 1, tag=2)]
            got = []
        else:
            got = [torch.empty(1), torch.empty(1)]
            ops = [dist.P2POp(dist.irecv, got[0], 0, tag=2), dist.P2POp(dist.irecv, got[1], 0, tag=1)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    said = [str(w.message) for w in caught if issubclass(w.category, strict.StrictWarning)]
    return [t.item() for t in got], [m for m in said if "tag" in m], [op.tag for op in ops]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("posted", [_tagged, _tagged_in_a_batch])
def test_tags_are_ignored_as_nccl_ignores_them(posted):
    (_, said0, *mine0), (got, said1, *mine1) = dtlib.spawn(posted, 2, strict=True)
    assert got == [1.0, 2.0]  # NCCL's order: the first message into the first receive
    assert "NCCL ignores tags" in said0[0] and "NCCL ignores tags" in said1[0]
    assert dtlib.spawn(posted, 2, strict=False)[1][:2] == ([2.0, 1.0], [])  # gloo's own: matched by tag
    if posted is _tagged_in_a_batch:  # the transfers ran untagged, the learner's ops are left as written
        assert mine0 == [[1, 2]] and mine1 == [[2, 1]]


def _monitored(rank, world_size, where):
    """``dist.monitored_barrier`` on the group ``where`` names; what it raised, or "ran"."""
    group = {"default": None, "world": dist.group.WORLD, "new_group()": dist.new_group(),
             "new_group(backend='gloo')": dist.new_group(backend="gloo"),
             "new_group(ranks, None, 'gloo')": dist.new_group(list(range(world_size)), None, "gloo")}[where]
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=30))
        return "ran"
    except ValueError as err:
        return str(err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["default", "world", "new_group()"])
def test_a_monitored_barrier_on_a_group_nccl_would_run_is_refused_as_torch_refuses_it_on_gpus(where):
    said = dtlib.spawn(_monitored, 2, args=(where,), strict=True)
    assert all(s.startswith("dist.monitored_barrier on ") and "only implemented for GLOO backend" in s
               and 'dist.new_group(backend="gloo")' in s for s in said), said
    assert dtlib.spawn(_monitored, 2, args=(where,), strict=False) == ["ran", "ran"]  # gloo's own: it runs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["new_group(backend='gloo')", "new_group(ranks, None, 'gloo')"])
def test_a_monitored_barrier_on_a_gloo_group_of_its_own_runs_as_it_would_beside_nccl(where):
    assert dtlib.spawn(_monitored, 2, args=(where,), strict=True) == ["ran", "ran"]


def _monitored_by_two_of_three(rank, world_size):
    """Every rank makes a gloo group of ranks 0 and 1 (new_group is called by all); every rank then calls
    monitored_barrier on it: rank 2, outside it, gets torch's own warning and returns at once."""
    pair = dist.new_group([0, 1], backend="gloo")
    dist.monitored_barrier(group=pair, timeout=datetime.timedelta(seconds=30))
    return "ran"


@pytest.mark.timeout(60)
def test_a_monitored_barrier_on_a_gloo_group_a_rank_is_not_in_passes_as_torch_lets_it():
    assert dtlib.spawn(_monitored_by_two_of_three, 3, strict=True) == ["ran"] * 3


def _on_a_group(rank, world_size, backend, what):
    """``what``, which NCCL refuses and gloo runs, on a group made with ``backend``: what it raised, or "ran"."""
    from dtlib.launch import host_tensors

    group = dist.new_group(backend=backend)
    peer = 1 - rank
    try:
        with host_tensors.watching():
            if what == "bitwise":
                dist.all_reduce(torch.ones(1, dtype=torch.int32), op=dist.ReduceOp.BOR, group=group)
            elif what == "host tensor":
                dist.all_reduce(torch.ones(2).cpu(), group=group)
            elif what == "non-contiguous":
                dist.broadcast(torch.ones(2, 3).t(), src=0, group=group)
            elif what == "int16 P2POp":
                x = torch.full((2,), rank, dtype=torch.int16)
                ops = [dist.P2POp(dist.isend, x, peer, group), dist.P2POp(dist.irecv, torch.empty_like(x), peer, group)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            else:  # the group's own method
                group.allreduce([torch.ones(2).cpu()]).wait()
    except ValueError as err:
        return str(err)
    return "ran"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["bitwise", "host tensor", "non-contiguous", "int16 P2POp", "group method"])
def test_a_group_made_with_backend_gloo_keeps_gloos_rules_as_it_would_beside_nccl(what):
    assert dtlib.spawn(_on_a_group, 2, args=("gloo", what), strict=True) == ["ran", "ran"]
    refused = dtlib.spawn(_on_a_group, 2, args=(None, what), strict=True)  # a group NCCL would run
    assert all(said != "ran" for said in refused), refused


def _two_groups_crossed(rank, world_size):
    """Two groups of the same two ranks: rank 0 sends on the first and receives on the second, rank 1 the
    mirror image. On NCCL they are two communicators, each with its own stream, so both transfers run."""
    from dtlib.launch import nccl_order

    first, second = dist.new_group(), dist.new_group()
    mine, theirs = torch.full((2,), float(rank)), torch.empty(2)
    with nccl_order.recording() as notes:
        if rank == 0:
            sent, got = dist.isend(mine, 1, group=first), dist.irecv(theirs, 1, group=second)
        else:
            sent, got = dist.isend(mine, 0, group=second), dist.irecv(theirs, 0, group=first)
        sent.wait()
        got.wait()
    return notes, theirs.tolist()


@pytest.mark.timeout(60)
def test_two_groups_of_the_same_ranks_are_replayed_as_two_communicators():
    from dtlib.launch import nccl_order

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", strict.StrictWarning)  # the second isend is posted unwaited: flagged
        (notes0, got0), (notes1, got1) = dtlib.spawn(_two_groups_crossed, 2, strict=True)
    assert (got0, got1) == ([1.0, 1.0], [0.0, 0.0])
    assert notes0[0][0].comm == notes1[1][0].comm != notes0[1][0].comm  # named by torch's group_name, alike
    assert nccl_order.deadlock([notes0, notes1]) is None
    assert nccl_order.deadlock([[tuple(op.__class__(**{**vars(op), "comm": ""}) for op in launch) for launch in rank]
                                for rank in (notes0, notes1)]) is not None  # one stream each: it would hang


def _exchange(rank, world_size, how):
    """Each rank sends its rank to the next and receives from the previous, as ``how`` posts it."""
    mine, theirs = torch.tensor([float(rank)]), torch.empty(1)
    after, before = (rank + 1) % world_size, (rank - 1) % world_size
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "batched, torch's own functions":  # imported before strict mode began: P2POp takes them too
            isend, irecv = strict._active["isend"], strict._active["irecv"]  # what such an import holds
            works = dist.batch_isend_irecv([dist.P2POp(isend, mine, after), dist.P2POp(irecv, theirs, before)])
        elif how == "batched":
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, after),
                                            dist.P2POp(dist.irecv, theirs, before)])
        elif how == "unbatched":
            works = [dist.isend(mine, after), dist.irecv(theirs, before)]
        else:  # one at a time: each waited before the next is posted
            works = []
            (dist.isend(mine, after) if rank % 2 == 0 else dist.irecv(theirs, before)).wait()
            (dist.irecv(theirs, before) if rank % 2 == 0 else dist.isend(mine, after)).wait()
        for work in works:
            work.wait()
    return theirs.item(), [str(w.message) for w in caught if issubclass(w.category, strict.StrictWarning)]


def _works_of_a_batch(rank, world_size):
    """How many works ``batch_isend_irecv`` returns for a send and a receive, and what each rank received."""
    peer, mine, theirs = 1 - rank, torch.full((2,), float(rank)), torch.empty(2)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
    count = len(works)
    finished = [work.wait() for work in works]
    try:
        works[-1].source_rank()
        sender = "named"
    except RuntimeError as err:
        sender = str(err).split(":")[0]
    # Work.is_success() and Work.exception() are left out: torch deprecates both (and 2.11 cannot return the
    # latter's value to Python).
    return (count, finished, all(work.is_completed() for work in works), theirs.tolist(), sender if count == 1 else "")


@pytest.mark.timeout(60)
def test_a_batch_returns_one_work_as_nccl_does_so_unpacking_one_per_transfer_fails_here_too():
    """torch's batch_isend_irecv returns cm.works, one work for the group call, where the backend coalesces
    (NCCL), and one per transfer where it does not (gloo): distributed_c10d.batch_isend_irecv."""
    no_sender = "the work of a dist.batch_isend_irecv has no source rank"  # nor has NCCL's one work
    assert dtlib.spawn(_works_of_a_batch, 2, strict=True) == [(1, [True], True, [1.0, 1.0], no_sender),
                                                              (1, [True], True, [0.0, 0.0], no_sender)]
    assert [count for count, *_ in dtlib.spawn(_works_of_a_batch, 2, strict=False)] == [2, 2]  # gloo's own


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["batched", "batched, torch's own functions", "unbatched", "one at a time"])
def test_isends_and_irecvs_posted_apart_are_flagged_and_batched_ones_are_not(how):
    results = dtlib.spawn(_exchange, 3, args=(how,), strict=True)
    assert [got for got, _ in results] == [2.0, 0.0, 1.0]
    flagged = [said for _, said in results]
    if how == "unbatched":
        assert all(said and "batch_isend_irecv" in said[0] and "unwaited" in said[0] for said in flagged)
    else:
        assert flagged == [[], [], []]


def _ping_pong_posted_apart(rank, world_size):
    peer = 1 - rank
    mine, theirs = torch.tensor([float(rank)]), torch.empty(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank == 0:
            dist.send(mine, dst=peer)
            dist.recv(theirs, src=peer)
        else:
            dist.recv(theirs, src=peer)
            dist.send(mine, dst=peer)
    return theirs.item(), [str(w.message) for w in caught if issubclass(w.category, strict.StrictWarning)]


def test_a_send_and_a_receive_with_one_peer_posted_apart_are_flagged():
    (got0, said0), (got1, said1) = dtlib.spawn(_ping_pong_posted_apart, 2, strict=True)
    assert (got0, got1) == (1.0, 0.0)
    assert said0 and said1 and "batch_isend_irecv" in said0[0]


def _fsdp_and_ddp_unchanged(rank, world_size):
    """torch's own calls keep gloo's behaviour: a DDP step gives the same gradients with strict mode on."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    torch.manual_seed(rank + 1)
    model(torch.randn(3, 4)).sum().backward()
    return model.module.weight.grad, strict.active()


def test_torchs_own_collectives_are_left_alone():
    (on0, active), _ = dtlib.spawn(_fsdp_and_ddp_unchanged, 2, strict=True)
    (off0, inactive), _ = dtlib.spawn(_fsdp_and_ddp_unchanged, 2, strict=False)
    assert active and not inactive
    torch.testing.assert_close(on0, off0)


def test_poison_reads_as_undefined_for_each_kind_of_dtype():
    for dtype, check in [(torch.float32, lambda t: t.isnan().all()), (torch.bfloat16, lambda t: t.isnan().all()),
                         (torch.int32, lambda t: (t == torch.iinfo(torch.int32).min).all())]:
        tensor = torch.zeros(3, dtype=dtype)
        strict.poison(tensor)
        assert check(tensor), dtype


def test_strict_must_be_a_bool():
    with pytest.raises(TypeError, match="strict"):
        dtlib.spawn(lambda rank, world_size: None, 2, strict="yes")


def _fsdp_counted_by_group(rank, world_size):
    """FSDP2's own all-gathers pass through count_by_group's wrappers: they stay torch's, unchanged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dtlib.measure.counting import count_by_group

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
    _, counts = count_by_group(lambda: model(torch.ones(2, 4)).sum().backward(), {"dp": mesh.get_group()})
    return model.weight.grad.full_tensor(), counts


def test_torchs_calls_through_dtlibs_counters_are_left_alone():
    (on, counts), _ = dtlib.spawn(_fsdp_counted_by_group, 2, strict=True)
    (off, _), _ = dtlib.spawn(_fsdp_counted_by_group, 2, strict=False)
    torch.testing.assert_close(on, off)
    assert counts["dp"]["all_gather_single"] >= 1


def _strict_is_on(rank, world_size):
    return strict.active()


def test_strict_mode_is_on_by_default_and_off_on_request(monkeypatch):
    monkeypatch.delenv(strict.STRICT_ENV, raising=False)
    assert dtlib.spawn(_strict_is_on, 2) == [True, True]
    monkeypatch.setenv(strict.STRICT_ENV, "0")
    assert dtlib.spawn(_strict_is_on, 2) == [False, False]
    assert dtlib.spawn(_strict_is_on, 2, strict=True) == [True, True]


def _posted_and_left(rank, world_size):
    from dtlib.launch import nccl_order

    peer = 1 - rank
    with nccl_order.recording() as notes:
        mine, theirs = torch.full((2,), float(rank)), torch.empty(2)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
        pending_batch = strict.unwaited()
        for work in works:
            work.wait()
        dist.all_reduce(mine)
        sending = dist.isend(torch.ones(1), peer) if rank == 0 else dist.irecv(torch.empty(1), peer)
        pending_single = strict.unwaited()
        sending.wait()
    return ([[(op.kind, op.peer, op.call) for op in launch] for launch in notes], pending_batch, pending_single,
            strict.unwaited(), theirs.tolist())


def test_strict_mode_notes_what_each_rank_posts_and_the_work_it_never_waited_for():
    (notes0, batch0, single0, left0, got0), (notes1, *_rest, got1) = dtlib.spawn(_posted_and_left, 2, strict=True,
                                                                                   timeout=60)
    assert notes0 == [[("send", 1, "batch_isend_irecv's isend"), ("recv", 1, "batch_isend_irecv's irecv")],
                      [("all_reduce", None, "all_reduce")], [("send", 1, "isend")]]
    assert notes1[-1] == [("recv", 0, "irecv")]
    assert batch0 == ["the work of dist.batch_isend_irecv"]  # one for the batch, as NCCL returns (gloo: one each)
    assert single0 == ["dist.isend to rank 1"] and left0 == []
    assert (got0, got1) == ([1.0, 1.0], [0.0, 0.0])


def _stacked_forms(rank, world_size):
    own = torch.full((3,), float(rank + 1))
    gathered = torch.empty(world_size, 3)  # the stacked form NCCL takes, as torch documents; gloo alone refuses it
    dist.all_gather_into_tensor(gathered, own)
    scattered = torch.empty(3)
    dist.reduce_scatter_tensor(scattered, torch.arange(world_size * 3.0).view(world_size, 3) + rank)
    return gathered.tolist(), scattered.tolist()


def test_the_stacked_form_of_the_single_tensor_collectives_passes_as_on_nccl():
    for rank, (gathered, scattered) in enumerate(dtlib.spawn(_stacked_forms, 2, strict=True)):
        assert gathered == [[1.0] * 3, [2.0] * 3]
        assert scattered == [2 * (3 * rank + k) + 1 for k in range(3)]  # (3r + k) summed over two ranks, + 0 and 1


def _group_method_calls(rank, world_size, wait):
    x = torch.full((2,), float(rank + 1))
    work = dist.group.WORLD.allreduce([x])  # a ProcessGroup's own method: async whatever it is given
    before = x.tolist()
    if wait == "wait":
        work.wait()
    elif wait == "poll":
        while not work.is_completed():  # polling until done is as good as waiting, on NCCL too
            pass
    return before, x.tolist(), strict.unwaited()


@pytest.mark.parametrize("wait", ["wait", "poll", "never"])
def test_a_process_groups_own_method_is_held_as_an_async_collective(wait):
    for before, after, unwaited in dtlib.spawn(_group_method_calls, 2, args=(wait,), strict=True):
        assert all(math.isnan(v) for v in before)
        if wait == "never":
            assert all(math.isnan(v) for v in after) and unwaited == ["ProcessGroup.allreduce(...)"]
        else:
            assert after == [3.0, 3.0] and unwaited == []


def _async_polled(rank, world_size):
    x = torch.full((2,), float(rank + 1))
    work = dist.all_reduce(x, async_op=True)
    while not work.is_completed():
        pass
    return x.tolist(), strict.unwaited()


def test_an_async_collective_polled_until_completed_delivers_its_result():
    for values, unwaited in dtlib.spawn(_async_polled, 2, strict=True):
        assert values == [3.0, 3.0] and unwaited == []
