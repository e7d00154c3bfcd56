"""Property tests of the token layout and the placement rules (docs/design.md §2), driving
``hcp_compile.batch.layout`` directly for every rank of a mesh in one process, and what the
balanced rule promises through ``shard_plan`` on meshes up to 8 x 8 of torch's fake process
group (no collective runs, so one process stands for every rank)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hcp_compile.testing.worlds import fake_world

import hcp_compile as hc
from cp_cases import cu_seqlens
from hcp_compile.batch import layout, schedule
from hcp_compile.batch.placements import PLACEMENTS

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


# --------------------------------------------------------------------------------------------
# the balanced rule's promise (docs/design.md §2.2), read from shard_plan
# --------------------------------------------------------------------------------------------

def balanced_plan(lengths: tuple[int, ...], ulysses: int, ring: int) -> hc.ShardPlan:
    with fake_world(ulysses, ring) as mesh:
        return hc.shard_plan(cu_seqlens(lengths), mesh)


def assert_short_documents_stay_whole(plan: hc.ShardPlan, lengths: tuple[int, ...], ranks: int) -> None:
    """Every document of at most 1/8 of a rank's tokens is "local" (whole on one rank, all
    heads) but at most one per rank, which may straddle a rank boundary: cut between the
    Ulysses ranks of its ring rank ("group") or over the ring ("ring")."""
    assert len(plan.document_placement) == len(lengths)
    assert set(plan.document_placement) <= {"local", "group", "ring"}
    short = [i for i, n in enumerate(lengths) if n * ranks * 8 <= sum(lengths)]
    straddling = [(lengths[i], plan.document_placement[i]) for i in short
                  if plan.document_placement[i] != "local"]
    assert len(straddling) <= ranks, f"{len(straddling)} of {len(short)} short documents split: {straddling}"


def assert_balanced(plan: hc.ShardPlan, lengths: tuple[int, ...], ranks: int, pads: float = 0.05,
                    within: float = 0.10, above: float = 0.05) -> None:
    """Pads under ``pads`` of the tokens; every rank's causal work within ``within`` of the
    mean, and no rank more than ``above`` over it."""
    padded = (plan.local_tokens * ranks - sum(lengths)) / sum(lengths)
    assert padded < pads, f"pads: {padded:.2%} of the tokens"
    work = layout.attention_work(plan.layout).reshape(-1).double()
    highest, lowest = float(work.max()) / float(work.mean()), float(work.min()) / float(work.mean())
    assert highest <= 1 + above, f"work: a rank {highest - 1:.2%} over the mean"
    assert lowest >= 1 - within, f"work: a rank {1 - lowest:.2%} under the mean"


def fill(candidates: torch.Tensor, total: int) -> tuple[int, ...]:
    """The first of ``candidates`` (lengths) that hold ``total`` tokens, the last one cut."""
    ends = torch.cumsum(candidates, 0)
    count = int(torch.searchsorted(ends, total)) + 1
    assert count <= candidates.numel(), "draw more candidates"
    lengths = candidates[:count].clone()
    lengths[-1] -= int(ends[count - 1]) - total
    return tuple(lengths.tolist())


BATCH_KINDS = ("log-uniform 256..32K", "log-uniform 32..8K", "short", "tiny", "one huge", "equal", "mixed",
               "few heavy")


def random_batch(kind: str, ranks: int, per_rank: int, seed: int) -> tuple[int, ...]:
    """A packed batch of about ``ranks * per_rank`` tokens whose documents are drawn the
    ``kind`` way (0- and 1-token documents among "tiny", "one huge", "mixed" and "few
    heavy")."""
    generator = torch.Generator().manual_seed(seed)
    total = ranks * per_rank

    def uniform(count: int, low: float, high: float) -> torch.Tensor:
        return torch.empty(count).uniform_(low, high, generator=generator)

    def integers(count: int, low: int, high: int) -> torch.Tensor:  # [low, high]
        return torch.randint(low, high + 1, (count,), generator=generator)

    def log_uniform(count: int, low: float, high: float) -> torch.Tensor:
        return torch.exp(uniform(count, math.log(low), math.log(high))).long()

    if kind == "log-uniform 256..32K":
        return fill(log_uniform(total // 256 + 1, 256, 32768), total)
    if kind == "log-uniform 32..8K":
        return fill(log_uniform(total // 32 + 1, 32, 8192), total)
    if kind == "short":  # each at most 1/8 of a rank's tokens
        return fill(integers(total + 1, 1, per_rank // 8), total)
    if kind == "tiny":
        return fill(integers(total, 0, 13), total)
    if kind == "one huge":  # a quarter to nine tenths of the batch, then small documents
        huge = int(total * float(uniform(1, 0.25, 0.9)))
        sizes = torch.stack([torch.zeros(total, dtype=torch.int64), torch.ones(total, dtype=torch.int64),
                             integers(total, 1, 64), integers(total, 64, 2048)])
        small = sizes.gather(0, integers(total, 0, 3)[None]).squeeze(0)
        return fill(torch.cat([torch.tensor([huge]), small]), total)
    if kind == "equal":  # 8 to 12 documents per rank, all of one length
        count = int(integers(1, 8 * ranks, 12 * ranks))
        return (total // count,) * count
    if kind == "mixed":  # a tenth 0- or 1-token, the rest log-uniform up to a rank's tokens
        drawn = log_uniform(total, 1, per_rank)
        return fill(torch.where(uniform(total, 0, 1) < 0.1, integers(total, 0, 1), drawn), total)
    if kind == "few heavy":  # R + 1 to 2R - 1 documents of 1/8 of a rank among 0..13-token ones
        heavy = (per_rank // 8,) * int(integers(1, ranks + 1, 2 * ranks - 1))
        return heavy + fill(integers(total, 0, 13), total - sum(heavy))
    raise ValueError(kind)


@st.composite
def batches(draw, ranks: int, per_rank: tuple[int, ...] = (4096, 16384)) -> tuple[int, ...]:
    kind = draw(st.sampled_from(BATCH_KINDS))
    return random_batch(kind, ranks, draw(st.sampled_from(per_rank)), draw(st.integers(0, 2**32 - 1)))


def mesh_id(mesh: tuple[int, int]) -> str:
    return f"{mesh[0]}x{mesh[1]}"


PLANNED_MESHES = ((1, 4), (1, 8), (2, 4), (4, 2), (8, 1))


@pytest.mark.parametrize("mesh", PLANNED_MESHES, ids=mesh_id)
@pytest.mark.parametrize("kind", BATCH_KINDS)
def test_balanced_keeps_short_documents_whole_and_balances_seeded_batches(kind, mesh):
    """Every kind of batch, 4 096 and 16 384 tokens per rank (hypothesis draws others below)."""
    ulysses, ring = mesh
    for per_rank in (4096, 16384):
        lengths = random_batch(kind, ulysses * ring, per_rank, seed=0)
        plan = balanced_plan(lengths, ulysses, ring)
        assert_short_documents_stay_whole(plan, lengths, ulysses * ring)
        assert_balanced(plan, lengths, ulysses * ring)


@pytest.mark.parametrize("mesh", PLANNED_MESHES, ids=mesh_id)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_balanced_keeps_short_documents_whole_and_balances_random_batches(mesh, data):
    ulysses, ring = mesh
    lengths = data.draw(batches(ulysses * ring), label="lengths")
    plan = balanced_plan(lengths, ulysses, ring)
    assert_short_documents_stay_whole(plan, lengths, ulysses * ring)
    assert_balanced(plan, lengths, ulysses * ring)


@settings(max_examples=5, deadline=None)
@given(lengths=batches(64, per_rank=(4096,)))
def test_balanced_keeps_short_documents_whole_and_balances_random_batches_on_8x8(lengths):
    plan = balanced_plan(lengths, 8, 8)
    assert_short_documents_stay_whole(plan, lengths, 64)
    assert_balanced(plan, lengths, 64)


def test_balanced_places_straddlers_whole_where_splitting_them_pads_more():
    """27 documents on 1 x 8, too few and too long to pour again into the room that split
    straddlers leave: the layout that pads least stands (splitting the straddlers and
    pouring again would pad 5.1 %)."""
    lengths = random_batch("log-uniform 32..8K", 8, 4096, seed=124)
    plan = balanced_plan(lengths, 1, 8)
    assert_short_documents_stay_whole(plan, lengths, 8)
    assert_balanced(plan, lengths, 8, pads=0.02)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(0, 3), st.integers(0, 60), st.integers(0, 5000)),
                        min_size=1, max_size=40).map(tuple),
       ulysses=st.sampled_from((1, 2, 3, 4, 8)), ring=st.sampled_from((1, 2, 3, 4, 8)))
def test_balanced_keeps_short_documents_whole_in_any_batch(lengths, ulysses, ring):
    """Tiny batches too (where pads and work cannot be even)."""
    assert_short_documents_stay_whole(balanced_plan(lengths, ulysses, ring), lengths, ulysses * ring)


# benchmarks.common.log_uniform_lengths(131072, 256, 32768, seed=27): 19 documents, one of
# 30 420 tokens, eleven of at most 1/8 of a rank's tokens on 4 ranks
SPARSE = (30420, 387, 3406, 743, 911, 12247, 705, 2322, 518, 762, 9321, 1036, 6226, 21044, 7179,
          3894, 20957, 864, 8130)


@pytest.mark.parametrize("mesh", ((1, 4), (2, 2), (4, 1), (1, 8)), ids=mesh_id)
def test_balanced_keeps_the_short_documents_of_a_sparse_batch_home(mesh):
    """A batch whose longest document holds more work than a rank's share: the rule once
    sent all of it round the ring on 1 x 4 (its whole-batch zigzag fallback); now the short
    documents stay whole but one per rank, and the long ones are split around them."""
    ulysses, ring = mesh
    plan = balanced_plan(SPARSE, ulysses, ring)
    assert_short_documents_stay_whole(plan, SPARSE, ulysses * ring)
    assert_balanced(plan, SPARSE, ulysses * ring, pads=0.02, above=0.02)


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


@pytest.mark.parametrize("mesh", BIG_MESHES, ids=mesh_id)
@pytest.mark.parametrize("name", sorted(packed_batches()))
def test_balanced_balances_work_and_tokens_on_the_benchmark_batches(name, mesh):
    """Pads under 1 % and work within 3 % of the mean; the 202 short documents all whole on
    one rank each up to 8 ranks."""
    lengths = packed_batches()[name]
    ulysses, ring = mesh
    plan = balanced_plan(lengths, ulysses, ring)
    assert_short_documents_stay_whole(plan, lengths, ulysses * ring)
    assert_balanced(plan, lengths, ulysses * ring, pads=0.01, within=0.03, above=0.03)
    if name == "short" and ulysses * ring <= 8:
        assert set(plan.document_placement) == {"local"}


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
        segments = layout.rank_segments(ranks.batch, sizes, ring_rank, causal, (8, 0) if windowed else (-1, -1), ring)
        windowed = segments.windowed  # positions only on a ring of several ranks
        tables = schedule.ScheduleTables(segments.local_cu, segments.cu_q, segments.cu_k, segments.q_positions,
                                         segments.k_positions, segments.gather_rows)
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
