"""Property tests of the token layout (DESIGN §2), driving ``hcp_compile.layout`` directly:
each rank's tokens are computed the way ``ShardPlan`` does it (the ring rank's stream, sliced by
Ulysses rank), for every rank of the mesh, in one process."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_cases import cu_seqlens
from hcp_compile import layout

SETTINGS = settings(max_examples=50, deadline=None)
lengths_st = st.lists(st.integers(0, 40), min_size=1, max_size=10).map(tuple)
size_st = st.integers(1, 4)


@dataclass
class Layout:
    stream_length: int  # T_r
    streams: list[layout.StreamTokens]  # per ring rank
    local: list[torch.Tensor]  # global index per rank, in global rank order (ring, ulysses)


def build_layout(lengths: tuple[int, ...], ulysses: int, ring: int) -> Layout:
    cu = cu_seqlens(lengths)
    chunk_total = int(layout.chunk_sizes(torch.tensor(lengths), ring).sum())
    stream_length = layout.ring_stream_length(chunk_total, ring, ulysses)
    chunks = layout.doc_chunks(cu, ring, stream_length)
    streams = [layout.stream_tokens(chunks, r, ring, stream_length) for r in range(ring)]
    per_rank = stream_length // ulysses
    local = [s.global_index[a * per_rank:(a + 1) * per_rank] for s in streams for a in range(ulysses)]
    return Layout(stream_length, streams, local)


def design_rule_streams(lengths: tuple[int, ...], ulysses: int, ring: int) -> list[list[int]]:
    """DESIGN §2 as plain loops: each ring rank's stream of global indices (-1 for a pad)."""
    streams: list[list[int]] = [[] for _ in range(ring)]
    start = 0
    for length in lengths:
        c = -(-length // (2 * ring))
        padded = [start + p if p < length else -1 for p in range(2 * ring * c)]
        for r in range(ring):
            mirror = 2 * ring - 1 - r
            streams[r] += padded[r * c:(r + 1) * c] + padded[mirror * c:(mirror + 1) * c]
        start += length
    tail = next(e for e in range(0, 2 * ulysses + 1, 2) if (len(streams[0]) + e) % ulysses == 0)
    return [s + [-1] * tail for s in streams]


def causal_work(stream: layout.StreamTokens) -> int:
    """Causal (query, key) pairs of real tokens whose queries this ring rank holds."""
    return int((stream.position[stream.valid] + 1).sum())


@SETTINGS
@given(lengths_st, size_st, size_st)
def test_layout_follows_the_design_rule(lengths, ulysses, ring):
    built = build_layout(lengths, ulysses, ring)
    expected = design_rule_streams(lengths, ulysses, ring)
    assert [s.global_index.tolist() for s in built.streams] == expected


@SETTINGS
@given(lengths_st, size_st, size_st)
def test_every_real_token_lands_exactly_once(lengths, ulysses, ring):
    held = torch.cat(build_layout(lengths, ulysses, ring).local)
    assert sorted(held[held >= 0].tolist()) == list(range(sum(lengths)))


@SETTINGS
@given(lengths_st, size_st, size_st)
def test_every_rank_holds_the_same_token_count_and_ulysses_divides_the_stream(lengths, ulysses, ring):
    built = build_layout(lengths, ulysses, ring)
    assert {t.numel() for t in built.local} == {built.stream_length // ulysses}
    assert built.stream_length % ulysses == 0
    assert all(s.global_index.numel() == built.stream_length for s in built.streams)


@SETTINGS
@given(lengths_st, size_st, size_st, st.integers(1, 3))
def test_shard_then_unshard_is_identity(lengths, ulysses, ring, features):
    x = torch.arange(sum(lengths) * features, dtype=torch.float32).reshape(-1, features)
    back = torch.full_like(x, float("nan"))
    for index in build_layout(lengths, ulysses, ring).local:
        shard = x[index.clamp(min=0)]  # what plan.shard does, pads aside
        back[index[index >= 0]] = shard[index >= 0]
    assert torch.equal(back, x)


@SETTINGS
@given(lengths_st, size_st, size_st)
def test_real_tokens_of_each_document_are_an_increasing_prefix_of_its_stream_part(lengths, ulysses, ring):
    for stream in build_layout(lengths, ulysses, ring).streams:
        for doc in stream.doc.unique().tolist():
            part = stream.doc == doc
            valid, position = stream.valid[part], stream.position[part]
            real = int(valid.sum())
            assert valid[:real].all() and not valid[real:].any()
            assert (position[1:] > position[:-1]).all()


@st.composite
def lengths_multiple_of_2r(draw):
    ring = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 6).map(lambda m: 2 * ring * m), min_size=1, max_size=8))
    return tuple(lengths), ring


@SETTINGS
@given(lengths_multiple_of_2r(), size_st)
def test_causal_work_is_equal_when_lengths_are_multiples_of_2r(lengths_and_ring, ulysses):
    lengths, ring = lengths_and_ring
    work = {causal_work(s) for s in build_layout(lengths, ulysses, ring).streams}
    assert len(work) == 1, f"causal work per ring rank differs: {work}"


@SETTINGS
@given(lengths_st, size_st, size_st)
def test_causal_work_imbalance_is_bounded_by_the_padding(lengths, ulysses, ring):
    """With padding to P_i, every ring rank would do the same work; a pad at position p only
    removes the p + 1 pairs of its query, so the imbalance is at most the pads' pairs."""
    work = [causal_work(s) for s in build_layout(lengths, ulysses, ring).streams]
    padded = [-(-n // (2 * ring)) * 2 * ring for n in lengths]
    bound = sum(sum(p + 1 for p in range(n, pn)) for n, pn in zip(lengths, padded))
    assert max(work) - min(work) <= bound
    assert sum(work) == sum(n * (n + 1) // 2 for n in lengths)
