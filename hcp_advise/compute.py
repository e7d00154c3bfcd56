"""The compute part: each block's visible query-key pairs on each rank, from the real layout, at
the throughput measured for the block's composition."""

from __future__ import annotations

import torch
from torch import Tensor

from hcp_compile.batch import layout
from hcp_compile.batch.layout import BatchLayout, Kind
from hcp_compile.batch.schedule import head_groups, rank_kv_heads
from hcp_compile.batch.traffic import CallShape
from hcp_compile.kernels import KERNELS, measured

from .measurements import KernelTable
from .records import BlockWork, ComputeTimes, FLOPS_PER_PAIR_HEAD_DIM, FORWARD_SHARE, OneGpuCall


def block_composition(segments: int, longest: int, windowed: bool = False) -> str | None:
    """The measured composition a block is timed by; None for a block without segments.
    Unlike ``measured.composition`` (which judges a whole batch), a block whose longest
    segment is short is short whatever its segment count: ``longest`` is the causal document
    whose work its longest segment has (:func:`block_work`). ``windowed``: a sliding window
    masks part of the block (some document of it is longer than the window)."""
    if segments == 0:
        return None
    if windowed:
        return measured.WINDOW
    if longest < measured.SHORT_DOCUMENT_ROWS:
        return measured.SHORT
    return measured.composition(False, segments, longest)


def cuts_short_segments(kernel: str) -> bool:
    """Whether ``kernel`` runs short segments in a varlen kernel of its own (its optional
    ``short_segment_rows``, :class:`hcp_compile.kernels.contract.Kernel`; the dense kernel hands
    them to flash): then a ring step's segments of a document cut into chunks shorter than that
    run at the short documents' speed whatever their queries."""
    return getattr(KERNELS.get(kernel), "short_segment_rows", 0) > 0


def visible_pairs(q0: Tensor, nq: Tensor, k0: Tensor, nk: Tensor, window: int = -1) -> Tensor:
    """The query-key pairs with ``0 <= q - k <= window`` (``window`` -1: causal, unbounded) of
    queries at positions ``[q0, q0 + nq)`` and keys at ``[k0, k0 + nk)`` of one document,
    elementwise over int64 tensors, exactly (closed forms, no enumeration)."""
    reach = (q0 + nq) if window < 0 else torch.full_like(q0, window)  # unbounded: past every key
    return _pairs_within(q0, nq, k0, nk, reach) - _pairs_within(q0, nq, k0, nk, torch.full_like(q0, -1))


def _pairs_within(q0: Tensor, nq: Tensor, k0: Tensor, nk: Tensor, d: Tensor) -> Tensor:
    """Pairs with ``q - k <= d``: a query ``q`` sees ``min(nk, max(0, k0 + nk + d - q))`` keys,
    summed over the queries as ``H(top) - H(bottom)`` with ``H(x) = sum_{u=1..x} min(nk, u)``."""
    top = k0 + nk + d - q0
    bottom = top - nq

    def prefix(x: Tensor) -> Tensor:
        x = x.clamp(min=0)
        inside = x.minimum(nk)
        return inside * (inside + 1) // 2 + (x - inside) * nk

    return prefix(top) - prefix(bottom)


