"""A packed-sequence transformer compiled with ``backend="hcp"``, checked against one device.

    python examples/compile_model.py                     # 4 CPU processes: ulysses 2 x ring 2
    python examples/compile_model.py --ulysses 1 --ring 4 --inner inductor
    torchrun --nproc-per-node 2 examples/compile_model.py --device cuda --ulysses 2 --ring 1

The model (``examples/packed_model.py``) is single-device code. Every rank builds the same
global packed batch, keeps its shard (``shard_plan``), and runs the model compiled with the
``hcp`` backend, which rewrites each attention call into all-to-all -> ring -> all-to-all.
Rank 0 prints ``hcp_compile.explain``'s table and compares the unsharded output and the
parameter gradients (summed over the CP ranks, as data parallelism would) with the same model
run on the whole batch on one device in float64. In bf16/fp16 a whole model is far from
float64 on one device too, so the allowed error is a small multiple of that one-device error
(``ONE_DEVICE_FACTOR``). The graphs before and after the rewrite and the AOT forward/backward
graphs are written under ``--dump-dir``.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
from tabulate import tabulate

import hcp_compile
from hcp_compile.compiled.backend import INNER_COMPILERS
from _common import DTYPES, Worker, add_launch_args, launch, mixed_doc_lengths
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
    reference_model = copy.deepcopy(model).double()  # the float64 expectation
    one_device_model = copy.deepcopy(model).to(me.device, dtype)  # what the dtype costs
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
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    for grad in grads.values():  # each rank holds its tokens' share of every gradient
        dist.all_reduce(grad)  # (in fp32: a trainer reduces gradients at least that precisely)

    report = hcp_compile.explain(
        model, plan.shard(x.to(dtype)), plan.position_ids, cu_seqlens, max_seqlen, mesh=mesh,
        plan=plan,
    )
    if me.rank != 0:
        return True

    positions = document_positions(cu_seqlens)
    expected = run_on_one_device(reference_model, x, positions, cu_seqlens, max_seqlen, weights)
    one_device = run_on_one_device(one_device_model, x, positions, cu_seqlens, max_seqlen, weights)
    cp = {"out": out, **{f"grad {name}": grad for name, grad in grads.items()}}
    rows = [(name, *errors(cp[name], one_device[name], expected[name])) for name in expected]
    worst = max(row[-1] for row in rows)
    print(f"documents {lengths}, mesh ulysses {args.ulysses} x ring {args.ring} on "
          f"{args.device}, {args.dtype}, inner compiler {inner}\n")
    print(report, "\n")
    print(f"compiled CP in {args.dtype} vs the same model on one device in float64. A whole "
          f"model in {args.dtype}\ndiffers from float64 on any device, so the bound is the error "
          f"of the model run on one device\nin {args.dtype}: error <= {ONE_DEVICE_FACTOR:g} x "
          f"that error + {FP32_TOL:g} x (1 + |float64 value|)\n")
    print(tabulate(sorted(rows, key=lambda r: -r[-1])[:8],
                   headers=["tensor (8 worst)", "CP max abs error",
                            f"one device {args.dtype} max abs error", "error / bound"],
                   floatfmt=".2e"))
    verdict = "PASS" if worst <= 1 else "FAIL"
    print(f"\nworst error / bound = {worst:.3f} (<= 1 passes): {verdict}")
    print(f"graphs before/after the rewrite and AOT graphs: {args.dump_dir}/rank*/graph_*/")
    return worst <= 1


# The bound of the check. Attention tolerances (docs/design.md §6) bound one attention call;
# a whole model in bf16/fp16 rounds its weights, activations and every matmul, and its error
# against float64 grows through the layers on one device as much as under CP. So the CP error
# is measured against what the dtype costs on one device: CP may round differently (it sums
# partial attention results and gradients in another order) but not much worse. The fp32 term
# keeps the bound meaningful where one device happens to round (almost) exactly.
ONE_DEVICE_FACTOR = 4.0
FP32_TOL = 1e-4


def run_on_one_device(
    model: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
    max_seqlen: int, weights: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Output and parameter gradients of ``sum(weights * model(x))`` on the whole batch, in
    the model's dtype, returned in float64 on the CPU."""
    weight = next(model.parameters())  # the model's device and dtype
    device = weight.device
    out = model(x.to(device, weight.dtype), positions.to(device), cu_seqlens.to(device), max_seqlen)
    (weights.to(device) * out).sum().backward()
    grads = {f"grad {name}": p.grad for name, p in model.named_parameters()}
    return {name: t.detach().double().cpu() for name, t in {"out": out, **grads}.items()}


def errors(cp: torch.Tensor, one_device: torch.Tensor, expected: torch.Tensor) -> tuple[float, float, float]:
    """Max abs error of CP and of one device against ``expected``, and CP's worst error /
    bound (<= 1 passes), the bound being ONE_DEVICE_FACTOR x the one-device max abs error
    + FP32_TOL x (1 + |expected|)."""
    cp = cp.detach().double().cpu()
    if not bool(torch.isfinite(cp).all()):
        return float("inf"), float((one_device - expected).abs().max()), float("inf")
    cp_error = (cp - expected).abs()
    one_device_error = float((one_device - expected).abs().max())
    bound = ONE_DEVICE_FACTOR * one_device_error + FP32_TOL * (1 + expected.abs())
    return float(cp_error.max()), one_device_error, float((cp_error / bound).max())


def main(argv: list[str] | None = None) -> int:
    return launch(worker, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
