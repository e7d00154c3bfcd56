"""A 4-layer packed-sequence transformer on 2 GPUs: eager hcp vs ``torch.compile(backend="hcp")``.

    torchrun --nproc-per-node 2 -m benchmarks.compile_model --ulysses 2 --ring 1 --out DIR
    torchrun --nproc-per-node 2 -m benchmarks.compile_model --ulysses 1 --ring 2 --out DIR

(from the repository root, whose ``examples`` folder holds the model).

The same model (``examples/packed_model.py``, bf16) runs fwd+bwd on each rank's shard of one
packed batch, first eagerly inside ``context_parallel``, then compiled with the ``hcp`` backend
(Inductor, overlap scheduling on). Both are timed side by side in this run (CUDA events,
median); their outputs and gradients are compared; one step of each is traced with the
profiler, and the trace gives how much of the NCCL transfer time runs while an attention
kernel (or any other compute kernel) runs on another stream.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

import hcp_compile
from benchmarks.common import add_run_args, packed_lengths
from examples.packed_model import PackedTransformer


def step(model, inputs, grad) -> torch.Tensor:
    out = model(*inputs)
    out.backward(grad)
    return out


def time_steps(run, warmup: int, iters: int) -> float:
    """Median milliseconds of one call of ``run``."""
    times = []
    for i in range(warmup + iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        run()
        stop.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def trace(run, path: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return overlap(json.loads(path.read_text()))


def overlap(chrome_trace: dict) -> dict:
    """Milliseconds of NCCL kernels, and how much of them runs concurrently with attention
    (flash) kernels and with any non-NCCL kernel."""
    kernels = [e for e in chrome_trace["traceEvents"] if e.get("cat") == "kernel" and "dur" in e]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    attention = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "flash" in e["name"].lower()]

    def covered(intervals, by):
        merged = _union(by)
        total = 0.0
        for start, stop in intervals:
            for m_start, m_stop in merged:
                total += max(0.0, min(stop, m_stop) - max(start, m_start))
        return total

    comm_us = sum(stop - start for start, stop in comm)
    return {
        "nccl_ms": comm_us / 1e3,
        "nccl_under_attention": covered(comm, attention) / comm_us if comm_us else 0.0,
        "nccl_under_compute": covered(comm, compute) / comm_us if comm_us else 0.0,
        "attention_ms": sum(stop - start for start, stop in attention) / 1e3,
    }


def _union(intervals):
    merged = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return merged


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(parser)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the traces")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # plain NCCL: with a mixed cpu/cuda group Inductor cannot tell the collectives' device
    # and estimates them as free, which leaves its overlap scheduling nothing to hide
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    mesh = hcp_compile.make_mesh(args.ulysses, args.ring, "cuda")
    lengths = packed_lengths(args.tokens, args.docs, seed=0)
    cu = torch.tensor([0, *lengths]).cumsum(0).to("cuda", torch.int32)
    max_len = max(lengths)
    torch.manual_seed(0)
    model = PackedTransformer(args.dim, args.heads, args.kv_heads, args.layers)
    model = model.to("cuda", torch.bfloat16)
    plan = hcp_compile.shard_plan(cu, mesh)
    x = plan.shard(torch.randn(args.tokens, args.dim, device="cuda", dtype=torch.bfloat16))
    x.requires_grad_()
    grad = torch.randn_like(x)
    inputs = (x, plan.position_ids, cu, max_len)

    def eager_step():
        with hcp_compile.context_parallel(mesh):
            return step(model, inputs, grad)

    compiled = torch.compile(model, backend="hcp", options={"mesh": mesh}, fullgraph=True)

    def compiled_step():
        return step(compiled, inputs, grad)

    results = {}
    for name, run in (("eager hcp", eager_step), ("compiled hcp (inductor)", compiled_step)):
        model.zero_grad(set_to_none=True)
        x.grad = None
        started = time.perf_counter()
        out = run()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - started
        grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
        results[name] = {"out": out.detach(), "grads": grads, "first_s": first_s}
        model.zero_grad(set_to_none=True)
        results[name]["ms"] = time_steps(run, args.warmup, args.iters)
        tag = name.split()[0]
        results[name]["trace"] = trace(run, args.out / f"trace_{tag}_u{args.ulysses}r{args.ring}_rank{rank}.json")

    eager, comp = results["eager hcp"], results["compiled hcp (inductor)"]
    out_error = max_relative_error(comp["out"], eager["out"])
    grad_error = max(max_relative_error(a, b) for a, b in zip(comp["grads"], eager["grads"]))
    if rank == 0:
        print(f"{args.tokens} tokens in {args.docs} docs (longest {max_len}), {args.layers} layers, "
              f"dim {args.dim}, heads {args.heads}/{args.kv_heads}, bf16, causal, fwd+bwd, "
              f"ulysses {args.ulysses} x ring {args.ring}, {plan.local_tokens} local tokens")
        rows = []
        for name, r in results.items():
            t = r["trace"]
            rows.append([name, f"{r['ms']:.1f}", f"{eager['ms'] / r['ms']:.2f}", f"{r['first_s']:.1f}",
                         f"{t['nccl_ms']:.1f}", f"{100 * t['nccl_under_attention']:.0f}%",
                         f"{100 * t['nccl_under_compute']:.0f}%"])
        print(tabulate(rows, headers=["run", "ms/step", "speed-up vs eager", "first step s",
                                      "NCCL kernel ms", "NCCL under attention", "NCCL under any compute"]))
        print(f"compiled vs eager: max relative error out {out_error:.2e}, grads {grad_error:.2e}")
        from torch._dynamo.utils import counters

        caches = {f"{group}.{name}": count for group in ("inductor", "aot_autograd")
                  for name, count in counters[group].items() if "cache" in name}
        print(f"compile caches (a second process start should hit): {caches}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