def block_work(batch: BatchLayout, window: int = -1, by_chunk: bool = False) -> BlockWork:
    """The pairs and compositions of every rank's blocks under ``batch``'s layout: the local
    region, the own ring step (the ring rank's own ring section, causal inside each document,
    and its GROUP documents) and the ring steps ``s`` against ring rank ``r - s``'s section
    (docs/design.md §3.3: ``LOWER`` for an earlier source, ``UPPER`` for a later one), as
    many as the schedule has (``layout.window_steps``: a window on a layout in adjacent pairs
    ends it early). Real tokens only: pads see nothing. ``window``: a causal sliding window of
    that many keys back (-1: none), which every block masks by position in the document, each
    ring document's chunks where the layout put them (its turn and pairing).

    A ring document's segment on a step holds its two chunks ``c`` of queries and one of keys,
    or one of queries and two of keys (``UPPER``): ``2 c^2`` pairs with no masked tile, the
    work of a causal document of ``2 c`` tokens, which is what times it (as the own step's
    segment, two chunks each side). ``by_chunk``: judged by the chunk instead, for a kernel that
    :func:`cuts_short_segments`."""
    lengths, ring, ulysses = batch.lengths, batch.ring, batch.ulysses
    # empty documents are no segments of any block (communication.rank_sizes drops them too)
    is_local, is_group, is_ring = ((batch.kind == k) & (lengths > 0) for k in (Kind.LOCAL, Kind.GROUP, Kind.RING))
    start = torch.zeros_like(lengths)
    whole = visible_pairs(start, lengths, start, lengths, window).double()
    slot = torch.where(is_local, batch.ring_rank * ulysses + batch.ulysses_rank, 0)
    local = torch.zeros(ring * ulysses, dtype=torch.float64).scatter_add(
        0, slot, torch.where(is_local, whole, 0)).view(ring, ulysses)
    local_count = torch.zeros(ring * ulysses, dtype=torch.int64).scatter_add(
        0, slot, is_local.long()).view(ring, ulysses)
    local_longest = torch.zeros(ring * ulysses, dtype=torch.int64).scatter_reduce(
        0, slot, torch.where(is_local, lengths, 0), "amax").view(ring, ulysses)
    group_rank = torch.where(is_group, batch.ring_rank, 0)
    group = torch.zeros(ring, dtype=torch.float64).scatter_add(0, group_rank, torch.where(is_group, whole, 0))
    group_count = torch.zeros(ring, dtype=torch.int64).scatter_add(0, group_rank, is_group.long())
    group_longest = torch.zeros(ring, dtype=torch.int64).scatter_reduce(
        0, group_rank, torch.where(is_group, lengths, 0), "amax")

    # real tokens of every RING document in each zigzag chunk: first[r] chunk r, second[r]
    # chunk 2R-1-r (a document's pads sit at the end of its last chunks)
    chunk = batch.chunk[is_ring]
    ring_lengths = lengths[is_ring]
    index = torch.arange(ring)[:, None]

    def real(chunk_index: Tensor) -> Tensor:
        return (ring_lengths - chunk_index * chunk).clamp(min=0).minimum(chunk).double()

    source = (index - torch.arange(ring)[None, :]) % ring  # [r, s]: step s reads r - s
    if window < 0:  # causal pairs factorize over the chunks: products of their token counts
        first, second = real(index), real(2 * ring - 1 - index)  # [R, n_ring]
        own = (first * (first + 1) / 2 + second * (second + 1) / 2 + first * second).sum(1)
        lower = (first + second) @ first.T  # [r, src]: every held query, the source's first chunk
        upper = second @ (first + second).T  # [r, src]: the second chunk's queries, both chunks
        rows = index.expand(ring, ring)
        steps = torch.where(source < rows, lower[rows, source], upper[rows, source])
        steps[:, 0] = own
    else:
        held = _held_chunks(batch, is_ring)
        steps = torch.stack([_window_step(chunk, ring_lengths, held, source[:, s], window)
                             for s in range(ring)], dim=1)
    schedule = layout.window_steps(batch, window)
    steps = steps[:, :schedule]
    steps[:, 0] += group
    n_ring, chunk_max = int(is_ring.sum()), int(chunk.max()) if chunk.numel() else 0
    ring_longest = int(ring_lengths.max()) if n_ring else 0

    def masked(longest: int) -> bool:  # a document of the block is longer than the window
        return 0 <= window < longest

    step_kind = [
        [block_composition(n_ring + int(group_count[r]), max(2 * chunk_max, int(group_longest[r])),
                           masked(max(ring_longest, int(group_longest[r]))))]
        + [block_composition(n_ring, chunk_max if by_chunk else 2 * chunk_max, masked(ring_longest))] * (schedule - 1)
        for r in range(ring)
    ]
    local_kind = [[block_composition(int(local_count[r, a]), int(local_longest[r, a]), masked(int(local_longest[r, a])))
                   for a in range(ulysses)] for r in range(ring)]
    return BlockWork(local, steps / ulysses, local_kind, step_kind)


def _held_chunks(batch: BatchLayout, is_ring: Tensor) -> tuple[Tensor, Tensor]:
    """``[R, n_ring]`` twice: the two chunks each ring rank holds of every RING document (its
    pair, turned and paired as the layout holds it: ``StreamTable.chunks``)."""
    ring = batch.ring
    return layout.paired_chunks((torch.arange(ring)[:, None] - batch.turn[is_ring][None, :]) % ring, ring, batch.adjacent)


