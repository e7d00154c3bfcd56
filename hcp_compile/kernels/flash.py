"""CUDA flash varlen attention through ``aten._flash_attention_forward/backward``.

Adapts flash's conventions to the shared kernel contract: flash marks rows with no visible key
with lse = +inf, the contract with -inf (so that the ring merge is a plain logaddexp).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..validation import InputError

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def supports(q: Tensor) -> bool:
    return q.is_cuda and q.dtype in SUPPORTED_DTYPES and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def _window(window_left: int, window_right: int, q_positions: Tensor | None) -> tuple:
    if q_positions is not None and (window_left >= 0 or window_right >= 0):
        raise InputError(
            "window_size: the flash kernel cannot apply a sliding window under context "
            "parallelism (masks need global positions); pass kernel='torch' in the "
            "context_parallel options or run without a window"
        )
    return (window_left if window_left >= 0 else None, window_right if window_right >= 0 else None)


def forward(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
    causal: bool, scale: float, window_left: int, window_right: int,
    q_positions: Tensor | None, k_positions: Tensor | None,
) -> tuple[Tensor, Tensor]:
    left, right = _window(window_left, window_right, q_positions)
    if q.shape[0] == 0 or k.shape[0] == 0:  # an empty region or ring section: nothing to see
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
        return torch.zeros_like(q), lse
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
        scale=scale, window_size_left=left, window_size_right=right,
    )
    return out, lse.masked_fill(lse == float("inf"), float("-inf"))


def backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
    causal: bool, scale: float, window_left: int, window_right: int,
    q_positions: Tensor | None, k_positions: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    left, right = _window(window_left, window_right, q_positions)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(),
        lse.masked_fill(lse == float("-inf"), float("inf")).contiguous(),
        cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused,
        scale=scale, window_size_left=left, window_size_right=right,
    )
