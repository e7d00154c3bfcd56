"""Scaling efficiency of each placement against one GPU, eager and compiled, on three packed
batches (one long document, log-uniform documents, many short documents).

Launch one process per device, from the repository root:
    torchrun --nproc-per-node 2 -m benchmarks.placement --ulysses 2 --ring 1
    torchrun --nproc-per-node 2 -m benchmarks.placement --ulysses 1 --ring 2
Every rank first times single-device flash attention on the whole batch (the baseline, side by
side on each device), then hierarchical CP on its shard for each placement, eagerly and
compiled with ``backend="hcp"`` (Inductor); fwd+bwd, bf16, causal, CUDA events, median.
Efficiency = one GPU's time / (GPUs x the CP time); TFLOP/s count the real causal work.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import nn

import hcp_compile
from benchmarks.cp_throughput import causal_flops, profile_one_step, time_fwd_bwd

PLACEMENTS = ("zigzag", "balanced")


def packed_batches(tokens: int, seed: int = 0) -> dict[str, list[int]]:
    """The three batches, each of exactly ``tokens`` tokens."""
    generator = torch.Generator().manual_seed(seed)

    def log_uniform(count: int, low: int, high: int) -> list[int]:
        logs = torch.empty(count).uniform_(math.log(low), math.log(high), generator=generator)
        lengths = torch.exp(logs)
        lengths = (lengths / lengths.sum() * tokens).long().clamp(min=1)
        lengths[lengths.argmax()] += tokens - int(lengths.sum())
        return lengths.tolist()

    return {
        "one document": [tokens],
        "25 docs log-uniform 256..32K": log_uniform(25, 256, 32768),
        "202 docs log-uniform 128..2K": log_uniform(202, 128, 2048),
    }


class Attention(nn.Module):
    """The single-device attention call the compiled mode traces."""

    def forward(self, q, k, v, cu_seqlens, max_seqlen: int):
        return hcp_compile.varlen_attention(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ulysses", type=int, required=True)
    parser.add_argument("--ring", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--no-compile", action="store_true", help="eager modes only")
    parser.add_argument("--batches", nargs="*", default=None,
                        help="run only the batches whose name contains one of these words")
    parser.add_argument("--placements", nargs="*", default=list(PLACEMENTS), choices=PLACEMENTS)
    parser.add_argument("--kernel", default="flash", choices=("flash", "flex", "auto"),
                        help="the block kernel, one GPU and CP alike")
    parser.add_argument("--profile", action="store_true",
                        help="also trace one CP step per mode into --out and print its top ops")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON")
    args = parser.parse_args()
    names = list(packed_batches(args.tokens))
    if args.batches and not any(word in name for word in args.batches for name in names):
        parser.error(f"--batches: no batch name contains any of {args.batches}; the batches: {names}")

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = hcp_compile.make_mesh(args.ulysses, args.ring, "cuda")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    rows = []

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    for name, lengths in packed_batches(args.tokens).items():
        if args.batches and not any(word in name for word in args.batches):
            continue
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        longest = max(lengths)
        shapes = [(args.tokens, h, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
        q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes)
        flops = causal_flops(lengths, args.heads, args.head_dim)
        attend = Attention()

        def record(mode: str, placement: str, ms: float, gpus: int) -> None:
            rows.append({
                "batch": name, "mode": mode, "placement": placement, "ms": round(ms, 2),
                "tflops_per_gpu": round(flops / gpus / ms / 1e9, 1),
                "efficiency": round(single_ms / (ms * gpus), 3),
            })
            say(f"  {name:30s} {mode:9s} {placement:9s} {ms:8.2f} ms  "
                f"efficiency {rows[-1]['efficiency']:.3f}")

        full = [t.clone().requires_grad_() for t in (q, k, v)]
        scale = args.head_dim ** -0.5

        def one_gpu(q, k, v):  # the single-device op with the benchmark's kernel
            return torch.ops.hcp.varlen_attention(
                q, k, v, cu, cu, longest, longest, True, scale, -1, -1, args.kernel
            )[0]

        single_ms = time_fwd_bwd(one_gpu, full, args.warmup, args.iters)
        record("1 GPU", "-", single_ms, 1)
        for placement in args.placements:
            plan = hcp_compile.shard_plan(cu, mesh, placement=placement)
            local = [plan.shard(t).requires_grad_() for t in (q, k, v)]
            with hcp_compile.context_parallel(mesh, kernel=args.kernel, placement=placement):
                ms = time_fwd_bwd(lambda *t: attend(*t, cu, longest), local, args.warmup, args.iters)
            record("eager", placement, ms, world)
            if args.profile:
                with hcp_compile.context_parallel(mesh, kernel=args.kernel, placement=placement):
                    profile_one_step(lambda *t: attend(*t, cu, longest), local, args.out,
                                     f"{name}-eager-{placement}")
            if not args.no_compile:
                torch._dynamo.reset()
                backend = hcp_compile.backend(mesh=mesh, placement=placement, kernel=args.kernel)
                compiled = torch.compile(attend, backend=backend)
                started = time.perf_counter()
                try:  # a compiler failure is reported with the eager rows, not fatal
                    compiled(*local, cu, longest).sum().backward()  # compiles fwd and bwd
                except Exception as error:  # noqa: BLE001
                    say(f"  compiled {placement}: FAILED {str(error)[:300]}")
                    if rank == 0:
                        traceback.print_exc()
                    continue
                say(f"  compiled in {time.perf_counter() - started:.1f} s")
                ms = time_fwd_bwd(lambda *t: compiled(*t, cu, longest), local, args.warmup, args.iters)
                record("compiled", placement, ms, world)
                if args.profile:
                    profile_one_step(lambda *t: compiled(*t, cu, longest), local, args.out,
                                     f"{name}-compiled-{placement}")
            if rank == 0:
                print(plan.summary(args.heads, args.kv_heads, args.head_dim), flush=True)
    if rank == 0:
        title = (f"ulysses {args.ulysses} x ring {args.ring}, {world} x "
                 f"{torch.cuda.get_device_name()}, torch {torch.__version__}, heads "
                 f"{args.heads}/{args.kv_heads} x {args.head_dim}, bf16, causal, fwd+bwd")
        print(title)
        print(tabulate([list(r.values()) for r in rows], headers=list(rows[0])))
        if args.out:
            path = Path(args.out) / f"placement_u{args.ulysses}r{args.ring}.json"
            path.write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
