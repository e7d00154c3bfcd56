"""``placement="balanced"`` (the default): short documents stay whole on one rank, only the
documents too heavy to place whole are split, and the others fill around them
(docs/design.md §2.2).

The promise, for any batch on any mesh: every *short* document (at most ``short_fraction``,
1/8, of a rank's tokens) is LOCAL, but at most one per rank, which may straddle a rank
boundary: split round the ring (RING) or over the Ulysses ranks of its ring rank (GROUP).
With some thousands of tokens per rank, pads stay under 5 % of the tokens and every rank's
causal work within 10 % of the mean, no rank more than 5 % above it (with fewer, the pads
of ring documents, up to ``2R - 1`` tokens each and all on ring rank 0, weigh more).

The rule is tensor ops over the documents (sorts, cumulative sums, scatters, searches; the
only loops run a fixed number of rounds), so that ``shard_plan`` and a compiled graph's
host op derive the same placement from ``cu_seqlens``. Laid out for a sliding ``window``, a
document's work is the pairs the window leaves (``layout.windowed_pairs``), which every step
weighs in place of the causal pairs (docs/design.md §2.2):

1. *Heavy* documents are split: those not short that hold more than ``balance_tolerance``
   of a rank's share of the causal work (pairs, ``~L^2``). Under a window a document's work
   grows with its length, not its square, and whole documents are the ones that run at one
   GPU's rate (a ring document's window is cut into pieces, docs/design.md §8.8): heavy are
   then first only those longer than ``window_whole_shares[0]`` of a rank's tokens, then the
   next share, and the rule keeps the first placement whose ranks' windowed work, ring
   documents turned (:func:`_work_strays`), is within ``window_balance`` of the mean; if
   none is, the heavy documents by work as without a window. One goes round the ring when a
   Ulysses group could not absorb it within the tolerance, when there is no Ulysses group
   to spread it over, or when it is long enough that its ring transfers hide under its own
   attention (:meth:`CostModel.ring_hides_transfers`); otherwise it is spread over one
   Ulysses group.
2. Ring ranks (``R > 1``). *Coarse* documents go round the ring: those longer than 1 % of
   a ring rank's share with fewer than ``(R - 1) L`` tokens in other documents no longer
   than them, so that nothing could even the ring ranks out around them. All long ones do;
   of the short ones, the longest ``j <= R``, for the least ``j`` whose rest, dealt whole,
   pads at most 0.5 % of the batch more than the rest after any other ``j``. The others are
   partitioned onto ``R`` piles (:func:`_partition`):

   a. dealt longest first in a serpentine (0, 1, .., R-1, R-1, .., 0, ..), which evens
      out tokens and work together;
   b. work: documents are split, at most one per pile, their work then shared by every
      pile. Where the lightest pile is more than twice ``work_slack`` (``window_work_slack``
      under a window) of a pile's fair share of the work under the mean, every pile more
      than the slack above it splits the document closest to that difference, which stands
      the piles level (a count of heavy documents that the piles do not divide); otherwise a
      pile more than the slack above the mean splits the document that brings it back to the
      mean;
   c. tokens: each pile keeps its longest documents up to an equal share of the tokens and
      the rest is poured into the room left, roomiest pile first, each document to the pile
      holding most of it. Those across the end of a room that overflow their pile by more
      than 1 % are split, and the room they leave is poured again. Of the piles as dealt, as
      poured (straddlers whole) and as poured again, those that pad least stand: documents
      too few or too long to pour again can pad less whole.

   At most ``R`` short documents are split in this step: the coarse ones first, then those
   the work and the tokens split, the longest and the most overflowing first.
3. Ulysses ranks (``A > 1``). Inside each ring rank, its documents but the heavy ones spread
   over its group are partitioned the same way onto its ``A`` ranks, a split document going
   over the group (GROUP). A rank's capacity is its token count ``T``, not an equal share:
   the exchange stream fills what the local documents leave, so tokens need no evening and a
   split's room is not poured again. At most ``A - 1`` short documents per ring rank are
   split here: with step 2, at most one per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hcp_compile.batch.layout import Assignment, Kind, placed_work, window_turns, windowed_pairs


@dataclass(frozen=True)
class CostModel:
    """What the rule weighs. The defaults describe H200s with bf16 GQA attention (32 query and
    8 key/value heads of 128) and a ring that crosses nodes."""

    # share of a rank's causal work a long document may hold and still be placed whole
    balance_tolerance: float = 0.025
    short_fraction: float = 1 / 8  # documents up to this share of a rank's tokens stay whole
    # how far (a share of its fair work) a pile may stray from the others before one of its
    # documents is split to bring it back
    work_slack: float = 0.025
    # the same under a sliding window: the turned ring documents (layout.window_turns) leave
    # the ring ranks' work a little uneven on their own, which adds to the piles' slack
    window_work_slack: float = 0.0125
    # under a window, the longest a document may be, as a share of a rank's tokens, and still
    # be placed whole (tried in order: the rule's step 1), and how far a rank's work may then
    # stray from the mean
    window_whole_shares: tuple[float, ...] = (1 / 2, 1 / 4)
    window_balance: float = 0.02
    attention_flops_per_s: float = 375e12  # one GPU, fwd+bwd, on long documents
    flops_per_pair: float = 4 * 32 * 128  # q k^T and p v over the query heads, forward
    kv_bytes_per_token: float = 2 * 8 * 128 * 2  # k and v, bf16
    ring_bytes_per_s: float = 50e9  # one direction of a 400 Gb/s link per GPU

    def ring_hides_transfers(self, lengths: Tensor, ring: int) -> Tensor:
        """A ring step of a document computes ``(L/R) x (L/2R)`` pairs per rank while the next
        ``L/R`` tokens of KV cross the ring link; the transfer hides when the first takes
        longer: ``L >= 2 R * kv_bytes * flops_per_s / (flops_per_pair * bytes_per_s)``."""
        shortest = (
            2 * ring * self.kv_bytes_per_token * self.attention_flops_per_s
            / (self.flops_per_pair * self.ring_bytes_per_s)
        )
        return lengths >= int(shortest)


DEFAULT_COST = CostModel()


def balanced(lengths: Tensor, ulysses: int, ring: int, cost: CostModel = DEFAULT_COST, *,
             window: int = -1) -> Assignment:
    ranks = ulysses * ring
    docs = _Docs.of(lengths, ranks, cost.short_fraction, window)
    if window >= 0:  # whole documents where the work stays even (step 1 of the module's rule)
        for share in cost.window_whole_shares:
            heavy = ~docs.short & (lengths * ranks > share * docs.total)
            assignment = _assign(docs, heavy, ulysses, ring, cost, window)
            if _work_strays(assignment, lengths, ulysses, ring, window) <= cost.window_balance:
                return assignment
    tolerance = round(1 / cost.balance_tolerance)  # in integers: pairs * ranks * 40 > total
    heavy = ~docs.short & (docs.pairs * ranks * tolerance > docs.total_pairs)
    return _assign(docs, heavy, ulysses, ring, cost, window)


def _assign(docs: "_Docs", heavy: Tensor, ulysses: int, ring: int, cost: CostModel, window: int) -> Assignment:
    """Steps 1-3 of the module's rule, the ``heavy`` documents split."""
    lengths = docs.lengths
    tolerance = round(1 / cost.balance_tolerance)
    ring_doc = torch.zeros_like(heavy)
    if ring > 1:
        group_cannot_absorb = docs.pairs * ring * tolerance > docs.total_pairs
        ring_doc = heavy & (group_cannot_absorb | (ulysses == 1) | cost.ring_hides_transfers(lengths, ring))
    group_doc = heavy & ~ring_doc
    slack = round(1 / (cost.work_slack if window < 0 else cost.window_work_slack))
    ring_rank = torch.zeros_like(lengths)
    if ring > 1:
        ring_rank, ring_doc = _place_on_ring_ranks(docs, ring_doc, ring, slack)
    ulysses_rank = torch.zeros_like(lengths)
    if ulysses > 1:
        ulysses_rank, group_doc = _place_on_ulysses_ranks(
            docs, ring_doc, group_doc, ring_rank, ulysses, ring, slack
        )
    kind = torch.where(ring_doc, int(Kind.RING), torch.where(group_doc, int(Kind.GROUP), int(Kind.LOCAL)))
    return Assignment(kind.to(torch.int64), ring_rank, ulysses_rank)


