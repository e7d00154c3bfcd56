"""The measured kernel throughputs (measured.json, written by scripts/measure_kernels.py): what
``kernel="auto"`` chooses by and what the cost hook turns FLOPs into time with.

Each device kind records, per kernel, the throughput on batches of a few compositions (one
document, log-uniform documents, short documents; and log-uniform documents under a window).
The batches of a composition other than one document are measured as a stream: every timed
call on new document lengths, so a kernel that builds something per new batch (the dense
kernel's cuDNN graphs, flex's block masks) pays for it there as a trainer does. A call is
judged by the composition its lengths are known to have before anything runs
(:func:`composition`).

A device may also record the compositions at several call sizes (``sizes``: records of the
token count, the composition, the mean work of one call in TFLOP and TFLOP/s per kernel): a
kernel runs a call of little work below a large call's speed (fixed work per call, a grid that
no longer fills the GPU), which the advisor's compute part reads through :func:`throughput_at`.
``kernel="auto"`` judges by the main table alone.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from statistics import mean

import torch

MEASURED_FILE = Path(__file__).with_name("measured.json")
# the compositions measured.json records ("window": log-uniform documents under a window)
ONE_DOCUMENT, LOG_UNIFORM, SHORT, WINDOW = "one document", "log-uniform documents", "short documents", "window"
# a call whose longest segment is shorter is judged as short documents (those of the measured
# batch are 128..2K; the dense kernel runs every shorter segment in its varlen kernel)
SHORT_DOCUMENT_ROWS = 2048


def device_kind(device: torch.device) -> str:
    """The name measurements are recorded under: the CUDA device's name, else the type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def composition(windowed: bool, segments: int | None, longest: int | None) -> str | None:
    """The measured composition a call is judged by: under a window, ``WINDOW``; one segment,
    ``ONE_DOCUMENT``; a longest segment under ``SHORT_DOCUMENT_ROWS``, ``SHORT``; otherwise
    ``LOG_UNIFORM``; None when the segments are unknown (the mean over the compositions)."""
    if windowed:
        return WINDOW
    if segments is None:
        return None
    if segments <= 1:
        return ONE_DOCUMENT
    if longest is not None and longest < SHORT_DOCUMENT_ROWS:
        return SHORT
    return LOG_UNIFORM


@functools.cache
def recorded() -> dict[str, dict[str, dict[str, float]]]:
    """Device kind -> composition -> kernel -> FLOP/s."""
    devices = json.loads(MEASURED_FILE.read_text())["devices"]
    return {device: {kind: {kernel: tflops * 1e12 for kernel, tflops in row.items()}
                     for kind, row in entry["tflops"].items()}
            for device, entry in devices.items()}


def throughputs(kind_of_call: str | None = None) -> dict[str, dict[str, float]]:
    """Device kind -> kernel -> FLOP/s on the composition ``kind_of_call``; None (or a
    composition a device did not record): the mean over the device's unwindowed ones."""
    # copies: the cached tables serve every later call (kernel="auto" asks once per attention call)
    return {device: dict(per_kernel) for device, per_kernel in _throughputs(kind_of_call).items()}


@functools.cache
def _throughputs(kind_of_call: str | None) -> dict[str, dict[str, float]]:
    result: dict[str, dict[str, float]] = {}
    for device, kinds in recorded().items():
        if kind_of_call in kinds:
            result[device] = kinds[kind_of_call]
            continue
        per_kernel: dict[str, list[float]] = {}
        for kind, row in kinds.items():
            if kind != WINDOW:
                for kernel, flops in row.items():
                    per_kernel.setdefault(kernel, []).append(flops)
        result[device] = {kernel: mean(values) for kernel, values in per_kernel.items()}
    return result


def fastest(kind: str, kernels: list[str], kind_of_call: str | None = None) -> str | None:
    """The fastest of ``kernels`` measured on device ``kind`` for calls of composition
    ``kind_of_call`` (see :func:`throughputs`); None when none of them was measured."""
    measured = throughputs(kind_of_call).get(kind, {})
    candidates = [k for k in kernels if k in measured]
    return max(candidates, key=measured.__getitem__) if candidates else None


def throughput(kernel: str, kind: str) -> float:
    """FLOP/s of ``kernel`` on ``kind``. Unmeasured there: the kernel's mean over the devices
    that measured it, else the mean of every measurement (an order of magnitude is all the
    scheduler needs to weigh a block against a transfer)."""
    table = throughputs()
    if kernel in table.get(kind, {}):
        return table[kind][kernel]
    elsewhere = [per_kernel[kernel] for per_kernel in table.values() if kernel in per_kernel]
    return mean(elsewhere or [v for per_kernel in table.values() for v in per_kernel.values()])


@functools.cache
def recorded_sizes() -> dict[str, dict[str, dict[str, tuple[tuple[float, float], ...]]]]:
    """Device kind -> composition -> kernel -> ``(FLOPs per call, FLOP/s)`` points of the
    device's ``sizes`` records, the smallest call first."""
    devices = json.loads(MEASURED_FILE.read_text())["devices"]
    result: dict[str, dict[str, dict[str, tuple[tuple[float, float], ...]]]] = {}
    for device, entry in devices.items():
        points: dict[str, dict[str, list[tuple[float, float]]]] = {}
        for record in entry.get("sizes", ()):
            for kernel, tflops in record["tflops"].items():
                points.setdefault(record["composition"], {}).setdefault(kernel, []).append(
                    (record["call_tflop"] * 1e12, tflops * 1e12))
        result[device] = {kind: {kernel: tuple(sorted(p)) for kernel, p in per_kernel.items()}
                          for kind, per_kernel in points.items()}
    return result


def throughput_at(kernel: str, kind: str, kind_of_call: str, call_flops: float) -> float | None:
    """FLOP/s of ``kernel`` on device ``kind`` for one call of composition ``kind_of_call``
    doing ``call_flops`` FLOPs: linear in ``log(call_flops)`` between the recorded sizes, the
    nearest one's outside them; None where fewer than two sizes were recorded for that kernel
    and composition (then the main table alone speaks)."""
    points = recorded_sizes().get(kind, {}).get(kind_of_call, {}).get(kernel, ())
    return interpolated(points, call_flops) if len(points) >= 2 else None


def interpolated(points: Sequence[tuple[float, float]], call_flops: float) -> float:
    """The FLOP/s of ``points`` (``(call FLOPs, FLOP/s)``, sorted, at least two) at
    ``call_flops``: linear in ``log(call_flops)`` between them, the nearest one's outside."""
    work = [w for w, _ in points]
    if call_flops <= work[0]:
        return points[0][1]
    if call_flops >= work[-1]:
        return points[-1][1]
    i = bisect.bisect_right(work, call_flops)
    (w0, f0), (w1, f1) = points[i - 1], points[i]
    share = (math.log(call_flops) - math.log(w0)) / (math.log(w1) - math.log(w0))
    return f0 + share * (f1 - f0)
