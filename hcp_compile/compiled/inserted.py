"""Hierarchical CP attention as the ``hcp`` backend inserts it into a traced graph.

It is the eager algorithm (``HierarchicalAttention`` on a ``RingSchedule``) with the host-side
parts done by opaque ops when the graph runs: ``hcp::batch_layout`` reads ``cu_seqlens`` to the
host, finds its :class:`prepared.PreparedBatch` by value (the one ``shard_plan`` made, here or
in a DataLoader worker) and checks the call against it (``validation.check``), the verdict is
agreed over the mesh, and the few sizes the collectives need become the graph's
data-dependent sizes; ``hcp::schedule_tables`` hands every attention call its schedule's
tables from the same prepared batch (docs/design.md §5).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from hcp_compile import validation
from hcp_compile.batch import layout
from hcp_compile.batch.call import checked_batch
from hcp_compile.batch.layout import RankSizes
from hcp_compile.batch.cache import BATCHES
from hcp_compile.batch.prepared import (
    BatchValues, Exchanges, GraphKind, MeshShape, PreparedBatch, find, find_by_value, host_values,
)
from hcp_compile.batch.schedule import ScheduleTables, cache_keys_needed, gathers, rank_schedule
from hcp_compile.exchange import agreement
from hcp_compile.exchange.agreement import Verdict
from hcp_compile.exchange.mesh import CPGroups, resolve_groups
from hcp_compile.exchange.schemes import DEFAULT_SCHEME
from hcp_compile.hierarchical import HierarchicalAttention


def checked_layout(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, tokens: tuple[int | torch.SymInt, ...],
    max_seqlens: tuple[int | torch.SymInt, ...], *, ulysses_group: str, ring_group: str,
    placement: str, agree: bool, recompute_exchange: bool = False, scheme: str = DEFAULT_SCHEME,
    graph_for: str = GraphKind().text, agreement_timeout_s: float | None = None,
) -> "CheckedBatch":
    """Check the batch and return what every attention call of it in the graph reuses: this
    rank's sizes (the values of :func:`layout.rank_size_values`) and the first cache key of
    its schedules' blocks, read to the host (symbolic ints in a graph), and ``cu_seqlens_q``,
    by which the tables op finds the batch again. ``tokens``: the token counts of q, k and v;
    ``max_seqlens``: ``max_seqlen_q`` and ``max_seqlen_k``.

    One opaque op (``hcp::batch_layout``) reads ``cu_seqlens`` to the host (once per tensor and
    version), takes the batch's prepared layout (kept for the tensor, else by value) and checks
    :data:`validation.BATCH_RULES` there; another (``hcp::agree_on_batch``) agrees on the
    verdict over the mesh as eager CP does (hcp_compile/exchange/agreement.py: the same
    payload, timeout and errors), so every rank raises together (also when the ranks were
    given different batches, or differ in ``placement``, ``recompute_exchange`` or ``scheme``,
    or run graphs built for different batches beside each other (``graph_for``, a
    :class:`prepared.GraphKind`'s text)) instead of some ranks waiting in the next collective."""
    groups = groups_from_names(ulysses_group, ring_group)
    on_host = torch.ops.hcp.batch_layout(
        cu_seqlens_q, cu_seqlens_k, groups.ulysses_size, groups.ring_size, placement, groups.ring_rank,
        groups.ulysses_rank, list(tokens), list(max_seqlens), recompute_exchange, scheme, graph_for,
    )
    accepted = torch.ops.hcp.agree_on_batch(on_host, ulysses_group, ring_group, agree, agreement_timeout_s)
    *sizes, first_cache_key = accepted.tolist()
    return CheckedBatch(cu_seqlens_q, placement, tuple(sizes), first_cache_key)


class CheckedBatch(NamedTuple):
    """A batch as :func:`checked_layout` hands it to every attention call of the graph."""

    # what the schedule tables op finds the batch by (the batch cache keeps it for this tensor
    # once the check found it)
    cu_seqlens_q: Tensor
    placement: str
    sizes: tuple[int | torch.SymInt, ...]  # layout.rank_size_values of this rank
    first_cache_key: int | torch.SymInt


# Note [the host vector]: what ``hcp::batch_layout`` hands the graph, one int64 CPU tensor
#
#     | verdict (agreement.Verdict, its LENGTH) | rank sizes (layout.rank_size_values) | first cache key |
#
# ``hcp::agree_on_batch`` takes the verdict off and passes the rest on; the graph reads that.


@torch.library.custom_op("hcp::batch_layout", mutates_args=())
def batch_layout_op(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, ulysses: int, ring: int, placement: str,
    ring_rank: int, ulysses_rank: int, tokens: list[int], max_seqlens: list[int],
    recompute_exchange: bool, scheme: str, graph_for: str,
) -> Tensor:
    """One batch on the host, once per call: ``on_host``, an int64 CPU tensor (Note [the host
    vector]): the verdict, then rank ``(ring_rank, ulysses_rank)``'s sizes
    (:func:`layout.rank_size_values`; zeros when the batch could not be laid out) and the
    first of the cache keys that name its segmentations of this batch. The verdict:
    ``validation.verdict`` of the call (``tokens``: q, k and v's token counts,
    ``max_seqlens``: both ``max_seqlen``) on the batch's :class:`prepared.PreparedBatch`,
    then its fingerprint, the kind of graph (``graph_for``) and their negations. The batch
    found here for ``cu_seqlens_q`` is kept for the tensor (``BatchCache.find``), so
    ``hcp::schedule_tables`` finds it by the same tensor without reading it.

    On a GPU the rule's hundreds of small sorts, scans and searches, and the checks, would cost
    milliseconds of launches per call; the host copy of ``cu_seqlens``, made once per tensor and
    version, costs microseconds, and the batch is prepared once (by ``shard_plan``, or ahead of
    time in a DataLoader worker: docs/design.md §5.3). The keys are given by the batch's
    values, so the layers and the backward of one batch share what the kernels derive."""
    mesh = MeshShape(ulysses, ring, placement)
    keys = None if cu_seqlens_k is cu_seqlens_q else host_values(cu_seqlens_k)
    # kept per call with the batch: a model's graphs check the same call of a batch again (each
    # graph of a model split by graph breaks, every step of a benchmark), and the check and the
    # layout's sizes cost the host a few hundred microseconds of Python that the GPU waits for
    # at the start of a step (docs/benchmarks.md, "Compiled host work")
    call = (None if keys is None else keys.digest, ring_rank, ulysses_rank, tuple(tokens), tuple(max_seqlens),
            recompute_exchange, scheme, graph_for)
    # the batch laid out for shard_plan's window (by value where the cache has not seen the tensor)
    _, on_host = BATCHES.checked(
        cu_seqlens_q, mesh, lambda: find_by_value(cu_seqlens_q, mesh), call,
        lambda prepared, planned: _check_call(prepared, keys, (ring_rank, ulysses_rank), tokens, max_seqlens,
                                              recompute_exchange, scheme, graph_for, planned),
    )
    return on_host.clone()


def _check_call(
    prepared: PreparedBatch, keys: BatchValues | None, rank: tuple[int, int], tokens: list[int],
    max_seqlens: list[int], recompute_exchange: bool, scheme: str, graph_for: str, planned: MeshShape | None,
) -> Tensor:
    """``batch_layout``'s ``on_host`` for one call of the batch ``prepared`` on rank ``rank``
    (ring rank, Ulysses rank) of its mesh, which ``shard_plan`` laid out for ``planned`` last."""
    mesh = prepared.mesh
    failures = checked_batch(prepared, keys, tokens, max_seqlens, rank, planned)
    failed = validation.verdict(failures, rank)
    fingerprint = agreement.fingerprint(prepared.batch.digest, mesh, recompute_exchange, scheme)
    graph = GraphKind.parse(graph_for).code
    if prepared.laid_out:
        sizes = torch.tensor(layout.size_values(prepared.rank_sizes(*rank)))
    else:
        sizes = torch.zeros(_sizes_length(mesh.ulysses, mesh.ring), dtype=torch.int64)
    # the batch's keys for this rank, as eager CP's: eager and compiled calls of one batch share
    # what the kernels derive
    key = BATCHES.cache_keys(prepared, rank, cache_keys_needed(mesh.ring))
    verdict = Verdict(tuple(failed), False, fingerprint, graph).encode()
    return torch.cat([verdict, sizes.to(torch.int64), torch.tensor([key], dtype=torch.int64)])


def _sizes_length(ulysses: int, ring: int) -> int:
    return 3 + ulysses + 1 + ring + 1  # layout.rank_size_values


@batch_layout_op.register_fake
def _(cu_seqlens_q, cu_seqlens_k, ulysses, ring, placement, ring_rank, ulysses_rank, tokens, max_seqlens,
      recompute_exchange, scheme, graph_for):
    return torch.empty(Verdict.LENGTH + _sizes_length(ulysses, ring) + 1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("hcp::agree_on_batch", mutates_args=())
def agree_on_batch(on_host: Tensor, ulysses_group: str, ring_group: str, agree: bool,
                   timeout_s: float | None) -> Tensor:
    """The verdict of ``on_host`` (Note [the host vector]) agreed over the mesh (``agree``) as
    eager CP agrees (:func:`agreement.agree`, waiting at most ``timeout_s``), raising
    :func:`agreement.raise_agreed`'s error on every rank; else the rest of ``on_host``."""
    verdict, rest = on_host.split([Verdict.LENGTH, on_host.shape[0] - Verdict.LENGTH])
    if agree:
        verdict = agreement.agree(groups_from_names(ulysses_group, ring_group), verdict,
                                  timeout_s=timeout_s, caller="the compiled graph's varlen_attention")
    agreement.raise_agreed(verdict.tolist())
    return rest.clone()


@agree_on_batch.register_fake
def _(on_host, ulysses_group, ring_group, agree, timeout_s):
    return on_host.new_empty(on_host.shape[0] - Verdict.LENGTH)


def hierarchical_varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, max_seqlen: int | torch.SymInt,
    batch: CheckedBatch, *, causal: bool, scale: float,
    window: tuple[int, int], kernel: str, ulysses_group: str, ring_group: str,
    return_lse: bool, recompute_exchange: bool = False, scheme: str = DEFAULT_SCHEME,
    graph_for: str = GraphKind().text,
) -> Tensor | tuple[Tensor, Tensor]:
    """This rank's shard of varlen attention over a packed batch, q/k/v being the local shards
    laid out by ``shard_plan``; ``batch`` comes from :func:`checked_layout`. The groups are
    given by name so that the call prints as readable code in a dumped graph.

    A graph cannot tell from its symbolic sizes what a batch exchanges, so it keeps every ring
    step and every all-to-all; ``graph_for`` (a :class:`prepared.GraphKind`'s text) builds the
    graph for batches that exchange less, as eager runs them: the sizes such batches leave
    empty become the constant 0, checked when the graph runs, and a window's calls run the ring
    steps the kind gives them (docs/compiled-path.md, "Graph variants")."""
    groups = groups_from_names(ulysses_group, ring_group)
    values, first_cache_key = batch.sizes, batch.first_cache_key
    for size in values[1:]:
        _check_is_size(size)
    kind = GraphKind.parse(graph_for)
    rank_sizes = _sizes_for_graph(layout.rank_sizes(values, groups.ulysses_rank, groups.ulysses_size),
                                  kind.exchanges)
    values = layout.size_values(rank_sizes)
    rank_sizes = dataclasses.replace(rank_sizes, tokens=q.shape[0])
    torch._check(rank_sizes.local + rank_sizes.own_exchange <= q.shape[0])
    torch._check(rank_sizes.ring_width <= rank_sizes.stream)
    gathered = gathers(scheme, causal, window, groups.ring_size, kernel)
    steps = layout.schedule_steps(rank_sizes, groups.ring_size, kind.steps(causal, window), gathered)
    gathered = gathered and steps > 1
    flat = torch.ops.hcp.schedule_tables(
        batch.cu_seqlens_q, q.device, groups.ulysses_size, groups.ring_size, batch.placement,
        groups.ring_rank, groups.ulysses_rank, steps, causal, window[0], window[1], values, gathered,
    )
    shape = layout.schedule_shape(rank_sizes, groups.ring_rank, groups.ring_size, steps, causal, gathered)
    sched = rank_schedule(
        flat, rank_sizes, shape, groups.ring_rank, groups.ring_size, max_seqlen,
        windowed=layout.window_by_position(window, groups.ring_size), causal=causal, scale=float(scale),
        window=window, kernel=kernel, first_cache_key=first_cache_key, scheme=scheme,
        kv_heads=k.shape[1], ulysses=groups.ulysses_size,
    )
    return HierarchicalAttention.apply(q, k, v, sched, groups, return_lse, recompute_exchange)


@torch.library.custom_op("hcp::schedule_tables", mutates_args=())
def schedule_tables_op(
    cu_seqlens_q: Tensor, device: torch.device, ulysses: int, ring: int, placement: str,
    ring_rank: int, ulysses_rank: int, steps: int, causal: bool, window_left: int, window_right: int,
    sizes: list[int], gathered: bool,
) -> tuple[Tensor, Tensor]:
    """The tables of rank ``(ring_rank, ulysses_rank)``'s schedule of the batch ``cu_seqlens_q``
    (:meth:`ScheduleTables.flat`: int32 segmentations, int64 positions), derived on the host
    once per batch and mask by its :class:`prepared.PreparedBatch` (one copy to ``device`` per
    call): on a GPU their sorts, scans and searches cost a dozen small kernels per attention
    call (docs/design.md §5.3). ``sizes``: the rank's sizes as :func:`checked_layout` read
    them, which give the fake outputs their lengths (the prepared batch holds the same);
    ``gathered``: the own step's and a gathered step's tables (:func:`schedule.gathers`).

    The graph runs every ring step, whichever a window leaves without a visible key (batch
    data): the tables of those steps come empty (``RankPlan.flat_skipping``), so their block
    calls compute nothing, as eager CP skips them (``RankPlan.active`` decides for both)."""
    prepared = find(cu_seqlens_q, MeshShape(ulysses, ring, placement))  # as hcp::batch_layout found it
    _, copies = prepared.device_tables(ring_rank, ulysses_rank, causal, (window_left, window_right), device, steps,
                                       skip_inactive=True, gathered=gathered)
    return copies


@schedule_tables_op.register_fake
def _(cu_seqlens_q, device, ulysses, ring, placement, ring_rank, ulysses_rank, steps, causal, window_left, window_right,
      sizes, gathered):
    window = (window_left, window_right)
    tables, positions = ScheduleTables.lengths(layout.rank_sizes(sizes, ulysses_rank, ulysses), steps,
                                               layout.window_by_position(window, ring), gathered)
    return (torch.empty(sum(tables), dtype=torch.int32, device=device),
            torch.empty(sum(positions), dtype=torch.int64, device=device))


def _sizes_for_graph(sizes: RankSizes, graph_for: Exchanges) -> RankSizes:
    """The rank's sizes with those that the batches of ``graph_for`` leave empty as the
    constant 0 (:meth:`prepared.Exchanges.narrowed`), each checked when the graph runs."""
    narrowed = graph_for.narrowed(sizes)
    for size, constant in zip((sizes.ring_width, *sizes.exchange), (narrowed.ring_width, *narrowed.exchange)):
        if constant is not size:
            torch._check(size == 0, lambda: (
                f"a batch that exchanges more ran in the graph built for batches that exchange {graph_for.value}"))
    return narrowed


def _check_is_size(size: int | torch.SymInt) -> None:
    """A layout size is a size: torch 2.11's decompositions need it marked as one to decide
    that a region is never empty-by-accident (later versions deprecate the marking)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch._check_is_size(size)


def groups_from_names(ulysses_group: str, ring_group: str) -> CPGroups:
    return resolve_groups((_resolve_process_group(ulysses_group), _resolve_process_group(ring_group)))
