"""Property tests of the token layout and the placement rules (docs/design.md §2), driving
``hcp_compile.layout`` directly for every rank of a mesh in one process."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_cases import cu_seqlens
from hcp_compile import layout, schedule
from hcp_compile.placements import PLACEMENTS

SETTINGS = settings(max_examples=40, deadline=None)
lengths_st = st.lists(st.integers(0, 40), min_size=1, max_size=10).map(tuple)
size_st = st.integers(1, 4)
placement_st = st.sampled_from(sorted(PLACEMENTS))


@dataclass
class Ranks:
    """Every rank's tokens, in global rank order (ring rank major)."""

    batch: layout.BatchLayout
    sizes: list[layout.RankSizes]
    tokens: list[layout.StreamTokens]
    streams: list[layout.StreamTokens]  # the exchange stream of each ring rank


def build(lengths: tuple[int, ...], ulysses: int, ring: int, placement: str) -> Ranks:
    batch = layout.batch_layout(cu_seqlens(lengths), ulysses, ring, PLACEMENTS[placement])
    sizes = [
        layout.rank_sizes(layout.rank_size_values(batch, r, a).tolist(), a, batch.ulysses)
        for r in range(ring) for a in range(ulysses)
    ]
    tokens = [layout.rank_tokens(batch, s, i // ulysses) for i, s in enumerate(sizes)]
    streams = [
        layout.stream_tokens(layout.stream_table(batch, r), r, ring, sizes[r * ulysses].stream)
        for r in range(ring)
    ]
    return Ranks(batch, sizes, tokens, streams)


def rank_work(ranks: Ranks, ulysses: int) -> list[float]:
    """Causal pairs per rank counted from the tokens themselves: a query at position p sees
    p + 1 keys; a rank computes its local region's queries with all heads and 1/A of its ring
    rank's exchange stream."""
    work = []
    for index, (tokens, sizes) in enumerate(zip(ranks.tokens, ranks.sizes)):
        local = tokens.position[: sizes.local][tokens.valid[: sizes.local]]
        stream = ranks.streams[index // ulysses]
        shared = stream.position[stream.valid]
        work.append(float((local + 1).sum()) + float((shared + 1).sum()) / ulysses)
    return work


def pad_fraction(ranks: Ranks, lengths: tuple[int, ...]) -> float:
    held = sum(t.doc.numel() for t in ranks.tokens)
    return (held - sum(lengths)) / max(sum(lengths), 1)


def imbalance(work: list[float]) -> float:
    mean = sum(work) / len(work)
    return max(work) / mean - 1 if mean else 0.0


@SETTINGS
@given(lengths_st, size_st, size_st, placement_st)
def test_every_rank_holds_the_same_token_count(lengths, ulysses, ring, placement):
    ranks = build(lengths, ulysses, ring, placement)
    counts = {t.doc.numel() for t in ranks.tokens} | {s.tokens for s in ranks.sizes}
    assert counts == {int(ranks.batch.local_tokens)}


@SETTINGS
@given(lengths_st, size_st, size_st, placement_st, st.integers(1, 3))
def test_shard_then_unshard_is_identity(lengths, ulysses, ring, placement, features):
    x = torch.arange(sum(lengths) * features, dtype=torch.float32).reshape(-1, features)
    back = torch.full_like(x, float("nan"))
    seen = torch.zeros(sum(lengths), dtype=torch.int64)
    for tokens in build(lengths, ulysses, ring, placement).tokens:
        index = tokens.global_index
        shard = x[index.clamp(min=0)]  # what plan.shard does, pads aside
        back[index[index >= 0]] = shard[index >= 0]
        seen.index_add_(0, index[index >= 0], torch.ones_like(index[index >= 0]))
    assert torch.equal(back, x)
    assert (seen == 1).all(), "a real token is held by no rank or by several"


@SETTINGS
@given(lengths_st, size_st, size_st, placement_st)
def test_positions_and_valid_describe_the_held_tokens(lengths, ulysses, ring, placement):
    cu = cu_seqlens(lengths).long()
    for tokens in build(lengths, ulysses, ring, placement).tokens:
        index, valid = tokens.global_index, tokens.valid
        assert torch.equal(valid, index >= 0)
        doc = torch.searchsorted(cu[1:], index.clamp(min=0), right=True)
        assert torch.equal(tokens.position, torch.where(valid, index - cu[doc], 0))
        assert torch.equal(tokens.doc, torch.where(valid, doc, -1))


@SETTINGS
@given(lengths_st, size_st, size_st, placement_st)
def test_exchange_stream_is_the_exchange_regions_in_ulysses_order(lengths, ulysses, ring, placement):
    ranks = build(lengths, ulysses, ring, placement)
    for r in range(ring):
        regions = [
            t.global_index[s.local : s.local + s.own_exchange]
            for t, s in zip(ranks.tokens[r * ulysses:(r + 1) * ulysses],
                            ranks.sizes[r * ulysses:(r + 1) * ulysses])
        ]
        assert torch.equal(torch.cat(regions), ranks.streams[r].global_index)


def design_rule_streams(lengths: tuple[int, ...], ring: int) -> list[list[int]]:
    """The zigzag rule as plain loops: each ring rank's stream of global indices (-1 for a pad)."""
    streams: list[list[int]] = [[] for _ in range(ring)]
    start = 0
    for length in lengths:
        c = -(-length // (2 * ring))
        padded = [start + p if p < length else -1 for p in range(2 * ring * c)]
        for r in range(ring):
            mirror = 2 * ring - 1 - r
            streams[r] += padded[r * c:(r + 1) * c] + padded[mirror * c:(mirror + 1) * c]
        start += length
    return streams


@SETTINGS
@given(lengths_st, size_st, size_st)
def test_zigzag_follows_the_design_rule_sliced_by_ulysses_rank(lengths, ulysses, ring):
    ranks = build(lengths, ulysses, ring, "zigzag")
    for r, expected in enumerate(design_rule_streams(lengths, ring)):
        held = torch.cat([t.global_index for t in ranks.tokens[r * ulysses:(r + 1) * ulysses]])
        assert held[: len(expected)].tolist() == expected
        assert (held[len(expected):] == -1).all()


@SETTINGS
@given(lengths_st, size_st, size_st, placement_st)
def test_attention_work_counts_the_pairs_of_the_held_queries(lengths, ulysses, ring, placement):
    ranks = build(lengths, ulysses, ring, placement)
    counted = torch.tensor(rank_work(ranks, ulysses), dtype=torch.float64)
    computed = layout.attention_work(ranks.batch).reshape(-1).double()
    torch.testing.assert_close(computed, counted)
    assert math.isclose(float(counted.sum()), sum(n * (n + 1) // 2 for n in lengths))


@SETTINGS
@given(lengths_st, size_st, size_st, placement_st)
def test_placement_is_deterministic(lengths, ulysses, ring, placement):
    first = layout.batch_layout(cu_seqlens(lengths), ulysses, ring, PLACEMENTS[placement])
    again = layout.batch_layout(cu_seqlens(lengths), ulysses, ring, PLACEMENTS[placement])
    for name in ("kind", "ring_rank", "ulysses_rank", "local_extent", "exchange_extent"):
        assert torch.equal(getattr(first, name), getattr(again, name))


@SETTINGS
@given(lengths_st, size_st, size_st)
def test_balanced_keeps_short_documents_whole_but_one_per_rank(lengths, ulysses, ring):
    """Documents of at most 1/8 of a rank's tokens are LOCAL, except at most one per rank
    that is cut at a rank boundary (or all, when the batch falls back to zigzag)."""
    batch = layout.batch_layout(cu_seqlens(lengths), ulysses, ring, PLACEMENTS["balanced"])
    if bool((batch.kind == layout.Kind.RING).all()):
        return  # the zigzag fallback
    short = batch.lengths * ulysses * ring * 8 <= sum(lengths)
    moved = short & (batch.kind != layout.Kind.LOCAL) & (batch.lengths > 0)
    assert int(moved.sum()) <= ulysses * ring


def packed_batches() -> dict[str, tuple[int, ...]]:
    """The batches of the GPU benchmark (131 072 tokens), drawn the same way."""
    generator = torch.Generator().manual_seed(0)
    short = torch.randint(128, 2049, (202,), generator=generator)
    log_uniform = torch.empty(25).uniform_(math.log(256), math.log(32768), generator=generator)
    return {
        "one-document": (131072,),
        "log-uniform": tuple(torch.exp(log_uniform).long().tolist()),
        "short": tuple(short.tolist()),
    }


BIG_MESHES = ((2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (8, 1), (4, 2), (2, 4), (8, 4))


@pytest.mark.parametrize("mesh", BIG_MESHES, ids=lambda m: f"u{m[0]}xr{m[1]}")
@pytest.mark.parametrize("name", sorted(packed_batches()))
def test_balanced_balances_work_and_tokens_on_the_benchmark_batches(name, mesh):
    lengths = packed_batches()[name]
    balanced = build(lengths, *mesh, "balanced")
    zigzag = build(lengths, *mesh, "zigzag")
    assert pad_fraction(balanced, lengths) < 0.02
    assert imbalance(rank_work(balanced, mesh[0])) < 0.05
    assert pad_fraction(balanced, lengths) <= max(pad_fraction(zigzag, lengths), 0.02)
    if not bool((balanced.batch.kind == layout.Kind.RING).all()):  # else: the zigzag fallback
        short = balanced.batch.lengths * mesh[0] * mesh[1] * 8 <= sum(lengths)
        moved = short & (balanced.batch.kind != layout.Kind.LOCAL)
        assert int(moved.sum()) <= mesh[0] * mesh[1], "short documents must stay whole"


@st.composite
def realistic_batch(draw):
    """A mesh and a packed training batch for it: 16 to 40 documents per rank, of log-uniform
    length 32..8192."""
    mesh = draw(st.sampled_from(BIG_MESHES))
    count = draw(st.integers(16, 40)) * mesh[0] * mesh[1]
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    logs = torch.empty(count).uniform_(math.log(32), math.log(8192), generator=generator)
    return tuple(torch.exp(logs).long().tolist()), mesh


@settings(max_examples=25, deadline=None)
@given(realistic_batch())
def test_balanced_is_balanced_on_random_batches_and_never_worse_than_zigzag(batch_and_mesh):
    """Pads under 2 % or no more than zigzag's; work within 5 % of the mean, or within the
    heaviest document kept whole (short documents are never split, and one may hold a fifth of
    a rank's pairs: dealing whole documents then misses 5 % in about 0.4 % of these batches,
    by up to 5.8 % in 1 551 of them), or no worse than zigzag."""
    lengths, mesh = batch_and_mesh
    balanced = build(lengths, *mesh, "balanced")
    zigzag = build(lengths, *mesh, "zigzag")
    pads = pad_fraction(balanced, lengths)
    assert pads < 0.02 or pads <= pad_fraction(zigzag, lengths)
    work = rank_work(balanced, mesh[0])
    whole = [n for n, kind in zip(lengths, balanced.batch.kind.tolist()) if kind == layout.Kind.LOCAL]
    heaviest_whole = max((n * (n + 1) / 2 for n in whole), default=0.0) / (sum(work) / len(work))
    assert imbalance(work) < max(0.05, heaviest_whole) or imbalance(work) <= imbalance(rank_work(zigzag, mesh[0]))


@SETTINGS
@given(lengths=lengths_st, ulysses=size_st, ring=size_st, placement=placement_st,
       causal=st.booleans(), windowed=st.booleans())
def test_schedule_tables_travel_flat_and_come_back_unchanged(lengths, ulysses, ring, placement, causal, windowed):
    """What a compiled graph gets from the host (``hcp::schedule_tables``): every rank's
    tables flattened into one tensor per dtype, in the lengths its sizes predict, split back
    into the same tables."""
    ranks = build(lengths, ulysses, ring, placement)
    for index, sizes in enumerate(ranks.sizes):
        ring_rank = index // ulysses
        tables = schedule.schedule_tables(ranks.batch, sizes, ring_rank, ring, causal=causal, windowed=windowed)
        flat = tables.flat()
        table_lengths, position_lengths = schedule.ScheduleTables.lengths(sizes, ring, windowed)
        assert (flat[0].dtype, flat[1].dtype) == (torch.int32, torch.int64)
        assert (flat[0].numel(), flat[1].numel()) == (sum(table_lengths), sum(position_lengths))
        back = schedule.ScheduleTables.unflat(*flat, sizes, ring, windowed)
        for name in ("local_cu", "cu_q", "cu_k", "q_positions", "k_positions"):
            got, expected = getattr(back, name), getattr(tables, name)
            got, expected = (x if isinstance(x, tuple) else (x,) for x in (got, expected))
            assert len(got) == len(expected), name
            for a, b in zip(got, expected):
                assert (a is None and b is None) or torch.equal(a, b), name
