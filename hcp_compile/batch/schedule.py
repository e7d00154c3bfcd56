"""The attention schedule of one rank for one batch: the segmentation of its local region and
of every ring step over the exchange stream (pure tensor math on top of
:mod:`hcp_compile.batch.layout`), the collective scheme that moves the data (by name, one of
``hcp_compile.exchange.schemes.SCHEMES``), and the rules that split the heads over the Ulysses group and
into head groups (docs/design.md §3.2, §3.6)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from hcp_compile.batch import layout
from hcp_compile.batch.layout import BatchLayout, RankSizes, StepKind
from hcp_compile.exchange.schemes import DEFAULT_SCHEME, scheme_named


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


def exchanged_head_groups(sizes: RankSizes, steps: int, kv_heads: int, ulysses: int) -> int:
    """The head groups a rank's exchange runs in (:func:`head_groups`), or 0 where its Ulysses
    group has no exchange region and nothing goes round the ring (``steps == 1``): then the
    rank issues no collective. Every rank of the group decides alike from its sizes (they share
    the exchange regions' sizes, and the ring section's width is the mesh's). Sizes that are
    symbols (a compiled graph's) are not known to be empty."""
    if layout.known_empty(sizes.stream) and steps == 1:
        return 0
    return head_groups(rank_kv_heads(kv_heads, ulysses), ulysses)


# Kernels that keep the steps under a scheme that gathers: flash (FlashAttention-2 through aten)
# faulted with a misaligned address on a gathered block on an H100 (docs/design.md §3.3)
KEEP_STEPS_KERNELS = frozenset({"flash"})


def gathers(scheme: str, causal: bool, window: tuple[int, int], ring: int, kernel: str | None = None) -> bool:
    """Whether a call's steps after the own one are one gathered step (Note [one gathered
    step] in layout.py): on a ring of several ranks, the scheme brings every section at once,
    the call is causal, its window (if any) needs no positions, and its ``kernel`` (resolved;
    None: not yet known, as when a batch is prepared ahead) is not one of
    :data:`KEEP_STEPS_KERNELS`."""
    return (ring > 1 and scheme_named(scheme).ring.gathers and causal and not layout.window_by_position(window, ring)
            and kernel not in KEEP_STEPS_KERNELS)


@dataclass(frozen=True)
class RingStep:
    source: int  # ring rank whose KV this step uses (-1: every other one, a gathered step)
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
    kv_repeat: int  # each KV head repeated this often before the Ulysses exchange (kv_head_repeat)
    head_groups: int  # the head groups the exchange runs in, 0: no collective (exchanged_head_groups)
    # whether the local region's block runs over all of the rank's rows: where its exchange
    # region is empty (a batch of short documents, every one whole on its rank), the pad rows
    # follow the local region outside its segments, the block op sets them (out 0, lse -inf,
    # gradients 0: ``BlockSpec.covered_rows``), and the rank's output and gradients are the
    # block's own, not a join that copies them. Decided as every size is (layout.known_empty):
    # eagerly, and in a graph built for batches that exchange nothing (its exchange regions
    # are the constant 0)
    local_holds_every_row: bool
    scheme: str = DEFAULT_SCHEME  # the collective scheme, a key of hcp_compile.exchange.schemes.SCHEMES
    # the gathered step's keys: their rows in the gathered sections (GatheredStep.rows), or None
    gather_rows: Tensor | None = None


@dataclass(frozen=True)
class ScheduleTables:
    """The tensors of one rank's schedule, per ring step: the segmentations (int32) and, under
    a window, the positions of the keys (int64); and the local region's segmentation and the
    exchange stream's positions; or, for a gathered step, the rows of its keys (int64). A
    compiled graph gets them from the host (docs/design.md §5), flattened into one tensor of
    each dtype (:meth:`flat`, :meth:`lengths`, :meth:`unflat`)."""

    local_cu: Tensor
    cu_q: tuple[Tensor, ...]
    cu_k: tuple[Tensor, ...]
    q_positions: Tensor | None
    k_positions: tuple[Tensor | None, ...]
    gather_rows: Tensor | None = None

    def flat(self) -> tuple[Tensor, Tensor]:
        """``(segmentations, rows)``: the int32 tables in the order of :meth:`lengths`, and the
        int64 positions (empty without a window) and gathered rows (empty without them)."""
        tables = torch.cat([self.local_cu, *(t for pair in zip(self.cu_q, self.cu_k) for t in pair)])
        windowed = self.q_positions is not None
        positions = [self.q_positions, *self.k_positions] if windowed else []
        if self.gather_rows is not None:
            positions.append(self.gather_rows)
        return tables, torch.cat(positions) if positions else self.local_cu.new_empty(0, dtype=torch.int64)

    def emptied(self, active: tuple[bool, ...]) -> "ScheduleTables":
        """The tables with every segment of the steps not ``active`` empty (their
        segmentations all 0, their lengths kept): all their rows lie outside every segment,
        so a kernel computes nothing for them (BlockSpec) where a graph runs every step."""
        def kept(tables: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            return tuple(t if on else torch.zeros_like(t) for t, on in zip(tables, active))

        return dataclasses.replace(self, cu_q=kept(self.cu_q), cu_k=kept(self.cu_k))

    @staticmethod
    def lengths(sizes: RankSizes, steps: int, windowed: bool, gathered: bool = False) -> tuple[list, list]:
        """The lengths of :meth:`flat`'s parts for a schedule of ``steps`` steps (``gathered``:
        the own step and a gathered one, segmented over the own stream's entries alike)."""
        tables = [sizes.local_entries + 1]
        entries = sizes.step_entries[:1] * steps if gathered else sizes.step_entries[:steps]
        for count in entries:
            tables += [4 * count + 1] * 2
        positions = [sizes.stream] * 2 + [sizes.ring_width] * (steps - 1) if windowed else []
        if gathered:
            positions.append(sizes.gathered_keys)
        return tables, positions

    @classmethod
    def unflat(cls, tables: Tensor, positions: Tensor, sizes: RankSizes, steps: int, windowed: bool,
               gathered: bool = False) -> "ScheduleTables":
        """The inverse of :meth:`flat` (views)."""
        table_lengths, position_lengths = cls.lengths(sizes, steps, windowed, gathered)
        local_cu, *pairs = tables.split(table_lengths)
        parts = list(positions.split(position_lengths))
        gather_rows = parts.pop() if gathered else None
        q_positions, *k_positions = parts if windowed else [None] * (steps + 1)
        return cls(local_cu, tuple(pairs[0::2]), tuple(pairs[1::2]), q_positions, tuple(k_positions), gather_rows)


def schedule_tables(
    batch: BatchLayout, sizes: RankSizes, ring_rank: int, steps: int, *, causal: bool,
    windowed: bool, gathered: bool = False,
) -> ScheduleTables:
    """The tables of rank ``(ring_rank, sizes.ulysses_rank)``'s first ``steps`` ring steps, or
    (``gathered``, two steps) of its own step and its gathered step."""
    ring = batch.ring
    own = layout.stream_table(batch, ring_rank)
    local_cu = layout.leading_segments(
        layout.local_segments(batch, ring_rank, sizes.ulysses_rank), sizes.local_entries
    )
    if gathered:
        own_cu = _step_tables(own, own, ring_rank, ring_rank, ring, StepKind.DIAGONAL, sizes.step_entries[0])
        step = layout.gathered_step(batch, ring_rank)
        segments = 4 * sizes.step_entries[0]
        cu = (layout.leading_segments(step.cu_q, segments), layout.leading_segments(step.cu_k, segments))
        return ScheduleTables(local_cu, (own_cu[0], cu[0]), (own_cu[1], cu[1]), None, (None, None), step.rows)
    sources = layout.step_sources(ring_rank, ring, steps)
    tables = [own] + [layout.stream_table(batch, src, with_group=False) for src in sources[1:]]
    lengths = [sizes.stream] + [sizes.ring_width] * (steps - 1)
    positions = [
        layout.stream_tokens(table, src, ring, length).position if windowed else None
        for table, src, length in zip(tables, sources, lengths)
    ]
    step_cu = [
        _step_tables(own, table, ring_rank, src, ring, layout.step_kind(ring_rank, src, causal), entries)
        for table, src, entries in zip(tables, sources, sizes.step_entries)
    ]
    return ScheduleTables(local_cu, tuple(q for q, _ in step_cu), tuple(k for _, k in step_cu),
                          positions[0], tuple(positions))


def schedule_steps(sizes: RankSizes, ring: int, window_steps: int | None = None, gathered: bool = False) -> int:
    """How many ring steps a schedule has: without a ring section (a batch of short documents)
    nothing goes round the ring, so only the own step; a symbolic width (a compiled graph)
    keeps every step (its graphs for batches without a ring section make the width the
    constant 0: hcp_compile.compiled.graph_variants); else two where the call ``gathered``
    (:func:`gathers`), or the ``window_steps`` a causal window needs (:func:`layout.window_steps`;
    None: every step)."""
    if layout.known_empty(sizes.ring_width):
        return 1
    if gathered:
        return 2
    return ring if window_steps is None else window_steps


def assemble_schedule(
    tables: ScheduleTables, sizes: RankSizes, max_seqlen: int | torch.SymInt, ring_rank: int,
    ring: int, *, causal: bool, scale: float, window: tuple[int, int], kernel: str,
    first_cache_key: int | torch.SymInt | None, kv_heads: int, ulysses: int, active: list[bool] | None = None,
    scheme: str = DEFAULT_SCHEME,
) -> RingSchedule:
    """The schedule with the given tables (the prepared batch's, from the host), one ring step
    per step of ``tables`` (the second a gathered one where they have its rows); ``active``
    (default: all) says which steps compute; ``scheme``: the collective scheme; ``kv_heads``:
    the call's KV heads, ``ulysses``: the Ulysses group's size (which decide its head groups)."""
    steps = len(tables.cu_q)
    gathered = tables.gather_rows is not None
    if gathered and not scheme_named(scheme).ring.gathers:
        # a scheme that does not gather would hand the gathered step one section's keys
        raise ValueError(f"hcp: a schedule with a gathered step under scheme={scheme!r}, which does not gather")
    sources = layout.step_sources(ring_rank, ring, steps)
    kinds = [layout.step_kind(ring_rank, src, causal) for src in sources]
    if gathered:
        sources, kinds = [ring_rank, -1], [StepKind.DIAGONAL, StepKind.GATHERED]
    active = [True] * steps if active is None else active
    # a causal schedule's ring steps are segmented otherwise than a full one's under the same
    # spec flags (only the own step is causal): each takes its own half of the keys
    first = None if first_cache_key is None else first_cache_key + (0 if causal else ring + 1)

    def key(slot: int) -> int | torch.SymInt:
        if first is None:
            return -1
        # a gathered step's tables are another segmentation than step 1's of the ring
        return first_cache_key + 2 * (ring + 1) if gathered and slot == 1 else first + slot

    return RingSchedule(
        sizes=sizes,
        local_cu=tables.local_cu,
        local_cache_key=key(ring),
        steps=tuple(
            RingStep(src, kind, cu_q, cu_k, positions, bool(on), key(index))
            for index, (src, kind, cu_q, cu_k, positions, on) in enumerate(zip(
                sources, kinds, tables.cu_q, tables.cu_k, tables.k_positions, active
            ))
        ),
        q_positions=tables.q_positions,
        max_seqlen=layout.step_max_seqlen(max_seqlen, ring),
        causal=causal,
        scale=scale,
        window_left=window[0],
        window_right=window[1],
        kernel=kernel,
        kv_repeat=kv_head_repeat(kv_heads, ulysses),
        head_groups=exchanged_head_groups(sizes, steps, kv_heads, ulysses),
        local_holds_every_row=layout.known_empty(sizes.own_exchange),
        scheme=scheme,
        gather_rows=tables.gather_rows,
    )


def cache_keys_needed(ring: int) -> int:
    """How many cache keys a rank's schedules of one batch take: one per ring step and one for
    the local region, for a causal schedule and for a full one, and one for a gathered step
    (causal only)."""
    return 2 * (ring + 1) + 1


def _step_tables(
    own: layout.StreamTable, table: layout.StreamTable, ring_rank: int, source: int, ring: int,
    kind: StepKind, entries: int | torch.SymInt,
) -> tuple[Tensor, Tensor]:
    """The step's ``(cu_q, cu_k)`` cut after its ``entries`` active entries (4 segments each)."""
    cu_q, cu_k = layout.step_segments(own, table, ring_rank, source, ring, kind)
    return layout.leading_segments(cu_q, 4 * entries), layout.leading_segments(cu_k, 4 * entries)
