"""What one attention call sends, per rank, from the scheme's own counts: for the report of the
``hcp`` backend, ``ShardPlan.summary`` and the tests that check both against measured bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hcp_compile.batch.layout import RankSizes, schedule_steps
from hcp_compile.batch.schedule import exchanged_head_groups, kv_head_repeat
from hcp_compile.exchange.schemes import scheme_named
from hcp_compile.exchange.schemes.protocol import GroupShape, GroupTraffic, Traffic
from hcp_compile.kernels.precision import accumulate_dtype


@dataclass(frozen=True)
class CallShape:
    """The attention call: its heads (before the exchange), head size, dtype and options."""

    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: torch.dtype
    returns_lse: bool = False
    recompute_exchange: bool = False
    window: int = -1  # a causal sliding window of this many keys back (-1: none); moves nothing else


def call_traffic(scheme: str, sizes: RankSizes, call: CallShape, ulysses: int, ring: int,
                 steps: int | None = None) -> Traffic:
    """The collectives and bytes of one forward and backward on the rank with ``sizes``, under
    the collective scheme named ``scheme``; ``steps``: the ring steps (default: as an eager
    schedule of ``sizes`` has them; a compiled graph has ``ring`` unless it is built for batches
    without a ring section: hcp_compile.compiled.graph_variants). No head group, and nothing sent, where
    nothing is exchanged (:func:`schedule.exchanged_head_groups`)."""
    repeat = kv_head_repeat(call.heads_kv, ulysses)
    steps = schedule_steps(sizes, ring) if steps is None else steps
    parts = exchanged_head_groups(sizes, steps, call.heads_kv, ulysses)
    if parts == 0:
        return Traffic(GroupTraffic(), GroupTraffic())
    shape = GroupShape(
        counts=tuple(sizes.exchange), rank=sizes.ulysses_rank, ring=ring,
        ring_width=sizes.ring_width, steps=steps,
        heads_q=call.heads_q // (ulysses * parts),
        heads_kv=call.heads_kv * repeat // (ulysses * parts), head_dim=call.head_dim,
        itemsize=call.dtype.itemsize, accumulate_itemsize=accumulate_dtype(call.dtype).itemsize,
        returns_lse=call.returns_lse, recompute_exchange=call.recompute_exchange,
    )
    chosen = scheme_named(scheme)
    return Traffic(chosen.heads.traffic(shape).times(parts), chosen.ring.traffic(shape).times(parts))


def whole_exchange_sizes(tokens: int, ulysses: int, ring: int) -> RankSizes:
    """The sizes of a rank whose ``tokens`` all go through the exchange and round the ring, as
    every rank of its ring rank's: the most a call of that many tokens per rank can send."""
    return RankSizes(tokens, 0, (tokens,) * ulysses, tokens * ulysses, 0, 0, (0,) * ring)
