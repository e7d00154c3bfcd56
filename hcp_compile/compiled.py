"""Hierarchical CP attention as the ``hcp`` backend inserts it into a traced graph.

It is the eager algorithm (``build_schedule`` + ``HierarchicalAttention``) with the host-side
parts replaced by traceable ones: the layout is derived on the device from ``cu_seqlens`` by
the same placement rule as ``shard_plan``'s, checked there (and agreed over the mesh), and
the few sizes the collectives need are read to the host once per batch, where they become
the graph's data-dependent sizes (docs/design.md §5).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from . import layout, validation
from .hierarchical import HierarchicalAttention
from .layout import BatchLayout, RankSizes
from .mesh import CPGroups, resolve_groups
from .placements import PLACEMENTS, placement_rule
from .plan import check_plan_agrees
from .schedule import build_schedule

# the checks of one batch, in the order of the agreed flag vector
_CHECKS = (
    "cu_seqlens must start at 0 and never decrease",
    "q.shape[0] must be the rank's token count under shard_plan(cu_seqlens, mesh, "
    "placement=...) of the backend's mesh and placement",
    "cu_seqlens_k must equal cu_seqlens_q",
    "max_seqlen must be at least the longest document",
    "the batch was sharded by shard_plan for another mesh shape or placement",
)


def checked_layout(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, local_tokens: int | torch.SymInt,
    max_seqlen: int | torch.SymInt, *, ulysses_group: str, ring_group: str, placement: str,
    agree: bool,
) -> tuple[BatchLayout, tuple[int, ...]]:
    """Check the batch on the device and return its layout with this rank's sizes (the values
    of :func:`layout.rank_size_values`) read to the host: symbolic ints in a graph. Every
    attention call of the batch reuses both.

    With ``agree`` the checks' outcome and a fingerprint of ``cu_seqlens`` are all-reduced over
    the mesh first, so every rank raises together (also when the ranks were given different
    batches) instead of some ranks waiting in the next collective."""
    groups = groups_from_names(ulysses_group, ring_group)
    cu = cu_seqlens_q.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    ulysses, ring = groups.ulysses_size, groups.ring_size
    batch = BatchLayout(
        ulysses, ring, cu[:-1], lengths,
        *torch.ops.hcp.batch_layout(cu_seqlens_q, ulysses, ring, placement),
    )
    values = layout.rank_size_values(batch, groups.ring_rank, groups.ulysses_rank)
    if cu_seqlens_k is cu_seqlens_q:
        k_matches = torch.ones((), dtype=torch.bool, device=cu.device)
    elif cu_seqlens_k.shape == cu_seqlens_q.shape:
        k_matches = (cu_seqlens_k.to(torch.int64) == cu).all()
    else:
        k_matches = torch.zeros((), dtype=torch.bool, device=cu.device)
    failed = torch.stack([
        (cu[0] != 0) | (lengths < 0).any(),
        values[0] != local_tokens,
        ~k_matches,
        lengths.max() > max_seqlen,
        torch.ops.hcp.plan_disagrees(
            cu_seqlens_q, groups.ulysses_size, groups.ring_size, placement
        ).reshape(()),
    ]).to(torch.int64)
    fingerprint = validation.batch_fingerprint(cu, list(PLACEMENTS).index(placement))
    flags = torch.cat([failed, torch.stack([fingerprint, -fingerprint])])
    if agree:
        for group in (groups.ulysses_group, groups.ring_group):
            issued = torch.ops._c10d_functional.all_reduce(flags, "max", group.group_name)
            flags = torch.ops._c10d_functional.wait_tensor(issued)
    return batch, tuple(torch.ops.hcp.raise_if_rejected(flags, values).tolist())


# the fields of BatchLayout that the placement decides, in order
_DECIDED = ("kind", "ring_rank", "ulysses_rank", "chunk", "local_extent", "exchange_extent",
            "local_tokens")


@torch.library.custom_op("hcp::batch_layout", mutates_args=())
def batch_layout_op(cu_seqlens: Tensor, ulysses: int, ring: int, placement: str) -> tuple[
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor
]:
    """:func:`layout.batch_layout`'s decided fields, as one opaque op: the compiled graph runs
    the placement rule's sorts and searches as they are instead of generating kernels for
    them (docs/design.md §5)."""
    batch = layout.batch_layout(cu_seqlens, ulysses, ring, placement_rule(placement))
    return tuple(getattr(batch, name).clone() for name in _DECIDED)


@batch_layout_op.register_fake
def _(cu_seqlens, ulysses, ring, placement):
    per_doc = [cu_seqlens.new_empty(cu_seqlens.shape[0] - 1, dtype=torch.int64) for _ in range(4)]
    per_rank = [cu_seqlens.new_empty((ring, ulysses), dtype=torch.int64) for _ in range(2)]
    return (*per_doc, *per_rank, cu_seqlens.new_empty((), dtype=torch.int64))


@torch.library.custom_op("hcp::plan_disagrees", mutates_args=())
def plan_disagrees(cu_seqlens: Tensor, ulysses: int, ring: int, placement: str) -> Tensor:
    """``[1]`` int64, 1 when this ``cu_seqlens`` tensor was given to ``shard_plan`` with another
    mesh shape or placement (a host-side look-up, so an opaque op)."""
    try:
        check_plan_agrees(cu_seqlens, ulysses, ring, placement)
    except validation.InputError:
        return torch.ones(1, dtype=torch.int64, device=cu_seqlens.device)
    return torch.zeros(1, dtype=torch.int64, device=cu_seqlens.device)


@plan_disagrees.register_fake
def _(cu_seqlens, ulysses, ring, placement):
    return cu_seqlens.new_empty(1, dtype=torch.int64)


@torch.library.custom_op("hcp::raise_if_rejected", mutates_args=())
def raise_if_rejected(flags: Tensor, sizes: Tensor) -> Tensor:
    """Raise :class:`InputError` on the host if the agreed ``flags`` reject the batch, else
    pass ``sizes`` on (the host read it needs is the one the sizes need anyway)."""
    *failed, highest, negated_lowest = flags.tolist()
    reasons = [check for check, bad in zip(_CHECKS, failed) if bad]
    if highest != -negated_lowest:
        reasons.append("every rank must pass the same cu_seqlens (the ranks got different ones)")
    if reasons:
        raise validation.InputError(
            "cu_seqlens: the batch does not match the local shards on some rank of the "
            f"context-parallel mesh: {'; '.join(reasons)}; pass the global cu_seqlens and "
            "plan.shard(x) of the same batch, mesh and placement"
        )
    return sizes.clone()


@raise_if_rejected.register_fake
def _(flags, sizes):
    return torch.empty_like(sizes)


def hierarchical_varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, max_seqlen: int | torch.SymInt,
    batch: tuple[BatchLayout, tuple[int, ...]], *, causal: bool, scale: float,
    window: tuple[int, int], kernel: str, ulysses_group: str, ring_group: str,
    return_lse: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """This rank's shard of varlen attention over a packed batch, q/k/v being the local shards
    laid out by ``shard_plan``; ``batch`` comes from :func:`checked_layout`. The groups are
    given by name so that the call prints as readable code in a dumped graph."""
    groups = groups_from_names(ulysses_group, ring_group)
    batch_layout, (_tokens, local, ring_width, *exchange) = batch
    for size in (local, ring_width, *exchange):
        _check_is_size(size)
    rank_sizes = RankSizes(q.shape[0], local, tuple(exchange), ring_width, groups.ulysses_rank)
    torch._check(local + rank_sizes.own_exchange <= q.shape[0])
    torch._check(ring_width <= rank_sizes.stream)
    sched = build_schedule(
        batch_layout.to(q.device), rank_sizes, max_seqlen, groups.ring_rank, causal=causal, scale=float(scale),
        window=window, kernel=kernel, skip_outside_window=False,
    )
    return HierarchicalAttention.apply(q, k, v, sched, groups, return_lse)


def _check_is_size(size: int | torch.SymInt) -> None:
    """A layout size is a size: torch 2.11's decompositions need it marked as one to decide
    that a region is never empty-by-accident (later versions deprecate the marking)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch._check_is_size(size)


def groups_from_names(ulysses_group: str, ring_group: str) -> CPGroups:
    return resolve_groups((_resolve_process_group(ulysses_group), _resolve_process_group(ring_group)))
