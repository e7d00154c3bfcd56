"""kernels/window_pieces.py: a causal window by position cut into pieces masked by offsets,
checked pair by pair against the window applied to the positions themselves."""

from __future__ import annotations

import random

import pytest
import torch

from hcp_compile.batch.layout import StepKind, batch_layout, step_kind, step_segments, step_sources, stream_table, \
    stream_tokens
from hcp_compile.batch.placements import PLACEMENTS
from hcp_compile.kernels import BlockSpec, new_cache_key
from hcp_compile.kernels.window_pieces import PieceKind, position_runs, reversed_rows, window_pieces


def ring_step_blocks(lengths: tuple[int, ...], ring: int, window: int, ulysses: int = 1,
                     placement: str = "balanced") -> list[tuple[int, int, BlockSpec, int]]:
    """Every ring step of ``lengths`` laid out on ``ulysses`` x ``ring``: ``(rank, source, spec,
    key rows)``, the spec's window by position as the schedule passes it (a ring rank's
    exchange stream: its ring chunks, and its GROUP documents in the own step)."""
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    layout = batch_layout(cu, ulysses, ring, PLACEMENTS[placement])
    steps = []
    for rank in range(ring):
        own = stream_table(layout, rank)
        rows = int(own.widths.sum())
        for source in step_sources(rank, ring, ring):
            kv = own if source == rank else stream_table(layout, source, with_group=False)
            key_rows = rows if source == rank else int(layout.ring_width)
            kind = step_kind(rank, source, True)
            cu_q, cu_k = step_segments(own, kv, rank, source, ring, kind)
            spec = BlockSpec(cu_q, cu_k, max(lengths), max(lengths), kind is StepKind.DIAGONAL, 64 ** -0.5, window, 0,
                             stream_tokens(own, rank, ring, rows).position,
                             stream_tokens(kv, source, ring, key_rows).position, new_cache_key(),
                             equal_lengths=kind is StepKind.DIAGONAL)
            steps.append((rank, source, spec, key_rows))
    return steps


def true_mask(cu_q, cu_k, q_positions, k_positions, window):
    """[rows_q, rows_k] bool: same segment and 0 <= pos_q - pos_k <= window."""
    seg_q = torch.repeat_interleave(torch.arange(cu_q.numel() - 1), cu_q.diff())
    seg_k = torch.repeat_interleave(torch.arange(cu_k.numel() - 1), cu_k.diff())
    gap = q_positions[: int(cu_q[-1]), None] - k_positions[None, : int(cu_k[-1])]
    return (seg_q[:, None] == seg_k[None, :]) & (gap >= 0) & (gap <= window)


def piece_masks(pieces, rows_q, rows_k, window):
    """The pairs each piece's kernel call computes, as its mask says (bottom-right band,
    full, or the reversed causal block of a tail), summed over the pieces."""
    count = torch.zeros(rows_q, rows_k, dtype=torch.int64)
    for qs, nq, ks, nk, kind in zip(*(t.tolist() for t in (pieces.q_start, pieces.q_rows, pieces.k_start,
                                                             pieces.k_rows, pieces.kind))):
        i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        if kind == PieceKind.BAND:
            diagonal = i + nk - nq
            visible = (j <= diagonal) & (j >= diagonal - window)
            assert nk >= nq and visible.any(1).all()
        elif kind == PieceKind.FULL:
            visible = torch.ones(nq, nk, dtype=torch.bool)
        else:  # reversed rows and keys make a causal block aligned bottom-right
            visible = ((nq - 1 - i) + (nk - nq) >= (nk - 1 - j))
            assert nk >= nq
        count[qs:qs + nq, ks:ks + nk] += visible.long()
    return count


