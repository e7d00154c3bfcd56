"""Measure the block kernels' throughput on this GPU and record it in the package.

    python -m scripts.measure_kernels                 # writes hcp_compile/kernels/measured.json
    python -m scripts.measure_kernels --out /tmp/m.json --iters 3

Single-device varlen attention (``torch.ops.hcp.varlen_attention`` with each kernel), forward
+ backward, on ``--tokens`` tokens in each composition ``kernel="auto"`` judges calls by
(hcp_compile/kernels/measured.py): one document (the same batch every call: a stream of it is
one shape); log-uniform lengths 256..32K, short documents 128..2K, and log-uniform lengths
under a sliding window of ``--window`` keys back, each as a stream: after one warm-up batch,
``--batches`` batches of new lengths of the same distribution, each through ``--layers`` calls
(a model's layers), so that what a kernel builds per new batch (graphs, masks) counts as a
trainer pays it. TFLOP/s count the real causal work (each
query against the keys up to it, or inside its window; forward 2 products, backward 5). The
device's entry of the JSON file (keyed by ``torch.cuda.get_device_name()``) is replaced; other
devices' entries are kept. The cost hook of the compiled path uses the mean over the unwindowed
compositions.

``--sizes 4096,16384,...`` measures the same compositions on batches of those token counts
and of ``--tokens`` (``--size-kernels``, default the measured ones) by the time some GPU kernel
runs (torch.profiler), not the wall time: a small call's wall time is its host's, which the
advisor counts apart (hcp_advise/host_measured.json). It records them under ``sizes`` with the
mean work of one call; the advisor's compute part times a CP rank's calls by them
(``measured.throughput_at``); ``kernel="auto"`` keeps judging by the main table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from tabulate import tabulate
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import kernel_intervals, log_uniform_lengths, stream_seed, union_intervals
from benchmarks.cp_throughput import causal_flops
from hcp_compile.kernels import KERNELS, BlockRequest
from hcp_compile.kernels import measured
from hcp_compile.kernels.measured import MEASURED_FILE, device_kind


def batches(tokens: int, window: int, count: int) -> dict[str, tuple[list[list[int]], int]]:
    """Composition -> (the document lengths of each batch, window_left or -1): the warm-up
    batch first, then ``count`` timed ones."""

    def stream(low: int, high: int, seed: int) -> list[list[int]]:
        return [log_uniform_lengths(tokens, low, high, seed=stream_seed(seed, step)) for step in range(count + 1)]

    return {
        measured.ONE_DOCUMENT: ([[tokens]] * 3, -1),  # one shape: two timed batches are as good as many
        measured.LOG_UNIFORM: (stream(256, 32768, 0), -1),
        measured.SHORT: (stream(128, 2048, 1), -1),
        measured.WINDOW: (stream(256, 32768, 0), window),
    }


def stream_ms(kernel: str, stream: list[list[int]], window: int, args: argparse.Namespace,
              busy: bool = False) -> float:
    """Total fwd+bwd time of one kernel over the stream's batches after the first (a warm-up),
    CUDA events around the whole; ``busy``: the time some kernel runs instead (a profiler trace
    of the same calls), what the GPU itself spends however fast the host issues."""
    tokens, dtype = sum(stream[0]), getattr(torch, args.dtype)
    q = torch.randn(tokens, args.heads_q, args.head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(tokens, args.heads_kv, args.head_dim, device="cuda", dtype=dtype,
                        requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)

    def step(lengths: list[int]) -> None:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        longest = max(lengths)
        out, _ = torch.ops.hcp.varlen_attention(q, k, v, cu, cu, longest, longest, True,
                                                args.head_dim ** -0.5, window, -1 if window < 0 else 0, kernel)
        out.backward(dout)

    for _ in range(args.layers):
        step(stream[0])
    if busy:
        return profiled_busy_ms(lambda: [step(lengths) for lengths in stream[1:] for _ in range(args.layers)])
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for lengths in stream[1:]:
        for _ in range(args.layers):
            step(lengths)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop)


def profiled_busy_ms(run: Callable[[], object]) -> float:
    """Ms during which some CUDA kernel of ``run`` runs (the union of their intervals)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        comm, compute = kernel_intervals(json.loads(path.read_text()))
    return sum(stop - start for start, stop in union_intervals(comm + compute)) / 1e3


