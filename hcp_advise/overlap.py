"""The overlap rules the code has: ring hops behind the steps, the last dKV hop exposed, head-group
pipelining of the all-to-all, the GPU waiting for the host's launches."""

from __future__ import annotations

from collections.abc import Sequence

from .host import step_with_host
from .records import ComputeTimes, ExchangeTimes, HopTimes, Passes, PhaseTimes


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
                 groups: int, host: PhaseTimes = PhaseTimes(), passes: Passes = Passes(),
                 lead: PhaseTimes = PhaseTimes()) -> tuple[float, float, float, float]:
    """``(step, exposed all-to-all, exposed ring, host wait)`` seconds of one rank: both
    directions' pipelines, a ring step lasting its kernels and its passes (``passes.step_*``:
    they run on the compute stream while the next hop travels), each phase's other passes after
    its pipeline (packing precedes an exchange and joining follows one, on the compute stream);
    then the GPU waiting for the host's launches (:func:`host.step_with_host`, ``host`` and its
    ``lead``; the tail is a phase's last block). The ring's exposed time is what its hops add to
    its steps' compute and passes, the all-to-all's what the exchanges add to that, the host
    wait what the host adds to the GPU's time."""
    def with_passes(times: tuple[float, ...], extra: tuple[float, ...]) -> list[float]:
        # the schedule may have fewer steps than the ring (none beyond the own one without a ring section)
        extra = (*extra, *(0.0,) * (len(times) - len(extra)))
        return [(t + p) / groups for t, p in zip(times, extra)]

    forward_steps = with_passes(compute.step_forward, passes.step_forward)
    backward_steps = with_passes(compute.step_backward, passes.step_backward)
    ring_f = ring_forward(forward_steps, hops.forward)
    ring_b = ring_backward(backward_steps, hops)
    forward = pipeline(compute.local_forward, exchange.forward_in, [ring_f] * groups, exchange.forward_out)
    backward = pipeline(compute.local_backward, exchange.backward_in, [ring_b] * groups, exchange.backward_out)
    # the same pipelines without the exchanges, and without the hops too
    ringed = (pipeline(compute.local_forward, 0.0, [ring_f] * groups, 0.0)
              + pipeline(compute.local_backward, 0.0, [ring_b] * groups, 0.0))
    plain = (pipeline(compute.local_forward, 0.0, [sum(forward_steps)] * groups, 0.0)
             + pipeline(compute.local_backward, 0.0, [sum(backward_steps)] * groups, 0.0))
    device = PhaseTimes(forward + passes.forward, backward + passes.backward)
    tail = PhaseTimes(_last_block(forward_steps, compute.local_forward),
                      _last_block(backward_steps, compute.local_backward))
    step = step_with_host(device, host, lead, tail)
    return step, forward + backward - ringed, ringed - plain, step - (device.forward + device.backward)


def _last_block(steps: list[float], local: float) -> float:
    """The GPU time of a phase's last block: its last computing ring step (one head group's),
    else its local region."""
    return next((t for t in reversed(steps) if t > 0), local)
