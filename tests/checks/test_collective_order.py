"""Notebook 15's checker: FSDP2's collectives predicted, judged against a trace of the real thing on live ranks."""

from __future__ import annotations

import pytest

from dtlib.checks import collective_order, fsdp_collectives

pytestmark = pytest.mark.timeout(180)

RIGHT = ["AG0", "AG1", "AG2", "AG2", "AG1", "RS2", "AG0", "RS1", "RS0"]


def test_the_truth_is_traced_not_held_and_each_block_is_named_by_its_size():
    assert collective_order.observed() == tuple(("all_gather" if item[:2] == "AG" else "reduce_scatter", int(item[2]))
                                        for item in RIGHT)


def test_the_traced_model_names_a_cpu_mesh_so_that_a_gpu_machine_traces_the_same():
    """The checker's ranks are gloo's on the CPU; fully_shard's default mesh is a CUDA one wherever torch sees a
    GPU, and rank 1 of a one-GPU machine then fails ("invalid device ordinal"). Every fully_shard names the mesh."""
    import ast

    calls = [node for node in ast.walk(ast.parse(collective_order.SETUP)) if isinstance(node, ast.Call)]
    meshes = [call for call in calls if getattr(call.func, "id", "") == "init_device_mesh"]
    assert [ast.literal_eval(call.args[0]) for call in meshes] == ["cpu"]
    shards = [call for call in calls if getattr(call.func, "id", "") == "fully_shard"]
    assert shards and all(any(keyword.arg == "mesh" for keyword in call.keywords) for call in shards)


@pytest.mark.parametrize("answer", [
    RIGHT,
    [("all_gather" if item[:2] == "AG" else "reduce_scatter", int(item[2])) for item in RIGHT],
    [f"{'all-gather' if item[:2] == 'AG' else 'reduce scatter'} (block {item[2]})" for item in RIGHT],
    tuple(item.lower() for item in RIGHT),
])
def test_a_right_prediction_passes_however_it_is_written(answer):
    assert fsdp_collectives(answer).ok


@pytest.mark.parametrize(("answer", "fragments"), [
    (["AG0", "AG1", "AG2", "RS2", "RS1", "RS0"], ["#4", "freed its gathered parameters"]),  # reshard False's order
    (["AG0", "AG1", "AG2", "AG2", "RS2", "AG1", "RS1", "AG0", "RS0"], ["#5", "prefetches"]),  # no prefetch
    (["AG0", "AG1", "AG2", "AG2", "AG1", "RS2", "AG0", "RS0", "RS1"], ["#8", "last block's first"]),
    (RIGHT[:-1], ["predicted 8", "called 9", "fewer"]),
    (RIGHT[:6], ["predicted 6", "fewer", "one block ahead"]),  # stops before backward's prefetch: said as one
    (RIGHT + ["RS0"], ["predicted 10", "more"]),
    ([], ["no collective"]),
    ("AG0 AG1", ["Predict a list"]),
    (["AG3"], ["numbered 0, 1 and 2"]),
    ([0, 1], ["neither (operation, block)"]),
    (["broadcast 0"], ["name an all-gather or a reduce-scatter"]),
])
def test_a_wrong_prediction_is_refused_at_its_first_wrong_collective_with_why(answer, fragments):
    said = fsdp_collectives(answer)
    assert not said.ok
    for fragment in fragments:
        assert fragment in said.message, said.message


@pytest.mark.parametrize("answer", [
    ["all_gather_single 0", "all_gather_single 1", "all_gather_single 2", "all_gather_single 2",
     "all_gather_single 1", "reduce_scatter_single 2", "all_gather_single 0", "reduce_scatter_single 1",
     "reduce_scatter_single 0"],  # torch's own names, as the traces print them
    ["AG0", "AG1", "AG2", "AG2 again", "AG1 (prefetch)", "RS2", "AG0 (prefetch)", "RS1", "RS0"],
    ["AG[0]", "AG(block=1)", "AG.2", "AG 2", "AG_1", "RS2", "AG0", "RS1", "RS0"],  # brackets, dots, keywords
])
def test_torchs_names_and_notes_after_the_block_are_read(answer):
    assert fsdp_collectives(answer).ok


def test_a_negative_block_is_refused_not_read_as_positive_and_prefetching_everything_is_explained():
    said = fsdp_collectives([("all_gather", -1)])
    assert not said.ok and "numbered 0, 1 and 2" in said.message
    said = fsdp_collectives(["AG0", "AG-1"])  # a hyphen read as a minus: said so, and how to write block 1
    assert not said.ok and "-1 is no block" in said.message and "'AG1'" in said.message
    said = fsdp_collectives(["AG0", "AG1", "AG2", "AG2", "AG1", "AG0", "RS2", "RS1", "RS0"])
    assert not said.ok and "#6" in said.message and "one block ahead" in said.message
    assert "AG0 AG1 AG2 AG2" not in fsdp_collectives(RIGHT).message  # the ✓ does not spell the answer out


@pytest.mark.parametrize("answer", [
    ["AG for block 0", "AG on block 1", "fwd AG2", "bwd AG2", "AG1", "RS for block 2", "AG 0", "RS1", "RS0"],
    ["1. AG0", "2. AG1", "3. AG2", "4. AG2", "5. AG1", "6. RS2", "7. AG0", "8. RS1", "9. RS0"],  # a numbered list
    ["- AG0", "- AG1", "- AG2", "- AG2", "- AG1", "- RS2", "- AG0", "- RS1", "- RS0"],
    ["AG_0_fwd", "AG1 fwd", "AllGather(2)", "all gather into tensor 2", "AG1 (prefetch)", "ReduceScatter(2)",
     "all-gather of block 0", "reduce scatter 1", "reduce_scatter_tensor 0"],
])
def test_shorthand_of_one_collective_and_its_block_is_read(answer):
    said = fsdp_collectives(answer)
    assert said.ok, said.message


@pytest.mark.parametrize(("entry", "fragment"), [
    ("RS2 (AG0 first)", "one collective and one block per entry"),  # a second collective hidden in a note
    ("AG 0-2", "one collective and one block per entry"),  # several blocks in one entry
    ("AG 0,1", "one collective and one block per entry"),
    ("AG 0.5", "0.5 is no block"),
    (("all_gather", 2.9), "2.9 is no block"),  # a float is not truncated to block 2
    ("all_gather_object 0", "name an all-gather or a reduce-scatter"),  # other collectives' names
    ("reducescatterxyz 0", "name an all-gather or a reduce-scatter"),
    ("AG RS 0", "name an all-gather or a reduce-scatter"),
    ("AG1 then RS", "one collective per entry"),
])
def test_an_entry_that_holds_more_or_other_than_one_collective_and_block_is_refused(entry, fragment):
    said = fsdp_collectives([entry])
    assert not said.ok and fragment in said.message, said.message
