"""The context-parallel device mesh: ``("ring", "ulysses")``, Ulysses ranks contiguous,
optionally with a leading ``"data"`` dim of data-parallel replicas."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hcp_compile.validation import BATCHES_DIFFER, SAME_BATCH

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


class AgreementTimeout(RuntimeError):
    """The agreement before an attention call (or ``plan.unshard``) waited longer than its
    timeout for another rank of the context-parallel mesh: that rank did not make the same
    call (docs/design.md §9)."""


def agree_on_error(
    groups: CPGroups, error: Exception | None, batch: int | None = None, *,
    timeout_s: float | None = None, caller: str = "varlen_attention",
) -> None:
    """Raise on every rank of the mesh if any rank found its input invalid, or (``batch``: a
    fingerprint of the batch each rank was given) if the ranks were given different batches.

    Called after local validation and before the first data collective, so that one rank's
    bad input makes all ranks raise instead of leaving the others waiting in a collective.
    The values travel as a CPU tensor where the groups' backend takes one (gloo, or a
    ``"cpu:gloo,cuda:nccl"`` process group), so no GPU work is waited for. Each all-reduce
    waits at most ``timeout_s`` (None: the process group's own timeout), then raises
    :class:`AgreementTimeout`: a rank that skipped the call must not leave the others
    waiting forever.
    """
    fingerprint = 0 if batch is None else batch
    flags = torch.tensor(
        [error is not None, fingerprint, -fingerprint], dtype=torch.int64,
        device=agreement_device(groups),
    )
    for name, group in agreeing_groups(groups):
        _all_reduce_max(flags, group, name, timeout_s, caller)
    if error is not None:
        raise error
    rejected, highest, negated_lowest = flags.tolist()
    if rejected:
        raise RuntimeError(
            "another rank of the context-parallel mesh rejected its input (see that rank's "
            "error); all ranks stop here instead of waiting in a collective"
        )
    if highest != -negated_lowest:
        raise SAME_BATCH.error(BATCHES_DIFFER)


def agreeing_groups(groups: CPGroups) -> list[tuple[str, dist.ProcessGroup]]:
    """The mesh's groups an agreement all-reduces over, by name: those of more than one rank
    (over one rank the all-reduce would change nothing and still cost a collective)."""
    named = (("ulysses", groups.ulysses_group, groups.ulysses_size), ("ring", groups.ring_group, groups.ring_size))
    return [(name, group) for name, group, size in named if size > 1]


def _all_reduce_max(
    flags: torch.Tensor, group: dist.ProcessGroup, name: str, timeout_s: float | None,
    caller: str,
) -> None:
    """``flags`` all-reduced (max) over ``group`` in place, waiting at most ``timeout_s``."""
    timeout = (
        datetime.timedelta(seconds=timeout_s) if timeout_s is not None
        else _group_timeout(group, flags.device)
    )
    started = time.monotonic()
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
    try:
        # with a timeout, gloo and NCCL block this thread until the all-reduce is done or
        # raise once the time is up (NCCL also aborts the group's communicator)
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as failure:
        waited = time.monotonic() - started
        if timeout is None or waited < timeout.total_seconds():
            raise  # not a timeout (a peer's connection closed, ...): the backend's own error
        raise AgreementTimeout(_timeout_message(group, name, waited, timeout_s, caller)) from failure


def _timeout_message(
    group: dist.ProcessGroup, name: str, waited: float, timeout_s: float | None, caller: str
) -> str:
    option = (
        f"agreement_timeout_s={timeout_s:g}" if timeout_s is not None
        else "agreement_timeout_s=None, the process group's timeout"
    )
    return (
        f"{caller}: the agreement all-reduce before the call (over this rank's {name} group, "
        f"global ranks {dist.get_process_group_ranks(group)}) timed out after {waited:.1f} s "
        f"({option}): another rank of the context-parallel mesh did not reach it; it probably "
        "skipped this call or stopped (for example it caught an exception and went on, or "
        "crashed: see its output). Every rank of the mesh must make the same calls in the "
        "same order: re-raise the exception (or stop every rank) instead of letting one rank "
        "go on. If a rank may legitimately arrive this late (it writes a checkpoint alone, "
        "...), raise context_parallel(mesh, agreement_timeout_s=...) or the process group's "
        "timeout. The process group is unusable after a timeout: restart the job"
    )


def _group_timeout(group: dist.ProcessGroup, device: torch.device) -> datetime.timedelta | None:
    """The timeout the group's backend was created with (``init_process_group(timeout=...)``,
    ``new_group(timeout=...)``), or None where the backend does not tell."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


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
