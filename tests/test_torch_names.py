"""Every torch.distributed name the course calls exists in the oldest supported torch, or dtlib.compat supplies it.

The record (tests/data/torch_names.txt) was written under that torch by ``python scripts/torch_names.py record``;
this test reads the code on whatever torch the gate has, so a name only a newer torch knows fails here, on a CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dtlib import compat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import torch_names  # noqa: E402


def test_the_record_was_made_under_the_oldest_supported_torch():
    version, _ = torch_names.read_record()
    assert tuple(int(part) for part in version.split("+")[0].split(".")[:2]) == compat.MIN_TORCH


def test_every_name_the_course_calls_exists_in_the_oldest_torch_or_compat_supplies_it():
    _, present = torch_names.read_record()
    used = torch_names.used_names()
    unrecorded = {name: paths for name, paths in used.items() if name not in present}
    assert not unrecorded, (
        f"not in the record, so never checked against the oldest torch: {unrecorded}. Run "
        "`make test-torch TORCH=2.11`, then `.venv-torch2.11/bin/python scripts/torch_names.py record`")
    supplied = {f"{torch_names.PREFIX}.{name}" for name in compat.RENAMED_COLLECTIVES}
    lacking = {name: used[name] for name, there in present.items() if not there and name in used}
    assert set(lacking) <= supplied, f"the oldest torch lacks these and dtlib.compat does not supply them: {lacking}"


def test_the_reader_finds_names_behind_aliases_imports_and_live_cells():
    source = ("import torch.distributed as dist\nimport torch.distributed.checkpoint as dcp\n"
              "from torch.distributed.fsdp import fully_shard as shard\n"
              "dist.all_reduce(x); dcp.save(s); shard(m); torch.distributed.barrier()\n")
    assert torch_names.names_in(source) >= {"torch.distributed.all_reduce", "torch.distributed.checkpoint.save",
                                            "torch.distributed.fsdp.fully_shard", "torch.distributed.barrier"}
    bound = dict(torch_names.LIVE_NAMES)  # a %%ranks cell uses dist without importing it
    assert "torch.distributed.all_gather_single" in torch_names.names_in("dist.all_gather_single(out, x)", bound)
    assert torch_names.MAGIC.sub(r"\1None", "before, x = %ranks pull before x") == "before, x = None"
