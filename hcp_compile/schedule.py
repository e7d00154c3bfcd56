"""The attention schedule of one rank for one batch: the segmentation of its local region and
of every ring step over the exchange stream (pure tensor math on top of
:mod:`hcp_compile.layout`), and the rules that split the heads over the Ulysses group and into
head groups (docs/design.md §3.2, §3.6)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import layout
from .layout import BatchLayout, RankSizes, StepKind


# Head groups the exchange is pipelined over when the heads allow it (docs/design.md §3.6):
# two hide about half of the exchange; each further group adds a ring of KV transfers and
# shrinks every kernel call.
HEAD_GROUPS = 2


def kv_head_repeat(kv_heads: int, ulysses: int) -> int:
    """How often to repeat each KV head so the Ulysses exchange can split them (GQA)."""
    return ulysses // kv_heads if kv_heads < ulysses else 1


def rank_kv_heads(kv_heads: int, ulysses: int) -> int:
    """KV heads a rank attends with after the Ulysses exchange (repeated ones included)."""
    return kv_heads * kv_head_repeat(kv_heads, ulysses) // ulysses


def head_groups(heads_kv_per_rank: int, ulysses: int) -> int:
    """Number of head groups the Ulysses exchange is pipelined over (docs/design.md §3.6):
    1 without an exchange (``ulysses == 1``) or when the rank's ``heads_kv_per_rank`` KV heads
    (after the exchange) cannot be split into :data:`HEAD_GROUPS` equal groups, which a group
    needs to keep the GQA ratio; else :data:`HEAD_GROUPS`. The query heads follow the KV
    heads: every group has ``1/G`` of each."""
    if ulysses == 1 or heads_kv_per_rank % HEAD_GROUPS != 0:
        return 1
    return HEAD_GROUPS


@dataclass(frozen=True)
class RingStep:
    source: int  # ring rank whose KV this step uses
    kind: StepKind
    cu_q: Tensor  # int32 segmentation of this ring rank's exchange stream (queries)
    cu_k: Tensor  # int32 segmentation of the keys: the own stream, or the source's ring section
    k_positions: Tensor | None  # positions of the keys inside their documents (window only)
    active: bool  # False when the step is wholly outside the window: compute skipped
    cache_key: int  # BlockSpec.cache_key of the step's blocks (-1: kernels cache nothing)


@dataclass(frozen=True)
class RingSchedule:
    sizes: RankSizes
    local_cu: Tensor  # int32 segmentation of the local region (its LOCAL documents)
    local_cache_key: int  # BlockSpec.cache_key of the local block
    steps: tuple[RingStep, ...]
    q_positions: Tensor | None  # positions of the exchange stream's tokens (window only)
    max_seqlen: int  # bound of every segment length, for the kernels' grids
    causal: bool
    scale: float
    window_left: int
    window_right: int
    kernel: str


def build_schedule(
    batch: BatchLayout, sizes: RankSizes, max_seqlen: int | torch.SymInt, ring_rank: int, *,
    causal: bool, scale: float, window: tuple[int, int], kernel: str, skip_outside_window: bool,
    first_cache_key: int | torch.SymInt | None = None,
) -> RingSchedule:
    """Schedule of rank ``(ring_rank, sizes.ulysses_rank)``; ``skip_outside_window`` reads one
    small tensor on the host. ``first_cache_key``: the first of :func:`cache_keys_needed`
    keys that name this schedule's segmentations (:attr:`BlockSpec.cache_key`: the ring steps
    in order, then the local region), so that kernels reuse what they derive from them; None:
    no keys."""
    ring = batch.ring
    windowed = window != (-1, -1)
    own = layout.stream_table(batch, ring_rank)
    # no ring section (a batch of short documents): nothing goes round the ring, so the
    # schedule has the own step only; a symbolic width (a compiled graph) keeps every step
    steps = 1 if isinstance(sizes.ring_width, int) and sizes.ring_width == 0 else ring
    sources = [(ring_rank - s) % ring for s in range(steps)]
    kinds = [layout.step_kind(ring_rank, src, causal) for src in sources]
    tables = [own] + [layout.stream_table(batch, src, with_group=False) for src in sources[1:]]
    lengths = [sizes.stream] + [sizes.ring_width] * (steps - 1)
    positions = [
        layout.stream_tokens(table, src, ring, length).position if windowed else None
        for table, src, length in zip(tables, sources, lengths)
    ]
    active = [True] * steps
    if windowed and skip_outside_window and steps > 1:
        seen = torch.stack([
            layout.step_sees_any_key(own, table, ring_rank, src, ring, kind, *window)
            for table, src, kind in zip(tables[1:], sources[1:], kinds[1:])
        ])
        active = [True, *seen.tolist()]

    def key(slot: int) -> int | torch.SymInt:
        return -1 if first_cache_key is None else first_cache_key + slot

    steps = tuple(
        RingStep(src, kind, *_step_tables(own, table, ring_rank, src, ring, kind, entries), pos,
                 bool(on), key(index))
        for index, (src, kind, table, pos, on, entries) in enumerate(zip(
            sources, kinds, tables, positions, active, sizes.step_entries
        ))
    )
    local_cu = layout.local_segments(batch, ring_rank, sizes.ulysses_rank)
    return RingSchedule(
        sizes=sizes,
        local_cu=layout.leading_segments(local_cu, sizes.local_entries),
        local_cache_key=key(ring),
        steps=steps,
        q_positions=positions[0],
        max_seqlen=layout.step_max_seqlen(max_seqlen, ring),
        causal=causal,
        scale=scale,
        window_left=window[0],
        window_right=window[1],
        kernel=kernel,
    )


def cache_keys_needed(ring: int) -> int:
    """How many cache keys one schedule's blocks take: one per ring step, one for the local
    region."""
    return ring + 1


def _step_tables(
    own: layout.StreamTable, table: layout.StreamTable, ring_rank: int, source: int, ring: int,
    kind: StepKind, entries: int | torch.SymInt,
) -> tuple[Tensor, Tensor]:
    """The step's ``(cu_q, cu_k)`` cut after its ``entries`` active entries (4 segments each)."""
    cu_q, cu_k = layout.step_segments(own, table, ring_rank, source, ring, kind)
    return layout.leading_segments(cu_q, 4 * entries), layout.leading_segments(cu_k, 4 * entries)
