"""dtlib.train.fsdp_checkpoint: a stopped and resumed job trains exactly like one that never stopped, and the full
checkpoint is a plain file a single process can load."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import pathlib
import pickle
import shutil
import stat
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dtlib
from dtlib import compat
from dtlib.train import data, fsdp, fsdp_checkpoint, fsdp_wrap, models
from dtlib.train.checkpoint import write_digests
from dtlib.train.fsdp import FSDPConfig

SAVED_AT = 3
CASES = [(api, kind) for api in ("fsdp2", "fsdp1") for kind in ("sharded", "full")]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, stop_and_resume):
    """``{(api, kind): (directory, losses, printed)}``: ``stop_and_resume`` on 2 ranks, 6 steps, stopped
    after SAVED_AT; its checkpoint directory is kept to look at, and the ranks' output relayed and caught."""
    out = {}
    for api, kind in CASES:
        directory = tmp_path_factory.mktemp(f"{api}-{kind}")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            losses = stop_and_resume(fsdp.run, FSDPConfig(api=api, checkpoint_kind=kind), steps=6,
                                     stop_after=SAVED_AT, location="checkpoint_dir", folder=str(directory),
                                     output="all")
        out[api, kind] = directory, losses, printed.getvalue()
    return out


def single_process(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The oracle: one process, the whole global batch per step, plain Adam, no wrapper."""
    config = FSDPConfig()
    model = models.build("transformer", seed=config.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    batches = data.batches(data.for_model("transformer", config.num_samples, seed=config.seed), world_size=1, rank=0,
                           batch_size=config.global_batch, seed=config.seed)
    for _ in range(steps):
        x, y = next(batches)
        optimizer.zero_grad()
        models.loss_fn("transformer", model(x), y).backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.timeout(180)
@pytest.mark.parametrize("api, kind", CASES)
def test_resumed_training_equals_uninterrupted_training(api, kind, resumed):
    losses = resumed[api, kind][1]
    assert len(losses["straight"]) == 6
    assert losses["stopped_and_resumed"] == losses["straight"]  # exactly: same data, same weights, same Adam moments
    assert losses["straight"][-1] < losses["straight"][0] - 0.5  # it trained (a fresh start would not match)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("api, kind", CASES)
def test_checkpoint_directory_holds_the_expected_files(api, kind, resumed):
    directory = resumed[api, kind][0]
    assert set(os.listdir(directory)) == {fsdp_checkpoint.STEP_FILE, "a"}  # step.json names the folder it commits
    assert json.loads((directory / fsdp_checkpoint.STEP_FILE).read_text()) == {"step": SAVED_AT, "kind": kind,
                                                                                "folder": "a"}
    files = set(os.listdir(directory / "a")) - {"SHA256SUMS"}  # every file's SHA-256, which load checks
    if kind == "sharded":  # DCP: its metadata, and one file per rank
        assert files == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    else:  # one file, written by rank 0
        assert files == {fsdp_checkpoint.FULL_FILE}
    assert sorted(line.split("  ")[1] for line in (directory / "a" / "SHA256SUMS").read_text().splitlines()) == \
        sorted(files)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_full_checkpoint_loads_into_a_plain_model(api, resumed):
    directory = resumed[api, "full"][0]
    state = torch.load(directory / "a" / fsdp_checkpoint.FULL_FILE, weights_only=True)
    assert set(state) == {"model", "optim"}
    model = models.build("transformer")
    model.load_state_dict(state["model"], strict=True)  # plain names, plain tensors, nothing missing
    reference, reference_optimizer = single_process(SAVED_AT)
    fresh = dict(models.build("transformer").named_parameters())
    for (name, param), (same_name, expected) in zip(model.named_parameters(), reference.named_parameters(),
                                                    strict=True):
        assert name == same_name
        assert (fresh[name] - expected).abs().max() > 0.02  # Adam moved every tensor by ~lr per step
        if name.endswith("qkv.bias"):
            # The key bias adds the same number to every score of a query; softmax ignores it, so its gradient
            # is rounding noise, which Adam scales up to lr-sized steps. It changes no output: compare loosely.
            dim = param.numel() // 3
            torch.testing.assert_close(param[dim:2 * dim], expected[dim:2 * dim], rtol=0, atol=1e-3)
            param, expected = torch.cat([param[:dim], param[2 * dim:]]), torch.cat([expected[:dim],
                                                                                    expected[2 * dim:]])
        torch.testing.assert_close(param, expected, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    batches = data.batches(data.for_model("transformer", 256), world_size=1, rank=0, batch_size=16,
                           first_step=SAVED_AT)
    x, y = next(batches)  # the batch of the step after the checkpoint
    with torch.no_grad():
        assert models.loss_fn("transformer", model(x), y).item() == pytest.approx(
            models.loss_fn("transformer", reference(x), y).item(), abs=1e-5)
    optim = state["optim"]
    assert set(optim["state"]) == {name for name, _ in model.named_parameters()}  # keyed by parameter name
    assert optim["param_groups"][0]["lr"] == FSDPConfig().lr
    for index, (name, param) in enumerate(model.named_parameters()):
        entry, expected = optim["state"][name], reference_optimizer.state_dict()["state"][index]
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(entry["step"]) == SAVED_AT
        assert entry["exp_avg"].shape == entry["exp_avg_sq"].shape == param.shape
        torch.testing.assert_close(entry["exp_avg"], expected["exp_avg"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(entry["exp_avg_sq"], expected["exp_avg_sq"], rtol=1e-4, atol=1e-9)


@pytest.mark.timeout(180)
def test_torch_warnings_become_notes_instead_of_output(resumed, capsys):
    for api, kind in CASES:
        printed = resumed[api, kind][2]
        assert "Warning" not in printed and "ShardedTensor" not in printed, f"{api} {kind} printed:\n{printed}"
    # Load FSDP1's sharded checkpoint again: torch 2.13 goes through the deprecated ShardedTensor.
    directory, losses, _ = resumed["fsdp1", "sharded"]
    results = fsdp.run(FSDPConfig(api="fsdp1", checkpoint_kind="sharded", steps=SAVED_AT + 1, resume=True,
                                  checkpoint_dir=str(directory)), 2, output="all")
    printed = capsys.readouterr()
    assert "Warning" not in printed.out + printed.err and "ShardedTensor" not in printed.out + printed.err
    for result in results:
        assert result.first_step == SAVED_AT and result.losses == losses["straight"][SAVED_AT:SAVED_AT + 1]
        sharded_tensor = [note for note in result.notes if "ShardedTensor" in note]
        assert len(sharded_tensor) == 1, result.notes
        assert len(result.notes) == len(set(result.notes))  # once each, not once per FSDP unit


def documented_fsdp1_full_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """FSDP1's documented full-state-dict route (``FullStateDictConfig(offload_to_cpu=True,
    rank0_only=True)``), kept to show why dtlib avoids it on the CPU: there it raises
    "setStorage ... out of bounds for storage of size 0" (dtlib.train.fsdp_checkpoint's docstring says why).
    ``FSDP.state_dict_type`` itself is deprecated in torch 2.13 for ``get_state_dict``, which dtlib uses.
    """
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecation is the docstring's point
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}


def _documented_route(rank: int, world_size: int) -> dict[str, object]:
    """One Adam step of the FSDP1-wrapped transformer on the CPU, then FSDP1's documented full state dict."""
    torch.set_num_threads(1)
    config = FSDPConfig(api="fsdp1")
    model = fsdp_wrap.wrap_fsdp1(models.build("transformer", seed=0), config, world_size, torch.device("cpu"), [])
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    tokens = torch.randint(models.VOCAB, (4, models.SEQ_LEN), generator=torch.Generator().manual_seed(rank))
    models.loss_fn("transformer", model(tokens), tokens).backward()
    optimizer.step()
    return documented_fsdp1_full_state_dict(model, optimizer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs the documented route works")
@pytest.mark.timeout(90)
@pytest.mark.skipif(compat.fsdp1_cpu_offload_state_dict_works(), reason="this torch fixed the documented route")
def test_documented_fsdp1_full_state_dict_fails_on_the_cpu(leftovers):
    with pytest.raises(dtlib.WorkerError, match=r"setStorage|out of bounds") as info:
        dtlib.spawn(_documented_route, 2, timeout=30, output="none")
    assert not isinstance(info.value, dtlib.WorkerTimeout)
    assert any(failure.exc_type == "RuntimeError" for failure in info.value.failures)
    leftovers.assert_clean()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(120)
def test_documented_fsdp1_full_state_dict_works_on_gpus():
    def route(rank: int, world_size: int) -> list[str]:
        torch.cuda.set_device(rank)
        config = FSDPConfig(api="fsdp1")
        device = torch.device("cuda", rank)
        model = fsdp_wrap.wrap_fsdp1(models.build("transformer", seed=0).to(device), config, world_size, device, [])
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        tokens = torch.randint(models.VOCAB, (4, models.SEQ_LEN), device=device)
        models.loss_fn("transformer", model(tokens), tokens).backward()
        optimizer.step()
        state = documented_fsdp1_full_state_dict(model, optimizer)["model"]
        return sorted(name.replace("_fsdp_wrapped_module.", "") for name in state)

    names = dtlib.spawn(route, 2, backend="nccl", timeout=90, output="none")[0]
    assert names == sorted(models.build("transformer").state_dict())


# --- where checkpoints go, and what loading them may run ----------------------------------------------------


def test_default_directory_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    directory = fsdp_checkpoint.default_directory()
    assert directory == str(tmp_path / "cache" / "dtlib" / "checkpoints" / "fsdp")
    for path in (directory, os.path.dirname(directory), os.path.dirname(os.path.dirname(directory))):
        info = os.stat(path)
        assert stat.S_IMODE(info.st_mode) == 0o700, (path, oct(info.st_mode))  # nobody else can read or plant
        assert info.st_uid == os.getuid()
    assert fsdp_checkpoint.default_directory("run2") == os.path.join(os.path.dirname(directory), "run2")


def test_default_directory_tightens_a_loose_folder_and_refuses_another_users(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    loose = tmp_path / "dtlib" / "checkpoints" / "fsdp"
    loose.mkdir(parents=True)
    loose.chmod(0o777)
    assert fsdp_checkpoint.default_directory() == str(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    monkeypatch.setattr(os, "getuid", lambda: loose.stat().st_uid + 1)  # as if someone else had made it
    with pytest.raises(PermissionError, match=r"belongs to another user .* pass a directory of your own"):
        fsdp_checkpoint.default_directory()


class _Payload:
    """Unpickling it makes the directory ``marker``: harmless, and visible when the code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _planted_copy(resumed, tmp_path) -> pathlib.Path:
    """A copy of FSDP2's sharded checkpoint to plant payloads in; returns its data folder."""
    copy = tmp_path / "planted"
    shutil.copytree(resumed["fsdp2", "sharded"][0], copy)
    return copy / "a"


def _read_metadata(folder: pathlib.Path):
    with open(folder / ".metadata", "rb") as file:
        return pickle.load(file)  # our own file, written by the fixture's dcp.save


@pytest.mark.timeout(180)
def test_a_payload_planted_in_the_metadata_is_refused(resumed, tmp_path):
    folder, marker = _planted_copy(resumed, tmp_path), tmp_path / "ran"
    metadata = _read_metadata(folder)
    metadata.planner_data = _Payload(str(marker))  # a real checkpoint, with one extra object inside
    with open(folder / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    dcp.FileSystemReader(folder).read_metadata()  # torch's own reader: plain pickle runs the payload
    assert marker.exists()
    marker.rmdir()
    with pytest.raises(pickle.UnpicklingError, match=r"never names posix.mkdir; refusing to load it"):
        fsdp_checkpoint._CheckedReader(folder).read_metadata()
    with pytest.raises(dtlib.WorkerError, match=r"a/.metadata changed since it was written"):  # the digest
        fsdp.run(FSDPConfig(steps=SAVED_AT + 1, resume=True, checkpoint_dir=str(folder.parent)), 2, output="none")
    write_digests(folder, os.listdir(folder))  # a planter who records the new digests too
    with pytest.raises(dtlib.WorkerError, match=r"never names posix.mkdir; refusing to load it"):
        fsdp.run(FSDPConfig(steps=SAVED_AT + 1, resume=True, checkpoint_dir=str(folder.parent)), 2, output="none")
    assert not marker.exists()


@pytest.mark.timeout(180)
def test_a_payload_planted_in_a_value_is_refused(resumed, tmp_path):
    """DCP stores non-tensor entries (the optimizer's lr, betas, ...) as pickles and reads them back with
    ``torch.load(weights_only=False)``; dtlib's planner reads them with ``weights_only=True``."""
    folder, marker = _planted_copy(resumed, tmp_path), tmp_path / "ran"
    metadata = _read_metadata(folder)
    payload = io.BytesIO()
    torch.save(_Payload(str(marker)), payload)
    (folder / "__2_0.distcp").write_bytes(payload.getvalue())
    (index,) = [index for index in metadata.storage_data if index.fqn == "optim.param_groups.0.lr"]
    metadata.storage_data[index] = type(metadata.storage_data[index])("__2_0.distcp", 0, len(payload.getvalue()))
    with open(folder / ".metadata", "wb") as file:
        pickle.dump(metadata, file)

    def load_lr(**options) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is ... uninitialized": one process
            dcp.load({"optim": {"param_groups": [{"lr": 0.0}]}}, no_dist=True, **options)

    load_lr(checkpoint_id=folder)  # torch's default planner runs it
    assert marker.exists()
    marker.rmdir()
    with pytest.raises(CheckpointException, match=r"entry optim.param_groups.0.lr holds more than a value "
                                                  r"\(Trying to load unsupported GLOBAL posix.mkdir"):
        load_lr(storage_reader=fsdp_checkpoint._CheckedReader(folder),
                planner=fsdp_checkpoint._CheckedPlanner(whole=False))  # only the lr, on purpose
    write_digests(folder, os.listdir(folder))  # a planter who records the new digests too
    with pytest.raises(dtlib.WorkerError, match=r"optim.param_groups.0.lr holds more than a value"):
        fsdp.run(FSDPConfig(steps=SAVED_AT + 1, resume=True, checkpoint_dir=str(folder.parent)), 2, output="none")
    assert not marker.exists()


def test_a_step_file_that_points_elsewhere_or_names_another_kind_is_refused(tmp_path):
    model = models.build("transformer")
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in .*step.json is missing"):
        fsdp_checkpoint.load(model, optimizer, str(tmp_path), "sharded")
    step_file = tmp_path / fsdp_checkpoint.STEP_FILE
    step_file.write_text(json.dumps({"step": 3, "kind": "full", "folder": "a"}))
    with pytest.raises(ValueError, match=r"holds a 'full' checkpoint, not 'sharded': use checkpoint_kind='full'"):
        fsdp_checkpoint.load(model, optimizer, str(tmp_path), "sharded")
    step_file.write_text(json.dumps({"step": 3, "kind": "full", "folder": "../elsewhere"}))
    with pytest.raises(ValueError, match=r"is not one that dtlib.train.fsdp_checkpoint.save wrote"):
        fsdp_checkpoint.load(model, optimizer, str(tmp_path), "full")


# --- a failed save keeps the previous checkpoint ------------------------------------------------------------


def _save_then_fail_half_way(rank: int, world_size: int, directory: str) -> None:
    """Save the model (every weight + 0.5) at step 1; then change it and save again, with rank 1's disk
    filling up after three tensors: the second save fails on every rank."""
    torch.set_num_threads(1)
    config = FSDPConfig()
    model = fsdp_wrap.wrap_fsdp2(models.build("transformer", seed=0), config, world_size, torch.device("cpu"), [])
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5)
    fsdp_checkpoint.save(model, optimizer, 1, directory)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    if rank == 1:
        real_save, calls = torch.save, [0]

        def disk_fills_up(obj, file, *args, **kwargs):
            calls[0] += 1
            if calls[0] > 3:
                file.write(b"\0" * 100)
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save(obj, file, *args, **kwargs)

        torch.save = disk_fills_up
    fsdp_checkpoint.save(model, optimizer, 2, directory)


def _load_full_weights(rank: int, world_size: int, directory: str) -> tuple[int, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    config = FSDPConfig()
    model = fsdp_wrap.wrap_fsdp2(models.build("transformer", seed=1), config, world_size, torch.device("cpu"), [])
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    step = fsdp_checkpoint.load(model, optimizer, directory)
    return step, {name: param.full_tensor() for name, param in model.named_parameters()}


@pytest.mark.timeout(180)
def test_a_sharded_save_that_fails_half_way_keeps_the_previous_checkpoint(tmp_path, leftovers):
    directory = str(tmp_path / "ckpt")
    with pytest.raises(dtlib.WorkerError, match=r"No space left on device"):
        dtlib.spawn(_save_then_fail_half_way, 2, args=(directory,), timeout=120, output="none")
    assert json.loads((tmp_path / "ckpt" / fsdp_checkpoint.STEP_FILE).read_text())["step"] == 1
    step, weights = dtlib.spawn(_load_full_weights, 2, args=(directory,), timeout=120, output="none")[0]
    assert step == 1
    expected = models.build("transformer", seed=0).state_dict()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name] + 0.5, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    leftovers.assert_clean()


# --- a checkpoint from another model is refused, not half loaded -------------------------------------------


def _save_two_blocks_load_one(rank: int, world_size: int, directory: str) -> None:
    torch.set_num_threads(1)
    config = FSDPConfig()
    for blocks, action in ((2, "save"), (1, "load")):
        model = fsdp_wrap.wrap_fsdp2(models.TinyTransformer(blocks=blocks), config, world_size, torch.device("cpu"), [])
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        if action == "save":
            fsdp_checkpoint.save(model, optimizer, 1, directory)
        else:
            fsdp_checkpoint.load(model, optimizer, directory)


@pytest.mark.timeout(120)
def test_a_sharded_checkpoint_of_another_model_is_refused_as_the_full_one_is(tmp_path):
    with pytest.raises(dtlib.WorkerError, match=r"entries this model and optimizer have no place for "
                                                r"\(model\.blocks\.1\..*it was saved from a different model"):
        dtlib.spawn(_save_two_blocks_load_one, 2, args=(str(tmp_path / "ckpt"),), timeout=90, output="none")


def test_an_empty_step_file_and_a_truncated_checkpoint_are_named(tmp_path):
    """Errors that name the file: json's and torch's own messages name none."""
    from dtlib.train.checkpoint import load_file

    (tmp_path / fsdp_checkpoint.STEP_FILE).write_text("")
    model = models.build("transformer")
    with pytest.raises(ValueError, match=rf"{tmp_path}/step.json is empty or cut short"):
        fsdp_checkpoint.load(model, torch.optim.Adam(model.parameters()), str(tmp_path))
    whole = tmp_path / "whole.pt"
    torch.save({"weight": torch.ones(1000)}, whole)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # a save killed half way
    with pytest.raises(RuntimeError, match=rf"{cut} could not be loaded \(cut short"):
        load_file(str(cut), "cpu", digest=False)
    assert torch.equal(load_file(str(whole), "cpu", digest=False)["weight"], torch.ones(1000))


def _damaged_copy(resumed, tmp_path, kind: str, damage) -> pathlib.Path:
    copy = tmp_path / kind
    shutil.copytree(resumed["fsdp2", kind][0], copy)
    damage(copy / "a")
    return copy


def _flip_a_byte(folder: pathlib.Path) -> None:
    path = max((p for p in folder.iterdir() if p.name != "SHA256SUMS"), key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of a weight: DCP and torch.load would load it as a changed number
    path.write_bytes(bytes(data))


def _cut_short(folder: pathlib.Path) -> None:
    path = max((p for p in folder.iterdir() if p.name != "SHA256SUMS"), key=lambda p: p.stat().st_size)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["sharded", "full"])
@pytest.mark.parametrize("damage, error, says", [
    (_flip_a_byte, dtlib.ChangedFile, r"changed since it was written: its SHA-256 is"),
    (_cut_short, dtlib.ChangedFile, r"changed since it was written: .* bytes now\)"),
    (lambda folder: (folder / "SHA256SUMS").unlink(), FileNotFoundError, r"a/SHA256SUMS is missing"),
    (lambda folder: next(p for p in folder.iterdir() if p.name != "SHA256SUMS").unlink(), FileNotFoundError,
     r"is missing: .*SHA256SUMS lists it"),
], ids=["flipped byte", "cut short", "no record", "a file gone"])
def test_a_changed_truncated_or_missing_checkpoint_file_is_refused_by_name(resumed, tmp_path, kind, damage, error,
                                                                           says):
    """One flipped bit in a .distcp file loaded as a changed weight without a word (DCP keeps no checksum):
    every rank now checks the SHA-256 that save recorded, before it reads anything."""
    directory = _damaged_copy(resumed, tmp_path, kind, damage)
    model = models.build("transformer")
    with pytest.raises(error, match=says):
        fsdp_checkpoint.load(model, torch.optim.Adam(model.parameters()), str(directory), kind)


def _flip_a_weight(folder: pathlib.Path) -> str:
    """Flip one bit in the middle of the largest tensor's bytes (for DCP, where ``.metadata`` says they lie):
    DCP and torch.load read it as a changed number, without a word. Returns the file's name."""
    if (folder / fsdp_checkpoint.FULL_FILE).exists():
        name, offset, length = fsdp_checkpoint.FULL_FILE, 0, (folder / fsdp_checkpoint.FULL_FILE).stat().st_size
    else:
        info = max(_read_metadata(folder).storage_data.values(), key=lambda info: info.length)
        name, offset, length = info.relative_path, info.offset, info.length
    data = bytearray((folder / name).read_bytes())
    data[offset + length // 2] ^= 0x01
    (folder / name).write_bytes(bytes(data))
    return name


def _empty_the_record(folder: pathlib.Path) -> None:
    _flip_a_weight(folder)
    (folder / "SHA256SUMS").write_text("")


def _drop_the_flipped_file_from_the_record(folder: pathlib.Path) -> None:
    flipped = _flip_a_weight(folder)
    lines = (folder / "SHA256SUMS").read_text().splitlines(keepends=True)
    (folder / "SHA256SUMS").write_text("".join(line for line in lines if not line.endswith(f"  {flipped}\n")))


def _record_another_file(folder: pathlib.Path) -> None:
    _flip_a_weight(folder)
    (folder / "notes.txt").write_text("a file of someone else's")
    write_digests(folder, ["notes.txt"])  # a whole, correct record: of notes.txt alone


def _add_a_file(name: str):
    def add(folder: pathlib.Path) -> None:
        (folder / name).write_bytes((folder / "SHA256SUMS").read_bytes())  # any bytes: the record never saw them
    return add


def _name_a_file_that_is_not_there(folder: pathlib.Path) -> None:
    metadata = _read_metadata(folder)
    (index,) = [index for index in metadata.storage_data if index.fqn == "optim.param_groups.0.lr"]
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="__2_0.distcp")
    with open(folder / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    write_digests(folder, os.listdir(folder))  # the record complete, for the folder as it now is


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind, damage, error, says", [
    ("sharded", _empty_the_record, dtlib.ChangedFile, r"a/SHA256SUMS lists no file, so it checks nothing"),
    ("full", _empty_the_record, dtlib.ChangedFile, r"a/SHA256SUMS lists no file, so it checks nothing"),
    ("sharded", _drop_the_flipped_file_from_the_record, dtlib.ChangedFile,
     r"a/__\d_0.distcp is not in .*a/SHA256SUMS: the record must list every file of the checkpoint"),
    ("sharded", _record_another_file, dtlib.ChangedFile, r"a/.metadata is not in .*a/SHA256SUMS \(nor are 2 more\)"),
    ("full", _record_another_file, dtlib.ChangedFile, r"a/full.pt is not in .*a/SHA256SUMS"),
    ("sharded", _add_a_file("__2_0.distcp"), dtlib.ChangedFile,
     r"a/__2_0.distcp is not in .*a/SHA256SUMS.*Remove the file if you put it there"),
    ("full", _add_a_file("full.pt.orig"), dtlib.ChangedFile, r"a/full.pt.orig is not in .*a/SHA256SUMS"),
    ("sharded", _name_a_file_that_is_not_there, FileNotFoundError,
     r"a/__2_0.distcp is missing: a sharded checkpoint is read from it, as .metadata says, and SHA256SUMS lists no"),
    ("sharded", _flip_a_weight, dtlib.ChangedFile, r"a/__\d_0.distcp changed since it was written"),
    ("full", _flip_a_weight, dtlib.ChangedFile, r"a/full.pt changed since it was written"),
], ids=["sharded, record emptied", "full, record emptied", "sharded, record cut short",
        "sharded, record of another file", "full, record of another file", "sharded, a file added",
        "full, a file added", "sharded, .metadata names a file not recorded", "sharded, a weight flipped, record whole",
        "full, a weight flipped, record whole"])
def test_a_record_that_leaves_a_file_out_is_refused(resumed, tmp_path, kind, damage, error, says):
    """A record checks only what it lists. Before, an emptied record, one cut short or one of another file checked
    nothing, and a flipped byte in the file it skipped loaded as a changed weight: now every file in the folder,
    and every file ``.metadata`` names, must be in it. Under a whole record the flipped weight is caught, as before."""
    directory = _damaged_copy(resumed, tmp_path, kind, damage)
    model = models.build("transformer")
    with pytest.raises(error, match=says):
        fsdp_checkpoint.load(model, torch.optim.Adam(model.parameters()), str(directory), kind)


@pytest.mark.timeout(120)
def test_a_ddp_checkpoint_carries_its_digest_and_a_changed_one_is_refused(tmp_path):
    from dtlib.train import ddp
    from dtlib.train.checkpoint import load_file

    path = tmp_path / "ckpt.pt"
    ddp.run(ddp.TrainConfig(steps=2, save_after_step=2, checkpoint_path=str(path)), 2, output="none")
    assert (tmp_path / "ckpt.pt.sha256").read_text().endswith("  ckpt.pt\n")
    assert load_file(str(path), "cpu")["step"] == 2
    _flip_a_byte(tmp_path)
    with pytest.raises(dtlib.ChangedFile, match=rf"{path} changed since it was written"):
        load_file(str(path), "cpu")
    with pytest.raises(dtlib.WorkerError, match=r"ckpt.pt changed since it was written"):
        ddp.run(ddp.TrainConfig(steps=3, resume=True, checkpoint_path=str(path)), 2, output="none")
    (tmp_path / "ckpt.pt.sha256").unlink()
    with pytest.raises(FileNotFoundError, match=r"ckpt.pt.sha256 is missing"):
        load_file(str(path), "cpu")


def _load_counting_checks(rank, world_size, directory, kind):
    """Load a checkpoint in a rank, listing the files this rank hashed."""
    from dtlib.train import checkpoint, fsdp_checkpoint, models

    hashed, original = [], checkpoint.sha256
    checkpoint.sha256 = lambda path: hashed.append(os.path.basename(path)) or original(path)
    model = models.build("transformer")
    try:
        fsdp_checkpoint.load(model, torch.optim.Adam(model.parameters()), directory, kind)
        return sorted(hashed), None
    except (ValueError, OSError) as error:
        return sorted(hashed), f"{type(error).__name__}: {error}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_the_ranks_share_the_hashing_and_every_rank_hears_the_verdict(resumed, tmp_path, kind):
    """Every rank hashed every file (N x N reads of the checkpoint); now each rank of the machine hashes its share
    (each file once in the job, and ``.metadata``, which each rank reads, by each), and a refusal reaches every
    rank, each raising it, so that none goes on to a load its peers refused."""
    intact = resumed["fsdp2", kind][0]
    results = dtlib.spawn(_load_counting_checks, 2, args=(str(intact), kind), output="none")
    assert [said for _, said in results] == [None, None]
    files = sorted(name for name in os.listdir(intact / "a") if name != "SHA256SUMS")  # "a": the saved folder
    shares = [hashed for hashed, _ in results]
    if kind == "sharded":
        assert all(".metadata" in share for share in shares)
        shares = [[name for name in share if name != ".metadata"] for share in shares]
    assert sorted(shares[0] + shares[1]) == [name for name in files if name != ".metadata" or kind != "sharded"]
    assert len(files) < 2 or all(shares), f"one rank hashed nothing of {files}: {shares}"
    damaged = str(_damaged_copy(resumed, tmp_path, kind, _flip_a_byte))
    results = dtlib.spawn(_load_counting_checks, 2, args=(damaged, kind), output="none")
    assert all(said.startswith("ChangedFile: ") and "changed since it was written" in said for _, said in results)
