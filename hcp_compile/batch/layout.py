"""Token layout of hierarchical context parallelism: pure tensor math, no collectives
(docs/design.md §2).

A placement rule (:mod:`hcp_compile.batch.placements`) gives every document one of three
placements; everything else follows from that here:

- ``LOCAL``: the whole document on one rank, all heads: no exchange, no ring transfer;
- ``GROUP``: the whole document inside one ring rank, spread over its Ulysses group by the
  all-to-all over heads, no ring step;
- ``RING``: padded to ``2R`` chunks of ``c_i = ceil(L_i / 2R)``; ring rank ``r`` holds the
  *pair* ``q`` of two chunks: ``q`` and ``2R-1-q``, the zigzag that balances causal work, with
  ``q = r``; or, in a layout balanced for a sliding window, the adjacent chunks ``2q`` and
  ``2q+1`` (``BatchLayout.adjacent``), with each document's pairs turned round the ring ranks
  (``q = (r - t_i) mod R``, :func:`window_turns`). A window's work is even along a document
  but for its start, which the turns spread; and a rank's span of a document then needs only
  the keys of the ranks just before it, so the ring steps end where the window does
  (:func:`window_steps`) and every step meets a document's keys in one run (Note [adjacent
  pairs under a window]).

Note [adjacent pairs under a window]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One document on a ring of 4, a window of about one pair back (``2c <= left``), turn 0::

    position  ->  |0 1|2 3|4 5|6 7|    chunks; a pair is two adjacent ones
    ring rank     | 0 | 1 | 2 | 3 |
    step 0        own pair, causal by offsets (a window by position all the same)
    step 1        keys of r-1: the pair just before, all of it before every query: one
                  window band (its tail, docs/design.md §8.8)
    step 2        keys of r-2: what the window still reaches; nothing once 2c > left
    step 3        keys of r-3 = r+1 (mod 4): after every query: nothing

The zigzag instead holds chunks ``r`` and ``7-r``, so every step meets some document's keys
inside the window (chunk ``7-r`` sees chunk ``6-r`` of ring rank ``r+1``, step ``R-1``), and
every step is cut into several pieces of chunks shorter than the window.

Rank ``(r, a)`` holds ``T`` tokens, equal on every rank: ``[local | exchange | pads]``. Its
local region holds its LOCAL documents, whole, in document order. The exchange regions of
the Ulysses ranks of ring rank ``r``, concatenated in Ulysses order, form the *exchange stream*
of ``r``: first its *ring section* (the pair of chunks it holds of every RING document, in
document order: ``W`` tokens, the same on every ring rank), then its GROUP documents, whole, in
document order. So after the all-to-all every Ulysses rank holds the exchange stream in order
(each document contiguous) for its heads, and ring transfers carry only the ring section.

Every function is vectorized over documents (tensor ops, no Python loop or branch over
documents), so 100K documents lay out in milliseconds. It runs on the host, on the batch's
values (prepared.py), once per batch and mesh shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import NamedTuple, Protocol

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true


class Kind(IntEnum):
    """The placement of one document."""

    LOCAL = 0
    GROUP = 1
    RING = 2


@dataclass(frozen=True)
class Assignment:
    """What a placement rule decides per document (``[n]`` int64 tensors)."""

    kind: Tensor  # Kind
    ring_rank: Tensor  # ring rank holding a LOCAL or GROUP document (unused for RING)
    ulysses_rank: Tensor  # Ulysses rank holding a LOCAL document (unused otherwise)


class PlacementRule(Protocol):
    """``(lengths, ulysses, ring, *, window)``: the placement of each document; ``window``, the
    keys back of a sliding window whose work the layout balances (-1: plain causal work), which
    a rule may weigh or ignore."""

    def __call__(self, lengths: Tensor, ulysses: int, ring: int, *, window: int = -1) -> Assignment: ...


@dataclass(frozen=True)
class BatchLayout:
    """Where every token of one batch goes on a ``ulysses x ring`` mesh; the same on every rank.

    The schedule, the eager and compiled attention, the shard plan and the report all read
    the layout from here."""

    ulysses: int
    ring: int
    starts: Tensor  # [n] int64: global offset of each document
    lengths: Tensor  # [n] int64
    kind: Tensor  # [n] int64 Kind
    ring_rank: Tensor  # [n]
    ulysses_rank: Tensor  # [n]
    chunk: Tensor  # [n] c_i for RING documents, 0 otherwise
    # [n] t_i: ring rank r holds pair q of a RING document, q = (r - t_i) mod R (0 but under
    # a window: window_turns)
    turn: Tensor
    local_extent: Tensor  # [R, A]: tokens of each rank's local region
    exchange_extent: Tensor  # [R, A]: tokens of each rank's exchange region
    local_tokens: Tensor  # 0-d: T, every rank's token count
    adjacent: bool = False  # pair q is chunks 2q and 2q+1 (laid out for a window), else q and 2R-1-q

    @property
    def ring_width(self) -> Tensor:
        """``W``: tokens of the ring section of every ring rank's exchange stream."""
        return 2 * self.chunk.sum()

    def is_local_on(self, ring_rank: int, ulysses_rank: int) -> Tensor:
        return (
            (self.kind == Kind.LOCAL) & (self.ring_rank == ring_rank)
            & (self.ulysses_rank == ulysses_rank)
        )


