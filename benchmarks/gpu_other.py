"""The GPU's work besides the attention kernels of one rank's eager CP call, profiled and fitted
(issue 26: the advisor's GPU-other part, kernels/gpu_other_measured.json).

    python -m benchmarks.gpu_other --out gpu_other.json       # on one GPU: profile, fit, write
    python -m benchmarks.gpu_other --record gpu_other.json    # add its constants to gpu_other_measured.json
    python -m benchmarks.gpu_other --device cpu --kernel torch --meshes 1x2 --shrink 512 --out /tmp/g.json

Rank ``--rank`` of each mesh runs alone over torch's fake process group, as
``benchmarks/speed.py --fake-rank`` runs it (its helpers, its ``hcp-eager`` call), on real-size
workloads. Each phase runs under ``torch.profiler``; its device time is split into what the
attention op (``hcp::block_*``) launched, which the compute part covers (kernels/measured.json
timed that op), communication (NCCL's kernels by name, none over the fake group) and the rest.
The rest is set against the bytes the advisor counts for that rank and phase
(:func:`hcp_compile.advise.gpu_other_bytes`), and a least-squares fit through the origin per
phase gives ``seconds = per_byte_s * bytes``. A first table shows every point's bytes, other ms,
fit and residual; a second the attention op's time, its attention kernels' (by name,
:func:`kernel_class`) and the rest of it, its own passes, beside the bytes counted for them
(:func:`hcp_compile.advise.kernel_own_bytes`): what the ring's K/V copies add to the compute
part. The JSON holds the constants in gpu_other_measured.json's form (``devices``) and the
points. On CPU (a smoke run of the plumbing) the ops' CPU time stands for the device time.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from argparse import Namespace
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tabulate import tabulate
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from hcp_compile import InputError, layout
from hcp_compile.advise import cu_seqlens_of, gpu_other_bytes, kernel_own_bytes, rank_sizes
from hcp_compile.kernels import KERNEL_CHOICES
from hcp_compile.kernels.gpu_other_measured import GPU_OTHER_FILE, parse, recorded
from hcp_compile.kernels.host_measured import PHASES
from hcp_compile.kernels.measured import device_kind
from hcp_compile.placements import placement_rule
from hcp_compile.schemes.traffic import CallShape

from .host_times import (
    MODE, PLACEMENT, measuring_parser, nonnegative_least_squares, parse_measuring, record, run,
)
from .speed import (
    HEADS, Batch, Setup, _synchronize, fake_process_group, fill_free_memory, hcp_eager, hcp_kernel,
    workloads as all_workloads,
)

ATTENTION_OP = "hcp::block_"  # the attention op (hcp::block_forward, hcp::block_backward): a CPU event
# substrings (lower case) of the names of attention kernels: cuDNN's SDPA graphs
# (cudnn_generated_fort_native_sdpa_*, and the dot(dO, O) and dQ conversion kernels of its
# backward), FlashAttention's, cutlass' fmha, and the attention op itself (CPU runs)
ATTENTION = ("sdpa", "fmha", "flash", "compute_dot_do_o", "convert_dq", ATTENTION_OP)
COMMUNICATION = ("nccl",)  # NCCL's kernels (none over the fake group)


def kernel_class(name: str) -> str:
    """``"attention"``, ``"communication"`` or ``"other"`` for a profiled kernel (or CPU op)
    named ``name``, by the substrings :data:`ATTENTION` and :data:`COMMUNICATION`; everything
    else (merges, copies, fills, sums) is the GPU-other part."""
    lowered = name.lower()
    if any(pattern in lowered for pattern in ATTENTION):
        return "attention"
    if any(pattern in lowered for pattern in COMMUNICATION):
        return "communication"
    return "other"


@dataclass(frozen=True)
class Point:
    """One rank's call on one workload: the advisor's bytes outside the attention op and the
    bytes of the op's own passes (:func:`hcp_compile.advise.kernel_own_bytes`), and the median
    profiled ms per phase: everything the attention op launched, its attention kernels alone
    (by name), and the kernels outside it (communication left out)."""

    kernel: str
    mesh: str  # "AxR"
    rank: int
    workload: str
    forward_bytes: int
    backward_bytes: int
    own_forward_bytes: int
    own_backward_bytes: int
    op_forward_ms: float
    kernels_forward_ms: float
    other_forward_ms: float
    op_backward_ms: float
    kernels_backward_ms: float
    other_backward_ms: float


def profiled_ms(run: Callable[[], object], device: torch.device) -> dict[str, float]:
    """Ms of ``run``'s device work: ``op``, what the attention op (:data:`ATTENTION_OP`)
    launched, which the compute part covers (kernels/measured.json timed the op); ``kernels``,
    the attention kernels among them; ``communication``; ``other``, the rest. On CPU the same
    from the ops' CPU time (a smoke run: no kernels, so ``kernels`` is the op's time)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        run()
        _synchronize(device)
    events = prof.events()
    work = [e for e in events if e.device_type == (DeviceType.CUDA if cuda else DeviceType.CPU)]
    classes = {"attention": 0.0, "communication": 0.0, "other": 0.0}
    for event in work:
        classes[kernel_class(event.name)] += (event.self_device_time_total if cuda else event.self_cpu_time_total)
    ops = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith(ATTENTION_OP)]
    op = sum(e.device_time_total if cuda else e.cpu_time_total for e in ops)
    total = sum(classes.values())
    return {"op": op / 1e3, "kernels": (classes["attention"] if cuda else op) / 1e3,
            "communication": classes["communication"] / 1e3, "other": (total - op - classes["communication"]) / 1e3}


