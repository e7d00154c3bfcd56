"""The kernel measurements the compute part times blocks by: this user's cache for the device kind,
which ``python -m hcp_advise --measure`` writes (measure.py), else the runtime's stored table
(hcp_compile/kernels/measured.json); and the table that a set of timings gives.

A cache file has measured.json's format, ``{"devices": {kind: entry}}`` (so its entry can also be
copied into measured.json for the runtime's ``kernel="auto"``), read as kernels/measured.py reads
that file: ``tflops`` per composition and kernel, ``sizes`` records of smaller calls; beside them
the NVLink figures ``--measure`` took (``links``, Links field -> value; absent where it could not)
and why (``links_note``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from statistics import mean
from typing import Any

from hcp_compile.kernels import measured
from hcp_compile.validation import InputError

from .records import DEFAULT_DEVICE, STORED_MEASUREMENTS, Links

CACHE_ENV = "HCP_ADVISE_CACHE_DIR"
MEASURE = "python -m hcp_advise --measure"


@dataclass(frozen=True)
class Timing:
    """``calls`` forward + backward calls of ``kernel`` on batches of ``tokens`` tokens of one
    composition, ``flops`` of causal work in all, took ``seconds``."""

    kernel: str
    composition: str
    tokens: int
    calls: int
    flops: float
    seconds: float


@dataclass(frozen=True)
class KernelTable:
    """One device kind's kernel throughputs in FLOP/s: ``rates[composition][kernel]`` (on the
    largest batches measured) and ``sizes[composition][kernel]``, ``(FLOPs of one call, FLOP/s)``
    points, the smallest call first; ``links``: the :class:`Links` fields measured with it;
    ``source``: the file."""

    device_kind: str
    source: str
    rates: dict[str, dict[str, float]]
    sizes: dict[str, dict[str, tuple[tuple[float, float], ...]]] = field(default_factory=dict)
    links: dict[str, float] = field(default_factory=dict)
    links_note: str = ""

    def throughputs(self, composition: str | None = None) -> dict[str, float]:
        """Kernel -> FLOP/s on ``composition``; on one the device did not record, or None, the
        mean over its unwindowed ones (as kernels/measured.py judges a call)."""
        if composition in self.rates:
            return dict(self.rates[composition])
        per_kernel: dict[str, list[float]] = {}
        for kind, row in self.rates.items():
            if kind != measured.WINDOW:
                for kernel, flops in row.items():
                    per_kernel.setdefault(kernel, []).append(flops)
        return {kernel: mean(values) for kernel, values in per_kernel.items()}

    def throughput(self, kernel: str, composition: str, call_flops: float | None = None) -> float:
        """FLOP/s of ``kernel`` on ``composition``; with ``call_flops``, of calls of that much work
        where two or more sizes were recorded: linear in ``log(call_flops)`` between them, the
        nearest one's outside them (as ``measured.throughput_at``)."""
        rates = self.throughputs(composition)
        if kernel not in rates:
            raise InputError(f"kernel: {kernel!r} was not measured on {self.device_kind!r} ({self.source}); "
                             f"expected one of {sorted(rates)}")
        points = self.sizes.get(composition, {}).get(kernel, ())
        if call_flops is None or len(points) < 2:
            return rates[kernel]
        return measured.interpolated(points, call_flops)

    def call_range(self, kernel: str, composition: str) -> tuple[float, float] | None:
        """The FLOPs of the smallest and the largest call measured for ``kernel`` on
        ``composition``, between which :meth:`throughput` interpolates; None where fewer than two
        sizes were recorded."""
        points = self.sizes.get(composition, {}).get(kernel, ())
        return (points[0][0], points[-1][0]) if len(points) >= 2 else None


def cache_dir() -> Path:
    """Where ``--measure`` stores its tables: ``$HCP_ADVISE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/hcp_compile``, else ``~/.cache/hcp_compile``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hcp_compile"


def cache_file(device_kind: str, folder: Path | None = None) -> Path:
    """``advisor-<device kind>.json`` in ``folder`` (None: :func:`cache_dir`), the kind's
    characters outside ``[A-Za-z0-9._-]`` as ``_``."""
    return (folder or cache_dir()) / f"advisor-{re.sub(r'[^A-Za-z0-9._-]+', '_', device_kind)}.json"


def stored_table(device_kind: str) -> KernelTable | None:
    """The runtime's measurements of ``device_kind``; None where it has none."""
    rates = measured.recorded().get(device_kind)
    if rates is None:
        return None
    return KernelTable(device_kind, STORED_MEASUREMENTS, rates, measured.recorded_sizes().get(device_kind, {}))


def cached_table(device_kind: str, folder: Path | None = None) -> KernelTable | None:
    """The measurements ``--measure`` stored for ``device_kind`` in ``folder``; None where there are none."""
    path = cache_file(device_kind, folder)
    if not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text())["devices"][device_kind]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InputError(f"{path}: expected the measurements of {device_kind!r} as `{MEASURE}` writes them, "
                         f"could not read them ({type(error).__name__}: {error}); run it again") from None
    return table_of(entry, device_kind, str(path))


