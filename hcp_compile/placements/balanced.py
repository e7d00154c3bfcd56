"""``placement="balanced"`` (the default): short documents stay whole on one rank, only the
documents that would unbalance the ranks are split (docs/design.md §2.2).

The rule, all of it tensor ops over the documents (sorts, cumulative sums, scatters), so the
shard plan on the host and a compiled graph on the device derive the same placement:

1. *Lumpy* documents are split: a document holding more than ``balance_tolerance`` of a
   rank's share of the causal work (pairs, ``~L^2``) cannot be balanced by whole-document
   placement. Short documents (at most ``short_fraction`` of a rank's tokens) never count as
   lumpy. A lumpy document goes round the ring when one ring rank (a Ulysses group) could not
   absorb it within the tolerance, when there is no Ulysses group to spread it over, or when it
   is long enough that its ring transfers hide under its own attention
   (:meth:`CostModel.ring_hides_transfers`); otherwise it is spread over one Ulysses group.
2. The other documents are dealt to the ring ranks longest first in a serpentine (which
   evens out both tokens and work), laid out pile after pile and cut into ``R`` equal token
   ranges; a document crossing a cut goes round the ring (at most one per cut), unless it is
   short: then it goes whole to the side that holds most of it, so a batch of short documents
   never crosses the ring.
3. Inside each ring rank the documents that are not spread are dealt to the ``A`` Ulysses
   ranks the same way and stay whole there (``LOCAL``); a rank's documents beyond its token
   count ``T`` (at most the shortest few of its pile) are spread over the group instead.
4. The documents at the ring cuts leave their ring ranks short by up to their length, which
   every rank pads; when that exceeds ``max_pad_fraction`` of the tokens and the zigzag
   rule pads less, the batch takes the zigzag rule instead (never worse than it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..layout import Assignment, Kind


@dataclass(frozen=True)
class CostModel:
    """What the rule weighs. The defaults describe H200s with bf16 GQA attention (32 query and
    8 key/value heads of 128) and a ring that crosses nodes."""

    # share of a rank's causal work one document may hold: half the 5 % the ranks may differ
    # by, so that dealing whole documents stays inside it
    balance_tolerance: float = 0.025
    short_fraction: float = 1 / 8  # documents up to this share of a rank's tokens stay whole
    max_pad_fraction: float = 0.02  # more pads than this: fall back to zigzag if it pads less
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


def balanced(lengths: Tensor, ulysses: int, ring: int, cost: CostModel = DEFAULT_COST) -> Assignment:
    ranks = ulysses * ring
    total = lengths.sum()
    work = lengths * lengths
    total_work = work.sum()
    tolerance = round(1 / cost.balance_tolerance)  # compare in integers: work * ranks * 40 > total
    short = lengths * ranks * round(1 / cost.short_fraction) <= total
    lumpy = ~short & (work * ranks * tolerance > total_work)
    no = torch.zeros_like(lumpy)
    if ring > 1:
        group_cannot_absorb = work * ring * tolerance > total_work
        ring_doc = lumpy & (group_cannot_absorb | (ulysses == 1) | cost.ring_hides_transfers(lengths, ring))
    else:
        ring_doc = no
    spread = lumpy & ~ring_doc & (ulysses > 1)

    ring_rank, crossing = _cut_into_ring_ranks(lengths, ~ring_doc, short, ring)
    ring_doc = ring_doc | crossing
    kept = ~ring_doc
    ring_width = 2 * torch.where(ring_doc, (lengths + 2 * ring - 1) // (2 * ring), 0).sum()
    per_ring_rank = ring_width + lengths.new_zeros(ring).scatter_add(
        0, torch.where(kept, ring_rank, 0), torch.where(kept, lengths, 0)
    )
    tokens = (per_ring_rank.max() + ulysses - 1) // ulysses
    candidates = kept & ~spread
    ulysses_rank, fits = _deal_to_ulysses_ranks(lengths, candidates, ring_rank, ulysses, ring, tokens)
    group_doc = kept & (spread | ~fits)
    kind = torch.where(ring_doc, int(Kind.RING), torch.where(group_doc, int(Kind.GROUP), int(Kind.LOCAL)))
    zigzag_tokens = (2 * ((lengths + 2 * ring - 1) // (2 * ring)).sum() + ulysses - 1) // ulysses
    padded = (tokens * ranks - total) * round(1 / cost.max_pad_fraction) > total
    kind = torch.where(padded & (zigzag_tokens < tokens), int(Kind.RING), kind)
    return Assignment(kind.to(torch.int64), ring_rank, ulysses_rank)


def _longest_first(lengths: Tensor, members: Tensor) -> Tensor:
    """Each document's rank in a longest-first order of ``members`` (ties by index;
    non-members after every member)."""
    key = torch.where(members, lengths, -1)
    order = torch.sort(key, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def _serpentine(rank: Tensor, piles: int) -> Tensor:
    """Deal items in order onto ``piles`` piles 0, 1, .., p-1, p-1, .., 0, 0, 1, ..."""
    lap, seat = rank // piles, rank % piles
    return torch.where(lap % 2 == 0, seat, piles - 1 - seat)


def _cut_into_ring_ranks(
    lengths: Tensor, members: Tensor, short: Tensor, ring: int
) -> tuple[Tensor, Tensor]:
    """``(ring_rank, crossing)`` of the ``members``: dealt onto ``ring`` piles, each pile laid
    out shortest at both ends and longest in the middle (so that a cut near a pile's end meets a
    short document), the piles one after another, cut into ``ring`` equal token ranges. A
    document across a cut is ``crossing`` unless it is ``short``."""
    n = lengths.numel()
    rank = _longest_first(lengths, members)
    pile, lap = _serpentine(rank, ring), rank // ring
    # even laps ascend to the middle of the pile (shortest first), odd laps descend from it
    within = torch.where(lap % 2 == 0, n - lap, n + 1 + lap)
    key = torch.where(members, pile * (2 * n + 2) + within, ring * (2 * n + 2) + rank)
    order = torch.argsort(key)
    laid = torch.where(members, lengths, 0).index_select(0, order)
    end = torch.empty_like(laid).scatter_(0, order, torch.cumsum(laid, 0))
    start = end - torch.where(members, lengths, 0)
    cuts = torch.arange(1, ring, device=lengths.device) * laid.sum() // ring
    crossing = members & ~short & ((start[:, None] < cuts) & (cuts < end[:, None])).any(1)
    # a short document across a cut goes whole to the side holding most of it
    return torch.searchsorted(2 * cuts, start + end, right=True), crossing


def _deal_to_ulysses_ranks(
    lengths: Tensor, members: Tensor, ring_rank: Tensor, ulysses: int, ring: int, tokens: Tensor,
) -> tuple[Tensor, Tensor]:
    """``(ulysses_rank, fits)``: the ``members`` of each ring rank dealt longest first onto its
    ``ulysses`` ranks in a serpentine; ``fits`` is False for the documents beyond a rank's
    ``tokens`` (the shortest of its pile)."""
    n = lengths.numel()
    rank = _longest_first(lengths, members)
    group = torch.where(members, ring_rank, ring)
    within_ring = _rank_within(group, rank, ring + 1)
    ulysses_rank = _serpentine(within_ring, ulysses)
    slot = torch.where(members, ring_rank * ulysses + ulysses_rank, ring * ulysses)
    order = torch.argsort(slot * n + rank)
    laid = torch.where(members, lengths, 0).index_select(0, order)
    running = torch.cumsum(laid, 0)
    slot_sorted = slot.index_select(0, order)
    slot_total = lengths.new_zeros(ring * ulysses + 1).scatter_add(0, slot_sorted, laid)
    slot_before = torch.cumsum(slot_total, 0) - slot_total
    inclusive = running - slot_before.index_select(0, slot_sorted)
    fits = torch.empty_like(members).scatter_(0, order, inclusive <= tokens)
    return ulysses_rank, fits


def _rank_within(group: Tensor, rank: Tensor, groups: int) -> Tensor:
    """Each item's rank inside its group, in the order of ``rank``."""
    n = rank.numel()
    order = torch.argsort(group * n + rank)
    counts = torch.zeros(groups, dtype=rank.dtype, device=rank.device).scatter_add(
        0, group, torch.ones_like(group)
    )
    first = torch.cumsum(counts, 0) - counts
    position = torch.arange(n, device=rank.device) - first.index_select(0, group.index_select(0, order))
    return torch.empty_like(position).scatter_(0, order, position)
