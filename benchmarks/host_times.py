"""The host time of one rank's eager CP call, measured and fitted (the advisor's host
part, hcp_advise/host_measured.json).

    python -m benchmarks.host_times --out host.json          # on one GPU: measure, fit, write
    python -m benchmarks.host_times --record host.json       # add its constants to host_measured.json
    python -m benchmarks.host_times --device cpu --kernels torch --meshes 1x2,2x1 --out /tmp/h.json

Each mesh's ranks (``--ranks``: the first and the last by default) run alone over torch's fake
process group, as ``benchmarks/speed.py --fake-rank`` runs them (its helpers, its ``hcp-eager``
call), on tiny batches whose layouts differ in their counts of kernel calls, ring steps and head
groups: one document, short documents (all local) and a mix. The GPU's work is then negligible,
so a phase's wall time (synchronized before and after) is the host's. The counts of each point
are the advisor's (:func:`hcp_advise.host.host_counts` on the batch's layout); a least-
squares fit per kernel and phase gives ``host seconds = floor + per_call * calls + per_step *
steps + per_group * groups``. The table shows every point's measured and fitted ms; the JSON
holds the constants in host_measured.json's form (``devices``) and the points. Collectives over
the fake group cost the host less than NCCL's do: the constants are a floor for those.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys
import time
from argparse import Namespace
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tabulate import tabulate
from torch import Tensor

from hcp_advise import cu_seqlens_of, host_counts, rank_sizes
from hcp_advise.host_measured import (
    COEFFICIENTS, HOST_FILE, PHASES, HostConstants, parse_devices, recorded,
)
from hcp_advise.records import SCHEME, HostCounts
from hcp_compile import InputError
from hcp_compile.batch import layout
from hcp_compile.batch.placements import placement_rule
from hcp_compile.kernels import KERNEL_CHOICES
from hcp_compile.kernels.measured import device_kind

from .advisor_check import parse_mesh
from .speed_modes import hcp_eager, hcp_kernel
from .speed_setup import Batch, Setup, fake_process_group, synchronize
from .speed_workloads import HEADS, Workload

MODE = "hcp-eager"
PLACEMENT = "balanced"
DEFAULT_MESHES = "1x2,1x4,1x8,2x1,2x2,2x4,4x1,4x2,8x1"


@dataclass(frozen=True)
class Point:
    """One rank's call on one batch: its counts and its median phase times."""

    kernel: str
    mesh: str  # "AxR"
    rank: int
    batch: str
    calls: int
    steps: int
    groups: int
    forward_ms: float
    backward_ms: float

    @property
    def counts(self) -> HostCounts:
        return HostCounts(self.calls, self.steps, self.groups)


