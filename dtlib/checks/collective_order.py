"""Notebook 15's exercise: the collectives FSDP2 calls in one training step, predicted, then proven by stepping.

The learner predicts, for three blocks wrapped with ``fully_shard(reshard_after_forward=True)``, the order in
which rank 0 calls its all-gathers and reduce-scatters in a forward and a backward, as ``(operation, block)``
pairs. The checker does not hold the answer: it runs the same code on two live ranks, traces every collective
with the stepper (:meth:`dtlib.LiveRanks.trace`) and compares, naming the first place where the prediction and
the ranks part, with what usually explains it.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from dtlib.checks.feedback import Feedback
from dtlib.live.ranks import LiveRanks

#: The model: three blocks of different sizes, so that each collective's element count names its block. The
#: checker's ranks are gloo's on the CPU wherever it runs, so the mesh is named: ``fully_shard``'s default mesh is
#: a CUDA one on a machine with a GPU ("invalid device ordinal" on rank 1 of a one-GPU machine).
SETUP = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
mesh = init_device_mesh("cpu", (world_size,))
model = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 6), nn.Linear(6, 4))
for block in model:
    fully_shard(block, mesh=mesh, reshard_after_forward=True)
fully_shard(model, mesh=mesh, reshard_after_forward=True)
"""
STEP = "model(torch.randn(4, 8)).sum().backward()"
#: Each block's parameter count (weight and bias): the size of its all-gather's output, of its reduce-scatter's input.
BLOCK_SIZES = {8 * 12 + 12: 0, 12 * 6 + 6: 1, 6 * 4 + 4: 2}
#: Every spelling of the two operations, letters only ("all-gather", "AllGather", "all_gather_into_tensor"): torch's
#: names for them, and the short ones. Nothing else counts: "all_gather_object" and "reducescatterxyz" are not.
_SPELLINGS = {**{name: "all_gather" for name in ("ag", "allgather", "allgatherintotensor", "allgathersingle",
                                                  "allgatherbase", "allgatherintotensorcoalesced")},
              **{name: "reduce_scatter" for name in ("rs", "reducescatter", "reducescattertensor",
                                                      "reducescattersingle", "reducescatterbase",
                                                      "reducescattertensorcoalesced")}}
#: Words that may stand between the operation and its block: "AG for block 0", "fwd AG0", "RS on layer 2".
_FILLER = frozenset({"for", "on", "of", "in", "at", "the", "block", "layer", "module", "fwd", "bwd", "forward",
                     "backward", "then", "again"})
_LIST_MARK = re.compile(r"^\s*(?:\d+[.)]|[-*\u2022])\s+")  # "1. AG0", "- AG0": a list's own numbering
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
EXAMPLE = '[("all_gather", 0), ("all_gather", 1), ...] or ["AG0", "AG1", ...]'


@functools.cache
def observed() -> tuple[tuple[str, int], ...]:
    """Rank 0's collectives in one step of the exercise's model, as ``(operation, block)``, traced on two live
    ranks the first time it is asked (a few seconds), then remembered."""
    with LiveRanks(2, backend="gloo", timeout=60) as ranks:
        ranks.run(SETUP)
        trace = ranks.trace(STEP)
    calls = []
    for call in trace.calls[0]:
        family = "all_gather" if call.op.startswith("all_gather") else "reduce_scatter"
        size = max(call.elements())
        if size not in BLOCK_SIZES:  # a torch whose FSDP2 pads or groups differently: say so, not KeyError
            raise RuntimeError(f"this torch's FSDP2 called {call.what()}, which no block's size ({sorted(BLOCK_SIZES)})"
                               " explains: the exercise was written for torch 2.13's")
        calls.append((family, BLOCK_SIZES[size]))
    return tuple(calls)


def _read(prediction: Any) -> list[tuple[str, int]] | str:
    """The prediction as ``(operation, block)`` pairs, or a message that says how to write it."""
    if isinstance(prediction, str) or not isinstance(prediction, list | tuple):
        return f"Predict a list, one entry per collective in calling order: {EXAMPLE}."
    read = []
    for index, item in enumerate(prediction, 1):
        if isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str):
            text = f"{item[0]} {item[1]}"
        elif isinstance(item, str):
            text = item
        else:
            return f"Entry {index}, {item!r}, is neither (operation, block) nor a string such as 'AG0': {EXAMPLE}."
        entry = _entry(text)
        if isinstance(entry, str):
            return f"Entry {index}, {item!r}: {entry}"
        read.append(entry)
    return read


