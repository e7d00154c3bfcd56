"""The context-parallel device mesh: ``("ring", "ulysses")``, Ulysses ranks contiguous,
optionally with a leading ``"data"`` dim of data-parallel replicas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


MESH_DIM_NAMES = ("ring", "ulysses")
DATA_DIM_NAME = "data"  # the data-parallel dim of a 3-D mesh (make_mesh(..., data=D))
_ACCEPTED_DIM_SETS = (set(MESH_DIM_NAMES), {DATA_DIM_NAME, *MESH_DIM_NAMES})

MeshLike = Union[DeviceMesh, tuple[dist.ProcessGroup, dist.ProcessGroup]]


def make_mesh(
    ulysses: int, ring: int, device_type: str | None = None, *, data: int = 1
) -> DeviceMesh:
    """A mesh with dims ``("ring", "ulysses")`` over all ranks, or ``("data", "ring",
    "ulysses")`` with ``data`` > 1 data-parallel replicas of that context-parallel mesh.

    Global rank ``(d * ring + r) * ulysses + a`` is data replica ``d``, ring rank ``r``,
    Ulysses rank ``a``: the Ulysses group is contiguous ranks, so with one process per GPU it
    stays inside a node, and so are the ranks of one replica.
    """
    for name, value in (("ulysses", ulysses), ("ring", ring), ("data", data)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"make_mesh: {name} must be a positive int, got {value!r}")
    if not dist.is_initialized():
        raise RuntimeError(
            "make_mesh: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group (or launch with torchrun) first"
        )
    world = dist.get_world_size()
    if world != data * ulysses * ring:
        raise ValueError(_world_size_error(world, ulysses, ring, data))
    if device_type is None:
        device_type = _device_type(dist.group.WORLD)
    if data == 1:
        return init_device_mesh(device_type, (ring, ulysses), mesh_dim_names=MESH_DIM_NAMES)
    return init_device_mesh(
        device_type, (data, ring, ulysses), mesh_dim_names=(DATA_DIM_NAME, *MESH_DIM_NAMES)
    )


def _world_size_error(world: int, ulysses: int, ring: int, data: int) -> str:
    if data == 1:
        return (
            f"make_mesh: world size is {world} but ulysses * ring = {ulysses} * {ring} = "
            f"{ulysses * ring}; choose ulysses and ring whose product is the world size, or "
            "build a 2-D DeviceMesh with dims ('ring', 'ulysses') over a subset yourself"
        )
    return (
        f"make_mesh: world size is {world} but data * ulysses * ring = {data} * {ulysses} * "
        f"{ring} = {data * ulysses * ring}; choose data, ulysses and ring whose product is the "
        "world size"
    )


@dataclass(frozen=True)
class CPGroups:
    """The two process groups of hierarchical context parallelism, and this rank's place."""

    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup
    ulysses_size: int
    ring_size: int
    ulysses_rank: int
    ring_rank: int
    device_type: str


def resolve_groups(mesh: MeshLike) -> CPGroups:
    """Accept a ``("ring", "ulysses")`` DeviceMesh (also ``mesh["ring", "ulysses"]`` of a
    larger one), a ``("data", "ring", "ulysses")`` DeviceMesh (context parallelism runs over
    its ``ring`` and ``ulysses`` dims, inside this rank's data replica) or a pair
    ``(ulysses_group, ring_group)``."""
    if isinstance(mesh, DeviceMesh):
        names = mesh.mesh_dim_names
        if names is None or set(names) not in _ACCEPTED_DIM_SETS:
            raise ValueError(
                f"mesh: expected a DeviceMesh with dims {MESH_DIM_NAMES} or "
                f"{(DATA_DIM_NAME, *MESH_DIM_NAMES)}, got dims {names} of shape "
                f"{tuple(mesh.shape)}; build it with hcp_compile.make_mesh, or pass the "
                "submesh mesh['ring', 'ulysses'] of a larger mesh"
            )
        ulysses_group, ring_group = mesh.get_group("ulysses"), mesh.get_group("ring")
        device_type = mesh.device_type
    elif (
        isinstance(mesh, (tuple, list))
        and len(mesh) == 2
        and all(isinstance(g, dist.ProcessGroup) for g in mesh)
    ):
        ulysses_group, ring_group = mesh
        device_type = _device_type(ulysses_group)
    else:
        raise TypeError(
            "mesh: expected a DeviceMesh with dims ('ring', 'ulysses') or a pair "
            f"(ulysses_group, ring_group) of ProcessGroups, got {type(mesh).__name__}"
        )
    return CPGroups(
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        ulysses_size=dist.get_world_size(ulysses_group),
        ring_size=dist.get_world_size(ring_group),
        ulysses_rank=dist.get_rank(ulysses_group),
        ring_rank=dist.get_rank(ring_group),
        device_type=device_type,
    )


def _device_type(group: dist.ProcessGroup) -> str:
    """Where the group's data lives: CUDA if it has an NCCL backend (``"nccl"`` or a mixed
    ``"cpu:gloo,cuda:nccl"``), else the CPU."""
    return "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"


def agreement_device(groups: CPGroups) -> torch.device:
    """Where an agreement's flags are all-reduced: on the host where every group's backend
    takes a CPU tensor, so that reading the verdict waits for no GPU work queued before it."""
    backends = [str(dist.get_backend(g)) for g in (groups.ulysses_group, groups.ring_group)]
    # "fake" (torch's FakeProcessGroup, no data moved: dry runs, speed.py --fake-rank) takes any device
    if all(b in ("gloo", "fake") or "cpu:" in b for b in backends):
        return torch.device("cpu")
    return torch.device(groups.device_type, torch.cuda.current_device())
