"""The communication part: each rank's sizes, its all-to-all bytes (before and after the ring) and
its ring hops, from the schemes' own counts, over the links."""

from __future__ import annotations

import dataclasses

from hcp_compile.batch.layout import BatchLayout, Kind, RankSizes, gathered_chunk_keys, stream_table
from hcp_compile.batch.traffic import CallShape, call_traffic

from .records import ExchangeTimes, HopTimes, Links, SCHEME


def rank_sizes(batch: BatchLayout, ring_rank: int, ulysses_rank: int) -> RankSizes:
    """The rank's :class:`RankSizes` read off the layout, equal to
    ``PreparedBatch.rank_sizes`` (tested) without its per-step tables, which cost seconds
    per rank on 512 ranks: every step has the ring documents and the ring rank's GROUP
    documents as entries (the own stream holds the queries of both); the gathered step's keys
    are a sum over the ring documents' chunks."""
    is_ring = (batch.kind == Kind.RING) & (batch.lengths > 0)
    group = (batch.kind == Kind.GROUP) & (batch.ring_rank == ring_rank) & (batch.lengths > 0)
    entries = int(is_ring.sum() + group.sum())
    return RankSizes(
        int(batch.local_tokens), int(batch.local_extent[ring_rank, ulysses_rank]),
        tuple(batch.exchange_extent[ring_rank].tolist()), int(batch.ring_width), ulysses_rank,
        int(batch.is_local_on(ring_rank, ulysses_rank).sum()),
        (entries,) * batch.ring, int(gathered_chunk_keys(stream_table(batch, ring_rank), ring_rank, batch.ring).sum()),
    )


def exchange_bytes(sizes: RankSizes, call: CallShape, ulysses: int, ring: int) -> tuple[int, int, int, int]:
    """``(forward in, forward out, backward in, backward out)`` all-to-all bytes of one rank
    and call (all head groups), from ``call_traffic``: what the rank sends of its own tokens
    (q, KV; dout) travels before the ring, what it sends of the others' (out; dq, dKV) after.
    The first is the traffic of the rank's sizes with the other ranks' regions emptied."""
    total = call_traffic(SCHEME, sizes, call, ulysses, ring).ulysses
    own = sizes.exchange[sizes.ulysses_rank]
    alone = tuple(own if a == sizes.ulysses_rank else 0 for a in range(len(sizes.exchange)))
    sent_in = call_traffic(SCHEME, _with_exchange(sizes, alone), call, ulysses, ring).ulysses
    return (sent_in.forward_bytes, total.forward_bytes - sent_in.forward_bytes,
            sent_in.backward_bytes, total.backward_bytes - sent_in.backward_bytes)


def _with_exchange(sizes: RankSizes, exchange: tuple[int, ...]) -> RankSizes:
    return dataclasses.replace(sizes, exchange=exchange)


def exchange_times(group_bytes: tuple[int, int, int, int], links: Links, groups: int) -> ExchangeTimes:
    """One head group's all-to-all phases over NVLink: its share of each phase's bytes, plus
    one latency per phase (a phase's all-to-alls are issued back to back, so their latencies
    overlap). ``group_bytes``: :func:`exchange_bytes` of the slowest member of the group (an
    all-to-all ends when every member's part has arrived)."""
    def seconds(count: int) -> float:
        if count == 0:
            return 0.0
        return count / groups / links.all_to_all_bytes_per_s + links.nvlink_latency_s

    return ExchangeTimes(*(seconds(b) for b in group_bytes))


def ring_link(ulysses: int, ring: int, gpus_per_node: int) -> str:
    """The slowest link of the ring: ``"network"`` when the mesh spans nodes (some hop crosses
    one, and each step waits for its hop), ``"nvlink"`` inside one node, ``"-"`` without a
    ring."""
    if ring == 1:
        return "-"
    return "network" if ulysses * ring > gpus_per_node else "nvlink"


def hop_times(sizes: RankSizes, call: CallShape, ulysses: int, ring: int, link: str,
              links: Links, groups: int, steps: int | None = None) -> HopTimes:
    """One head group's ring hops, from ``call_traffic``'s bytes (``S - 1`` forward hops;
    ``S - 1`` KV hops, as large as a forward hop plus the one carried element, and ``S`` dKV
    hops in the backward, the last one the finished sum in the input dtype: a forward hop's
    size, schemes/ring.py). A hop is a collective of its own: one latency each. ``steps``: the
    schedule's (``call_traffic``'s default: every step, or only the own one without a ring
    section)."""
    traffic = call_traffic(SCHEME, sizes, call, ulysses, ring, steps).ring
    if traffic.forward_calls == 0:
        return HopTimes()
    bandwidth, latency = ((links.network_bytes_per_s, links.network_latency_s) if link == "network"
                          else (links.ring_nvlink_bytes_per_s, links.nvlink_latency_s))
    hops = traffic.forward_calls  # (S - 1) per head group, forward; as many KV hops backward
    forward = traffic.forward_bytes // hops
    backward_kv = forward + call.dtype.itemsize
    # the S dKV hops of a group: S - 1 before the last, which is a forward hop's size
    dkv_before_last = (traffic.backward_bytes - hops * backward_kv - groups * forward) / hops

    def seconds(count: float) -> float:
        return count / bandwidth + latency

    return HopTimes(seconds(forward), seconds(backward_kv), seconds(dkv_before_last), seconds(forward))
