"""Independent float64 reference for packed varlen attention, on CPU.

Written from the contract (docs/design.md §1), not from the library's kernels: a plain Python loop over
documents and heads, an explicit boolean mask per document, and a softmax. Gradients come from
float64 autograd through this loop.
"""

from __future__ import annotations

import torch
from torch import Tensor


def document_mask(len_q: int, len_k: int, causal: bool, window: tuple[int, int]) -> Tensor:
    """``[len_q, len_k]`` bool: which keys of one document each query of it may see.

    Positions are offsets inside the document (self-attention: ``len_q == len_k``)."""
    q_pos = torch.arange(len_q)[:, None]
    k_pos = torch.arange(len_k)[None, :]
    mask = torch.ones(len_q, len_k, dtype=torch.bool)
    if causal:
        mask &= k_pos <= q_pos
    left, right = window
    if left >= 0:
        mask &= k_pos >= q_pos - left
    if right >= 0:
        mask &= k_pos <= q_pos + right
    return mask


def _attend_one_head(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Masked softmax attention of one document and head; rows with no visible key give 0."""
    scores = (q @ k.T) * scale
    sees_any = mask.any(dim=1, keepdim=True)
    # rows without keys get finite dummy scores (softmax of them is discarded below), so that
    # neither the output nor the float64 autograd produce NaN
    scores = torch.where(mask, scores, torch.where(sees_any, float("-inf"), 0.0))
    probs = torch.softmax(scores, dim=1) * mask
    return probs @ v


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_q: list[int], cu_k: list[int], *, causal: bool,
    window: tuple[int, int] = (-1, -1), scale: float | None = None,
) -> Tensor:
    """Single-device varlen attention in float64: ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``."""
    if cu_q != cu_k and (causal or window != (-1, -1)):
        raise ValueError("the reference defines causal/window masks for self-attention only")
    q, k, v = q.double(), k.double(), v.double()
    heads_q, heads_kv, dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads_q // heads_kv
    scale = dim ** -0.5 if scale is None else scale
    out_docs = []
    for (q0, q1), (k0, k1) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
        mask = document_mask(q1 - q0, k1 - k0, causal, window)
        heads = [
            _attend_one_head(q[q0:q1, h], k[k0:k1, h // group], v[k0:k1, h // group], mask, scale)
            for h in range(heads_q)
        ]
        out_docs.append(torch.stack(heads, dim=1).reshape(q1 - q0, heads_q, dim))
    return torch.cat(out_docs) if out_docs else q.new_zeros(q.shape)


def reference_with_grads(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, cu_q: list[int], cu_k: list[int], **mask_args
) -> dict[str, Tensor]:
    """Reference output and the gradients of ``sum(out * dout)`` w.r.t. q, k, v (float64)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = reference_attention(*leaves, cu_q, cu_k, **mask_args)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout.double(), allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip((dq, dk, dv), leaves)]
    return {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}
