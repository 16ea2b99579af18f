"""dtlib.train.ddp_scratch: NaiveDDP and BucketedDDP against torch's DistributedDataParallel on 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dtlib
from dtlib.measure.counting import count_collectives
from dtlib.train import data, models
from dtlib.train.ddp_scratch import BucketedDDP, NaiveDDP

CAPS_MB = (0.0001, 0.001, 25.0)  # 0.0001 MB = 105 bytes: nearly one bucket per parameter
NAMES = ("mlp", "transformer")


def _batch(name: str, rank: int, size: int = 8, seed_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Different samples on every rank."""
    dataset = data.for_model(name, size, seed=100 * rank + seed_offset)
    return dataset.tensors


def _backward(model: torch.nn.Module, name: str, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = batch
    models.loss_fn(name, model(x), y).backward()


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]


def _wrappers(cap_list=CAPS_MB):
    yield "naive", lambda module: NaiveDDP(module)
    for cap in cap_list:
        yield f"bucketed {cap}", lambda module, cap=cap: BucketedDDP(module, cap)


def _scratch_against_torch(rank, world_size):
    torch.set_num_threads(1)
    out: dict = {"grads": {}, "reference": {}, "layouts": {}, "no_sync": {}}
    for name in NAMES:
        batch, later = _batch(name, rank), _batch(name, rank, seed_offset=1)
        reference = DistributedDataParallel(models.build(name, seed=0))
        _backward(reference, name, batch)
        out["reference"][name] = _grads(reference.module)
        # no_sync: accumulate one batch locally, then synchronise on the next backward
        reference = DistributedDataParallel(models.build(name, seed=0))
        with reference.no_sync():
            _backward(reference, name, batch)
        _backward(reference, name, later)
        out["reference"][f"{name} accumulated"] = _grads(reference.module)
        for label, wrap in _wrappers():
            ours = wrap(models.build(name, seed=0))
            _backward(ours, name, batch)
            ours.finish_gradient_sync()
            out["grads"][(name, label)] = _grads(ours.module)
            if isinstance(ours, BucketedDDP):
                index = {id(p): i for i, p in enumerate(ours.module.parameters())}
                out["layouts"][(name, label)] = [[(index[id(p)], p.numel() * p.element_size()) for p in bucket]
                                                 for bucket in ours.buckets]
            ours = wrap(models.build(name, seed=0))

            def accumulate(model=ours, name=name, batch=batch):
                with model.no_sync():
                    _backward(model, name, batch)
                    model.finish_gradient_sync()  # nothing in flight: must be a no-op

            def synchronise(model=ours, name=name, later=later):
                _backward(model, name, later)
                model.finish_gradient_sync()

            calls_inside = count_collectives(accumulate)[1].get("all_reduce", 0)  # held to CommDebugMode: test_counting
            local = _grads(ours.module)
            calls_after = calls_inside + count_collectives(synchronise)[1].get("all_reduce", 0)
            out["no_sync"][(name, label)] = {"calls_inside": calls_inside, "calls_after": calls_after,
                                             "local": local, "synced": _grads(ours.module),
                                             "buckets": len(getattr(ours, "buckets", ours.params))}
    # the constructor broadcasts rank 0's parameters and buffers
    out["broadcast"] = {}
    for label, wrap in _wrappers(cap_list=(0.001,)):
        module = models.build("batchnorm", seed=rank)  # a different model on every rank
        module.net[1].running_mean.fill_(float(rank + 1))
        wrap(module)
        out["broadcast"][label] = (torch.cat([p.detach().reshape(-1) for p in module.parameters()]),
                                   module.net[1].running_mean.clone())
    out["bad_caps"] = []
    for cap in (0, -1.0):
        try:
            BucketedDDP(models.build("mlp"), cap)
            out["bad_caps"].append("")
        except ValueError as err:
            out["bad_caps"].append(str(err))
    # fp16 gradients of 40000 on every rank: dividing before the sum keeps the average (fp16's largest is 65504)
    out["fp16"] = {}
    for label, wrap in [("torch DDP", DistributedDataParallel), *_wrappers(cap_list=(25.0,))]:
        layer = torch.nn.Linear(1, 1, bias=False).half()
        wrapped = wrap(layer)
        wrapped(torch.full((1, 1), 40000.0, dtype=torch.float16)).sum().backward()  # the gradient is the input
        getattr(wrapped, "finish_gradient_sync", lambda: None)()
        out["fp16"][label] = layer.weight.grad.item()
    # why NaiveDDP hooks after accumulation: a register_hook hook sees one backward's gradient, not .grad's sum
    weight, syncing = torch.nn.Parameter(torch.zeros(3)), [False]

    def average(grad):
        if not syncing[0]:
            return grad
        grad = grad / world_size
        dist.all_reduce(grad)
        return grad

    weight.register_hook(average)
    for micro_batch, last in ((1.0, False), (2.0, True)):  # the first as if under no_sync
        syncing[0] = last
        (weight * (micro_batch + 10 * rank)).sum().backward()
    out["register_hook_accumulated"] = weight.grad.clone()
    unused = BucketedDDP(models.build("branchy"), 25.0)  # one bucket: nothing launched before the error
    _backward(unused, "branchy", _batch("mlp", rank))
    try:
        unused.finish_gradient_sync()
        out["unused_error"] = ""
    except RuntimeError as err:
        out["unused_error"] = str(err)
    return out