def check_pieces(cu_q, cu_k, q_positions, k_positions, window):
    pieces = window_pieces(cu_q, cu_k, q_positions, k_positions, window)
    expected = true_mask(cu_q, cu_k, q_positions, k_positions, window)
    got = piece_masks(pieces, int(cu_q[-1]), int(cu_k[-1]), window)
    assert (got <= 1).all(), "a pair computed twice"
    assert torch.equal(got.bool(), expected)
    for kind, layer in pieces.groups():  # one call's entries: disjoint and in order on both sides
        group = pieces.select(kind, layer)
        for start, rows in ((group.q_start, group.q_rows), (group.k_start, group.k_rows)):
            assert (start[1:] >= start[:-1] + rows[:-1]).all()
    return pieces


@pytest.mark.parametrize("ring", [2, 3, 4])
@pytest.mark.parametrize("window", [0, 3, 8, 30, 200])
def test_the_ring_steps_of_a_zigzag_layout_are_cut_exactly(ring, window):
    """Every ring step of a batch laid out on 1 x ring (documents shorter and longer than a
    chunk, padding): the pieces cover exactly the pairs the window allows, each once."""
    lengths = (1, 7, 40, 3, 97, 16, 64, 25)
    kinds = set()
    for _, _, spec, _ in ring_step_blocks(lengths, ring, window):
        pieces = check_pieces(spec.cu_q, spec.cu_k, spec.q_positions, spec.k_positions, window)
        kinds |= set(pieces.kind.tolist())
    # each kind of piece was met: no full piece without a window, no tail where it holds every document
    expected = {PieceKind.BAND} if window == 0 else {PieceKind.BAND, PieceKind.FULL}
    assert kinds == (expected if window == 0 or window >= max(lengths) else set(PieceKind))


def test_random_batches_on_random_meshes_are_cut_exactly():
    """Random batches on meshes with Ulysses groups (GROUP documents in the own step) and
    both placements."""
    rng = random.Random(1)
    for _ in range(25):
        lengths = tuple(rng.randint(1, 120) for _ in range(rng.randint(1, 9)))
        mesh = dict(ulysses=rng.choice([1, 2, 3]), ring=rng.choice([2, 3, 4]), placement=rng.choice(list(PLACEMENTS)))
        window = rng.choice([0, 1, 9, 33, 150])
        for _, _, spec, _ in ring_step_blocks(lengths, window=window, **mesh):
            check_pieces(spec.cu_q, spec.cu_k, spec.q_positions, spec.k_positions, window)


def test_random_runs_are_cut_exactly():
    """Segments whose rows are arbitrary runs of positions (up to four a side, gaps, overlaps
    and empty segments)."""
    rng = random.Random(0)
    for _ in range(60):
        lengths_q, lengths_k, q_positions, k_positions = [], [], [], []
        for _ in range(rng.randint(1, 4)):
            for lengths, positions in ((lengths_q, q_positions), (lengths_k, k_positions)):
                runs = [(rng.randint(0, 60), rng.randint(1, 12)) for _ in range(rng.randint(0, 4))]
                lengths.append(sum(n for _, n in runs))
                positions += [first + i for first, n in runs for i in range(n)]
        cu_q, cu_k = (torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0))
                      for lengths in (lengths_q, lengths_k))
        check_pieces(cu_q, cu_k, torch.tensor(q_positions, dtype=torch.long),
                     torch.tensor(k_positions, dtype=torch.long), rng.choice([0, 1, 5, 17, 100]))


def test_runs_break_at_segments_and_position_jumps():
    runs = position_runs(torch.tensor([0, 5, 5, 9]), torch.tensor([0, 1, 2, 7, 8, 3, 4, 5, 6]))
    assert runs.start.tolist() == [0, 3, 5] and runs.length.tolist() == [3, 2, 4]
    assert runs.segment.tolist() == [0, 0, 2] and runs.index.tolist() == [0, 1, 0]
    assert runs.position.tolist() == [0, 7, 3]


def test_reversed_rows_run_each_piece_backwards():
    assert reversed_rows(torch.tensor([10, 3]), torch.tensor([3, 2])).tolist() == [12, 11, 10, 4, 3]
