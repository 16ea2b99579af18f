"""Checkers of answers typed into a cell (a backend name, a number of bytes, a strategy, a command).

Nothing here starts processes. The strategy checker asks :mod:`dtlib.train.guide`'s recommendation, and the
torchrun checker reads a line with torchrun's own parser (:mod:`dtlib.launch.torchrun`).

Example::

    dtlib.checks.backend_choice("gloo", world_size=2)   # ✓ or ✗ with a hint
"""

from __future__ import annotations

import os
import shlex
from typing import Any

from dtlib.feedback import Feedback
from dtlib.launch import torchrun
from dtlib.launch.spawn import resolve_backend
from dtlib.measure import memory
from dtlib.train import guide


def backend_choice(answer: Any, world_size: int = 2) -> Feedback:
    """Notebook 00: which backend does ``dtlib.spawn(backend="auto")`` pick for ``world_size`` ranks here?"""
    if answer is None:
        return Feedback(False, "No answer yet: set `answer` to 'gloo' or 'nccl'.")
    if not isinstance(answer, str) or answer.lower() not in ("gloo", "nccl", "mpi"):
        return Feedback(False, f"{answer!r} is not a backend name; the choices are 'gloo', 'nccl' and 'mpi'.")
    expected = resolve_backend("auto", world_size)
    if answer.lower() == expected:
        why = "one GPU per rank is available" if expected == "nccl" else "there are not enough GPUs for NCCL"
        return Feedback(True, f"Right: {expected}, because {why} for {world_size} ranks.")
    if answer.lower() == "nccl":
        return Feedback(False, f"NCCL needs one CUDA GPU per rank; this machine cannot give {world_size} ranks "
                               "a GPU each (look at the GPU count above).")
    if answer.lower() == "mpi":
        return Feedback(False, "dtlib never picks MPI by itself; 'auto' chooses between NCCL and gloo.")
    return Feedback(False, f"This machine has enough GPUs for {world_size} ranks, so 'auto' picks NCCL.")


#: Units an answer in bytes may have been given in by mistake: name, bytes per unit, and how to say it.
BYTE_UNITS = (("KB", 1e3, "10^3"), ("KiB", 2**10, "2^10"), ("MB", 1e6, "10^6"), ("MiB", 2**20, "2^20"),
              ("GB", 1e9, "10^9"), ("GiB", 2**30, "2^30"))


def _show(number: float) -> str:
    """A number as a learner reads it: 112,256 or 0.1123, never a small number rounded to 0."""
    return f"{number:,.0f}" if abs(number) >= 1000 else f"{number:.6g}"


