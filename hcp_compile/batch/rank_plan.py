"""What one rank's attention of a batch needs for one mask, derived in one pass from the batch's
layout: its sizes, how many ring steps its schedule has, the schedule's tables and the steps a
window leaves without a visible key. A :class:`prepared.PreparedBatch` keeps one per rank and
mask asked for, under the mask as the call gives it, so that what a DataLoader worker prepared
is what both doors find (docs/design.md §2.4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hcp_compile.batch import layout
from hcp_compile.batch.layout import BatchLayout, RankSizes, window_by_position
from hcp_compile.batch.schedule import ScheduleTables, schedule_tables


@dataclass(frozen=True)
class RankPlan:
    """One rank's schedule of one batch for one mask, on the host."""

    sizes: RankSizes
    steps: int  # the schedule's ring steps
    windowed: bool  # whether the window masks by position (layout.window_by_position)
    gathered: bool  # whether its second step is a gathered one (schedule.gathers)
    flat: tuple[Tensor, Tensor]  # the tables as ScheduleTables.flat gives them: what goes to the device
    active: tuple[bool, ...]  # per step, whether any query sees any key (the own step always computes)
    # ``flat`` with the steps not active emptied (ScheduleTables.emptied; ``flat`` itself where
    # every step is): what a compiled graph gets, which runs every step (docs/design.md §3.3)
    flat_skipping: tuple[Tensor, Tensor]

    @property
    def tables(self) -> ScheduleTables:
        return ScheduleTables.unflat(*self.flat, self.sizes, self.steps, self.windowed, self.gathered)


def plan_rank(batch: BatchLayout, sizes: RankSizes, ring_rank: int, causal: bool, window: tuple[int, int],
              steps: int, gathered: bool = False) -> RankPlan:
    """Rank ``(ring_rank, sizes.ulysses_rank)``'s plan of ``steps`` ring steps (its own,
    :func:`schedule.schedule_steps`, or every step: a compiled graph built for batches that go
    round the ring) for calls with this mask; ``gathered``: the own step and a gathered one
    (``steps`` 2)."""
    windowed = window_by_position(window, batch.ring)
    gathered = gathered and steps > 1
    tables = schedule_tables(batch, sizes, ring_rank, steps, causal=causal, windowed=windowed, gathered=gathered)
    active = (True,) * steps if gathered else steps_seeing_keys(batch, ring_rank, steps, causal, window)
    flat = tables.flat()
    # the positions stay: the emptied steps' positions are never read
    skipping = flat if all(active) else (tables.emptied(active).flat()[0], flat[1])
    return RankPlan(sizes, steps, windowed, gathered, flat, active, skipping)


def steps_seeing_keys(batch: BatchLayout, ring_rank: int, steps: int, causal: bool,
                      window: tuple[int, int]) -> tuple[bool, ...]:
    """Per ring step of rank ``ring_rank``'s schedule, whether any query sees any key under the
    sliding ``window``: the steps a schedule may skip."""
    if window == (-1, -1) or steps == 1:
        return (True,) * steps
    ring = batch.ring
    own = layout.stream_table(batch, ring_rank)
    seen = torch.stack([
        layout.step_sees_any_key(own, layout.stream_table(batch, src, with_group=False), ring_rank, src, ring,
                                 layout.step_kind(ring_rank, src, causal), *window)
        for src in layout.step_sources(ring_rank, ring, steps)[1:]
    ])
    return (True, *seen.tolist())
