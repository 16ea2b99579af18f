"""dtlib.launch.torchrun and python -m dtlib.train: real torchrun processes, one node and two simulated nodes.

The rank function below travels to dtlib.spawn's ranks by value (``register_pickle_by_value``), as a notebook
cell's functions do, so the ranks never import this module (or pytest).
"""

from __future__ import annotations

import re
import sys
import tempfile
import time

import cloudpickle
import pytest

from dtlib import checks
from dtlib.checks.feedback import Feedback
from dtlib.launch import joblog, torchrun

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def failure_report(finished: torchrun.Finished, lines: int = 30) -> str:
    """What to read when a torchrun job failed: the last ``lines`` lines that each failed rank printed
    itself (``--tee=3`` prefixes them ``[default<LOCAL_RANK>]:``), then torchrun's own summary. A rank that
    died of a signal (SIGABRT: ``exitcode: -6``) often says why only in its own lines, long before the
    summary's last 2,000 characters. Example: ``assert finished.returncode == 0, failure_report(finished)``."""
    local = dict(re.findall(r"rank\s*:\s*\d+ \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)",
                            finished.output))
    parts = [f"{finished.command}\nexit code {finished.returncode}"]
    for rank, code in sorted(local.items()):
        own = [line for line in finished.output.splitlines() if line.startswith(f"[default{rank}]:")]
        parts.append(f"--- local rank {rank} (exit code {code}), its last {lines} lines:\n" + "\n".join(own[-lines:]))
    summary = finished.output.rfind("Failures:")
    parts.append(finished.output[summary:] if summary >= 0 else finished.output[-2000:])
    return "\n".join(parts)


def _by_rank(records):
    return {int(r["RANK"]): r for r in records}


@pytest.mark.timeout(120)
def test_two_static_nodes_on_one_machine_are_one_job_numbered_by_node_rank(monkeypatch, tmp_path):
    """Two torchrun processes with a static rendezvous, two ranks each: one job whose all-reduce sees all 4 ranks,
    a rank's number 2 * its node's plus its local one. Nothing is left in the temporary directory (torchrun's own
    logs go to a folder removed with the job). The c10d rendezvous joining two nodes into one job is notebook 07's
    checked cell (2 nodes of 2 ranks: WORLD_SIZE 4, ranks 0 to 3, nodes 0 and 1, the sum of ranks 6); its command,
    and its temporary folder, are checked in test_killing_the_node_that_serves_the_store_ends_the_survivor_too."""
    _temporary_directory(monkeypatch, tmp_path)
    finished = torchrun.simulate_nodes(["-m", "dtlib.examples.env"], nnodes=2, nproc_per_node=2,
                                       rendezvous="static", timeout=90)
    assert [f.returncode for f in finished] == [0, 0], [failure_report(f) for f in finished]
    ranks = _by_rank(torchrun.env_records(finished))
    assert sorted(ranks) == list(range(4))
    for record in ranks.values():
        assert record["WORLD_SIZE"] == "4" and record["LOCAL_WORLD_SIZE"] == "2"
        assert record["sum_of_ranks"] == sum(range(4))
        assert int(record["RANK"]) == 2 * int(record["GROUP_RANK"]) + int(record["LOCAL_RANK"])
    assert {r["GROUP_RANK"] for r in ranks.values()} == {"0", "1"}
    assert "--node_rank=1" in finished[1].command and {r["MASTER_ADDR"] for r in ranks.values()} == {"127.0.0.1"}
    assert list(tmp_path.iterdir()) == [], "left in the temporary directory"


def _temporary_directory(monkeypatch, folder):
    """``folder`` as the temporary directory of this process (tempfile's cached choice forgotten) and of what
    it starts."""
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)


@pytest.mark.timeout(120)
def test_the_ddp_runner_trains_on_the_ranks_torchrun_started(monkeypatch, tmp_path):
    """The fsdp runner's run under torchrun is the next test's. Rank 0 alone notes the job in DTLIB_JOB_LOG."""
    monkeypatch.setenv(joblog.JOB_LOG, str(tmp_path / "jobs"))
    finished = torchrun.single_node(["-m", "dtlib.train", "ddp", "--steps", "2"], nproc_per_node=2, timeout=90)
    assert finished.returncode == 0, failure_report(finished)
    assert "DDP on 2 rank(s)" in finished.output and "losses" in finished.output
    assert finished.command.startswith("torchrun --standalone --nproc_per_node=2 --tee=3 -m dtlib.train ddp")
    assert [(job["launcher"], job["world_size"], job["backend"]) for job in joblog.read(tmp_path / "jobs")] == [
        ("torchrun", 2, "gloo")]


