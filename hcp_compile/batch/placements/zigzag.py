"""``placement="zigzag"``: every document goes round the ring, cut into ``2R`` chunks of which
ring rank ``r`` holds chunks ``r`` and ``2R-1-r``, and through the Ulysses exchange inside each
ring rank. Balances causal work for any batch, at the price of ring steps and exchanges for
documents one GPU would finish alone. It weighs nothing, so a window changes nothing here
(a layout for a window turns the chunk pairs and may hold them adjacent: ``layout.batch_layout``)."""

from __future__ import annotations

import torch
from torch import Tensor

from hcp_compile.batch.layout import Assignment, Kind


def zigzag(lengths: Tensor, ulysses: int, ring: int, *, window: int = -1) -> Assignment:
    unused = torch.zeros_like(lengths)
    return Assignment(torch.full_like(lengths, int(Kind.RING)), unused, unused)