def _window_step(chunk: Tensor, lengths: Tensor, held: tuple[Tensor, Tensor], source: Tensor,
                 window: int) -> Tensor:
    """``[R]`` windowed pairs of one ring step: ring rank ``r``'s queries (its two chunks of
    every RING document, ``held``) against ring rank ``source[r]``'s keys (its two chunks),
    each chunk at its place in the document, real tokens only."""
    total = torch.zeros(source.shape[0], dtype=torch.int64)
    for q_chunk in held:
        for k_chunk in held:
            q0, k0 = q_chunk * chunk, k_chunk[source] * chunk  # [R, n_ring]
            nq = (lengths - q0).clamp(min=0).minimum(chunk)
            nk = (lengths - k0).clamp(min=0).minimum(chunk)
            total += visible_pairs(q0, nq, k0, nk, window).sum(1)
    return total.double()


def compute_times(work: BlockWork, ring_rank: int, ulysses_rank: int, call: CallShape,
                  kernel: str, table: KernelTable) -> ComputeTimes:
    """Seconds of rank ``(ring_rank, ulysses_rank)``'s blocks: pairs x ``14 D`` FLOPs per
    query head, at the throughput ``table`` records for the block's composition and for kernel
    calls of its calls' work (a small call runs below a large one's speed): the local region is
    one call, a ring step one per head group (docs/design.md §3.6)."""
    ulysses = work.local.shape[1]
    groups = head_groups(rank_kv_heads(call.heads_kv, ulysses), ulysses)

    def seconds(pairs: float, composition: str | None, calls: int) -> float:
        return block_seconds(pairs, composition, calls, call, kernel, table)

    local = seconds(float(work.local[ring_rank, ulysses_rank]), work.local_kind[ring_rank][ulysses_rank], 1)
    steps = [seconds(float(p), kind, groups) for p, kind in zip(work.steps[ring_rank].tolist(), work.step_kind[ring_rank])]
    return ComputeTimes(
        local * FORWARD_SHARE, local * (1 - FORWARD_SHARE),
        tuple(s * FORWARD_SHARE for s in steps), tuple(s * (1 - FORWARD_SHARE) for s in steps),
    )


def block_seconds(pairs: float, composition: str | None, calls: int, call: CallShape, kernel: str,
                  table: KernelTable) -> float:
    """Seconds of a block of ``pairs`` visible pairs per query head run in ``calls`` equal kernel
    calls: ``14 D`` FLOPs per pair and query head at the throughput ``table`` records for the
    block's composition and for calls of that work."""
    if composition is None or pairs == 0:
        return 0.0
    flops = pairs * pair_flops(call)
    return flops / table.throughput(kernel, composition, flops / calls)


def pair_flops(call: CallShape) -> float:
    """Forward + backward FLOPs of one visible query-key pair over all query heads."""
    return FLOPS_PER_PAIR_HEAD_DIM * call.head_dim * call.heads_q


def one_gpu_call(cu_seqlens: Tensor, call: CallShape, kernel: str, table: KernelTable) -> OneGpuCall:
    """The whole batch on one GPU, as the benchmarks' one-GPU baseline runs it: one kernel call
    of every document (the sum of their visible pairs, under ``call.window`` if any), priced as
    :func:`block_seconds` prices a rank's local region; with where its work lies against the
    call sizes measured for its composition (beyond the largest: priced at that one's rate)."""
    lengths = cu_seqlens.to(torch.int64).diff()
    lengths = lengths[lengths > 0]  # empty documents are no segments (as block_work drops them)
    start = torch.zeros_like(lengths)
    pairs = float(visible_pairs(start, lengths, start, lengths, call.window).sum())
    longest = int(lengths.max()) if lengths.numel() else 0
    composition = block_composition(lengths.numel(), longest, 0 <= call.window < longest)
    seconds = block_seconds(pairs, composition, 1, call, kernel, table)
    return OneGpuCall(kernel, composition, pairs * pair_flops(call), seconds,
                      table.call_range(kernel, composition) if composition is not None else None)
