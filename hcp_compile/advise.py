"""Which ``ulysses x ring`` mesh and placement for a user's batches (issue 26): a cost model
from measured parts and a chooser over the valid meshes.

    python -m hcp_compile.advise --world 64 --gpus-per-node 8 --heads 32/8 --head-dim 128 \\
        --lengths loguniform:256:32768 --tokens 1048576

The model predicts one causal forward + backward of one attention call per rank, as the sum of
explicit parts, each a pure function that a GPU measurement can check on its own:

- compute (:func:`compute_times`): each block's visible query-key pairs (from the real layout
  of the placement rule, :mod:`hcp_compile.layout`) times ``14 * head_dim`` FLOPs per pair
  and query head, at the TF/s that kernels/measured.json records for the kernel on the
  device kind and the block's composition (one document, log-uniform or short documents);
  the forward takes 1/3.5 of it (2 of the 7 products, docs/design.md §7);
- all-to-all (:func:`exchange_times`) and ring (:func:`hop_times`): the bytes that
  ``schemes.traffic.call_traffic`` counts for the rank, over the link of each level
  (:class:`Links`), plus a latency per collective;
- overlap (:func:`ring_forward`, :func:`ring_backward`, :func:`pipeline`): what the code
  overlaps (docs/design.md §3.3, §3.6, §4): every ring hop travels behind the step before the
  one that reads it, the backward's dKV hop behind the next step, its last hop exposed; head
  group ``g + 1``'s exchange behind group ``g``'s ring, group 0's behind the local region.

A step's time is its slowest rank's. Not modelled: per-call host work and launches (which
dominate batches of short documents on few ranks, docs/benchmarks.md), contention between an
all-to-all and ring hops on one NVLink domain, windows (only causal attention is measured for
every kernel).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tabulate import tabulate
from torch import Tensor

from . import layout
from .kernels import measured
from .layout import BatchLayout, Kind, RankSizes
from .packing import log_uniform_lengths
from .placements import PLACEMENTS, placement_rule
from .schedule import head_groups, rank_kv_heads
from .schemes.traffic import CallShape, call_traffic
from .validation import InputError, check_head_split

# FLOPs of one visible query-key pair per query head and unit of head dim, forward + backward:
# 7 products of 2 FLOPs (the count measured.json's TF/s are taken with, benchmarks/speed.py)
FLOPS_PER_PAIR_HEAD_DIM = 14
FORWARD_SHARE = 2 / 7  # the forward's 2 products (q k^T, p v) of the 7 (docs/design.md §7)
SCHEME = "ring"  # the collective scheme whose overlap the model describes (schemes/ring.py)
DEFAULT_DEVICE = "NVIDIA H200"
# predictions closer than this are called a tie: the parts are measured to a few percent
TIE = 0.01


@dataclass(frozen=True)
class Links:
    """Bandwidth (bytes/s, one direction, per GPU) and latency (s per collective) of each level.

    The bandwidths are the issue's H200 figures: ~440 GB/s for an all-to-all of 2 ranks and
    ~290 GB/s for a ring transfer over NVLink, measured, and 400 Gb/s per GPU across nodes,
    nominal. The latencies are assumptions to be measured on the GPU machines: they matter
    only where the steps are short (many ring ranks, small batches)."""

    all_to_all_bytes_per_s: float = 440e9
    ring_nvlink_bytes_per_s: float = 290e9
    network_bytes_per_s: float = 50e9
    nvlink_latency_s: float = 10e-6
    network_latency_s: float = 25e-6


@dataclass(frozen=True)
class Option:
    """One mesh and placement: ``make_mesh(ulysses=o.ulysses, ring=o.ring)``,
    ``shard_plan(..., placement=o.placement)``."""

    ulysses: int
    ring: int
    placement: str


@dataclass(frozen=True)
class BlockWork:
    """The causal query-key pairs of every block of every rank, each counted per query head of
    the block (a stream block runs ``1/A`` of the heads, so its pairs are divided by ``A``),
    and each block's composition (a key of measured.json, None for an empty block)."""

    local: Tensor  # [R, A] pairs of the local region (all heads)
    steps: Tensor  # [R, S] pairs of ring step s of ring rank r, per Ulysses rank (1/A heads)
    local_kind: list[list[str | None]]  # [R][A]
    step_kind: list[list[str | None]]  # [R][S]


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds of the compute of one rank: forward and backward of its local region and of
    each ring step (all head groups together)."""

    local_forward: float
    local_backward: float
    step_forward: tuple[float, ...]
    step_backward: tuple[float, ...]

    @property
    def total(self) -> float:
        return self.local_forward + self.local_backward + sum(self.step_forward) + sum(self.step_backward)


@dataclass(frozen=True)
class ExchangeTimes:
    """Seconds of one head group's all-to-alls: before its ring (q and KV; in the backward
    dout) and after it (the output; dq and dKV)."""

    forward_in: float = 0.0
    forward_out: float = 0.0
    backward_in: float = 0.0
    backward_out: float = 0.0


@dataclass(frozen=True)
class HopTimes:
    """Seconds of one head group's ring hops: a forward KV hop, a backward KV hop, a backward
    dKV hop before the last, the last dKV hop (the finished sum in the input dtype)."""

    forward: float = 0.0
    backward_kv: float = 0.0
    backward_dkv: float = 0.0
    last_dkv: float = 0.0


@dataclass(frozen=True)
class RankPrediction:
    """One rank's predicted forward + backward of one attention call, in seconds."""

    step: float
    compute: float
    exposed_all_to_all: float
    exposed_ring: float
    all_to_all_bytes: int
    ring_bytes: int


