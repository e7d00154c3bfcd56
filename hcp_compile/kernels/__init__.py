"""Attention kernels behind one signature, exposed as ``torch.ops.hcp.block_forward/backward``.

Contract shared by every kernel:

- ``forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right,
  q_positions, k_positions) -> (out [Tq, Hq, D] in q's dtype, lse [Hq, Tq])``, lse in fp32
  (float64 for float64 inputs), both contiguous;
  a row with no visible key has ``out = 0`` and ``lse = -inf``.
- ``backward(dout, q, k, v, out, lse, <same arguments>) -> (dq, dk, dv)``, where ``out`` and
  ``lse`` may be the merged results of several blocks (the ring backward passes them so each
  block yields its exact share of the gradient); rows with ``lse = -inf`` give no gradient.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from ..validation import InputError
from . import flash, torch_kernel
from .precision import accumulate_dtype

KERNELS: dict[str, ModuleType] = {"torch": torch_kernel, "flash": flash}
KERNEL_CHOICES = ("auto", *KERNELS)


def resolve_kernel(name: str, q: Tensor) -> str:
    """The kernel to run for ``q``: ``"auto"`` picks flash where it supports q, else torch."""
    if name not in KERNEL_CHOICES:
        raise InputError(f"kernel: expected one of {KERNEL_CHOICES}, got {name!r}")
    if name == "auto":
        return "flash" if flash.supports(q) else "torch"
    if name == "flash" and not flash.supports(q):
        raise InputError(
            f"kernel='flash' needs CUDA tensors in fp16/bf16 with head_dim a multiple of 8 "
            f"and at most 256; got {q.dtype} on {q.device} with head_dim {q.shape[-1]}; "
            "use kernel='torch' or 'auto'"
        )
    return name


@torch.library.custom_op("hcp::block_forward", mutates_args=())
def block_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
    causal: bool, scale: float, window_left: int, window_right: int,
    q_positions: Tensor | None, k_positions: Tensor | None, kernel: str,
) -> tuple[Tensor, Tensor]:
    """One attention block: ``(out, lse)`` under the kernel contract above."""
    return KERNELS[kernel].forward(
        q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right,
        q_positions, k_positions,
    )


@block_forward.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right,
      q_positions, k_positions, kernel):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=accumulate_dtype(q.dtype))
    return out, lse


@torch.library.custom_op("hcp::block_backward", mutates_args=())
def block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
    causal: bool, scale: float, window_left: int, window_right: int,
    q_positions: Tensor | None, k_positions: Tensor | None, kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one attention block given the (possibly merged) ``out`` and ``lse``."""
    return tuple(KERNELS[kernel].backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
        window_left, window_right, q_positions, k_positions,
    ))


@block_backward.register_fake
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window_left,
      window_right, q_positions, k_positions, kernel):
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(v.shape, dtype=v.dtype, device=v.device),
    )


from . import cost  # noqa: E402,F401  (registers the ops' FLOP formulas)