@pytest.mark.timeout(240)
def test_the_fsdp_runner_trains_under_torchrun_and_checks_its_groups_against_torchruns_world_size():
    """docs/torchrun.md's SLURM line: --shard-group-size is checked against torchrun's WORLD_SIZE (2 here),
    not against --world-size (3 here, which cannot form groups of 2: without torchrun this line is refused),
    which torchrun ignores; the runner trains on the 2 ranks torchrun started."""
    finished = torchrun.single_node(["-m", "dtlib.train", "fsdp", "--strategy", "hybrid_shard", "--shard-group-size",
                                     "2", "--world-size", "3", "--steps", "1"], nproc_per_node=2, timeout=200)
    assert finished.returncode == 0, failure_report(finished)
    assert "fsdp2 hybrid_shard on 2 ranks: losses" in finished.output
    assert finished.command.startswith("torchrun --standalone --nproc_per_node=2 --tee=3 -m dtlib.train fsdp")


def test_exit_codes_are_none_where_no_rank_failed():
    assert torchrun.exit_codes(torchrun.Finished("torchrun x.py", 0, "[default0]:done\n")) == {}


# Notebook 07's checked cells run its jobs once for the gate, and nbval or the browser tests compare what they
# print: a rank's exit code 3 that torchrun does not pass on (it exits 1) and names in its summary (exit_codes:
# {0: -15, 1: 3}, rank 0 stopped with SIGTERM), a restart under --max_restarts=1 (the command with
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and every attempt's ranks), two c10d nodes of two ranks joined into one
# job, the deprecated launcher's --local-rank argument beside torchrun's LOCAL_RANK, and each rank's loader workers
# reading only its indices. They are not started again here; the summary's wording ("Root Cause", "exitcode  :")
# is checked on notebook 16's job killed after step 6.


@pytest.mark.timeout(60)
def test_a_job_that_prints_and_then_nothing_is_stopped_after_its_silence():
    finished = torchrun.single_node(["--no-python", "sh", "-c", "echo started; sleep 60"], nproc_per_node=1,
                                    timeout=50, silence=3)
    assert finished.returncode != 0 and "started" in finished.output
    assert "3 s without a line of output" in finished.output and "stopped after 50 s" not in finished.output


@pytest.mark.timeout(60)
def test_silence_waits_for_a_first_line_and_a_job_that_finishes_keeps_all_its_output(monkeypatch, tmp_path):
    _temporary_directory(monkeypatch, tmp_path)
    # silence=5 against a first line after the agent's start and 6 s more: the wait for a first line is shown; after
    # the last line the agent tears down without a line of its own, which took over 2 s beside two busy loops (stop
    # 60's busy gate C)
    finished = torchrun.single_node(["--no-python", "sh", "-c", "sleep 6; seq 1 3000"], nproc_per_node=1,
                                    timeout=50, silence=5)
    assert finished.returncode == 0 and "stopped after" not in finished.output
    assert list(tmp_path.iterdir()) == [], "torchrun's logs left in the temporary directory"
    assert [int(line.split(":")[-1]) for line in finished.output.splitlines() if "]:" in line] == list(range(1, 3001))


def _ranks_running(argument):
    """The pids of the ranks ``--no-python sleep ARGUMENT`` started: processes whose own command is ``sleep``, not
    the agents, whose command lines hold the same words from the moment they start."""
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[:2] == ["sleep", argument]]


