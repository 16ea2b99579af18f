"""Notebook 07's checker: a torchrun command line typed into a cell, read as the shell and torchrun read it.

The line is read as the shell reads it first (``shlex``: quotes, ``VAR=value`` prefixes, line continuations,
``;`` and ``&&``), then by torchrun's own argument parser (:mod:`dtlib.launch.torchrun`), so every form they
accept is right. Nothing here starts processes.

Example::

    dtlib.checks.torchrun_command("torchrun --standalone train.py")   # ✗: standalone is one node only
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from collections.abc import Iterator
from typing import Any

from dtlib.checks.feedback import Feedback
from dtlib.launch import torchrun

#: Characters the shell reads as operators: command separators, pipes, redirections, subshell brackets.
_OPERATORS = "();<>|&\n"
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
_PYTHON = re.compile(r"python[0-9.]*")
_PASS_THROUGH = ("nohup", "exec", "time", "command", "sudo")  # each runs the rest of its line as it is
#: Tools that run the rest of the line inside an environment (``conda run -n train torchrun ...``), and their
#: options that take a value, which is not the command.
_RUNNERS = ("uv", "conda", "mamba", "micromamba", "pixi", "poetry", "pipenv")
_VALUED = ("-n", "--name", "-p", "--prefix", "-e", "--environment", "-u", "--user", "-g", "--group", "--cwd",
           "--with", "--python")
_SHELLS = ("bash", "sh", "zsh", "dash")  # bash -c '...': the string is a command line of its own
_DASHES = "\u2010\u2011\u2012\u2013\u2014\u2212"  # what a word processor or a web page makes of "-" and "--"
#: torchrun's rendezvous backends (its registry's names) besides static, what each is, and why not here.
_RENDEZVOUS = {"c10d": "c10d ignores --node_rank and finds its store at --rdzv_endpoint, not --master_addr",
               "etcd": "etcd needs an etcd server at --rdzv_endpoint and numbers the nodes itself",
               "etcd-v2": "etcd-v2 needs an etcd server at --rdzv_endpoint and numbers the nodes itself"}
#: The options the exercise is about, as torchrun's parser names them (dest).
_SETTINGS = ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
             "standalone")
#: Variables a learner may take for a setting, by torchrun's option; torchrun reads none (it reads PET_<OPTION>).
_NOT_READ = {"master_addr": ("MASTER_ADDR",), "master_port": ("MASTER_PORT",), "node_rank": ("NODE_RANK", "GROUP_RANK"),
             "nnodes": ("NNODES", "GROUP_WORLD_SIZE"), "nproc_per_node": ("NPROC_PER_NODE", "LOCAL_WORLD_SIZE")}
#: Those of them that torchrun's agent sets for the ranks it starts (LocalElasticAgent).
_SET_FOR_RANKS = ("MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _simple_command(words: list[str], variables: dict[str, str], exported: dict[str, str]
                    ) -> tuple[dict[str, str], list[str]] | None:
    """One simple command, as the shell runs it: its $VARIABLES expanded (from earlier commands; an unset one is
    kept as it is written, so that a message can name it), ``VAR=value`` prefixes and ``env``/``nohup``/``exec``
    taken off into the environment the program gets. ``export`` and bare assignments only record variables."""
    words = [_VARIABLE.sub(lambda match: variables.get(match[1], match[0]), word) for word in words]
    env = dict(exported)
    while words:
        if _ASSIGNMENT.match(words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        elif words[0] in (*_PASS_THROUGH, "env") or (words[0] in _RUNNERS and words[1:2] == ["run"]):
            del words[:2 if words[0] in _RUNNERS else 1]  # uv run, conda run -n NAME: in an environment
            while words and words[0].startswith("-"):  # env -i, time -p, uv run --frozen, sudo -E, -n NAME
                option = words.pop(0)
                if option in _VALUED and words:
                    words.pop(0)
        else:
            break
    if not words or words[0] == "export":
        assigned = dict(word.split("=", 1) for word in words[1:] if _ASSIGNMENT.match(word))
        variables.update(env if not words else assigned)
        exported.update(assigned)
        return None
    return env, words


def _shell_commands(text: str) -> list[tuple[dict[str, str], list[str]]]:
    """The simple commands in ``text`` as a POSIX shell reads them, each with the variables its program gets:
    ``"A=1 torchrun x.py; cd d"`` -> ``[({"A": "1"}, ["torchrun", "x.py"]), ({}, ["cd", "d"])]``.
    Raises ValueError where the shell would refuse the text (an unclosed quote)."""
    text = text.replace("\r\n", "\n").replace("\\\n", "")  # a backslash before a newline joins the lines
    text = re.sub(r"(?m)^([ \t]*)!", r"\1", text)  # a notebook's !command: IPython hands the rest to the shell
    # punctuation_chars splits at operators; "\n" is doubled because a comment swallows the one that ends it
    lexer = shlex.shlex(text.replace("\n", "\n\n"), posix=True, punctuation_chars=_OPERATORS)
    lexer.whitespace, lexer.whitespace_split = " \t\r", True  # a newline is an operator, not a space
    commands: list[tuple[dict[str, str], list[str]]] = []
    variables: dict[str, str] = {}
    exported: dict[str, str] = {}
    words: list[str] = []
    redirect_target = False
    for token in [*lexer, ";"]:
        if redirect_target:  # the file after > or <: not a word of the command
            redirect_target = False
        elif not set(token) <= set(_OPERATORS):
            words.append(token)
        elif "<" in token or ">" in token:
            redirect_target = True
            if words and words[-1].isdigit():  # the 2 of 2>&1 names a stream
                words.pop()
        elif token.strip("()"):  # ; && || | & or a newline: the command ends
            command = _simple_command(words, variables, exported)
            if command and command[1][0] in _SHELLS and command[1][1:2] == ["-c"] and len(command[1]) > 2:
                commands += [({**command[0], **env}, inner) for env, inner in _shell_commands(command[1][2])]
            else:
                commands += [command] if command else []
            words = []
    return commands


_NO_TORCHRUN = "launch it with torchrun (or python -m torch.distributed.run), its options first, then train.py."


def _torchrun_arguments(words: list[str]) -> tuple[list[str] | None, str]:
    """What follows the launcher where ``words`` start torchrun (``torchrun``, ``python -m torch.distributed.run``,
    a path to either), else (None, what the command does instead, in the learner's terms)."""
    program = os.path.basename(words[0])
    if program == "torchrun":
        return words[1:], ""
    if not _PYTHON.fullmatch(program):
        if program == "train.py":
            return None, f"`{words[0]}` runs the script alone: one process and no rendezvous; {_NO_TORCHRUN}"
        return None, f"This line runs `{words[0]}`, not torchrun: start with torchrun (or python -m " \
                     "torch.distributed.run), then torchrun's options, then train.py."
    rest = words[1:]
    while rest and rest[0].startswith("-") and not rest[0].startswith(("-m", "-c")) and rest[0] != "-":
        rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]  # python's own options: -u, -O, -X dev
    if not rest or rest[0] == "-" or rest[0].startswith("-c"):
        return None, f"`{program}` alone runs Python code, not a distributed job: {_NO_TORCHRUN}"
    if rest[0].startswith("-m"):
        module, rest = (rest[1] if rest[1:] else "", rest[2:]) if rest[0] == "-m" else (rest[0][2:], rest[1:])
        if module == "torch.distributed.run":
            return rest, ""
        if module == "torch.distributed.launch":
            return None, "python -m torch.distributed.launch is torchrun's deprecated predecessor: it also passes " \
                         "--local-rank=N to the script, which must then accept it, and it will go. Write the same " \
                         "options after torchrun (or python -m torch.distributed.run)."
        if module == "torchrun":
            return None, "There is no module named torchrun: torchrun is the command, and its module is " \
                         "torch.distributed.run (python -m torch.distributed.run)."
        return None, f"`{program} -m {module}` starts one process and no rendezvous: {_NO_TORCHRUN}"
    if os.path.basename(rest[0]) == "torchrun" or rest[0].replace("\\", "/").endswith("torch/distributed/run.py"):
        return rest[1:], ""  # python /path/to/bin/torchrun: the same launcher
    return None, f"`{program} {rest[0]}` starts one process and no rendezvous: {_NO_TORCHRUN}"


