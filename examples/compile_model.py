"""A packed-sequence transformer compiled with ``backend="hcp"``, checked against one device.

    python examples/compile_model.py                     # 4 CPU processes: ulysses 2 x ring 2
    python examples/compile_model.py --ulysses 1 --ring 4 --inner inductor
    torchrun --nproc-per-node 2 examples/compile_model.py --device cuda --ulysses 2 --ring 1

The model (``examples/packed_model.py``) is single-device code. Every rank builds the same
global packed batch, keeps its shard (``shard_plan``), and runs the model compiled with the
``hcp`` backend, which rewrites each attention call into all-to-all -> ring -> all-to-all.
Rank 0 prints ``hcp_compile.explain``'s table and compares the unsharded output and the
parameter gradients (summed over the CP ranks, as data parallelism would) with the same model
run on the whole batch on one device in float64. The graphs before and after the rewrite and
the AOT forward/backward graphs are written under ``--dump-dir``.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
from tabulate import tabulate

import hcp_compile
from hcp_compile.backend import INNER_COMPILERS
from _common import DTYPES, Worker, add_launch_args, launch, mixed_doc_lengths, tolerance
from packed_model import PackedTransformer, document_positions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_launch_args(parser, ulysses=2, ring=2, device="cpu", dtype="float32")
    parser.add_argument("--tokens", type=int, default=200, help="real tokens in the packed batch")
    parser.add_argument("--docs", type=int, default=5, help="documents in the packed batch")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--inner", choices=INNER_COMPILERS,
                        default=None, help="default: inductor on cuda, aot_eager on cpu")
    parser.add_argument("--dump-dir", default="hcp_dump")
    return parser.parse_args(argv)


def worker(me: Worker, args: argparse.Namespace) -> bool:
    dtype = DTYPES[args.dtype]
    inner = args.inner or ("inductor" if args.device == "cuda" else "aot_eager")
    mesh = hcp_compile.make_mesh(ulysses=args.ulysses, ring=args.ring, device_type=args.device)
    torch.manual_seed(args.seed)  # the same weights and batch on every rank
    model = PackedTransformer(args.dim, args.heads, args.kv_heads, args.layers)
    reference_model = copy.deepcopy(model).double()
    model = model.to(me.device, dtype)
    lengths = mixed_doc_lengths(args.tokens, args.docs, args.seed)
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(me.device, torch.int32)
    max_seqlen = max(lengths)
    x = torch.randn(args.tokens, args.dim, device=me.device)
    weights = torch.randn(args.tokens, args.dim, device=me.device)  # loss = sum(weights * out)

    plan = hcp_compile.shard_plan(cu_seqlens, mesh)
    options = {"mesh": mesh, "inner": inner, "dump_dir": args.dump_dir}
    compiled = torch.compile(model, backend="hcp", options=options, fullgraph=True)
    local_out = compiled(plan.shard(x.to(dtype)), plan.position_ids, cu_seqlens, max_seqlen)
    out = plan.unshard(local_out)
    (weights * out).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for grad in grads.values():  # each rank holds its tokens' share of every gradient
        dist.all_reduce(grad)

    report = hcp_compile.explain(
        model, plan.shard(x.to(dtype)), plan.position_ids, cu_seqlens, max_seqlen, mesh=mesh,
        plan=plan,
    )
    if me.rank != 0:
        return True

    positions = document_positions(cu_seqlens)
    ref_out = reference_model(x.double().cpu(), positions.cpu(), cu_seqlens.cpu(), max_seqlen)
    (weights.double().cpu() * ref_out).sum().backward()
    tol = tolerance(dtype, gqa=args.kv_heads < args.heads)
    rows = [("out", out, ref_out)] + [
        (f"grad {name}", grads[name], p.grad) for name, p in reference_model.named_parameters()
    ]
    worst = 0.0
    table = []
    for name, got, expected in rows:
        got, expected = got.detach().double().cpu(), expected.detach().double()
        bound = tol + tol * expected.abs()
        ratio = float(((got - expected).abs() / bound).max())
        worst = max(worst, ratio)
        table.append((name, float((got - expected).abs().max()), ratio))
    print(f"documents {lengths}, mesh ulysses {args.ulysses} x ring {args.ring} on "
          f"{args.device}, {args.dtype}, inner compiler {inner}\n")
    print(report, "\n")
    print(f"compiled CP vs one device in float64 (tolerance {tol:g}):\n")
    print(tabulate(sorted(table, key=lambda r: -r[2])[:8],
                   headers=["tensor (8 worst)", "max abs error", "error / bound"], floatfmt=".2e"))
    verdict = "PASS" if worst <= 1 else "FAIL"
    print(f"\nworst error / bound = {worst:.3f} (<= 1 passes): {verdict}")
    print(f"graphs before/after the rewrite and AOT graphs: {args.dump_dir}/rank*/graph_*/")
    return worst <= 1


def main(argv: list[str] | None = None) -> int:
    return launch(worker, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