def _work_strays(assignment: Assignment, lengths: Tensor, ulysses: int, ring: int, window: int) -> float:
    """How far the most or least loaded rank's windowed work strays from the mean (a share of
    it), the ring documents in adjacent pairs turned as the layout will turn them."""
    turn = window_turns(lengths, assignment.kind, assignment.ring_rank, ring, window, adjacent=True)
    work = placed_work(lengths, assignment.kind, assignment.ring_rank, assignment.ulysses_rank, turn,
                       ulysses, ring, window=window, adjacent=True).double()
    mean = work.mean()
    return float((work - mean).abs().max() / mean) if mean > 0 else 0.0


@dataclass(frozen=True)
class _Docs:
    """The documents of a batch as the rule sees them."""

    lengths: Tensor
    pairs: Tensor  # causal query-key pairs, L (L + 1) / 2, or those a window leaves
    short: Tensor  # at most short_fraction of a rank's tokens: whole, but for one per rank
    order: Tensor  # longest first, ties by index
    rank: Tensor  # each document's place in ``order``
    total: Tensor
    total_pairs: Tensor

    @staticmethod
    def of(lengths: Tensor, ranks: int, short_fraction: float, window: int) -> "_Docs":
        pairs = lengths * (lengths + 1) // 2 if window < 0 else windowed_pairs(lengths, window)
        total = lengths.sum()
        order = torch.sort(lengths, descending=True, stable=True).indices
        return _Docs(
            lengths, pairs, lengths * ranks * round(1 / short_fraction) <= total, order,
            _inverse(order), total, pairs.sum(),
        )

    def running(self, values: Tensor) -> Tensor:
        """Each document's running sum of ``values``, longest first (itself included)."""
        return _running(values, self.order)

    def segment_order(self, segment: Tensor, segments: int) -> Tensor:
        """The documents by ``segment``, then longest first."""
        if segments == 1:
            return self.order
        return torch.sort(segment * self.order.numel() + self.rank).indices


