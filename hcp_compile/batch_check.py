"""``check(prepared, call)``: the rules of a batch against one attention call, for every path
(docs/design.md §9). Eager CP raises the first failure after the ranks agree, the compiled
graph's host op turns the failures into its agreed flags, the single-device op raises the first
one. Pure: it reads the prepared batch and the call, nothing else, and runs no collective."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .prepared import BatchValues, MeshShape, PreparedBatch
from .validation import (
    BATCH_RULES, CU_ENDS_AT_TOKENS, MAX_SEQLEN_COVERS, PLANNED_FOR_THIS_MESH, SAME_DOCUMENT_COUNT,
    SAME_DOCUMENTS, SHARD_TOKENS, Failure,
)


@dataclass(frozen=True)
class BatchCall:
    """What one attention call brings to the checks of its batch, as the host sees it."""

    tokens: Mapping[str, int]  # token counts of "q", "k" and "v"
    max_seqlens: Mapping[str, object]  # "max_seqlen_q", "max_seqlen_k" as passed
    keys: BatchValues | None = None  # cu_seqlens_k's values; None: the tensor of cu_seqlens_q
    rank: tuple[int, int] = (0, 0)  # (ring rank, Ulysses rank) under context parallelism
    planned: MeshShape | None = None  # what shard_plan laid these values out for last


def check(prepared: PreparedBatch, call: BatchCall) -> tuple[Failure, ...]:
    """The rules ``call`` breaks on the batch ``prepared`` (its ``cu_seqlens_q``), in the order
    an error should report them; empty when the call may run."""
    own = prepared.batch.failures("cu_seqlens_q")
    if call.keys is not None:
        own += call.keys.failures("cu_seqlens_k")
    if own:  # the other rules read document lengths and counts these values do not give
        return own
    if prepared.mesh is None:
        return _single_device(prepared.batch, call.keys or prepared.batch, call)
    return _context_parallel(prepared, call)


def flags(failures: tuple[Failure, ...]) -> list[bool]:
    """One flag per rule of :data:`validation.BATCH_RULES`: True where ``failures`` break it."""
    broken = {failure.rule for failure in failures}
    return [rule in broken for rule in BATCH_RULES]


def _single_device(queries: BatchValues, keys: BatchValues, call: BatchCall) -> tuple[Failure, ...]:
    """Each side's ``cu_seqlens`` describes its whole tensor (cross-attention allowed)."""
    failed = []
    for cu_name, values, tensors in (("cu_seqlens_q", queries, "q"), ("cu_seqlens_k", keys, "kv")):
        for name in tensors:
            if call.tokens[name] != values.num_tokens:
                failed.append(Failure(CU_ENDS_AT_TOKENS, (
                    f"{cu_name}: last entry is {values.num_tokens} but {name} has "
                    f"{call.tokens[name]} tokens; {CU_ENDS_AT_TOKENS.fix}"
                )))
        failed += _max_seqlen(f"max_seqlen_{cu_name[-1]}", call.max_seqlens, values.longest)
    if queries.values.numel() != keys.values.numel():
        found = f"{queries.values.numel() - 1} and {keys.values.numel() - 1}"
        failed.append(Failure.of(SAME_DOCUMENT_COUNT, found))
    return tuple(failed)


def _context_parallel(prepared: PreparedBatch, call: BatchCall) -> tuple[Failure, ...]:
    """The shards of one batch laid out for this mesh, queries and keys from the same
    documents."""
    batch, mesh = prepared.batch, prepared.mesh
    failed = []
    if call.keys is not None and call.keys.digest != batch.digest:
        failed.append(Failure.of(SAME_DOCUMENTS))
    for name in ("max_seqlen_q", "max_seqlen_k"):
        failed += _max_seqlen(name, call.max_seqlens, batch.longest)
    if call.planned is not None and call.planned != mesh:
        found = f"a batch sharded for {call.planned.describe()}, but the attention runs on {mesh.describe()}"
        failed.append(Failure.of(PLANNED_FOR_THIS_MESH, found))
    rank_tokens = prepared.rank_tokens(*call.rank)
    for name in ("q", "k", "v"):
        if call.tokens[name] != rank_tokens:
            found = (
                f"{call.tokens[name]} tokens where this cu_seqlens sharded over "
                f"ulysses={mesh.ulysses} x ring={mesh.ring} (placement {mesh.placement!r}) gives "
                f"{rank_tokens} per rank"
            )
            failed.append(Failure.of(SHARD_TOKENS, found, name))
    return tuple(failed)


def _max_seqlen(name: str, max_seqlens: Mapping[str, object], longest: int) -> list[Failure]:
    bound = max_seqlens[name]
    if isinstance(bound, int) and not isinstance(bound, bool) and bound >= longest:
        return []
    found = f"{bound!r} while the longest document in cu_seqlens has {longest} tokens"
    return [Failure.of(MAX_SEQLEN_COVERS, found, name)]