@pytest.fixture(scope="module")
def reports():
    return dtlib.spawn(_scratch_against_torch, 2, output="none")


def _local_grads(name: str, rank: int) -> list[torch.Tensor]:
    model = models.build(name, seed=0)
    _backward(model, name, _batch(name, rank))
    return _grads(model)


def _assert_grads_equal(ours, theirs, what):
    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, i=i: f"{what}, parameter {i}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("label", [label for label, _ in _wrappers()])
def test_gradients_equal_torch_ddp(reports, name, label):
    for rank, report in enumerate(reports):
        _assert_grads_equal(report["grads"][(name, label)], report["reference"][name], f"{label}, {name}, rank {rank}")
    # the oracle itself: torch's DDP averaged two different local gradients
    local = [_local_grads(name, rank) for rank in range(2)]
    assert not torch.equal(local[0][0], local[1][0])
    _assert_grads_equal(reports[0]["reference"][name], [(a + b) / 2 for a, b in zip(*local, strict=True)],
                        f"torch DDP against the mean of local gradients, {name}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_buckets_hold_parameters_in_reverse_order_and_close_at_the_cap(reports, name):
    count = len(list(models.build(name).parameters()))
    layouts = reports[0]["layouts"]
    for cap in CAPS_MB:
        buckets = layouts[(name, f"bucketed {cap}")]
        assert [i for bucket in buckets for i, _ in bucket] == list(reversed(range(count)))
        cap_bytes = cap * 2**20
        for bucket in buckets[:-1]:  # every closed bucket reached the cap with its last parameter
            sizes = [nbytes for _, nbytes in bucket]
            assert sum(sizes) >= cap_bytes and sum(sizes) - sizes[-1] < cap_bytes, (cap, sizes)
        last = [nbytes for _, nbytes in buckets[-1]]
        assert sum(last) - last[-1] < cap_bytes
        assert reports[1]["layouts"][(name, f"bucketed {cap}")] == buckets  # the same on every rank
    assert len(layouts[(name, "bucketed 25.0")]) == 1
    assert len(layouts[(name, "bucketed 0.0001")]) > len(layouts[(name, "bucketed 0.001")]) > 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("label", [label for label, _ in _wrappers()])
def test_no_sync_skips_communication_and_the_next_backward_syncs_the_sum(reports, name, label):
    for rank, report in enumerate(reports):
        seen = report["no_sync"][(name, label)]
        assert seen["calls_inside"] == 0, "an all-reduce ran inside no_sync()"
        assert seen["calls_after"] == seen["buckets"]  # one per parameter (naive) or per bucket
        _assert_grads_equal(seen["local"], _local_grads(name, rank), f"{label}, {name}, rank {rank}, local")
        _assert_grads_equal(seen["synced"], report["reference"][f"{name} accumulated"],
                            f"{label}, {name}, rank {rank}, accumulated")


@pytest.mark.timeout(120)
def test_constructor_broadcasts_rank_0s_parameters_and_buffers(reports):
    expected = torch.cat([p.detach().reshape(-1) for p in models.build("batchnorm", seed=0).parameters()])
    assert not torch.equal(expected, torch.cat([p.detach().reshape(-1)
                                                for p in models.build("batchnorm", seed=1).parameters()]))
    for report in reports:
        for label, (params, running_mean) in report["broadcast"].items():
            assert torch.equal(params, expected), label
            assert torch.equal(running_mean, torch.ones_like(running_mean)), label  # rank 0 filled it with 1


@pytest.mark.timeout(120)
def test_bad_bucket_cap_is_refused(reports):
    for report in reports:
        assert len(report["bad_caps"]) == 2
        for message in report["bad_caps"]:
            assert "bucket_cap_mb must be > 0" in message


@pytest.mark.timeout(120)
def test_unused_parameter_is_reported_not_silently_skipped(reports):
    for report in reports:
        assert "find_unused_parameters" in report["unused_error"]
        assert "0 of 1 buckets" in report["unused_error"]


@pytest.mark.timeout(120)
def test_averages_divide_before_they_sum_as_torch_ddp_does(reports):
    assert torch.finfo(torch.float16).max < 2 * 40000.0  # summing first would overflow to inf
    for report in reports:
        assert report["fp16"] == {"torch DDP": 40000.0, "naive": 40000.0, "bucketed 25.0": 40000.0}


@pytest.mark.timeout(120)
def test_a_register_hook_average_misses_what_no_sync_accumulated(reports):
    # right: ((1 + 2) + (11 + 12)) / 2 = 13 on both ranks; the hook averaged only the second backward's 2 and 12
    hooked = [report["register_hook_accumulated"] for report in reports]
    assert hooked[0].tolist() == [1.0 + 7.0] * 3 and hooked[1].tolist() == [11.0 + 7.0] * 3
