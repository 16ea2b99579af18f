"""dtlib.checks.torchrun_command (notebook 07): every form the shell and torchrun accept is right; each kind of
wrong answer is refused with what it did wrong. The oracle is bash itself running each banked line against
stand-in programs, whose arguments torchrun's own parser then reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import get_args_parser

from dtlib import checks

JOB = {"nnodes": 2, "nproc_per_node": 4, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29500}
OPTIONS = "--nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500"
HYPHENS = "--nnodes 2 --nproc-per-node 4 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500"
STORE_ON = "--nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr={addr} --master_port=29500"

#: (command, whether bash can run it against the stand-ins: every program it starts is torchrun, python, python3)
RIGHT = [
    (f"OMP_NUM_THREADS=8 torchrun {OPTIONS} train.py", True),  # an environment prefix
    (f"torchrun {OPTIONS} ./train.py", True),
    (f"torchrun {OPTIONS} /home/me/project/train.py --epochs 3", True),  # absolute path, then the script's own
    (f"python -m torch.distributed.run {HYPHENS} train.py", True),  # hyphens, --opt value
    (f"python3 -m torch.distributed.run {OPTIONS} ./train.py --lr 0.1", True),
    ("torchrun --nnodes=2 \\\n  --nproc-per-node=4 \\\n  --node-rank=1 \\\n"
     "  --master-addr=10.0.0.1 --master-port=29500 \\\n  train.py", True),  # line continuations
    ("torchrun --nnodes=2:2 --nproc_per=4 --node_r=1 --master_a=10.0.0.1 train.py", True),  # abbreviations, 2:2
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --rdzv-endpoint=10.0.0.1:29500 train.py", True),
    ("PET_NNODES=2 PET_NODE_RANK=1 torchrun --nproc-per-node 4 --master-addr 10.0.0.1 train.py", True),
    (f"env CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun {OPTIONS} train.py 2>&1 | tee log.txt", True),
    (f"cd / && torchrun {OPTIONS} train.py  # the second machine", True),
    ("export NODE_RANK=1\ntorchrun --nnodes=2 --nproc-per-node=gpu --node-rank=$NODE_RANK --master-addr=10.0.0.1 "
     "train.py", True),  # a variable set on the line before; gpu counts the machine's 4 GPUs
    (f"nohup torchrun {OPTIONS} 'train.py' > out.log &\nwait", True),
    (f"python3 -u -m torch.distributed.run {OPTIONS} -m train", True),  # python's own flag, the script as a module
    (f"/opt/conda/bin/torchrun {OPTIONS} train.py", False),
    (f"/usr/bin/python3.11 -m torch.distributed.run {OPTIONS} train.py", False),
    (f"!torchrun {OPTIONS} train.py", False),  # a notebook cell's shell escape
    (f"uv run torchrun {OPTIONS} train.py", False),  # torchrun of the project's environment
    (f"torchrun {OPTIONS} --no-python python3 -u train.py", True),  # torchrun starts python itself, as told
    (f"conda run -n train --no-capture-output torchrun {OPTIONS} train.py", False),  # a conda environment's
    (f"sudo -E -u trainer torchrun {OPTIONS} train.py", False),  # as another user, keeping the environment
    (f"bash -c 'torchrun {OPTIONS} train.py'", True),  # a command line of its own, as a SLURM script writes it
    (f"OMP_NUM_THREADS=8 sh -c \"torchrun {OPTIONS} train.py > log.txt\"", True),
]

#: (command, what the message must say, whether bash can run it against the stand-ins)
WRONG = [
    (f"torchrun {STORE_ON.replace('nnodes=2', 'nnodes=1').format(addr='10.0.0.1')} train.py",
     "--nnodes=1 should be 2: the number of machines", True),
    (f"torchrun {STORE_ON.replace('nnodes=2', 'nnodes=8').format(addr='10.0.0.1')} train.py",
     "8 is the number of ranks, machines x GPUs", True),
    (f"torchrun {STORE_ON.replace('per_node=4', 'per_node=8').format(addr='10.0.0.1')} train.py",
     "8 is the whole job's ranks", True),
    (f"torchrun {OPTIONS.replace('rank=1', 'rank=0')} train.py", "0 is the first machine", True),
    (f"torchrun {OPTIONS.replace('rank=1', 'rank=2')} train.py", "(node ranks count from 0)", True),
    (f"torchrun train.py {OPTIONS}", "--nnodes=2 comes after train.py, so it goes to train.py", True),
    (f"torchrun {OPTIONS}", "There is no script", True),
    ("python train.py", "`python train.py` starts one process and no rendezvous", True),
    ("OMP_NUM_THREADS=8 python3 ./train.py --nnodes=2", "`python3 ./train.py` starts one process", True),
    ("./train.py", "`./train.py` runs the script alone", False),
    (f"python -m torch.distributed.launch {OPTIONS} train.py", "torchrun's deprecated predecessor", True),
    ("torchrun --standalone --nproc_per_node=4 train.py", "one node only", True),
    (f"torchrun {STORE_ON.format(addr='localhost')} train.py", "localhost is this machine itself", True),
    (f"torchrun {STORE_ON.format(addr='10.0.0.1:29500')} train.py", "the port goes in --master_port", True),
    ("MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 train.py",
     "MASTER_ADDR=10.0.0.1 in front does not set it", True),
    ("NODE_RANK=1 torchrun --nnodes=2 --nproc_per_node=4 --master_addr=10.0.0.1 train.py",
     "--node_rank is missing: this job needs 1", True),
    ("NODE_RANK=1 torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$NODE_RANK --master_addr=10.0.0.1 train.py",
     "The shell expands $NODE_RANK before NODE_RANK=1 in front of the command takes effect", True),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=$HEAD train.py",
     "shell variable this answer never sets", True),
    ("torchrun --nnodes 2 4 --node_rank=1 --master_addr=10.0.0.1 train.py", "one value too many", True),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --rdzv_backend=c10d --rdzv_endpoint=10.0.0.1:29500 "
     "train.py", "--rdzv_backend=c10d: this job numbers its nodes by hand", True),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --rdzv_endpoint=10.0.0.1 train.py", "has no port", True),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --rdzv_endpoint=10.0.0.2:29500 train.py",
     "wins over --master_addr", True),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --rdzv_endpoint=:29500 train.py", "names no machine",
     True),
    ("torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --rdzv_endpoint=10.0.0.1:port train.py",
     "the port after the colon must be a whole number", True),
    (f"torchrun {OPTIONS.replace('rank=1', 'rank=0')} train.py\ntorchrun {OPTIONS} train.py",
     "starts torchrun 2 times", True),
    (f"python -m torchrun {OPTIONS} train.py", "There is no module named torchrun", True),
    (f"srun torchrun {OPTIONS} train.py", "This line runs `srun`, not torchrun", False),
    (f"torchrun {OPTIONS} main.py", "End with the script, train.py", True),
    (f"torchrun {OPTIONS} 'train.py", "The shell could not read this line: No closing quotation", False),
    ("torchrun --nnodes=1:2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 train.py",
     "A range min:max is for elastic jobs", True),
    ("torchrun --nnodes=2 --nproc_per_node=cpu --node_rank=1 --master_addr=10.0.0.1 train.py",
     "cpu starts one rank per CPU core", True),
    ("torchrun --nodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=10.0.0.1 train.py",
     "torchrun would refuse this line: unrecognized arguments: --nodes=2", True),
    ("PET_NODE_RANK=0 torchrun --nnodes=2 --nproc_per_node=4 --master_addr=10.0.0.1 train.py",
     "PET_NODE_RANK=0 in front of torchrun sets --node_rank: --node_rank=0 should be 1", True),
    (f"torchrun {STORE_ON.replace('29500', '29400').format(addr='10.0.0.1')} train.py",
     "--master_port=29400 should be 29500", True),
    ("PET_NODE_RANK=one torchrun --nnodes=2 --nproc_per_node=4 --master_addr=10.0.0.1 train.py",
     "PET_NODE_RANK=one in front sets its options, and argument --node-rank/--node_rank: invalid int value", True),
    (f"torchrun {OPTIONS} -m train.py", "a module's name has no .py", True),
    (f"torchrun {OPTIONS} --no-python train.py", "start train.py itself as a program, with no python", True),
    (f"torchrun {OPTIONS} --no-python -m train", "torchrun refuses --no-python with -m", True),
    (f"torchrun --rdzv_backend=etcd {OPTIONS} train.py", "etcd needs an etcd server", True),
    (f"torchrun --rdzv_backend=STATIC {OPTIONS} train.py", "no rendezvous backend named STATIC (its names are lower",
     True),
    (f"torchrun \u2013-nnodes=2 {OPTIONS.removeprefix('--nnodes=2 ')} train.py", "starts with an en dash (\u2013)",
     True),
]


@pytest.mark.parametrize("command", [command for command, _ in RIGHT])
def test_right_answers_in_every_form_the_shell_and_torchrun_accept(command):
    verdict = checks.torchrun_command(command, **JOB)
    assert verdict.ok and "RANK 4..7" in verdict.message, verdict.message


@pytest.mark.parametrize("command, says", [(command, says) for command, says, _ in WRONG])
def test_wrong_answers_are_refused_saying_what_is_wrong(command, says):
    verdict = checks.torchrun_command(command, **JOB)
    assert not verdict.ok and says in verdict.message, verdict.message


@pytest.mark.parametrize("command", [
    f"torchrun {OPTIONS} --module train.py", f"PET_MODULE=1 torchrun {OPTIONS} train.py",
    f"python -m torch.distributed.run {OPTIONS} -m ./train.py"])
def test_a_module_named_with_its_py_is_refused_in_every_form(command):
    """Review: torchrun -m train.py passed, with a note naming -m train; python then finds no module train.py."""
    verdict = checks.torchrun_command(command, **JOB)
    assert not verdict.ok and "a module's name has no .py" in verdict.message, verdict.message


@pytest.mark.parametrize("command", [f"torchrun {OPTIONS} --no_python ./train.py",
                                     f"PET_NO_PYTHON=1 torchrun {OPTIONS} train.py"])
def test_no_python_before_the_script_itself_is_refused_in_every_form(command):
    """Review: --no-python train.py passed; torchrun then starts train.py as a program, not with python."""
    verdict = checks.torchrun_command(command, **JOB)
    assert not verdict.ok and "itself as a program, with no python" in verdict.message, verdict.message


def test_the_banks_hold_many_kinds_and_forms():
    assert len(RIGHT) >= 5 and len(WRONG) >= 8
    assert len({says for _, says, _ in WRONG}) == len(WRONG)  # each wrong answer has a message of its own


def _stand_in(folder: Path, name: str) -> None:
    """A program that records how it was called (its name, arguments and PET_ variables), in place of ``name``."""
    path = folder / name
    path.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "with open(os.environ['ORACLE_RECORD'], 'a') as record:\n"
                    "    pet = {k: v for k, v in os.environ.items() if k.startswith('PET_')}\n"
                    "    record.write(json.dumps([os.path.basename(sys.argv[0]), sys.argv[1:], pet]) + '\\n')\n")
    path.chmod(0o755)


def _torchrun_reads(program: str, argv: list[str], pet: dict[str, str], monkeypatch) -> object | None:
    """torchrun's parse of what a stand-in got, or None where it was not torchrun or torchrun refuses it."""
    if program.startswith("python"):
        while argv and argv[0].startswith("-") and argv[0] != "-m":  # python's own flags
            argv = argv[1:]
        if argv[:2] != ["-m", "torch.distributed.run"]:
            return None
        argv = argv[2:]
    elif program != "torchrun":
        return None
    with monkeypatch.context() as patch:
        for name in [name for name in os.environ if name.startswith("PET_")]:
            patch.delenv(name)
        for name, value in pet.items():
            patch.setenv(name, value)
        try:
            return get_args_parser().parse_args(argv)  # PET_ defaults are read when the parser is built
        except SystemExit:
            return None


