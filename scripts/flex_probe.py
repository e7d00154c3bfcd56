"""Where hcp's flex kernel spends its time against torch's own compiled flex_attention (one GPU).

    python scripts/flex_probe.py                      # the three batches of measure_kernels.py
    python scripts/flex_probe.py --window 4096 --batches loguniform --profile
    python scripts/flex_probe.py --tokens 131000   # rows that are not whole 128-row mask blocks

Per batch (GQA 32/8 x 128, bf16, causal, optionally a sliding window), forward and forward +
backward medians (CUDA events) of:
  torch       compiled flex_attention (static shapes), create_block_mask document mask, built
              once outside the timing, on [1, H, T, D] tensors made outside the timing;
  torch-strided  the same on [1, H, T, D] views of the [T, H, D] tensors (no copies);
  hcp         torch.ops.hcp.varlen_attention with kernel "flex" (rows static, STATIC_SHAPES);
  hcp-dynamic the same with the rows dynamic (STATIC_SHAPES = 0);
  mask        hcp's build_document_mask alone.
``--profile``: the CUDA kernels of one forward + backward of torch, torch-strided and hcp, summed
by name.
docs/design.md §8.5 records what it found.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks
from benchmarks.common import cuda_median_ms, log_uniform_lengths  # noqa: E402
from benchmarks.cp_throughput import causal_flops  # noqa: E402
from hcp_compile.kernels import BlockSpec  # noqa: E402
from hcp_compile.kernels import flex as flex_kernel  # noqa: E402
from hcp_compile.kernels.flex_mask import build_document_mask  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
WARMUP, ITERS = 2, 5


def kernel_table(fn: Callable[[], object], rows: int = 14) -> str:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def probe(name: str, lengths: list[int], window: int, profile: bool) -> None:
    tokens, longest, scale = sum(lengths), max(lengths), HEAD_DIM ** -0.5
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(tokens, HEADS_Q, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True)
    k, v = (torch.randn(tokens, HEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    q4, k4, v4 = (x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v))
    dout4 = dout.transpose(0, 1).unsqueeze(0).contiguous()
    document = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                       torch.tensor(lengths, device="cuda"))

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)
        return visible & (q_idx - kv_idx <= window) if window >= 0 else visible

    torch_mask = create_block_mask(mask_mod, None, None, tokens, tokens, device="cuda", _compile=True)
    compiled_flex = torch.compile(flex_attention, dynamic=False)

    def torch_forward():
        return compiled_flex(q4, k4, v4, block_mask=torch_mask, enable_gqa=True, scale=scale)

    def torch_strided_forward():  # on [1, H, T, D] views of the THD tensors: no copies
        views = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        return compiled_flex(*views, block_mask=torch_mask, enable_gqa=True, scale=scale)

    def hcp_forward():
        return torch.ops.hcp.varlen_attention(q, k, v, cu, cu, longest, longest, True, scale, window,
                                              -1 if window < 0 else 0, "flex")[0]

    def forward_only(forward):
        def run():
            with torch.no_grad():
                forward()
        return run

    def both(forward, grad):
        return lambda: forward().backward(grad)

    spec = BlockSpec(cu, cu, longest, longest, True, scale, window, -1 if window < 0 else 0)
    results = {"torch": (cuda_median_ms(forward_only(torch_forward), WARMUP, ITERS), cuda_median_ms(both(torch_forward, dout4), WARMUP, ITERS)),
               "torch-strided": (cuda_median_ms(forward_only(torch_strided_forward), WARMUP, ITERS),
                                 cuda_median_ms(both(torch_strided_forward, dout4), WARMUP, ITERS))}
    budget = flex_kernel.STATIC_SHAPES
    for label, shapes in (("hcp", budget), ("hcp-dynamic", 0)):
        flex_kernel.STATIC_SHAPES = shapes
        flex_kernel.clear_compiled()
        torch._dynamo.reset()
        results[label] = (cuda_median_ms(forward_only(hcp_forward), WARMUP, ITERS), cuda_median_ms(both(hcp_forward, dout), WARMUP, ITERS))
    flex_kernel.STATIC_SHAPES = budget
    flex_kernel.clear_compiled()
    results["mask"] = (cuda_median_ms(lambda: build_document_mask(spec, tokens, tokens), WARMUP, ITERS), float("nan"))
    flops = causal_flops(lengths, HEADS_Q, HEAD_DIM, window)
    for label, (forward_ms, both_ms) in results.items():
        print(f"[{name}] {label:12s} fwd {forward_ms:8.2f} ms ({flops * 2 / 7 / forward_ms / 1e9:6.1f} TF/s)  "
              f"fwd+bwd {both_ms:8.2f} ms ({flops / both_ms / 1e9:6.1f} TF/s)", flush=True)
    if profile:
        for label, run in (("torch", both(torch_forward, dout4)), ("torch-strided", both(torch_strided_forward, dout4)),
                           ("hcp", both(hcp_forward, dout))):
            print(f"[{name}] kernels of one {label} forward + backward\n{kernel_table(run)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--window", type=int, default=-1, help="window_left (-1: none)")
    parser.add_argument("--batches", default="one,loguniform,short")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    batches = {
        "one": [args.tokens],
        "loguniform": log_uniform_lengths(args.tokens, 256, 32768, seed=0),
        "short": log_uniform_lengths(args.tokens, 128, 2048, seed=1),
    }
    for name in args.batches.split(","):
        probe(name, batches[name], args.window, args.profile)


if __name__ == "__main__":
    main()
