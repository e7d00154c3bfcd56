"""The packed batch, the run options and the trace arithmetic that the GPU benchmarks share."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from hcp_compile.batch.packing import log_uniform_lengths  # noqa: F401  (the benchmarks' batches)


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


def union_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, stop)`` intervals as sorted disjoint intervals."""
    merged: list[list[float]] = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(start, stop) for start, stop in merged]


def exposed_length(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """How long some ``comm`` interval runs while no ``compute`` interval does: the length of
    the union of ``comm`` minus its overlap with the union of ``compute`` (communication that
    no kernel hides, on whatever stream)."""
    comm_union, compute_union = union_intervals(comm), union_intervals(compute)
    total = sum(stop - start for start, stop in comm_union)
    covered, j = 0.0, 0
    for start, stop in comm_union:  # both lists sorted and disjoint: one merge-like pass
        while j < len(compute_union) and compute_union[j][1] <= start:
            j += 1
        i = j
        while i < len(compute_union) and compute_union[i][0] < stop:
            covered += min(stop, compute_union[i][1]) - max(start, compute_union[i][0])
            i += 1
    return total - covered


def kernel_intervals(chrome_trace: dict) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The device kernels of a profiler Chrome trace as ``(start, stop)`` in microseconds:
    the NCCL kernels, and all the others."""
    comm, compute = [], []
    for event in chrome_trace["traceEvents"]:
        if event.get("cat") == "kernel" and "dur" in event:
            interval = (float(event["ts"]), float(event["ts"]) + float(event["dur"]))
            (comm if "nccl" in event["name"].lower() else compute).append(interval)
    return comm, compute


def kernel_totals(trace: dict, key: Callable[[str], str]) -> dict[str, tuple[int, float]]:
    """The device kernels of a profiler Chrome trace grouped by ``key(name)``: per group, the
    kernel count and their summed time in microseconds."""
    totals: dict[str, tuple[int, float]] = {}
    for event in trace["traceEvents"]:
        if event.get("cat") == "kernel" and "dur" in event:
            group = key(event["name"])
            count, total = totals.get(group, (0, 0.0))
            totals[group] = (count + 1, total + float(event["dur"]))
    return totals


def kernel_summary(trace: dict, rows: int = 12) -> str:
    """One traced step: its span (first kernel start to last kernel end), the time some kernel
    runs, the kernel count, and the ``rows`` kernel names with the most time."""
    comm, compute = kernel_intervals(trace)
    kernels = comm + compute
    span = max(stop for _, stop in kernels) - min(start for start, _ in kernels)
    busy = sum(stop - start for start, stop in union_intervals(kernels))
    by_name = kernel_totals(trace, lambda name: name[:90])
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:rows]
    lines = [f"span {span / 1e3:.2f} ms, some kernel running {busy / 1e3:.2f} ms, {len(kernels)} kernels"]
    lines += [f"    {total / 1e3:8.3f} ms {count:5d}x  {name}" for name, (count, total) in top]
    return "\n".join(lines)


def live_at_peak(device_trace: list[dict], rows: int = 12) -> str:
    """Where the memory lies at the peak of a CUDA allocator history (one device's list of
    ``torch.cuda.memory._snapshot()["device_traces"]``, recorded with Python stacks): the peak
    of the bytes allocated and not yet freed, the event that reached it, and the ``rows`` places
    holding most of it then, each named by its first frames inside ``hcp_compile`` or
    ``benchmarks`` (the allocator's own count: a block counts until its free completes)."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for event in device_trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    by_place: dict[str, int] = {}
    for event in at_peak:
        place = _allocated_at(event.get("frames", []))
        by_place[place] = by_place.get(place, 0) + event["size"]
    lines = [f"peak {peak / 2**30:.3f} GiB allocated, {len(at_peak)} blocks, reached at "
             f"{_allocated_at(at_peak[-1].get('frames', [])) if at_peak else '-'}"]
    lines += [f"    {size / 2**30:8.3f} GiB  {place}"
              for place, size in sorted(by_place.items(), key=lambda item: -item[1])[:rows]]
    return "\n".join(lines)


def _allocated_at(frames: list[dict], depth: int = 3) -> str:
    ours = [f for f in frames if "hcp_compile" in f["filename"] or "benchmarks" in f["filename"]]
    return " <- ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
                       for f in (ours or frames)[:depth]) or "?"


def cuda_median_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream (CUDA events), after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def stream_seed(seed: int, step: int) -> int:
    """The seed of step ``step`` of a stream of batches seeded ``seed``: ``seed`` itself at
    step 0, so that a stream starts with the batch that ``seed`` alone draws, and a new seed at
    every step. 32 bits, as torch's CPU generator keeps no more: ``seed + step * K`` modulo
    2**32 with ``K`` odd (2**32 / the golden ratio), distinct over the steps of one seed and,
    for small seeds, across seeds until some stream runs about 2**31 steps."""
    if not 0 <= seed < 2**32 or step < 0:
        raise ValueError(f"stream_seed: expected 0 <= seed < 2**32 and step >= 0, got {seed}, {step}")
    return (seed + step * 0x9E3779B9) % 2**32
