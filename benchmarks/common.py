"""The packed batch and the run options that the GPU benchmarks share."""

from __future__ import annotations

import argparse

import torch


def packed_lengths(tokens: int, docs: int, seed: int) -> list[int]:
    """``docs`` random document lengths (odd ones included) that sum to ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(docs, generator=gen) + 0.05
    lengths = (weights / weights.sum() * tokens).floor().long()
    lengths[0] += tokens - int(lengths.sum())
    return lengths.tolist()


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """The mesh, batch and timing options of both GPU benchmarks."""
    parser.add_argument("--ulysses", type=int, required=True)
    parser.add_argument("--ring", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--docs", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
