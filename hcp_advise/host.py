"""The host part: the seconds one rank's host takes to issue its call, from the call counts of
its layout and the constants measured for the device, mode and kernel
(hcp_advise/host_measured.json), and how they bound the rank's step."""

from __future__ import annotations

import functools

import torch

from hcp_compile.batch.layout import RankSizes, StepKind, step_kind, step_sources
from hcp_compile.batch.schedule import exchanged_head_groups, schedule_steps
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


def host_counts(sizes: RankSizes, ring_rank: int, ring: int, kernel: str, heads_kv: int) -> HostCounts:
    """The counts of rank ``(ring_rank, sizes.ulysses_rank)``'s eager call (causal, no window)
    with ``heads_kv`` KV heads: the local region, then in each head group the schedule's steps
    (only the own one without a ring section, ``schedule.schedule_steps``; no head group where
    nothing is exchanged, ``schedule.exchanged_head_groups``). A block without queries or keys
    costs its op but calls no kernel (the kernels return at once)."""
    steps = schedule_steps(sizes, ring)
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


def bounded_by_host(device_forward: float, device_backward: float, host: PhaseTimes) -> float:
    """The step of a rank whose GPU needs ``device_forward`` and ``device_backward`` seconds
    and whose host needs ``host``: per phase the longer of the two. The host issues every
    kernel of a phase in order, so the GPU cannot finish the phase before the host has issued
    its last kernel; and it cannot finish before its own work. Per phase rather than over the
    whole call, because a phase's host work is not hidden under the other phase's GPU work in
    a model's step (the backward starts after the loss, the next layer's forward waits for
    this one's output). Measured against one rank alone: docs/benchmarks.md, "Advisor check"."""
    return max(host.forward, device_forward) + max(host.backward, device_backward)
