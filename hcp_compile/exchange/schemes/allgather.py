"""``scheme="allgather"``: every ring section in one all-gather, and the gradients back in one
all-to-all, instead of ``R - 1`` (forward) and ``2R - 1`` (backward) hops.

Better when the ring steps are short: each hop is a collective whose latency (tens of
microseconds on NCCL, more across nodes) is paid in series with the steps, and a step whose
blocks are small cannot hide it; one collective pays it once, and it travels while the own
step computes. The price is memory, ``R`` sections of KV at once instead of two, and the
overlap of later steps (they all wait for the one transfer). It also sends one section fewer
in the backward: each gradient goes straight to its owner, where the ring's accumulator makes
a last hop home. Each gradient travels rounded once to the input dtype and is summed on
arrival in the accumulation dtype (the ring rounds its running sum once, on the last hop).

Since every section arrives at once, a causal call without a window by position computes the
steps after the own one as one gathered step (Note [one gathered step] in batch/layout.py):
its keys copied out of the sections, one kernel call, one merge."""

from __future__ import annotations

import torch
from torch import Tensor

from hcp_compile.exchange.collectives import arrived, gather_sections, send_pieces
from hcp_compile.exchange.schemes.protocol import GroupShape, GroupTraffic
from hcp_compile.exchange.schemes.sections import SectionRing, SectionSteps
from hcp_compile.kernels.merge import accumulate
from hcp_compile.kernels.precision import accumulate_dtype


class _Gathered(SectionSteps):
    _pending: Tensor | None = None  # the all-gather, in flight
    _all: Tensor | None = None  # every ring rank's message, once arrived
    _index: tuple[Tensor, Tensor] | None = None  # the gathered step's keys, once derived

    def _start(self, message: Tensor) -> None:
        self._row = message.numel()
        self._pending = gather_sections(message, self._groups.ring_group, self._groups.ring_size)

    def kv(self, step: int) -> Tensor:
        if step == 0:
            return self._kv
        if self._all is None:  # waited where a section is first read: after the own step
            # (on the CPU when gloo staged a CUDA gather: gather_sections)
            self._all = arrived(self._pending, (self._groups.ring_size, self._row)).to(self._kv.device)
        if self._gather_rows is not None:  # the gathered step: its keys, out of every section
            return self._sections()[self._gathered_index()]
        return self._section_of(self._all[(self._groups.ring_rank - step) % self._groups.ring_size])

    def _sections(self) -> Tensor:
        """``[R, W, 2h, D]``: every ring rank's section, without the carried element."""
        return self._all[:, : self._size].unflatten(1, self._section)

    def _gathered_index(self) -> tuple[Tensor, Tensor]:
        """The gathered step's keys as (ring rank, row of its section): derived once, read by
        the backward's keys and again by their gradients."""
        if self._index is None:
            width = self._section[0]
            self._index = (self._gather_rows // width, self._gather_rows % width)
        return self._index


class _GatheredWithGrads(_Gathered):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._grads: dict[int, Tensor | None] = {}

    def add(self, step: int, dkv: Tensor | None) -> None:
        self._grads[step] = dkv

    def result(self) -> Tensor:
        kv, groups = self._kv, self._groups
        own = self._grads[0]
        if self._steps == 1:
            return own.to(kv.dtype)
        ring, rank = groups.ring_size, groups.ring_rank
        sent = self._gathered_grads() if self._gather_rows is not None else self._step_grads()
        pending = send_pieces(sent, self._size, groups.ring_group, rank, ring)
        received = arrived(pending, (ring - 1, *self._section))
        return accumulate(received.sum(0, dtype=accumulate_dtype(kv.dtype)), own, kv.dtype)

    def _step_grads(self) -> Tensor:
        """The send buffer of a schedule of steps: ring rank ``j``'s section was the keys of
        step ``(rank - j) mod R``, none where a window's schedule stopped before it
        (layout.window_steps)."""
        kv, ring, rank = self._kv, self._groups.ring_size, self._groups.ring_rank
        rows = []
        for j in range(ring):
            if j != rank:
                dkv = self._grads.get((rank - j) % ring)
                rows.append(torch.zeros(self._section, dtype=kv.dtype, device=kv.device)
                            if dkv is None else dkv.to(kv.dtype).reshape(self._section))
        return torch.cat([row.reshape(-1) for row in rows])

    def _gathered_grads(self) -> Tensor:
        """The send buffer of a gathered step: its keys' gradient added into the rows they were
        copied from. A key copied twice (for both query chunks that see it) gets two rounded
        gradients; their sum is rounded once, as the accumulation dtype's would be. The own
        section's row receives none (the own chunks are the own step's)."""
        kv, rank = self._kv, self._groups.ring_rank
        grads = torch.zeros((self._groups.ring_size, *self._section), dtype=kv.dtype, device=kv.device)
        dkv = self._grads.get(1)
        if dkv is not None:
            grads.index_put_(self._gathered_index(), dkv.to(kv.dtype), accumulate=True)
        return torch.cat([grads[:rank], grads[rank + 1:]]).reshape(-1)


class AllGatherKV(SectionRing):
    """One all-gather of the ring sections, issued before the own step computes::

        forward:   all-gather [section_0 | section_1 | ... | section_{R-1}]
                   step s reads section (r - s) mod R
        backward:  the same all-gather (each section with one element of the backward's
                   input), then one all-to-all: row j of the send buffer is the gradient of
                   ring rank j's section (step (r - j) mod R), the own row stays home
    """

    name = "allgather"
    forward_steps, backward_steps = _Gathered, _GatheredWithGrads
    gathers = True

    def traffic(self, shape: GroupShape) -> GroupTraffic:
        """Forward: the section to each other ring rank; backward: the section and the
        carried element to each, then to each the gradient of its section."""
        if shape.steps == 1:
            return GroupTraffic()
        others, section, item = shape.ring - 1, shape.section, shape.itemsize
        return GroupTraffic(
            forward_calls=1, backward_calls=2, forward_bytes=others * section * item,
            backward_bytes=others * (section + 1) * item + others * section * item,
        )
