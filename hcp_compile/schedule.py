"""The ring schedule of one rank: per step, the source rank and the varlen segmentation of
the block it computes (pure tensor math on top of :mod:`hcp_compile.layout`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import layout
from .layout import StepKind


@dataclass(frozen=True)
class RingStep:
    source: int  # ring rank whose KV this step uses
    kind: StepKind
    cu_q: Tensor  # int32 segmentation of the local stream's queries
    cu_k: Tensor  # int32 segmentation of the source stream's keys
    k_positions: Tensor | None  # global positions of the source's tokens (window only)
    active: bool  # False when the step is wholly outside the window: compute skipped


@dataclass(frozen=True)
class RingSchedule:
    steps: tuple[RingStep, ...]
    q_positions: Tensor | None  # global positions of the local tokens (window only)
    max_seqlen: int  # bound of every segment length, for the kernels' grids
    scale: float
    window_left: int
    window_right: int
    kernel: str


def build_schedule(
    cu_seqlens: Tensor, max_seqlen: int, ring_rank: int, ring: int, ulysses: int,
    stream_length: int | torch.SymInt, *, causal: bool, scale: float,
    window: tuple[int, int], kernel: str, skip_outside_window: bool,
) -> RingSchedule:
    """Schedule of ring rank ``ring_rank``. ``cu_seqlens`` is the global real one, on the
    device the attention runs on; ``skip_outside_window`` reads one small tensor on the host."""
    chunks = layout.doc_chunks(cu_seqlens, ring, stream_length)
    windowed = window != (-1, -1)

    sources = [(ring_rank - s) % ring for s in range(ring)]
    # global positions of every ring stream (the sources include this rank), window only
    positions = {
        src: layout.stream_tokens(chunks, src, ring, stream_length).position if windowed else None
        for src in sources
    }
    steps = []
    kinds = [layout.step_kind(ring_rank, src, causal) for src in sources]
    active = [True] * ring
    if windowed and skip_outside_window:
        seen = torch.stack([
            layout.step_sees_any_key(chunks, ring_rank, src, ring, kind, *window)
            for src, kind in zip(sources, kinds)
        ])
        active = seen.tolist()
    for src, kind, is_active in zip(sources, kinds, active):
        cu_q, cu_k = layout.step_segments(chunks, ring_rank, src, ring, kind)
        steps.append(RingStep(src, kind, cu_q, cu_k, positions[src], bool(is_active)))
    return RingSchedule(
        steps=tuple(steps),
        q_positions=positions[ring_rank],
        max_seqlen=layout.step_max_seqlen(max_seqlen, ring, ulysses),
        scale=scale,
        window_left=window[0],
        window_right=window[1],
        kernel=kernel,
    )