@dataclass(frozen=True)
class _Piles:
    """Piles that documents are dealt onto: ``piles`` in each of ``segments`` independent
    segments (ring ranks: one segment of ``R`` piles; Ulysses ranks: ``R`` segments of
    ``A``). A document's pile is ``pile`` of its ``segment``; its *slot* is the flat
    ``segment * piles + pile``, ``segments * piles`` for documents not dealt, and tables of
    ``[segments, piles]`` are read and summed by slot."""

    segment: Tensor  # [n], read for the documents dealt only
    segments: int
    piles: int
    order: Tensor  # by segment, then longest first

    @staticmethod
    def of(docs: "_Docs", segment: Tensor, segments: int, piles: int) -> "_Piles":
        return _Piles(segment, segments, piles, docs.segment_order(segment, segments))

    @property
    def slots(self) -> int:
        return self.segments * self.piles

    def running(self, values: Tensor) -> Tensor:
        """Each document's running sum of ``values`` over its segment, longest first."""
        return _running(values, self.order, self.segment, self.segments)

    def slot(self, members: Tensor, pile: Tensor) -> Tensor:
        """Each member's slot (``slots`` for the others)."""
        return torch.where(members, self.segment * self.piles + pile, self.slots)

    def sums(self, values: Tensor, slot: Tensor) -> Tensor:
        """``[segments, piles]``: the sums of ``values`` by slot (0 for the documents not dealt)."""
        return _slot_sum(slot, values, self.slots).view(self.segments, self.piles)

    def read(self, table: Tensor, slot: Tensor) -> Tensor:
        """``table[segment, pile]`` of each document (0 for the documents not dealt)."""
        return torch.cat([table.reshape(-1), table.new_zeros(1)]).index_select(0, slot)

    def count(self, which: Tensor) -> Tensor:
        """``[segments]``: the documents of ``which`` in each segment."""
        return _slot_sum(torch.where(which, self.segment, self.segments), which.long(), self.segments)


