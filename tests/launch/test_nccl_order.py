"""dtlib.launch.nccl_order: a replay of what each rank posted, as NCCL runs it, finds the orders that hang there.

Oracle: NCCL's rules as its documentation states them (a rank's transfers run one after another on its group's
stream; a send ends only while its receive runs; a group call posts its transfers together), worked by hand for
each case: the classic deadlocks hang, their textbook fixes (even/odd order, batching) finish; and NCCL pairs
the k-th send between two ranks with the k-th receive, whatever their tags (torch's ProcessGroupNCCL ignores them).
"""

from __future__ import annotations

import pytest

from dtlib.launch.nccl_order import Launch, Op, deadlock, launch, note, recording, sizes_disagree, tags_disagree


def _program(*calls: tuple[str, int | None]) -> list[tuple[Op, ...]]:
    return [launch(kind, peer) for kind, peer in calls]


def _ring(world_size: int, first: str) -> list[list[tuple[Op, ...]]]:
    order = {"send": lambda r: [("send", (r + 1) % world_size), ("recv", (r - 1) % world_size)],
             "recv": lambda r: [("recv", (r - 1) % world_size), ("send", (r + 1) % world_size)]}
    return [_program(*order[first](rank)) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 3, 5])
@pytest.mark.parametrize("first", ["send", "recv"])
def test_a_ring_where_every_rank_posts_the_same_side_first_hangs(world_size, first):
    said = deadlock(_ring(world_size, first))
    assert said is not None and said.startswith("On NCCL these transfers hang")
    for rank in range(world_size):
        assert f"rank {rank} waits in dist.{first}" in said


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_even_ranks_sending_first_and_odd_ones_receiving_first_finishes(world_size):
    ranks = [(_ring(world_size, "send") if rank % 2 == 0 else _ring(world_size, "recv"))[rank]
             for rank in range(world_size)]
    assert deadlock(ranks) is None


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_ring_posted_in_one_batch_per_rank_finishes(world_size):
    ranks = [[(Op("send", (rank + 1) % world_size, (), "isend"), Op("recv", (rank - 1) % world_size, (), "irecv"))]
             for rank in range(world_size)]
    assert deadlock(ranks) is None


def test_transfers_wait_behind_a_collective_that_their_peer_reaches_later():
    # rank 0: all_reduce, then send to 1; rank 1: recv from 0, then all_reduce. Each waits for the other.
    said = deadlock([[launch("all_reduce"), launch("send", 1)], [launch("recv", 0), launch("all_reduce")]])
    assert said is not None and "rank 0 waits in dist.all_reduce" in said
    assert "rank 1 waits in dist.recv from rank 0" in said
    assert deadlock([[launch("all_reduce"), launch("send", 1)], [launch("all_reduce"), launch("recv", 0)]]) is None


def test_another_group_has_a_stream_of_its_own():
    pair = (0, 1)  # of three ranks
    # On the default group's stream rank 0's send would wait for rank 1's all_reduce; on a group of its own it runs.
    ranks = [[launch("all_reduce"), launch("send", 1, pair)], [launch("recv", 0, pair), launch("all_reduce")],
             [launch("all_reduce")]]
    assert deadlock(ranks) is None
    assert deadlock([[launch("all_reduce"), launch("send", 1)], [launch("recv", 0), launch("all_reduce")],
                     [launch("all_reduce")]]) is not None


def test_two_groups_of_the_same_members_are_two_streams_and_two_channels():
    def on(comm: str, kind: str, peer: int) -> Launch:
        return (Op(kind, peer, (0, 1), kind, comm=comm),)

    # Each rank sends first, on its own group: one stream per rank would hang; two communicators run both.
    crossed = [[on("a", "send", 1), on("b", "recv", 1)], [on("b", "send", 0), on("a", "recv", 0)]]
    assert deadlock(crossed) is None
    assert deadlock([[on("a", "send", 1), on("a", "recv", 1)], [on("a", "send", 0), on("a", "recv", 0)]])
    # Sizes pair per communicator: group a's send meets group a's receive, whatever was posted between.
    sized = [[(Op("send", 1, (0, 1), "send", size=(2, "float32", 8), comm="a"),),
              (Op("send", 1, (0, 1), "send", size=(4, "float32", 16), comm="b"),)],
             [(Op("recv", 0, (0, 1), "recv", size=(4, "float32", 16), comm="b"),),
              (Op("recv", 0, (0, 1), "recv", size=(2, "float32", 8), comm="a"),)]]
    assert sizes_disagree(sized) is None and deadlock(sized) is None
    # A collective on one meets the same collective on the other rank's same group, not the other group's.
    collectives = [[(Op("all_reduce", None, (0, 1), "all_reduce", comm="a"),), on("b", "send", 1)],
                   [on("b", "recv", 0), (Op("all_reduce", None, (0, 1), "all_reduce", comm="a"),)]]
    assert deadlock(collectives) is None


def test_a_transfer_that_no_peer_matches_is_named():
    said = deadlock([[launch("send", 1, call="isend")], []])
    assert said == ("Rank 0's dist.isend to rank 1 is never matched: rank 1 posts no receive for it. gloo lets the "
                    "job end with it pending; on NCCL it waits forever.")


def test_the_kth_send_meets_the_kth_receive():
    # Two sends from 0 to 1, received in order: fine. A third send with no receive: never matched.
    assert deadlock([_program(("send", 1), ("send", 1)), _program(("recv", 0), ("recv", 0))]) is None
    said = deadlock([_program(("send", 1), ("send", 1), ("send", 1)), _program(("recv", 0), ("recv", 0))])
    assert said is not None and "never matched" in said


