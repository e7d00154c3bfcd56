"""GPU correctness check of hierarchical CP against single-GPU attention (docs/design.md §6).

    torchrun --nproc-per-node 2 -m scripts.gpu_check --ulysses 2 --ring 1
    torchrun --nproc-per-node 2 -m scripts.gpu_check --ulysses 1 --ring 2
    torchrun --nproc-per-node 2 -m scripts.gpu_check --device cpu --dtype float32 --tokens 200
    torchrun --nproc-per-node 2 -m scripts.gpu_check --share-gpu --ulysses 2 --ring 1   # one GPU

A packed batch (default 65536 real tokens over 20 documents of mixed, partly odd lengths, one
of them long) runs through ``varlen_attention`` inside ``context_parallel(mesh, kernel=...)``
(flash on CUDA, bf16), forward and backward, for GQA and MHA heads, causal and not. The
unsharded output and q/k/v gradients are compared with single-GPU ``varlen_attention`` on the
full tensors (rank 0, same dtype, kernel "auto") using assert_close's criterion with
atol = rtol = the docs/design.md §6 tolerance. For small batches (``--fp32-ref-max-tokens``) both are
also compared with a float32 reference (the O(T^2)-memory torch kernel).

Prints a table on rank 0, writes it to ``$OUT/gpu_check_<A>x<R>.txt`` when ``OUT`` is set,
and exits non-zero if any configuration fails.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tabulate import tabulate

import hcp_compile
from hcp_compile.batch.placements import PLACEMENTS
from hcp_compile.exchange.schemes import DEFAULT_SCHEME, SCHEMES
from hcp_compile.kernels import KERNEL_CHOICES
from examples._common import (
    DTYPES, GRADIENTS, PackedBatch, Result, Worker, add_launch_args, compare, context_parallel,
    launch, make_batch, max_abs_error, mixed_doc_lengths, single_device, tolerance,
)

FULL_TOKENS, QUICK_TOKENS = 65536, 8192


@dataclass(frozen=True)
class Config:
    heads_q: int
    heads_kv: int
    causal: bool
    recompute_exchange: bool = False

    @property
    def gqa(self) -> bool:
        return self.heads_kv < self.heads_q

    @property
    def heads(self) -> str:
        return f"{self.heads_q}/{self.heads_kv} " + ("GQA" if self.gqa else "MHA")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_launch_args(parser, ulysses=2, ring=1, device="cuda", dtype="bfloat16")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"real tokens (default {FULL_TOKENS}, {QUICK_TOKENS} with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_TOKENS} tokens instead of {FULL_TOKENS}")
    parser.add_argument("--docs", type=int, default=20)
    parser.add_argument("--heads-q", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, nargs="+", default=[4, 16],
                        help="one configuration per value (< heads-q: GQA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--placement", nargs="+", default=list(PLACEMENTS),
                        choices=tuple(PLACEMENTS), help="token layouts to check")
    parser.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                        help="sliding window (left, right); -1: unlimited")
    parser.add_argument("--kernel", choices=KERNEL_CHOICES, default=None,
                        help="CP kernel (default: flash on cuda, torch on cpu); the single-device "
                             "reference runs kernel='auto'")
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default=DEFAULT_SCHEME,
                        help="the collective scheme of context_parallel")
    parser.add_argument("--recompute-exchange", action="store_true",
                        help="also run every configuration with context_parallel(recompute_exchange=True)")
    parser.add_argument("--fp32-ref-max-tokens", type=int, default=QUICK_TOKENS,
                        help="also compare with a float32 reference up to this many tokens")
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = QUICK_TOKENS if args.quick else FULL_TOKENS
    if args.kernel is None:
        args.kernel = "flash" if args.device == "cuda" else "torch"
    return args


def wants_fp32_reference(args: argparse.Namespace) -> bool:
    return DTYPES[args.dtype] not in (torch.float32, torch.float64) and (
        args.tokens <= args.fp32_ref_max_tokens
    )


def check(
    me: Worker, args: argparse.Namespace, mesh, plan: hcp_compile.ShardPlan, batch: PackedBatch,
    cfg: Config,
) -> tuple[list, list | None] | None:
    """One configuration: its result row and, if wanted, its float32 row on rank 0; None
    elsewhere."""
    window = tuple(args.window)
    result = context_parallel(batch, mesh, plan, cfg.causal, kernel=args.kernel, window=window,
                              recompute_exchange=cfg.recompute_exchange, scheme=args.scheme)
    if me.rank != 0:
        return None
    reference = single_device(batch, cfg.causal, window=window)
    cmp = compare(result, reference, tolerance(DTYPES[args.dtype], cfg.gqa))
    row = [plan.placement, cfg.heads, cfg.causal, cfg.recompute_exchange, *cmp.errors.values(), cmp.tol, cmp.ratio,
           cmp.pad_max, "PASS" if cmp.ok else "FAIL"]
    fp32_row = None
    if wants_fp32_reference(args):
        exact = single_device(batch, cfg.causal, dtype=torch.float32, window=window)
        fp32_row = [plan.placement, cfg.heads, cfg.causal, cfg.recompute_exchange,
                    *_pair_errors(result, reference, exact)]
    return row, fp32_row


def _pair_errors(result: Result, reference: Result, exact: Result) -> list[str]:
    """``"cp / single"``: each one's max abs error against the float32 reference."""
    triples = zip(*(r.tensors().values() for r in (result, reference, exact)))
    return [f"{max_abs_error(a, e):.2e} / {max_abs_error(b, e):.2e}" for a, b, e in triples]