def fsdp_memory(answer: Any, num_params: int = 28_064, world_size: int = 4, strategy: str = "full_shard") -> Feedback:
    """Notebook 05: bytes of model state per rank for ``num_params`` fp32 parameters trained with Adam
    (4 bytes of weights, 4 of gradients, 8 of Adam's two moments per parameter) under ``strategy``.

    Example: ``fsdp_memory(16 * 28_064)`` says that is DDP's figure, not FULL_SHARD's.
    """

    fp32_adam = {"param_bytes": 4, "grad_bytes": 4, "optim_bytes_per_param": 8}
    expected = memory.estimate(num_params, world_size, strategy, **fp32_adam)
    if answer is None:
        return Feedback(False, "No answer yet: set `answer` to a number of bytes.")
    if not isinstance(answer, (int, float)) or isinstance(answer, bool):
        return Feedback(False, f"Answer with a number of bytes, not {type(answer).__name__}.")
    if abs(answer - expected) <= 0.01 * expected:
        return Feedback(True, f"Right: {expected:,.0f} bytes per rank; the measured figure above is within 0.1% "
                              "(Adam's step counters are the difference).")
    p, n = num_params, world_size
    known = {
        16 * p: "that is every rank holding everything, as DDP does: FULL_SHARD divides all three by world_size.",
        4 * p / n: "that counts the parameters only: each rank also holds its shard of the gradients and of "
                   "Adam's two moments.",
        8 * p / n: "that misses Adam's state: exp_avg and exp_avg_sq, 8 bytes per parameter in fp32.",
        12 * p / n: "that misses the gradients: 4 bytes per parameter, sharded like the rest.",
        memory.estimate(p, n, "zero2", **fp32_adam): "that is ZeRO-2: parameters whole on every rank, gradients "
                                                     "and Adam's state sharded. FULL_SHARD shards the parameters "
                                                     "too.",
    }
    for value, hint in known.items():
        if abs(answer - value) <= 0.01 * value:
            return Feedback(False, f"{_show(answer)} bytes: {hint}")
    for unit, size, power in BYTE_UNITS:
        in_bytes = answer * size
        if abs(in_bytes - expected) <= 0.01 * expected:
            return Feedback(False, f"{_show(answer)} looks like the answer in {unit} ({power} bytes): that is "
                                   f"{_show(in_bytes)} bytes, the right amount. Give the answer in bytes.")
        for value, hint in known.items():
            if abs(in_bytes - value) <= 0.01 * value:
                return Feedback(False, f"{_show(answer)} looks like {unit} ({power} bytes), that is "
                                       f"{_show(in_bytes)} bytes; give the answer in bytes. And {hint}")
    return Feedback(False, f"{_show(answer)} bytes is off by a factor of {answer / expected:.3g}: count 16 bytes "
                           f"per parameter (4 weights + 4 gradients + 8 Adam), then apply {strategy}'s sharding "
                           f"over {world_size} ranks.")


def strategy_choice(answer: Any, num_params: float, gpu_memory_gb: float, num_gpus: int, nodes: int = 1) -> Feedback:
    """Notebook 06's exercise: is ``answer`` (one of :data:`dtlib.train.guide.CHOICES`) what
    :func:`dtlib.train.guide.recommend` picks?

    A wrong answer gets the reason it fails (it does not fit its budget, or HSDP on one node), or, where it
    would work, the simpler choice that works too. Example: ``strategy_choice("HSDP", 20e9, 80, 8)`` says one node.
    """
    advice = guide.recommend(num_params, gpu_memory_gb, num_gpus, nodes=nodes)
    if answer not in guide.CHOICES:
        return Feedback(False, f"Answer with one of: {', '.join(repr(choice) for choice in guide.CHOICES)}.")
    if answer == advice.choice:
        return Feedback(True, f"Right: {advice}")
    why = guide.why_not(str(answer), advice, gpu_memory_gb, nodes)
    if why:
        return Feedback(False, why)
    return Feedback(False, f"{answer} would fit, but a simpler strategy fits too: {advice}")