def _oracle(command: str, folder: Path, monkeypatch) -> bool:
    """Does bash, running ``command``, start torchrun once with this job's settings?"""
    record = folder / "record.jsonl"
    record.unlink(missing_ok=True)
    env = {name: value for name, value in os.environ.items() if not name.startswith("PET_")}
    env.update(PATH=f"{folder}{os.pathsep}{env['PATH']}", ORACLE_RECORD=str(record))
    subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, timeout=30, check=False)
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    parsed = [_torchrun_reads(*call, monkeypatch) for call in calls]
    if len(parsed) != 1 or parsed[0] is None:
        return False
    args = parsed[0]
    port = 29500 if args.master_port is None else args.master_port  # torchrun's main() fills it in
    endpoint = args.rdzv_endpoint or f"{args.master_addr}:{port}"  # get_rdzv_endpoint, for static
    try:
        store = parse_rendezvous_endpoint(endpoint, -1)
        nodes = [int(part) for part in args.nnodes.split(":")]
    except ValueError:
        return False
    if args.no_python and args.module:
        return False  # torchrun refuses the two together
    # what torchrun starts: the script itself under --no-python, else python with the script (-m: as a module)
    started = [args.training_script, *args.training_script_args] if args.no_python else \
        ["python", *(["-m"] if args.module else []), args.training_script, *args.training_script_args]
    words = started[1:] if Path(started[0]).name.startswith("python") else ["not python"]
    while words and words[0].startswith("-") and words[0] != "-m":  # python's own flags
        words = words[1:]
    runs_train = words[:2] == ["-m", "train"] or (words[:1] not in ([], ["-m"]) and Path(words[0]).name == "train.py")
    rest = words[2:] if words[:1] == ["-m"] else words[1:]
    return (args.rdzv_backend == "static" and not args.standalone and set(nodes) == {2} and args.node_rank == 1
            and args.nproc_per_node in ("4", "gpu", "auto") and store == ("10.0.0.1", 29500) and runs_train
            and not any(word.lstrip("-").split("=")[0].replace("-", "_") in JOB for word in rest))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash, the shell the oracle runs")
