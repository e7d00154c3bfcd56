"""The host's part of a CP step on this machine: the compiled graph's host ops, and the plan's
CPU ops before and after an Inductor compile (one rank alone over the fake process group).

    python scripts/host_probe.py --parts ops,threads
    python scripts/host_probe.py --parts contention --device cpu     # any machine

ops      the cached path of hcp::batch_layout, hcp::raise_if_rejected and hcp::schedule_tables
         (W3-128K's batch, rank 0 of 1 x 2), and what they call, microseconds per call;
threads  shard_plan of new W3-128K batches, ms, before an Inductor compile of the hcp backend, after
         it, 5 s later, after torch's compile workers are shut down and with one intra-op thread,
         with the processes that use the CPU after each (ps);
contention  shard_plan of new W3-128K batches, ms, with torch's intra-op threads and with one,
         on an idle machine and with one core kept busy by another process.
docs/benchmarks.md ("Host work on the step") records what it found.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks
import hcp_compile  # noqa: E402
import hcp_compile.compiled as compiled  # noqa: E402
from benchmarks.speed import PackedAttention, cu_seqlens, init_fake, workloads  # noqa: E402
from hcp_compile.prepared import MeshShape, host_values, prepare  # noqa: E402
from hcp_compile.schemes import DEFAULT_SCHEME  # noqa: E402

WORKLOAD = workloads()["W3-128K"]


def ops(device: torch.device) -> None:
    cu = cu_seqlens(WORKLOAD.lengths, device)
    prepared = prepare(host_values(cu), MeshShape(1, 2, "balanced"))
    tokens = prepared.rank_tokens(0, 0)
    layout_args = (cu, cu, 1, 2, "balanced", 0, 0, [tokens] * 3, [max(WORKLOAD.lengths)] * 2, False, DEFAULT_SCHEME,
                   "nothing")
    on_host, cu_on_host = torch.ops.hcp.batch_layout(*layout_args)
    flags, sizes = on_host[:compiled._FLAGS].clone(), on_host[compiled._FLAGS:].clone()
    tables_args = (cu_on_host, device, 1, 2, "balanced", 0, 0, 1, True, False, sizes.tolist()[:-1])
    calls = {
        "hcp::batch_layout": lambda: torch.ops.hcp.batch_layout(*layout_args),
        "hcp::raise_if_rejected": lambda: torch.ops.hcp.raise_if_rejected(flags, sizes),
        "hcp::schedule_tables": lambda: torch.ops.hcp.schedule_tables(*tables_args),
        "torch.empty (for scale)": lambda: torch.empty(4),
        "prepare(host_values(cu))": lambda: prepare(host_values(cu), MeshShape(1, 2, "balanced")),
        "PreparedBatch.device_tables": lambda: prepared.device_tables(0, 0, 1, True, False, device),
    }
    for name, call in calls.items():
        call()
        print(f"{name:30s} {timeit.timeit(call, number=500) / 500 * 1e6:8.1f} us", flush=True)


def threads(device: torch.device) -> None:
    mesh = hcp_compile.make_mesh(1, 2, device.type)
    step = iter(range(1, 10**6))

    def plans(tag: str) -> None:
        times = []
        for _ in range(5):
            cu = cu_seqlens(WORKLOAD.step(next(step)).lengths, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            hcp_compile.shard_plan(cu, mesh)
            times.append(round(1e3 * (time.perf_counter() - started), 1))
        print(f"{tag:34s} {times} ms, {torch.get_num_threads()} threads", flush=True)

    def busy() -> None:
        top = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,nlwp,comm", "--sort=-pcpu"], capture_output=True, text=True)
        print("\n".join(top.stdout.splitlines()[:4]), flush=True)

    plans("before a compile")
    busy()
    backend = hcp_compile.backend(mesh=mesh, placement="balanced", kernel="auto", inner="inductor")
    model = torch.compile(PackedAttention((-1, -1)), backend=backend, fullgraph=True)
    batch = WORKLOAD.step(10**6)
    cu = cu_seqlens(batch.lengths, device)
    rows = hcp_compile.shard_plan(cu, mesh).local_tokens
    q, k, v = (torch.randn(rows, heads, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
               for heads in (32, 8, 8))
    for t in (q, k, v, cu):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    with torch.compiler.config.patch(dynamic_sources="L['max_seqlen']"):
        model(q, k, v, cu, max(batch.lengths)).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    plans("after the compile")
    busy()
    time.sleep(5)
    plans("5 s later")
    from torch._inductor import async_compile
    async_compile.shutdown_compile_workers()
    plans("compile workers shut down")
    torch.set_num_threads(1)
    plans("one intra-op thread")


def contention(device: torch.device) -> None:
    mesh = hcp_compile.make_mesh(1, 2, device.type)
    step = iter(range(1, 10**6))
    threads = torch.get_num_threads()

    def plans(tag: str) -> None:
        times = []
        for _ in range(8):
            cu = cu_seqlens(WORKLOAD.step(next(step)).lengths, device)
            time.sleep(0.05)  # as a step's plan follows a wait for the GPU
            started = time.perf_counter()
            hcp_compile.shard_plan(cu, mesh)
            times.append(round(1e3 * (time.perf_counter() - started), 1))
        print(f"{tag:20s} {torch.get_num_threads():3d} threads: {times} ms", flush=True)

    for count in (threads, 1):
        torch.set_num_threads(count)
        plans("idle")
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)
            plans("one core busy")
        finally:
            spinner.kill()
            spinner.wait()
    torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="ops,threads")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    init_fake(0, 2)
    device = torch.device(args.device)
    for part in args.parts.split(","):
        {"ops": ops, "threads": threads, "contention": contention}[part](device)


if __name__ == "__main__":
    main()
