"""The advisor's compute and host parts against one rank's measured time.

    python -m benchmarks.advisor_check --meshes 2x1,1x2,4x1,2x2,1x4,8x1,2x4,1x8 --kernel cudnn \\
        --workloads W1-128K,W2-128K,W3-128K --out DIR          # on one GPU: measure, then compare
    python -m benchmarks.advisor_check --results DIR            # compare again from DIR's JSONs
    python -m benchmarks.advisor_check --comparisons benchmarks/results/advisor_check.json
                                                # predict again the measured times of a comparison

Each mesh's rank runs alone over torch's fake process group (``benchmarks/speed.py
--fake-rank``, mode ``hcp-eager``): its kernels, layout copies and merges, no communication.
That is what the advisor's compute part (:func:`hcp_advise.compute_times`) predicts
for that rank from the device's kernel measurements (kernels/measured.json, or what
``python -m hcp_advise --measure`` stored), so the two are set side by side here: measured ms,
predicted ms and the prediction's error; beside them the whole model's prediction of the rank
(:func:`hcp_advise.predict_rank` with no communication: its kernels, its memory-bound passes
besides them, and the GPU waiting for its host, hcp_advise/host_measured.json; none where the
device's host constants were not measured). The communication part is checked against the
bytes the code sends by the CPU tests (tests/test_schemes.py, tests/test_advise.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from tabulate import tabulate

from hcp_advise import (
    DEFAULT_DEVICE, ExchangeTimes, HopTimes, active_steps, block_work, compute_times, cu_seqlens_of,
    cuts_short_segments, host_counts, host_leads, host_measured, host_times, kernel_table, pass_times,
    predict_rank, rank_sizes,
)
from hcp_compile.batch.schedule import head_groups, rank_kv_heads
from hcp_compile import InputError
from hcp_compile.batch import layout
from hcp_compile.batch.placements import placement_rule
from hcp_compile.batch.traffic import CallShape

from .speed_report import read_json
from .speed_workloads import HEADS, Workload, workloads


@dataclass(frozen=True)
class Comparison:
    workload: str
    mesh: str  # "AxR"
    rank: int
    placement: str
    kernel: str
    measured_ms: float | None
    predicted_ms: float | None
    error: str | None = None  # the run's or the model's error, instead of a time
    predicted_host_ms: float | None = None  # the whole model (passes, host); None: no host times for the device

    @property
    def error_pct(self) -> float | None:
        return _error_pct(self.predicted_ms, self.measured_ms)

    @property
    def error_host_pct(self) -> float | None:
        return _error_pct(self.predicted_host_ms, self.measured_ms)


def _error_pct(predicted: float | None, measured: float | None) -> float | None:
    if measured is None or predicted is None:
        return None
    return 100 * (predicted - measured) / measured


def parse_mesh(text: str) -> tuple[int, int]:
    ulysses, _, ring = text.partition("x")
    if not (ulysses.isdigit() and ring.isdigit() and int(ulysses) > 0 and int(ring) > 0):
        raise argparse.ArgumentTypeError(f"expected a mesh ULYSSESxRING such as 2x4, got {text!r}")
    return int(ulysses), int(ring)


def predicted_ms(lengths: tuple[int, ...], ulysses: int, ring: int, rank: int, placement: str, kernel: str,
                 heads: str, head_dim: int, device_kind: str,
                 window: int = -1) -> tuple[float, float | None]:
    """The advisor's time of global rank ``rank`` (ring rank ``rank // ulysses``, Ulysses rank
    ``rank % ulysses``, as ``make_mesh`` numbers them) alone, for the batch of document
    ``lengths``: its compute, with the kernel times the advisor has for ``device_kind``
    (``hcp_advise.kernel_table``: what ``--measure`` stored, else kernels/measured.json); and
    the whole model's step of the rank with no communication (``predict_rank``: its compute, its
    passes besides the kernels, the GPU waiting for its host), None where
    hcp_advise/host_measured.json has no eager host times for the device and kernel.
    ``window``: the call's causal sliding window (-1: none)."""
    batch = layout.batch_layout(cu_seqlens_of(lengths), ulysses, ring, placement_rule(placement))
    heads_q, heads_kv = HEADS[heads]
    call = CallShape(heads_q, heads_kv, head_dim, torch.bfloat16, window=window)
    ring_rank, ulysses_rank = rank // ulysses, rank % ulysses
    work = block_work(batch, window, cuts_short_segments(kernel))
    times = compute_times(work, ring_rank, ulysses_rank, call, kernel, kernel_table(device_kind))
    record = host_measured.find(device_kind, "hcp-eager", kernel)
    if record is None:
        return times.total * 1e3, None
    sizes = rank_sizes(batch, ring_rank, ulysses_rank)
    active = active_steps(work, ring_rank, sizes, ring)
    step, *_ = predict_rank(
        times, ExchangeTimes(), HopTimes(), head_groups(rank_kv_heads(heads_kv, ulysses), ulysses),
        host_times(host_counts(sizes, ring_rank, ring, kernel, heads_kv), record),
        pass_times(sizes, active, call, ulysses, kernel),
        host_leads(sizes, ring_rank, ring, kernel, heads_kv, record))
    return times.total * 1e3, step * 1e3