def batches(world: int, rank_tokens: int) -> list[Workload]:
    """Tiny batches of ``rank_tokens`` per rank: one document (every step calls the kernel, no
    local region), short documents (a local region, no ring section: the own step only) and
    half of each."""
    tokens, short = world * rank_tokens, max(1, rank_tokens // 16)  # local: at most 1/8 of a rank's
    shorts = (short,) * (tokens // short)
    return [Workload("one document", (tokens,)), Workload("short documents", shorts),
            Workload("mixed", (tokens // 2,) + shorts[: len(shorts) // 2])]


def phase_ms(fn: Callable[..., Tensor], inputs: list[Tensor], device: torch.device, warmup: int,
             iters: int) -> tuple[float, float]:
    """Median ms of the forward and of the backward, each synchronized before and after."""
    times: list[tuple[float, float]] = []
    for i in range(warmup + iters):
        for t in inputs:
            t.grad = None
        synchronize(device)
        started = time.perf_counter()
        out = fn(*inputs)
        synchronize(device)
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        synchronize(device)
        if i >= warmup:
            times.append(((middle - started) * 1e3, (time.perf_counter() - middle) * 1e3))
    return statistics.median(f for f, _ in times), statistics.median(b for _, b in times)


def measure_mesh(ulysses: int, ring: int, rank: int, kernel: str, args: Namespace) -> list[Point]:
    """Rank ``rank`` of ``ulysses x ring`` alone over the fake group, on every tiny batch."""
    world = ulysses * ring
    with fake_process_group(rank, world):
        # laid out as its own counts are (batch_layout below, no window), under the advisor's scheme
        options = Namespace(**{**vars(args), "ulysses": ulysses, "ring": ring, "kernel": kernel,
                               "layout_window": "off", "scheme": SCHEME})
        setup = Setup(options, torch.device(args.device), getattr(torch, args.dtype), rank, world, fake=True)
        heads_q, heads_kv = HEADS[args.heads]
        points = []
        for workload in batches(world, args.rank_tokens):
            ran = hcp_kernel(workload, args.heads, setup)  # the kernel the call resolves to (auto)
            batch = layout.batch_layout(cu_seqlens_of(workload.lengths), ulysses, ring, placement_rule(PLACEMENT))
            counts = host_counts(rank_sizes(batch, rank // ulysses, rank % ulysses), rank // ulysses, ring, ran,
                                 heads_kv)
            with hcp_eager(Batch.make(workload, args.heads, setup), setup, PLACEMENT) as (attend, shards):
                forward, backward = phase_ms(attend, shards, setup.device, args.warmup, args.iters)
            points.append(Point(ran, f"{ulysses}x{ring}", rank, workload.name, counts.calls, counts.steps,
                                counts.groups, forward, backward))
            print(f"  {points[-1]}", flush=True)
        return points


def features(counts: HostCounts) -> list[float]:
    return [1.0, float(counts.calls), float(counts.steps), float(counts.groups)]


def nonnegative_least_squares(design: Sequence[Sequence[float]], seconds: Sequence[float]) -> list[float]:
    """The least-squares coefficients of ``seconds`` over the rows of ``design``, none negative
    (a cost is not): the best fit over every subset of the columns that solves to non-negative
    values, the others 0 (four columns: fifteen small solves). A subset whose columns cannot be
    told apart takes the minimum-norm solution."""
    if len(design) != len(seconds) or not design:
        raise InputError(f"fit: expected as many times as points, at least one; got {len(seconds)} and {len(design)}")
    matrix = torch.tensor([list(row) for row in design], dtype=torch.float64)
    target = torch.tensor(list(seconds), dtype=torch.float64)
    width = matrix.shape[1]
    best, best_error = torch.zeros(width, dtype=torch.float64), float(target.square().sum())
    for chosen in itertools.chain.from_iterable(itertools.combinations(range(width), n) for n in range(1, width + 1)):
        columns = list(chosen)
        # gelsd: minimum norm where the design is rank-deficient (gels would fail on CPU)
        solution = torch.linalg.lstsq(matrix[:, columns], target[:, None], driver="gelsd").solution[:, 0]
        error = float((matrix[:, columns] @ solution - target).square().sum())
        if bool((solution >= 0).all()) and error < best_error * (1 - 1e-12):
            best = torch.zeros_like(best)
            best[columns] = solution
            best_error = error
    return best.tolist()


def fit(counts: Sequence[HostCounts], seconds: Sequence[float]) -> HostConstants:
    """The host constants of ``seconds`` over ``counts`` (:func:`nonnegative_least_squares`)."""
    return HostConstants(*nonnegative_least_squares([features(c) for c in counts], seconds))


def predicted_ms(constants: HostConstants, counts: HostCounts) -> float:
    """The fitted model's ms, unclamped (the residuals show the fit as it is)."""
    return 1e3 * sum(c * f for c, f in zip((getattr(constants, n) for n in COEFFICIENTS), features(counts)))


def fitted(points: list[Point]) -> dict[str, dict[str, dict[str, float]]]:
    """Kernel -> phase -> coefficient -> seconds."""
    result = {}
    for kernel in sorted({p.kernel for p in points}):
        mine = [p for p in points if p.kernel == kernel]
        result[kernel] = {phase: asdict(fit([p.counts for p in mine], [getattr(p, f"{phase}_ms") / 1e3 for p in mine]))
                          for phase in PHASES}
    return result


def table(points: list[Point], constants: dict[str, dict[str, dict[str, float]]]) -> str:
    rows = []
    for p in points:
        row = [p.kernel, p.mesh, p.rank, p.batch, p.calls, p.steps, p.groups]
        for phase in PHASES:
            measured = getattr(p, f"{phase}_ms")
            model = predicted_ms(HostConstants(**constants[p.kernel][phase]), p.counts)
            row += [round(measured, 3), round(model, 3), f"{100 * (model - measured) / measured:+.1f} %"]
        rows.append(row)
    headers = ["kernel", "mesh AxR", "rank", "batch", "calls", "steps", "groups",
               "fwd ms", "fwd fit", "fwd residual", "bwd ms", "bwd fit", "bwd residual"]
    return tabulate(rows, headers=headers, tablefmt="github")


def constants_table(constants: dict[str, dict[str, dict[str, float]]]) -> str:
    rows = [[kernel, phase, *(round(values[n] * 1e6, 1) for n in COEFFICIENTS)]
            for kernel, phases in constants.items() for phase, values in phases.items()]
    return tabulate(rows, headers=["kernel", "phase", *(f"{n[:-2]} us" for n in COEFFICIENTS)], tablefmt="github")


def measure_all(args: Namespace) -> dict:
    started = time.perf_counter()
    points: list[Point] = []
    for kernel in args.kernels:
        for ulysses, ring in args.meshes:
            for rank in sorted({r if r >= 0 else ulysses * ring + r for r in args.ranks}):
                if 0 <= rank < ulysses * ring:
                    print(f"{kernel}: rank {rank} of {ulysses} x {ring} alone", flush=True)
                    points += measure_mesh(ulysses, ring, rank, kernel, args)
    constants = fitted(points)
    print(table(points, constants))
    print(constants_table(constants))
    device = torch.device(args.device)
    kind = device_kind(device)
    entry = {
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "setup": (f"benchmarks/host_times.py: one rank alone over the fake process group, {args.heads} heads of "
                  f"{args.head_dim}, {args.dtype}, {args.rank_tokens} tokens per rank, meshes "
                  f"{','.join(f'{a}x{r}' for a, r in args.meshes)}, median of {args.iters} after {args.warmup}"),
        "modes": {MODE: constants},
    }
    print(f"measured in {time.perf_counter() - started:.1f} s")
    return {"devices": {kind: entry}, "points": [asdict(p) for p in points]}


def record(path: Path, into: Path = HOST_FILE) -> None:
    """Add the constants of ``path`` (this command's ``--out``) to ``into``, per device, mode
    and kernel (a newer record of the same replaces the older)."""
    devices = json.loads(path.read_text()).get("devices")
    parse_devices(devices, str(path))  # refuse a bad file before touching the record
    data = json.loads(into.read_text())
    for kind, entry in devices.items():
        old = data["devices"].get(kind, {})
        modes = old.get("modes", {})
        kept = any(set(modes.get(mode, {})) - set(kernels) for mode, kernels in entry["modes"].items())
        for mode, kernels in entry["modes"].items():
            modes[mode] = {**modes.get(mode, {}), **kernels}
        merged = {**old, **{k: v for k, v in entry.items() if k != "modes"}, "modes": modes}
        if kept and old.get("setup") not in (None, entry.get("setup")):
            merged["setup"] = _setup_beside(old["setup"], entry["modes"], entry.get("setup"))
        data["devices"][kind] = merged
    into.write_text(json.dumps(data, indent=2) + "\n")
    recorded.cache_clear()
    recorded(into)  # what was written reads back
    added = ", ".join(f"{kind} {mode} {sorted(kernels)}" for kind, entry in devices.items()
                      for mode, kernels in entry["modes"].items())
    print(f"recorded {added} into {into}")


def _setup_beside(old: str, modes: dict, setup: str | None) -> str:
    """The device's setup text after recording ``modes``' kernels with ``setup`` beside kernels
    it keeps: the kept kernels' text, then ``"; KERNELS: setup"``, replacing an earlier such
    part for the same kernels (so that recording them again does not grow it)."""
    added = ", ".join(sorted({kernel for kernels in modes.values() for kernel in kernels}))
    parts = [part for part in old.split("; ") if not part.startswith(f"{added}: ")]
    return "; ".join([*parts, f"{added}: {setup}"])


def measuring_parser(description: str, meshes: str, record_help: str) -> argparse.ArgumentParser:
    """This command's options: ``--out`` or ``--record``, the device, the meshes, the call's
    heads, head dim and dtype."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="measure, fit and write the constants and points here")
    parser.add_argument("--record", type=Path, metavar="JSON", help=record_help)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--meshes", default=meshes, help="comma-separated ULYSSESxRING meshes")
    parser.add_argument("--heads", default="gqa", choices=sorted(HEADS))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    return parser


def parse_measuring(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Namespace:
    """The arguments of a :func:`measuring_parser`, ``--meshes`` as ``(ulysses, ring)`` pairs."""
    args = parser.parse_args(argv)
    if (args.out is None) == (args.record is None):
        parser.error("pass --out FILE (measure and fit) or --record FILE (add a measured file's constants)")
    try:
        args.meshes = [parse_mesh(m) for m in args.meshes.split(",")]
    except argparse.ArgumentTypeError as error:
        parser.error(f"--meshes: {error}")
    return args


def parse_args(argv: Sequence[str] | None = None) -> Namespace:
    parser = measuring_parser(__doc__, DEFAULT_MESHES,
                              "add the constants of a --out file to hcp_advise/host_measured.json")
    parser.add_argument("--kernels", default="cudnn",
                        help=f"comma-separated, of {', '.join(KERNEL_CHOICES)} (auto: as CP resolves it)")
    parser.add_argument("--ranks", default="0,-1", help="comma-separated ranks of each mesh (-1: its last)")
    parser.add_argument("--rank-tokens", type=int, default=512, help="tokens per rank of every batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parse_measuring(parser, argv)
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in args.kernels if k not in KERNEL_CHOICES]
    if unknown or not args.kernels:
        parser.error(f"--kernels: expected some of {', '.join(KERNEL_CHOICES)}, got {unknown or args.kernels}")
    try:
        args.ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks: expected comma-separated ints such as 0,-1, got {args.ranks!r}")
    if args.rank_tokens < 16 or args.iters < 1 or args.warmup < 0:
        parser.error("--rank-tokens: at least 16; --iters: at least 1; --warmup: at least 0")
    return args


def run(args: Namespace, measure: Callable[[Namespace], dict], add: Callable[[Path], None]) -> None:
    """A measuring command's work: with ``--record``, ``add`` that file's constants; otherwise
    ``measure`` on the device and write the result to ``--out``."""
    if args.record is not None:
        add(args.record)
        return
    if args.device == "cuda":
        torch.cuda.set_device(0)
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


def main(argv: Sequence[str] | None = None) -> None:
    run(parse_args(argv), measure_all, record)


if __name__ == "__main__":
    main(sys.argv[1:])
