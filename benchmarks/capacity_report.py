"""The capacity benchmark's rows: their ratios to one GPU, table, JSON file, merge and plot
(the measuring is benchmarks/capacity.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tabulate import tabulate

ONE_GPU_MODES = ("one-gpu-eager", "one-gpu-compiled")


@dataclass
class Row:
    mode: str
    mesh: str  # "AxR": one rank of it alone over the fake process group; "1": one GPU
    gpus: int
    rank: int
    checkpointing: bool
    workload: str
    cap: str  # "40.0 GiB"; on CPU the stand-in, "512 tokens per rank"
    capacity: int | None = None  # global tokens
    per_rank: int | None = None
    ratio: float | None = None  # capacity / (gpus x one GPU's), by relate()
    all_ranks_capacity: int | None = None  # --all-ranks: the size every rank fits
    peak_gib: float | None = None  # max allocated in the step at capacity
    reserved_gib: float | None = None  # max reserved: what the cap limits
    step_ms: float | None = None
    tokens_per_s_per_gpu: float | None = None
    probes: int | None = None
    leaked_gib: float | None = None  # allocated after the row beyond before it (freeing failed)
    seconds: float | None = None  # the row's wall time (the configuration compiled before it)
    error: str | None = None



def relate(rows: list[Row]) -> None:
    """Each row's capacity over ``gpus`` x the one-GPU capacity of the same workload,
    checkpointing, cap and kind (eager or compiled)."""
    def group(r: Row) -> tuple:
        return r.mode.split("-")[-1], r.workload, r.checkpointing, r.cap

    one_gpu = {group(r): r.capacity for r in rows if r.mode in ONE_GPU_MODES}
    for row in rows:
        base = one_gpu.get(group(row))
        row.ratio = round(row.capacity / (row.gpus * base), 3) if base and row.capacity is not None else None


def table(rows: list[Row]) -> str:
    headers = ["mode", "mesh", "N", "rank", "ckpt", "workload", "cap", "capacity", "per rank", "ratio",
               "all ranks", "peak GiB", "reserved GiB", "step ms", "tok/s/GPU", "probes", "s", "error"]
    body = [[r.mode, r.mesh, r.gpus, r.rank, "on" if r.checkpointing else "off", r.workload, r.cap, r.capacity,
             r.per_rank, r.ratio, r.all_ranks_capacity, r.peak_gib, r.reserved_gib, r.step_ms, r.tokens_per_s_per_gpu,
             r.probes, r.seconds, (r.error or "")[:60]] for r in rows]
    caption = ("capacity: global tokens of the largest step that fits; ratio: over N x one GPU's (same workload, "
               "checkpointing, eager/compiled). AxR: one rank alone over a fake process group, no communication")
    return f"{caption}\n{tabulate(body, headers=headers, missingval='-')}"


def write_json(path: Path, runs: list[dict], rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs, "rows": [asdict(r) for r in rows]}, indent=1, default=str) + "\n")


def merge(paths: Sequence[Path]) -> tuple[list[dict], list[Row]]:
    """The runs and rows of several files; a row measured again is taken from the later one."""
    runs, by_key, names = [], {}, {f.name for f in fields(Row)}
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs += data["runs"]
        for row in (Row(**{k: v for k, v in raw.items() if k in names}) for raw in data["rows"]):
            by_key[row.mode, row.mesh, row.rank, row.checkpointing, row.workload, row.cap] = row
    rows = list(by_key.values())
    relate(rows)
    return runs, rows


def plot(rows: list[Row], path: Path) -> None:
    """Capacity against N per mode, a panel per (workload, checkpointing, cap), dashed: N x one GPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r.workload, r.checkpointing, r.cap) for r in rows if r.capacity))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        shown = [r for r in rows if (r.workload, r.checkpointing, r.cap) == panel and r.capacity]
        for i, mode in enumerate(dict.fromkeys(r.mode for r in shown)):
            points = sorted((r.gpus, r.capacity) for r in shown if r.mode == mode)
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=f"C{i}", label=mode)
            if mode in ONE_GPU_MODES:  # the ideal: N x one GPU
                ax.plot(*zip(*((n, n * points[0][1]) for n in sorted({1, *(r.gpus for r in shown)}))), "--",
                        color=f"C{i}", label=f"N x {mode}")
        ax.set(title=f"{panel[0]}, checkpointing {'on' if panel[1] else 'off'}, cap {panel[2]}", xlabel="N (ranks)",
               ylabel="tokens per step")
        ax.legend(fontsize="x-small")
    fig.savefig(path, dpi=120, bbox_inches="tight")
