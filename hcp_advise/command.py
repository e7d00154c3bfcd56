"""``python -m hcp_advise``: batches from a spec, the arguments, the report."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from hcp_compile.batch.packing import log_uniform_lengths
from hcp_compile.batch.placements import PLACEMENTS
from hcp_compile.validation import InputError

from .chooser import advise
from .records import DEFAULT_DEVICE, Links
from .report import format_advice

DESCRIPTION = ("Which ulysses x ring mesh and placement for your batches: per option the predicted step "
               "time per rank and its exposed communication, and why the best wins.")


def cu_seqlens_of(lengths: Sequence[int]) -> Tensor:
    return torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.int32)


def batches_from(spec: str, tokens: int, count: int, seed: int) -> list[Tensor]:
    """``"one"``: one document of ``tokens``; ``"loguniform:LOW:HIGH"``: ``count`` batches of
    ``tokens`` drawn with seeds ``seed..``; otherwise a file, one batch per line of
    whitespace-separated document lengths."""
    if spec == "one":
        return [cu_seqlens_of([tokens])]
    if spec.startswith("loguniform:"):
        try:
            low, high = (int(x) for x in spec.split(":")[1:])
        except ValueError:
            raise InputError(f"lengths: expected loguniform:LOW:HIGH with ints, got {spec!r}") from None
        if not 1 <= low <= high:
            raise InputError(f"lengths: expected 1 <= LOW <= HIGH in loguniform:LOW:HIGH, got {spec!r}")
        return [cu_seqlens_of(log_uniform_lengths(tokens, low, high, seed + i)) for i in range(count)]
    path = Path(spec)
    if not path.is_file():
        raise InputError(f"lengths: expected 'one', 'loguniform:LOW:HIGH' or a file of document "
                         f"lengths (one batch per line), got {spec!r}, which is no file")
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
    try:
        return [cu_seqlens_of([int(x) for x in line]) for line in lines]
    except ValueError:
        raise InputError(f"lengths: {spec} must hold whitespace-separated int lengths, one batch per line") from None


def parse_heads(text: str) -> tuple[int, int]:
    try:
        heads_q, heads_kv = (int(x) for x in text.split("/"))
    except ValueError:
        raise InputError(f"heads: expected HQ/HKV (e.g. 32/8), got {text!r}") from None
    return heads_q, heads_kv


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m hcp_advise", description=DESCRIPTION)
    parser.add_argument("--world", type=int, required=True, help="GPUs of the CP mesh")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--heads", default="32/8", help="query/key-value heads, e.g. 32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--lengths", default="loguniform:256:32768",
                        help="'one', 'loguniform:LOW:HIGH' or a file (one batch of lengths per line)")
    parser.add_argument("--tokens", type=int, default=1 << 20, help="tokens per drawn batch")
    parser.add_argument("--batches", type=int, default=1, help="drawn batches to average over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--device-kind", default=DEFAULT_DEVICE)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--window", type=int, default=-1,
                        help="a causal sliding window: the keys each query sees back (default -1: none)")
    defaults = Links()
    parser.add_argument("--all-to-all-gbs", type=float, default=defaults.all_to_all_bytes_per_s / 1e9,
                        help="NVLink all-to-all GB/s per GPU and direction")
    parser.add_argument("--ring-nvlink-gbs", type=float, default=defaults.ring_nvlink_bytes_per_s / 1e9)
    parser.add_argument("--network-gbs", type=float, default=defaults.network_bytes_per_s / 1e9,
                        help="across nodes, GB/s per GPU and direction (400 Gb/s = 50)")
    parser.add_argument("--nvlink-latency-us", type=float, default=defaults.nvlink_latency_s * 1e6)
    parser.add_argument("--network-latency-us", type=float, default=defaults.network_latency_s * 1e6)
    args = parser.parse_args(argv)
    heads_q, heads_kv = parse_heads(args.heads)
    links = Links(args.all_to_all_gbs * 1e9, args.ring_nvlink_gbs * 1e9, args.network_gbs * 1e9,
                  args.nvlink_latency_us * 1e-6, args.network_latency_us * 1e-6)
    batches = batches_from(args.lengths, args.tokens, args.batches, args.seed)
    advice = advise(batches, world=args.world, gpus_per_node=args.gpus_per_node, heads_q=heads_q,
                    heads_kv=heads_kv, head_dim=args.head_dim, dtype=getattr(torch, args.dtype),
                    placements=[p for p in args.placements.split(",") if p], kernel=args.kernel,
                    device_kind=args.device_kind, links=links, window=args.window)
    return format_advice(advice)
