"""Pulled DTensors and DeviceMeshes pushed back to live ranks: checked in the kernel, rebuilt on each rank.

A DTensor or a DeviceMesh cannot leave its rank whole (its mesh holds process groups that exist only there), so
``LiveRanks.pull`` gives every rank's :class:`~dtlib.launch.shards.LocalShard` or
:class:`~dtlib.launch.shards.LocalMesh`. ``LiveRanks.push`` gives them back: :func:`to_send`, in the kernel,
refuses what cannot be rebuilt as it is (one rank's part alone, shards whose shapes do not fit their placements,
a submesh that differs by rank) before anything is sent, and marks the rest for each rank; :func:`rebuild_on_rank`,
in every rank in the same order (a mesh's process groups are made collectively), builds the DTensor or mesh::

    shards = live.pull("w")            # [LocalShard(rank 0's rows), LocalShard(rank 1's rows)]
    live.push(w=shards, mesh=live.pull("mesh"))   # a DTensor and a DeviceMesh again, on every rank

Imports dtlib.launch.shards and torch (the ranks' side); nothing here starts or talks to a rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from dtlib.launch.shards import LocalMesh, LocalShard, rebuild


class ShardsByRank(list):
    """Every rank's shard of a DTensor, pushed: each rank rebuilds the DTensor from its own one."""


@dataclass(frozen=True)
class MeshSpec:
    """A DeviceMesh to build on every rank: ``DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names)``."""

    device_type: str
    mesh: list[Any]  # the ranks, nested as the mesh's shape
    mesh_dim_names: tuple[str, ...] | None


def to_send(name: str, value: Any, world_size: int) -> Any:
    """``value`` as it should travel to the ranks: a pulled DTensor's shards as :class:`ShardsByRank`, a pulled
    mesh as a :class:`MeshSpec`, anything else as it is. Raises ValueError, saying what to push instead, for what
    would be wrong on a rank. Example: ``to_send("w", live.pull("w"), 2)`` is a ShardsByRank of 2 shards."""
    if isinstance(value, LocalShard):
        raise ValueError(f"{name} is rank {value.rank}'s shard of a DTensor: pushed, every rank would hold rank "
                         f"{value.rank}'s part. Push the whole pulled list (one shard per rank) to give each rank "
                         "its own, or a plain tensor (value.local) to give every rank the same")
    if isinstance(value, LocalMesh):
        raise ValueError(f"{name} is rank {value.rank}'s view of a DeviceMesh: push the whole pulled list (one per "
                         "rank), and every rank gets the mesh back")
    parts = list(value.values()) if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    pulled = [part for part in parts if isinstance(part, (LocalShard, LocalMesh))]
    if not pulled:
        return value
    if len(pulled) < len(parts) or isinstance(value, dict) or len({type(part) for part in pulled}) > 1:
        raise ValueError(f"{name} holds pulled DTensor shards or DeviceMeshes beside other values: push each pulled "
                         "list (one part per rank) under a name of its own")
    ranks = [part.rank for part in pulled]
    if ranks != list(range(world_size)):
        what = "DTensor shards" if isinstance(pulled[0], LocalShard) else "DeviceMesh views"
        raise ValueError(f"{name} holds {what} of ranks {ranks}; pushing rebuilds it from one part per rank, in "
                         f"rank order 0..{world_size - 1}")
    if isinstance(pulled[0], LocalMesh):
        return mesh_spec(name, pulled, world_size)
    _check_shards(name, pulled)
    return ShardsByRank(pulled)


def _check_shards(name: str, shards: list[LocalShard]) -> None:
    """Refuse shards that are not one DTensor's parts: on a rank, gloo would abort at the first collective."""
    first = shards[0]
    for shard in shards:
        if not isinstance(shard.local, torch.Tensor):
            raise ValueError(f"{name}: rank {shard.rank}'s shard holds a {type(shard.local).__name__}, not a tensor")
        fields = ("global_shape", "placements", "mesh", "mesh_dim_names", "device_type")
        differ = [field for field in fields if getattr(shard, field) != getattr(first, field)]
        if differ:
            raise ValueError(f"{name}: rank {shard.rank}'s shard differs from rank 0's in {', '.join(differ)}, so "
                             "the shards are not parts of one DTensor. Nothing was pushed; the ranks keep their "
                             "variables")
        if shard.local.dtype != first.local.dtype:
            raise ValueError(f"{name}: rank {shard.rank}'s shard is {shard.local.dtype}, rank 0's {first.local.dtype}:"
                             " a DTensor's parts share one dtype. Nothing was pushed; the ranks keep their variables")
    mesh = torch.tensor(first.mesh)
    for shard in shards:
        where = (mesh == shard.rank).nonzero()
        if len(where) != 1:
            continue  # a rank outside the mesh holds no part of it
        required = local_shape(first.global_shape, first.placements, tuple(mesh.shape), tuple(where[0].tolist()))
        if required is not None and tuple(shard.local.shape) != required:
            raise ValueError(
                f"{name}: rank {shard.rank}'s shard has shape {tuple(shard.local.shape)}, but placements "
                f"{tuple(first.placements)} of a DTensor of shape {tuple(first.global_shape)} on mesh {first.mesh} "
                f"give rank {shard.rank} a part of shape {required}. Nothing was pushed; the ranks keep their "
                "variables. Keep each shard's shape, or push a plain tensor and build the DTensor on the ranks "
                "(distribute_tensor)")


