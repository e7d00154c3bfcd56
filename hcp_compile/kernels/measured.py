"""The measured kernel throughputs (measured.json, written by scripts/measure_kernels.py): what
``kernel="auto"`` chooses by and what the cost hook turns FLOPs into time with."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from statistics import mean

import torch

MEASURED_FILE = Path(__file__).with_name("measured.json")


def device_kind(device: torch.device) -> str:
    """The name measurements are recorded under: the CUDA device's name, else the type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@functools.cache
def throughputs(windowed: bool = False) -> dict[str, dict[str, float]]:
    """Device kind -> kernel -> FLOP/s: the mean over the batches measured without a window
    (``"tflops"``), or with ``windowed`` over those measured under a sliding window
    (``"tflops_window"``; a device without them: its unwindowed means)."""
    recorded = json.loads(MEASURED_FILE.read_text())["devices"]
    result: dict[str, dict[str, float]] = {}
    for device, entry in recorded.items():
        batches = entry.get("tflops_window") if windowed else None
        per_kernel: dict[str, list[float]] = {}
        for batch in (batches or entry["tflops"]).values():
            for kernel, tflops in batch.items():
                per_kernel.setdefault(kernel, []).append(tflops * 1e12)
        result[device] = {kernel: mean(values) for kernel, values in per_kernel.items()}
    return result


def fastest(kind: str, kernels: list[str], windowed: bool = False) -> str | None:
    """The fastest of ``kernels`` measured on ``kind`` (under a window, with ``windowed``);
    None when none of them was."""
    measured = throughputs(windowed).get(kind, {})
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
