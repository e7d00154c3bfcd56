"""The one place the host keeps what it derived from the batches it has seen (docs/design.md
§2.4).

A batch is named one way, by ``(digest of its cu_seqlens values, mesh shape)``; its entry holds
the :class:`prepared.PreparedBatch` (whose ``key`` that is), the :attr:`BlockSpec.cache_key`
values handed out for its blocks, the compiled graph's checked calls and whether ``shard_plan``
laid it out. What a kernel
derives per block (masks, cuDNN calls, dense plans) sits in the kernels' memos under those keys
(``kernels.contract.BLOCK_MEMOS``, below this layer, driven from here), so evicting a batch, or
:func:`clear_batch_cache`, drops everything kept for it. What is kept
per configuration (compiled kernels, cuDNN graphs by shape) lives in the kernels and stays.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hcp_compile.kernels.contract import BLOCK_MEMOS, new_cache_key

T = TypeVar("T")
BatchKey = tuple[bytes, Hashable]  # (digest of the values, mesh shape or None)

# batches kept: a training step's, the next one's from the loader, a few more
CAPACITY = 8


@dataclass(eq=False)
class _Entry:
    prepared: Any  # the batch's PreparedBatch
    keys: dict[Hashable, int] = field(default_factory=dict)  # (purpose, count) -> first cache key
    owned: list[int] = field(default_factory=list)  # every cache key handed out for the batch
    checked: dict[Hashable, Any] = field(default_factory=dict)  # the compiled check, per call
    planned: int = -1  # when shard_plan last laid the batch out (a stamp), -1: never


class BatchCache:
    """A bounded map of batch entries, the least recently used dropped first, safe across
    threads (a checkpointed layer's attention runs on CUDA's autograd thread)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._entries: OrderedDict[BatchKey, _Entry] = OrderedDict()
        self._stamps = itertools.count()
        self._lock = threading.RLock()

    def prepared(self, key: BatchKey, build: Callable[[], T]) -> T:
        """The batch's prepared values, built by ``build`` (and kept) where not kept yet."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry.prepared
        return self.adopt(build())

    def adopt(self, prepared: T) -> T:
        """Keep ``prepared`` (built here or unpickled from a worker) under its ``key``; an entry
        already there stays and its batch is returned."""
        key = prepared.key
        with self._lock:
            if key not in self._entries:
                self._entries[key] = _Entry(prepared)
                while len(self._entries) > self.capacity:
                    self._drop(*self._entries.popitem(last=False))
            self._entries.move_to_end(key)
            return self._entries[key].prepared

    def cache_keys(self, prepared: Any, purpose: Hashable, count: int = 1) -> int:
        """The first of ``count`` cache keys for the blocks of ``purpose`` (a rank's schedule,
        the single-device call against some keys' values) of the batch ``prepared``: the same
        for as long as the batch is kept, never handed out again after."""
        with self._lock:
            entry = self._entry(prepared)
            if (purpose, count) not in entry.keys:
                first = new_cache_key(count)
                entry.keys[purpose, count] = first
                entry.owned.extend(range(first, first + count))
            return entry.keys[purpose, count]

    def checked(self, prepared: Any, call: Hashable, check: Callable[[], T]) -> T:
        """``check()`` of one call of the batch ``prepared``, kept with the batch for as long as
        ``shard_plan`` laid its values out for the same mesh shape last (the check reads it)."""
        with self._lock:
            kept = self._entry(prepared).checked
            key = (call, self.planned(prepared.batch.digest))
            if key not in kept:
                kept[key] = check()
            return kept[key]

    def record_plan(self, prepared: Any) -> None:
        """Remember that ``shard_plan`` laid the batch ``prepared`` out (last)."""
        with self._lock:
            self._entry(prepared).planned = next(self._stamps)

    def planned(self, digest: bytes) -> Hashable | None:
        """The mesh shape ``shard_plan`` laid these values out for last (None: never, or the
        batch is no longer kept)."""
        with self._lock:
            stamped = [(entry.planned, mesh) for (kept, mesh), entry in self._entries.items()
                       if kept == digest and entry.planned >= 0]
        return max(stamped, key=lambda found: found[0])[1] if stamped else None

    def clear(self) -> None:
        """Forget every batch and all that the kernels derived from them."""
        with self._lock:
            self._entries.clear()
        BLOCK_MEMOS.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, prepared: Any) -> _Entry:
        """The entry of ``prepared`` (its ``key`` names it), kept again if it was dropped."""
        self.adopt(prepared)
        return self._entries[prepared.key]

    def _drop(self, key: BatchKey, entry: _Entry) -> None:
        BLOCK_MEMOS.drop(set(entry.owned))


BATCHES = BatchCache()


def clear_batch_cache() -> None:
    """Forget every batch seen (prepared, adopted from a DataLoader worker, laid out by
    ``shard_plan``) and what the kernels derived from them: the next call of any batch derives
    it all again, as for a batch never seen. Compiled kernels and graphs stay."""
    BATCHES.clear()
