"""Measure the block kernels' throughput on this GPU and record it in the package.

    python scripts/measure_kernels.py                 # writes hcp_compile/kernels/measured.json
    python scripts/measure_kernels.py --out /tmp/m.json --iters 3

Single-device varlen attention (``torch.ops.hcp.varlen_attention`` with each kernel), forward
+ backward, on three packed batches of ``--tokens`` tokens: one document, log-uniform lengths
256..32K, and many short documents 128..2K; and on the log-uniform batch under a sliding
window of ``--window`` keys back. TFLOP/s count the real causal work (each query against the
keys up to it, or inside its window; forward 2 products, backward 5). The device's entry of the
JSON file (keyed by ``torch.cuda.get_device_name()``) is replaced; other devices' entries are
kept. ``kernel="auto"`` then picks the fastest supporting kernel on this device kind (for a
windowed call, by the windowed batch), and the cost hook of the compiled path uses the mean
over the unwindowed batches.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks
from benchmarks.common import cuda_median_ms, log_uniform_lengths  # noqa: E402
from benchmarks.cp_throughput import causal_flops  # noqa: E402
from hcp_compile.kernels import KERNELS, BlockRequest
from hcp_compile.kernels.measured import MEASURED_FILE, device_kind


def batches(tokens: int, window: int) -> dict[str, tuple[list[int], int]]:
    """Name -> (document lengths, window_left or -1)."""
    log_uniform = log_uniform_lengths(tokens, 256, 32768, seed=0)
    return {
        f"one document of {tokens}": ([tokens], -1),
        "log-uniform documents 256..32K": (log_uniform, -1),
        "many short documents 128..2K": (log_uniform_lengths(tokens, 128, 2048, seed=1), -1),
        f"log-uniform documents 256..32K, window {window}": (log_uniform, window),
    }


def time_ms(kernel: str, lengths: list[int], window: int, args: argparse.Namespace) -> float:
    """Median fwd+bwd time of one kernel on one batch, CUDA events."""
    tokens, dtype = sum(lengths), getattr(torch, args.dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(tokens, args.heads_q, args.head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(tokens, args.heads_kv, args.head_dim, device="cuda", dtype=dtype,
                        requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    longest = max(lengths)

    def step() -> None:
        out, _ = torch.ops.hcp.varlen_attention(q, k, v, cu, cu, longest, longest, True,
                                                args.head_dim ** -0.5, window, -1 if window < 0 else 0, kernel)
        out.backward(dout)

    return cuda_median_ms(step, args.warmup, args.iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--window", type=int, default=4096, help="window_left of the windowed batch")
    parser.add_argument("--kernels", nargs="+", help="default: every kernel but torch that can run the call")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--out", type=Path, default=MEASURED_FILE)
    args = parser.parse_args()

    device = torch.device("cuda", torch.cuda.current_device())
    probe_q = torch.empty(1, args.heads_q, args.head_dim, dtype=getattr(torch, args.dtype), device=device)
    probe_k = torch.empty(1, args.heads_kv, args.head_dim, dtype=probe_q.dtype, device=device)
    tables: dict[str, dict[str, dict[str, float]]] = {"tflops": {}, "tflops_window": {}}
    for name, (lengths, window) in batches(args.tokens, args.window).items():
        request = BlockRequest.of(probe_q, probe_k, (window, -1 if window < 0 else 0))
        kernels = [n for n in (args.kernels or KERNELS) if n != "torch" and KERNELS[n].supports(request) is None]
        flops = causal_flops(lengths, args.heads_q, args.head_dim, window)
        row = tables["tflops" if window < 0 else "tflops_window"][name] = {}
        for kernel in kernels:
            ms = time_ms(kernel, lengths, window, args)
            row[kernel] = round(flops / (ms * 1e-3) / 1e12, 1)
            print(f"{name} ({len(lengths)} docs): {kernel} {ms:.1f} ms, {row[kernel]} TFLOP/s", flush=True)
    rows = [[name, *(f"{kernel} {tflops}" for kernel, tflops in row.items())]
            for table in tables.values() for name, row in table.items()]
    print(tabulate(rows, headers=["batch", "TFLOP/s per kernel"]))

    recorded = json.loads(args.out.read_text()) if args.out.exists() else {"devices": {}}
    recorded.setdefault("devices", {})[device_kind(device)] = {
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "setup": (f"scripts/measure_kernels.py: {args.tokens} tokens, {args.heads_q}/{args.heads_kv} "
                  f"heads of {args.head_dim}, {args.dtype}, causal, forward + backward, median of "
                  f"{args.iters} after {args.warmup} warm-ups"),
        **tables,
    }
    args.out.write_text(json.dumps(recorded, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