def measure_mesh(ulysses: int, ring: int, args: Namespace) -> list[Point]:
    """Rank ``args.rank`` of ``ulysses x ring`` alone over the fake group, on every workload."""
    world, rank = ulysses * ring, args.rank
    by_name = all_workloads(args.shrink)
    points = []
    with fake_process_group(rank, world):
        options = Namespace(**{**vars(args), "ulysses": ulysses, "ring": ring})
        setup = Setup(options, torch.device(args.device), getattr(torch, args.dtype), rank, world, fake=True)
        heads_q, heads_kv = HEADS[args.heads]
        call = CallShape(heads_q, heads_kv, args.head_dim, setup.dtype)
        for name in args.workloads:
            workload = by_name[name]
            ran = hcp_kernel(workload, args.heads, setup)  # the kernel the call resolves to (auto)
            batch = layout.batch_layout(cu_seqlens_of(workload.lengths), ulysses, ring, placement_rule(PLACEMENT))
            sizes = rank_sizes(batch, rank // ulysses, rank % ulysses)
            moved, own = gpu_other_bytes(sizes, ring, call), kernel_own_bytes(sizes, rank // ulysses, ring, call, ran)
            if setup.device.type == "cuda":  # what the fake collectives "receive" (as speed.py's fake ranks)
                fill_free_memory(setup.device)
            with hcp_eager(Batch.make(workload, args.heads, setup), setup, PLACEMENT) as (attend, shards):
                forward, backward = phase_classes(attend, shards, setup.device, args.warmup, args.iters)
            points.append(Point(ran, f"{ulysses}x{ring}", rank, name, moved.forward, moved.backward, own.forward,
                                own.backward, forward["op"], forward["kernels"], forward["other"], backward["op"],
                                backward["kernels"], backward["other"]))
            print(f"  {points[-1]}", flush=True)
    return points


def phase_classes(attend: Callable[..., torch.Tensor], shards: list[torch.Tensor], device: torch.device,
                  warmup: int, iters: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms per kernel class of the forward and of the backward, each profiled alone."""
    for _ in range(warmup):
        attend(*shards).backward(torch.ones_like(shards[0]))
    runs: list[tuple[dict[str, float], dict[str, float]]] = []
    for _ in range(iters):
        for t in shards:
            t.grad = None
        held: list[torch.Tensor] = []
        forward = profiled_ms(lambda: held.append(attend(*shards)), device)
        grad = torch.ones_like(held[0])  # made outside the profiled backward
        backward = profiled_ms(lambda: held[0].backward(grad), device)
        runs.append((forward, backward))
    return tuple({name: statistics.median(run[phase][name] for run in runs) for name in runs[0][phase]}
                 for phase in (0, 1))


def fit_per_byte(moved: Sequence[int], seconds: Sequence[float]) -> float:
    """The seconds per byte of ``seconds`` over ``moved``, through the origin, never negative."""
    return nonnegative_least_squares([[float(b)] for b in moved], seconds)[0]


def fitted(points: list[Point]) -> dict[str, dict[str, dict[str, float]]]:
    """Kernel -> phase -> ``{"per_byte_s": seconds}``."""
    result = {}
    for kernel in sorted({p.kernel for p in points}):
        mine = [p for p in points if p.kernel == kernel]
        result[kernel] = {phase: {"per_byte_s": fit_per_byte([getattr(p, f"{phase}_bytes") for p in mine],
                                                             [getattr(p, f"other_{phase}_ms") / 1e3 for p in mine])}
                          for phase in PHASES}
    return result


def table(points: list[Point], constants: dict[str, dict[str, dict[str, float]]]) -> str:
    """The fit: per point and phase the bytes outside the attention op, their profiled ms, the
    fitted ms and the residual."""
    rows = []
    for p in points:
        row = [p.kernel, p.mesh, p.rank, p.workload]
        for phase in PHASES:
            moved, measured = getattr(p, f"{phase}_bytes"), getattr(p, f"other_{phase}_ms")
            model = 1e3 * constants[p.kernel][phase]["per_byte_s"] * moved
            residual = f"{100 * (model - measured) / measured:+.1f} %" if measured else "-"
            row += [round(moved / 2**20, 1), round(measured, 3), round(model, 3), residual]
        rows.append(row)
    headers = ["kernel", "mesh AxR", "rank", "workload"]
    for short in ("fwd", "bwd"):
        headers += [f"{short} MiB", f"{short} other ms", f"{short} fit", f"{short} residual"]
    return tabulate(rows, headers=headers, tablefmt="github")


def op_table(points: list[Point]) -> str:
    """The attention op per point and phase: all it launched, its attention kernels, the rest
    (its own passes, in the compute part) beside the bytes counted for them."""
    rows = [[p.kernel, p.mesh, p.workload,
             *(value for phase in PHASES for value in (
                 round(getattr(p, f"op_{phase}_ms"), 3), round(getattr(p, f"kernels_{phase}_ms"), 3),
                 round(getattr(p, f"op_{phase}_ms") - getattr(p, f"kernels_{phase}_ms"), 3),
                 round(getattr(p, f"own_{phase}_bytes") / 2**20, 1)))]
            for p in points]
    headers = ["kernel", "mesh AxR", "workload"]
    for short in ("fwd", "bwd"):
        headers += [f"{short} op ms", f"{short} attention kernels ms", f"{short} own passes ms", f"{short} own MiB"]
    return tabulate(rows, headers=headers, tablefmt="github")


def measure_all(args: Namespace) -> dict:
    started = time.perf_counter()
    points: list[Point] = []
    for ulysses, ring in args.meshes:
        if args.rank < ulysses * ring:
            print(f"rank {args.rank} of {ulysses} x {ring} alone", flush=True)
            points += measure_mesh(ulysses, ring, args)
    if not points:
        raise InputError(f"--rank: {args.rank} is beyond every mesh of --meshes; pass a rank they all have")
    constants = fitted(points)
    print(table(points, constants))
    print(op_table(points))
    for kernel, phases in constants.items():  # as a bandwidth: bytes per second of the fitted constant
        print(f"{kernel}: " + ", ".join(f"{phase} {1e12 * values['per_byte_s']:.4g} ps/byte"
                                        f" ({1e-9 / values['per_byte_s'] if values['per_byte_s'] else float('inf'):.4g} GB/s)"
                                        for phase, values in phases.items()))
    entry = {
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "setup": (f"benchmarks/gpu_other.py: rank {args.rank} alone over the fake process group, {args.heads} heads "
                  f"of {args.head_dim}, {args.dtype}, workloads {','.join(args.workloads)} (shrink {args.shrink}), "
                  f"meshes {','.join(f'{a}x{r}' for a, r in args.meshes)}, median of {args.iters} after "
                  f"{args.warmup}"),
        "modes": {MODE: constants},
    }
    print(f"measured in {time.perf_counter() - started:.1f} s")
    return {"devices": {device_kind(torch.device(args.device)): entry}, "points": [asdict(p) for p in points]}


def parse_args(argv: Sequence[str] | None = None) -> Namespace:
    parser = measuring_parser(__doc__, "2x1,2x2,2x4,8x1", "add the constants of a --out file to --into")
    parser.add_argument("--into", type=Path, default=GPU_OTHER_FILE, help="the record --record adds to")
    parser.add_argument("--kernel", default="cudnn", choices=KERNEL_CHOICES)
    parser.add_argument("--rank", type=int, default=0, help="the rank of each mesh that runs")
    parser.add_argument("--workloads", default="W2-128K,W3-128K", help="comma-separated speed.py workloads")
    parser.add_argument("--shrink", type=int, default=1, help="speed.py's --shrink (CPU smoke runs)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    args = parse_measuring(parser, argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    known = all_workloads()
    unknown = [w for w in args.workloads if w not in known]
    if unknown or not args.workloads:
        parser.error(f"--workloads: expected some of {', '.join(known)}, got {unknown or args.workloads}")
    if args.rank < 0 or args.shrink < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--rank: at least 0; --shrink, --iters: at least 1; --warmup: at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    run(args, measure_all, lambda path: record(path, args.into, parse, recorded))


if __name__ == "__main__":
    main(sys.argv[1:])
