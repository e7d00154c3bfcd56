"""The one place the host keeps what it derived from the batches it has seen (docs/design.md
§2.4).

A batch is named one way, by ``(digest of its cu_seqlens values, mesh shape)``; its entry holds
the :class:`prepared.PreparedBatch` (whose ``key`` that is), the :attr:`BlockSpec.cache_key`
values handed out for its blocks, the CP doors' checked calls and whether ``shard_plan``
laid it out. What a kernel
derives per block (masks, cuDNN calls, dense plans) sits in the kernels' memos under those keys
(``kernels.contract.BLOCK_MEMOS``), and the host copies of its device tensors' values (its
``cu_seqlens`` read once, its schedules' tables) in ``kernels.contract.HOST_READS``, owned by
its values' digest and its key: both below this layer, driven from here, so evicting a batch,
or :func:`clear_batch_cache`, drops everything kept for it. What is kept per configuration
(compiled kernels, cuDNN graphs by shape) lives in the kernels and stays.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from hcp_compile.kernels.contract import BLOCK_MEMOS, HOST_READS, new_cache_key

T = TypeVar("T")
BatchKey = tuple[bytes, Hashable]  # (digest of the values, mesh shape or None)

# batches kept: a training step's, the next one's from the loader, a few more
CAPACITY = 8


@dataclass(eq=False)
class _Entry:
    prepared: Any  # the batch's PreparedBatch
    keys: dict[Hashable, int] = field(default_factory=dict)  # (purpose, count) -> first cache key
    owned: list[int] = field(default_factory=list)  # every cache key handed out for the batch
    checked: dict[Hashable, Any] = field(default_factory=dict)  # a CP door's check, per call
    planned: int = -1  # when shard_plan last laid the batch out (a stamp), -1: never


class BatchCache:
    """A bounded map of batch entries, the least recently used dropped first, safe across
    threads (a checkpointed layer's attention runs on CUDA's autograd thread)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        # in order of use, the least recently used first; a plain dict, which unlike an
        # OrderedDict iterates its items without hashing each key again (a mesh shape hashes
        # in Python)
        self._entries: dict[BatchKey, _Entry] = {}
        self._stamps = itertools.count()
        # tensor -> (its version, {mesh shape: the batch find gave}): what every layer of a model
        # and every host op of a graph asks again for the same cu_seqlens; emptied whenever a
        # batch comes or goes or is laid out again (:meth:`_changed`), which can change the answer
        self._by_tensor = WeakIdKeyDictionary()
        # how often the cache changed: a door that keeps what it found asks it again when this moved
        self.changes = 0
        self._lock = threading.RLock()

    def find(self, tensor: Tensor, mesh: Hashable, find: Callable[[], T]) -> T:
        """The batch ``find()`` gives for the values of ``tensor`` on ``mesh``
        (``prepared.find``), kept for the tensor and its version until the cache changes."""
        with self._lock:
            kept = self._by_tensor.get(tensor)
            if kept is not None and kept[0] == tensor._version and mesh in kept[1]:
                return kept[1][mesh]
        found = find()
        with self._lock:
            entry = self._entries.get(found.key)
            if entry is not None and entry.prepared is found:  # not dropped meanwhile by another thread
                kept = self._by_tensor.get(tensor)
                if kept is None or kept[0] != tensor._version:
                    kept = self._by_tensor[tensor] = (tensor._version, {})
                kept[1][mesh] = found
        return found

    def prepared(self, key: BatchKey, build: Callable[[], T]) -> T:
        """The batch's prepared values, built by ``build`` (and kept) where not kept yet."""
        with self._lock:
            entry = self._found(key)
            if entry is not None:
                return entry.prepared
        return self.adopt(build())

    def adopt(self, prepared: T) -> T:
        """Keep ``prepared`` (built here or unpickled from a worker) under its ``key``; an entry
        already there stays and its batch is returned."""
        with self._lock:
            return self._entry(prepared).prepared

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

    def checked(self, tensor: Tensor, mesh: Hashable, find: Callable[[], Any], call: Hashable,
                check: Callable[[Any, Hashable | None], T]) -> tuple[Any, T]:
        """The batch of ``tensor`` on ``mesh`` (:meth:`find`) and ``check(batch, planned)`` of one
        call of it, ``planned`` being the mesh shape ``shard_plan`` laid its values out for last
        (:meth:`planned`, which the check reads), kept with the batch for as long as that shape
        stays the last: one look-up for a door's check of a call."""
        prepared = self.find(tensor, mesh, find)
        with self._lock:
            kept = self._entry(prepared).checked
            planned = self.planned(prepared.batch.digest)
            found = kept.get((call, planned))
            if found is None:
                found = kept[call, planned] = check(prepared, planned)
            return prepared, found

    def record_plan(self, prepared: Any) -> None:
        """Remember that ``shard_plan`` laid the batch ``prepared`` out (last)."""
        with self._lock:
            self._entry(prepared).planned = next(self._stamps)
            self._changed()

    def planned(self, digest: bytes) -> Hashable | None:
        """The mesh shape ``shard_plan`` laid these values out for last (None: never, or the
        batch is no longer kept)."""
        with self._lock:
            stamped = [(entry.planned, mesh) for (kept, mesh), entry in self._entries.items()
                       if kept == digest and entry.planned >= 0]
        return max(stamped, key=lambda found: found[0])[1] if stamped else None

    def clear(self) -> None:
        """Forget every batch and all that the kernels derived or the host read from them."""
        with self._lock:
            self._entries.clear()
            self._changed()
        BLOCK_MEMOS.clear()
        HOST_READS.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, prepared: Any) -> _Entry:
        """The entry of ``prepared`` (its ``key`` names it; made for it where there is none:
        never kept, or dropped since), now the most recently used."""
        key = prepared.key
        entry = self._found(key)
        if entry is None:
            entry = self._entries[key] = _Entry(prepared)
            while len(self._entries) > self.capacity:
                oldest = next(iter(self._entries))
                self._drop(oldest, self._entries.pop(oldest))
            self._changed()
        return entry

    def _changed(self) -> None:
        """A batch came, went or was laid out again: what :meth:`find` kept may be another
        batch now (a window's layout, a batch dropped)."""
        self._by_tensor.clear()
        self.changes += 1

    def _found(self, key: BatchKey) -> _Entry | None:
        """The entry under ``key``, now the most recently used; None where there is none."""
        entry = self._entries.get(key)
        # moved only where it is not the newest already (kept under its batch's own key): each
        # lookup hashes the mesh shape again, and a call of a batch looks it up several times
        if entry is not None and next(reversed(self._entries)) is not entry.prepared.key:
            del self._entries[key]
            self._entries[entry.prepared.key] = entry
        return entry

    def _drop(self, key: BatchKey, entry: _Entry) -> None:
        """Drop what the kernels keep for the batch ``key``, just evicted as ``entry``: its
        blocks' memos, its tables' host copies and, unless its values are kept for another mesh
        shape, the reads of its values."""
        BLOCK_MEMOS.drop(set(entry.owned))
        digest = key[0]
        HOST_READS.drop({key} if any(kept == digest for kept, _ in self._entries) else {key, digest})


BATCHES = BatchCache()


def clear_batch_cache() -> None:
    """Forget every batch seen (prepared, adopted from a DataLoader worker, laid out by
    ``shard_plan``) and what the kernels derived from them: the next call of any batch derives
    it all again, as for a batch never seen. Compiled kernels and graphs stay."""
    BATCHES.clear()
