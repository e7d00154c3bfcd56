"""A layout balanced for a sliding window (``shard_plan(..., window=)``, docs/design.md §2.2):
pure layout math in one process, no process group. Its ranks' windowed work is even on the
benchmark's windowed batches, every token is held once, and the ring steps that the turned
zigzag gives (``BatchLayout.turn``) still compute every causal pair of every document exactly
once, which the window's skipped steps respect."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.speed_workloads import workloads
from benchmarks.work_split import rank_work
from cp_cases import cu_seqlens
from hcp_compile import InputError
from hcp_compile.batch import layout
from hcp_compile.batch.layout import Kind, StepKind
from hcp_compile.batch.placements import NO_WINDOW, PLACEMENTS, check_layout_window
from hcp_compile.batch.prepared import BatchValues, MeshShape, PreparedBatch, prepare_batch
from hcp_compile.exchange.agreement import fingerprint

SETTINGS = settings(max_examples=30, deadline=None)
lengths_st = st.lists(st.integers(0, 60), min_size=1, max_size=8).map(tuple)
MESHES = ((2, 1), (1, 2), (1, 8), (2, 4))


def laid_out(lengths: tuple[int, ...], ulysses: int, ring: int, placement: str, window: int) -> layout.BatchLayout:
    return layout.batch_layout(cu_seqlens(lengths), ulysses, ring, PLACEMENTS[placement], window)


def shares(work: torch.Tensor) -> torch.Tensor:
    work = work.double().flatten()
    return work / work.mean()


# --------------------------------------------------------------------------------------------
# balance
# --------------------------------------------------------------------------------------------

# the most any rank's windowed work strays from the mean, per batch and mesh
WITHIN = {(name, mesh): 0.03 for name in ("W4-128K", "W4-1M") for mesh in MESHES}


@pytest.mark.parametrize("name, mesh", sorted(WITHIN), ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_balanced_evens_the_windowed_work_of_the_benchmark_batches(name, mesh):
    """Laid out for its window, every rank's windowed work within the bound of the mean and
    pads under 5 %, with no more documents cut (round the ring or over a Ulysses group) than
    the causal layout cuts (docs/benchmarks.md)."""
    workload = workloads()[name]
    ulysses, ring = mesh
    batch = laid_out(workload.lengths, ulysses, ring, "balanced", workload.window_left)
    work = shares(layout.attention_work(batch, window=workload.window_left))
    within = WITHIN[name, mesh]
    assert (work - 1).abs().max() <= within, f"{name} on {ulysses}x{ring}: {work.tolist()}"
    tokens = int(batch.local_tokens) * ulysses * ring
    assert 1 - sum(workload.lengths) / tokens < 0.05
    plain = laid_out(workload.lengths, ulysses, ring, "balanced", -1)
    assert int((batch.kind != Kind.LOCAL).sum()) <= int((plain.kind != Kind.LOCAL).sum())


# documents cut on each mesh, laid out for the window: (round the ring, over a Ulysses group),
# against the causal layout's (21, 0) on 1 x 8 and 2 x 4
WHOLE_UNDER_THE_WINDOW = {(1, 2): (0, 0), (2, 1): (0, 0), (1, 8): (5, 0), (2, 4): (0, 2)}


@pytest.mark.parametrize("mesh", sorted(WHOLE_UNDER_THE_WINDOW), ids=lambda mesh: "x".join(map(str, mesh)))
def test_under_a_window_documents_stay_whole_where_the_work_stays_even(mesh):
    """A window's work grows with a document's length, not its square: laid out for it, the
    1M-token batch keeps documents of up to half a rank's tokens whole (no window pieces, no
    exchange), where the causal layout sends every long one round the ring, and its ranks'
    windowed work stays within 2 % of the mean (``CostModel.window_balance``)."""
    workload = workloads()["W4-1M"]
    batch = laid_out(workload.lengths, *mesh, "balanced", workload.window_left)
    cut = (int((batch.kind == Kind.RING).sum()), int((batch.kind == Kind.GROUP).sum()))
    assert cut == WHOLE_UNDER_THE_WINDOW[mesh]
    work = shares(layout.attention_work(batch, window=workload.window_left))
    assert (work - 1).abs().max() <= 0.02
    half = sum(workload.lengths) / (2 * mesh[0] * mesh[1])
    assert all(length <= half for length in batch.lengths[batch.kind == Kind.LOCAL].tolist())


def test_under_a_window_the_rule_falls_back_to_cutting_by_work_where_whole_documents_stray():
    """Where no share of whole documents keeps the work within the bound, the rule cuts the
    heavy documents by work as without a window (W4-128K on 2 x 2: 9 round the ring)."""
    workload = workloads()["W4-128K"]
    batch = laid_out(workload.lengths, 2, 2, "balanced", workload.window_left)
    work = shares(layout.attention_work(batch, window=workload.window_left))
    assert (work - 1).abs().max() <= layout.ADJACENT_WORK_STRAY
    assert int((batch.kind == Kind.RING).sum()) == 9


@pytest.mark.parametrize("ulysses, ring", [(1, 2), (2, 2), (1, 4), (2, 3)])
def test_zigzag_under_a_window_turns_the_light_chunks_round_the_ring(ulysses, ring):
    """Every document round the ring: the turns give each ring rank the same windowed work
    within a few percent, where the plain zigzag gives ring rank 0 every light first chunk."""
    lengths = (4000, 3000, 2500, 2000, 1800, 1500, 1200, 1000) * 2
    batch = laid_out(lengths, ulysses, ring, "zigzag", 256)
    plain = laid_out(lengths, ulysses, ring, "zigzag", -1)
    assert (shares(layout.attention_work(batch, window=256)) - 1).abs().max() < 0.02
    assert (shares(layout.attention_work(plain, window=256)) - 1).abs().max() > 0.02


@pytest.mark.parametrize("ulysses, ring", [(1, 2), (2, 2), (1, 3), (2, 4)])
@pytest.mark.parametrize("window", [0, 3, 17])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_attention_work_counts_the_windowed_pairs_of_the_held_tokens(ulysses, ring, window, placement):
    """``layout.attention_work(..., window=)`` is the count from the tokens each rank holds
    (benchmarks.work_split), turned zigzag included."""
    lengths = (0, 1, 7, 3, 130, 0, 2, 61, 29, 300, 5, 90, 44)
    values = BatchValues.of(cu_seqlens(lengths))
    prepared = PreparedBatch(values, MeshShape(ulysses, ring, placement, (window, 0)),
                             laid_out(lengths, ulysses, ring, placement, window))
    counted = torch.tensor(rank_work(prepared, window), dtype=torch.float64)
    work = layout.attention_work(prepared.layout, window=window).double().flatten()
    torch.testing.assert_close(work, counted)


# --------------------------------------------------------------------------------------------
# every token once, every causal pair once
# --------------------------------------------------------------------------------------------

def stream(batch: layout.BatchLayout, ring_rank: int, with_group: bool = True) -> tuple[layout.StreamTable, layout.StreamTokens]:
    table = layout.stream_table(batch, ring_rank, with_group)
    return table, layout.stream_tokens(table, ring_rank, batch.ring, int(table.widths.sum()))


@SETTINGS
@given(lengths=lengths_st, ulysses=st.integers(1, 3), ring=st.integers(1, 4), window=st.integers(0, 9),
       placement=st.sampled_from(sorted(PLACEMENTS)))
def test_every_token_is_held_once_and_ring_ranks_hold_turned_chunk_pairs(lengths, ulysses, ring, window, placement):
    batch = laid_out(lengths, ulysses, ring, placement, window)
    held = []
    for r in range(ring):
        for a in range(ulysses):
            sizes = layout.rank_sizes(layout.rank_size_values(batch, r, a).tolist(), a, ulysses)
            tokens = layout.rank_tokens(batch, sizes, r)
            held += tokens.global_index[tokens.valid].tolist()
            assert sizes.tokens == int(batch.local_tokens)
        _, tokens = stream(batch, r, with_group=False)
        for doc in torch.nonzero(batch.kind == Kind.RING).flatten().tolist():
            c, length = int(batch.chunk[doc]), int(batch.lengths[doc])
            q = (r - int(batch.turn[doc])) % ring
            chunks = (2 * q, 2 * q + 1) if batch.adjacent else (q, 2 * ring - 1 - q)
            expected = [p for i in chunks for p in range(i * c, (i + 1) * c) if p < length]
            assert tokens.position[tokens.doc == doc].tolist() == expected
    assert sorted(held) == list(range(sum(lengths)))


def step_pairs(batch: layout.BatchLayout, ring_rank: int, source: int) -> set[tuple[int, int, int]]:
    """``(document, query position, key position)`` of every pair the step's segments compute:
    the own step causal inside each segment (by offsets: its queries and keys are the same
    rows), the others whole blocks."""
    q_table, q_tokens = stream(batch, ring_rank)
    k_table, k_tokens = stream(batch, source, with_group=source == ring_rank)
    kind = layout.step_kind(ring_rank, source, causal=True)
    cu_q, cu_k = layout.step_segments(q_table, k_table, ring_rank, source, batch.ring, kind)
    pairs = []
    for i in range(cu_q.numel() - 1):
        for qi in range(int(cu_q[i]), int(cu_q[i + 1])):
            for kj in range(int(cu_k[i]), int(cu_k[i + 1])):
                if kind is StepKind.DIAGONAL and qi - int(cu_q[i]) < kj - int(cu_k[i]):
                    continue
                assert q_tokens.valid[qi] and k_tokens.valid[kj], "a pad in a segment with keys"
                assert q_tokens.doc[qi] == k_tokens.doc[kj], "a pair across documents"
                pairs.append((int(q_tokens.doc[qi]), int(q_tokens.position[qi]), int(k_tokens.position[kj])))
    assert len(pairs) == len(set(pairs)), "a pair computed twice in one step"
    return set(pairs)


@SETTINGS
@given(lengths=lengths_st, ring=st.integers(2, 4), window=st.integers(0, 12),
       placement=st.sampled_from(sorted(PLACEMENTS)))
def test_the_ring_steps_of_a_turned_layout_compute_every_causal_pair_once(lengths, ring, window, placement):
    """Over its ring rank's steps, every query of a RING or GROUP document sees each earlier
    key of its document exactly once, whichever chunks the turn gave the ranks and however
    they pair; a step the window lets the schedule skip (``step_sees_any_key``) holds no pair
    inside the window, nor any step past those the window needs (``window_steps``)."""
    batch = laid_out(lengths, 1, ring, placement, window)
    needed = layout.window_steps(batch, window)
    seen: list[tuple[int, int, int]] = []
    for r in range(ring):
        own, _ = stream(batch, r)
        for step, source in enumerate(layout.step_sources(r, ring, ring)):
            pairs = step_pairs(batch, r, source)
            seen += pairs
            inside = any(q - k <= window for _, q, k in pairs)
            assert step < needed or not inside, (r, step, needed)
            if source != r:
                kind = layout.step_kind(r, source, causal=True)
                sees = bool(layout.step_sees_any_key(own, layout.stream_table(batch, source, False), r, source,
                                                     ring, kind, window, 0))
                assert sees == inside, (r, source)
    exchanged = (batch.kind != Kind.LOCAL).tolist()
    expected = [(d, q, k) for d, length in enumerate(lengths) if exchanged[d] for q in range(length) for k in range(q + 1)]
    assert sorted(seen) == expected


# --------------------------------------------------------------------------------------------
# the window as the layout's name
# --------------------------------------------------------------------------------------------

def test_the_layout_window_is_part_of_the_batch_name():
    """A batch laid out for a window is another prepared batch (key, fingerprint, description)
    than without; ``right`` changes nothing under causal attention and is dropped."""
    cu = cu_seqlens((40, 3, 33, 5, 29))
    plain = prepare_batch(cu, ulysses=1, ring=2)
    windowed = prepare_batch(cu, ulysses=1, ring=2, layout_window=(6, 3))
    assert windowed.mesh == MeshShape(1, 2, "balanced", (6, 0)) and plain.mesh.window == NO_WINDOW
    assert windowed.key != plain.key
    digest = windowed.batch.digest
    assert fingerprint(digest, windowed.mesh, False, "ring") != fingerprint(digest, plain.mesh, False, "ring")
    assert windowed.mesh.describe().endswith("for window=(6, 0)")
    assert plain.mesh.describe() == "ulysses=1 x ring=2 with placement='balanced'"
    assert check_layout_window((-1, 7)) == NO_WINDOW
    assert not torch.equal(windowed.tokens(0, 0).global_index, plain.tokens(0, 0).global_index)


@pytest.mark.parametrize("window", [(-2, 0), (4,), "4096", (4.0, 0), (True, 0)])
def test_a_bad_layout_window_is_refused_naming_the_argument(window):
    with pytest.raises(InputError, match=r"^window: expected \(left, right\) ints >= -1"):
        check_layout_window(window)
    with pytest.raises(InputError, match=r"^layout_window: expected \(left, right\) ints >= -1"):
        prepare_batch(cu_seqlens((4, 5)), ulysses=1, ring=2, layout_window=window)