def torchrun_command(command: Any, *, nnodes: int = 2, nproc_per_node: int = 4, node_rank: int = 1,
                     master_addr: str = "10.0.0.1", master_port: int = 29500) -> Feedback:
    """Notebook 07's exercise: the torchrun line for node ``node_rank`` of a static (hand-numbered) job.

    The line is read by torchrun's own argument parser, so every spelling torchrun accepts is right:
    ``--opt=value`` or ``--opt value``, dashes or underscores, abbreviations, ``python -m torch.distributed.run``.
    Example: ``torchrun_command("torchrun --standalone train.py")`` explains why standalone is one node only.
    """
    if not isinstance(command, str) or not command.strip():
        return Feedback(False, "Write the command as one string, e.g. \"torchrun --nnodes=... train.py\".")
    try:
        words = shlex.split(command.replace("\\\n", " "))  # a backslash before a newline continues the line
    except ValueError as err:  # an unclosed quote
        return Feedback(False, f"The shell could not read this line: {err}.")
    if not words:
        return Feedback(False, "Write the command as one string, e.g. \"torchrun --nnodes=... train.py\".")
    arguments = torchrun.command_arguments(words)
    if arguments is None:
        if "torch.distributed.launch" in words:
            return Feedback(False, "python -m torch.distributed.launch is torchrun's deprecated predecessor: it also "
                                   "passes --local-rank=N to the script, which must then accept it, and it will "
                                   "go. Write the same options after torchrun (or python -m torch.distributed.run).")
        if os.path.basename(words[0]).startswith("python") and "train.py" in words:
            return Feedback(False, "`python train.py` starts one process and no rendezvous: launch it with torchrun "
                                   "(or python -m torch.distributed.run), its options first, then train.py.")
        return Feedback(False, "Start with torchrun and end with the script, train.py.")
    given, complaint = torchrun.parse_options(arguments)
    if given is None:
        return Feedback(False, f"torchrun would refuse this line: {complaint}.")
    if given["training_script"] != "train.py":
        return Feedback(False, "End with the script, train.py: torchrun's options come before it "
                               f"(this line runs {given['training_script']!r}).")
    wanted = {"nnodes": str(nnodes), "nproc_per_node": str(nproc_per_node), "node_rank": node_rank,
              "master_addr": master_addr, "master_port": master_port}
    script_args = given["training_script_args"]
    late = [str(word) for word in script_args if word.lstrip("-").replace("-", "_").split("=")[0] in wanted]
    if late:
        return Feedback(False, f"{late[0]} comes after train.py, so it goes to train.py, not to torchrun: put "
                               "torchrun's options before the script.")
    if given["standalone"] is True:
        return Feedback(False, "--standalone starts a private rendezvous on this machine: one node only. "
                               "Several nodes must name the same --master_addr and --master_port.")
    backend = given.get("rdzv_backend", torchrun.NOT_GIVEN)
    if backend not in (torchrun.NOT_GIVEN, "static"):
        return Feedback(False, f"--rdzv_backend={backend}: this job numbers its nodes by hand, which is the static "
                               "rendezvous (torchrun's default). c10d ignores --node_rank and finds its store at "
                               "--rdzv_endpoint, not --master_addr: leave --rdzv_backend out.")
    endpoint = given.get("rdzv_endpoint", torchrun.NOT_GIVEN)
    if endpoint not in (torchrun.NOT_GIVEN, "", f"{master_addr}:{master_port}"):
        return Feedback(False, f"--rdzv_endpoint={endpoint} wins over --master_addr and --master_port, and this "
                               f"job's store is at {master_addr}:{master_port}: leave --rdzv_endpoint out.")
    if endpoint == f"{master_addr}:{master_port}":  # a static rendezvous uses the endpoint when given one
        wanted.pop("master_addr")
        wanted.pop("master_port")
    defaults = torchrun.option_defaults()
    if defaults["master_port"] is None:  # newer torchrun fills it in after parsing: 29500 for a static rendezvous
        defaults["master_port"] = 29500
    left_out = []
    for name, value in wanted.items():
        got = given[name]
        if got is torchrun.NOT_GIVEN:
            if defaults[name] == value:
                left_out.append(f"--{name}")  # torchrun's default is this job's value
                continue
            return Feedback(False, f"--{name} is missing: this job needs {value}, and without it torchrun uses "
                                   f"{defaults[name]}.")
        same = str(got).split(":") in ([str(value)], [str(value)] * 2) if name == "nnodes" else got == value
        if not same:  # --nnodes=2:2 is the same as 2 (min:max nodes)
            hint = " (node ranks count from 0)" if name == "node_rank" else ""
            return Feedback(False, f"--{name}={got} should be {value}{hint}.")
    defaulted = f" ({' and '.join(left_out)} left out: torchrun's default is this job's value.)" if left_out else ""
    return Feedback(True, f"Right: {nnodes * nproc_per_node} ranks; this node's get RANK "
                          f"{node_rank * nproc_per_node}..{(node_rank + 1) * nproc_per_node - 1} and LOCAL_RANK "
                          f"0..{nproc_per_node - 1}; node 0 hosts the store at {master_addr}:{master_port}.{defaulted}")