def measure(tokens: int, kernel_names: list[str] | None, args: argparse.Namespace, busy: bool = False) -> list[dict]:
    """One record per composition on streams of ``tokens``-token batches: the composition, the
    mean TFLOP of one call and each kernel's TFLOP/s (``busy``: by GPU busy time)."""
    device = torch.device("cuda", torch.cuda.current_device())
    probe_q = torch.empty(1, args.heads_q, args.head_dim, dtype=getattr(torch, args.dtype), device=device)
    probe_k = torch.empty(1, args.heads_kv, args.head_dim, dtype=probe_q.dtype, device=device)
    records = []
    for name, (stream, window) in batches(tokens, args.window, args.batches).items():
        request = BlockRequest.of(probe_q, probe_k, (window, -1 if window < 0 else 0))
        kernels = [n for n in (kernel_names or KERNELS) if n != "torch" and KERNELS[n].supports(request) is None]
        flops = args.layers * sum(causal_flops(lengths, args.heads_q, args.head_dim, window) for lengths in stream[1:])
        row: dict[str, float] = {}
        for kernel in kernels:
            ms = stream_ms(kernel, stream, window, args, busy)
            row[kernel] = round(flops / (ms * 1e-3) / 1e12, 1)
            print(f"{tokens} tokens, {name} ({len(stream) - 1} batches): {kernel} {ms:.1f} ms, "
                  f"{row[kernel]} TFLOP/s", flush=True)
        call_tflop = flops / (args.layers * (len(stream) - 1)) / 1e12
        records.append({"tokens": tokens, "composition": name, "call_tflop": round(call_tflop, 6), "tflops": row})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--window", type=int, default=4096, help="window_left of the windowed batch")
    parser.add_argument("--kernels", nargs="+", help="default: every kernel but torch that can run the call")
    parser.add_argument("--batches", type=int, default=20, help="timed batches per composition")
    parser.add_argument("--layers", type=int, default=4, help="calls per batch")
    parser.add_argument("--sizes", type=lambda text: [int(n) for n in text.split(",")], default=[],
                        help="token counts of smaller calls to measure too, comma-separated")
    parser.add_argument("--size-kernels", nargs="+", help="the kernels measured at --sizes (default: --kernels)")
    parser.add_argument("--out", type=Path, default=MEASURED_FILE)
    args = parser.parse_args()

    device = torch.device("cuda", torch.cuda.current_device())
    main_sizes = measure(args.tokens, args.kernels, args)
    table = {record["composition"]: record["tflops"] for record in main_sizes}
    print(tabulate([[name, *(f"{kernel} {tflops}" for kernel, tflops in row.items())] for name, row in table.items()],
                   headers=["composition", "TFLOP/s per kernel"]))
    sizes = [record for tokens in sorted({*args.sizes, args.tokens}) if args.sizes
             for record in measure(tokens, args.size_kernels or args.kernels, args, busy=True)]
    if sizes:
        print(tabulate([[r["tokens"], r["composition"], r["call_tflop"],
                         *(f"{kernel} {tflops}" for kernel, tflops in r["tflops"].items())] for r in sizes],
                       headers=["tokens", "composition", "TFLOP per call", "TFLOP/s per kernel"]))

    recorded = json.loads(args.out.read_text()) if args.out.exists() else {"devices": {}}
    recorded.setdefault("devices", {})[device_kind(device)] = {
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "setup": (f"scripts/measure_kernels.py: {args.tokens} tokens, {args.heads_q}/{args.heads_kv} "
                  f"heads of {args.head_dim}, {args.dtype}, causal, forward + backward, {args.batches} new "
                  f"batches per composition (one document: 2) after one warm-up, {args.layers} calls each"
                  + (f"; sizes: {sorted({*args.sizes, args.tokens})} tokens by GPU busy time" if sizes else "")),
        "tflops": table,
        **({"sizes": sizes} if sizes else {}),
    }
    args.out.write_text(json.dumps(recorded, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
