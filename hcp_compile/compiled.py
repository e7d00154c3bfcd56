"""Hierarchical CP attention as the ``hcp`` backend inserts it into a traced graph.

It is the eager algorithm (``build_schedule`` + ``HierarchicalAttention``) with the host-side
parts replaced by traceable ones: the stream length comes from the local token count instead
of a host read of ``cu_seqlens``, no ring step is skipped on host values, and the input checks
run on the device (optionally agreed over the mesh) instead of raising on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from . import layout
from .hierarchical import HierarchicalAttention
from .mesh import CPGroups, resolve_groups
from .schedule import build_schedule


def hierarchical_varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int | torch.SymInt, *,
    causal: bool, scale: float, window: tuple[int, int], kernel: str, ulysses_group: str,
    ring_group: str, return_lse: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """This rank's shard of varlen attention over the packed batch ``cu_seqlens`` (global, real
    boundaries), q/k/v being the local shards laid out by ``shard_plan``. The groups are given
    by name so that the call prints as readable code in a dumped graph."""
    groups = groups_from_names(ulysses_group, ring_group)
    stream_length = groups.ulysses_size * q.shape[0]
    sched = build_schedule(
        cu_seqlens.to(q.device), max_seqlen, groups.ring_rank, groups.ring_size,
        groups.ulysses_size, stream_length, causal=causal, scale=float(scale), window=window,
        kernel=kernel, skip_outside_window=False,
    )
    return HierarchicalAttention.apply(q, k, v, sched, groups, return_lse)


def check_layout(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, local_tokens: int | torch.SymInt, *,
    ulysses_group: str, ring_group: str, agree: bool,
) -> None:
    """Device-side check that ``cu_seqlens_q`` is a valid batch whose shard is
    ``local_tokens`` long on this mesh, and that ``cu_seqlens_k`` equals it.

    With ``agree`` the verdict is all-reduced over the mesh first, so every rank fails
    together instead of some ranks waiting in the next collective."""
    groups = groups_from_names(ulysses_group, ring_group)
    cu = cu_seqlens_q.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    chunk_total = layout.chunk_sizes(lengths, groups.ring_size).sum()
    stream_length = layout.ring_stream_length(chunk_total, groups.ring_size, groups.ulysses_size)
    ok = (cu[0] == 0) & (lengths >= 0).all()
    ok = ok & (stream_length == groups.ulysses_size * local_tokens)
    if cu_seqlens_k is not cu_seqlens_q:
        same_shape = cu_seqlens_k.shape == cu_seqlens_q.shape
        ok = ok & (cu_seqlens_k.to(torch.int64) == cu).all() if same_shape else ok & False
    bad = (~ok).to(torch.int32).reshape(1)
    if agree:
        for group in (groups.ulysses_group, groups.ring_group):
            issued = torch.ops._c10d_functional.all_reduce(bad, "max", group.group_name)
            bad = torch.ops._c10d_functional.wait_tensor(issued)
    torch._assert_async(
        bad[0] == 0,
        "hcp_compile: cu_seqlens does not describe the batch these local shards were cut "
        "from on some rank of the context-parallel mesh (it must start at 0, never decrease, "
        "give each rank exactly q.shape[0] tokens under shard_plan, and cu_seqlens_k must "
        "equal cu_seqlens_q); pass the global cu_seqlens and plan.shard(x) of the same batch",
    )


def groups_from_names(ulysses_group: str, ring_group: str) -> CPGroups:
    return resolve_groups((_resolve_process_group(ulysses_group), _resolve_process_group(ring_group)))
