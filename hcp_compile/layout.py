"""Token layout of hierarchical context parallelism: pure tensor math, no collectives.

The rule (DESIGN §2), for ``R`` ring ranks and ``A`` Ulysses ranks:

1. Document ``i`` of real length ``L_i`` is padded at its end to ``P_i = roundup(L_i, 2R)``
   and cut into ``2R`` chunks of ``c_i = P_i / 2R`` tokens.
2. Ring rank ``r`` takes chunks ``r`` and ``2R-1-r`` of every document, document by document
   (the zigzag pairing that balances causal work). After the documents comes a pad-only tail
   (its own segment) so that the ring stream length ``T_r`` is divisible by ``A``.
3. Ulysses rank ``a`` of ring rank ``r`` holds the contiguous slice ``a`` of that stream.

Every function here is vectorized over documents and traceable: shapes depend only on the
number of documents and on the stream length, never on the values of ``cu_seqlens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor


@dataclass(frozen=True)
class DocChunks:
    """Per-document real lengths and chunk sizes, with the pad-only tail as a last pseudo-doc."""

    starts: Tensor  # [n+1] int64: global offset of each document (the tail starts at the end)
    lengths: Tensor  # [n+1] int64: real tokens per document (0 for the tail)
    chunk: Tensor  # [n+1] int64: c_i = ceil(L_i / 2R) (0 for the tail)
    widths: Tensor  # [n+1] int64: tokens each ring rank holds of the document (2 c_i, or the tail)


def chunk_sizes(lengths: Tensor, ring: int) -> Tensor:
    """``c_i = ceil(L_i / 2R)``: the zigzag chunk size of each document."""
    return (lengths + 2 * ring - 1) // (2 * ring)


def ring_stream_length(chunk_total: int | Tensor, ring: int, ulysses: int) -> int | Tensor:
    """``T_r``: tokens of one ring rank's stream, the documents' ``2 * sum(c_i)`` plus the
    smallest even tail that makes it divisible by ``ulysses`` (an int, or a tensor for a
    tensor ``chunk_total``)."""
    period = ulysses // math.gcd(ulysses, 2)
    tail_half = (-chunk_total) % period
    return 2 * (chunk_total + tail_half)


def stream_length_for(cu_seqlens: Tensor, ring: int, ulysses: int) -> int:
    """``T_r`` of the batch ``cu_seqlens`` (host values) on a ``ulysses x ring`` mesh."""
    chunk_total = int(chunk_sizes(cu_seqlens[1:] - cu_seqlens[:-1], ring).sum())
    return ring_stream_length(chunk_total, ring, ulysses)


def doc_chunks(cu_seqlens: Tensor, ring: int, stream_length: int | torch.SymInt) -> DocChunks:
    """Chunk table of ``cu_seqlens`` for a ring stream of ``stream_length`` tokens."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    chunk = chunk_sizes(lengths, ring)
    tail = (stream_length - 2 * chunk.sum()).reshape(1)
    zero = torch.zeros_like(tail)
    return DocChunks(
        starts=cu,
        lengths=torch.cat([lengths, zero]),
        chunk=torch.cat([chunk, zero]),
        widths=torch.cat([2 * chunk, tail]),
    )


@dataclass(frozen=True)
class StreamTokens:
    """Where each token of one ring rank's stream comes from."""

    doc: Tensor  # [T_r] int64: document index (n for the tail)
    position: Tensor  # [T_r] int64: position inside the padded document
    valid: Tensor  # [T_r] bool: a real token (not padding)
    global_index: Tensor  # [T_r] int64: index into the global packed tokens, -1 for padding


def stream_tokens(
    chunks: DocChunks, ring_rank: int, ring: int, stream_length: int | torch.SymInt
) -> StreamTokens:
    """The tokens of ring rank ``ring_rank``'s stream, in stream order."""
    n_segments = chunks.widths.numel()
    device = chunks.widths.device
    doc = torch.repeat_interleave(
        torch.arange(n_segments, device=device), chunks.widths, output_size=stream_length
    )
    seg_start = torch.cumsum(chunks.widths, 0) - chunks.widths
    offset = torch.arange(stream_length, device=device) - seg_start.index_select(0, doc)
    c = chunks.chunk.index_select(0, doc)
    first_half = offset < c
    position = torch.where(
        first_half, ring_rank * c + offset, (2 * ring - 1 - ring_rank) * c + offset - c
    )
    valid = position < chunks.lengths.index_select(0, doc)
    global_index = torch.where(valid, chunks.starts.index_select(0, doc) + position, -1)
    return StreamTokens(doc=doc, position=position, valid=valid, global_index=global_index)


@dataclass(frozen=True)
class RankLayout:
    """One rank's share of a batch, and how to reassemble the batch from all shares."""

    stream_length: int  # T_r
    local_tokens: int  # T_r / A, on every rank
    tokens: StreamTokens  # this rank's local tokens
    unshard_index: Tensor  # [num_tokens]: row of each global token in the gathered shards


def rank_layout(
    cu_seqlens: Tensor, ring: int, ulysses: int, ring_rank: int, ulysses_rank: int
) -> RankLayout:
    """The layout of rank ``(ring_rank, ulysses_rank)``; shards are gathered ring rank major,
    Ulysses rank minor, which concatenates every ring stream in order."""
    stream_length = stream_length_for(cu_seqlens, ring, ulysses)
    local_tokens = stream_length // ulysses
    chunks = doc_chunks(cu_seqlens, ring, stream_length)
    streams = [stream_tokens(chunks, r, ring, stream_length) for r in range(ring)]
    gathered = torch.cat([s.global_index for s in streams])
    # pads (-1) scatter into one extra slot that is cut off afterwards
    slot = torch.where(gathered >= 0, gathered, cu_seqlens[-1])
    unshard_index = torch.empty(int(cu_seqlens[-1]) + 1, dtype=torch.int64, device=slot.device)
    unshard_index.scatter_(0, slot, torch.arange(gathered.numel(), device=slot.device))
    unshard_index = unshard_index[:-1]
    mine = slice(ulysses_rank * local_tokens, (ulysses_rank + 1) * local_tokens)
    stream = streams[ring_rank]
    local = StreamTokens(
        doc=stream.doc[mine], position=stream.position[mine], valid=stream.valid[mine],
        global_index=stream.global_index[mine],
    )
    return RankLayout(stream_length, local_tokens, local, unshard_index)


