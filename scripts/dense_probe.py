"""Where the dense kernel's cut between cuDNN calls and the varlen kernel should lie, and what
cuDNN costs for a segment length it has not seen (one GPU).

    python scripts/dense_probe.py                        # all three parts
    python scripts/dense_probe.py --parts segments --heads 16/4

``segments``: batches of equal segments of ``n`` rows filling ``--tokens`` rows, causal
squares and full (non-causal) squares, fwd+bwd TF/s of cuDNN calls (the dense kernel with
``MIN_DENSE_ROWS = n``), flash and flex: where a segment is long enough for its own cuDNN call.

``fresh``: forward + backward of one segment whose length was not seen before (cuDNN builds a
graph per shape) against the same call repeated, host clock with a sync; and training-like
steps: new log-uniform 256..32K batches of ``--tokens`` tokens, each kernel's first call on
each batch against its second (what a benchmark that repeats one batch does not show), for
the first ``--iters`` batches of the process and for ``--iters`` more after
``--fresh-warmup`` others.

``threshold``: the dense kernel on the log-uniform and short-document batches of
scripts/measure_kernels.py with ``MIN_DENSE_ROWS`` in ``--thresholds`` and ``DENSE_SIZE_BITS``
in ``--bits``.

``isolation``: what keeping other segments' values out of a rounded-up dense call costs: the
dense kernel as it is (the call's rows and keys past its segment are zeros, copies) against
the same calls reading the block's next rows in place (not isolated: a non-finite value there
would reach the segment), alternated, on log-uniform 256..32K batches.
docs/design.md §8.6 records what it found.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks
from benchmarks.common import cuda_median_ms, log_uniform_lengths  # noqa: E402
from benchmarks.cp_throughput import causal_flops  # noqa: E402
from hcp_compile.kernels import dense  # noqa: E402

HEAD_DIM, DTYPE = 128, torch.bfloat16


class Batch:
    def __init__(self, lengths: list[int], heads: tuple[int, int], causal: bool = True) -> None:
        self.lengths, self.causal, self.heads_q = lengths, causal, heads[0]
        tokens = sum(lengths)
        self.cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        self.q = torch.randn(tokens, heads[0], HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True)
        self.k, self.v = (torch.randn(tokens, heads[1], HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True)
                          for _ in range(2))
        self.dout = torch.randn_like(self.q)

    def step(self, kernel: str) -> None:
        longest = max(self.lengths)
        out, _ = torch.ops.hcp.varlen_attention(self.q, self.k, self.v, self.cu, self.cu, longest, longest,
                                                self.causal, HEAD_DIM ** -0.5, -1, -1, kernel)
        out.backward(self.dout)

    def tflops(self, ms: float) -> float:
        flops = causal_flops(self.lengths, self.heads_q, HEAD_DIM)
        if not self.causal:
            flops *= 2 * sum(n * n for n in self.lengths) / sum(n * (n + 1) for n in self.lengths)
        return flops / (ms * 1e-3) / 1e12


def with_threshold(rows: int, run, bits: int | None = None):
    saved = dense.MIN_DENSE_ROWS, dense.DENSE_SIZE_BITS
    dense.MIN_DENSE_ROWS, dense.DENSE_SIZE_BITS = rows, bits or saved[1]
    try:
        return run()
    finally:
        dense.MIN_DENSE_ROWS, dense.DENSE_SIZE_BITS = saved


def segments(args: argparse.Namespace, heads: tuple[int, int]) -> None:
    for causal in (True, False):
        for n in args.sizes:
            batch = Batch([n] * (args.tokens // n), heads, causal)
            cells = []
            for kernel in ("dense", "flash", "flex"):
                ms = with_threshold(n, lambda: cuda_median_ms(lambda: batch.step(kernel), args.warmup, args.iters))
                cells.append(f"{kernel} {ms:7.2f} ms {batch.tflops(ms):6.1f} TF/s")
            print(f"[segments {heads[0]}/{heads[1]}] {'causal' if causal else 'full  '} {n:6d} rows x "
                  f"{len(batch.lengths):4d}: " + " | ".join(cells), flush=True)


def wall_ms(run) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def fresh(args: argparse.Namespace, heads: tuple[int, int]) -> None:
    for kernel in ("dense", "flash"):
        for i in range(3):
            batch = Batch([4096 + 136 * (i + 1) + (kernel == "flash")], heads)
            first, again = wall_ms(lambda: batch.step(kernel)), wall_ms(lambda: batch.step(kernel))
            print(f"[fresh {heads[0]}/{heads[1]}] {kernel} one segment of {batch.lengths[0]}: first call "
                  f"{first:8.1f} ms, again {again:6.1f} ms", flush=True)
    kernels = ("dense", "flash", "flex")
    seeds = iter(range(1000, 2000))
    for phase, batches in (("first", args.iters), ("warm-up", args.fresh_warmup), ("later", args.iters)):
        first, again = {k: [] for k in kernels}, {k: [] for k in kernels}
        for _ in range(batches):
            batch = Batch(log_uniform_lengths(args.tokens, 256, 32768, seed=next(seeds)), heads)
            for kernel in kernels:
                first[kernel].append(wall_ms(lambda: batch.step(kernel)))
                again[kernel].append(wall_ms(lambda: batch.step(kernel)))
        if phase != "warm-up":
            cells = [f"{k} {sum(first[k]) / batches:7.1f} / {sum(again[k]) / batches:6.1f} ms" for k in kernels]
            print(f"[fresh {heads[0]}/{heads[1]}] {batches} {phase} new log-uniform batches, mean first call / "
                  f"same batch again: " + " | ".join(cells), flush=True)


def threshold(args: argparse.Namespace, heads: tuple[int, int]) -> None:
    batches = {"log-uniform 256..32K": log_uniform_lengths(args.tokens, 256, 32768, seed=0),
               "short 128..2K": log_uniform_lengths(args.tokens, 128, 2048, seed=1)}
    for name, lengths in batches.items():
        batch = Batch(lengths, heads)
        cells = []
        for rows in args.thresholds:
            for bits in args.bits:
                ms = with_threshold(rows, lambda: cuda_median_ms(lambda: batch.step("dense"), args.warmup, args.iters),
                                    bits)
                cells.append(f"{rows}/{bits} bits: {ms:7.2f} ms {batch.tflops(ms):6.1f}")
        for kernel in ("flash", "flex"):
            ms = cuda_median_ms(lambda: batch.step(kernel), args.warmup, args.iters)
            cells.append(f"{kernel}: {ms:7.2f} ms {batch.tflops(ms):6.1f}")
        print(f"[threshold {heads[0]}/{heads[1]}] {name}: " + " | ".join(cells), flush=True)


def isolation(args: argparse.Namespace, heads: tuple[int, int]) -> None:
    isolated = dense._call_rows

    def in_place(x, rows, count, zeros_after=True):
        return isolated(x, rows, count, zeros_after=False)

    for seed in range(3):
        batch = Batch(log_uniform_lengths(args.tokens, 256, 32768, seed=seed), heads)
        times: dict[str, list[float]] = {"zeros": [], "in place": []}
        for round_ in range(args.iters):  # alternated, so clock drift falls on both alike
            for name, call_rows in (("zeros", isolated), ("in place", in_place)):
                dense._call_rows = call_rows
                warmup = args.warmup if round_ == 0 else 0  # both read the same shapes after round 0
                try:
                    times[name].append(cuda_median_ms(lambda: batch.step("dense"), warmup, 3))
                finally:
                    dense._call_rows = isolated
        medians = {name: sorted(ms)[len(ms) // 2] for name, ms in times.items()}
        cells = [f"{name} {ms:7.2f} ms {batch.tflops(ms):6.1f} TF/s" for name, ms in medians.items()]
        print(f"[isolation {heads[0]}/{heads[1]}] log-uniform seed {seed}: " + " | ".join(cells)
              + f" | zeros / in place {medians['zeros'] / medians['in place']:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="segments,fresh,threshold")
    parser.add_argument("--heads", default="32/8,16/4", help="comma-separated q/kv head counts")
    parser.add_argument("--tokens", type=int, default=64 * 1024)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 3072, 4096, 8192])
    parser.add_argument("--thresholds", type=int, nargs="+", default=[1024, 2048, 3072, 4096])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--fresh-warmup", type=int, default=20)
    parser.add_argument("--bits", type=int, nargs="+", default=[dense.DENSE_SIZE_BITS],
                        help="DENSE_SIZE_BITS values for the threshold part")
    args = parser.parse_args()
    parts = {"segments": segments, "fresh": fresh, "threshold": threshold, "isolation": isolation}
    for heads in args.heads.split(","):
        pair = tuple(int(h) for h in heads.split("/"))
        for part in args.parts.split(","):
            parts[part](args, pair)


if __name__ == "__main__":
    main()
