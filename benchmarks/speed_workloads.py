"""The packed batches of benchmarks.speed as document lengths (its docstring describes them):
the workloads W1..W4 by name, a stream's new batch per step and a mixed stream's order of
compositions."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from benchmarks.common import log_uniform_lengths, stream_seed

HEADS = {"gqa": (32, 8), "mha": (32, 32)}
WINDOW_LEFT = 4096
NO_WINDOW = (-1, -1)


# run only when named in --workloads (a one-GPU step takes seconds)
ONLY_WHEN_NAMED = ("W2-512K", "W2-1M", "W4-1M")


@dataclass(frozen=True)
class Workload:
    name: str
    lengths: tuple[int, ...]
    window_left: int = -1  # -1: no window
    spread: tuple[int, int, int] | None = None  # the lengths' (low, high, seed), log-uniform; None: one document

    @property
    def window(self) -> tuple[int, int]:
        return (self.window_left, 0) if self.window_left >= 0 else NO_WINDOW

    def step(self, step: int) -> "Workload":
        """Step ``step`` of a stream of this workload (``--stream``): as many tokens in new
        lengths from the same distribution, seeded (seed, step), the same on every rank and in
        every run; step 0 is this batch. One document is the same batch at every step."""
        if self.spread is None:
            return self
        low, high, seed = self.spread
        lengths = log_uniform_lengths(sum(self.lengths), low, high, seed=stream_seed(seed, step))
        return replace(self, lengths=tuple(lengths))


def workloads(shrink: int = 1) -> dict[str, Workload]:
    """The workloads by name; token counts, length ranges and the window divided by ``shrink``
    (tiny CPU runs keep the names)."""
    short = (_size(128, shrink), _size(2048, shrink), 1)  # (low, high, seed)
    result = [Workload(f"W1-{size_label(k)}", (_tokens(k, shrink),)) for k in (128, 256)]
    result += [log_uniform(k, shrink) for k in (128, 256)]
    result += [Workload(f"W3-{size_label(k)}", _drawn(k, short, shrink), spread=short) for k in (128, 256)]
    result += [replace(log_uniform(k, shrink), name=f"W4-{size_label(k)}", window_left=_size(WINDOW_LEFT, shrink))
               for k in (128, 256, 1024)]
    result += [log_uniform(k, shrink) for k in (512, 1024)]
    return {w.name: w for w in result}


def log_uniform(k: int, shrink: int = 1) -> Workload:
    """W2 at ``k`` K tokens (``W2-<size_label(k)>``): lengths log-uniform in 256..32K, seed 0,
    as :func:`workloads` describes (the batches of ``--scale``)."""
    spread = (_size(256, shrink), _size(32768, shrink), 0)
    return Workload(f"W2-{size_label(k)}", _drawn(k, spread, shrink), spread=spread)


def _tokens(k: int, shrink: int) -> int:
    return k * 1024 // shrink


def _size(n: int, shrink: int) -> int:
    return max(1, n // shrink)


def _drawn(k: int, spread: tuple[int, int, int], shrink: int) -> tuple[int, ...]:
    low, high, seed = spread
    return tuple(log_uniform_lengths(_tokens(k, shrink), low, high, seed=seed))


def size_label(k: int) -> str:
    """``k`` K tokens as a name writes it: 128K, 1M."""
    return f"{k // 1024}M" if k % 1024 == 0 else f"{k}K"


def parse_size(text: str) -> int:
    """A token count as ``--scale`` takes it, ``128K`` or ``1M``, in K tokens."""
    number, unit = text[:-1], text[-1:].upper()
    if unit not in ("K", "M") or not number.isdigit() or int(number) < 1:
        raise ValueError(f"expected a token count such as 128K or 1M, got {text!r}")
    return int(number) * (1024 if unit == "M" else 1)


def mixed_steps(compositions: Sequence[Workload], count: int, seed: int = 0) -> list[Workload]:
    """``count`` steps' batches: rounds in which every composition comes once, each round in a
    random order (``random.Random(seed)``), so that two rounds meet each at least twice; step s
    draws a new batch of its composition (:meth:`Workload.step` s: a step index no other
    composition's batch uses, so no batch repeats another's lengths, W1's one document aside).
    The first steps of a longer count are these."""
    rng, order = random.Random(seed), []
    while len(order) < count:
        round_ = list(compositions)
        rng.shuffle(round_)
        order += round_
    return [workload.step(s) for s, workload in enumerate(order[:count])]


def reset_steps(steps: int, every: int) -> list[int]:
    """The steps before which a mixed stream resets Dynamo: every ``every``-th after the
    first (each mode's stream starts reset); none for 0."""
    return list(range(every, steps, every)) if every else []
