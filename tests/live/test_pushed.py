"""Pulled DTensors and DeviceMeshes pushed back to live ranks (:mod:`dtlib.live.pushed`).

Oracles: torch's own split of a DTensor (``_compute_local_shape_and_global_offset``) for the shape each rank's
part must have, and the original mesh and DTensor on the ranks for what a push rebuilds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from dtlib.launch.shards import LocalMesh
from dtlib.live.pushed import MeshSpec, local_shape, mesh_spec, to_send

pytestmark = pytest.mark.timeout(300)

MESHES = """from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
flat = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
grid = init_device_mesh(device.type, (1, world_size), mesh_dim_names=("dp", "tp"))
plain = init_device_mesh(device.type, (world_size,))
w = distribute_tensor(torch.arange(10.0).reshape(5, 2), flat, [Shard(0)])
kept = rank + 80
"""


# -- in the kernel: what each rank's part must be --------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=3), st.lists(st.integers(1, 3), min_size=1, max_size=3),
       st.data())
def test_the_shape_each_ranks_part_must_have_is_torchs(global_shape, mesh_shape, data):
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as torchs_split

    kinds = st.one_of(st.just(Replicate()), st.just(Partial()), st.integers(0, len(global_shape) - 1).map(Shard))
    placements = tuple(data.draw(st.lists(kinds, min_size=len(mesh_shape), max_size=len(mesh_shape))))
    coordinate = tuple(data.draw(st.integers(0, size - 1)) for size in mesh_shape)
    expected = torchs_split(tuple(global_shape), tuple(mesh_shape), list(coordinate), placements)[0]
    assert local_shape(tuple(global_shape), placements, tuple(mesh_shape), coordinate) == tuple(expected)


def test_a_placement_it_does_not_know_is_not_guessed():
    class Strided(Shard):  # a subclass, as torch's _StridedShard is: its split is not Shard's
        pass

    assert local_shape((4,), (Strided(0),), (2,), (0,)) is None


def _view(rank: int, text: str, mesh: list) -> LocalMesh:
    return LocalMesh(rank=rank, text=text, mesh=mesh, coordinate=(rank,))


def test_a_mesh_is_read_back_from_torchs_repr_or_refused():
    named = [_view(r, "DeviceMesh((dp=1, tp=2), 'cpu', stride=(2, 1))", [[0, 1]]) for r in (0, 1)]
    assert mesh_spec("m", named, 2) == MeshSpec("cpu", [[0, 1]], ("dp", "tp"))
    plain = [_view(r, "DeviceMesh((2,), 'cuda', stride=(1,), Mesh: [0, 1])", [0, 1]) for r in (0, 1)]
    assert mesh_spec("m", plain, 2) == MeshSpec("cuda", [0, 1], None)
    with pytest.raises(ValueError, match="cannot be read back here. Build it on the ranks instead"):
        mesh_spec("m", [_view(r, "DeviceMesh((dp=4), 'cpu', stride=(1,))", [0, 1]) for r in (0, 1)], 2)  # 4 != 2
    with pytest.raises(ValueError, match="cannot be read back"):
        mesh_spec("m", [_view(r, "DeviceMesh('cpu', [0, 1])", [0, 1]) for r in (0, 1)], 2)
    with pytest.raises(ValueError, match="different meshes on different ranks .* push the mesh it came from"):
        mesh_spec("m", [_view(r, "DeviceMesh((dp=1), 'cpu', stride=(2,))", [r]) for r in (0, 1)], 2)
    with pytest.raises(ValueError, match=r"mesh \[0, 3\] does not fit these 2 ranks"):
        mesh_spec("m", [_view(r, "DeviceMesh((2,), 'cpu', stride=(1,))", [0, 3]) for r in (0, 1)], 2)
    with pytest.raises(ValueError, match="rank 1's view of a DeviceMesh: push the whole pulled list"):
        to_send("m", named[1], 2)
    with pytest.raises(ValueError, match="beside other values: push each pulled list"):
        to_send("m", [named[0], 5], 2)
    assert to_send("m", [1, 2], 2) == [1, 2] and to_send("m", [], 2) == []


# -- on live ranks --------------------------------------------------------------------------------------------
def test_a_pulled_mesh_pushed_back_is_the_same_mesh_and_carries_a_dtensor(ranks, capsys):
    """Pushed back, a pulled mesh arrived as LocalMesh objects, and using it failed later inside torch; it is
    rebuilt on every rank now: the same device type, ranks and dim names, and a DTensor on it works."""
    ranks.run(MESHES)
    for name in ("flat", "grid", "plain"):
        ranks.push(again=ranks.pull(name))
        assert "every rank got the DeviceMesh back" in capsys.readouterr().out
        assert ranks.run(f"repr(again) == repr({name}), again.mesh.tolist() == {name}.mesh.tolist(), "
                         f"again.mesh_dim_names == {name}.mesh_dim_names, again.device_type") == [
            (True, True, True, "cpu")] * 2
        parts = ranks.run("x = distribute_tensor(torch.arange(4.0), again, [Replicate()] * (again.ndim - 1) + "
                          "[Shard(0)])\nx.full_tensor().tolist(), x.to_local().tolist()")
        assert parts == [([0.0, 1.0, 2.0, 3.0], [0.0, 1.0]), ([0.0, 1.0, 2.0, 3.0], [2.0, 3.0])]
    ranks.push(grid2=ranks.pull("grid"))
    assert ranks.run("grid2['tp'].mesh.tolist(), grid2['dp'].mesh.tolist()") == [([0, 1], [0]), ([0, 1], [1])]
    with pytest.raises(ValueError, match="different meshes on different ranks"):
        ranks.push(sub=ranks.run("grid['dp']"))  # [0] on rank 0, [1] on rank 1
    assert ranks.pull("kept") == [80, 81]


def test_shards_whose_shapes_do_not_fit_their_placement_are_refused_before_anything_is_sent(ranks):
    """An edited shard of the wrong shape was pushed, rebuilt, and gloo aborted rank 1 at the next collective:
    every variable lost. The push is now refused in the kernel, naming the rank and both shapes."""
    ranks.run(MESHES)
    pids = ranks.run("import os\nos.getpid()")
    shards = ranks.pull("w")  # 5 rows on 2 ranks: 3 and 2
    assert [tuple(s.local.shape) for s in shards] == [(3, 2), (2, 2)]
    for edited, said in [
            (dataclasses.replace(shards[1], local=torch.zeros(3, 2)), r"rank 1's shard has shape \(3, 2\), but "
             r"placements \(Shard\(dim=0\),\) of a DTensor of shape \(5, 2\) on mesh \[0, 1\] give rank 1 a part "
             r"of shape \(2, 2\)"),
            (dataclasses.replace(shards[1], local=torch.zeros(2)), r"rank 1's shard has shape \(2,\)"),
            (dataclasses.replace(shards[1], local=shards[1].local.double()), "rank 1's shard is torch.float64"),
            (dataclasses.replace(shards[1], global_shape=(4, 2)), "differs from rank 0's in global_shape")]:
        with pytest.raises(ValueError, match=said):
            ranks.push(bad=[shards[0], edited])
    edited = [shards[0], dataclasses.replace(shards[1], local=shards[1].local * 10)]  # values edited, shape kept
    ranks.push(w2=edited)
    assert ranks.run("w2.full_tensor().sum().item()") == [float(sum(range(6)) + 10 * sum(range(6, 10)))] * 2
    assert ranks.run("import os\nos.getpid()") == pids  # no rank died or restarted
    assert ranks.pull("kept") == [80, 81] and ranks.run("'bad' in globals()") == [False, False]