def batch_layout(cu_seqlens: Tensor, ulysses: int, ring: int, rule: PlacementRule, window: int = -1) -> BatchLayout:
    """The layout of the batch ``cu_seqlens`` (global, real boundaries) under ``rule``, which
    weighs the work of a causal ``window`` of that many keys back (-1: none)."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    assignment = rule(lengths, ulysses, ring, window=window)
    kind = assignment.kind
    is_ring, is_local, is_group = kind == Kind.RING, kind == Kind.LOCAL, kind == Kind.GROUP
    chunk = torch.where(is_ring, (lengths + 2 * ring - 1) // (2 * ring), 0)
    adjacent, turn = _pairing(lengths, assignment, ulysses, ring, window)
    slot = torch.where(is_local, assignment.ring_rank * ulysses + assignment.ulysses_rank, 0)
    local_extent = lengths.new_zeros(ring * ulysses).scatter_add(
        0, slot, torch.where(is_local, lengths, 0)
    ).view(ring, ulysses)
    group_extent = lengths.new_zeros(ring).scatter_add(
        0, torch.where(is_group, assignment.ring_rank, 0), torch.where(is_group, lengths, 0)
    )
    stream_extent = 2 * chunk.sum() + group_extent  # [R]
    per_ring_rank = stream_extent + local_extent.sum(1)
    tokens = torch.maximum((per_ring_rank.max() + ulysses - 1) // ulysses, local_extent.max())
    # the exchange stream fills what the local regions leave free, Ulysses rank by rank
    capacity = tokens - local_extent
    before = torch.cumsum(capacity, 1) - capacity
    exchange_extent = (stream_extent[:, None] - before).clamp(min=0).minimum(capacity)
    return BatchLayout(
        ulysses, ring, cu[:-1], lengths, kind, assignment.ring_rank, assignment.ulysses_rank,
        chunk, turn, local_extent, exchange_extent, tokens, adjacent,
    )


def paired_chunks(pair: Tensor, ring: int, adjacent: bool) -> tuple[Tensor, Tensor]:
    """The two chunks of pair ``pair`` (elementwise), in document order: ``2q`` and ``2q+1``
    in adjacent pairs (``BatchLayout.adjacent``), else the zigzag's ``q`` and ``2R-1-q``."""
    return (2 * pair, 2 * pair + 1) if adjacent else (pair, 2 * ring - 1 - pair)


# Adjacent pairs cut a window's ring steps short and into fewer pieces, but they leave a
# document's light start (its first ``window`` positions) on fewer ring ranks than the zigzag
# does, which the turns may not even out: past this share of the mean work on any rank, a
# layout for a window keeps the zigzag (the balance issue 48 asks of a window's layout)
ADJACENT_WORK_STRAY = 0.03


def _pairing(lengths: Tensor, assignment: Assignment, ulysses: int, ring: int, window: int) -> tuple[bool, Tensor]:
    """``(adjacent, turn)`` of a layout (``BatchLayout.adjacent``, ``BatchLayout.turn``):
    for a window, adjacent pairs where their turned work stays within
    :data:`ADJACENT_WORK_STRAY` of the mean, else the turned zigzag; none without a window."""
    if window < 0:
        return False, torch.zeros_like(lengths)
    turn = window_turns(lengths, assignment.kind, assignment.ring_rank, ring, window, adjacent=True)
    work = placed_work(lengths, assignment.kind, assignment.ring_rank, assignment.ulysses_rank, turn,
                       ulysses, ring, window=window, adjacent=True).double()
    mean = work.mean()
    if mean == 0 or float((work - mean).abs().max() / mean) <= ADJACENT_WORK_STRAY:
        return True, turn
    return False, window_turns(lengths, assignment.kind, assignment.ring_rank, ring, window, adjacent=False)


