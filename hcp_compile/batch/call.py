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
derives once per batch and mask in one pass (layout, then its tables); eagerly
``schedule.prepared_schedule`` takes the plan, its device tables and cache keys in one go.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from torch import Tensor

from hcp_compile.batch.cache import BATCHES
from hcp_compile.batch.prepared import BatchValues, MeshShape, PreparedBatch
from hcp_compile.validation import BatchCall, Failure, check

T = TypeVar("T")

# calls a door keeps: a step's batch and its keys, the next one's
CALLS_KEPT = 4


class KeptCalls(Generic[T]):
    """What one door (an eager ``context_parallel`` block, a compiled graph's variants) derived
    for the ``cu_seqlens`` tensors of a call, kept by their identity and version and the call's
    other keys until the batch cache changes (``BatchCache.changes``: a batch came, went or was
    laid out again, which can change the answer). The layers of a model, and every call of a
    compiled graph, pass the same tensors again and find the answer here without entering the
    rest of the batch package. The door owns it; it holds the tensors of a few calls, so their
    ids stay theirs."""

    def __init__(self, capacity: int = CALLS_KEPT):
        self._capacity = capacity
        self._kept: dict[tuple, tuple[int, tuple[Tensor, ...], T]] = {}

    def kept(self, tensors: tuple[Tensor, ...], key: Hashable, derive: Callable[[], T]) -> T:
        """What ``derive()`` gave for the tensors (as they are now) and ``key``, derived and
        kept where it is not kept yet or the batch cache changed since."""
        kept_key = (*((id(t), t._version) for t in tensors), key)
        found = self._kept.get(kept_key)
        if found is not None and found[0] == BATCHES.changes and all(a is b for a, b in zip(found[1], tensors)):
            return found[2]
        value = derive()
        if len(self._kept) >= self._capacity:
            self._kept.clear()  # tensors of batches done with
        self._kept[kept_key] = (BATCHES.changes, tensors, value)
        return value

    def values(self) -> list[T]:
        return [value for *_, value in self._kept.values()]


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

