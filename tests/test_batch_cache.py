"""The one batch cache (hcp_compile/batch/cache.py): a batch is kept by its values and mesh
shape with the cache keys of its blocks and what the kernels derived under them, all dropped
together when the batch is evicted or ``hcp_compile.clear_batch_cache()`` runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import hcp_compile as hc
from cp_cases import cu_seqlens, seeded
from hcp_compile.batch import prepared
from hcp_compile.batch.cache import BATCHES, BatchCache
from hcp_compile.batch.prepared import BatchValues, MeshShape, PreparedBatch
from hcp_compile.kernels import BlockSpec
from hcp_compile.kernels.contract import BLOCK_MEMOS


@pytest.fixture(autouse=True)
def no_batch_kept() -> Iterator[None]:
    """Each test starts without a kept batch and leaves none for the next file's tests."""
    hc.clear_batch_cache()
    yield
    hc.clear_batch_cache()


def batch(lengths: tuple[int, ...], mesh: MeshShape | None = None) -> PreparedBatch:
    return PreparedBatch(BatchValues.of(cu_seqlens(lengths).long()), mesh)


def flex_call(lengths: tuple[int, ...]) -> None:
    """One single-device flex attention of a batch of ``lengths``, forward only."""
    q, k, v = (seeded(f"cache/{n}", sum(lengths), 2, 8) for n in "qkv")
    cu = cu_seqlens(lengths)
    torch.ops.hcp.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), True, 0.5, -1, -1, "flex")


def test_a_kept_batch_keeps_its_keys_and_an_evicted_one_gets_new_ones():
    cache = BatchCache(capacity=2)
    first = cache.adopt(batch((3, 4)))
    keys = cache.cache_keys(first, "rank", 3)
    assert cache.cache_keys(first, "rank", 3) == keys
    assert cache.cache_keys(first, "other", 3) not in range(keys, keys + 3)
    assert cache.adopt(batch((3, 4))) is first  # the same values: the kept one
    cache.adopt(batch((5,)))
    cache.adopt(batch((6,)))  # the first batch goes
    again = cache.prepared(first.key, lambda: batch((3, 4)))
    assert again is not first and cache.cache_keys(again, "rank", 3) >= keys + 3  # never reused


def test_evicting_a_batch_drops_what_was_derived_under_its_keys():
    cache = BatchCache(capacity=1)
    kept = cache.adopt(batch((3, 4)))
    memo = BLOCK_MEMOS.memo("test", capacity=64)
    cu = cu_seqlens((3, 4))
    own = cache.cache_keys(kept, "rank")
    specs = [BlockSpec(cu, cu, 4, 4, True, 1.0, cache_key=key) for key in (own, BLOCK_MEMOS.derived_key(own))]
    builds = []
    for _ in range(2):
        for spec in specs:
            memo.get(spec, (), lambda: builds.append(spec.cache_key))
    assert len(builds) == 2  # once per key
    cache.adopt(batch((5,)))  # evicts the batch, its key and the key derived from it
    for spec in specs:
        memo.get(spec, (), lambda: builds.append(spec.cache_key))
    assert builds[2:] == builds[:2]  # built again, each


def test_clear_forgets_every_batch_and_what_the_kernels_derived(mask_builds):
    values = BatchValues.of(cu_seqlens((3, 4)).long())
    mesh = MeshShape(2, 1)
    kept = prepared.prepare(values, mesh)
    assert prepared.prepare(values, mesh) is kept
    flex_call((5, 9, 3))
    flex_call((5, 9, 3))
    assert mask_builds[0] == 1
    hc.clear_batch_cache()
    assert len(BATCHES) == 0 and prepared.prepare(values, mesh) is not kept
    flex_call((5, 9, 3))
    assert mask_builds[0] == 2


def test_a_batch_evicted_from_the_cache_takes_its_kernel_state_along(mask_builds):
    """A batch's flex mask goes when the batch leaves the cache (not when the kernel's own
    bound is reached): the same batch after as many others as the cache holds builds it again."""
    flex_call((5, 9, 3))
    for length in range(1, BATCHES.capacity + 1):
        flex_call((length, 2))
    assert mask_builds[0] == BATCHES.capacity + 1
    flex_call((5, 9, 3))
    assert mask_builds[0] == BATCHES.capacity + 2
