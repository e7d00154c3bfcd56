"""One attention call on one batch, the same steps for every door (docs/design.md §2.4, §9).

    cu_seqlens ──► find ──────────► checked_batch ──► agreement ──► rank_schedule ──► the algorithm
                   (read once per  (the call's       (eager: an     (the tables
                   tensor version, rules against     all-reduce;    the kernels
                   prepared once   the prepared      compiled: in   and the ring
                   per batch)      batch)            the graph)     steps read)

The single-device op stops after the check; eager CP (hcp_compile/context.py) runs every step
in the call; the compiled graph runs the first two in its host op (``hcp::batch_layout``), the
agreement as collectives of the graph, and the schedule from its tables op
(``hcp::schedule_tables``, hcp_compile/compiled/inserted.py). ``rank_schedule`` is
``schedule.rank_schedule``, over the tables of the rank's plan, which ``schedule.plan_rank``
derives once per batch and mask in one pass (layout, then its tables).
"""

from __future__ import annotations

from collections.abc import Sequence

from hcp_compile.batch.prepared import BatchValues, MeshShape, PreparedBatch
from hcp_compile.validation import BatchCall, Failure, check


def checked_batch(
    prepared: PreparedBatch, keys: BatchValues | None, tokens: Sequence[int], max_seqlens: Sequence[int],
    rank: tuple[int, int] = (0, 0), planned: MeshShape | None = None,
) -> tuple[Failure, ...]:
    """The rules a call breaks on the batch ``prepared`` (``cu_seqlens_q``'s, for the call's
    mesh; a single device's has none): ``keys``, ``cu_seqlens_k``'s values where it is another
    tensor; ``tokens``, q, k and v's token counts; ``max_seqlens``, both ``max_seqlen`` as
    passed; ``rank``, (ring rank, Ulysses rank); ``planned``, the mesh shape ``shard_plan``
    laid these values out for last (``BatchCache.planned``; None: never, or a single device)."""
    call = BatchCall(
        dict(zip("qkv", tokens)), {"max_seqlen_q": max_seqlens[0], "max_seqlen_k": max_seqlens[1]},
        keys, rank, planned if prepared.mesh is not None else None,
    )
    return check(prepared, call)

