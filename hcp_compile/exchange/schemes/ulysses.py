"""The Ulysses exchange as one all-to-all per tensor group (docs/design.md §3.2, §3.5): the
:class:`HeadExchange` of every scheme so far."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from hcp_compile.exchange.collectives import Issued, gather_heads, join_heads, scatter_heads
from hcp_compile.exchange.schemes.protocol import GroupShape, GroupTraffic


class AllToAllHeads:
    """``scatter``/``gather``/``join`` are :func:`collectives.scatter_heads`,
    :func:`collectives.gather_heads` and :func:`collectives.join_heads`."""

    name = "all_to_all"

    def scatter(self, tensors: list[Tensor], group: dist.ProcessGroup, size: int,
                counts: tuple[int, ...], part: int = 0, parts: int = 1,
                after: Tensor | None = None) -> Issued[Tensor]:
        return scatter_heads(tensors, group, size, counts, part, parts, after)

    def gather(self, x: Tensor, group: dist.ProcessGroup, size: int, counts: tuple[int, ...],
               rank: int) -> Issued[Tensor]:
        return gather_heads(x, group, size, counts, rank)

    def join(self, gathered: list[Tensor], repeat: int = 1) -> Tensor:
        return join_heads(gathered, repeat)

    def traffic(self, shape: GroupShape) -> GroupTraffic:
        """Forward: q, then k and v, out (each rank keeps its own ``1/A``), and the lse when
        the caller uses it (``[stream, h, 1]`` in the accumulation dtype). Backward: dout and
        out (with ``recompute_exchange`` also q, k and v) in one all-to-all, then dq and dkv
        back. Without a Ulysses group (``A = 1``) nothing is sent."""
        size = len(shape.counts)
        if size == 1:
            return GroupTraffic()
        own = shape.counts[shape.rank]
        others = sum(shape.counts) - own
        dim, item = shape.head_dim, shape.itemsize
        q, kv = shape.heads_q, 2 * shape.heads_kv

        def scatter(width: int) -> int:  # this rank's tokens, the heads of every other rank
            return own * width * dim * (size - 1) * item

        def gather(width: int, row: int = dim, itemsize: int = item) -> int:  # the others' tokens
            return others * width * row * itemsize

        lse = gather(q, 1, shape.accumulate_itemsize) if shape.returns_lse else 0
        sent_in = 3 * q + kv if shape.recompute_exchange else 2 * q  # dout, out [, q, k, v]
        return GroupTraffic(
            forward_calls=3 + shape.returns_lse, backward_calls=3,
            forward_bytes=scatter(q) + scatter(kv) + gather(q) + lse,
            backward_bytes=scatter(sent_in) + gather(q) + gather(kv),
        )
