"""Plain-PyTorch varlen attention with LSE and an explicit backward.

Runs on any device and is the reference for the other kernels. It materializes the scores of
all query rows against all key rows ([heads, Tq, Tk] in fp32), so it is meant for CPU runs and
tests, not for long sequences on a GPU.

Masking: a query sees a key of the same segment (``cu_seqlens``), that is not masked by
``causal`` or the window. Positions come from ``q_positions``/``k_positions`` when given (ring
steps pass global positions inside the document); otherwise they are the offsets inside the
segment, aligned bottom-right as flash attention does when a segment has more keys than queries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .precision import accumulate_dtype


def _segments(cu: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Segment id, offset inside the segment, and segment length of every row."""
    cu = cu.to(torch.int64)
    row = torch.arange(rows, device=cu.device)
    seg = torch.searchsorted(cu[1:], row, right=True)
    return seg, row - cu[seg], (cu[1:] - cu[:-1])[seg]


def _mask(
    q_rows: int, k_rows: int, cu_q: Tensor, cu_k: Tensor, causal: bool,
    window_left: int, window_right: int, q_positions: Tensor | None, k_positions: Tensor | None,
) -> Tensor:
    seg_q, off_q, len_q = _segments(cu_q, q_rows)
    seg_k, off_k, _ = _segments(cu_k, k_rows)
    if q_positions is None:
        len_k_of_q = (cu_k[1:] - cu_k[:-1]).to(torch.int64)[seg_q]
        q_positions = off_q + len_k_of_q - len_q
        k_positions = off_k
    mask = seg_q[:, None] == seg_k[None, :]
    delta = q_positions[:, None] - k_positions[None, :]
    if causal:
        mask &= delta >= 0
    if window_left >= 0:
        mask &= delta <= window_left
    if window_right >= 0:
        mask &= -delta <= window_right
    return mask


def _scores(q: Tensor, k: Tensor, scale: float, mask: Tensor) -> Tensor:
    """Masked scores [Hkv, group, Tq, Tk] in the accumulation dtype."""
    acc = accumulate_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    qg = q.to(acc).unflatten(1, (k.shape[1], group))
    s = torch.einsum("qhgd,khd->hgqk", qg, k.to(acc)) * scale
    return s.masked_fill(~mask, float("-inf"))


def _probabilities(s: Tensor, lse: Tensor) -> Tensor:
    # rows with no visible key have lse = -inf: their probabilities are 0, not NaN
    finite = torch.isfinite(lse)
    return torch.where(finite[..., None], torch.exp(s - torch.where(finite, lse, 0)[..., None]), 0)


def forward(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
    causal: bool, scale: float, window_left: int, window_right: int,
    q_positions: Tensor | None, k_positions: Tensor | None,
) -> tuple[Tensor, Tensor]:
    mask = _mask(q.shape[0], k.shape[0], cu_q, cu_k, causal, window_left, window_right,
                 q_positions, k_positions)
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = _probabilities(s, lse)
    out = torch.einsum("hgqk,khd->qhgd", p, v.to(p.dtype)).flatten(1, 2)
    return out.to(q.dtype).contiguous(), lse.flatten(0, 1).contiguous()


def backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
    causal: bool, scale: float, window_left: int, window_right: int,
    q_positions: Tensor | None, k_positions: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    mask = _mask(q.shape[0], k.shape[0], cu_q, cu_k, causal, window_left, window_right,
                 q_positions, k_positions)
    s = _scores(q, k, scale, mask)
    acc = s.dtype
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    p = _probabilities(s, lse.to(acc).unflatten(0, (hkv, group)))
    dout_g = dout.to(acc).unflatten(1, (hkv, group))
    dv = torch.einsum("hgqk,qhgd->khd", p, dout_g)
    dp = torch.einsum("qhgd,khd->hgqk", dout_g, v.to(acc))
    row_dot = (dout_g * out.to(acc).unflatten(1, (hkv, group))).sum(-1).permute(1, 2, 0)
    ds = p * (dp - row_dot[..., None])
    dq = torch.einsum("hgqk,khd->qhgd", ds, k.to(acc)).flatten(1, 2) * scale
    dk = torch.einsum("hgqk,qhgd->khd", ds, q.to(acc).unflatten(1, (hkv, group))) * scale
    return (
        dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()
    )