def _entry(text: str) -> tuple[str, int] | str:
    """One entry read: an operation (words of :data:`_FILLER` may stand around it), one whole block number, then
    any note without a number or another operation ("AG1 (prefetch)"). Otherwise what is wrong with it."""
    text = _LIST_MARK.sub("", text.lower(), count=1)
    numbers = _NUMBER.findall(text)
    if len(numbers) > 1:
        return (f"one collective and one block per entry; this one holds {len(numbers)} numbers "
                f"({', '.join(numbers)}): write each collective as an entry of its own.")
    operations = _operations(text.partition(numbers[0])[0] if numbers else text)
    if not numbers or operations is None or len(operations) != 1:
        return f"name an all-gather or a reduce-scatter (AG, RS, or torch's own names) and then a block: {EXAMPLE}."
    number = numbers[0]
    if "." in number:
        return f"{number} is no block: the blocks are numbered 0, 1 and 2, from the model's first."
    if int(number) < 0:
        return (f"{number} is no block (a minus sign, or a hyphen read as one): the blocks are numbered 0, 1 and 2; "
                "write 'AG1' or 'AG 1' for block 1.")
    if int(number) not in BLOCK_SIZES.values():
        return "the blocks are numbered 0, 1 and 2, from the model's first."
    if _operations(text.partition(number)[2], notes=True):
        return "one collective per entry: write each as an entry of its own."
    return operations[0], int(number)


def _operations(text: str, notes: bool = False) -> list[str] | None:
    """The operations ``text`` names, read word by word, the longest spelling first ("all gather into tensor" is
    one); None where a word is neither a spelling nor filler, unless ``notes`` (after the block, any word goes)."""
    words, found, start = re.findall(r"[a-z]+", text), [], 0
    while start < len(words):
        end = next((end for end in range(len(words), start, -1) if "".join(words[start:end]) in _SPELLINGS), None)
        if end is not None:
            found.append(_SPELLINGS["".join(words[start:end])])
            start = end
        elif notes or words[start] in _FILLER:
            start += 1
        else:
            return None
    return found


def _short(pairs: Any) -> str:
    return " ".join(("AG" if op == "all_gather" else "RS") + str(block) for op, block in pairs)


def _hint(index: int, said: tuple[str, int], truth: tuple[tuple[str, int], ...]) -> str:
    """What usually explains predicting ``said`` where rank 0 called ``truth[index]``."""
    called = truth[index]
    before = truth[:index]
    last = max(BLOCK_SIZES.values())
    if called == ("all_gather", last) and ("all_gather", last) in before:
        return (f"Block {last} ran its forward last, and reshard_after_forward=True freed its gathered parameters "
                "right after it: the backward must gather them again before it can compute anything.")
    if called[0] == "all_gather" and said[0] == "reduce_scatter":
        return ("FSDP2 prefetches in backward: as a block's backward begins it starts the all-gather of the block "
                "whose backward comes next, so that gather comes before this block's reduce-scatter and overlaps "
                "its work.")
    if said[0] == "all_gather" and called[0] == "reduce_scatter" and said in truth[index:]:
        return ("That all-gather comes, but later: FSDP2 prefetches one block ahead, not all of them, so each "
                "block's reduce-scatter comes before the gather of the block after next.")
    if called[0] == "reduce_scatter" and said[0] == "reduce_scatter":
        return "Gradients are reduce-scattered in the order their blocks' backwards finish: the last block's first."
    if called[0] == "reduce_scatter":
        return "Each block's gradients are reduce-scattered as soon as its backward is done."
    if called in before:  # a block gathered in forward, gathered again: backward's prefetch
        return ("In backward FSDP2 gathers each block again (reshard_after_forward=True freed it after forward), "
                "one block ahead: as a block's backward begins, it starts the all-gather of the block whose backward "
                "comes next, so that gather comes before this block's reduce-scatter.")
    return "The forward gathers each block's parameters just before that block runs, in the model's order."


def fsdp_collectives(prediction: Any) -> Feedback:
    """Notebook 15: is ``prediction`` the order of rank 0's all-gathers and reduce-scatters in one forward and
    backward of the exercise's three FSDP2 blocks? Judged against a trace of the real thing."""
    read = _read(prediction)
    if isinstance(read, str):
        return Feedback(False, read)
    truth = observed()
    for index, (said, called) in enumerate(zip(read, truth, strict=False)):
        if said != called:
            right = f" (your first {index} were right)" if index else ""
            return Feedback(False, f"Collective #{index + 1}: you predicted {_short([said])}, rank 0 called "
                                   f"{_short([called])}{right}. {_hint(index, said, truth)}")
    if not read:
        return Feedback(False, f"You predicted no collective; rank 0 called {len(truth)}. {_hint(0, ('?', -1), truth)}")
    if len(read) != len(truth):
        more = "more" if len(read) > len(truth) else "fewer"
        return Feedback(False, f"Your first {min(len(read), len(truth))} are right, but you predicted {len(read)} "
                               f"collectives and rank 0 called {len(truth)}: {more} than it did. "
                               f"{'' if len(read) > len(truth) else _hint(len(read), ('?', -1), truth)}".rstrip())
    return Feedback(True, f"Rank 0 called exactly these {len(truth)} collectives, in this order: the stepper traced "
                          "them on two live ranks, at this kernel's first check (later checks reuse that trace).")