@pytest.mark.timeout(60)
def test_an_interrupt_while_waiting_stops_the_job(monkeypatch):
    import psutil

    real_sleep = time.sleep

    def interrupt_the_wait(seconds):  # the wait, once the rank runs: as the notebook's stop button, mid-wait
        if sys._getframe(1).f_code.co_name == "_finish" and _ranks_running("61.25"):
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", interrupt_the_wait)
    with pytest.raises(KeyboardInterrupt):
        torchrun.single_node(["--no-python", "sleep", "61.25"], nproc_per_node=1, timeout=50)
    monkeypatch.undo()
    deadline = time.monotonic() + 20
    while (left := [p for p in psutil.process_iter(["cmdline"]) if "61.25" in (p.info["cmdline"] or [])]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the job outlived the interrupt: {left}"


@pytest.mark.parametrize("silence", [0, -1, "20", True])
def test_a_silence_that_is_not_a_positive_number_is_refused(silence):
    with pytest.raises(ValueError, match="silence must be a positive number"):
        torchrun.single_node(["train.py"], silence=silence)


def test_train_without_a_runner_name_says_how():
    from dtlib.train import cli

    assert cli.main([]) == 2 and cli.main(["lightning"]) == 2


@pytest.mark.parametrize("command, ok, says", [
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 train.py",
     True, "RANK 4..7"),
    ("torchrun --standalone --nproc_per_node=4 train.py", False, "one node only"),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=2 --master_addr=10.0.0.1 --master_port=29500 train.py",
     False, "count from 0"),
    ("torchrun --nnodes=2 --nproc_per_node=4 --master_addr=10.0.0.1 --master_port=29500 train.py", False,
     "--node_rank is missing"),
    ("python train.py", False, "`python train.py` starts one process and no rendezvous"),
    ("", False, "one string"),
    # every spelling torchrun's own parser accepts is right
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port 29500 train.py",
     True, "RANK 4..7"),
    ("torchrun --nnodes 2 --nproc-per-node 4 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 train.py",
     True, "RANK 4..7"),
    ("python -m torch.distributed.run --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 "
     "--master_port=29500 train.py --lr 0.1", True, "RANK 4..7"),
    ("torchrun --nnodes=2:2 --nproc_per=4 --node_r=1 --master_a=10.0.0.1 --master_p=29500 train.py", True,
     "RANK 4..7"),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 train.py", True,
     "--master_port left out"),
    # what torchrun's parser refuses, in argparse's words
    ("torchrun --bogus train.py", False, "torchrun would refuse this line: unrecognized arguments: --bogus"),
    ("torchrun --master_port=abc train.py", False, "invalid int value: 'abc'"),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500", False,
     "the following arguments are required: training_script"),
    # the existing diagnoses, whatever the spelling
    ("torchrun --nnodes 2 --nproc_per_node 4 --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 train.py",
     False, "--node_rank=0 should be 1 (node ranks count from 0)"),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29501 train.py",
     False, "--master_port=29501 should be 29500."),
    ("torchrun --nnodes=1:2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 train.py",
     False, "--nnodes=1:2 should be 2."),
    ("torchrun --nnodes=2 --nproc_per_node=4 --master-addr 10.0.0.1 --master_port=29500 train.py", False,
     "--node_rank is missing: this job needs 1, and without it torchrun uses 0."),
    ("torchrun train.py --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500",
     False, "--nnodes=2 comes after train.py, so it goes to train.py"),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 main.py",
     False, "End with the script, train.py"),
    # torchrun reads its store from --rdzv_endpoint when given (get_rdzv_endpoint), and c10d ignores node_rank:
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 "
     "--rdzv_endpoint=10.0.0.2:1234 train.py", False, "--rdzv_endpoint=10.0.0.2:1234 wins over --master_addr"),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 "
     "--rdzv_backend=c10d train.py", False, "--rdzv_backend=c10d: this job numbers its nodes by hand"),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --rdzv_endpoint=10.0.0.1:29500 --rdzv_backend=static "
     "--master_addr=10.0.0.1 train.py", True, "Right"),
    # the endpoint alone is enough: a static rendezvous takes the store's address from it
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --rdzv_endpoint=10.0.0.1:29500 train.py", True, "Right"),
    # one command over several lines, as a shell script writes it
    ("torchrun --nnodes=2 --nproc_per_node=4 \\\n    --node_rank=1 --master_addr=10.0.0.1 \\\n    --master_port=29500 "
     "train.py", True, "Right"),
    ("python -m torch.distributed.launch --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 "
     "--master_port=29500 train.py", False, "torchrun's deprecated predecessor"),
    ("   ", False, "Write the command as one string"),
])
def test_exercise_checker(command, ok, says):
    verdict = checks.torchrun_command(command)
    assert isinstance(verdict, Feedback) and verdict.ok is ok and says in verdict.message, verdict.message


def test_exercise_checker_agrees_with_torchruns_parser():
    """The oracle: what torchrun's own parser reads from each accepted spelling is the job's settings."""
    import shlex

    from torch.distributed.run import get_args_parser

    spellings = [
        "--nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500",
        "--nnodes 2 --nproc-per-node 4 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500",
        "--nnodes=2 --nproc_per=4 --node_r=1 --master_a=10.0.0.1 --master_p=29500",
    ]
    for options in spellings:
        args = get_args_parser().parse_args([*shlex.split(options), "train.py"])
        assert (args.nnodes, args.nproc_per_node, args.node_rank, args.master_addr, args.master_port) == (
            "2", "4", 1, "10.0.0.1", 29500)
        assert checks.torchrun_command(f"torchrun {options} train.py").ok


def test_bad_node_settings():
    with pytest.raises(ValueError, match="nnodes must be >= 1"):
        torchrun.simulate_nodes(["x.py"], nnodes=0)
    with pytest.raises(ValueError, match="rendezvous must be"):
        torchrun.simulate_nodes(["x.py"], rendezvous="etcd")