@contextlib.contextmanager
def _environment_of_torchrun(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` as torchrun would find it: its options default to the PET_<OPTION> variables, taken from
    the command's environment ``env`` only, never from this kernel's."""
    saved = {name: value for name, value in os.environ.items() if name.startswith("PET_")}
    try:
        for name in saved:
            del os.environ[name]
        os.environ.update({name: value for name, value in env.items() if name.startswith("PET_")})
        yield
    finally:
        for name in [name for name in os.environ if name.startswith("PET_")]:
            del os.environ[name]
        os.environ.update(saved)


def _refused_by_parser(complaint: str, env: dict[str, str]) -> str:
    """argparse's complaint about a torchrun line (run with ``env``), said in the learner's terms where we can."""
    unset = re.search(r"invalid \w+ value: '\$\{?(\w+)", complaint)
    if unset and unset[1] in env:
        return f"The shell expands ${unset[1]} before {unset[1]}={env[unset[1]]} in front of the command takes " \
               f"effect, so nothing is there: write the value itself (torchrun would refuse this line: {complaint})."
    if unset:
        return f"${unset[1]} is a shell variable that this answer never sets, so the shell leaves nothing there: " \
               f"write the value itself (torchrun would refuse this line: {complaint})."
    if "required: training_script" in complaint:
        return "There is no script: torchrun runs the one named after its options, so end the line with train.py " \
               f"(torchrun would refuse this line: {complaint})."
    return f"torchrun would refuse this line: {complaint}."


def _node_counts(nnodes: str) -> tuple[int, int] | None:
    """--nnodes as torchrun reads it (parse_min_max_nnodes): "2" -> (2, 2), "1:2" -> (1, 2), else None."""
    parts = nnodes.split(":")
    if len(parts) > 2 or not all(part.strip().isdigit() for part in parts):
        return None
    return int(parts[0]), int(parts[-1])


def _wrong_setting(name: str, got: object, job: dict[str, Any]) -> str | None:
    """Why ``--name=got`` is wrong for ``job`` (the checker's keyword arguments), or None where it is right."""
    wanted = job[name]
    said = f"--{name}={got} should be {wanted}"
    if name == "nnodes":
        counts = _node_counts(str(got))
        if counts == (wanted, wanted):
            return None
        if counts is None:
            return f"{said}. It takes the number of machines, or a range min:max."
        if counts[0] != counts[1]:
            return f"{said}. A range min:max is for elastic jobs that may start with fewer machines; this job " \
                   f"always has {wanted}."
        if counts[1] == wanted * job["nproc_per_node"]:
            return f"{said}. {counts[1]} is the number of ranks, machines x GPUs; --nnodes counts machines."
        return f"{said}: the number of machines in the job."
    if name == "nproc_per_node":
        if str(got).isdigit() and int(str(got)) == wanted or got in ("gpu", "auto"):
            return None  # gpu and auto count this machine's GPUs: 4 on the machines the exercise describes
        if got == "cpu":
            return f"{said}. cpu starts one rank per CPU core; this job wants one per GPU."
        if str(got).isdigit() and int(str(got)) == wanted * job["nnodes"]:
            return f"{said}. {got} is the whole job's ranks; --nproc_per_node counts the ranks on this machine, " \
                   "one per GPU."
        return f"{said}: one rank per GPU of this machine."
    if got == wanted:
        return None
    if name == "node_rank":
        first = " 0 is the first machine, the one that hosts the store." if got == 0 else ""
        return f"{said} (node ranks count from 0): the machines are 0 to {job['nnodes'] - 1}, and this command is " \
               f"for machine {wanted}.{first}"
    if name == "master_addr":
        host, _, port = str(got).rpartition(":")
        if host == wanted and port.isdigit():
            return f"{said}. The address alone: the port goes in --master_port."
        if got in ("localhost", "127.0.0.1", "0.0.0.0", "::1"):
            return f"{said}. {got} is this machine itself, and the store runs on node 0, at {wanted}."
        return f"{said}, node 0's address, where the store runs."
    return f"{said}. The store listens on port {wanted} of node 0."


def torchrun_command(command: Any, *, nnodes: int = 2, nproc_per_node: int = 4, node_rank: int = 1,
                     master_addr: str = "10.0.0.1", master_port: int = 29500) -> Feedback:
    """Notebook 07's exercise: the torchrun line for node ``node_rank`` of a static (hand-numbered) job.

    The shell's reading (``shlex``: quotes, ``VAR=value`` prefixes, backslash-newline, ``;``/``&&``) comes first,
    then torchrun's own argument parser, so every form they accept is right: ``--opt=value`` or ``--opt value``,
    dashes or underscores, abbreviations, ``python -m torch.distributed.run``, ``./train.py`` or an absolute path,
    PET_<OPTION> variables. Example: ``torchrun_command("torchrun --standalone train.py")`` explains why
    standalone is one node only.
    """
    if not isinstance(command, str) or not command.strip():
        return Feedback(False, "Write the command as one string, e.g. \"torchrun --nnodes=... train.py\".")
    try:
        commands = _shell_commands(command)
    except ValueError as err:  # an unclosed quote, a backslash at the very end
        return Feedback(False, f"The shell could not read this line: {err}.")
    if not commands:
        return Feedback(False, "Write the command as one string, e.g. \"torchrun --nnodes=... train.py\".")
    launches = [(env, arguments) for env, words in commands
                for arguments, _ in [_torchrun_arguments(words)] if arguments is not None]
    if not launches:
        return Feedback(False, _torchrun_arguments(commands[-1][1])[1])
    if len(launches) > 1:
        return Feedback(False, f"This answer starts torchrun {len(launches)} times: write one command, the one the "
                               f"machine with node rank {node_rank} runs.")
    env, arguments = launches[0]
    said = io.StringIO()
    with _environment_of_torchrun(env), contextlib.redirect_stderr(said):
        try:  # the defaults come from the PET_ variables of the line
            given, complaint = torchrun.parse_options(arguments)
            defaults = torchrun.option_defaults()
        except SystemExit:  # argparse refuses a PET_ value its option cannot take, as torchrun would
            pet = " ".join(f"{name}={value}" for name, value in env.items() if name.startswith("PET_"))
            errors = [line.split("error:", 1)[1].strip() for line in said.getvalue().splitlines() if "error:" in line]
            complaint = errors[-1] if errors else "it prints its help"
            return Feedback(False, f"torchrun would refuse this line: {pet} in front sets its options, and "
                                   f"{complaint}.")
    if given is None:
        return Feedback(False, _refused_by_parser(complaint, env))
    if defaults["master_port"] is None:  # newer torchrun fills it in after parsing: 29500 for a static rendezvous
        defaults["master_port"] = 29500
    value = {name: defaults[name] if given[name] is torchrun.NOT_GIVEN else given[name] for name in defaults}
    script, script_args = str(value["training_script"]), [str(word) for word in value["training_script_args"]]
    if value["no_python"] is True and _PYTHON.fullmatch(os.path.basename(script)):  # --no-python python train.py
        flags = next((i for i, word in enumerate(script_args) if not word.startswith("-")), len(script_args))
        if flags < len(script_args) and "-m" not in script_args[:flags]:
            script, script_args = script_args[flags], script_args[flags + 1:]
    runs_module = value["module"] is True
    if value["no_python"] is True and runs_module:
        return Feedback(False, "torchrun refuses --no-python with -m (--module): -m asks python to run a module, and "
                               "--no-python starts no python. Leave both out and end with train.py.")
    if value["no_python"] is True and not _PYTHON.fullmatch(os.path.basename(str(value["training_script"]))):
        return Feedback(False, f"--no-python makes torchrun start {script} itself as a program, with no python: "
                               "train.py is no command on the PATH, and ./train.py runs only if it is executable "
                               "and starts with #!. Leave --no-python out, or write --no-python python train.py.")
    if runs_module and script.endswith(".py"):
        return Feedback(False, f"-m (--module) makes torchrun run python -m {script}, and a module's name has no "
                               f".py: Python looks for a module named py in a package {script[:-3]!r}, and fails. "
                               "Write -m train, or leave -m out and end with train.py.")
    if script[:1] in _DASHES:
        return Feedback(False, f"{script!r} starts with {'an en dash' if script[0] == chr(0x2013) else 'a dash'} "
                               f"({script[0]}), not a hyphen (-): torchrun reads it as the script, not as an option. "
                               "Type its two hyphens again (a web page or a word processor turns -- into a dash).")
    if os.path.basename(script) != "train.py" and not (runs_module and script == "train"):
        if "train.py" in map(os.path.basename, script_args):
            return Feedback(False, f"torchrun takes the first word after its options for the script, here "
                                   f"{script!r}, and gives it the rest, train.py included, as its arguments: did an "
                                   "option take one value too many? End with train.py.")
        return Feedback(False, "End with the script, train.py: torchrun's options come before it "
                               f"(this line runs {script!r}).")
    late = [word for word in script_args if word.startswith("--")
            and word[2:].split("=")[0].replace("-", "_") in _SETTINGS]
    if late:
        return Feedback(False, f"{late[0]} comes after train.py, so it goes to train.py, not to torchrun: put "
                               "torchrun's options before the script.")
    unset = [f"--{name}={value[name]}" for name in _SETTINGS if "$" in str(value[name])]
    if unset:
        return Feedback(False, f"{unset[0]}: that is a shell variable this answer never sets, so the shell leaves "
                               "nothing there; write the value itself.")
    if value["standalone"] is True:
        return Feedback(False, "--standalone starts a private rendezvous on this machine: one node only. "
                               "Several nodes must name the same --master_addr and --master_port.")
    backend = str(value["rdzv_backend"])
    if backend != "static":
        known = _RENDEZVOUS.get(backend, f"torchrun has no rendezvous backend named {backend}" + (
            " (its names are lower case)" if backend.lower() in (*_RENDEZVOUS, "static") else ""))
        return Feedback(False, f"--rdzv_backend={backend}: this job numbers its nodes by hand, which is the static "
                               f"rendezvous (torchrun's default). {known}: leave --rdzv_backend out.")
    job = {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "node_rank": node_rank, "master_addr": master_addr,
           "master_port": master_port}
    endpoint = str(value["rdzv_endpoint"]).strip()
    if endpoint:  # a static rendezvous takes its store's address from the endpoint when given one
        host, colon, port = endpoint.rpartition(":")  # as parse_rendezvous_endpoint reads host:port
        if not host and colon:
            return Feedback(False, f"--rdzv_endpoint={endpoint} names no machine: write {master_addr}:{master_port}, "
                                   "node 0's address and the port of its store.")
        if not colon or endpoint.endswith("]"):
            return Feedback(False, f"--rdzv_endpoint={endpoint} has no port, and a static rendezvous then stops: "
                                   f"write {master_addr}:{master_port}, or leave it out and give --master_addr and "
                                   "--master_port.")
        if not port.isdigit() or int(port) >= 2**16:
            return Feedback(False, f"--rdzv_endpoint={endpoint}: the port after the colon must be a whole number "
                                   "below 65536.")
        if (host.strip("[]"), int(port)) != (master_addr, master_port):
            return Feedback(False, f"--rdzv_endpoint={endpoint} wins over --master_addr and --master_port, and this "
                                   f"job's store is at {master_addr}:{master_port}: leave --rdzv_endpoint out.")
        del job["master_addr"], job["master_port"]
    left_out = []
    for name in job:
        wrong = _wrong_setting(name, value[name], job)
        if given[name] is torchrun.NOT_GIVEN and f"PET_{name.upper()}" not in env:
            if wrong is None:
                left_out.append(f"--{name}")  # torchrun's default is this job's value
                continue
            hint = "".join(f" ({var}={env[var]} in front does not set it: torchrun reads only its options and "
                           f"PET_{name.upper()}{f'; it sets {var} for its ranks' if var in _SET_FOR_RANKS else ''}.)"
                           for var in _NOT_READ[name] if var in env)
            default = str(defaults[name])
            if name == "nnodes" and default == "1:1":
                default = "1 (its default, written 1:1: at least one node and at most one)"
            return Feedback(False, f"--{name} is missing: this job needs {job[name]}, and without it torchrun uses "
                                   f"{default}.{hint}")
        if wrong is not None:
            variable = f"PET_{name.upper()}"
            return Feedback(False, wrong if given[name] is not torchrun.NOT_GIVEN
                            else f"{variable}={env[variable]} in front of torchrun sets --{name}: {wrong}")
    notes = [f" ({' and '.join(left_out)} left out: torchrun's default is this job's value.)" if left_out else "",
             f" (--nproc_per_node={value['nproc_per_node']}: torchrun counts this machine's GPUs, {nproc_per_node} "
             "on these machines.)" if value["nproc_per_node"] in ("gpu", "auto") else "",
             " (-m train runs train.py as a module.)" if runs_module else ""]
    return Feedback(True, f"Right: {nnodes * nproc_per_node} ranks; this node's get RANK "
                          f"{node_rank * nproc_per_node}..{(node_rank + 1) * nproc_per_node - 1} and LOCAL_RANK "
                          f"0..{nproc_per_node - 1}; node 0 hosts the store at {master_addr}:{master_port}."
                          + "".join(notes))
