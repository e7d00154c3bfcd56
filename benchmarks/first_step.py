"""The first compiled step of a process, and whether Inductor's caches serve a second process.

    python -m benchmarks.first_step --cache-dir DIR [--kernel flex] [--backend hcp|inductor]

(from the repository root). The model of ``examples/packed_model.py`` (bf16 on CUDA, fp32 on
CPU) runs one fwd+bwd step on one packed batch, compiled with ``backend="hcp"`` on a one-rank
mesh or with Inductor around the single-device op. Run it twice with the same ``--cache-dir``
(``TORCHINDUCTOR_CACHE_DIR``): the second process finds the first one's compiled graphs in
Inductor's FX graph cache and AOTAutograd's cache when the graphs hand it pickle, and the table
shows the cache counters (hits, misses, bypasses) beside the step's seconds. A bypass is a
graph the cache could not key (docs/design.md §8.5).
"""

from __future__ import annotations

import argparse
import os
import time

from tabulate import tabulate


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", required=True, help="Inductor's cache folder, the same for both processes")
    parser.add_argument("--kernel", default="auto", help="the attention kernel (default: auto)")
    parser.add_argument("--backend", default="hcp", choices=("hcp", "inductor"),
                        help="hcp on a one-rank mesh, or Inductor around the single-device op (default: hcp)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of the packed batch (default: 16384)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir  # before torch reads its config
    import torch
    import torch.distributed as dist

    import hcp_compile
    from benchmarks.common import packed_lengths
    from examples.packed_model import PackedTransformer

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = packed_lengths(args.tokens, docs=max(args.tokens // 2048, 1), seed=0)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    torch.manual_seed(0)
    model = PackedTransformer(dim=512, heads=8, kv_heads=2, layers=2).to(device, dtype)
    x = torch.randn(args.tokens, 512, device=device, dtype=dtype)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    options = {"kernel": args.kernel}
    if args.backend == "hcp":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
        mesh = hcp_compile.make_mesh(1, 1, device.type)
        plan = hcp_compile.shard_plan(cu_seqlens, mesh)
        x, positions = plan.shard(x), plan.position_ids
        compiled = torch.compile(model, backend="hcp", options={"mesh": mesh, **options})
    else:
        compiled = torch.compile(model)
    start = time.perf_counter()
    compiled(x, positions, cu_seqlens, max(lengths)).float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    counters = torch._dynamo.utils.counters
    rows = [["first step s", f"{seconds:.2f}"]]
    rows += [[f"{group} {name}", count] for group in ("inductor", "aot_autograd")
             for name, count in sorted(counters[group].items()) if "cache" in name]
    print(tabulate(rows, headers=[f"{args.backend}, kernel {args.kernel}", ""]))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