@pytest.mark.timeout(120)
def test_bash_and_torchruns_parser_agree_with_every_banked_verdict(tmp_path, monkeypatch):
    """The oracle: bash runs each line against stand-ins for torchrun and python, and torchrun's own parser
    reads what they got; the checker's verdict must be the same."""
    for name in ("torchrun", "python", "python3"):
        _stand_in(tmp_path, name)
    banked = [(command, True) for command, runnable in RIGHT if runnable]
    banked += [(command, False) for command, _, runnable in WRONG if runnable]
    for command, right in banked:
        assert _oracle(command, tmp_path, monkeypatch) is right, command
        assert checks.torchrun_command(command, **JOB).ok is right, command


def test_the_kernels_own_pet_variables_are_neither_read_nor_changed(monkeypatch):
    monkeypatch.setenv("PET_NODE_RANK", "1")
    verdict = checks.torchrun_command("torchrun --nnodes=2 --nproc_per_node=4 --master_addr=10.0.0.1 train.py")
    assert not verdict.ok and "--node_rank is missing" in verdict.message, verdict.message
    assert checks.torchrun_command("PET_NNODES=2 torchrun --nproc_per_node=4 --node_rank=1 "
                                   "--master_addr=10.0.0.1 train.py").ok
    assert os.environ["PET_NODE_RANK"] == "1" and "PET_NNODES" not in os.environ