def _place_on_ring_ranks(docs: _Docs, ring_doc: Tensor, ring: int, slack: int) -> tuple[Tensor, Tensor]:
    """``(ring_rank, ring_doc)``: step 2 of the module's rule, the documents not ``ring_doc``
    (heavy ones) onto ring ranks, or round the ring."""
    stays = ~ring_doc
    coarse = _coarse(docs, stays, ring)
    fine = (docs.lengths * (stays & ~coarse)).sum()
    coarse_short = _longest_to_split(docs, coarse & docs.short, fine, ring)
    ring_doc = ring_doc | (coarse & ~docs.short) | coarse_short
    piles = _Piles.of(docs, torch.zeros_like(docs.lengths), 1, ring)
    ring_rank, split = _partition(
        docs, ~ring_doc, piles, docs.total_pairs // ring, slack, None, ring - piles.count(coarse_short)
    )
    return ring_rank, ring_doc | split


def _place_on_ulysses_ranks(
    docs: _Docs, ring_doc: Tensor, group_doc: Tensor, ring_rank: Tensor, ulysses: int, ring: int,
    slack: int,
) -> tuple[Tensor, Tensor]:
    """``(ulysses_rank, group_doc)``: step 3 of the module's rule, the documents of each ring
    rank but the ``group_doc`` (heavy ones) onto its Ulysses ranks, or over them."""
    lengths = docs.lengths
    stays = ~ring_doc
    chunk = (lengths + 2 * ring - 1) // (2 * ring) * ring_doc
    per_ring_rank = 2 * chunk.sum() + lengths.new_zeros(ring).scatter_add(
        0, ring_rank * stays, lengths * stays
    )
    tokens = (per_ring_rank.max() + ulysses - 1) // ulysses
    local = stays & ~group_doc
    piles = _Piles.of(docs, ring_rank * local, ring, ulysses)
    ulysses_rank, split = _partition(
        docs, local, piles, docs.total_pairs // (ring * ulysses), slack, tokens,
        lengths.new_full((ring,), ulysses - 1),
    )
    return ulysses_rank, group_doc | (local & split)


def _partition(
    docs: _Docs, members: Tensor, piles: _Piles, fair: Tensor, slack: int, capacity: Tensor | None,
    budget: Tensor,
) -> tuple[Tensor, Tensor]:
    """``(pile, split)``: the ``members`` of each segment dealt onto its piles, work then
    tokens evened out (steps 2a-c of the module's rule). ``fair``: a pile's share of the
    batch's work; ``capacity``: the tokens a pile may hold (None: an equal share of its
    segment's, poured again after a split); ``budget``: ``[segments]`` short documents each
    segment may split."""
    pile = _serpentine(piles.running(members.long()) - 1, piles.piles)
    split, slot = _split_work(docs, members, piles, pile, fair, slack)
    split = split & (~docs.short | _highest(split & docs.short, slot, docs.lengths, docs, piles, budget))
    budget = budget - piles.count(split & docs.short)
    pile, more = _even_tokens(docs, members & ~split, piles, pile, capacity, budget)
    return pile, split | more