def measure(out: Path, ulysses: int, ring: int, rank: int, args: argparse.Namespace) -> None:
    """One rank alone (``speed.py --fake-rank``), its rows written to ``out`` (none if it fails:
    the comparison then lacks that rank)."""
    path = out / f"advisor_u{ulysses}r{ring}_rank{rank}.json"
    command = [sys.executable, "-m", "benchmarks.speed", "--fake-rank", str(rank), "--ulysses", str(ulysses),
               "--ring", str(ring), "--modes", "hcp-eager", "--workloads", args.workloads, "--heads", args.heads,
               "--kernel", args.kernel, "--placements", args.placements, "--warmup", str(args.warmup),
               "--iters", str(args.iters), "--no-profile", "--device", args.device, "--shrink", str(args.shrink),
               "--out", str(path)]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=False)


def compare(paths: list[Path], device_kind: str | None, kernel: str | None = None) -> list[Comparison]:
    """Every hcp-eager row of the fake-rank JSONs ``paths`` against its prediction for the
    kernel the row ran (``kernel``: for this one instead)."""
    result = []
    for path in paths:
        try:
            runs, rows = read_json(path)
        except (KeyError, TypeError, json.JSONDecodeError):
            print(f"skipped {path}: not the JSON of a benchmarks/speed.py run", file=sys.stderr)
            continue
        run = runs[0]
        if run.get("fake_rank") is None:
            continue
        options, rank = run["options"], run["fake_rank"]
        kind = device_kind or run["device"]
        by_name = workloads(options["shrink"])  # the run's batches, drawn as it drew them
        for row in rows:
            if row.mode != "hcp-eager" or row.recompute_exchange:
                continue
            ulysses, ring = parse_mesh(row.mesh.split()[0])  # "AxR rank R alone"
            measured = Comparison(row.workload, f"{ulysses}x{ring}", rank, row.placement, row.kernel, row.ms,
                                  None, row.error)
            result.append(predicted(measured, by_name, row.heads, options["head_dim"], kind, kernel))
    return sorted(result, key=lambda c: (c.workload, c.mesh, c.rank, c.placement))


def predicted(measured: Comparison, by_name: dict[str, Workload], heads: str, head_dim: int, device_kind: str,
              kernel: str | None = None) -> Comparison:
    """``measured`` with the advisor's predictions for the kernel it ran (``kernel``: this one)."""
    ulysses, ring = parse_mesh(measured.mesh)
    try:
        workload = by_name[measured.workload]
        compute, with_host = predicted_ms(
            workload.lengths, ulysses, ring, measured.rank, measured.placement,
            kernel or measured.kernel, heads, head_dim, device_kind, workload.window_left)
        return replace(measured, predicted_ms=compute, predicted_host_ms=with_host)
    except InputError as model_error:  # a kernel or device the measurements do not cover
        return replace(measured, predicted_ms=None, predicted_host_ms=None,
                       error=measured.error or str(model_error))


def recompare(path: Path, heads: str, head_dim: int, device_kind: str, kernel: str | None = None) -> list[Comparison]:
    """The measured rows of an earlier comparison (an advisor_check.json, its batches unshrunk)
    predicted again, with the host part where it is measured."""
    by_name = workloads()
    names = [f.name for f in fields(Comparison) if not f.name.startswith("predicted_")]
    return [predicted(Comparison(**{n: row.get(n) for n in names}, predicted_ms=None), by_name, heads, head_dim,
                      device_kind, kernel)
            for row in json.loads(path.read_text())]