@pytest.mark.parametrize("answer", [None, 42, "", "   \n", "# only a comment"])
def test_no_command_asks_for_one(answer):
    verdict = checks.torchrun_command(answer)
    assert not verdict.ok and "Write the command as one string" in verdict.message, verdict.message


def test_another_job_is_judged_by_its_own_settings():
    job = {"nnodes": 4, "nproc_per_node": 8, "node_rank": 3, "master_addr": "node0", "master_port": 1234}
    line = "torchrun --nnodes=4 --nproc-per-node=8 --node-rank=3 --master-addr=node0 --master-port=1234 train.py"
    verdict = checks.torchrun_command(line, **job)
    assert verdict.ok and "32 ranks" in verdict.message and "RANK 24..31" in verdict.message, verdict.message
    assert "--nnodes=2 should be 4" in checks.torchrun_command(line.replace("=4 ", "=2 ", 1), **job).message


_PIECES = ["torchrun", "python", "-m", "torch.distributed.run", "train.py", "./train.py", "--nnodes=2", "--nnodes",
           "2", "1:2", "--nproc-per-node=4", "--node_rank=1", "--node-rank", "--master_addr=10.0.0.1",
           "--rdzv-endpoint=10.0.0.1", "--rdzv_backend=c10d", "--standalone", "PET_NODE_RANK=x", "PET_NNODES=2",
           "A=1", "export", "env", "$X", "${NODE_RANK}", "'", '"', "\\\n", "\n", ";", "&&", "|", "2>&1", ">", "#",
           "(", ")", "-u", "-c", "-", "--", "=", ":"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES) | st.text(max_size=6), max_size=12), st.sampled_from([" ", ""]))
def test_any_text_gets_a_verdict_never_an_exception(pieces, separator):
    verdict = checks.torchrun_command(separator.join(pieces), **JOB)
    assert isinstance(verdict.ok, bool) and verdict.message
    assert not {"PET_NODE_RANK", "PET_NNODES"} & set(os.environ)  # the line's variables never leak out
