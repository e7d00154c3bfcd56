"""How long planning a packed batch takes: ~1M tokens in 100K documents (DESIGN §2 asks for
milliseconds).

    python benchmarks/plan_bench.py
    python benchmarks/plan_bench.py --meshes 2x2 8x4 8x8 --repeats 11

A real 32-rank mesh cannot be built on one machine, so for each ``ULYSSESxRING`` mesh this
times, for one rank, the layout math that ``ShardPlan.__init__`` runs
(``hcp_compile.layout.rank_layout``: every ring rank's stream, the unshard index and this
rank's slice), and the ring schedule that ``context_parallel``
builds on the first attention call of a batch (``hcp_compile.schedule.build_schedule``,
causal). ``shard_plan`` itself is timed end to end on a real 1-process gloo mesh (1x1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from tabulate import tabulate

import hcp_compile
from hcp_compile import layout
from hcp_compile.schedule import build_schedule
from hcp_compile.validation import check_cu_seqlens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--mean-length", type=int, default=10, help="mean document length")
    parser.add_argument("--meshes", nargs="+", default=["2x2", "8x4", "8x8"], help="ULYSSESxRING")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def random_cu_seqlens(docs: int, mean_length: int, seed: int) -> torch.Tensor:
    """Uniform lengths in [1, 2 * mean - 1]: about ``docs * mean`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 2 * mean_length, (docs,), generator=gen)
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def median_ms(fn: Callable[[torch.Tensor], object], cu: torch.Tensor, repeats: int) -> float:
    """Median wall time of ``fn`` on a fresh copy of ``cu`` each time (the library caches
    per tensor), after one warm-up call."""
    fn(cu.clone())
    times = []
    for _ in range(repeats):
        fresh = cu.clone()
        start = time.perf_counter()
        fn(fresh)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def plan_layout(cu: torch.Tensor, ulysses: int, ring: int) -> layout.RankLayout:
    """What ``ShardPlan.__init__`` computes, for rank (ring 0, ulysses 0)."""
    return layout.rank_layout(check_cu_seqlens(cu), ring, ulysses, 0, 0)


def ring_schedule(cu: torch.Tensor, ulysses: int, ring: int, max_seqlen: int) -> object:
    """The causal ring schedule of ring rank 0, as ``context_parallel`` builds it per batch."""
    stream_length = layout.stream_length_for(check_cu_seqlens(cu), ring, ulysses)
    return build_schedule(
        cu, max_seqlen, 0, ring, ulysses, stream_length, causal=True, scale=1.0,
        window=(-1, -1), kernel="torch", skip_outside_window=True,
    )


def parse_mesh(text: str) -> tuple[int, int]:
    ulysses, ring = (int(part) for part in text.lower().split("x"))
    return ulysses, ring


def mesh_rows(cu: torch.Tensor, meshes: list[str], repeats: int) -> list[list]:
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    rows = []
    for text in meshes:
        ulysses, ring = parse_mesh(text)
        rows.append([
            f"{ulysses}x{ring}", ulysses * ring, plan_layout(cu, ulysses, ring).local_tokens,
            median_ms(lambda c: plan_layout(c, ulysses, ring), cu, repeats),
            median_ms(lambda c: ring_schedule(c, ulysses, ring, max_seqlen), cu, repeats),
        ])
    return rows


def shard_plan_ms(cu: torch.Tensor, repeats: int) -> float:
    """``hcp_compile.shard_plan`` end to end on a real 1-process gloo mesh (ulysses 1 x ring 1)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = hcp_compile.make_mesh(ulysses=1, ring=1, device_type="cpu")
        return median_ms(lambda c: hcp_compile.shard_plan(c, mesh), cu, repeats)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cu = random_cu_seqlens(args.docs, args.mean_length, args.seed)
    print(f"{int(cu[-1]):,} tokens in {args.docs:,} documents, {torch.get_num_threads()} CPU "
          f"threads, torch {torch.__version__}, median of {args.repeats}\n")
    rows = mesh_rows(cu, args.meshes, args.repeats)
    headers = ["mesh AxR", "ranks", "local tokens", "plan layout, one rank (ms)",
               "ring schedule, one rank (ms)"]
    print(tabulate(rows, headers=headers, floatfmt=".1f", intfmt=","))
    end_to_end = shard_plan_ms(cu, args.repeats)
    print(f"\nshard_plan() end to end, real 1x1 gloo mesh: {end_to_end:.1f} ms")


if __name__ == "__main__":
    main()
