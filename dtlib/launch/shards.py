"""A DTensor's part on one rank, as it travels back from a rank (:func:`dtlib.launch.worker.dumps_result`) and
back to the ranks (``LiveRanks.push``): its local tensor, its placements, and the mesh it lives on.

A DTensor cannot leave its rank as one: its mesh holds process groups that exist only there. What comes back is
:class:`LocalShard`, and a list of them, one per rank, can be pushed back to rebuild the same DTensor::

    shards = live.pull("w")          # [LocalShard(rank 0's rows), LocalShard(rank 1's rows)]
    live.push(w=shards)              # each rank gets its own shard back, as a DTensor again
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class LocalShard:
    """One rank's part of a DTensor: ``local`` (a CPU tensor), how the DTensor is laid out, and where."""

    rank: int
    local: Any  # torch.Tensor, on the CPU
    placements: tuple[Any, ...]  # torch's Placement objects: Shard(dim), Replicate(), Partial()
    global_shape: tuple[int, ...]
    device_type: str
    mesh: list[Any]  # the mesh's ranks, nested as its shape (DeviceMesh.mesh.tolist())
    mesh_dim_names: tuple[str, ...] | None
    coordinate: tuple[int, ...] | None  # this rank's place in the mesh

    def __repr__(self) -> str:
        names = f" {self.mesh_dim_names}" if self.mesh_dim_names else ""
        return (f"{self.local!r}\n# rank {self.rank}'s local shard of a DTensor of shape {tuple(self.global_shape)}, "
                f"placements {tuple(self.placements)}, at mesh coordinate {self.coordinate}{names}")


@dataclass(frozen=True)
class LocalMesh:
    """A DeviceMesh as one rank sees it: its ``repr``, the ranks it holds, and this rank's coordinate in it."""

    rank: int
    text: str
    mesh: list[Any]
    coordinate: tuple[int, ...] | None

    def __repr__(self) -> str:
        return f"{self.text}\n# ranks {self.mesh}; rank {self.rank} at coordinate {self.coordinate}"


def local_mesh(mesh: Any) -> LocalMesh:
    """``mesh``, a DeviceMesh, as this rank's :class:`LocalMesh` (its process groups cannot leave the rank)."""
    coordinate = mesh.get_coordinate()
    return LocalMesh(rank=dist.get_rank(), text=repr(mesh), mesh=mesh.mesh.tolist(),
                     coordinate=tuple(coordinate) if coordinate is not None else None)


def local_shard(tensor: Any) -> LocalShard:
    """``tensor``, a DTensor, as this rank's :class:`LocalShard`. Example: ``local_shard(dtensor).local``."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    return LocalShard(rank=dist.get_rank(), local=tensor.to_local().detach().cpu(),
                      placements=tuple(tensor.placements), global_shape=tuple(tensor.shape),
                      device_type=mesh.device_type, mesh=mesh.mesh.tolist(),
                      mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                      coordinate=tuple(coordinate) if coordinate is not None else None)


def describe(shards: list[Any]) -> str:
    """One sentence on a list of every rank's :class:`LocalShard` (or :class:`LocalMesh`): one DTensor (or one
    mesh), and how its parts relate."""
    first = shards[0]
    if all(isinstance(s, LocalMesh) for s in shards):
        same = all(s.mesh == first.mesh and s.text == first.text for s in shards)
        return "one mesh, each rank at its own coordinate" if same else "different meshes on different ranks"
    same_tensor = all(s.global_shape == first.global_shape and s.placements == first.placements
                      and s.mesh == first.mesh for s in shards)
    if not same_tensor:
        return "local shards of DTensors that differ in shape, placements or mesh"
    kinds = {type(p).__name__ for p in first.placements}
    if kinds == {"Replicate"}:
        equal = all(s.local.shape == first.local.shape and torch.equal(s.local, first.local) for s in shards)
        return ("one replicated DTensor: the same on every rank" if equal else
                "one DTensor placed Replicate(), but the ranks' copies differ: it is not what its placement says")
    partial = " (Partial: the DTensor's value is the sum of the ranks' parts)" if "Partial" in kinds else ""
    return (f"one DTensor of shape {tuple(first.global_shape)}, placements {tuple(first.placements)}: each rank "
            f"holds its own part{partial}")


def rebuild(shard: LocalShard, device: Any) -> Any:
    """The DTensor ``shard`` came from, on this rank: its local tensor on ``device``, on a new mesh of the same
    ranks and names (every rank must call it: a mesh creates process groups). Example: ``rebuild(shards[rank],
    device)``."""
    from torch.distributed.tensor import DTensor

    mesh = DeviceMesh(shard.device_type, torch.tensor(shard.mesh), mesh_dim_names=shard.mesh_dim_names)
    return DTensor.from_local(shard.local.to(device), mesh, list(shard.placements), run_check=False,
                              shape=torch.Size(shard.global_shape),
                              stride=torch.empty(shard.global_shape, device="meta").stride())
