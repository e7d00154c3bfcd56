"""What the ring schemes share: each sends the own ring section as one flat message, which in
the backward carries one element of its input along (docs/design.md §4), and builds its forward
and backward steps from the same arguments."""

from __future__ import annotations

import torch
from torch import Tensor

from hcp_compile.exchange.mesh import CPGroups
from hcp_compile.exchange.schemes.protocol import KVGradSteps, KVSteps


class SectionSteps:
    """The keys of a schedule's ring steps, from the exchange stream ``kv`` whose first
    ``width`` rows are the own ring section. Where any step reads another ring rank's section
    (``steps > 1``), the own section's message goes to :meth:`_start`."""

    def __init__(self, kv: Tensor, width: int | torch.SymInt, steps: int, groups: CPGroups,
                 carried: Tensor | None, gather_rows: Tensor | None = None):
        self._kv, self._steps, self._groups, self._carried = kv, steps, groups, carried
        self._gather_rows = gather_rows
        self._section = (width, *kv.shape[1:])
        if steps > 1:
            own = kv.split([width, kv.shape[0] - width])[0]
            self._size = own.numel()
            self._start(own.reshape(-1) if carried is None else torch.cat(
                [own.reshape(-1), carried.to(kv.dtype)]))

    def _start(self, message: Tensor) -> None:
        """Issue the collective of the own section's ``message``, or keep it for a later one."""
        raise NotImplementedError

    def _section_of(self, message: Tensor) -> Tensor:
        """The ring section a message (of any ring rank) holds, without the carried element."""
        if self._carried is None:
            return message.view(self._section)
        return message[: self._size].view(self._section)


class SectionRing:
    """A :class:`KVRing` whose forward and backward steps are ``forward_steps`` and
    ``backward_steps`` (the forward's carry nothing)."""

    forward_steps: type[SectionSteps]
    backward_steps: type[SectionSteps]
    gathers: bool = False

    def forward(self, kv: Tensor, width: int | torch.SymInt, steps: int, groups: CPGroups,
                gather_rows: Tensor | None = None) -> KVSteps:
        return self.forward_steps(kv, width, steps, groups, carried=None, gather_rows=gather_rows)

    def backward(self, kv: Tensor, width: int | torch.SymInt, steps: int, groups: CPGroups,
                 carried: Tensor, gather_rows: Tensor | None = None) -> KVGradSteps:
        return self.backward_steps(kv, width, steps, groups, carried, gather_rows)