def _even_tokens(docs: _Docs, members: Tensor, piles: _Piles, pile: Tensor, capacity: Tensor | None,
                 budget: Tensor) -> tuple[Tensor, Tensor]:
    """``(pile, split)``: the piles filled to the capacity (:func:`_fill`), splitting the
    straddlers that overflow their pile by more than 1 % (short ones within the ``budget``).

    With no capacity (an equal share), the room the split ones leave is poured again; but
    where the documents are too few or too long to fill it, the straddlers placed whole, or
    even the piles as dealt, pad less: of the three, the layout that pads least stands (the
    earlier on a tie)."""
    filled, straddles, crossed, minority, cap = _fill(docs, members, piles, pile, capacity)
    # a straddler placed whole makes its pile overflow by its smaller part: worth splitting
    # where that exceeds 1 % of a pile
    worth = straddles & (minority * 100 > cap)
    split = worth & (~docs.short | _highest(worth & docs.short, crossed, minority, docs, piles, budget))
    if capacity is not None:
        return filled, split
    refilled = _fill(docs, members & ~split, piles, filled, capacity)[0]
    none = torch.zeros_like(split)
    options = ((pile, none), (filled, none), (refilled, split))
    pads = torch.stack([
        _pads(piles.sums(docs.lengths * (members & ~cut), piles.slot(members, at)))
        for at, cut in options
    ])
    best = pads.argmin(0).index_select(0, piles.segment * members)
    pile = torch.where(best == 0, pile, torch.where(best == 1, filled, refilled))
    return pile, (best == 2) & split


def _split_work(docs: _Docs, members: Tensor, piles: _Piles, pile: Tensor, fair: Tensor,
                slack: int) -> tuple[Tensor, Tensor]:
    """``(split, slot)``: documents to split, at most one per pile, and the members' slots.
    A split document's work is shared by every pile of its segment. Where the lightest pile
    of a segment is more than twice the slack (a share of ``fair``) under the mean, every
    pile more than the slack above the lightest splits the document closest to that
    difference, and the piles then stand level (a count of heavy documents that does not
    divide by the piles). Otherwise a pile more than the slack above the mean splits the
    document closest to ``piles / (piles - 1)`` times its excess, which brings it back."""
    count = piles.piles
    slot = piles.slot(members, pile)
    pairs = docs.pairs * members
    work = piles.sums(pairs, slot)
    total = work.sum(1, keepdim=True)
    lightest = work.min(1, keepdim=True).values
    above = work - lightest
    low = (total - count * lightest) * slack > 2 * count * fair
    excess = count * work - total  # piles x (pile - mean)
    # what a split should take off the pile, times piles - 1 (0: the pile does not split)
    levels = (count - 1) * above * (above * slack > fair)
    target = torch.where(low, levels, excess * (excess * slack > count * fair))
    own = piles.read(target, slot)
    shed = (count - 1) * pairs
    eligible = (pairs > 0) & (shed < 2 * own)
    return _argmin_per_slot((shed - own).abs(), eligible, slot, piles.slots), slot


