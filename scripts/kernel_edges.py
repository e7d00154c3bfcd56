"""The shape-dependent paths of the aten/cuDNN calls the kernels make, probed on a GPU
(docs/design.md §8.7: what was found and how each path is kept out of reach).

    PYTHONUNBUFFERED=1 python scripts/kernel_edges.py

Part 1 calls the aten ops as they are, with the shapes that reach their special paths (flash's
GQA decoding shortcut, empty segments, key bounds of 1, head dims, fp16; cuDNN's head dims and
GQA) and prints what each does: ok with its largest error against an fp32 per-segment
reference, or the exception. Part 2 runs the flash and dense kernels and ``"auto"``, forward
and backward, on the batches that crashed (1-token documents beside empty ones, GQA) and prints
the same (every kernel on random batches: scripts/gpu_properties.py). Rows print as they come.
Exits non-zero when a library kernel fails (part 2); part 1 records facts and never fails.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

import hcp_compile  # noqa: F401  (registers torch.ops.hcp)
from hcp_compile.kernels import KERNELS, BlockRequest

DEVICE = "cuda"


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _inputs(lengths_q: list[int], lengths_k: list[int], heads: tuple[int, int], dim: int,
            dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    make = lambda rows, h: torch.randn(rows, h, dim, device=DEVICE, dtype=dtype, generator=generator)  # noqa: E731
    tq, tk = sum(lengths_q), sum(lengths_k)
    return {"q": make(tq, heads[0]), "k": make(tk, heads[1]), "v": make(tk, heads[1]), "dout": make(tq, heads[0])}


def reference(x: dict[str, torch.Tensor], lengths_q: list[int], lengths_k: list[int], causal: bool,
              window: tuple[int, int] = (-1, -1)) -> dict[str, torch.Tensor]:
    """fp32 per-segment attention (causal and window aligned bottom-right), autograd grads."""
    leaves = {n: x[n].float().requires_grad_() for n in "qkv"}
    group = x["q"].shape[1] // x["k"].shape[1]
    outs, q0, k0 = [], 0, 0
    for lq, lk in zip(lengths_q, lengths_k):
        q, k, v = leaves["q"][q0:q0 + lq], leaves["k"][k0:k0 + lk], leaves["v"][k0:k0 + lk]
        qpos = torch.arange(lq, device=DEVICE)[:, None] + (lk - lq)
        kpos = torch.arange(lk, device=DEVICE)[None, :]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=DEVICE)
        if causal:
            mask &= kpos <= qpos
        if window[0] >= 0:
            mask &= kpos >= qpos - window[0]
        if window[1] >= 0:
            mask &= kpos <= qpos + window[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
        # rows without a visible key: finite dummy scores, their weights zeroed after the softmax
        scores = torch.where(mask, scores, torch.where(mask.any(1, keepdim=True), float("-inf"), 0.0))
        probs = torch.softmax(scores, -1) * mask
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        q0, k0 = q0 + lq, k0 + lk
    out = torch.cat(outs) if outs else leaves["q"] * 0
    grads = torch.autograd.grad(out, [leaves[n] for n in "qkv"], x["dout"].float(), allow_unused=True)
    return {"out": out.detach(), **{f"d{n}": (g if g is not None else torch.zeros_like(leaves[n]))
                                    for n, g in zip("qkv", grads)}}


def worst_error(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str:
    errors = []
    for name, value in got.items():
        if not torch.isfinite(value).all():
            return f"non-finite {name}"
        errors.append((value.float() - expected[name]).abs().max().item() if value.numel() else 0.0)
    return f"ok, max err {max(errors):.1e}"


def attempt(call: Callable[[], dict[str, torch.Tensor]], expected: Callable[[], dict[str, torch.Tensor]]) -> str:
    try:
        got = call()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001  (a probe records what the op does)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
    return worst_error(got, expected())


def aten_flash(x, lengths_q, lengths_k, max_q, max_k, causal, window=(None, None)) -> dict[str, torch.Tensor]:
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    args = dict(scale=x["q"].shape[-1] ** -0.5, window_size_left=window[0], window_size_right=window[1])
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        x["q"], x["k"], x["v"], cu_q, cu_k, max_q, max_k, 0.0, causal, False, **args)
    rng, unused = torch.zeros(2, dtype=torch.uint64, device=DEVICE), torch.empty(0, device=DEVICE)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        x["dout"], x["q"], x["k"], x["v"], out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, **args)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def aten_cudnn(x, causal) -> dict[str, torch.Tensor]:
    """One dense segment through cuDNN, heads first, as the dense kernel calls it."""
    first = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
    q, k, v = (first(x[n]) for n in "qkv")
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                      scale=q.shape[-1] ** -0.5)
    seed = offset = torch.zeros((), dtype=torch.int64, device=DEVICE)
    dout = first(x["dout"]).contiguous()
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out.contiguous(), lse.float().contiguous(), seed, offset, None, None, None,
        q.shape[2], k.shape[2], 0.0, causal, scale=q.shape[-1] ** -0.5)
    last = lambda t: t[0].transpose(0, 1)  # noqa: E731
    return {"out": last(out), **{f"d{n}": last(g) for n, g in zip("qkv", grads)}}


def part_aten() -> None:
    bf16, fp16 = torch.bfloat16, torch.float16
    flash_cases = [
        # (what, lengths_q, lengths_k, heads, dim, dtype, max_q, max_k, causal)
        ("GQA, 1-token segs beside an empty one, max_q 1", [1, 1, 0, 1], [1, 1, 0, 1], (32, 8), 128, bf16, 1, 1, True),
        ("same, max_q raised to 2", [1, 1, 0, 1], [1, 1, 0, 1], (32, 8), 128, bf16, 2, 1, True),
        ("GQA, every seg 1 query (shortcut taken)", [1, 1, 1], [5, 1, 9], (32, 8), 128, bf16, 1, 9, True),
        ("MHA, 1-token segs beside an empty one, max_q 1", [1, 1, 0, 1], [1, 1, 0, 1], (8, 8), 128, bf16, 1, 1, True),
        ("GQA, [4096, 1, 0, 4096], max 4096", [4096, 1, 0, 4096], [4096, 1, 0, 4096], (32, 8), 128, bf16, 4096, 4096, True),
        ("GQA, 1-query segs, 0-key seg, max_q 2", [1, 1, 1], [3, 0, 2], (8, 2), 64, bf16, 2, 3, False),
        ("GQA, max_k 1 (1-key segs)", [7, 3, 0], [1, 1, 0], (8, 2), 64, bf16, 7, 1, False),
        ("all key segments empty, max_k 1", [5, 3], [0, 0], (8, 2), 64, bf16, 5, 1, False),
        *[(f"head dim {d}, {dt}", [300, 1, 0, 77], [300, 1, 0, 77], (8, 2), d, dt, 300, 300, True)
          for d in (64, 96, 128, 256) for dt in (bf16, fp16)],
    ]
    for what, lq, lk, heads, dim, dtype, max_q, max_k, causal in flash_cases:
        x = _inputs(lq, lk, heads, dim, dtype)
        result = attempt(lambda: aten_flash(x, lq, lk, max_q, max_k, causal), lambda: reference(x, lq, lk, causal))
        print(f"aten flash | {what} | {result}")
    for dim in (64, 96, 128, 256):
        for dtype in (bf16, fp16):
            for rows_, heads in ((2048, (32, 8)), (2048, (8, 8)), (64, (8, 2))):
                x = _inputs([rows_], [rows_], heads, dim, dtype)
                result = attempt(lambda: aten_cudnn(x, True), lambda: reference(x, [rows_], [rows_], True))
                print(f"aten cudnn | {rows_} rows, heads {heads}, dim {dim}, {dtype} | {result}")
    # last: a launch error here could leave the device unusable for the probes after it
    lq, lk = [5, 3], [0, 0]
    x = _inputs(lq, lk, (8, 2), 64, bf16)
    result = attempt(lambda: aten_flash(x, lq, lk, 5, 0, False), lambda: reference(x, lq, lk, False))
    print(f"aten flash | all key segments empty, max_k 0 | {result}")


def part_kernels() -> bool:
    passed = True
    batches = [[4096, 1, 0, 4096], [1, 1, 0, 1], [0, 1], [2048, 0, 1, 1, 2049, 1], [0, 0, 5]]
    for lengths in batches:
        for heads in ((32, 8), (8, 8)):
            for dim, dtype in ((128, torch.bfloat16), (64, torch.float16)):
                for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (64, 0))):
                    x = _inputs(lengths, lengths, heads, dim, dtype)
                    request = BlockRequest.of(x["q"], x["k"], window)
                    for name in ("auto", "flash", "dense"):
                        if name != "auto" and KERNELS[name].supports(request) is not None:
                            continue
                        result = attempt(lambda: library(x, lengths, causal, window, name),
                                         lambda: reference(x, lengths, lengths, causal, window))
                        tolerance = 3.5e-2 if dtype == torch.bfloat16 else 1e-2
                        ok = result.startswith("ok") and float(result.split()[-1]) <= tolerance * 8
                        passed &= ok
                        print(f"{name} | {lengths} | {heads[0]}/{heads[1]} x {dim} | {dtype} | causal {causal} | "
                              f"window {window} | {result} | {'PASS' if ok else 'FAIL'}")
    return passed


def library(x, lengths, causal, window, kernel) -> dict[str, torch.Tensor]:
    leaves = [x[n].clone().requires_grad_() for n in "qkv"]
    cu, longest = _cu(lengths), max(lengths)
    out, _ = torch.ops.hcp.varlen_attention(*leaves, cu, cu, longest, longest, causal,
                                            x["q"].shape[-1] ** -0.5, *window, kernel)
    out.backward(x["dout"])
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}


def main() -> int:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    print("Part 1: the aten ops as they are (errors against an fp32 per-segment reference)")
    part_aten()
    print("Part 2: the library's kernels, forward and backward")
    passed = part_kernels()
    print("ALL PASS" if passed else "FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
