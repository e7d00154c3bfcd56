"""Where hcp's cudnn kernel spends a single-device fwd+bwd, and whether its segment bound matters.

    python scripts/cudnn_probe.py                                 # W3, W4, W2 (128K)
    python scripts/cudnn_probe.py --workloads W3-128K,W3-256K --iters 9

Per workload of ``benchmarks/speed.py`` (GQA 32/8 x 128, bf16, causal, its window), through
``torch.ops.hcp.varlen_attention`` with kernel ``"cudnn"``, two bounds of a graph's segment
rows (``s_max``), each timed twice in turn (median of ``--iters`` fwd+bwd after 2 warm-ups,
CUDA events, the graphs built anew for each):
  rows     the block's rows (what the kernel does: one graph serves every batch of a size);
  maxlen   the longest document (``max_seqlen``), as a graph sized to the batch would be.
Then one fwd+bwd of each, after a pause, under the profiler: the span from the first kernel's
start to the last kernel's end, the time some kernel runs, and the kernels by time (names cut).
docs/benchmarks.md ("Where the single-GPU time goes") records what it found.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks
from benchmarks.cp_throughput import causal_flops, time_fwd_bwd  # noqa: E402
from benchmarks.speed import PackedAttention, cu_seqlens, workloads  # noqa: E402
from hcp_compile.kernels import cudnn  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
_ROWS_BOUND = cudnn.Shape.of.__func__


def _maxlen_bound(cls, q, k, spec, mask):
    shape = _ROWS_BOUND(cls, q, k, spec, mask)
    longest = cudnn.bucket(int(max(spec.max_q, spec.max_k)), cudnn.MIN_SEGMENT_ROWS)
    return dataclasses.replace(shape, segment_rows=min(shape.segment_rows, longest))


BOUNDS = {"rows": _ROWS_BOUND, "maxlen": _maxlen_bound}


def use_bound(name: str) -> None:
    cudnn.Shape.of = classmethod(BOUNDS[name])
    cudnn.GRAPHS.clear()


def profiled(fn, inputs: list[torch.Tensor]) -> str:
    """One fwd+bwd after a pause: span, busy time and the kernels by time."""
    for t in inputs:
        t.grad = None
    torch.cuda.synchronize()
    time.sleep(0.5)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    start = min(e.time_range.start for e in kernels)
    end = max(e.time_range.end for e in kernels)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:80]] = by_name.get(e.name[:80], 0.0) + e.device_time / 1e3
    lines = [f"span {(end - start) / 1e3:.3f} ms, kernels {sum(by_name.values()):.3f} ms"]
    lines += [f"    {ms:8.3f} ms  {name}" for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="W3-128K,W4-128K,W2-128K")
    parser.add_argument("--iters", type=int, default=7)
    args = parser.parse_args()
    device, by_name = torch.device("cuda"), workloads()
    for name in args.workloads.split(","):
        workload = by_name[name]
        cu, longest = cu_seqlens(workload.lengths, device), max(workload.lengths)
        gen = torch.Generator(device).manual_seed(0)
        inputs = [torch.randn(sum(workload.lengths), heads, HEAD_DIM, generator=gen, device=device,
                              dtype=torch.bfloat16).requires_grad_() for heads in (HEADS_Q, HEADS_KV, HEADS_KV)]
        attend = PackedAttention(workload.window, "cudnn")

        def fn(q, k, v):
            return attend(q, k, v, cu, longest)

        flops = causal_flops(list(workload.lengths), HEADS_Q, HEAD_DIM, workload.window_left)
        print(f"{name}: {len(workload.lengths)} documents, longest {longest}", flush=True)
        for bound in ("rows", "maxlen", "rows", "maxlen"):
            use_bound(bound)
            ms = time_fwd_bwd(fn, inputs, 2, args.iters, barrier=False)
            print(f"  {bound:7s} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TF/s", flush=True)
        for bound in BOUNDS:
            use_bound(bound)
            time_fwd_bwd(fn, inputs, 1, 1, barrier=False)  # its graphs built
            print(f"  profiled, {bound}: {profiled(fn, inputs)}", flush=True)
    use_bound("rows")


if __name__ == "__main__":
    main()
