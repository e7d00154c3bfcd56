"""Measure the block kernels' throughput on this GPU and record it in the package.

    python scripts/measure_kernels.py                 # writes hcp_compile/kernels/measured.json
    python scripts/measure_kernels.py --out /tmp/m.json --iters 3

Single-device varlen attention (``torch.ops.hcp.varlen_attention`` with each kernel), forward
+ backward, on three packed batches of ``--tokens`` tokens: one document, log-uniform lengths
256..32K, and many short documents 128..2K. TFLOP/s count the real causal work (each query
against the keys up to it, forward 2 products, backward 5). The device's entry of the JSON file
(keyed by ``torch.cuda.get_device_name()``) is replaced; other devices' entries are kept.
``kernel="auto"`` then picks the fastest supporting kernel on this device kind, and the cost
hook of the compiled path uses the mean over the batches.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks
from benchmarks.common import log_uniform_lengths  # noqa: E402
from hcp_compile.kernels import KERNELS, BlockRequest
from hcp_compile.kernels.measured import MEASURED_FILE, device_kind


def batches(tokens: int) -> dict[str, list[int]]:
    return {
        f"one document of {tokens}": [tokens],
        "log-uniform documents 256..32K": log_uniform_lengths(tokens, 256, 32768, seed=0),
        "many short documents 128..2K": log_uniform_lengths(tokens, 128, 2048, seed=1),
    }


def causal_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention over the documents (7 products of
    2·D FLOPs per visible pair and head)."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 7 * 2 * pairs * heads * head_dim


def time_ms(kernel: str, lengths: list[int], args: argparse.Namespace) -> float:
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
                                                args.head_dim ** -0.5, -1, -1, kernel)
        out.backward(dout)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kernels", nargs="+", help="default: every kernel but torch that can run the call")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--out", type=Path, default=MEASURED_FILE)
    args = parser.parse_args()

    device = torch.device("cuda", torch.cuda.current_device())
    probe_q = torch.empty(1, args.heads_q, args.head_dim, dtype=getattr(torch, args.dtype), device=device)
    probe_k = torch.empty(1, args.heads_kv, args.head_dim, dtype=probe_q.dtype, device=device)
    request = BlockRequest.of(probe_q, probe_k)
    kernels = args.kernels or [n for n, kernel in KERNELS.items()
                               if n != "torch" and kernel.supports(request) is None]
    table: dict[str, dict[str, float]] = {}
    for name, lengths in batches(args.tokens).items():
        flops = causal_flops(lengths, args.heads_q, args.head_dim)
        table[name] = {}
        for kernel in kernels:
            ms = time_ms(kernel, lengths, args)
            table[name][kernel] = round(flops / (ms * 1e-3) / 1e12, 1)
            print(f"{name} ({len(lengths)} docs): {kernel} {ms:.1f} ms, {table[name][kernel]} TFLOP/s", flush=True)
    print(tabulate([[name, *row.values()] for name, row in table.items()], headers=["batch", *kernels]))

    recorded = json.loads(args.out.read_text()) if args.out.exists() else {"devices": {}}
    recorded.setdefault("devices", {})[device_kind(device)] = {
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "setup": (f"scripts/measure_kernels.py: {args.tokens} tokens, {args.heads_q}/{args.heads_kv} "
                  f"heads of {args.head_dim}, {args.dtype}, causal, forward + backward, median of "
                  f"{args.iters} after {args.warmup} warm-ups"),
        "tflops": table,
    }
    args.out.write_text(json.dumps(recorded, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
