"""The overlap rules the code has: ring hops behind the steps, the last dKV hop exposed, head-group
pipelining of the all-to-all, the GPU behind the host."""

from __future__ import annotations

from collections.abc import Sequence

from .host import bounded_by_host
from .records import ComputeTimes, ExchangeTimes, HopTimes, PhaseTimes


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
                 groups: int, host: PhaseTimes = PhaseTimes()) -> tuple[float, float, float]:
    """``(step, exposed all-to-all, exposed ring)`` seconds of one rank: both directions'
    pipelines, each phase waiting for the host where ``host`` takes longer
    (:func:`host.bounded_by_host`); the ring's exposed time is what its hops add to its
    steps' compute, the all-to-all's what is left of the pipelines."""
    forward_steps = [t / groups for t in compute.step_forward]
    backward_steps = [t / groups for t in compute.step_backward]
    ring_f = ring_forward(forward_steps, hops.forward)
    ring_b = ring_backward(backward_steps, hops)
    forward = pipeline(compute.local_forward, exchange.forward_in, [ring_f] * groups, exchange.forward_out)
    backward = pipeline(compute.local_backward, exchange.backward_in, [ring_b] * groups, exchange.backward_out)
    exposed_ring = groups * (ring_f + ring_b) - sum(compute.step_forward) - sum(compute.step_backward)
    return (bounded_by_host(forward, backward, host),
            forward + backward - compute.total - exposed_ring, exposed_ring)
