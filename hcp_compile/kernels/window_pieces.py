"""A causal window by position cut into pieces that a kernel masking by offsets can run
(docs/design.md §8.8): pure host-side tensor math, no kernel calls.

Note [a window by position as pieces]
A ring step under a sliding window pairs the rows of one document that a rank holds with the
keys another rank holds; row ``i`` sees key ``j`` where ``0 <= pos_q(i) - pos_k(j) <= W``. A
segment's rows are runs of consecutive positions (the zigzag chunks a rank holds), so every
pair of a query run and a key run (starting at positions ``qa`` and ``ka``, ``d = qa - ka``)
is one band, ``i + d - W <= j <= i + d`` in the runs' own offsets. Its rows fall in three
consecutive ranges by where their band lies against the run's ``nk`` keys:

    keys ->  0 . . . . nk-1
    rows     ◣                  BAND: the diagonal inside the keys (i + d <= nk - 1): a causal
             ■◣                       window aligned bottom-right on the keys that end there
             ■■◣                      (a square, aligned top-left, where d = 0: a chunk's own)
             ■■■■■■■            FULL: every key inside the window (i + d - W <= 0)
              ◥■■■■■            TAIL: only the keys from i + d - W on: the mirror image of a
                ◥■■■                  causal block; its rows and keys copied in reverse order
                                      make one, with more keys than queries

A band and a full range run in place, on the rows and keys where they lie, as ragged entries
of one call per kind and *layer*: layer ``l`` holds the pairs of a segment's ``a``-th query run
and ``(a + l)``-th key run, so its pieces' rows and keys never overlap and are in order (a
rank's own chunks, ``l = 0``, make one call). The tails of a layer run as one causal block over
reversed copies of their rows and keys, merged by lse into the rows they came from (their
gradients added back). ``W`` is the window's left size (``window_size[0]``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor


class PieceKind(IntEnum):
    BAND = 0
    FULL = 1
    TAIL = 2


@dataclass(frozen=True)
class Runs:
    """Runs of consecutive positions inside the segments of one side (``[n]`` int64 each)."""

    start: Tensor  # first row
    length: Tensor
    segment: Tensor
    position: Tensor  # position of the first row
    index: Tensor  # the run's index among its segment's runs


def position_runs(cu: Tensor, positions: Tensor) -> Runs:
    """The runs of ``positions`` (one per row) inside the segments ``cu``: a run breaks at a
    segment's start and wherever a position is not one more than the row's before."""
    cu, positions = cu.long(), positions.long()
    rows = int(cu[-1])
    lengths = cu.diff()
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=rows)
    starts_segment = torch.zeros(rows, dtype=torch.bool)
    starts_segment[cu[:-1][lengths > 0]] = True
    breaks = starts_segment.clone()
    breaks[1:] |= positions[1:rows] != positions[: max(rows - 1, 0)] + 1
    start = breaks.nonzero().flatten()
    run_number = torch.arange(start.numel())
    first_run = torch.cummax(torch.where(starts_segment[start], run_number, 0), 0).values if rows else run_number
    return Runs(start, torch.diff(start, append=torch.tensor([rows])), segment[start], positions[start],
                run_number - first_run)


@dataclass(frozen=True)
class Pieces:
    """Query rows against key rows that one kernel call masks by offsets (``[p]`` int64 each):
    a BAND is a causal window of ``W`` aligned bottom-right, a FULL piece unmasked, a TAIL the
    keys from ``i + d - W`` on for row ``i`` (run in reverse: Note [a window by position as
    pieces])."""

    q_start: Tensor
    q_rows: Tensor
    k_start: Tensor
    k_rows: Tensor
    kind: Tensor
    layer: Tensor

    def select(self, kind: PieceKind, layer: int) -> "Pieces":
        chosen = (self.kind == kind) & (self.layer == layer)
        return Pieces(*(getattr(self, name)[chosen] for name in
                        ("q_start", "q_rows", "k_start", "k_rows", "kind", "layer")))

    def groups(self) -> list[tuple[PieceKind, int]]:
        """The (kind, layer) groups that hold pieces, each one call's worth."""
        pairs = torch.stack([self.kind, self.layer], 1).unique(dim=0).tolist()
        return [(PieceKind(kind), layer) for kind, layer in pairs]


def window_pieces(cu_q: Tensor, cu_k: Tensor, q_positions: Tensor, k_positions: Tensor, window: int) -> Pieces:
    """The pieces of a causal block whose query segment ``s`` attends to key segment ``s``
    where ``0 <= pos_q - pos_k <= window`` (host tensors)."""
    q, k = position_runs(cu_q, q_positions), position_runs(cu_k, k_positions)
    segments = cu_q.numel() - 1
    k_runs = torch.bincount(k.segment, minlength=segments)
    k_first = torch.cumsum(k_runs, 0) - k_runs
    per_q_run = k_runs[q.segment]
    pair_q = torch.repeat_interleave(torch.arange(q.start.numel()), per_q_run)
    within = torch.arange(pair_q.numel()) - (torch.cumsum(per_q_run, 0) - per_q_run)[pair_q]
    pair_k = k_first[q.segment[pair_q]] + within
    layer = k.index[pair_k] - q.index[pair_q]
    d = q.position[pair_q] - k.position[pair_k]
    nq, nk = q.length[pair_q], k.length[pair_k]
    seen_from = (-d).clamp(min=0)  # rows before it come before every key
    seen_to = torch.minimum(nq, nk + window - d).maximum(seen_from)  # rows from here see no key
    band_to = torch.minimum(seen_to, nk - d).maximum(seen_from)
    full_to = torch.minimum(seen_to, window - d + 1).maximum(band_to)
    ranges = {
        PieceKind.BAND: (seen_from, band_to, (seen_from + d - window).clamp(min=0), band_to + d),
        PieceKind.FULL: (band_to, full_to, torch.zeros_like(d), nk),
        PieceKind.TAIL: (full_to, seen_to, full_to + d - window, nk),
    }
    parts = []
    for kind, (first, stop, key_first, key_stop) in ranges.items():
        keep = stop > first
        parts.append((q.start[pair_q] + first, stop - first, k.start[pair_k] + key_first, key_stop - key_first,
                      torch.full_like(d, int(kind)), layer, keep))
    columns = [torch.cat([part[c][part[-1]] for part in parts]) for c in range(6)]
    return Pieces(*columns)


def reversed_rows(starts: Tensor, counts: Tensor) -> Tensor:
    """The rows ``start + count - 1`` down to ``start`` of every piece, pieces in order."""
    total = int(counts.sum())
    piece = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=total)
    offset = torch.arange(total) - (torch.cumsum(counts, 0) - counts)[piece]
    return starts[piece] + counts[piece] - 1 - offset
