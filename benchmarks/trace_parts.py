"""Where a traced step's kernel time goes, by part: the attention kernels, the kernels' own
helpers, the sums and merges of blocks, copies, fills, reductions and communication. It puts
stored traces side by side, such as one GPU's call and a CP rank's (issue 48 asks for the
breakdown before and after a change):

    python -m benchmarks.trace_parts ONE_GPU.json.gz RANK.json.gz --divide 8,1

``--divide``: per trace, a number to divide its times by (one GPU's call over N ranks gives
the share a rank would run at one GPU's rate). Traces are those ``benchmarks.speed --trace
DIR`` keeps (Chrome traces of the profiled step, gzipped or not)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

from tabulate import tabulate

from benchmarks.common import kernel_totals
from benchmarks.speed_measure import read_trace

# (part, pattern of the kernel's name), the first that matches names it; the helpers come
# before the attention kernels since cuDNN's carry "fmha" too
PARTS: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl"),
    ("kernel helpers (dO·O, dQ to 16 bits, GQA reduction, setup)",
     r"dot_do_o|convert_dq|reduce_head|qkv_tma_setup"),
    ("attention kernels", r"sdpa|flash_|fmha|triton_tem|flex_attention|attn"),
    ("sums and merges", r"_merge_kernel|_add_kernel|Functor_add|logaddexp|_sum_|accumulate"),
    ("copies, conversions, concatenations, indexing", r"CatArray|direct_copy|index|gather|scatter|copy"),
    ("fills", r"FillFunctor|fill"),
    ("reductions", r"reduce_kernel"),
)
OTHER = "other"


def part_of(kernel: str) -> str:
    """The part a kernel's name belongs to (:data:`PARTS`), else ``"other"``."""
    return next((part for part, pattern in PARTS if re.search(pattern, kernel, re.IGNORECASE)), OTHER)


def kernel_parts(trace: dict) -> dict[str, tuple[float, int]]:
    """Per part, the kernels' summed time (ms) and their count, in :data:`PARTS`' order."""
    totals = kernel_totals(trace, part_of)
    parts = [*(part for part, _ in PARTS), OTHER]
    return {part: (total / 1e3, count) for part in parts for count, total in [totals.get(part, (0, 0.0))]}


def table(traces: Sequence[dict], names: Sequence[str], divisors: Sequence[float]) -> str:
    """The parts of every trace, each divided by its divisor, in ms (the kernels counted, not
    divided, in brackets)."""
    columns = []
    for trace in traces:
        parts = kernel_parts(trace)
        parts["total"] = (sum(ms for ms, _ in parts.values()), sum(count for _, count in parts.values()))
        columns.append(parts)
    rows = [[part, *(f"{parts[part][0] / divisor:.1f} ({parts[part][1]})" if parts[part][1] else "-"
                     for parts, divisor in zip(columns, divisors))]
            for part in columns[0]]
    headers = ["part", *(name + (f" / {divisor:g}" if divisor != 1 else "") for name, divisor in zip(names, divisors))]
    return tabulate(rows, headers=headers, tablefmt="github")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--divide", default="", help="comma-separated, one per trace (default 1)")
    args = parser.parse_args(argv)
    try:
        divisors = [float(d) for d in args.divide.split(",")] if args.divide else [1.0] * len(args.traces)
    except ValueError:
        parser.error(f"--divide: expected comma-separated numbers such as 8,1, got {args.divide!r}")
    if len(divisors) != len(args.traces) or min(divisors) <= 0:
        parser.error(f"--divide: {args.divide!r} for {len(args.traces)} traces; give one positive number per trace")
    names = [path.name.split(".json")[0] for path in args.traces]
    print(table([read_trace(path) for path in args.traces], names, divisors))


if __name__ == "__main__":
    main()