def report(
    args: argparse.Namespace, lengths: list[int], rows: list[list], fp32_rows: list[list]
) -> str:
    title = (
        f"hcp_compile GPU check: ulysses {args.ulysses} x ring {args.ring}, {args.device}, "
        f"{args.dtype}, kernel {args.kernel}, window {tuple(args.window)}, {sum(lengths)} tokens in {len(lengths)} docs "
        f"(longest {max(lengths)}), head dim {args.head_dim}, torch {torch.__version__}"
    )
    if args.device == "cuda":
        title += f", {torch.cuda.get_device_name()}"
    parts = [
        title,
        f"doc lengths: {lengths}",
        "max abs error of CP vs single-device attention (same dtype, kernel auto):",
        tabulate(rows, headers=["placement", "heads q/kv", "causal", "recompute", *GRADIENTS, "tol",
                                "worst/bound", "pad |max|", "result"],
                 floatfmt=("", "", "", "", ".2e", ".2e", ".2e", ".2e", "g", ".3f", "g", "")),
        "tol: atol = rtol (README, Tolerances); worst/bound: max |err| / (tol + tol |ref|) over "
        "all four tensors, <= 1 passes (torch.testing.assert_close's criterion); NaN/Inf fail; "
        "pad |max|: largest |value| of the local output and gradients on pad rows (inputs and "
        "output gradient filled with 7 there), must be 0",
    ]
    if fp32_rows:
        parts += [
            "max abs error vs a float32 reference (torch kernel), CP / single-device:",
            tabulate(fp32_rows, headers=["placement", "heads q/kv", "causal", "recompute", *GRADIENTS]),
        ]
    return "\n\n".join(parts) + "\n"


def write_report(args: argparse.Namespace, text: str) -> None:
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / f"gpu_check_{args.ulysses}x{args.ring}.txt"
        path.write_text(text)
        print(f"written to {path}")


def worker(me: Worker, args: argparse.Namespace) -> bool:
    mesh = hcp_compile.make_mesh(ulysses=args.ulysses, ring=args.ring, device_type=args.device)
    lengths = mixed_doc_lengths(args.tokens, args.docs, args.seed)
    rows, fp32_rows = [], []
    for heads_kv in args.heads_kv:
        batch = make_batch(
            lengths, args.heads_q, heads_kv, args.head_dim, DTYPES[args.dtype], me.device, args.seed
        )
        for placement in args.placement:
            plan = hcp_compile.shard_plan(batch.cu_seqlens, mesh, placement=placement)
            recomputes = (False, True) if args.recompute_exchange else (False,)
            for causal, recompute in itertools.product((True, False), recomputes):
                config = Config(args.heads_q, heads_kv, causal, recompute)
                checked = check(me, args, mesh, plan, batch, config)
                if checked is not None:
                    row, fp32_row = checked
                    rows.append(row)
                    if fp32_row is not None:
                        fp32_rows.append(fp32_row)
    if me.rank != 0:
        return True
    text = report(args, lengths, rows, fp32_rows)
    print(text)
    write_report(args, text)
    passed = all(row[-1] == "PASS" for row in rows)
    print("ALL PASS" if passed else "FAILED")
    return passed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available here. This check is meant for GPU machines; to "
            "exercise its logic on CPU run e.g. `torchrun --nproc-per-node 2 -m scripts.gpu_check "
            "--device cpu --dtype float32 --tokens 200`",
            file=sys.stderr,
        )
        return 2
    return launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
