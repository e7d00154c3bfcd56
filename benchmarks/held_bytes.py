"""What one attention call's forward keeps for its backward on each rank, counted from the layout
(no GPU, no process group), over what one GPU keeps for the whole batch: issue 48's "held"
(targets 0.55, 0.30 and 0.17 at 2, 4 and 8 ranks).

    python -m benchmarks.held_bytes --workloads W2-128K,W2-1M --meshes 2x1 1x2 2x2 2x4 1x8

Counted as eager CP keeps it (default options, hcp_compile/hierarchical.py): the local region's
rows of q, k and v (the rank's whole shards where it exchanges nothing), the local logsumexp,
and per head group the exchanged stream's q, KV (repeated for GQA where the Ulysses size exceeds
the KV heads) and logsumexp; the backward exchanges the output again. One GPU's kernel keeps q,
k, v and the logsumexp. The output is left out on both sides: the next layer keeps it anyway.
Checked against the bytes a forward really keeps by tests/test_cp_memory.py.
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

from benchmarks.speed_workloads import HEADS, Workload, workloads
from benchmarks.work_split import parse_selection
from hcp_compile.batch.layout import RankSizes, known_empty, schedule_steps
from hcp_compile.batch.prepared import MeshShape, host_values, prepare
from hcp_compile.batch.schedule import exchanged_head_groups, rank_kv_heads

LSE_BYTES = 4  # the logsumexp is fp32 in every kernel


def held_bytes(sizes: RankSizes, ring: int, heads: tuple[int, int], head_dim: int, ulysses: int,
               element: int) -> int:
    """Bytes one rank's forward keeps for its backward (the output left out)."""
    heads_q, heads_kv = heads
    # whole shards where the exchange region is empty (hierarchical's rule), else the local rows
    rows = sizes.tokens if known_empty(sizes.own_exchange) else sizes.local
    kept = rows * (heads_q + 2 * heads_kv) * head_dim * element + rows * heads_q * LSE_BYTES
    if not exchanged_head_groups(sizes, schedule_steps(sizes, ring), heads_kv, ulysses):
        return kept
    stream_q = heads_q // ulysses  # the stream's query heads
    stream_kv = 2 * rank_kv_heads(heads_kv, ulysses)
    return kept + sizes.stream * ((stream_q + stream_kv) * head_dim * element + stream_q * LSE_BYTES)


def one_gpu_held_bytes(tokens: int, heads: tuple[int, int], head_dim: int, element: int) -> int:
    heads_q, heads_kv = heads
    return tokens * ((heads_q + 2 * heads_kv) * head_dim * element + heads_q * LSE_BYTES)


def held_shares(workload: Workload, ulysses: int, ring: int, placement: str, heads: tuple[int, int],
                head_dim: int = 128, element: int = 2) -> list[float]:
    """Each rank's held bytes (rank order ``r * A + a``) over one GPU's for the whole batch."""
    lengths = torch.tensor(workload.lengths)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    prepared = prepare(host_values(cu), MeshShape(ulysses, ring, placement))
    one_gpu = one_gpu_held_bytes(int(lengths.sum()), heads, head_dim, element)
    return [held_bytes(prepared.rank_sizes(r, a), ring, heads, head_dim, ulysses, element) / one_gpu
            for r in range(ring) for a in range(ulysses)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default="gqa", choices=sorted(HEADS), help="head configuration of benchmarks.speed")
    names, meshes, placements = parse_selection(parser, default_workloads="W2-128K")
    heads = HEADS[parser.parse_args().heads]
    known, rows = workloads(), []
    for name in names:
        for (ulysses, ring) in meshes:
            for placement in placements:
                split = held_shares(known[name], ulysses, ring, placement, heads)
                rows.append([name, f"{ulysses}x{ring}", placement, ulysses * ring, round(max(split), 3),
                             round(sum(split) / len(split), 3), " ".join(f"{s:.3f}" for s in split)])
    print(tabulate(rows, headers=["workload", "mesh", "placement", "N", "most", "mean",
                                  "every rank / one GPU"]))


if __name__ == "__main__":
    main()
