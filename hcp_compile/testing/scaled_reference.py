"""The float64 reference for batches of any size, on any device, and torch's SDPA baseline.

``reference.py`` loops over documents and heads on the CPU: the contract written plainly, too
slow for 65K-token batches. :func:`reference` computes the same attention (tests check them
equal) with the documents of one length as one batch and an explicit forward and backward over
chunks of query rows, so memory stays within ``chunk_elements`` scores whatever a document's
length. :func:`sdpa_baseline` is what torch's own SDPA makes of the same data in the inputs'
dtype: the error the property bound is tied to (``bounds.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from .cases import PackedBatch, PropertyCase, Result


def document_groups(lengths: tuple[int, ...], device: torch.device) -> Iterator[tuple[int, Tensor]]:
    """``(L, rows)`` per document length ``L > 0``: ``rows [n, L]``, the packed rows of the
    ``n`` documents of that length (computed together: batches of many tiny documents)."""
    starts: dict[int, list[int]] = {}
    start = 0
    for length in lengths:
        if length:
            starts.setdefault(length, []).append(start)
        start += length
    for length, firsts in sorted(starts.items()):
        yield length, torch.tensor(firsts, device=device)[:, None] + torch.arange(length, device=device)


def row_chunks(length: int, rows_elements: int, chunk_elements: int) -> Iterator[tuple[int, int]]:
    """Query rows ``[r0, r1)`` of a document group, so that ``rows_elements`` (documents x
    heads) x query rows x keys stays within ``chunk_elements``."""
    rows = max(1, chunk_elements // (rows_elements * length))
    for start in range(0, length, rows):
        yield start, min(length, start + rows)


def visible_keys(r0: int, r1: int, length: int, case: PropertyCase) -> tuple[int, int]:
    """The key range any of the document's query rows ``r0:r1`` may see (never empty: a row
    sees itself)."""
    left, right = case.window
    low = max(0, r0 - left) if left >= 0 else 0
    high = r1 if case.causal else length
    if right >= 0:
        high = min(high, r1 + right)
    return low, high


def visible(r0: int, r1: int, k0: int, k1: int, case: PropertyCase, device: torch.device) -> Tensor:
    """``[r1 - r0, k1 - k0]`` bool: which keys each query row sees (positions in the
    document; the contract, docs/design.md §1)."""
    rows = torch.arange(r0, r1, device=device)[:, None]
    keys = torch.arange(k0, k1, device=device)[None, :]
    mask = torch.ones(r1 - r0, k1 - k0, dtype=torch.bool, device=device)
    left, right = case.window
    if case.causal:
        mask &= keys <= rows
    if left >= 0:
        mask &= keys >= rows - left
    if right >= 0:
        mask &= keys <= rows + right
    return mask


def heads_first(x: Tensor, group: int = 1) -> Tensor:
    """``[n, L, H, D]`` -> ``[n, H * group, L, D]``, each head repeated ``group`` times (GQA)."""
    return x.transpose(1, 2).repeat_interleave(group, dim=1)


def per_kv_head(x: Tensor, heads_kv: int) -> Tensor:
    """``[n, H, L, D]`` of repeated KV heads -> ``[n, L, heads_kv, D]``, the repeats summed."""
    return x.unflatten(1, (heads_kv, -1)).sum(2).transpose(1, 2)


def reference(batch: PackedBatch, case: PropertyCase, chunk_elements: int) -> Result:
    """Attention and its gradients per document in float64 from the same inputs."""
    q, k, v, dout = (t.double() for t in (batch.q, batch.k, batch.v, batch.dout))
    out, dq, dk, dv = (torch.zeros_like(t) for t in (q, q, k, v))
    group, scale = case.heads_q // case.heads_kv, case.softmax_scale
    for length, rows in document_groups(case.lengths, q.device):
        qd, dod = heads_first(q[rows]), heads_first(dout[rows])
        kd, vd = heads_first(k[rows], group), heads_first(v[rows], group)
        dk_rep, dv_rep = torch.zeros_like(kd), torch.zeros_like(vd)
        for r0, r1 in row_chunks(length, rows.shape[0] * case.heads_q, chunk_elements):
            k0, k1 = visible_keys(r0, r1, length, case)
            keys, values = kd[:, :, k0:k1], vd[:, :, k0:k1]
            scores = qd[:, :, r0:r1] @ keys.mT * scale
            p = torch.softmax(scores.masked_fill(~visible(r0, r1, k0, k1, case, q.device), float("-inf")), dim=-1)
            o, do = p @ values, dod[:, :, r0:r1]
            ds = p * (do @ values.mT - (do * o).sum(-1, keepdim=True))
            out[rows[:, r0:r1]] = o.transpose(1, 2)
            dq[rows[:, r0:r1]] = (ds @ keys * scale).transpose(1, 2)
            dk_rep[:, :, k0:k1] += ds.mT @ qd[:, :, r0:r1] * scale
            dv_rep[:, :, k0:k1] += p.mT @ do
        dk[rows], dv[rows] = per_kv_head(dk_rep, case.heads_kv), per_kv_head(dv_rep, case.heads_kv)
    return Result(out, dq, dk, dv)


def sdpa_baseline(batch: PackedBatch, case: PropertyCase, chunk_elements: int) -> Result:
    """Torch's own SDPA on the documents in the inputs' dtype, those of one length as one
    batch: whole documents with ``is_causal`` where there is no window, else chunks of query
    rows with the window's mask; KV heads repeated and their gradients summed in fp32, and
    across chunks (as flash accumulates them)."""
    out, dq = torch.zeros_like(batch.q), torch.zeros_like(batch.q)
    dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (batch.k, batch.v))
    group = case.heads_q // case.heads_kv
    windowed = case.window != (-1, -1)
    for length, rows in document_groups(case.lengths, batch.q.device):
        kd, vd = heads_first(batch.k[rows], group), heads_first(batch.v[rows], group)
        chunks = row_chunks(length, rows.shape[0] * case.heads_q, chunk_elements) if windowed else [(0, length)]
        for r0, r1 in chunks:
            k0, k1 = visible_keys(r0, r1, length, case) if windowed else (0, length)
            qc = heads_first(batch.q[rows[:, r0:r1]]).requires_grad_()
            kc, vc = (x[:, :, k0:k1].requires_grad_() for x in (kd, vd))
            mask = visible(r0, r1, k0, k1, case, qc.device) if windowed else None
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, is_causal=case.causal and not windowed,
                                               scale=case.softmax_scale)
            o.backward(heads_first(batch.dout[rows[:, r0:r1]]))
            out[rows[:, r0:r1]] = o.detach().transpose(1, 2)
            dq[rows[:, r0:r1]] = qc.grad.transpose(1, 2)
            dk[rows[:, k0:k1]] += per_kv_head(kc.grad.float(), case.heads_kv)
            dv[rows[:, k0:k1]] += per_kv_head(vc.grad.float(), case.heads_kv)
    return Result(out, dq, dk.to(case.torch_dtype), dv.to(case.torch_dtype))
