"""The measured host time of one rank's attention call (host_measured.json, written by
``python -m benchmarks.host_times --record``): what the advisor's host part
(:mod:`hcp_advise.host`) turns a rank's call counts into seconds with.

Per device kind, mode (``hcp-eager``) and kernel, each phase (forward, backward) records a
linear model fitted to one rank's eager calls on tiny batches, where the GPU's work is
negligible and the wall time is the host's: a floor per call, plus a cost per kernel call,
per ring-step iteration (a block op, its merge and its hop, in every head group) and per head
group (its all-to-alls).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hcp_compile.validation import InputError

HOST_FILE = Path(__file__).with_name("host_measured.json")
PHASES = ("forward", "backward")
# the modes whose host work the advisor knows (advise.host.host_counts counts an eager call; a
# compiled call adds its batch check and table ops, and its inner compiler's own host work)
MODES = ("hcp-eager",)
HOW_TO_ADD = ("run `python -m benchmarks.host_times --out FILE` on that device, then "
              "`python -m benchmarks.host_times --record FILE`")


@dataclass(frozen=True)
class HostConstants:
    """Host seconds of one phase of one call: ``floor_s + per_call_s * calls + per_step_s *
    steps + per_group_s * groups``."""

    floor_s: float
    per_call_s: float
    per_step_s: float
    per_group_s: float


@dataclass(frozen=True)
class HostRecord:
    forward: HostConstants
    backward: HostConstants


COEFFICIENTS = tuple(f.name for f in fields(HostConstants))


def parse_devices(devices: Any, source: str) -> dict[str, dict[str, dict[str, HostRecord]]]:
    """``{device: {mode: {kernel: {phase: {coefficient: seconds}}}}}`` (extra keys beside the
    modes, such as ``date``, are the measurement's notes) as host records;
    :class:`InputError` naming the first missing or bad entry of ``source``."""
    if not isinstance(devices, dict):
        raise InputError(f"{source}: expected 'devices' to be an object of device kinds, got {devices!r}")
    result: dict[str, dict[str, dict[str, HostRecord]]] = {}
    for device, entry in devices.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("modes"), dict):
            raise InputError(f"{source}: devices[{device!r}] has no 'modes' object; {HOW_TO_ADD}")
        result[device] = {}
        for mode, kernels in entry["modes"].items():
            if not isinstance(kernels, dict):
                raise InputError(f"{source}: devices[{device!r}].modes[{mode!r}]: expected kernels, got {kernels!r}")
            result[device][mode] = {
                kernel: _record(phases, f"{source}: devices[{device!r}].modes[{mode!r}][{kernel!r}]")
                for kernel, phases in kernels.items()}
    return result


def _record(phases: Any, where: str) -> HostRecord:
    names = list(COEFFICIENTS)
    per_phase = []
    for phase in PHASES:
        values = phases.get(phase) if isinstance(phases, dict) else None
        if not isinstance(values, dict):
            raise InputError(f"{where}: no {phase!r} constants; expected {{{', '.join(names)}}} in seconds")
        for name in names:
            value = values.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InputError(f"{where}.{phase}.{name}: expected a finite number of seconds, got {value!r}")
        per_phase.append(HostConstants(**{name: float(values[name]) for name in names}))
    return HostRecord(*per_phase)


@functools.cache
def recorded(path: Path = HOST_FILE) -> dict[str, dict[str, dict[str, HostRecord]]]:
    """Device kind -> mode -> kernel -> record of the measured file ``path`` (as
    :func:`parse_devices` reads it), read once."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise InputError(f"{path}: expected the JSON of measured constants, could not read it ({error})") from None
    if not isinstance(data, dict) or "devices" not in data:
        raise InputError(f"{path}: expected an object with 'devices'; {HOW_TO_ADD}")
    return parse_devices(data["devices"], str(path))


def find(device_kind: str, mode: str, kernel: str) -> HostRecord | None:
    """The record of ``kernel`` in ``mode`` on ``device_kind``; None where none was measured."""
    return recorded().get(device_kind, {}).get(mode, {}).get(kernel)


def host_record(device_kind: str, mode: str, kernel: str) -> HostRecord:
    """As :func:`find`, but a missing record is an :class:`InputError` saying how to add it."""
    record = find(device_kind, mode, kernel)
    if record is None:
        measured = {m: sorted(k) for m, k in recorded().get(device_kind, {}).items()}
        raise InputError(f"device_kind: no host times for kernel {kernel!r} in mode {mode!r} on {device_kind!r} "
                         f"in hcp_advise/host_measured.json (it has {measured or 'nothing'} there); {HOW_TO_ADD}")
    return record