@pytest.mark.parametrize("call, message", [
    (lambda: torchrun.single_node("train.py"), "target must be a non-empty list of strings"),
    (lambda: torchrun.single_node([]), "target must be a non-empty list of strings"),
    (lambda: torchrun.single_node(["x.py", 3]), "target must be a non-empty list of strings"),
    (lambda: torchrun.single_node(["x.py"], nproc_per_node=0), "nproc_per_node must be >= 1"),
    (lambda: torchrun.single_node(["x.py"], nproc_per_node=1.5), r"nproc_per_node must be a whole number"),
    (lambda: torchrun.single_node(["x.py"], timeout=-1), "timeout must be a positive number of seconds"),
    (lambda: torchrun.single_node(["x.py"], timeout=None), "a torchrun job that hangs would hang the caller"),
    (lambda: torchrun.simulate_nodes("x.py"), "target must be a non-empty list of strings"),
    (lambda: torchrun.simulate_nodes(["x.py"], nproc_per_node=-2), "nproc_per_node must be >= 1"),
    (lambda: torchrun.single_node(["x.py"], options="--max_restarts=1"), "options must be a list"),
    (lambda: torchrun.single_node(["x.py"], options=["--bogus"]), "unrecognized arguments: --bogus"),
    (lambda: torchrun.single_node(["x.py"], options=["--max_restarts=two"]), "invalid int value"),
    (lambda: torchrun.single_node(["x.py"], options=["--nproc_per_node=4"]), "--nproc_per_node is set by this"),
    (lambda: torchrun.simulate_nodes(["x.py"], options=["--rdzv_id=7"]), "--rdzv_id is set by this"),
    (lambda: torchrun.single_node(["x.py"], options=["y.py"]), "torchrun's options only, not the script"),
    (lambda: torchrun.single_node(["x.py"], options=["--max_restarts=1"], restart_fix="no"),
     "restart_fix must be True or False"),
])
def test_the_helpers_check_their_arguments_before_starting_anything(monkeypatch, call, message):
    monkeypatch.setattr(torchrun.subprocess, "Popen", lambda *a, **k: pytest.fail("torchrun started"))
    with pytest.raises(ValueError, match=message):
        call()


def test_failure_report_shows_each_failed_ranks_own_lines_then_the_summary():
    """A SIGABRT's reason is in the rank's own lines, not in the summary's tail."""
    output = "\n".join(["[default0]:step 1", "[default1]:terminate called without an active exception",
                        *[f"[default0]:noise {i}" for i in range(100)],
                        "Failures:", "[1]:", "  rank      : 0 (local_rank: 0)", "  exitcode  : -15 (pid: 7)",
                        "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
                        "  exitcode  : -6 (pid: 8)"])
    report = failure_report(torchrun.Finished("torchrun x", 1, output), lines=3)
    assert "terminate called without an active exception" in report
    assert "local rank 1 (exit code -6)" in report and "local rank 0 (exit code -15)" in report
    assert "noise 99" in report and "noise 96" not in report
    assert report.rstrip().endswith("exitcode  : -6 (pid: 8)") and "step 1" not in report


def test_restart_fix_is_set_where_restarts_are_allowed_unless_turned_off(monkeypatch):
    monkeypatch.delenv(torchrun.RESTART_FIX[0], raising=False)
    assert torchrun._torchrun_options(["--max_restarts=1"])[1] == dict([torchrun.RESTART_FIX])
    assert torchrun._torchrun_options(["--max_restarts=1"], restart_fix=False)[1] == {}
    assert torchrun._torchrun_options([])[1] == {}  # no restarts allowed: nothing to fix


def test_json_records_are_every_ranks_json_lines_and_nothing_else():
    output = "\n".join(['[default0]:{"rank": 0, "step": 1}', '[default1]:{"rank": 1, "step": 1}', "W1129 a warning",
                        '[default1]:{not json}', '[default0]:[1, 2]', '[default10]:{"rank": 10, "step": 2}',
                        '{"plain": true}'])
    run = torchrun.Finished("torchrun x.py", 0, output)
    assert torchrun.json_records(run) == [{"rank": 0, "step": 1}, {"rank": 1, "step": 1}, {"rank": 10, "step": 2},
                                          {"plain": True}]
    assert torchrun.json_records([run, run]) == torchrun.json_records(run) * 2


ELASTIC = """
import json, os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(json.dumps({"attempt": attempt, "world": dist.get_world_size(), "pid": os.getpid()}), flush=True)
if attempt == 0:
    time.sleep(3)   # every rank: the moment its node may be killed
total = torch.ones(1)
dist.all_reduce(total)
print(json.dumps({"attempt": attempt, "sum": total.item()}), flush=True)
dist.destroy_process_group()
"""
#: Fast on one machine: a node is dead after 2 missed heartbeats of 1 s, and a round closes 5 s after its first
#: node joined (long enough for both nodes, started together, to join the first round on a busy machine).
FAST_RENDEZVOUS = "--rdzv_conf=last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"


