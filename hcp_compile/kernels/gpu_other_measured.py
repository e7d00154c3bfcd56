"""The measured GPU time of one rank's work besides the attention kernels
(gpu_other_measured.json, written by ``python -m benchmarks.gpu_other --record``): what the
advisor's GPU-other part (:mod:`hcp_compile.advise.gpu_other`) turns a rank's bytes into
seconds with.

Per device kind, mode (``hcp-eager``) and kernel, each phase (forward, backward) records the
seconds per byte that the non-attention kernels of real-size eager ranks took, fitted through
the origin to their profiled device time. The file has host_measured.json's form, read by its
loader (:func:`host_measured.load`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import host_measured

GPU_OTHER_FILE = Path(__file__).with_name("gpu_other_measured.json")
HOW_TO_ADD = ("run `python -m benchmarks.gpu_other --out FILE` on that device, then "
              "`python -m benchmarks.gpu_other --record FILE`")


@dataclass(frozen=True)
class GpuOtherConstants:
    """Seconds of one phase's non-attention GPU work: ``per_byte_s * bytes``."""

    per_byte_s: float


@dataclass(frozen=True)
class GpuOtherRecord:
    forward: GpuOtherConstants
    backward: GpuOtherConstants


def parse(devices: Any, source: str) -> dict[str, dict[str, dict[str, GpuOtherRecord]]]:
    """The records of a file's ``devices`` (:func:`host_measured.parse_devices` of this form)."""
    return host_measured.parse_devices(devices, source, GpuOtherConstants, GpuOtherRecord, HOW_TO_ADD)


def recorded(path: Path = GPU_OTHER_FILE) -> dict[str, dict[str, dict[str, GpuOtherRecord]]]:
    """Device kind -> mode -> kernel -> the record, read once."""
    return host_measured.load(path, GpuOtherConstants, GpuOtherRecord, HOW_TO_ADD)


def find(device_kind: str, mode: str, kernel: str) -> GpuOtherRecord | None:
    """The record of ``kernel`` in ``mode`` on ``device_kind``; None where none was measured."""
    return recorded().get(device_kind, {}).get(mode, {}).get(kernel)
