"""One attention call on one batch, the same steps for every door (docs/design.md §2.4, §9).

    cu_seqlens ──► find ──────────► checked_batch ──► agreement ──► rank_schedule ──► the algorithm
                   (read once per  (the call's       (eager: an     (the tables
                   tensor version, rules against     all-reduce;    the kernels
                   prepared once   the prepared      compiled: in   and the ring
                   per batch)      batch)            the graph)     steps read)

The single-device op stops after the check; eager CP (hcp_compile/context.py) runs every step
in the call; the compiled graph runs the first two in its host op (``hcp::batch_layout``), the
agreement as collectives of the graph, and the schedule from its tables op
(``hcp::schedule_tables``, hcp_compile/compiled/inserted.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from hcp_compile.batch.layout import RankSizes, window_by_position
from hcp_compile.batch.cache import BATCHES
from hcp_compile.batch.prepared import BatchValues, PreparedBatch
from hcp_compile.batch.schedule import RingSchedule, ScheduleTables, assemble_schedule
from hcp_compile.validation import BatchCall, Failure, check


def checked_batch(
    prepared: PreparedBatch, keys: BatchValues | None, tokens: Sequence[int], max_seqlens: Sequence[int],
    rank: tuple[int, int] = (0, 0),
) -> tuple[Failure, ...]:
    """The rules a call breaks on the batch ``prepared`` (``cu_seqlens_q``'s, for the call's
    mesh; a single device's has none): ``keys``, ``cu_seqlens_k``'s values where it is another
    tensor; ``tokens``, q, k and v's token counts; ``max_seqlens``, both ``max_seqlen`` as
    passed; ``rank``, (ring rank, Ulysses rank)."""
    call = BatchCall(
        dict(zip("qkv", tokens)), {"max_seqlen_q": max_seqlens[0], "max_seqlen_k": max_seqlens[1]},
        keys, rank, BATCHES.planned(prepared.batch.digest) if prepared.mesh is not None else None,
    )
    return check(prepared, call)


def rank_schedule(
    flat: Sequence, sizes: RankSizes, steps: int, ring_rank: int, ring: int, max_seqlen: object, *,
    causal: bool, scale: float, window: tuple[int, int], kernel: str, first_cache_key: object, scheme: str,
    gathered: bool, kv_heads: int, ulysses: int, active: list[bool] | None = None,
) -> RingSchedule:
    """This rank's ring schedule from its flat tables (:meth:`PreparedBatch.device_tables`,
    eagerly or through the graph's tables op) and its sizes (host ints, or a graph's symbols);
    ``gathered``: its second step a gathered one (``RankPlan.gathered``)."""
    tables = ScheduleTables.unflat(*flat, sizes, steps, window_by_position(window, ring), gathered)
    return assemble_schedule(
        tables, sizes, max_seqlen, ring_rank, ring, causal=causal, scale=scale, window=window, kernel=kernel,
        active=active, first_cache_key=first_cache_key, scheme=scheme, kv_heads=kv_heads, ulysses=ulysses,
    )