def test_notes_are_kept_only_while_recording_and_nest():
    note(*launch("all_reduce"))  # outside: dropped
    with recording() as outer:
        note(*launch("send", 1))
        with recording() as inner:
            note(*launch("recv", 0))
        note(*launch("all_reduce"))
    assert [ops[0].kind for ops in outer] == ["send", "all_reduce"]
    assert [ops[0].kind for ops in inner] == ["recv"]


def _tagged(kind: str, peer: int, tag: int) -> Launch:
    return (Op(kind, peer, (), kind, tag=tag),)


def test_tags_that_repeat_the_order_posted_agree_with_nccls_pairing():
    assert tags_disagree([[_tagged("send", 1, 1), _tagged("send", 1, 2)],
                          [_tagged("recv", 0, 1), _tagged("recv", 0, 2)]]) is None
    assert tags_disagree([_program(("send", 1)), _program(("recv", 0))]) is None  # no tags at all
    assert tags_disagree([[_tagged("send", 1, 7)], [_tagged("recv", 0, 7)]]) is None  # one tag, both sides


def test_tags_that_pair_other_messages_than_the_order_are_named_by_the_first_such_pair():
    said = tags_disagree([[_tagged("send", 1, 1), _tagged("send", 1, 2)],
                          [_tagged("recv", 0, 2), _tagged("recv", 0, 1)]])
    assert said is not None and said.startswith("Rank 0's 1st dist.send to rank 1 has tag=1, and rank 1's 1st "
                                                "dist.recv from rank 0 has tag=2. NCCL ignores tags"), said


def test_tags_are_paired_per_channel_and_inside_a_batch_too():
    # Rank 2's messages to rank 1 come after rank 0's in rank 1's program, but have a channel of their own.
    ranks = [[_tagged("send", 1, 5)], [_tagged("recv", 0, 5), _tagged("recv", 2, 6)], [_tagged("send", 1, 6)]]
    assert tags_disagree(ranks) is None
    batch = (Op("send", 1, (), "batch_isend_irecv's isend", tag=3), Op("send", 1, (), "batch_isend_irecv's isend",
                                                                        tag=4))
    said = tags_disagree([[batch], [(Op("recv", 0, (), "irecv", tag=4), Op("recv", 0, (), "irecv", tag=3))]])
    assert said is not None and "dist.batch_isend_irecv's isend to rank 1 has tag=3" in said, said


def _sized(kind: str, peer: int, numel: int, dtype: str = "float32", item: int = 4) -> Launch:
    return (Op(kind, peer, (), kind, size=(numel, dtype, numel * item)),)


def test_a_receive_that_differs_from_its_send_in_count_or_dtype_is_named():
    assert sizes_disagree([[_sized("send", 1, 4)], [_sized("recv", 0, 4)]]) is None
    assert sizes_disagree([_program(("send", 1)), _program(("recv", 0))]) is None  # sizes not noted
    larger = sizes_disagree([[_sized("send", 1, 4), _sized("send", 1, 4)],
                             [_sized("recv", 0, 4), _sized("recv", 0, 5)]])
    assert larger is not None and larger.startswith("Rank 0's 2nd dist.send to rank 1 sends 4 float32 (16 bytes), "
                                                    "and the receive NCCL pairs it with, rank 1's 2nd dist.recv "
                                                    "from rank 0, takes 5 float32 (20 bytes)."), larger
    other_dtype = sizes_disagree([[_sized("send", 1, 4, "float32")], [_sized("recv", 0, 4, "float64", 8)]])
    assert other_dtype is not None and "takes 4 float64 (32 bytes)" in other_dtype


@pytest.mark.parametrize(("sent", "received"), [
    (("bool", 1), ("uint8", 1)),  # torch hands NCCL both as ncclUint8
    (("complex64", 8), ("float32", 4)),  # a complex tensor goes as its real view: 2 floats each
    (("float32", 4), ("int32", 4))])  # the same bytes: NCCL's transfer moves them
def test_pairs_whose_bytes_agree_pass_as_nccl_runs_them(sent, received):
    (sent_dtype, sent_item), (received_dtype, received_item) = sent, received
    count = 4 * received_item // sent_item if sent_item > received_item else 4
    room = count * sent_item // received_item
    assert sizes_disagree([[_sized("send", 1, count, sent_dtype, sent_item)],
                           [_sized("recv", 0, room, received_dtype, received_item)]]) is None
    assert sizes_disagree([[_sized("send", 1, 0)], [_sized("recv", 0, 0)]]) is None  # nothing sent, nothing taken


def test_tags_that_match_nothing_leave_nccls_order_as_the_only_pairing():
    # The sender tags each message with its step, the receiver tags none: gloo would wait, NCCL pairs in order.
    assert tags_disagree([[_tagged("send", 1, 1), _tagged("send", 1, 2)],
                          [_tagged("recv", 0, 0), _tagged("recv", 0, 0)]]) is None


def test_a_receive_that_gloo_would_pair_with_a_later_send_is_named():
    # Sends tagged 2 then 1, receives 1 and 1: gloo gives the first receive the second send; NCCL, the first.
    said = tags_disagree([[_tagged("send", 1, 2), _tagged("send", 1, 1)],
                          [_tagged("recv", 0, 1), _tagged("recv", 0, 1)]])
    assert said is not None and said.startswith("Rank 0's 1st dist.send to rank 1 has tag=2, and rank 1's 1st "
                                                "dist.recv from rank 0 has tag=1."), said