def local_shape(global_shape: tuple[int, ...], placements: tuple[Any, ...], mesh_shape: tuple[int, ...],
                coordinate: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape of the part that ``placements`` give the rank at ``coordinate`` of a mesh of ``mesh_shape``, as
    torch splits a DTensor (``Shard(d)`` cuts dim ``d`` as ``torch.chunk`` does, mesh dims left to right); None for
    a placement this does not know. Example: ``local_shape((5,), (Shard(0),), (2,), (1,))`` is ``(2,)``."""
    shape = list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        kind = type(placement).__name__
        if kind in ("Replicate", "Partial"):
            continue
        if kind != "Shard" or not shape:
            return None
        dim = placement.dim % len(shape)
        size, parts, index = shape[dim], mesh_shape[mesh_dim], coordinate[mesh_dim]
        chunk = -(-size // parts)  # torch.chunk's part size: the last parts are shorter, or empty
        shape[dim] = max(0, min(size, chunk * (index + 1)) - chunk * index)
    return tuple(shape)


#: torch's repr of a DeviceMesh: ``DeviceMesh((dp=1, tp=2), 'cpu', stride=(2, 1))``, or ``DeviceMesh((2,), ...``
_MESH_REPR = re.compile(r"DeviceMesh\(\(([^()]*)\), '([^']+)'")


def mesh_spec(name: str, meshes: list[LocalMesh], world_size: int) -> MeshSpec:
    """Every rank's view of one DeviceMesh as the :class:`MeshSpec` to rebuild it from: its ranks, and its device
    type and dim names as torch's ``repr`` of it says them (checked against the mesh's shape). Raises ValueError
    for meshes that differ by rank, or a repr this torch writes otherwise."""
    first = meshes[0]
    if any(mesh.mesh != first.mesh or mesh.text != first.text for mesh in meshes):
        raise ValueError(f"{name} holds different meshes on different ranks (a submesh such as mesh['dp'] is): "
                         "push the mesh it came from, and take the submesh on the ranks")
    ranks = torch.tensor(first.mesh)
    flat = ranks.flatten().tolist()
    if len(set(flat)) != len(flat) or not all(0 <= rank < world_size for rank in flat):
        raise ValueError(f"{name}'s mesh {first.mesh} does not fit these {world_size} ranks")
    spec = _from_repr(first.text, tuple(ranks.shape))
    if spec is None:
        raise ValueError(f"{name}: the device type and dim names of the mesh {first.text!r} cannot be read back "
                         "here. Build it on the ranks instead: init_device_mesh(device.type, shape, "
                         "mesh_dim_names=...)")
    return MeshSpec(spec[0], first.mesh, spec[1])


def _from_repr(text: str, shape: tuple[int, ...]) -> tuple[str, tuple[str, ...] | None] | None:
    """``(device_type, mesh_dim_names)`` from torch's repr of a mesh of ``shape``, or None if it does not say."""
    match = _MESH_REPR.match(text)
    if match is None:
        return None
    names, sizes = [], []
    for item in (item.strip() for item in match.group(1).split(",")):
        if item:
            dim_name, _, size = item.rpartition("=")
            if not size.isdigit():
                return None
            names.append(dim_name)
            sizes.append(int(size))
    if tuple(sizes) != shape or (any(names) and not all(names)):
        return None
    return match.group(2), tuple(names) if all(names) and names else None


def rebuild_on_rank(value: Any, rank: int, device: torch.device) -> Any:
    """On a rank: a pushed value as the learner means it (every rank calls it, in the same order)."""
    if isinstance(value, ShardsByRank):
        return rebuild(value[rank], device)
    if isinstance(value, MeshSpec):
        return DeviceMesh(value.device_type, torch.tensor(value.mesh, dtype=torch.int),
                          mesh_dim_names=value.mesh_dim_names)
    return value
