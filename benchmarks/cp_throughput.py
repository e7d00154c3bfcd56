"""Throughput of eager hierarchical CP attention against single-device attention.

Launch one process per device, from the repository root:
    torchrun --nproc-per-node 2 -m benchmarks.cp_throughput --ulysses 2 --ring 1
    torchrun --nproc-per-node 2 -m benchmarks.cp_throughput --ulysses 1 --ring 2
Every rank first times single-device attention on the whole packed batch (the baseline, run
side by side on each device), then the CP run on its shard; fwd+bwd, causal, CUDA events.
TFLOP/s count only the real (causal) attention work of the batch.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from tabulate import tabulate

import hcp_compile
from benchmarks.common import add_run_args, packed_lengths


def causal_flops(lengths: list[int], heads: int, head_dim: int, window_left: int = -1) -> float:
    """fwd (2 matmuls) + bwd (5 matmuls) over the causal half of every document; with
    ``window_left`` >= 0 only the pairs inside the sliding window (each query sees itself and
    at most ``window_left`` keys before it)."""
    pairs = sum(_visible_pairs(n, window_left) for n in lengths)
    return 7 * 2 * pairs * heads * head_dim


def _visible_pairs(n: int, window_left: int) -> float:
    if window_left < 0 or n <= window_left + 1:
        return n * (n + 1) / 2
    seen = window_left + 1  # keys a query sees once its window is full
    return seen * (seen + 1) / 2 + (n - seen) * seen


def time_fwd_bwd(
    fn, inputs: list[torch.Tensor], warmup: int, iters: int, *, barrier: bool = True
) -> float:
    """Median milliseconds of forward + backward: CUDA events for CUDA inputs, else the host
    clock. ``barrier``: all ranks start each iteration together (off for a step that one rank
    runs alone)."""
    cuda = inputs[0].is_cuda
    grad = None
    times = []
    for i in range(warmup + iters):
        for t in inputs:
            t.grad = None
        if barrier:
            dist.barrier()
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
        started = time.perf_counter()
        out = fn(*inputs)
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)
        if cuda:
            stop.record()
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop) if cuda else (time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def profile_one_step(fn, inputs: list[torch.Tensor], out_dir: str | None, label: str = "") -> None:
    """One forward + backward under the profiler: every rank's Chrome trace (into ``out_dir``
    when given), rank 0's top ops by CPU and by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(*inputs).sum().backward()
        torch.cuda.synchronize()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        prefix = f"trace_{label.replace(' ', '_')}_" if label else "trace_"
        name = f"{prefix}rank{dist.get_rank()}.json"
        prof.export_chrome_trace(os.path.join(out_dir, name))
    if dist.get_rank() == 0:
        print(f"profile {label}:")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(parser)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--profile", metavar="DIR", help="also trace one CP iteration into DIR")
    args = parser.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # CPU tensors go through gloo: the per-call input agreement then waits for no GPU work
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = hcp_compile.make_mesh(args.ulysses, args.ring, "cuda")
    lengths = packed_lengths(args.tokens, args.docs, seed=0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    max_len = max(lengths)
    torch.manual_seed(0)
    shape_q = (args.tokens, args.heads, args.head_dim)
    shape_kv = (args.tokens, args.kv_heads, args.head_dim)
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in (shape_q, shape_kv, shape_kv))

    def attention(q, k, v):
        return hcp_compile.varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=True)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    single_ms = time_fwd_bwd(attention, full, args.warmup, args.iters)

    plan = hcp_compile.shard_plan(cu, mesh)
    local = [plan.shard(t).requires_grad_() for t in (q, k, v)]
    with hcp_compile.context_parallel(mesh, kernel="flash"):
        cp_ms = time_fwd_bwd(attention, local, args.warmup, args.iters)
        if args.profile:
            profile_one_step(attention, local, args.profile)

    world = dist.get_world_size()
    flops = causal_flops(lengths, args.heads, args.head_dim)
    rows = [
        ["single device, whole batch", f"{single_ms:.2f}", f"{flops / single_ms / 1e9:.1f}", "1.00"],
        [
            f"hcp ulysses {args.ulysses} x ring {args.ring}, per GPU",
            f"{cp_ms:.2f}",
            f"{flops / world / cp_ms / 1e9:.1f}",
            f"{single_ms / (cp_ms * world):.2f}",
        ],
    ]
    if dist.get_rank() == 0:
        print(
            f"{args.tokens} tokens, {args.docs} docs (longest {max_len}), heads {args.heads}/"
            f"{args.kv_heads} x {args.head_dim}, bf16, causal, fwd+bwd, {world} GPUs, "
            f"{plan.local_tokens} local tokens"
        )
        print(tabulate(rows, headers=["run", "ms", "TFLOP/s per GPU", "efficiency vs 1 GPU"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
