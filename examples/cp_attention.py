"""Hierarchical context-parallel attention over a packed batch, checked against one device.

    python examples/cp_attention.py                       # 4 CPU processes: ulysses 2 x ring 2
    python examples/cp_attention.py --ulysses 1 --ring 4
    torchrun --nproc-per-node 4 examples/cp_attention.py --device cuda --ulysses 2 --ring 2

Every rank builds the same global packed batch (documents of mixed lengths back to back, as
``cu_seqlens`` describes them), keeps only its shard (``shard_plan``), runs the model's
attention call unchanged inside ``context_parallel``, and runs backward. Rank 0 then prints
where the tokens went and how far the unsharded output and gradients are from single-device
attention computed in float64.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

import hcp_compile
from _common import (
    DTYPES, LAYOUT_HEADERS, Worker, add_launch_args, compare, context_parallel, launch, make_batch,
    mixed_doc_lengths, rank_layout, single_device, tolerance,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_launch_args(parser, ulysses=2, ring=2, device="cpu", dtype="float32")
    parser.add_argument("--tokens", type=int, default=300, help="real tokens in the packed batch")
    parser.add_argument("--docs", type=int, default=6, help="documents in the packed batch")
    parser.add_argument("--heads-q", type=int, default=8)
    parser.add_argument("--heads-kv", type=int, default=2, help="< heads-q: GQA")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    return parser.parse_args(argv)


def worker(me: Worker, args: argparse.Namespace) -> bool:
    dtype = DTYPES[args.dtype]
    mesh = hcp_compile.make_mesh(ulysses=args.ulysses, ring=args.ring, device_type=args.device)
    lengths = mixed_doc_lengths(args.tokens, args.docs, args.seed)
    batch = make_batch(
        lengths, args.heads_q, args.heads_kv, args.head_dim, dtype, me.device, args.seed
    )

    plan = hcp_compile.shard_plan(batch.cu_seqlens, mesh)
    result = context_parallel(batch, mesh, plan, args.causal)
    layout = rank_layout(mesh, plan)
    if me.rank != 0:
        return True

    reference = single_device(batch, args.causal, dtype=torch.float64)
    tol = tolerance(dtype, gqa=args.heads_kv < args.heads_q)
    cmp = compare(result, reference, tol)
    print(f"documents {lengths} ({sum(lengths)} tokens), causal={args.causal}, {args.dtype}, "
          f"q heads {args.heads_q}, kv heads {args.heads_kv}, head dim {args.head_dim}")
    print(f"\nmesh: ulysses {args.ulysses} x ring {args.ring} on {args.device}\n")
    print(tabulate(layout, headers=LAYOUT_HEADERS))
    print(f"\nunsharded CP result vs single-device attention in float64 (tolerance {tol:g}):\n")
    print(tabulate(cmp.errors.items(), headers=["tensor", "max abs error"], floatfmt=".2e"))
    verdict = "PASS" if cmp.ok else "FAIL"
    print(f"\nworst |error| / (tol + tol * |reference|) = {cmp.ratio:.3f} (<= 1 passes): {verdict}")
    return cmp.ok


def main(argv: list[str] | None = None) -> int:
    return launch(worker, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