def _gone(pids, deadline_s=15.0):
    import psutil

    deadline = time.monotonic() + deadline_s
    while (alive := [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _store_servers(finished):
    import psutil

    port = re.search(r"--rdzv_endpoint=127\.0\.0\.1:(\d+)", finished[0].command).group(1)
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if f"{port}, is_master=True" in " ".join(p.info["cmdline"] or [])]


# An elastic job whose store runs apart, one of its two nodes killed whole, going on at world size 1 (exit codes
# [-9, 0], world size 2 then 1, each loss after the shrink the uninterrupted run's mean of two ranks') is notebook
# 16's checked cell; a separate store gone when the call returns is checked after a timeout below (the call ends
# the store in the same `finally` however its nodes ended).


@pytest.mark.timeout(120)
def test_killing_the_node_that_serves_the_store_ends_the_survivor_too(monkeypatch, tmp_path):
    """Two c10d nodes (the command names no --node_rank), --nnodes=1:2, the node whose agent serves the store
    killed whole (agent and rank) while every rank waits: the survivor's agent cannot reach the store, fails
    without a second attempt, and no rank outlives the call, nor anything left in the temporary directory."""
    (tmp_path / "elastic.py").write_text(ELASTIC)
    _temporary_directory(monkeypatch, tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    finished = torchrun.simulate_nodes([str(tmp_path / "elastic.py")], 2, min_nodes=1, kill=("host", '"attempt": 0'),
                                       options=["--max_restarts=1", FAST_RENDEZVOUS], timeout=90)
    host = [f for f in finished if "it served the rendezvous store" in f.output]
    assert len(host) == 1 and host[0].returncode == -9
    assert "), its agent and the 1 process below it, with SIGKILL" in host[0].output
    other = finished[1 - finished.index(host[0])]
    assert other.returncode == 1 and "RendezvousConnectionError" in other.output
    assert not [r for r in torchrun.json_records(other) if r.get("attempt") == 1]
    for node in finished:
        assert "--nnodes=1:2 --rdzv_backend=c10d" in node.command and "--node_rank" not in node.command
    assert not _gone([r["pid"] for r in torchrun.json_records(finished) if "pid" in r])
    assert list((tmp_path / "tmp").iterdir()) == [], "left in the temporary directory"


@pytest.mark.timeout(60)
def test_a_hanging_job_is_stopped_at_its_timeout_and_takes_its_separate_store_with_it():
    """single_node and simulate_nodes wait in the same loop (_finish): this checks its timeout for both."""
    finished = torchrun.simulate_nodes(["--no-python", "sleep", "61.75"], 2, min_nodes=1, store="apart", timeout=6,
                                       options=["--rdzv_conf=is_host=false"])
    assert all(f.returncode != 0 and "stopped after 6 s" in f.output for f in finished), [f.output for f in finished]
    import psutil

    sleeping = [p.pid for p in psutil.process_iter(["cmdline"]) if "61.75" in (p.info["cmdline"] or [])]
    assert not _gone(sleeping) and not _store_servers(finished)


@pytest.mark.parametrize("kwargs, message", [
    ({"kill": (2, "x")}, "kill must be"), ({"kill": (0, "")}, "kill must be"), ({"kill": "host"}, "kill must be"),
    ({"kill": (True, "x")}, "kill must be"), ({"kill": ("host", "x"), "store": "apart"}, "needs store='agent'"),
    ({"store": "etcd"}, "store must be"), ({"min_nodes": 3}, "min_nodes must be at most nnodes"),
    ({"min_nodes": 0}, "min_nodes must be >= 1"), ({"min_nodes": 1, "rendezvous": "static"}, "need rendezvous='c10d'"),
    ({"absent": 2}, "absent must be less than nnodes"), ({"absent": -1}, "absent must be >= 0"),
    ({"absent": 1, "kill": (1, "x")}, "kill must be"),
])
def test_bad_elastic_settings_are_refused_before_anything_starts(monkeypatch, kwargs, message):
    monkeypatch.setattr(torchrun.subprocess, "Popen", lambda *a, **k: pytest.fail("torchrun started"))
    with pytest.raises(ValueError, match=message):
        torchrun.simulate_nodes(["x.py"], 2, **kwargs)


@pytest.mark.timeout(60)
def test_an_interrupt_while_nodes_run_ends_every_agent_rank_and_the_separate_store(monkeypatch):
    import psutil

    real_sleep, servers = time.sleep, []
    real_server = torchrun._store_server

    def remember(port):
        servers.append(real_server(port))
        return servers[-1]

    def interrupt_the_wait(seconds):  # the nodes' wait, once their ranks run: as the notebook's stop button
        if sys._getframe(1).f_code.co_name == "_finish" and len(_ranks_running("61.5")) == 2:
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(torchrun, "_store_server", remember)
    monkeypatch.setattr(time, "sleep", interrupt_the_wait)
    with pytest.raises(KeyboardInterrupt):
        torchrun.simulate_nodes(["--no-python", "sleep", "61.5"], 2, min_nodes=1, store="apart", timeout=50,
                                options=["--rdzv_conf=is_host=false"])
    monkeypatch.undo()
    sleeping = [p.pid for p in psutil.process_iter(["cmdline"]) if "61.5" in (p.info["cmdline"] or [])]
    assert servers and servers[0].poll() is not None, "the store outlived the interrupt"
    assert not _gone(sleeping), "a rank outlived the interrupt"


def test_a_store_whose_port_another_process_holds_is_named_and_nothing_starts(monkeypatch):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(torchrun, "free_port", lambda: taken.getsockname()[1])
        with pytest.raises(RuntimeError, match=rf"could not start on port {taken.getsockname()[1]}: .*"):
            torchrun.simulate_nodes(["x.py"], 2, min_nodes=1, store="apart", timeout=60)


def _notebook_16_scripts(folder):
    """The files notebook 16 writes (train_resume.py, faults.py), from its own %%writefile cells (``-a``: appended
    to the file, as IPython does, each cell's text ending in a newline)."""
    import json
    from pathlib import Path

    notebook = Path(__file__).parents[2] / "notebooks" / "16_when_a_rank_dies.ipynb"
    for cell in json.loads(notebook.read_text())["cells"]:
        text = "".join(cell["source"])
        if text.startswith("%%writefile "):
            magic, body = text.split("\n", 1)
            *options, name = magic.split()[1:]
            with open(folder / name, "a" if options == ["-a"] else "w") as file:
                file.write(body.rstrip("\n") + "\n")
    return str(folder / "train_resume.py")


@pytest.fixture(scope="module")
def notebook_16s_job_killed_after_step_6(tmp_path_factory):
    """Notebook 16's script on 2 ranks, rank 1 killed after step 6, no restarts: run once, for the two tests below.
    Returns its folder (the scripts, and ckpt/ with its checkpoints) and the job; a test that would write in that
    folder copies it first."""
    folder = tmp_path_factory.mktemp("notebook_16_kill_6")
    script = _notebook_16_scripts(folder)
    job = torchrun.single_node([script, "--folder", str(folder / "ckpt"), "--fault", "kill:6"],
                               options=["--max_restarts=0"], timeout=90)
    return folder, job


@pytest.mark.timeout(120)
def test_notebook_16s_script_without_restarts_fails_clearly_with_each_ranks_exit(notebook_16s_job_killed_after_step_6):
    """Rank 1 is killed (SIGKILL). Rank 0 ends one of two ways, by timing: the agent sees rank 1's death first and
    stops rank 0 (SIGTERM, -15), or rank 0 first meets the broken connection ("Connection reset by peer") and
    fails on its own, aborting as it exits (SIGABRT, -6) or exiting 1; torchrun then names rank 0 as the "first
    observed failure". The second came in one busy fresh clone of three (stop 67)."""
    folder, job = notebook_16s_job_killed_after_step_6
    codes = torchrun.exit_codes(job)
    assert job.returncode == 1 and codes[1] == -9 and codes[0] in (-15, -6, 1), job.output[-3000:]
    assert "Root Cause" in job.output and "exitcode  : -9" in job.output  # the summary, as torchrun words it
    assert max(r["step"] for r in torchrun.json_records(job)) == 6
    assert (folder / "ckpt" / "latest").read_text() == "4"  # the last complete checkpoint, for a later resume


@pytest.mark.timeout(150)
def test_notebook_16s_checkpoint_of_two_ranks_resumes_on_three(notebook_16s_job_killed_after_step_6, tmp_path):
    """DCP reshards on load: a checkpoint written by 2 ranks resumes on 3, each taking its rows of the step."""
    import shutil

    written, first = notebook_16s_job_killed_after_step_6
    assert first.returncode == 1 and (written / "ckpt" / "latest").read_text() == "4"
    shutil.copytree(written, tmp_path, dirs_exist_ok=True)  # the resume writes its checkpoints in a copy
    again = torchrun.single_node([str(tmp_path / "train_resume.py"), "--folder", str(tmp_path / "ckpt")],
                                 nproc_per_node=3, timeout=90)
    assert again.returncode == 0, again.output[-3000:]
    records = torchrun.json_records(again)
    assert {r["world"] for r in records} == {3} and sorted({r["step"] for r in records}) == list(range(5, 13))


@pytest.mark.timeout(150)
def test_notebook_16s_resume_refuses_a_checkpoint_file_changed_since_it_was_written(
        notebook_16s_job_killed_after_step_6, tmp_path):
    """DCP stores no checksum: one flipped byte in a rank's part would load as a changed weight. The script
    records every file's SHA-256 before its marker names the checkpoint, and its resume checks them first: the
    job fails before training, naming the file, and no loss is printed from the changed weights."""
    import shutil

    written, first = notebook_16s_job_killed_after_step_6
    assert first.returncode == 1 and (written / "ckpt" / "latest").read_text() == "4"
    shutil.copytree(written, tmp_path, dirs_exist_ok=True)
    checkpoint = tmp_path / "ckpt" / "step-4"
    assert "__1_0.distcp" in (checkpoint / "SHA256SUMS").read_text()  # every rank's part, recorded
    part = bytearray((checkpoint / "__1_0.distcp").read_bytes())
    part[len(part) // 2] ^= 0x01  # one bit, in the middle of rank 1's tensors
    (checkpoint / "__1_0.distcp").write_bytes(bytes(part))
    again = torchrun.single_node([str(tmp_path / "train_resume.py"), "--folder", str(tmp_path / "ckpt")],
                                 timeout=90)
    assert again.returncode == 1, again.output[-3000:]
    assert "ChangedFile" in again.output and "__1_0.distcp changed since it was written" in again.output
    assert not [r for r in torchrun.json_records(again) if "step" in r]


@pytest.mark.timeout(150)
def test_notebook_16s_rank_lost_at_a_checkpoint_step_resumes_from_the_checkpoint_before(tmp_path):
    """Killed after step 8's training, before its save: rank 0 fails inside dcp.save, the marker still names
    step 4, and the restart runs steps 5 to 8 again, to the same losses. Steps lost: 4, not 8 mod 4."""
    script = _notebook_16_scripts(tmp_path)
    job = torchrun.single_node([script, "--folder", str(tmp_path / "ckpt"), "--fault", "kill:8"],
                               options=["--max_restarts=1"], timeout=120)
    assert job.returncode == 0, job.output[-3000:]
    records = torchrun.json_records(job)
    first = {(r["rank"], r["step"]): r["loss"] for r in records if r["attempt"] == 0}
    again = {(r["rank"], r["step"]): r["loss"] for r in records if r["attempt"] == 1}
    assert max(step for _, step in first) == 8 and min(step for _, step in again) == 5
    assert all(again[key] == loss for key, loss in first.items() if key[1] >= 5)
    assert (tmp_path / "ckpt" / "latest").read_text() == "12"


@pytest.fixture(scope="module")
def notebook_16s_uninterrupted_run(tmp_path_factory):
    """Notebook 16's script on 2 ranks with no fault, run once (with --async-save) as the reference of the tests
    below that compare a resumed job's losses with an uninterrupted run's. The losses are the same whichever way
    it saves: a save only reads the weights, and nothing in an uninterrupted run loads. Returns its checkpoints'
    folder and the job."""
    folder = tmp_path_factory.mktemp("notebook_16_whole")
    script = _notebook_16_scripts(folder)
    whole = torchrun.single_node([script, "--folder", str(folder / "whole"), "--async-save"], timeout=120)
    return folder / "whole", whole


#: A fault of the test's own, beside notebook 16's: rank 1 killed (SIGKILL) inside DCP's write of its part, after
#: two of its tensors reached the file and before the rest did.
_KILLED_MID_SAVE = """

def _die_mid_save():
    import torch.distributed.checkpoint.filesystem as filesystem

    real, written = filesystem._write_item, []

    def write_item(transforms, stream, *args, **kwargs):
        result = real(transforms, stream, *args, **kwargs)
        written.append(result)
        if len(written) == 2:
            stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    filesystem._write_item = write_item


_notebooks_after_step = after_step


def after_step(fault, step, attempt, rank):
    kind, _, at = fault.partition(":")
    if kind == "killsave" and attempt == 0 and rank == 1 and step == int(at):
        _die_mid_save()
    else:
        _notebooks_after_step(fault, step, attempt, rank)
"""


@pytest.mark.timeout(180)
def test_notebook_16s_rank_killed_inside_its_checkpoint_write_leaves_a_folder_no_resume_reads(
        notebook_16s_uninterrupted_run, tmp_path):
    """Rank 1 dies inside dcp.save at step 8, its file cut short: the step-8 folder has parts and no .metadata,
    the marker still names step 4, and a new job resumes from step 4 to every loss of an uninterrupted run."""
    script = _notebook_16_scripts(tmp_path)
    with open(tmp_path / "faults.py", "a") as faults:
        faults.write(_KILLED_MID_SAVE)
    folder = tmp_path / "ckpt"
    _, whole = notebook_16s_uninterrupted_run
    assert whole.returncode == 0, failure_report(whole)
    reference = {(r["rank"], r["step"]): r["loss"] for r in torchrun.json_records(whole)}
    cut = torchrun.single_node([script, "--folder", str(folder), "--fault", "killsave:8"],
                               options=["--max_restarts=0"], timeout=90)
    assert cut.returncode == 1 and torchrun.exit_codes(cut).get(1) == -9, cut.output[-3000:]
    parts = {path.name: path.stat().st_size for path in (folder / "step-8").iterdir()}
    assert ".metadata" not in parts and parts.get("__1_0.distcp", 0) > 0, parts
    assert parts["__1_0.distcp"] < (folder / "step-4" / "__1_0.distcp").stat().st_size  # cut short
    assert (folder / "latest").read_text() == "4"
    again = torchrun.single_node([script, "--folder", str(folder)], timeout=90)
    assert again.returncode == 0, again.output[-3000:]
    resumed = {(r["rank"], r["step"]): r["loss"] for r in torchrun.json_records(again)}
    assert min(step for _, step in resumed) == 5 and all(reference[key] == loss for key, loss in resumed.items())
    assert (folder / "latest").read_text() == "12" and (folder / "step-8" / ".metadata").exists()


#: Another fault of the test's own: rank 1's writer thread held inside step STEP's async save (it waits on an event
#: that is never set, before writing a byte of that folder), and rank 1 killed (SIGKILL) after step STEP + 1, the
#: save still in flight. Rank 0 has run step STEP + 1's all-reduce with rank 1 by then, so it is past step STEP's
#: save too. Only step STEP's writes are held: the previous save's thread may not have written yet either.
_KILLED_WITH_A_SAVE_IN_FLIGHT = """

def _hold_writes(folder):
    import threading

    import torch.distributed.checkpoint.filesystem as filesystem

    real, never = filesystem._write_item, threading.Event()

    def write_item(transforms, stream, *args, **kwargs):
        if f"/{folder}/" in str(stream.name):
            never.wait()
        return real(transforms, stream, *args, **kwargs)

    filesystem._write_item = write_item


_notebooks_own_after_step = after_step


def after_step(fault, step, attempt, rank):
    kind, _, at = fault.partition(":")
    if kind != "killinflight" or attempt > 0 or rank != 1:
        _notebooks_own_after_step(fault, step, attempt, rank)
    elif step == int(at):
        _hold_writes(f"step-{at}")
    elif step == int(at) + 1:
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(240)
def test_notebook_16s_rank_killed_with_an_async_save_in_flight_resumes_from_the_checkpoint_before(
        notebook_16s_uninterrupted_run, tmp_path):
    """--async-save: rank 1 dies after step 9, its writer thread still inside step 8's save. The marker names a
    checkpoint only once its future's result() returned, so it still names step 4 (written when step 8's save
    began); torchrun restarts both ranks, they resume from step 4, and every loss equals an uninterrupted run's
    (with --async-save too: it ends with every rank's 12 steps and its marker naming step 12)."""
    script = _notebook_16_scripts(tmp_path)
    with open(tmp_path / "faults.py", "a") as faults:
        faults.write(_KILLED_WITH_A_SAVE_IN_FLIGHT)
    whole_folder, whole = notebook_16s_uninterrupted_run
    assert whole.returncode == 0, failure_report(whole)
    reference = {(r["rank"], r["step"]): r["loss"] for r in torchrun.json_records(whole)}
    assert len(reference) == 24 and (whole_folder / "latest").read_text() == "12"
    folder = tmp_path / "ckpt"
    job = torchrun.single_node([script, "--folder", str(folder), "--async-save", "--fault", "killinflight:8"],
                               options=["--max_restarts=1"], timeout=180)
    assert job.returncode == 0, failure_report(job)
    records = torchrun.json_records(job)
    first = [(r["rank"], r["step"]) for r in records if r["attempt"] == 0]
    again = {(r["rank"], r["step"]): r["loss"] for r in records if r["attempt"] == 1}
    assert max(step for rank, step in first if rank == 1) == 9, first  # killed after step 9, not before
    assert sorted(again) == [(rank, step) for rank in (0, 1) for step in range(5, 13)], sorted(again)
    assert all(reference[key] == loss for key, loss in again.items())
    assert (folder / "latest").read_text() == "12" and (folder / "step-8" / ".metadata").exists()


@pytest.mark.timeout(90)
def test_a_node_that_never_comes_ends_the_rendezvous_at_its_join_timeout_with_torchs_own_error():
    finished = torchrun.simulate_nodes(["--no-python", "true"], 2, absent=1, timeout=60,
                                       options=["--rdzv_conf=join_timeout=2"])
    assert len(finished) == 1 and finished[0].returncode == 1 and "stopped after" not in finished[0].output
    assert "RendezvousTimeoutError" in finished[0].output, finished[0].output[-2000:]


@pytest.mark.timeout(60)
def test_an_interrupt_while_the_separate_store_starts_ends_it(monkeypatch):
    import psutil

    from dtlib.launch.processes import free_port

    port, real_sleep = free_port(), time.sleep

    def interrupt_the_store_start(seconds):
        if sys._getframe(1).f_code.co_name == "_store_server":
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(torchrun, "free_port", lambda: port)
    monkeypatch.setattr(time, "sleep", interrupt_the_store_start)
    with pytest.raises(KeyboardInterrupt):
        torchrun.simulate_nodes(["x.py"], 2, min_nodes=1, store="apart", timeout=30)
    monkeypatch.undo()
    left = _store_servers([torchrun.Finished(f"torchrun --rdzv_endpoint=127.0.0.1:{port}", 0, "")])
    assert not [pid for pid in left if psutil.Process(pid).status() != "zombie"], "the store outlived the interrupt"
