"""dtlib.torchrun and python -m dtlib.train: real torchrun processes, one node and two simulated nodes."""

from __future__ import annotations

import pytest

from dtlib import torchrun
from dtlib.checks import Feedback


def _by_rank(records):
    return {int(r["RANK"]): r for r in records}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_nodes_on_one_machine(rendezvous):
    """Two torchrun processes, two ranks each: one job of 4 ranks whose all-reduce sees everyone."""
    finished = torchrun.simulate_nodes(["-m", "dtlib.examples.env"], nnodes=2, nproc_per_node=2,
                                       rendezvous=rendezvous, timeout=90)
    assert [f.returncode for f in finished] == [0, 0], [f.output[-2000:] for f in finished]
    ranks = _by_rank(torchrun.env_records(finished))
    assert sorted(ranks) == [0, 1, 2, 3]
    for record in ranks.values():
        assert record["WORLD_SIZE"] == "4" and record["LOCAL_WORLD_SIZE"] == "2"
        assert record["sum_of_ranks"] == 0 + 1 + 2 + 3
        assert int(record["RANK"]) == 2 * int(record["GROUP_RANK"]) + int(record["LOCAL_RANK"])
    assert {r["GROUP_RANK"] for r in ranks.values()} == {"0", "1"}
    if rendezvous == "static":
        assert "--node_rank=1" in finished[1].command and {r["MASTER_ADDR"] for r in ranks.values()} == {"127.0.0.1"}
    else:
        assert "--rdzv_backend=c10d" in finished[0].command and "--node_rank" not in finished[0].command


@pytest.mark.timeout(120)
@pytest.mark.parametrize("runner", [["ddp", "--steps", "2"], ["fsdp", "--api", "fsdp2", "--steps", "2"]])
def test_runners_start_under_torchrun(runner):
    """The course's runners under torchrun --standalone: they train on the ranks torchrun started."""
    finished = torchrun.launch(["-m", "dtlib.train", *runner], nproc_per_node=2, timeout=90)
    assert finished.returncode == 0, finished.output[-2000:]
    assert "on 2 rank" in finished.output and "losses" in finished.output
    assert finished.command.startswith("torchrun --standalone --nproc_per_node=2 --tee=3 -m dtlib.train")


@pytest.mark.timeout(60)
def test_a_hanging_job_is_stopped_at_the_timeout():
    finished = torchrun.launch(["--no-python", "sleep", "60"], nproc_per_node=1, timeout=8)
    assert finished.returncode != 0 and "stopped after 8 s" in finished.output


def test_train_without_a_runner_name_says_how():
    from dtlib import train

    assert train.main([]) == 2 and train.main(["lightning"]) == 2


@pytest.mark.parametrize("command, ok, says", [
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 train.py",
     True, "RANK 4..7"),
    ("torchrun --standalone --nproc_per_node=4 train.py", False, "one node only"),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=2 --master_addr=10.0.0.1 --master_port=29500 train.py",
     False, "count from 0"),
    ("torchrun --nnodes=2 --nproc_per_node=4 --master_addr=10.0.0.1 --master_port=29500 train.py", False,
     "--node_rank is missing"),
    ("python train.py", False, "--nnodes is missing"),
    ("", False, "one string"),
])
def test_exercise_checker(command, ok, says):
    verdict = torchrun.check_command(command)
    assert isinstance(verdict, Feedback) and verdict.ok is ok and says in verdict.message


def test_bad_node_settings():
    with pytest.raises(ValueError, match="nnodes must be >= 1"):
        torchrun.simulate_nodes(["x.py"], nnodes=0)
    with pytest.raises(ValueError, match="rendezvous must be"):
        torchrun.simulate_nodes(["x.py"], rendezvous="etcd")