def chunk_real(chunks: DocChunks, chunk_index: int) -> Tensor:
    """Real tokens of each document in its chunk ``chunk_index`` (padding sits at the end)."""
    return (chunks.lengths - chunk_index * chunks.chunk).clamp(min=0).minimum(chunks.chunk)


def real_tokens_held(chunks: DocChunks, ring_rank: int, ring: int) -> Tensor:
    """Real tokens of each document in ring rank ``ring_rank``'s stream (a prefix of its part)."""
    return chunk_real(chunks, ring_rank) + chunk_real(chunks, 2 * ring - 1 - ring_rank)


class StepKind(Enum):
    """Which block of the causal zigzag schedule one ring step computes (DESIGN §3)."""

    DIAGONAL = "diagonal"  # local Q x local KV, causal inside each document
    LOWER = "lower"  # all Q x the first chunk of each KV document (src < r)
    UPPER = "upper"  # the second chunk of each Q document x all KV (src > r)
    FULL = "full"  # non-causal: all Q x all KV


def step_kind(ring_rank: int, source: int, causal: bool) -> StepKind:
    if not causal:
        return StepKind.FULL
    if source == ring_rank:
        return StepKind.DIAGONAL
    return StepKind.LOWER if source < ring_rank else StepKind.UPPER


def step_segments(
    chunks: DocChunks, ring_rank: int, source: int, ring: int, kind: StepKind
) -> tuple[Tensor, Tensor]:
    """``(cu_seqlens_q, cu_seqlens_k)`` (int32) of one ring step over the two local streams.

    Every document becomes four aligned segments on both sides: ``a`` (queries that take no
    part in this step, matched with no keys), ``b`` (real queries x the real keys the step
    should see), ``c`` (pad queries x no keys) and ``d`` (no queries x pad keys). Any varlen
    kernel then computes exactly the step's block without gathering rows, and its contract
    (rows with no visible key give 0 and lse = -inf) leaves pad rows at zero with no masking.
    """
    widths = chunks.widths
    zero = torch.zeros_like(widths)
    q_skip = chunks.chunk if kind is StepKind.UPPER else zero
    if kind is StepKind.UPPER:  # only the second chunk of each query document takes part
        q_real = chunk_real(chunks, 2 * ring - 1 - ring_rank)
    else:
        q_real = real_tokens_held(chunks, ring_rank, ring)
    if kind is StepKind.LOWER:  # only the first chunk of each key document takes part
        k_real = chunk_real(chunks, source)
    else:
        k_real = real_tokens_held(chunks, source, ring)
    q_parts = (q_skip, q_real, widths - q_skip - q_real, zero)
    k_parts = (zero, k_real, zero, widths - k_real)
    return _cumulative(q_parts), _cumulative(k_parts)


def _cumulative(parts: tuple[Tensor, ...]) -> Tensor:
    lengths = torch.stack(parts, dim=1).reshape(-1)
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


def step_max_seqlen(max_seqlen: int | torch.SymInt, ring: int, ulysses: int) -> int | torch.SymInt:
    """Upper bound of any segment length in a ring step (documents' ``2 c_i`` or the tail);
    ``torch.sym_max`` keeps a symbolic ``max_seqlen`` free of guards."""
    return torch.sym_max(2 * (-(-max_seqlen // (2 * ring))), max(2 * ulysses, 1))


def step_sees_any_key(
    chunks: DocChunks, ring_rank: int, source: int, ring: int, kind: StepKind,
    window_left: int, window_right: int,
) -> Tensor:
    """Whether any real query of ring rank ``ring_rank`` sees any real key of ``source`` in
    this step under the sliding window (a 0-d bool tensor). Used to skip steps wholly outside
    the window."""
    inf = torch.iinfo(torch.int64).max // 4
    left = window_left if window_left >= 0 else inf
    right = 0 if kind is not StepKind.FULL else (window_right if window_right >= 0 else inf)

    def intervals(chunk_indices: tuple[int, ...]) -> list[tuple[Tensor, Tensor]]:
        # real positions [start, stop) of each chunk, per document
        return [
            (i * chunks.chunk, i * chunks.chunk + chunk_real(chunks, i)) for i in chunk_indices
        ]

    both = (ring_rank, 2 * ring - 1 - ring_rank)
    q_chunks = (2 * ring - 1 - ring_rank,) if kind is StepKind.UPPER else both
    k_both = (source, 2 * ring - 1 - source)
    k_chunks = (source,) if kind is StepKind.LOWER else k_both
    seen = torch.zeros((), dtype=torch.bool, device=chunks.lengths.device)
    for q_start, q_stop in intervals(q_chunks):
        for k_start, k_stop in intervals(k_chunks):
            nonempty = (q_stop > q_start) & (k_stop > k_start)
            # q - k over the pair of intervals spans [q_start - (k_stop - 1), (q_stop - 1) - k_start]
            low = q_start - (k_stop - 1)
            high = (q_stop - 1) - k_start
            overlaps = (high >= -right) & (low <= left)
            seen = seen | (nonempty & overlaps).any()
    return seen
