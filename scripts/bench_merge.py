"""GPU micro-benchmark of hcp_compile/merge.py against the passes it replaces (issue 9, item 4).

    python scripts/bench_merge.py                        # T=65536, H=16, D=128, bf16
    python scripts/bench_merge.py --tokens 131072 --sweep

One CUDA device. Each row is one call of the ring's pass, old (the torch ops ``hierarchical``
ran before merge.py, copied below) against new (merge.py), median of ``--iters`` timed with
CUDA events after ``--warmup`` calls:

- merge, middle step: running out fp32 + a block in the input dtype -> fp32 (new: one Triton
  kernel, in place)
- merge, first merge: the running out is still the first block (input dtype): new allocates the
  fp32 accumulator
- merge, last step + the final ``out.to(q.dtype)``: new writes the input dtype directly
  (``out_dtype``)
- sum, fp32 + block: ``dq.to(acc) + dq_block`` against ``accumulate`` (``add_``, in place)
- sum, first: two blocks in the input dtype, against ``accumulate`` (one Triton pass)

Also prints each row's effective bandwidth (bytes its new version must move / time), the
largest difference between old and new values, and how many CUDA kernels each version
launches per call (torch.profiler): 1 for every new one is the point. ``--sweep`` times the
merge kernel's tile rows and warps. Writes the table to ``$OUT/bench_merge.txt`` when ``OUT``
is set.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cuda_median_ms  # noqa: E402
from hcp_compile.merge import (  # noqa: E402
    accumulate, merge_partials, merge_partials_torch, merge_partials_triton,
)


def old_sum(acc, x):
    """The replaced version: ``dq.to(acc) + dq_block`` / ``received.to(acc) + dkv``."""
    return acc.to(torch.float32) + x


def kernels_per_call(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def max_diff(new, old) -> float:
    """Largest |new - old| over the out (and the lse, for a merge)."""
    pairs = zip(new, old) if isinstance(new, tuple) else [(new, old)]
    return max(((a.float() - b.float()).abs().nan_to_num(posinf=0.0).max().item()
                if a.numel() else 0.0) for a, b in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sweep", action="store_true", help="time the merge kernel's tiles")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_merge needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    t, h, d = args.tokens, args.heads, args.dim
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    block_out, block2 = randn(t, h, d, dtype=dtype), randn(t, h, d, dtype=dtype)
    block_lse, lse0 = randn(h, t) * 3 + 2, randn(h, t) * 3 + 2
    block_lse[:, ::7] = float("-inf")  # some rows a block does not see
    running = randn(t, h, d)
    n, ebytes = t * h * d, block_out.element_size()
    lse_bytes = 3 * h * t * 4

    # new versions write into their running buffers: each call gets buffers it may overwrite
    # (the values drift over the repeats; the work per call does not)
    run_out, run_lse = running.clone(), lse0.clone()
    first_lse, last_lse = lse0.clone(), lse0.clone()
    acc = randn(t, h, d)
    # (name, bytes the new version moves, old call, new call, (new, old) values on fresh copies)
    rows = [
        ("merge, middle step", n * (4 + ebytes + 4) + lse_bytes,
         lambda: merge_partials_torch(running, lse0, block_out, block_lse),
         lambda: merge_partials(run_out, run_lse, block_out, block_lse),
         lambda: (merge_partials(running.clone(), lse0.clone(), block_out, block_lse),
                  merge_partials_torch(running, lse0, block_out, block_lse))),
        ("merge, first merge", n * (2 * ebytes + 4) + lse_bytes,
         lambda: merge_partials_torch(block2, lse0, block_out, block_lse),
         lambda: merge_partials(block2, first_lse, block_out, block_lse),
         lambda: (merge_partials(block2, lse0.clone(), block_out, block_lse),
                  merge_partials_torch(block2, lse0, block_out, block_lse))),
        ("merge, last step + .to(dtype)", n * (4 + 2 * ebytes) + lse_bytes,
         lambda: merge_partials_torch(running, lse0, block_out, block_lse)[0].to(dtype),
         lambda: merge_partials(running, last_lse, block_out, block_lse, out_dtype=dtype),
         lambda: (merge_partials(running, lse0.clone(), block_out, block_lse, out_dtype=dtype)[0],
                  merge_partials_torch(running, lse0, block_out, block_lse)[0].to(dtype))),
        ("sum, fp32 + block", n * (4 + ebytes + 4),
         lambda: old_sum(acc, block_out),
         lambda: accumulate(acc, block_out),
         lambda: (accumulate(acc.clone(), block_out), old_sum(acc, block_out))),
        ("sum, first (block + block)", n * (2 * ebytes + 4),
         lambda: old_sum(block2, block_out),
         lambda: accumulate(block2, block_out),
         lambda: (accumulate(block2, block_out), old_sum(block2, block_out))),
    ]
    lines = [f"T={t} H={h} D={d} {args.dtype}, {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}; median of {args.iters} calls (ms)",
             f"{'pass':32} {'old ms':>8} {'new ms':>8} {'speedup':>8} {'new GB/s':>9} "
             f"{'kernels old/new':>16} {'max |new-old|':>14}"]
    for name, nbytes, old, new, values in rows:
        diff = max_diff(*values())
        old_ms = cuda_median_ms(old, args.warmup, args.iters)
        new_ms = cuda_median_ms(new, args.warmup, args.iters)
        counts = f"{kernels_per_call(old)}/{kernels_per_call(new)}"
        lines.append(f"{name:32} {old_ms:8.3f} {new_ms:8.3f} {old_ms / new_ms:7.2f}x "
                     f"{nbytes / new_ms / 1e6:9.0f} {counts:>16} {diff:14.3g}")

    if args.sweep:
        lines.append("merge kernel, middle step, by tile rows x warps (ms):")
        for block_t in (8, 16, 32, 64, 128):
            cells = []
            for warps in (2, 4, 8):
                ms = cuda_median_ms(lambda: merge_partials_triton(run_out, run_lse, block_out, block_lse,
                                                           block_t=block_t, num_warps=warps),
                             args.warmup, args.iters)
                cells.append(f"{warps} warps {ms:7.3f}")
            lines.append(f"  BLOCK_T={block_t:<4} " + "  ".join(cells))

    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_merge.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