@dataclass(frozen=True)
class Prediction:
    """An option's prediction: the slowest rank's parts, averaged over the batches."""

    option: Option
    head_groups: int
    ring_link: str  # "nvlink", "network" or "-" (no ring)
    step_s: float
    compute_s: float
    mean_compute_s: float  # the mean rank's compute: step_s against it shows the imbalance
    exposed_all_to_all_s: float
    exposed_ring_s: float
    all_to_all_bytes: float  # per rank and call, the slowest rank's
    ring_bytes: float

    @property
    def ulysses(self) -> int:
        return self.option.ulysses

    @property
    def ring(self) -> int:
        return self.option.ring

    @property
    def placement(self) -> str:
        return self.option.placement

    @property
    def exposed_s(self) -> float:
        return self.exposed_all_to_all_s + self.exposed_ring_s


@dataclass(frozen=True)
class Advice:
    """The predictions, fastest first; ``best`` is the first."""

    predictions: tuple[Prediction, ...]
    kernel: str
    device_kind: str
    batches: int
    seconds: float  # how long the advice took

    @property
    def best(self) -> Prediction:
        return self.predictions[0]


# --------------------------------------------------------------------------------------------
# the options
# --------------------------------------------------------------------------------------------

def mesh_options(world: int, gpus_per_node: int, heads_q: int, heads_kv: int,
                 placements: Sequence[str] = tuple(PLACEMENTS)) -> list[Option]:
    """Every ``ulysses x ring = world`` whose Ulysses group lies inside one node (``ulysses``
    divides ``gpus_per_node``: a group is ``ulysses`` consecutive ranks) and can split the
    heads (:func:`validation.check_head_split`), with every placement."""
    _check_positive(world=world, gpus_per_node=gpus_per_node, heads_q=heads_q, heads_kv=heads_kv)
    if heads_q % heads_kv:
        raise InputError(f"heads: {heads_q} query heads are not a multiple of {heads_kv} "
                         "key/value heads; pass --heads HQ/HKV with HKV dividing HQ")
    for name in placements:
        if name not in PLACEMENTS:
            raise InputError(f"placements: expected names of {sorted(PLACEMENTS)}, got {name!r}")
    meshes = []
    for ulysses in range(1, min(world, gpus_per_node) + 1):
        if world % ulysses or gpus_per_node % ulysses:
            continue
        try:
            check_head_split(heads_q, heads_kv, ulysses)
        except InputError:
            continue
        meshes.append((ulysses, world // ulysses))
    return [Option(a, r, p) for a, r in meshes for p in placements]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name}: expected a positive int, got {value!r}")


# --------------------------------------------------------------------------------------------
# compute
# --------------------------------------------------------------------------------------------

def block_composition(segments: int, longest: int) -> str | None:
    """The measured composition a block is timed by; None for a block without segments.
    Unlike ``measured.composition`` (which judges a whole batch), a block whose longest
    segment is short is short whatever its segment count: a ring step of one document cut
    into 1K chunks runs at short-segment speed (the dense kernel hands such segments to
    flash), not at one 131K document's."""
    if segments == 0:
        return None
    if longest < measured.SHORT_DOCUMENT_ROWS:
        return measured.SHORT
    return measured.composition(False, segments, longest)


def block_work(batch: BatchLayout) -> BlockWork:
    """The pairs and compositions of every rank's blocks under ``batch``'s layout: the local
    region, the own ring step (the ring rank's own ring section, causal inside each document,
    and its GROUP documents) and the ring steps ``s`` against ring rank ``r - s``'s section
    (docs/design.md §3.3: ``LOWER`` for an earlier source, ``UPPER`` for a later one). Real
    tokens only: pads see nothing."""
    lengths, ring, ulysses = batch.lengths, batch.ring, batch.ulysses
    is_local, is_group, is_ring = (batch.kind == k for k in (Kind.LOCAL, Kind.GROUP, Kind.RING))
    whole = (lengths * (lengths + 1) // 2).double()
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

    first, second = real(index), real(2 * ring - 1 - index)  # [R, n_ring]
    own = (first * (first + 1) / 2 + second * (second + 1) / 2 + first * second).sum(1)
    lower = (first + second) @ first.T  # [r, src]: every held query, the source's first chunk
    upper = second @ (first + second).T  # [r, src]: the second chunk's queries, both chunks
    source = (index - torch.arange(ring)[None, :]) % ring  # [r, s]: step s reads r - s
    rows = index.expand(ring, ring)
    steps = torch.where(source < rows, lower[rows, source], upper[rows, source])
    steps[:, 0] = own + group
    n_ring, chunk_max = int(is_ring.sum()), int(chunk.max()) if chunk.numel() else 0
    step_kind = [
        [block_composition(n_ring + int(group_count[r]), max(2 * chunk_max, int(group_longest[r])))]
        + [block_composition(n_ring, chunk_max)] * (ring - 1)
        for r in range(ring)
    ]
    local_kind = [[block_composition(int(local_count[r, a]), int(local_longest[r, a]))
                   for a in range(ulysses)] for r in range(ring)]
    return BlockWork(local, steps / ulysses, local_kind, step_kind)


def kernel_throughput(kernel: str, device_kind: str, composition: str) -> float:
    """FLOP/s (forward + backward) measured for ``kernel`` on ``device_kind`` for a batch of
    ``composition`` (kernels/measured.json)."""
    table = measured.throughputs(composition)
    if device_kind not in table:
        raise InputError(f"device_kind: no measurements for {device_kind!r} in "
                         f"kernels/measured.json; expected one of {sorted(table)} (run "
                         "scripts/measure_kernels.py on that device to add it)")
    if kernel not in table[device_kind]:
        raise InputError(f"kernel: {kernel!r} was not measured on {device_kind!r}; expected "
                         f"one of {sorted(table[device_kind])}")
    return table[device_kind][kernel]


def compute_times(work: BlockWork, ring_rank: int, ulysses_rank: int, call: CallShape,
                  kernel: str, device_kind: str) -> ComputeTimes:
    """Seconds of rank ``(ring_rank, ulysses_rank)``'s blocks: pairs x ``14 D`` FLOPs per
    query head, at the measured throughput of each block's composition."""
    flops_per_pair = FLOPS_PER_PAIR_HEAD_DIM * call.head_dim * call.heads_q

    def seconds(pairs: float, composition: str | None) -> float:
        if composition is None or pairs == 0:
            return 0.0
        return pairs * flops_per_pair / kernel_throughput(kernel, device_kind, composition)

    local = seconds(float(work.local[ring_rank, ulysses_rank]), work.local_kind[ring_rank][ulysses_rank])
    steps = [seconds(float(p), kind) for p, kind in zip(work.steps[ring_rank].tolist(), work.step_kind[ring_rank])]
    return ComputeTimes(
        local * FORWARD_SHARE, local * (1 - FORWARD_SHARE),
        tuple(s * FORWARD_SHARE for s in steps), tuple(s * (1 - FORWARD_SHARE) for s in steps),
    )


# --------------------------------------------------------------------------------------------
# communication
# --------------------------------------------------------------------------------------------

def rank_sizes(batch: BatchLayout, ring_rank: int, ulysses_rank: int) -> RankSizes:
    """The rank's :class:`RankSizes` read off the layout, equal to
    ``PreparedBatch.rank_sizes`` (tested) without its per-step tables, which cost seconds
    per rank on 512 ranks: every step has the ring documents and the ring rank's GROUP
    documents as entries (the own stream holds the queries of both)."""
    is_ring = (batch.kind == Kind.RING) & (batch.lengths > 0)
    group = (batch.kind == Kind.GROUP) & (batch.ring_rank == ring_rank) & (batch.lengths > 0)
    entries = int(is_ring.sum() + group.sum())
    return RankSizes(
        int(batch.local_tokens), int(batch.local_extent[ring_rank, ulysses_rank]),
        tuple(batch.exchange_extent[ring_rank].tolist()), int(batch.ring_width), ulysses_rank,
        int(batch.is_local_on(ring_rank, ulysses_rank).sum()),
        (entries,) * batch.ring,
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
    return RankSizes(sizes.tokens, sizes.local, exchange, sizes.ring_width, sizes.ulysses_rank,
                     sizes.local_entries, sizes.step_entries)


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
              links: Links, groups: int) -> HopTimes:
    """One head group's ring hops, from ``call_traffic``'s bytes (``S - 1`` forward hops;
    ``S - 1`` KV hops, as large as a forward hop plus the one carried element, and ``S`` dKV
    hops in the backward, the last one the finished sum in the input dtype: a forward hop's
    size, schemes/ring.py). A hop is a collective of its own: one latency each."""
    traffic = call_traffic(SCHEME, sizes, call, ulysses, ring).ring
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


# --------------------------------------------------------------------------------------------
# overlap
# --------------------------------------------------------------------------------------------

def ring_forward(steps: Sequence[float], hop: float) -> float:
    """One head group's forward ring: the hop for step ``s + 1`` travels while step ``s``
    computes (docs/design.md §3.3), so a step lasts the longer of the two; the last step
    has no hop after it."""
    return sum(max(compute, hop) for compute in steps[:-1]) + steps[-1]


def ring_backward(steps: Sequence[float], hops: HopTimes) -> float:
    """One head group's backward ring (docs/design.md §4): during step ``s`` the link carries
    the KV hop for step ``s + 1`` and the dKV accumulator of step ``s - 1`` (both to the next
    ring rank), each step lasting the longer of its compute and its link; the last dKV hop,
    home to the keys' owner, is waited for after the last step: exposed."""
    if len(steps) == 1:
        return steps[0]
    total = 0.0
    for s, compute in enumerate(steps):
        link = (hops.backward_kv if s + 1 < len(steps) else 0.0) + (hops.backward_dkv if s > 0 else 0.0)
        total += max(compute, link)
    return total + hops.last_dkv


def pipeline(local: float, exchange_in: float, rings: Sequence[float], exchange_out: float) -> float:
    """One direction of a call over its head groups (docs/design.md §3.6): group 0's exchange
    is issued first and travels while the local region computes; each group ``g`` issues
    group ``g + 1``'s exchange, waits for its own, runs its ring and issues its result's way
    back; the all-to-alls queue on the Ulysses link in that order; the call ends when the
    last result is back."""
    link = exchange_in  # when the Ulysses link is free; group 0's exchange issued at 0
    arrived = [exchange_in]
    clock = local  # the compute stream
    for g, ring_time in enumerate(rings):
        if g + 1 < len(rings):
            link = max(clock, link) + exchange_in
            arrived.append(link)
        clock = max(clock, arrived[g]) + ring_time
        link = max(clock, link) + exchange_out
    return max(clock, link)


def predict_rank(compute: ComputeTimes, exchange: ExchangeTimes, hops: HopTimes,
                 groups: int) -> tuple[float, float, float]:
    """``(step, exposed all-to-all, exposed ring)`` seconds of one rank: both directions'
    pipelines; the ring's exposed time is what its hops add to its steps' compute, the
    all-to-all's what is left."""
    forward_steps = [t / groups for t in compute.step_forward]
    backward_steps = [t / groups for t in compute.step_backward]
    ring_f = ring_forward(forward_steps, hops.forward)
    ring_b = ring_backward(backward_steps, hops)
    step = (pipeline(compute.local_forward, exchange.forward_in, [ring_f] * groups, exchange.forward_out)
            + pipeline(compute.local_backward, exchange.backward_in, [ring_b] * groups, exchange.backward_out))
    exposed_ring = groups * (ring_f + ring_b) - sum(compute.step_forward) - sum(compute.step_backward)
    return step, step - compute.total - exposed_ring, exposed_ring


# --------------------------------------------------------------------------------------------
# an option's prediction, the chooser
# --------------------------------------------------------------------------------------------

def predict_batch(cu_seqlens: Tensor, option: Option, gpus_per_node: int, call: CallShape,
                  kernel: str, device_kind: str, links: Links) -> tuple[RankPrediction, float]:
    """The slowest rank's prediction for one batch, and the mean rank's compute."""
    ulysses, ring = option.ulysses, option.ring
    batch = layout.batch_layout(cu_seqlens, ulysses, ring, placement_rule(option.placement))
    work = block_work(batch)
    groups = head_groups(rank_kv_heads(call.heads_kv, ulysses), ulysses)
    link = ring_link(ulysses, ring, gpus_per_node)
    ranks = []
    for r in range(ring):
        sizes = [rank_sizes(batch, r, a) for a in range(ulysses)]
        moved = [exchange_bytes(s, call, ulysses, ring) for s in sizes]
        slowest = tuple(max(column) for column in zip(*moved))
        exchange = exchange_times(slowest, links, groups)
        hops = hop_times(sizes[0], call, ulysses, ring, link, links, groups)
        ring_bytes = call_traffic(SCHEME, sizes[0], call, ulysses, ring).ring
        for a in range(ulysses):
            compute = compute_times(work, r, a, call, kernel, device_kind)
            step, a2a, exposed_ring = predict_rank(compute, exchange, hops, groups)
            ranks.append(RankPrediction(step, compute.total, a2a, exposed_ring, sum(moved[a]),
                                        ring_bytes.forward_bytes + ring_bytes.backward_bytes))
    return max(ranks, key=lambda p: p.step), sum(p.compute for p in ranks) / len(ranks)


def predict(batches: Sequence[Tensor], option: Option, gpus_per_node: int, call: CallShape,
            kernel: str, device_kind: str, links: Links) -> Prediction:
    """``option``'s prediction: the slowest rank of each batch, averaged over ``batches``."""
    slowest, means = zip(*(predict_batch(b, option, gpus_per_node, call, kernel, device_kind, links)
                           for b in batches))

    def average(values: Sequence[float]) -> float:
        return sum(values) / len(values)

    groups = head_groups(rank_kv_heads(call.heads_kv, option.ulysses), option.ulysses)
    return Prediction(
        option, groups, ring_link(option.ulysses, option.ring, gpus_per_node),
        average([p.step for p in slowest]), average([p.compute for p in slowest]), average(means),
        average([p.exposed_all_to_all for p in slowest]), average([p.exposed_ring for p in slowest]),
        average([p.all_to_all_bytes for p in slowest]), average([p.ring_bytes for p in slowest]),
    )


def cuda_kernel(device_kind: str) -> str:
    """The kernel ``kernel="auto"`` takes under CP on ``device_kind`` with every measured
    kernel installed: the best mean over the unwindowed compositions (docs/design.md §8.2)."""
    table = measured.throughputs()
    if device_kind not in table:
        raise InputError(f"device_kind: no measurements for {device_kind!r} in "
                         f"kernels/measured.json; expected one of {sorted(table)}")
    return max(table[device_kind], key=table[device_kind].__getitem__)


def advise(batches: Tensor | Sequence[Tensor], *, world: int, gpus_per_node: int, heads_q: int,
           heads_kv: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
           placements: Sequence[str] = tuple(PLACEMENTS), kernel: str = "auto",
           device_kind: str = DEFAULT_DEVICE, links: Links = Links()) -> Advice:
    """Predict every valid mesh and placement (:func:`mesh_options`) on ``batches`` (one
    global int32 ``cu_seqlens`` or a sample of them) and rank them, fastest first:
    ``advice.best`` has ``ulysses``, ``ring`` and ``placement`` for ``make_mesh`` and
    ``shard_plan``. ``kernel="auto"``: the one CP's auto takes on ``device_kind``."""
    started = time.perf_counter()
    batches = [batches] if isinstance(batches, Tensor) else list(batches)
    if not batches:
        raise InputError("batches: expected a cu_seqlens tensor or a non-empty list of them")
    for i, cu in enumerate(batches):
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 \
                or bool((cu[1:] < cu[:-1]).any()):
            raise InputError(f"batches[{i}]: expected a 1-D cu_seqlens starting at 0, "
                             "non-decreasing, with at least one document; pass the global "
                             "cumulative document lengths")
    _check_positive(head_dim=head_dim)
    kernel = cuda_kernel(device_kind) if kernel == "auto" else kernel
    call = CallShape(heads_q, heads_kv, head_dim, dtype)
    options = mesh_options(world, gpus_per_node, heads_q, heads_kv, placements)
    if not options:
        raise InputError(f"world: no ulysses x ring = {world} has a Ulysses group inside a node "
                         f"of {gpus_per_node} GPUs that splits {heads_q}/{heads_kv} heads")
    predictions = sorted(
        (predict(batches, o, gpus_per_node, call, kernel, device_kind, links) for o in options),
        key=lambda p: (p.step_s, p.exposed_s),
    )
    return Advice(tuple(predictions), kernel, device_kind, len(batches), time.perf_counter() - started)


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------

def format_table(advice: Advice) -> str:
    rows = [[
        f"{p.ulysses} x {p.ring}", p.placement, p.head_groups, p.ring_link,
        f"{p.step_s * 1e3:.2f}", f"{p.compute_s * 1e3:.2f}",
        f"{(p.compute_s / p.mean_compute_s - 1) * 100:.1f}" if p.mean_compute_s else "0.0",
        f"{p.exposed_all_to_all_s * 1e3:.2f}", f"{p.exposed_ring_s * 1e3:.2f}",
        f"{p.exposed_s / p.step_s * 100:.1f}" if p.step_s else "0.0",
        f"{p.all_to_all_bytes / 2**20:.1f}", f"{p.ring_bytes / 2**20:.1f}",
    ] for p in advice.predictions]
    headers = ["ulysses x ring", "placement", "head groups", "ring link", "step ms",
               "compute ms", "over mean %", "exposed a2a ms", "exposed ring ms", "exposed %",
               "a2a MiB", "ring MiB"]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def reasons(advice: Advice) -> list[str]:
    """Why the best option wins: against the runner-up, and against the best option of every
    other mesh, the part (compute of the slowest rank, exposed all-to-all, exposed ring) that
    makes most of the difference."""
    best = advice.best
    lines = [f"best: ulysses {best.ulysses} x ring {best.ring}, placement {best.placement!r}: "
             f"{best.step_s * 1e3:.2f} ms per call per rank, {best.exposed_s * 1e3:.2f} ms of it "
             f"exposed communication"]
    rivals: list[Prediction] = []
    for p in advice.predictions[1:]:
        if p is advice.predictions[1] or all((p.ulysses, p.ring) != (q.ulysses, q.ring) for q in rivals + [best]):
            rivals.append(p)
    close = [p for p in advice.predictions[1:] if p.step_s <= best.step_s * (1 + TIE)]
    if close:
        names = ", ".join(f"{p.ulysses} x {p.ring} {p.placement!r}" for p in close)
        lines.append(f"within {TIE:.0%} of the best (a tie at the model's accuracy): {names}")
    for p in rivals:
        parts = {
            "compute of its slowest rank": p.compute_s - best.compute_s,
            "exposed all-to-all": p.exposed_all_to_all_s - best.exposed_all_to_all_s,
            "exposed ring": p.exposed_ring_s - best.exposed_ring_s,
        }
        part = max(parts, key=parts.__getitem__)
        lines.append(
            f"vs ulysses {p.ulysses} x ring {p.ring} {p.placement!r}: {p.step_s * 1e3:.2f} ms "
            f"(+{(p.step_s / best.step_s - 1) * 100 if best.step_s else 0:.1f} %), mostly "
            f"{part} (+{parts[part] * 1e3:.2f} ms)"
        )
    return lines


def format_advice(advice: Advice) -> str:
    return "\n".join([
        format_table(advice), "",
        *reasons(advice), "",
        f"kernel {advice.kernel!r} at its {advice.device_kind} measurements, {advice.batches} "
        f"batch(es), advised in {advice.seconds:.2f} s; use make_mesh(ulysses="
        f"{advice.best.ulysses}, ring={advice.best.ring}) and placement={advice.best.placement!r}",
    ])


# --------------------------------------------------------------------------------------------
# batches for the command
# --------------------------------------------------------------------------------------------

def cu_seqlens_of(lengths: Sequence[int]) -> Tensor:
    return torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.int32)


def batches_from(spec: str, tokens: int, count: int, seed: int) -> list[Tensor]:
    """``"one"``: one document of ``tokens``; ``"loguniform:LOW:HIGH"``: ``count`` batches of
    ``tokens`` drawn with seeds ``seed..``; otherwise a file, one batch per line of
    whitespace-separated document lengths."""
    if spec == "one":
        return [cu_seqlens_of([tokens])]
    if spec.startswith("loguniform:"):
        try:
            low, high = (int(x) for x in spec.split(":")[1:])
        except ValueError:
            raise InputError(f"lengths: expected loguniform:LOW:HIGH with ints, got {spec!r}") from None
        if not 1 <= low <= high:
            raise InputError(f"lengths: expected 1 <= LOW <= HIGH in loguniform:LOW:HIGH, got {spec!r}")
        return [cu_seqlens_of(log_uniform_lengths(tokens, low, high, seed + i)) for i in range(count)]
    path = Path(spec)
    if not path.is_file():
        raise InputError(f"lengths: expected 'one', 'loguniform:LOW:HIGH' or a file of document "
                         f"lengths (one batch per line), got {spec!r}, which is no file")
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
    try:
        return [cu_seqlens_of([int(x) for x in line]) for line in lines]
    except ValueError:
        raise InputError(f"lengths: {spec} must hold whitespace-separated int lengths, one batch per line") from None


def parse_heads(text: str) -> tuple[int, int]:
    try:
        heads_q, heads_kv = (int(x) for x in text.split("/"))
    except ValueError:
        raise InputError(f"heads: expected HQ/HKV (e.g. 32/8), got {text!r}") from None
    return heads_q, heads_kv


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m hcp_compile.advise", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, required=True, help="GPUs of the CP mesh")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--heads", default="32/8", help="query/key-value heads, e.g. 32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--lengths", default="loguniform:256:32768",
                        help="'one', 'loguniform:LOW:HIGH' or a file (one batch of lengths per line)")
    parser.add_argument("--tokens", type=int, default=1 << 20, help="tokens per drawn batch")
    parser.add_argument("--batches", type=int, default=1, help="drawn batches to average over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--device-kind", default=DEFAULT_DEVICE)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    defaults = Links()
    parser.add_argument("--all-to-all-gbs", type=float, default=defaults.all_to_all_bytes_per_s / 1e9,
                        help="NVLink all-to-all GB/s per GPU and direction")
    parser.add_argument("--ring-nvlink-gbs", type=float, default=defaults.ring_nvlink_bytes_per_s / 1e9)
    parser.add_argument("--network-gbs", type=float, default=defaults.network_bytes_per_s / 1e9,
                        help="across nodes, GB/s per GPU and direction (400 Gb/s = 50)")
    parser.add_argument("--nvlink-latency-us", type=float, default=defaults.nvlink_latency_s * 1e6)
    parser.add_argument("--network-latency-us", type=float, default=defaults.network_latency_s * 1e6)
    args = parser.parse_args(argv)
    heads_q, heads_kv = parse_heads(args.heads)
    links = Links(args.all_to_all_gbs * 1e9, args.ring_nvlink_gbs * 1e9, args.network_gbs * 1e9,
                  args.nvlink_latency_us * 1e-6, args.network_latency_us * 1e-6)
    batches = batches_from(args.lengths, args.tokens, args.batches, args.seed)
    advice = advise(batches, world=args.world, gpus_per_node=args.gpus_per_node, heads_q=heads_q,
                    heads_kv=heads_kv, head_dim=args.head_dim, dtype=getattr(torch, args.dtype),
                    placements=[p for p in args.placements.split(",") if p], kernel=args.kernel,
                    device_kind=args.device_kind, links=links)
    return format_advice(advice)


if __name__ == "__main__":
    try:
        print(main())
    except InputError as error:
        sys.exit(f"error: {error}")