def kernel_table(device_kind: str, folder: Path | None = None) -> KernelTable:
    """The measurements the advisor times ``device_kind``'s kernels by: the cache's (this user
    measured that GPU), else the runtime's; :class:`InputError` saying what to run where neither has any."""
    table = cached_table(device_kind, folder) or stored_table(device_kind)
    if table is None:
        raise InputError(missing_message(device_kind, folder))
    return table


def missing_message(device_kind: str, folder: Path | None = None) -> str:
    """What to run when no measurements of ``device_kind`` exist."""
    command = MEASURE if folder is None or folder == cache_dir() else f"{MEASURE} --cache-dir {folder}"
    return (f"device_kind: no measurements for {device_kind!r}: {STORED_MEASUREMENTS} has "
            f"{sorted(measured.recorded())} and {cache_file(device_kind, folder)} does not exist. On a machine with that GPU run `{command}` "
            f"(about 2 minutes; it writes that file, which later calls read: copy it here if you advise on "
            f"another machine), or pass --device-kind {DEFAULT_DEVICE!r} to advise with its measurements")


def table_of(entry: Any, device_kind: str, source: str) -> KernelTable:
    """The :class:`KernelTable` of a measured.json-format device ``entry`` (TFLOP/s); :class:`InputError`
    naming the first bad value of ``source``."""
    def rate(value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise InputError(f"{source}: {where}: expected a positive number, got {value!r}; run `{MEASURE}` again")
        return float(value)

    def kernels(row: Any, where: str) -> dict[str, float]:
        if not isinstance(row, dict) or not row:
            raise InputError(f"{source}: {where}: expected kernel -> TFLOP/s, got {row!r}; run `{MEASURE}` again")
        return {kernel: rate(value, f"{where}[{kernel!r}]") * 1e12 for kernel, value in row.items()}

    if not isinstance(entry, dict) or not isinstance(entry.get("tflops"), dict) or not entry["tflops"]:
        raise InputError(f"{source}: expected {device_kind!r}'s 'tflops' per composition; run `{MEASURE}` again")
    rates = {kind: kernels(row, f"tflops[{kind!r}]") for kind, row in entry["tflops"].items()}
    points: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for i, record in enumerate(entry.get("sizes", [])):
        where = f"sizes[{i}]"
        if not isinstance(record, dict) or not isinstance(record.get("composition"), str):
            raise InputError(f"{source}: {where}: expected a record with a 'composition'; run `{MEASURE}` again")
        work = rate(record.get("call_tflop"), f"{where}.call_tflop") * 1e12
        for kernel, flops in kernels(record.get("tflops"), f"{where}.tflops").items():
            points.setdefault(record["composition"], {}).setdefault(kernel, []).append((work, flops))
    names = {f.name for f in fields(Links)}
    links = entry.get("links", {})
    if not isinstance(links, dict) or not set(links) <= names:
        raise InputError(f"{source}: links: expected some of {sorted(names)}, got {links!r}; run `{MEASURE}` again")
    return KernelTable(device_kind, source, rates,
                       {kind: {kernel: tuple(sorted(p)) for kernel, p in per_kernel.items()}
                        for kind, per_kernel in points.items()},
                       {name: rate(value, f"links.{name}") for name, value in links.items()},
                       str(entry.get("links_note", "")))


def entry_of(timings: Sequence[Timing]) -> dict[str, Any]:
    """The ``tflops`` and ``sizes`` of a measured.json entry from ``timings``: per composition and
    batch size a record of the mean TFLOP of one call and each kernel's TFLOP/s, and as the main
    table each kernel's TFLOP/s on its largest batches of the composition (4 significant digits)."""
    if not timings:
        raise InputError("measure: no kernel could be timed on this GPU (the lines above say why)")

    def tflops(t: Timing) -> float:
        return float(f"{t.flops / t.seconds / 1e12:.4g}")

    records: dict[tuple[int, str], dict[str, Any]] = {}
    largest: dict[str, dict[str, Timing]] = {}
    for t in sorted(timings, key=lambda t: t.tokens):
        record = records.setdefault((t.tokens, t.composition), {
            "tokens": t.tokens, "composition": t.composition,
            "call_tflop": float(f"{t.flops / t.calls / 1e12:.4g}"), "tflops": {}})
        record["tflops"][t.kernel] = tflops(t)
        largest.setdefault(t.composition, {})[t.kernel] = t
    return {"tflops": {kind: {kernel: tflops(t) for kernel, t in row.items()} for kind, row in largest.items()},
            "sizes": list(records.values())}


def store(path: Path, device_kind: str, entry: dict[str, Any]) -> None:
    """Write ``entry`` as ``device_kind``'s measurements to ``path`` (replaced whole, never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"devices": {device_kind: entry}}, indent=2) + "\n")
    partial.replace(path)