def window_turns(lengths: Tensor, kind: Tensor, ring_rank: Tensor, ring: int, window: int,
                 adjacent: bool) -> Tensor:
    """``t_i`` of each RING document under a causal window of ``window`` keys back (0 for the
    others). A query then sees at most ``window + 1`` keys, so a document's first ``window``
    positions hold less work than the rest, and the zigzag would give every document's light
    first chunks to the same ring ranks (0, 1, ...), as would adjacent pairs (``adjacent``,
    ``BatchLayout.adjacent``) their pair 0. The turns deal the RING documents longest
    first, each given the turn that leaves the ring ranks' work most even (the least sum of
    squares; ties: the smallest turn), starting from the work of the documents placed whole on
    each ring rank. A loop over the RING documents, which are few (each longer than a rank's
    share of short ones), on the host as every layout is."""
    is_ring = kind == Kind.RING
    turn = torch.zeros_like(lengths)
    if ring == 1 or not bool(is_ring.any()):
        return turn
    whole = windowed_pairs(lengths, window)
    load = torch.zeros(ring, dtype=torch.float64).scatter_add_(
        0, torch.where(is_ring, 0, ring_rank), torch.where(is_ring, 0, whole).double())
    documents = torch.nonzero(is_ring).flatten()
    documents = documents[torch.sort(lengths[documents], descending=True, stable=True).indices]
    length, chunk = lengths[documents, None], ((lengths[documents] + 2 * ring - 1) // (2 * ring))[:, None]

    def chunk_pairs(index: Tensor) -> Tensor:  # [docs, R]: windowed pairs of chunk ``index``
        low, high = (index * chunk).minimum(length), ((index + 1) * chunk).minimum(length)
        return windowed_pairs(high, window) - windowed_pairs(low, window)

    first = torch.arange(ring)
    # work[i, q]: the document's pair q, chunks 2q and 2q+1 (adjacent) or q and 2R-1-q; under
    # turn t ring rank r holds q = (r - t) % R, so its work per turn and ring rank is work[i, held]
    work = sum(chunk_pairs(chunk) for chunk in paired_chunks(first[None, :], ring, adjacent)).double()
    held = (first[None, :] - first[:, None]) % ring  # [turn, ring rank]
    for document, pairs in zip(documents.tolist(), work):
        candidates = load[None, :] + pairs[held]
        best = int(torch.argmin(candidates.square().sum(1)))  # the most even (the first of ties)
        load = candidates[best]
        turn[document] = best
    return turn


@dataclass(frozen=True)
class RankSizes:
    """The sizes one rank's attention works with: host ints in eager mode, symbolic ints read
    once per batch in a compiled graph."""

    tokens: int  # T
    local: int  # its local region
    exchange: tuple[int, ...]  # the exchange region of every Ulysses rank of its ring rank
    ring_width: int  # W
    ulysses_rank: int
    # entries (documents, or document parts) that hold tokens in the local region and in each
    # ring step (step s pairs this ring rank's queries with ring rank (r - s) mod R's keys):
    # the segment tables keep these and drop the empty rest (docs/design.md §3.3)
    local_entries: int
    step_entries: tuple[int, ...]
    # keys of the gathered step (Note [one gathered step]) of a causal call: the rows it copies
    gathered_keys: int = 0
    # derived once here, not on each read: the algorithm reads them several times per call
    own_exchange: int = field(init=False)  # this rank's exchange region
    pad: int = field(init=False)  # its pad rows, after both regions
    stream: int = field(init=False)  # tokens of the exchange stream (all of the ring rank's exchange regions)

    def __post_init__(self) -> None:
        own = self.exchange[self.ulysses_rank]
        object.__setattr__(self, "own_exchange", own)
        object.__setattr__(self, "pad", self.tokens - self.local - own)
        object.__setattr__(self, "stream", sum(self.exchange))


def rank_size_values(layout: BatchLayout, ring_rank: int, ulysses_rank: int) -> Tensor:
    """``[T, local, W, exchange_0..exchange_{A-1}, local_entries, step_entries_0..R-1,
    gathered_keys]`` of rank ``(ring_rank, ulysses_rank)``."""
    own = stream_table(layout, ring_rank)
    sources = step_sources(ring_rank, layout.ring, layout.ring)[1:]
    step_entries = [step_active(own, None).sum()] + [
        step_active(own, stream_table(layout, src, with_group=False)).sum() for src in sources
    ]
    return torch.cat([
        torch.stack([
            layout.local_tokens, layout.local_extent[ring_rank, ulysses_rank], layout.ring_width,
        ]),
        layout.exchange_extent[ring_rank],
        torch.stack([layout.is_local_on(ring_rank, ulysses_rank).sum(), *step_entries,
                     gathered_chunk_keys(own, ring_rank, layout.ring).sum()]),
    ])


def known_empty(size: int | torch.SymInt) -> bool:
    """Whether a region of this size is known to be empty, the one rule both doors decide by:
    an eager call's sizes are ints; a compiled graph's are symbols, known to be 0 only where its
    variant made them the constant 0 (``Exchanges.narrowed``), and otherwise kept general
    without a guard."""
    return statically_known_true(size == 0)


def size_values(sizes: RankSizes) -> list:
    """Inverse of :func:`rank_sizes`: the values in :func:`rank_size_values`' order."""
    return [sizes.tokens, sizes.local, sizes.ring_width, *sizes.exchange, sizes.local_entries, *sizes.step_entries,
            sizes.gathered_keys]


def rank_sizes(values: list, ulysses_rank: int, ulysses: int) -> RankSizes:
    """:class:`RankSizes` from the values of :func:`rank_size_values` (read to the host)."""
    tokens, local, ring_width, *rest, gathered_keys = values
    exchange, (local_entries, *step_entries) = rest[:ulysses], rest[ulysses:]
    return RankSizes(
        tokens, local, tuple(exchange), ring_width, ulysses_rank, local_entries,
        tuple(step_entries), gathered_keys,
    )


def active_first(active: Tensor) -> Tensor:
    """The order that puts the ``active`` entries first, each group in its own order: empty
    entries moved to the end keep every token's row, and a table cut after the active ones
    then spends no kernel work (flash pads every segment to 128 rows) on the rest."""
    return torch.argsort(torch.logical_not(active).to(torch.int8), stable=True)


def leading_segments(cu: Tensor, segments: int | torch.SymInt) -> Tensor:
    """The first ``segments`` segments of ``cu`` (whose later segments are empty)."""
    torch._check(segments + 1 <= cu.shape[0])
    return cu.narrow(0, 0, segments + 1)


def local_segments(layout: BatchLayout, ring_rank: int, ulysses_rank: int) -> Tensor:
    """int32 ``cu_seqlens`` of a rank's local region: one segment per document of the batch,
    its LOCAL documents first (in order), the others empty."""
    local = layout.is_local_on(ring_rank, ulysses_rank)
    widths = torch.where(local, layout.lengths, 0)[active_first(local)]
    return torch.nn.functional.pad(torch.cumsum(widths, 0), (1, 0)).to(torch.int32)


# --------------------------------------------------------------------------------------------
# the exchange stream of a ring rank
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamTable:
    """The exchange stream of one ring rank as ``2n`` entries: the RING part of every document,
    then every GROUP document of that ring rank, each of zero width where it has no part."""

    starts: Tensor  # [2n] global offset of the entry's document
    lengths: Tensor  # [2n] real length of the entry's document
    chunk: Tensor  # [2n] c_i of ring entries, 0 for group entries
    turn: Tensor  # [2n] t_i of ring entries (BatchLayout.turn), 0 for group entries
    widths: Tensor  # [2n] tokens of the entry in the stream
    is_ring: Tensor  # [2n] bool: the first n entries
    adjacent: bool  # BatchLayout.adjacent

    def pair(self, ring_rank: int, ring: int) -> Tensor:
        """``q`` of each entry: the pair of chunks ``ring_rank`` holds; pairs are in document
        order either way (each pair's first chunk after the one before's)."""
        return (ring_rank - self.turn) % ring

    def chunks(self, ring_rank: int, ring: int) -> tuple[Tensor, Tensor]:
        """The two chunks of each entry that ``ring_rank`` holds, in stream order."""
        return paired_chunks(self.pair(ring_rank, ring), ring, self.adjacent)


def stream_table(layout: BatchLayout, ring_rank: int, with_group: bool = True) -> StreamTable:
    """The exchange stream of ``ring_rank``; ``with_group=False`` gives its ring section only
    (what a ring transfer carries)."""
    n = layout.lengths.numel()
    group = (layout.kind == Kind.GROUP) & (layout.ring_rank == ring_rank) & with_group
    is_ring = torch.arange(2 * n, device=layout.lengths.device) < n
    return StreamTable(
        starts=layout.starts.repeat(2),
        lengths=layout.lengths.repeat(2),
        chunk=torch.cat([layout.chunk, torch.zeros_like(layout.chunk)]),
        turn=torch.cat([layout.turn, torch.zeros_like(layout.turn)]),
        widths=torch.cat([2 * layout.chunk, torch.where(group, layout.lengths, 0)]),
        is_ring=is_ring,
        adjacent=layout.adjacent,
    )


@dataclass(frozen=True)
class StreamTokens:
    """Where each token of a rank's local tensor or of an exchange stream comes from."""

    doc: Tensor  # [tokens] int64: document index (-1 for pads)
    position: Tensor  # [tokens] int64: position inside the document (0 for pads)
    valid: Tensor  # [tokens] bool: a real token (not padding)
    global_index: Tensor  # [tokens] int64: index into the global packed tokens, -1 for pads


def stream_tokens(
    table: StreamTable, ring_rank: int, ring: int, length: int | torch.SymInt
) -> StreamTokens:
    """The ``length`` tokens of ``ring_rank``'s exchange stream ``table``, in stream order."""
    device = table.widths.device
    entry = torch.repeat_interleave(
        torch.arange(table.widths.numel(), device=device), table.widths, output_size=length
    )
    entry_start = torch.cumsum(table.widths, 0) - table.widths
    offset = torch.arange(length, device=device) - entry_start.index_select(0, entry)
    c = table.chunk.index_select(0, entry)
    first, second = (chunk.index_select(0, entry) for chunk in table.chunks(ring_rank, ring))
    paired = torch.where(offset < c, first * c + offset, second * c + offset - c)
    position = torch.where(table.is_ring.index_select(0, entry), paired, offset)
    valid = position < table.lengths.index_select(0, entry)
    n = table.widths.numel() // 2
    return StreamTokens(
        doc=torch.where(valid, entry % n, -1),
        position=torch.where(valid, position, 0),
        valid=valid,
        global_index=torch.where(valid, table.starts.index_select(0, entry) + position, -1),
    )


def local_tokens(layout: BatchLayout, ring_rank: int, ulysses_rank: int, length: int) -> StreamTokens:
    """The ``length`` tokens of a rank's local region, in order."""
    mine = layout.is_local_on(ring_rank, ulysses_rank)
    widths = torch.where(mine, layout.lengths, 0)
    doc = torch.repeat_interleave(
        torch.arange(widths.numel(), device=widths.device), widths, output_size=length
    )
    position = torch.arange(length, device=widths.device) - (torch.cumsum(widths, 0) - widths)[doc]
    return StreamTokens(doc, position, torch.ones_like(doc, dtype=torch.bool),
                        layout.starts[doc] + position)


def rank_tokens(layout: BatchLayout, sizes: RankSizes, ring_rank: int) -> StreamTokens:
    """Where each of the ``T`` tokens rank ``(ring_rank, sizes.ulysses_rank)`` holds comes from:
    its local region, its slice of the exchange stream, then pads."""
    local = local_tokens(layout, ring_rank, sizes.ulysses_rank, sizes.local)
    stream = stream_tokens(stream_table(layout, ring_rank), ring_rank, layout.ring, sizes.stream)
    first = sum(sizes.exchange[: sizes.ulysses_rank])
    mine = slice(first, first + sizes.own_exchange)
    pads = torch.full((sizes.pad,), -1, dtype=torch.int64, device=local.doc.device)
    return StreamTokens(
        doc=torch.cat([local.doc, stream.doc[mine], pads]),
        position=torch.cat([local.position, stream.position[mine], torch.zeros_like(pads)]),
        valid=torch.cat([local.valid, stream.valid[mine], pads >= 0]),
        global_index=torch.cat([local.global_index, stream.global_index[mine], pads]),
    )


# --------------------------------------------------------------------------------------------
# ring steps
# --------------------------------------------------------------------------------------------

def chunk_real(table: StreamTable, chunk_index: int | Tensor) -> Tensor:
    """Real tokens of each entry in its chunk ``chunk_index`` (one, or one per entry;
    padding sits at the end)."""
    return (table.lengths - chunk_index * table.chunk).clamp(min=0).minimum(table.chunk)


def real_tokens_held(table: StreamTable, ring_rank: int, ring: int) -> Tensor:
    """Real tokens of each entry in ``ring_rank``'s stream (a prefix of the entry)."""
    first, second = table.chunks(ring_rank, ring)
    ring_part = chunk_real(table, first) + chunk_real(table, second)
    return torch.where(table.is_ring, ring_part, table.widths)


class StepKind(Enum):
    """Which block of the causal zigzag schedule one ring step computes (docs/design.md §3). A
    document a window turned (``BatchLayout.turn``) is LOWER or UPPER in a causal ring step by
    its own chunks, and one in adjacent pairs all or nothing (:func:`entry_parts`), whatever
    the step's kind says."""

    DIAGONAL = "diagonal"  # own Q x own KV, causal inside each document
    LOWER = "lower"  # all Q x the first chunk of each KV document (src < r)
    UPPER = "upper"  # the second chunk of each Q document x all KV (src > r)
    FULL = "full"  # non-causal: all Q x all KV
    # each query chunk x every key of its document before it that another ring rank holds,
    # gathered from all ring ranks' sections (Note [one gathered step])
    GATHERED = "gathered"


class EntryParts(NamedTuple):
    """Which part of each entry a causal ring step computes (``[2n]`` bool each); an entry in
    none of them computes all its queries against all its keys."""

    lower: Tensor  # every query against the first of the source's chunks
    upper: Tensor  # the second of the queries' chunks against every key
    unseen: Tensor  # nothing: the source's keys come after every query (adjacent pairs)


def entry_parts(q_table: StreamTable, k_table: StreamTable, ring_rank: int, source: int,
                ring: int, kind: StepKind) -> EntryParts:
    """The :class:`EntryParts` of a step's ring entries. A zigzag document is LOWER where the
    source's pair of it comes before this rank's, else UPPER: by the step's kind, unless a
    window turned it (``BatchLayout.turn``). Adjacent pairs (``BatchLayout.adjacent``) hold
    a span each: the source's span before this rank's is seen whole, after it not at all.
    Nothing is cut in the own step or a FULL one."""
    none = torch.zeros_like(q_table.is_ring)
    if kind not in (StepKind.LOWER, StepKind.UPPER):
        return EntryParts(none, none, none)
    before = k_table.pair(source, ring) < q_table.pair(ring_rank, ring)
    if q_table.adjacent:
        return EntryParts(none, none, q_table.is_ring & ~before)
    return EntryParts(q_table.is_ring & before, q_table.is_ring & ~before, none)


def step_sources(ring_rank: int, ring: int, steps: int) -> list[int]:
    """The ring rank whose keys each step uses: step ``s`` those of ``ring_rank - s``."""
    return [(ring_rank - s) % ring for s in range(steps)]


def window_steps(layout: BatchLayout, window_left: int) -> int:
    """How many ring steps a causal window of ``window_left`` keys back needs on every ring
    rank: in adjacent pairs (Note [adjacent pairs under a window]) a rank's span of a
    document of chunks ``c`` sees the spans of the ``(left - 1) // 2c + 1`` ranks before it
    (the first query reaches ``left`` back; the span ``k`` back ends ``2c (k - 1) + 1``
    before it), and no later step sees a key; the zigzag meets keys in every step."""
    ring = layout.ring
    if not layout.adjacent or window_left < 0:
        return ring
    chunk = layout.chunk[layout.kind == Kind.RING]
    if chunk.numel() == 0:
        return 1
    reach = 0 if window_left == 0 else int(((window_left - 1) // (2 * chunk.clamp(min=1)) + 1).max())
    return min(ring, reach + 1)


def window_by_position(window: tuple[int, int], ring: int) -> bool:
    """Whether a window must mask by the tokens' positions in their documents (passed to the
    kernels with each step) rather than by offsets inside the step's segments. Only a ring of
    several ranks needs positions: with one ring rank a document's zigzag is the document
    itself, so every segment holds its document's rows in order from position 0, and its
    offsets are the positions (any kernel that windows varlen segments can take the call)."""
    return window != (-1, -1) and ring > 1


def step_kind(ring_rank: int, source: int, causal: bool) -> StepKind:
    if not causal:
        return StepKind.FULL
    if source == ring_rank:
        return StepKind.DIAGONAL
    return StepKind.LOWER if source < ring_rank else StepKind.UPPER


def step_segments(
    q_table: StreamTable, k_table: StreamTable, ring_rank: int, source: int, ring: int,
    kind: StepKind,
) -> tuple[Tensor, Tensor]:
    """``(cu_seqlens_q, cu_seqlens_k)`` (int32) of one ring step: the queries of
    ``ring_rank``'s exchange stream against the keys of ``source``'s (its ring section only,
    unless ``source`` is this rank).

    The entries holding queries or keys come first (:func:`step_active`, the count is in
    :class:`RankSizes`), the empty ones after them. Every entry becomes four aligned segments
    on both sides: ``a`` (queries that take no
    part in this step, matched with no keys), ``b`` (real queries x the real keys the step
    should see), ``c`` (pad queries x no keys) and ``d`` (no queries x pad keys). Any varlen
    kernel then computes exactly the step's block without gathering rows, and its contract
    (rows with no visible key give 0 and lse = -inf) leaves pad rows at zero with no masking.
    GROUP documents take part only in the rank's own step.
    """
    own = source == ring_rank
    widths_q, widths_k = q_table.widths, k_table.widths
    zero = torch.zeros_like(widths_q)
    lower, upper, unseen = entry_parts(q_table, k_table, ring_rank, source, ring, kind)
    ring_q_skip = torch.where(upper, q_table.chunk, zero)
    # an UPPER document: only the second chunk of its queries takes part; an unseen one: none
    second = q_table.chunks(ring_rank, ring)[1]
    ring_q_real = torch.where(upper, chunk_real(q_table, second), real_tokens_held(q_table, ring_rank, ring))
    ring_q_real = torch.where(unseen, zero, ring_q_real)
    # a LOWER document: only the first chunk of its keys takes part
    ring_k_real = torch.where(lower, chunk_real(k_table, k_table.chunks(source, ring)[0]),
                              real_tokens_held(k_table, source, ring))
    ring_k_real = torch.where(unseen, zero, ring_k_real)
    group_q_real = widths_q if own else zero
    q_skip = torch.where(q_table.is_ring, ring_q_skip, widths_q - group_q_real)
    q_real = torch.where(q_table.is_ring, ring_q_real, group_q_real)
    k_real = torch.where(k_table.is_ring, ring_k_real, widths_k if own else zero)
    q_parts = (q_skip, q_real, widths_q - q_skip - q_real, zero)
    k_parts = (zero, k_real, zero, widths_k - k_real)
    order = active_first(step_active(q_table, None if own else k_table))
    return _cumulative(q_parts, order), _cumulative(k_parts, order)


def step_active(q_table: StreamTable, k_table: StreamTable | None) -> Tensor:
    """Entries of a step that hold queries or keys (``k_table`` None: the own step, where
    keys and queries are the same stream)."""
    active = q_table.widths > 0
    return active if k_table is None else active | (k_table.widths > 0)


def _cumulative(parts: tuple[Tensor, ...], order: Tensor) -> Tensor:
    lengths = torch.stack(parts, dim=1)[order].reshape(-1)
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


# --------------------------------------------------------------------------------------------
# the gathered step
# --------------------------------------------------------------------------------------------
#
# Note [one gathered step]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Where one collective brings every ring rank's section at once (``scheme="allgather"``), the
# steps after the own one need not be separate kernel calls, each with its own backward
# helpers, lse merge and fp32 gradient sum. One call computes them all: every query chunk of a
# RING document against every key before it that another ring rank holds, copied out of the
# gathered sections into one buffer, a segment per query chunk. The keys of a query chunk all
# come before it, so the block has no mask; the own chunks stay with the own step (causal).
# Ring rank 1 of 4, a document of chunks 0..7 (zigzag: rank 1 holds 1 and 6)::
#
#     own step      [1 6] x [1 6]               causal, as always
#     gathered      [1]   x [0]                 keys of rank 0
#                   [6]   x [0 2 3 4 5]         keys of ranks 0, 2, 3, 3, 2
#
# Chunk 0 is copied twice, once per query chunk that sees it (its gradient sums both). The
# copy costs ``(2R - 1) / 2R`` of a document's keys per ring rank, beside the gathered
# sections; the calls, merges and sums fall from ``R - 1`` to one. Causal calls without a
# window by position only: a window keeps the steps, which skip what it does not reach.

@dataclass(frozen=True)
class GatheredStep:
    """A rank's gathered step (Note [one gathered step]): its segmentations over the exchange
    stream (queries) and over the gathered keys, four segments per entry of the stream that
    holds tokens, and where each gathered key comes from."""

    cu_q: Tensor  # int32
    cu_k: Tensor  # int32
    rows: Tensor  # [K] int64: ring rank * W + row of the key in that ring rank's ring section


def gathered_chunk_keys(table: StreamTable, ring_rank: int, ring: int) -> Tensor:
    """``[n, 2, 2R]`` int64: for each document's RING entry of ``ring_rank``'s exchange stream
    ``table`` and each of the two query chunks it holds (in stream order), the real keys of
    every chunk of the document that the gathered step gives it: those before the query chunk
    that other ring ranks hold (the own chunks are the own step's), none for a chunk without a
    real query. 0 for documents that do not go round the ring (their chunk is 0)."""
    n = table.widths.numel() // 2
    chunk, lengths = table.chunk[:n, None], table.lengths[:n, None]
    index = torch.arange(2 * ring, device=chunk.device)
    real = (lengths - index * chunk).clamp(min=0).minimum(chunk)  # [n, 2R]
    first, second = (c[:n, None] for c in table.chunks(ring_rank, ring))
    queries = torch.cat([first, second], 1)  # [n, 2]
    own = (index == first) | (index == second)  # [n, 2R]
    seen = (index < queries[:, :, None]) & ~own[:, None, :] & (real.gather(1, queries) > 0)[:, :, None]
    return torch.where(seen, real[:, None, :], 0)


def gathered_step(layout: BatchLayout, ring_rank: int) -> GatheredStep:
    """Rank ``ring_rank``'s gathered step (:class:`GatheredStep`): the entries of its exchange
    stream as in the own step (:func:`active_first`), a RING entry's segments its first chunk's
    real queries against their keys, its pad rows against none, and the same for its second
    chunk; a GROUP entry's rows against no key (they are the own step's). The keys follow the
    segments, each query chunk's in document order (:func:`gathered_chunk_keys`)."""
    ring = layout.ring
    own = stream_table(layout, ring_rank)
    keys = gathered_chunk_keys(own, ring_rank, ring)  # [n, 2, 2R]
    # the ring rank and the row in its section of each document's chunks
    index = torch.arange(2 * ring, device=keys.device)
    pair = torch.where(index < ring, index, 2 * ring - 1 - index) if not layout.adjacent else index // 2
    slot = (index >= ring).long() if not layout.adjacent else index % 2
    holder = (pair + layout.turn[:, None]) % ring  # [n, 2R]
    section_start = torch.cumsum(2 * layout.chunk, 0) - 2 * layout.chunk  # [n]
    first_row = holder * layout.ring_width + section_start[:, None] + slot * layout.chunk[:, None]
    counts = keys.reshape(-1)
    starts = first_row[:, None, :].expand_as(keys).reshape(-1)
    total = int(counts.sum())
    owner = torch.repeat_interleave(torch.arange(counts.numel(), device=keys.device), counts, output_size=total)
    offset = torch.arange(total, device=keys.device) - (torch.cumsum(counts, 0) - counts)[owner]
    rows = starts[owner] + offset
    # segments: a ring entry's (real, pad) rows of each query chunk, a group entry's rows alone
    real_q = torch.stack([chunk_real(own, c) for c in own.chunks(ring_rank, ring)], 1)  # [2n, 2]
    ring_keys = torch.cat([keys.sum(2), torch.zeros_like(keys[:, :, 0])])  # [2n, 2]
    zero = torch.zeros_like(own.widths)
    ring_entry = own.is_ring
    q_parts = (torch.where(ring_entry, real_q[:, 0], own.widths), torch.where(ring_entry, own.chunk - real_q[:, 0], zero),
               torch.where(ring_entry, real_q[:, 1], zero), torch.where(ring_entry, own.chunk - real_q[:, 1], zero))
    k_parts = (ring_keys[:, 0], zero, ring_keys[:, 1], zero)
    order = active_first(step_active(own, None))
    return GatheredStep(_cumulative(q_parts, order), _cumulative(k_parts, order), rows)


def step_sees_any_key(
    q_table: StreamTable, k_table: StreamTable, ring_rank: int, source: int, ring: int,
    kind: StepKind, window_left: int, window_right: int,
) -> Tensor:
    """Whether any real query of ``ring_rank``'s ring section sees any real key of
    ``source``'s in this step under the sliding window (a 0-d bool tensor). Used to skip the
    ring steps (never the rank's own step) wholly outside the window."""
    inf = torch.iinfo(torch.int64).max // 4
    left = window_left if window_left >= 0 else inf
    right = 0 if kind is not StepKind.FULL else (window_right if window_right >= 0 else inf)

    def intervals(table: StreamTable, rank: int, taking: tuple[Tensor, Tensor]) -> list[tuple[Tensor, Tensor]]:
        # real positions [start, stop) of the rank's two chunks, per ring entry, empty where an
        # entry does not take that chunk (and for group entries)
        return [(i * table.chunk, i * table.chunk + chunk_real(table, i) * takes)
                for i, takes in zip(table.chunks(rank, ring), taking)]

    lower, upper, unseen = entry_parts(q_table, k_table, ring_rank, source, ring, kind)
    every = torch.ones_like(lower)
    seen = torch.zeros((), dtype=torch.bool, device=q_table.lengths.device)
    # an UPPER document's first query chunk and a LOWER one's second key chunk take no part,
    # nor an unseen one's queries
    for q_start, q_stop in intervals(q_table, ring_rank, (~upper & ~unseen, ~unseen)):
        for k_start, k_stop in intervals(k_table, source, (every, ~lower)):
            nonempty = (q_stop > q_start) & (k_stop > k_start)
            # q - k over the pair of intervals spans [q_start - (k_stop - 1), (q_stop - 1) - k_start]
            low = q_start - (k_stop - 1)
            high = (q_stop - 1) - k_start
            overlaps = (high >= -right) & (low <= left)
            seen = seen | (nonempty & overlaps).any()
    return seen


def attention_work(layout: BatchLayout, causal: bool = True, window: int = -1) -> Tensor:
    """``[R, A]`` query-key pairs each rank computes (int64): its LOCAL documents whole, plus
    a ``1/A`` share (by heads) of its ring rank's exchange stream, whose RING documents
    count the pairs of the queries the ring rank holds. ``window``: causal attention sees that
    many keys back (-1: every earlier key)."""
    return placed_work(layout.lengths, layout.kind, layout.ring_rank, layout.ulysses_rank, layout.turn,
                       layout.ulysses, layout.ring, causal, window, layout.adjacent)


def placed_work(lengths: Tensor, kind: Tensor, ring_rank: Tensor, ulysses_rank: Tensor, turn: Tensor,
                ulysses: int, ring: int, causal: bool = True, window: int = -1, adjacent: bool = False) -> Tensor:
    """:func:`attention_work` of documents placed so (an :class:`Assignment`'s fields, the
    ring documents' turns and their pairing, ``BatchLayout.adjacent``), before they are laid
    out: what a placement rule weighs."""

    def pairs_before(stop: Tensor, length: Tensor) -> Tensor:  # queries at [0, stop) of documents this long
        if causal and window >= 0:
            return windowed_pairs(stop, window)
        return stop * (stop + 1) // 2 if causal else stop * length

    is_local, is_group = kind == Kind.LOCAL, kind == Kind.GROUP
    whole = pairs_before(lengths, lengths)
    slot = torch.where(is_local, ring_rank * ulysses + ulysses_rank, 0)
    local = lengths.new_zeros(ring * ulysses).scatter_add(0, slot, torch.where(is_local, whole, 0))
    stream = lengths.new_zeros(ring).scatter_add(
        0, torch.where(is_group, ring_rank, 0), torch.where(is_group, whole, 0)
    )
    # [R, ring documents]: ring rank r holds pair q of each, q = (r - t) mod R
    documents = torch.nonzero(kind == Kind.RING).flatten()
    length = lengths[documents]
    chunk = (length + 2 * ring - 1) // (2 * ring)
    pair = (torch.arange(ring, device=lengths.device)[:, None] - turn[documents]) % ring
    first, second = paired_chunks(pair, ring, adjacent)

    def held_pairs(chunk_index: Tensor) -> Tensor:
        low = (chunk_index * chunk).minimum(length)
        high = ((chunk_index + 1) * chunk).minimum(length)
        return pairs_before(high, length) - pairs_before(low, length)

    ring_pairs = (held_pairs(first) + held_pairs(second)).sum(1)
    return local.view(ring, ulysses) + ((stream + ring_pairs) / ulysses)[:, None]


def windowed_pairs(stop: Tensor, window: int) -> Tensor:
    """The query-key pairs of the queries at positions ``[0, stop)`` of a document under a
    causal window of ``window`` keys back: ``sum of min(p, window) + 1``."""
    ramp = stop.clamp(max=window + 1)
    return ramp * (ramp + 1) // 2 + (stop - ramp) * (window + 1)


# --------------------------------------------------------------------------------------------
# one rank's schedule for one mask, in one pass
# --------------------------------------------------------------------------------------------

def schedule_steps(sizes: RankSizes, ring: int, window_steps: int | None = None, gathered: bool = False) -> int:
    """How many ring steps a schedule has: without a ring section (a batch of short documents)
    nothing goes round the ring, so only the own step; a symbolic width (a compiled graph)
    keeps every step (its graphs for batches without a ring section make the width the
    constant 0: hcp_compile.compiled.graph_variants); else two where the call ``gathered``
    (``schedule.gathers``), or the ``window_steps`` a causal window needs
    (:func:`window_steps`; None: every step)."""
    if known_empty(sizes.ring_width):
        return 1
    if gathered:
        return 2
    return ring if window_steps is None else window_steps


def own_steps(layout: BatchLayout, sizes: RankSizes, causal: bool, window: tuple[int, int],
              gathered: bool = False) -> int:
    """The ring steps of a rank's own schedule for calls with this mask
    (:func:`schedule_steps`): a causal window on a layout in adjacent pairs ends them early
    (:func:`window_steps`), the same on every rank; a ``gathered`` call has two."""
    ring = layout.ring
    return schedule_steps(sizes, ring, window_steps(layout, window[0]) if causal else ring, gathered)


class ScheduleShape(NamedTuple):
    """What a schedule of some ring steps is made of beside its tables, decided alike by both
    doors (host ints eagerly, a graph's symbols compiled): its steps are ``len(sources)``."""

    sources: tuple[int, ...]  # per step, the ring rank whose keys it uses (-1: a gathered step)
    kinds: tuple[StepKind, ...]
    gathered: bool  # its second step is a gathered one
    stream_empty: bool  # the exchange stream known to be empty (known_empty)
    own_exchange_empty: bool  # the rank's own exchange region known to be empty


def schedule_shape(sizes: RankSizes, ring_rank: int, ring: int, steps: int, causal: bool,
                   gathered: bool) -> ScheduleShape:
    """The :class:`ScheduleShape` of rank ``(ring_rank, sizes.ulysses_rank)``'s schedule of
    ``steps`` ring steps (``gathered``: its own step and a gathered one)."""
    if gathered:
        sources, kinds = (ring_rank, -1), (StepKind.DIAGONAL, StepKind.GATHERED)
    else:
        sources, kinds = _steps_of(ring_rank, ring, steps, causal)
    return ScheduleShape(sources, kinds, gathered, known_empty(sizes.stream), known_empty(sizes.own_exchange))


class RankSegments(NamedTuple):
    """One rank's segmentation of its schedule for one mask (:func:`rank_segments`): the
    schedule's shape, the local region's and every ring step's segments, cut after their
    active entries, the positions a window masks by, a gathered step's key rows, and which
    steps see a key."""

    shape: ScheduleShape
    windowed: bool  # the window masks by position (window_by_position)
    active: tuple[bool, ...]  # per step, whether any query sees any key (the own step always)
    local_cu: Tensor  # int32
    cu_q: tuple[Tensor, ...]  # int32, per step
    cu_k: tuple[Tensor, ...]  # int32, per step
    q_positions: Tensor | None  # int64 positions of the exchange stream's tokens (windowed)
    k_positions: tuple[Tensor | None, ...]  # int64 positions of each step's keys (windowed)
    gather_rows: Tensor | None  # int64 rows of the gathered step's keys (GatheredStep.rows)


def rank_segments(layout: BatchLayout, sizes: RankSizes, ring_rank: int, causal: bool, window: tuple[int, int],
                  steps: int | None = None, gathered: bool = False) -> RankSegments:
    """Rank ``(ring_rank, sizes.ulysses_rank)``'s :class:`RankSegments` for calls with this
    mask, derived in one pass over its steps' stream tables: of its own ring steps
    (:func:`own_steps`), or of ``steps`` (a compiled graph's: every step, or those of its
    graph kind), which must be at least its own; ``gathered``: the own step and a gathered one
    (``schedule.gathers``), where more than one step runs."""
    ring = layout.ring
    own_count = own_steps(layout, sizes, causal, window, gathered)
    if steps is not None and steps < own_count:
        # a graph's kind and the schedule come from the same layout: never, but not silently
        raise RuntimeError(f"hcp: a schedule of {steps} ring steps asked for a batch whose calls need {own_count}")
    steps = own_count if steps is None else steps
    shape = schedule_shape(sizes, ring_rank, ring, steps, causal, gathered and steps > 1)
    windowed = window_by_position(window, ring)
    own = stream_table(layout, ring_rank)
    local_cu = leading_segments(local_segments(layout, ring_rank, sizes.ulysses_rank), sizes.local_entries)
    if shape.gathered:
        own_q, own_k = _step_cut(own, own, ring_rank, ring_rank, ring, StepKind.DIAGONAL, sizes.step_entries[0])
        step = gathered_step(layout, ring_rank)
        segments = 4 * sizes.step_entries[0]
        return RankSegments(
            shape, windowed, (True,) * steps, local_cu,
            (own_q, leading_segments(step.cu_q, segments)), (own_k, leading_segments(step.cu_k, segments)),
            None, (None, None), step.rows,
        )
    sources, kinds = shape.sources, shape.kinds
    tables = [own] + [stream_table(layout, source, with_group=False) for source in sources[1:]]
    lengths = [sizes.stream] + [sizes.ring_width] * (steps - 1)
    positions = [stream_tokens(table, source, ring, length).position if windowed else None
                 for table, source, length in zip(tables, sources, lengths)]
    cuts = [_step_cut(own, table, ring_rank, source, ring, kind, entries)
            for table, source, kind, entries in zip(tables, sources, kinds, sizes.step_entries)]
    active = (True,) * steps
    if window != (-1, -1) and steps > 1:
        seen = torch.stack([step_sees_any_key(own, table, ring_rank, source, ring, kind, *window)
                            for table, source, kind in zip(tables[1:], sources[1:], kinds[1:])])
        active = (True, *seen.tolist())
    return RankSegments(shape, windowed, active, local_cu, tuple(q for q, _ in cuts),
                        tuple(k for _, k in cuts), positions[0], tuple(positions), None)


def _steps_of(ring_rank: int, ring: int, steps: int, causal: bool) -> tuple[tuple[int, ...], tuple[StepKind, ...]]:
    """Per ring step of ``ring_rank``'s schedule, the ring rank whose keys it uses and its kind."""
    sources = tuple(step_sources(ring_rank, ring, steps))
    return sources, tuple(step_kind(ring_rank, source, causal) for source in sources)


def _step_cut(own: StreamTable, table: StreamTable, ring_rank: int, source: int, ring: int, kind: StepKind,
              entries: int | torch.SymInt) -> tuple[Tensor, Tensor]:
    """The step's ``(cu_q, cu_k)`` cut after its ``entries`` active entries (4 segments each)."""
    cu_q, cu_k = step_segments(own, table, ring_rank, source, ring, kind)
    return leading_segments(cu_q, 4 * entries), leading_segments(cu_k, 4 * entries)