def table(comparisons: list[Comparison]) -> str:
    def ms(value: float | None) -> float | None:
        return None if value is None else round(value, 2)

    def pct(value: float | None) -> str | None:
        return None if value is None else f"{value:+.1f} %"

    rows = [(c.workload, c.mesh, c.rank, c.placement, c.kernel, c.error[:60] if c.error else c.measured_ms,
             ms(c.predicted_ms), pct(c.error_pct), ms(c.predicted_host_ms), pct(c.error_host_pct))
            for c in comparisons]
    text = tabulate(rows, headers=["workload", "mesh AxR", "rank", "placement", "kernel", "measured ms",
                                   "compute ms", "error", "model ms", "error"],
                    tablefmt="github")
    if any(c.predicted_ms is not None and c.predicted_host_ms is None for c in comparisons):
        text += (f"\nmodel: compute, passes and host; not given where hcp_advise/host_measured.json has no host "
                 f"times ({host_measured.HOW_TO_ADD})")
    return text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshes", default="2x1,1x2,4x1,2x2,1x4,8x1,2x4,1x8",
                        help="comma-separated ULYSSESxRING meshes to measure")
    parser.add_argument("--ranks", default="0", help="comma-separated ranks of each mesh (those beyond it skipped)")
    parser.add_argument("--workloads", default="W1-128K,W2-128K,W3-128K")
    parser.add_argument("--heads", default="gqa", choices=sorted(HEADS))
    parser.add_argument("--kernel", default="cudnn")
    parser.add_argument("--placements", default="balanced")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shrink", type=int, default=1, help="speed.py's --shrink (CPU smoke tests)")
    parser.add_argument("--predict-kernel", help="the measured kernel the predictions use (default: the one each "
                        "row ran; another for CPU smoke tests, whose kernels were not measured)")
    parser.add_argument("--device-kind", help="the measured.json device the predictions use (default: the run's)")
    parser.add_argument("--head-dim", type=int, default=128, help="with --comparisons: the runs' head dim")
    parser.add_argument("--out", type=Path, help="measure into this folder, then compare")
    parser.add_argument("--results", type=Path, help="compare the JSONs already in this folder")
    parser.add_argument("--comparisons", type=Path, metavar="JSON",
                        help="predict again the measured rows of an advisor_check.json (--heads, --head-dim: "
                             "the runs'); prints the table")
    args = parser.parse_args()
    if sum(a is not None for a in (args.out, args.results, args.comparisons)) != 1:
        parser.error("pass --out DIR (measure, then compare), --results DIR (compare only) or --comparisons "
                     "JSON (predict an earlier comparison again)")
    try:
        args.meshes = [parse_mesh(m) for m in args.meshes.split(",")]
    except argparse.ArgumentTypeError as error:
        parser.error(f"--meshes: {error}")
    if not all(r.isdigit() for r in args.ranks.split(",")):
        parser.error(f"--ranks: expected comma-separated ranks such as 0,1, got {args.ranks!r}")
    args.ranks = [int(r) for r in args.ranks.split(",")]
    return args


def main() -> None:
    args = parse_args()
    if args.comparisons is not None:
        print(table(recompare(args.comparisons, args.heads, args.head_dim, args.device_kind or DEFAULT_DEVICE,
                              args.predict_kernel)))
        return
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for ulysses, ring in args.meshes:
            for rank in args.ranks:
                if rank < ulysses * ring:
                    measure(args.out, ulysses, ring, rank, args)
    folder = args.out or args.results
    results = [p for p in sorted(folder.glob("*.json")) if p.name != "advisor_check.json"]
    comparisons = compare(results, args.device_kind, args.predict_kernel)
    text = table(comparisons)
    print(text)
    (folder / "advisor_check.md").write_text(text + "\n")
    (folder / "advisor_check.json").write_text(json.dumps(
        [{**c.__dict__, "error_pct": c.error_pct, "error_host_pct": c.error_host_pct} for c in comparisons],
        indent=1) + "\n")


if __name__ == "__main__":
    main()
