"""How long planning a packed batch takes: ~1M tokens in 100K documents (docs/design.md §2
asks for milliseconds).

    python -m benchmarks.plan_bench
    python -m benchmarks.plan_bench --meshes 2x2 8x4 8x8 --repeats 11

A real 32-rank mesh cannot be built on one machine, so for each ``ULYSSESxRING`` mesh and
placement this times the placement itself (``hcp_compile.layout.batch_layout``: the rule and
the sizes of every rank, what eager attention and a compiled graph compute per batch), one
rank's tokens (``layout.rank_tokens``, what ``ShardPlan`` adds for its own rank) and the ring
schedule that ``context_parallel`` builds on the first attention call of a batch
(``hcp_compile.schedule.build_schedule``, causal). ``shard_plan`` itself is timed end to end on
a real 1-process gloo mesh (1x1).
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
from hcp_compile.placements import PLACEMENTS
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


def placement(cu: torch.Tensor, ulysses: int, ring: int, rule: str) -> layout.BatchLayout:
    """The batch's layout, as every path derives it per batch."""
    return layout.batch_layout(check_cu_seqlens(cu), ulysses, ring, PLACEMENTS[rule])


def rank_sizes(batch: layout.BatchLayout) -> layout.RankSizes:
    return layout.rank_sizes(layout.rank_size_values(batch, 0, 0).tolist(), 0, batch.ulysses)


def own_tokens(cu: torch.Tensor, ulysses: int, ring: int, rule: str) -> layout.StreamTokens:
    """Rank (ring 0, ulysses 0)'s tokens: the layout, then where its tokens come from."""
    batch = placement(cu, ulysses, ring, rule)
    return layout.rank_tokens(batch, rank_sizes(batch), 0)


def ring_schedule(cu: torch.Tensor, ulysses: int, ring: int, rule: str, max_seqlen: int) -> object:
    """The causal schedule of rank (0, 0), as ``context_parallel`` builds it per batch."""
    batch = placement(cu, ulysses, ring, rule)
    return build_schedule(
        batch, rank_sizes(batch), max_seqlen, 0, causal=True, scale=1.0, window=(-1, -1),
        kernel="torch", skip_outside_window=True,
    )


def parse_mesh(text: str) -> tuple[int, int]:
    ulysses, ring = (int(part) for part in text.lower().split("x"))
    return ulysses, ring


def mesh_rows(cu: torch.Tensor, meshes: list[str], repeats: int) -> list[list]:
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    rows = []
    for text in meshes:
        ulysses, ring = parse_mesh(text)
        for rule in PLACEMENTS:
            rows.append([
                f"{ulysses}x{ring}", ulysses * ring, rule,
                int(placement(cu, ulysses, ring, rule).local_tokens),
                median_ms(lambda c: placement(c, ulysses, ring, rule), cu, repeats),
                median_ms(lambda c: own_tokens(c, ulysses, ring, rule), cu, repeats),
                median_ms(lambda c: ring_schedule(c, ulysses, ring, rule, max_seqlen), cu, repeats),
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
    headers = ["mesh AxR", "ranks", "placement", "local tokens", "placement (ms)",
               "+ one rank's tokens (ms)", "+ ring schedule (ms)"]
    print(tabulate(rows, headers=headers, floatfmt=".1f", intfmt=","))
    end_to_end = shard_plan_ms(cu, args.repeats)
    print(f"\nshard_plan() end to end, real 1x1 gloo mesh: {end_to_end:.1f} ms")


if __name__ == "__main__":
    main()
