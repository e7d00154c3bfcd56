"""``scheme="ring"``: the zigzag ring of KV transfers (docs/design.md §3.3, §4): ``R - 1`` hops
of the ring section forward, and in the backward the same hops with a dKV accumulator that
follows the keys round the ring, ``R`` hops, back to their owner."""

from __future__ import annotations

import torch
from torch import Tensor

from hcp_compile.exchange.collectives import arrived, ring_shift
from hcp_compile.exchange.schemes.protocol import GroupShape, GroupTraffic
from hcp_compile.exchange.schemes.sections import SectionRing, SectionSteps
from hcp_compile.kernels.merge import accumulate
from hcp_compile.kernels.precision import accumulate_dtype


class _Hops(SectionSteps):
    """The keys of each step, each received section sent on to the next ring rank.

    ::

        step 0: kv = own stream    issue hop of own section -->  r+1
        step 1: wait  <-- r-1      issue hop of what arrived -->  r+1
        ...
        step S-1: wait <-- r-S+1   (no further hop)
    """

    _message: Tensor | None = None  # the section in hand: sent on by the next hop
    _incoming: Tensor | None = None  # the hop in flight

    def _start(self, message: Tensor) -> None:
        self._message = message

    def kv(self, step: int) -> Tensor:
        if step > 0:
            self._message = arrived(self._incoming, self._message.shape)
        if step + 1 < self._steps:  # issued before this step computes, so the two overlap
            self._incoming = ring_shift(self._message, self._groups.ring_group,
                                        self._groups.ring_rank, self._groups.ring_size)
        if step == 0:
            return self._kv
        return self._section_of(self._message)


class _HopsWithGrads(_Hops):
    """Also a dKV accumulator of the section in hand, sent on after each step, the last hop
    straight home: after ``S`` hops it is back at the owner of the keys, holding every ring
    rank's share (on a full ring, ``S = R``, the last hop is the next one round; a window's
    schedule may stop after fewer steps, layout.window_steps). Sums of several blocks are kept
    in the accumulation dtype; a block's own gradient and the finished sum travel in the input
    dtype, which rounds nothing that the result would not."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._travelling: Tensor | None = None

    def add(self, step: int, dkv: Tensor | None) -> None:
        kv, groups, last = self._kv, self._groups, step == self._steps - 1
        if self._travelling is not None:
            received = arrived(self._travelling, self._section)
            if dkv is None:  # every rank sends the same dtype at each step
                dkv = received.to(accumulate_dtype(kv.dtype))
            else:  # the last hop sends the finished sum in kv's dtype: written so at once
                dkv = accumulate(received, dkv, out_dtype=kv.dtype if last else None)
        if dkv is None:
            dkv = torch.zeros(self._section, dtype=kv.dtype, device=kv.device)
        if self._steps == 1:
            self._travelling = dkv
            return
        # the accumulator in hand is that of ring rank r - step's section: home is step back
        self._travelling = ring_shift(dkv.to(kv.dtype) if last else dkv, groups.ring_group,
                                      groups.ring_rank, groups.ring_size, by=-step if last else 1)

    def result(self) -> Tensor:
        if self._steps == 1:
            return self._travelling.to(self._kv.dtype)
        return arrived(self._travelling, self._section).to(self._kv.dtype)


class ZigzagRing(SectionRing):
    """Point-to-point hops, each issued before the step that it overlaps: the transfer for
    step ``s + 1`` travels while step ``s`` computes. Holds two sections of KV at a time."""

    name = "ring"
    forward_steps, backward_steps = _Hops, _HopsWithGrads

    def traffic(self, shape: GroupShape) -> GroupTraffic:
        """Forward ``S - 1`` hops of a section; backward ``S - 1`` hops of a section and the
        carried element, and ``S`` hops of the dKV accumulator (the last one home): the first
        a block's own gradient and the last the finished sum in the input dtype, those
        between sums in the accumulation dtype."""
        steps, section, item = shape.steps, shape.section, shape.itemsize
        if steps == 1:
            return GroupTraffic()
        gradients = section * (2 * item + (steps - 2) * shape.accumulate_itemsize)
        return GroupTraffic(
            forward_calls=steps - 1, backward_calls=2 * steps - 1,
            forward_bytes=(steps - 1) * section * item,
            backward_bytes=(steps - 1) * (section + 1) * item + gradients,
        )
