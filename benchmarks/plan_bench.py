"""How long planning a packed batch takes: ~1M tokens in 100K documents (docs/design.md §2
asks for milliseconds).

    python -m benchmarks.plan_bench
    python -m benchmarks.plan_bench --meshes 2x2 8x4 8x8 --repeats 11

A real 32-rank mesh cannot be built on one machine, so for each ``ULYSSESxRING`` mesh and
placement this times, cumulatively, what the host derives per batch, once, in
``hcp_compile.batch.prepared`` (every path reads the batch from there): the prepared batch (the
check of ``cu_seqlens``, the placement rule's layout and every rank's sizes), then one rank's
tokens (what ``ShardPlan`` adds for its own rank), then that rank's causal schedule tables
(what the first attention call of a batch adds, eager or compiled). A trainer can run all of
it in a DataLoader worker (``prepared.prepare_batch``); the last columns time what is then
left on the training step's critical path: unpickling the worker's batch and finding it by the
values of ``cu_seqlens`` (its digest), and the pickle's size. ``shard_plan`` itself is timed end
to end on a real 1-process gloo mesh (1x1), on ``cu_seqlens`` and on a prepared batch.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from tabulate import tabulate

import hcp_compile
from hcp_compile.batch import prepared
from hcp_compile.batch.cache import BATCHES
from hcp_compile.batch.placements import PLACEMENTS
from hcp_compile.batch.prepared import BatchValues, MeshShape, PreparedBatch


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


def placement(cu: torch.Tensor, ulysses: int, ring: int, rule: str) -> PreparedBatch:
    """The prepared batch: checked values, layout, every rank's sizes (not cached here)."""
    return prepared._build(BatchValues.of(cu.long()), MeshShape(ulysses, ring, rule))


def own_tokens(cu: torch.Tensor, ulysses: int, ring: int, rule: str) -> PreparedBatch:
    """The prepared batch and rank (ring 0, ulysses 0)'s tokens."""
    batch = placement(cu, ulysses, ring, rule)
    batch.tokens(0, 0)
    return batch


def ring_schedule(cu: torch.Tensor, ulysses: int, ring: int, rule: str) -> PreparedBatch:
    """The above and rank (0, 0)'s causal schedule tables."""
    batch = own_tokens(cu, ulysses, ring, rule)
    batch.tables(0, 0, True, (-1, -1))
    return batch


def critical_path(pickled: bytes, cu: torch.Tensor) -> PreparedBatch:
    """What the training process does with a batch a worker prepared: unpickle it, keep it,
    find it by the values of a fresh ``cu_seqlens`` (read and hashed once per tensor)."""
    batch = BATCHES.adopt(pickle.loads(pickled))
    return prepared.prepare(prepared.host_values(cu), batch.mesh)


def parse_mesh(text: str) -> tuple[int, int]:
    ulysses, ring = (int(part) for part in text.lower().split("x"))
    return ulysses, ring


def mesh_rows(cu: torch.Tensor, meshes: list[str], repeats: int) -> list[list]:
    rows = []
    for text in meshes:
        ulysses, ring = parse_mesh(text)
        for rule in PLACEMENTS:
            warm = prepared.prepare_batch(cu, ulysses=ulysses, ring=ring, placement=rule, rank=0)
            pickled = pickle.dumps(warm)
            rows.append([
                f"{ulysses}x{ring}", ulysses * ring, rule, warm.rank_tokens(0, 0),
                median_ms(lambda c: placement(c, ulysses, ring, rule), cu, repeats),
                median_ms(lambda c: own_tokens(c, ulysses, ring, rule), cu, repeats),
                median_ms(lambda c: ring_schedule(c, ulysses, ring, rule), cu, repeats),
                median_ms(lambda c: critical_path(pickled, c), cu, repeats),
                len(pickled) / 2**20,
            ])
    return rows


def shard_plan_ms(cu: torch.Tensor, repeats: int) -> tuple[float, float]:
    """``hcp_compile.shard_plan`` end to end on a real 1-process gloo mesh (ulysses 1 x ring 1):
    on ``cu_seqlens`` (each time a batch not seen before), and on a prepared batch."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = hcp_compile.make_mesh(ulysses=1, ring=1, device_type="cpu")
        ahead = prepared.prepare_batch(cu, ulysses=1, ring=1)

        def fresh(c: torch.Tensor) -> object:
            hcp_compile.clear_batch_cache()  # a new batch every time, as in training
            return hcp_compile.shard_plan(c, mesh)

        def given(c: torch.Tensor) -> object:
            hcp_compile.clear_batch_cache()
            return hcp_compile.shard_plan(ahead, mesh)

        return median_ms(fresh, cu, repeats), median_ms(given, cu, repeats)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cu = random_cu_seqlens(args.docs, args.mean_length, args.seed)
    print(f"{int(cu[-1]):,} tokens in {args.docs:,} documents, {torch.get_num_threads()} CPU "
          f"threads, torch {torch.__version__}, median of {args.repeats}\n")
    rows = mesh_rows(cu, args.meshes, args.repeats)
    headers = ["mesh AxR", "ranks", "placement", "local tokens", "prepared batch (ms)",
               "+ one rank's tokens (ms)", "+ ring schedule tables (ms)",
               "prepared in a worker: left on the step (ms)", "pickle (MiB)"]
    print(tabulate(rows, headers=headers, floatfmt=".1f", intfmt=","))
    on_the_fly, given = shard_plan_ms(cu, args.repeats)
    print(f"\nshard_plan() end to end, real 1x1 gloo mesh: {on_the_fly:.1f} ms on cu_seqlens, "
          f"{given:.1f} ms on a prepared batch")


if __name__ == "__main__":
    main()