def _fill(docs: _Docs, members: Tensor, piles: _Piles, pile: Tensor, capacity: Tensor | None,
          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(pile, straddles, crossed, minority, cap)``: each pile keeps its longest documents up
    to the capacity (``None``: an equal share of its segment's tokens); the rest is poured
    into the room left, roomiest pile first, each document to the pile holding most of it.
    ``straddles``: the poured documents across the end of a pile's room (``crossed``: the flat
    index of that room, one straddler each), ``minority``: the part of each poured document
    outside its pile, ``cap``: the capacity of each document's pile."""
    segments, count, slots = piles.segments, piles.piles, piles.slots
    lengths = docs.lengths * members
    slot = piles.slot(members, pile)
    held = piles.sums(lengths, slot)
    if capacity is None:
        cap = ((held.sum(1, keepdim=True) + count - 1) // count).expand(segments, count)
    else:
        cap = capacity.expand(segments, count)
    # each pile's documents, longest first, while they fit
    order = docs.segment_order(slot, slots + 1)
    at = slot.index_select(0, order)
    before = torch.cumsum(held.reshape(-1), 0) - held.reshape(-1)
    inclusive = torch.cumsum(lengths.index_select(0, order), 0) - piles.read(before, at)
    kept = torch.empty_like(members).scatter_(0, order, inclusive <= piles.read(cap, at)) & members
    pool = members & ~kept
    room = cap - piles.sums(lengths * kept, slot)
    pour = torch.sort(room, dim=1, descending=True, stable=True).indices  # piles, roomiest first
    size = room.gather(1, pour).reshape(-1)
    ends = torch.cumsum(size, 0)  # where each room ends, segment after segment
    # the pool laid out segment after segment, each from where its rooms start: positions
    # that grow along ``piles.order``, so a few searches place the rooms' ends among them
    poured = lengths * pool
    first = torch.cat([ends.new_zeros(1), ends.view(segments, count)[:, -1]])[:segments]
    end = piles.running(poured) + first.index_select(0, piles.segment)
    start = end - poured
    most = _bounds_up_to(2 * ends, start + end, piles.order)  # the room holding a document's middle
    most = most.minimum(piles.segment * count + count - 1)
    crossed = _bounds_up_to(ends, start, piles.order)  # the room a document starts in
    room_end = ends.index_select(0, most)
    inside = (end.minimum(room_end) - start.maximum(room_end - size.index_select(0, most))).clamp(min=0)
    minority = poured - inside
    pile = torch.where(pool, pour.reshape(-1).index_select(0, most), pile)
    return pile, minority > 0, crossed, minority, piles.read(cap, piles.slot(members, pile))


def _bounds_up_to(bounds: Tensor, values: Tensor, order: Tensor) -> Tensor:
    """``searchsorted(bounds, values, right=True)``: how many of the ascending ``bounds`` are
    at most each value, for ``values`` that ascend along ``order``: the bounds are placed
    among the values (few searches) rather than each value among the bounds."""
    laid = values.index_select(0, order)
    reached = torch.searchsorted(laid, bounds)  # the first value of ``laid`` each bound is at most
    counted = values.new_zeros(values.numel() + 1).scatter_add_(0, reached, torch.ones_like(reached))
    return torch.empty_like(values).scatter_(0, order, torch.cumsum(counted, 0)[:-1])


def _pads(held: Tensor) -> Tensor:
    """``[segments]``: the pads that evening ``[segments, piles]`` held tokens to the fullest
    pile takes."""
    return held.shape[1] * held.max(1).values - held.sum(1)


def _highest(candidates: Tensor, slot: Tensor, priority: Tensor, docs: _Docs, piles: _Piles,
             budget: Tensor) -> Tensor:
    """The ``budget[segment]`` candidates of each segment of highest ``priority`` (a
    non-negative int below ``2**31``; ties: longest first). ``slot``: a flat slot of the
    segment's that no other candidate has."""
    n = priority.numel()
    key = torch.where(candidates, priority * n + (n - 1 - docs.rank), -1)  # distinct per document
    table = key.new_full((piles.slots + 1,), -1).scatter_(0, torch.where(candidates, slot, piles.slots), key)
    table = table[:-1].view(piles.segments, piles.piles)
    place = _inverse_rows(torch.sort(table, dim=1, descending=True, stable=True).indices)
    allowed = (table >= 0) & (place < budget[:, None])
    return candidates & piles.read(allowed, slot.clamp(max=piles.slots))


def _coarse(docs: _Docs, members: Tensor, piles: int) -> Tensor:
    """Members too long for the other members to even out ``piles`` piles around them: longer
    than 1 % of a pile, with fewer than ``(piles - 1) * L`` tokens in other members no longer
    than them that are not coarse themselves (three rounds towards that fixed point, each
    catching what the last one's coarse documents no longer cover)."""
    ascending = docs.order.flip(0)
    laid = docs.lengths.index_select(0, ascending)
    member = members.index_select(0, ascending)
    # the last of each run of equal lengths: documents of one length count for each other
    last = torch.cat([laid[1:] != laid[:-1], laid.new_ones(1, dtype=torch.bool)])
    position = torch.arange(laid.numel(), device=laid.device)
    run_end = torch.where(last, position, laid.numel()).flip(0).cummin(0).values.flip(0)
    long = member & (laid * 100 > (laid * member).sum() // piles)
    needed = (piles - 1) * laid
    coarse = torch.zeros_like(member)
    for _ in range(3):
        kept = laid * (member & ~coarse)
        coarse = long & (torch.cumsum(kept, 0).index_select(0, run_end) - kept < needed)
    return torch.empty_like(coarse).scatter_(0, ascending, coarse)


def _longest_to_split(docs: _Docs, coarse: Tensor, fine: Tensor, piles: int) -> Tensor:
    """Which of the ``coarse`` documents to split: the longest ``j`` of them, for the least
    ``j <= piles`` whose rest, dealt longest first in a serpentine and evened out by the
    ``fine`` tokens, pads at most 0.5 % of the batch more than the rest after any ``j``."""
    rank = docs.running(coarse.long()) - 1  # among the coarse, longest first
    lengths = docs.lengths * coarse
    # a serpentine deals position q onto pile q mod 2P or 2P - 1 - (q mod 2P): the rest after
    # the longest j puts on pile p the documents of rank = j + p and j + 2P - 1 - p mod 2P
    period = 2 * piles
    residue = lengths.new_zeros(period).scatter_add_(0, rank % period * coarse, lengths)
    first = lengths.new_zeros(piles + 1).scatter_add_(
        0, torch.where(coarse & (rank < piles), rank, piles), lengths
    )[:piles]  # the longest ``piles``, by rank
    j = torch.arange(piles + 1, device=rank.device)[:, None]
    before_j = torch.arange(period, device=rank.device) < j  # [j, residue]: ranks below j
    rest = residue - torch.where(before_j, torch.cat([first, first.new_zeros(piles)]), 0)
    p = torch.arange(piles, device=rank.device)
    held = rest.gather(1, (j + p) % period) + rest.gather(1, (j + period - 1 - p) % period)
    pads = (piles * held.max(1).values - held.sum(1) - fine).clamp(min=0)
    good = pads * 200 <= pads.min() * 200 + docs.total
    least = (torch.cumsum(good.long(), 0) == 0).sum()  # the first good j
    return coarse & (rank < least)


def _serpentine(rank: Tensor, piles: int) -> Tensor:
    """Deal items in order onto ``piles`` piles 0, 1, .., p-1, p-1, .., 0, 0, 1, ..."""
    lap, seat = rank // piles, rank % piles
    return torch.where(lap % 2 == 0, seat, piles - 1 - seat)


def _inverse_rows(order: Tensor) -> Tensor:
    """The inverse of each row's permutation."""
    seats = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, seats)


def _inverse(order: Tensor) -> Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def _running(values: Tensor, order: Tensor, group: Tensor | None = None, groups: int = 1) -> Tensor:
    """Running sums of ``values`` in ``order`` (itself included), restarting at each of the
    ``groups`` that ``order`` visits one after another."""
    laid = values.index_select(0, order)
    running = torch.cumsum(laid, 0)
    if group is not None and groups > 1:
        total = _slot_sum(group, values, groups + 1)
        running = running - (torch.cumsum(total, 0) - total).index_select(0, group.index_select(0, order))
    return torch.empty_like(running).scatter_(0, order, running)


def _slot_sum(slot: Tensor, values: Tensor, slots: int) -> Tensor:
    """Sum of ``values`` per slot below ``slots`` (slot ``slots`` collects the rest)."""
    return values.new_zeros(slots + 1).scatter_add(0, slot, values)[:slots]


def _argmin_per_slot(score: Tensor, eligible: Tensor, slot: Tensor, slots: int) -> Tensor:
    """The eligible document of lowest ``score`` in each slot (ties: lowest index)."""
    n = score.numel()
    big = torch.iinfo(torch.int64).max
    score = torch.where(eligible, score, big)
    target = torch.where(eligible, slot, slots)
    lowest = score.new_full((slots + 1,), big).scatter_reduce(0, target, score, "amin")
    hit = eligible & (score == lowest.index_select(0, target))
    index = torch.arange(n, device=score.device)
    first = index.new_full((slots + 1,), n).scatter_reduce(0, target, torch.where(hit, index, n), "amin")
    return hit & (index == first.index_select(0, target))
