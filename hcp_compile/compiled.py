"""Hierarchical CP attention as the ``hcp`` backend inserts it into a traced graph.

It is the eager algorithm (``build_schedule`` + ``HierarchicalAttention``) with the host-side
parts replaced by traceable ones: the layout is derived on the device from ``cu_seqlens`` by
the same placement rule as ``shard_plan``'s, checked there (and agreed over the mesh), and
the few sizes the collectives need are read to the host once per batch, where they become
the graph's data-dependent sizes (docs/design.md §5).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from . import layout, validation
from .hierarchical import HierarchicalAttention
from .layout import BatchLayout
from .mesh import CPGroups, agreeing_groups, resolve_groups
from .placements import PLACEMENTS, placement_rule
from .plan import check_plan_agrees
from .kernels import KeysByValue
from .schedule import build_schedule, cache_keys_needed


def checked_layout(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, tokens: tuple[int | torch.SymInt, ...],
    max_seqlens: tuple[int | torch.SymInt, ...], *, ulysses_group: str, ring_group: str,
    placement: str, agree: bool,
) -> tuple[BatchLayout, tuple[int, ...]]:
    """Check the batch on the device and return its layout with this rank's sizes (the values
    of :func:`layout.rank_size_values`) and the first cache key of its schedules' blocks read
    to the host: symbolic ints in a graph. Every attention call of the batch reuses them.
    ``tokens``: the token counts of q, k and v; ``max_seqlens``: ``max_seqlen_q`` and
    ``max_seqlen_k``.

    The rules are :data:`validation.DEVICE_RULES`. With ``agree`` their outcome and a
    fingerprint of ``cu_seqlens`` are all-reduced over the mesh first, so every rank raises
    together (also when the ranks were given different batches) instead of some ranks waiting
    in the next collective."""
    groups = groups_from_names(ulysses_group, ring_group)
    cu = cu_seqlens_q.to(torch.int64)
    ulysses, ring = groups.ulysses_size, groups.ring_size
    *decided, first_cache_key = torch.ops.hcp.batch_layout(
        cu_seqlens_q, ulysses, ring, placement, groups.ring_rank, groups.ulysses_rank
    )
    batch = BatchLayout(ulysses, ring, cu[:-1], cu[1:] - cu[:-1], *decided)
    values = torch.cat([
        layout.rank_size_values(batch, groups.ring_rank, groups.ulysses_rank), first_cache_key,
    ])
    failed = validation.batch_failures(
        cu_seqlens_q, cu_seqlens_k, values[0], tokens, max_seqlens,
        torch.ops.hcp.plan_disagrees(cu_seqlens_q, ulysses, ring, placement),
    )
    fingerprint = validation.batch_fingerprint(cu, list(PLACEMENTS).index(placement))
    flags = torch.cat([failed, torch.stack([fingerprint, -fingerprint])])
    if agree:
        for _, group in agreeing_groups(groups):
            issued = torch.ops._c10d_functional.all_reduce(flags, "max", group.group_name)
            flags = torch.ops._c10d_functional.wait_tensor(issued)
    return batch, tuple(torch.ops.hcp.raise_if_rejected(flags, values).tolist())


# the fields of BatchLayout that the placement decides, in order
_DECIDED = ("kind", "ring_rank", "ulysses_rank", "chunk", "local_extent", "exchange_extent",
            "local_tokens")


@torch.library.custom_op("hcp::batch_layout", mutates_args=())
def batch_layout_op(
    cu_seqlens: Tensor, ulysses: int, ring: int, placement: str, ring_rank: int, ulysses_rank: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`layout.batch_layout`'s decided fields, and (``[1]`` int64) the first of the cache
    keys that name rank ``(ring_rank, ulysses_rank)``'s segmentations of this batch, as one
    opaque op. The rule runs on the host, once per distinct batch: on a GPU its hundreds of
    small sorts, scans and searches cost milliseconds of launches per call, the host copy of
    ``cu_seqlens`` microseconds (docs/design.md §5.3). The keys are given by the batch's
    values, so the layers and the backward of one batch share what kernels derive from a
    block (flex's masks), while Inductor reuses the graph's buffers (§8.1)."""
    host = cu_seqlens.cpu()
    cu_bytes = host.numpy().tobytes()
    decided = _host_layout(cu_bytes, str(host.dtype), ulysses, ring, placement)
    batch = (cu_bytes, str(host.dtype), ulysses, ring, placement, ring_rank, ulysses_rank)
    first_key = _batch_keys.key(batch, cache_keys_needed(ring))
    key = torch.tensor([first_key], dtype=torch.int64)
    return tuple(t.to(cu_seqlens.device, copy=True) for t in (*decided, key))


# the keys of the batches seen last (a compiled model's graphs see one batch per step)
_batch_keys = KeysByValue(64)


@functools.lru_cache(maxsize=8)
def _host_layout(
    cu_bytes: bytes, dtype: str, ulysses: int, ring: int, placement: str
) -> tuple[Tensor, ...]:
    """The decided fields for a batch given by value (the cache key), on the host."""
    cu = torch.frombuffer(bytearray(cu_bytes), dtype=getattr(torch, dtype.removeprefix("torch.")))
    batch = layout.batch_layout(cu, ulysses, ring, placement_rule(placement))
    return tuple(getattr(batch, name) for name in _DECIDED)


@batch_layout_op.register_fake
def _(cu_seqlens, ulysses, ring, placement, ring_rank, ulysses_rank):
    per_doc = [cu_seqlens.new_empty(cu_seqlens.shape[0] - 1, dtype=torch.int64) for _ in range(4)]
    per_rank = [cu_seqlens.new_empty((ring, ulysses), dtype=torch.int64) for _ in range(2)]
    return (*per_doc, *per_rank, cu_seqlens.new_empty((), dtype=torch.int64),
            cu_seqlens.new_empty(1, dtype=torch.int64))


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
    error = validation.rejected_batch_error(failed, batches_differ=highest != -negated_lowest)
    if error is not None:
        raise error
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
    batch_layout, (*values, first_cache_key) = batch
    for size in values[1:]:
        _check_is_size(size)
    rank_sizes = dataclasses.replace(
        layout.rank_sizes(values, groups.ulysses_rank, groups.ulysses_size), tokens=q.shape[0]
    )
    torch._check(rank_sizes.local + rank_sizes.own_exchange <= q.shape[0])
    torch._check(rank_sizes.ring_width <= rank_sizes.stream)
    sched = build_schedule(
        batch_layout.to(q.device), rank_sizes, max_seqlen, groups.ring_rank, causal=causal, scale=float(scale),
        window=window, kernel=kernel, skip_outside_window=False, first_cache_key=first_cache_key,
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
