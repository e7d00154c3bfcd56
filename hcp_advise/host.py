"""The host part: the seconds one rank's host takes to issue its call, from the call counts of
its layout and the constants measured for the device, mode and kernel
(hcp_advise/host_measured.json), and how the GPU waits for it."""

from __future__ import annotations

import functools

import torch

from hcp_compile.batch.layout import RankSizes, StepKind, schedule_steps, step_kind, step_sources
from hcp_compile.batch.schedule import exchanged_head_groups
from hcp_compile.kernels import KERNELS, BlockSpec

from .host_measured import HostConstants, HostRecord
from .records import HostCounts, PhaseTimes


@functools.cache
def kernel_calls(kernel: str, kind: StepKind | None) -> int:
    """Kernel invocations of one block that has queries and keys: the kernel's own count
    (its optional ``calls(spec)``, :class:`hcp_compile.kernels.contract.Kernel`) on a spec
    flagged as the schedule flags it (``kind`` None: the local region, one segmentation for
    both sides; the own step causal with equal lengths; the other steps not causal:
    ``hierarchical._local_spec``, ``_step_spec``); one call for a kernel that has none."""
    count = getattr(KERNELS.get(kernel), "calls", None)
    if count is None:
        return 1
    cu = torch.zeros(2, dtype=torch.int32)
    diagonal = kind is StepKind.DIAGONAL
    spec = BlockSpec(cu, cu if kind is None else cu.clone(), 1, 1, kind is None or diagonal, 1.0, -1, -1,
                     equal_lengths=diagonal)
    return count(spec)


def host_counts(sizes: RankSizes, ring_rank: int, ring: int, kernel: str, heads_kv: int,
                steps: int | None = None) -> HostCounts:
    """The counts of rank ``(ring_rank, sizes.ulysses_rank)``'s eager call (causal, no window)
    with ``heads_kv`` KV heads: the local region, then in each head group the schedule's
    ``steps`` (default ``layout.schedule_steps``: only the own one without a ring section;
    no head group where nothing is exchanged, ``schedule.exchanged_head_groups``). A block
    without queries or keys costs its op but calls no kernel (the kernels return at once)."""
    steps = schedule_steps(sizes, ring) if steps is None else steps
    groups = exchanged_head_groups(sizes, steps, heads_kv, len(sizes.exchange))
    calls = kernel_calls(kernel, None) if sizes.local else 0
    for index, source in enumerate(step_sources(ring_rank, ring, steps)):
        keys = sizes.stream if index == 0 else sizes.ring_width
        if sizes.stream and keys:
            calls += groups * kernel_calls(kernel, step_kind(ring_rank, source, True))
    return HostCounts(calls, groups * steps, groups)


def phase_seconds(counts: HostCounts, constants: HostConstants) -> float:
    """One phase's host seconds under the fitted linear model, never below 0."""
    return max(0.0, constants.floor_s + constants.per_call_s * counts.calls + constants.per_step_s * counts.steps
               + constants.per_group_s * counts.groups)


def host_times(counts: HostCounts, record: HostRecord | None) -> PhaseTimes:
    """The rank's host seconds per phase; 0 without a record (the host part not modelled)."""
    if record is None:
        return PhaseTimes()
    return PhaseTimes(phase_seconds(counts, record.forward), phase_seconds(counts, record.backward))


def lead_counts(sizes: RankSizes, ring_rank: int, ring: int, kernel: str, heads_kv: int,
                steps: int | None = None) -> HostCounts:
    """What the rank's host issues in each phase before its first attention kernel (the GPU has
    nothing else of the call to run until then): the call's own work (the floor), the first head
    group's exchange (issued first), and the first block's kernel calls: the local region's, or
    where it has none the own ring step's (one ring-step iteration). Counted as
    :func:`host_counts` counts, in a :class:`HostCounts` for :func:`phase_seconds`."""
    steps = schedule_steps(sizes, ring) if steps is None else steps
    groups = min(1, exchanged_head_groups(sizes, steps, heads_kv, len(sizes.exchange)))
    if sizes.local:
        return HostCounts(kernel_calls(kernel, None), 0, groups)
    if sizes.stream:
        return HostCounts(kernel_calls(kernel, step_kind(ring_rank, ring_rank, True)), 1, groups)
    return HostCounts(0, 0, groups)


def host_leads(sizes: RankSizes, ring_rank: int, ring: int, kernel: str, heads_kv: int,
               record: HostRecord | None, steps: int | None = None) -> PhaseTimes:
    """The host seconds of each phase before its first kernel (:func:`lead_counts`); 0 without a
    record."""
    if record is None:
        return PhaseTimes()
    counts = lead_counts(sizes, ring_rank, ring, kernel, heads_kv, steps)
    return PhaseTimes(phase_seconds(counts, record.forward), phase_seconds(counts, record.backward))


def step_with_host(device: PhaseTimes, host: PhaseTimes, lead: PhaseTimes = PhaseTimes(),
                   tail: PhaseTimes = PhaseTimes()) -> float:
    """The step of one call issued alone (forward, then at once its backward, as the check
    measures a rank): the GPU needs ``device`` per phase, the host ``host``, of which ``lead``
    comes before the phase's first kernel, and ``tail`` is the GPU time of a phase's last block
    (issued when the host is nearly done with the phase). The host issues every kernel in order
    and never waits for the GPU, so:

    - a phase's GPU work starts once the host has issued its first kernel (``lead`` after the
      host began the phase) and once the GPU has finished the forward: the forward's lead is
      exposed, the backward's runs under the forward's GPU work;
    - a phase ends when its GPU work is done, and not before the host has issued its last
      block (its whole host time) and the GPU has run it (``tail``).

    Where the host takes longer than the GPU the step is the host's time plus a tail; where the
    GPU does, the GPU's plus the forward's lead. Measured against one rank alone:
    docs/benchmarks.md, "Advisor check"."""
    forward = max(lead.forward + device.forward, host.forward + tail.forward)
    start = max(forward, host.forward + lead.backward)
    return max(start + device.backward, host.forward + host.backward + tail.backward)
