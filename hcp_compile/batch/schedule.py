"""The attention schedule of one rank for one batch: its plan for one mask (the tables of its
local region and of every ring step over the exchange stream, derived in one pass by
:func:`layout.rank_segments`, flattened for the device), the schedule both doors assemble from
those tables, the collective scheme that moves the data (by name, one of
``hcp_compile.exchange.schemes.SCHEMES``), and the rules that split the heads over the Ulysses
group and into head groups (docs/design.md §3.2, §3.6)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hcp_compile.batch import layout
from hcp_compile.batch.cache import BATCHES
from hcp_compile.batch.layout import BatchLayout, RankSizes, ScheduleShape, StepKind
from hcp_compile.exchange.schemes import DEFAULT_SCHEME, scheme_named

if TYPE_CHECKING:
    from hcp_compile.batch.prepared import PreparedBatch  # prepared imports this module


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
    return _head_groups(layout.known_empty(sizes.stream), steps, kv_heads, ulysses)


def _head_groups(stream_empty: bool, steps: int, kv_heads: int, ulysses: int) -> int:
    if stream_empty and steps == 1:
        return 0
    return head_groups(rank_kv_heads(kv_heads, ulysses), ulysses)


# Kernels that keep the steps under a scheme that gathers: flash (FlashAttention-2 through aten)
# faulted with a misaligned address on a gathered block on an H100 (docs/design.md §3.3)
KEEP_STEPS_KERNELS = frozenset({"flash"})


def gathers(scheme: str, causal: bool, window: tuple[int, int], ring: int, kernel: str | None = None) -> bool:
    """Whether a call's steps after the own one are one gathered step (Note [one gathered
    step] in layout.py): on a ring of several ranks, the scheme brings every section at once,
    the call is causal without a window (on a ring a window masks by position, which a
    gathered step's segments do not carry: ``layout.window_by_position``), and its ``kernel``
    (resolved; None: not yet known, as when a batch is prepared ahead) is not one of
    :data:`KEEP_STEPS_KERNELS`."""
    return (ring > 1 and scheme_named(scheme).ring.gathers and causal and window == (-1, -1)
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


@dataclass(frozen=True)
class RankPlan:
    """One rank's schedule of one batch for one mask, on the host: what a
    :class:`prepared.PreparedBatch` keeps per rank and mask asked for, under the mask as the
    call gives it, so that what a DataLoader worker prepared is what both doors find
    (docs/design.md §2.4)."""

    sizes: RankSizes
    shape: ScheduleShape  # its steps' sources and kinds, whether the second is gathered
    windowed: bool  # whether the window masks by position (layout.window_by_position)
    flat: tuple[Tensor, Tensor]  # the tables as ScheduleTables.flat gives them: what goes to the device
    active: tuple[bool, ...]  # per step, whether any query sees any key (the own step always computes)
    # ``flat`` with the steps not active emptied (ScheduleTables.emptied; ``flat`` itself where
    # every step is): what a compiled graph gets, which runs every step (docs/design.md §3.3)
    flat_skipping: tuple[Tensor, Tensor]

    @property
    def steps(self) -> int:
        return len(self.shape.sources)

    @property
    def tables(self) -> ScheduleTables:
        return ScheduleTables.unflat(*self.flat, self.sizes, self.steps, self.windowed, self.shape.gathered)


def plan_rank(batch: BatchLayout, sizes: RankSizes, ring_rank: int, causal: bool, window: tuple[int, int],
              steps: int | None = None, gathered: bool = False) -> RankPlan:
    """Rank ``(ring_rank, sizes.ulysses_rank)``'s plan for calls with this mask, from its
    segments (:func:`layout.rank_segments`: of its own ring steps, or of ``steps``;
    ``gathered``: the own step and a gathered one)."""
    segments = layout.rank_segments(batch, sizes, ring_rank, causal, window, steps, gathered)
    tables = ScheduleTables(segments.local_cu, segments.cu_q, segments.cu_k, segments.q_positions,
                            segments.k_positions, segments.gather_rows)
    flat = tables.flat()
    active = segments.active
    # the positions stay: the emptied steps' positions are never read
    skipping = flat if all(active) else (tables.emptied(active).flat()[0], flat[1])
    return RankPlan(sizes, segments.shape, segments.windowed, flat, active, skipping)


def prepared_schedule(
    prepared: PreparedBatch, ring_rank: int, ulysses_rank: int, ring: int, device: torch.device, max_seqlen: int, *,
    causal: bool, scale: float, window: tuple[int, int], kernel: str, scheme: str, kv_heads: int, ulysses: int,
    skip_outside_window: bool,
) -> RingSchedule:
    """Eager CP's schedule of a call of the batch ``prepared`` on rank ``(ring_rank,
    ulysses_rank)``: the rank's plan for the call's mask, its tables on ``device``
    (``PreparedBatch.device_tables``) and the batch's cache keys for the rank, as the compiled
    graph's (eager and compiled calls of one batch share what the kernels derive); the steps a
    window leaves without a visible key skipped where ``skip_outside_window``."""
    gathered = gathers(scheme, causal, window, ring, kernel)
    plan, flat = prepared.device_tables(ring_rank, ulysses_rank, causal, window, device, gathered=gathered)
    first_key = BATCHES.cache_keys(prepared, (ring_rank, ulysses_rank), cache_keys_needed(ring))
    return rank_schedule(
        flat, plan.sizes, plan.shape, ring_rank, ring, max_seqlen, windowed=plan.windowed, causal=causal,
        scale=scale, window=window, kernel=kernel, active=list(plan.active) if skip_outside_window else None,
        first_cache_key=first_key, scheme=scheme, kv_heads=kv_heads, ulysses=ulysses,
    )


def rank_schedule(
    flat: Sequence, sizes: RankSizes, shape: ScheduleShape, ring_rank: int, ring: int,
    max_seqlen: int | torch.SymInt, *, windowed: bool, causal: bool, scale: float, window: tuple[int, int],
    kernel: str, first_cache_key: int | torch.SymInt | None, scheme: str, kv_heads: int, ulysses: int,
    active: list[bool] | None = None,
) -> RingSchedule:
    """This rank's ring schedule from its flat tables (``PreparedBatch.device_tables``,
    eagerly or through the graph's tables op), its sizes (host ints, or a graph's symbols) and
    its schedule's shape (``RankPlan.shape``, or ``layout.schedule_shape`` of a graph's
    sizes); ``windowed``: its window masks by position (``RankPlan.windowed``)."""
    tables = ScheduleTables.unflat(*flat, sizes, len(shape.sources), windowed, shape.gathered)
    return assemble_schedule(
        tables, sizes, shape, max_seqlen, ring_rank, ring, causal=causal, scale=scale, window=window,
        kernel=kernel, active=active, first_cache_key=first_cache_key, scheme=scheme, kv_heads=kv_heads,
        ulysses=ulysses,
    )


def assemble_schedule(
    tables: ScheduleTables, sizes: RankSizes, shape: ScheduleShape, max_seqlen: int | torch.SymInt,
    ring_rank: int, ring: int, *, causal: bool, scale: float, window: tuple[int, int], kernel: str,
    first_cache_key: int | torch.SymInt | None, kv_heads: int, ulysses: int, active: list[bool] | None = None,
    scheme: str = DEFAULT_SCHEME,
) -> RingSchedule:
    """The schedule with the given tables (the prepared batch's, from the host), one ring step
    per step of ``shape`` (the second a gathered one where ``shape.gathered``); ``active``
    (default: all) says which steps compute; ``scheme``: the collective scheme; ``kv_heads``:
    the call's KV heads, ``ulysses``: the Ulysses group's size (which decide its head groups)."""
    steps = len(shape.sources)
    gathered = shape.gathered
    if gathered and not scheme_named(scheme).ring.gathers:
        # a scheme that does not gather would hand the gathered step one section's keys
        raise ValueError(f"hcp: a schedule with a gathered step under scheme={scheme!r}, which does not gather")
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
                shape.sources, shape.kinds, tables.cu_q, tables.cu_k, tables.k_positions, active
            ))
        ),
        q_positions=tables.q_positions,
        max_seqlen=step_max_seqlen(max_seqlen, ring),
        causal=causal,
        scale=scale,
        window_left=window[0],
        window_right=window[1],
        kernel=kernel,
        kv_repeat=kv_head_repeat(kv_heads, ulysses),
        head_groups=_head_groups(shape.stream_empty, steps, kv_heads, ulysses),
        local_holds_every_row=shape.own_exchange_empty,
        scheme=scheme,
        gather_rows=tables.gather_rows,
    )


def step_max_seqlen(max_seqlen: int | torch.SymInt, ring: int) -> int | torch.SymInt:
    """Upper bound of any segment length of a step or of a local region (a RING document's
    ``2 c_i``, a whole document); ``torch.sym_max`` keeps a symbolic ``max_seqlen`` free of
    guards."""
    return torch.sym_max(torch.sym_max(2 * (-(-max_seqlen // (2 * ring))), max_seqlen), 1)


def cache_keys_needed(ring: int) -> int:
    """How many cache keys a rank's schedules of one batch take: one per ring step and one for
    the local region, for a causal schedule and for a full one, and one for a gathered step
    (causal only)."""
    return 2 * (ring + 1) + 1

