"""Plain-PyTorch varlen attention with LSE and an explicit backward.

Runs on any device and is the reference for the other kernels. It works through the queries in
blocks of at most ``QUERY_BLOCK`` rows, each against the keys of the segments the block
touches, so memory is ``heads x QUERY_BLOCK x (keys of those segments)`` in fp32: fine on a CPU
and in tests, slow for long sequences on a GPU (use flash there). It reads ``cu_seqlens`` on
the host once per call.

Masking: a query sees a key of the same segment (``cu_seqlens``), that is not masked by
``causal`` or the window. Positions come from ``q_positions``/``k_positions`` when given (ring
steps pass global positions inside the document); otherwise they are the offsets inside the
segment, aligned bottom-right as flash attention does when a segment has more keys than queries.

Isolation: a block's einsums run over every (query, key) pair of the block, masked ones
included, and a masked pair still multiplies a zero by its operands: 0 * NaN = NaN. So when
any operand holds a non-finite value (one host read per call), the blocks are cut at segment
boundaries and no document's values enter another document's results.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from hcp_compile.kernels.contract import BlockRequest, BlockSpec
from hcp_compile.kernels.precision import accumulate_dtype

QUERY_BLOCK = 1024


@dataclass(frozen=True)
class _Block:
    """Query rows ``[q0, q1)`` and the key rows ``[k0, k1)`` of the segments they touch."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: Tensor  # [q1 - q0, k1 - k0] bool


def _segments(cu: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Segment id, offset inside the segment, and segment length of every row."""
    cu = cu.to(torch.int64)
    row = torch.arange(rows, device=cu.device)
    seg = torch.searchsorted(cu[1:], row, right=True)
    return seg, row - cu[seg], (cu[1:] - cu[:-1])[seg]


def _query_ranges(starts_q: list[int], q_rows: int, per_segment: bool) -> Iterator[tuple[int, int]]:
    """Query row ranges of at most ``QUERY_BLOCK`` rows; with ``per_segment`` none of them
    spans two segments."""
    bounds = starts_q if per_segment else [0, q_rows]
    for start, stop in zip(bounds, bounds[1:]):
        for q0 in range(start, stop, QUERY_BLOCK):
            yield q0, min(q0 + QUERY_BLOCK, stop)


def _all_finite(*tensors: Tensor, lse: Tensor | None = None) -> bool:
    """Whether every value is finite, in one host read; ``lse`` may also be -inf (a row with
    no visible key), never NaN or +inf. A tensor's sum stands for its values (ten times
    cheaper than ``isfinite(t).all()``): a NaN or inf anywhere makes it non-finite, and a sum
    that overflows from finite values only sends the call down the isolated path, which is
    as right, just slower."""
    flags = [torch.isfinite(t.sum(dtype=accumulate_dtype(t.dtype))) for t in tensors]
    if lse is not None:
        flags.append((lse < float("inf")).all())
    return bool(torch.stack(flags).all())


def _blocks(spec: BlockSpec, per_segment: bool) -> Iterator[_Block]:
    """The blocks of the rows inside the segments: rows past ``cu_q``'s last entry see no key
    (the contract's rows outside every segment), and keep the caller's initial values."""
    cu_q, cu_k, q_positions, k_positions = spec.cu_q, spec.cu_k, spec.q_positions, spec.k_positions
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    seg_q, off_q, len_q = _segments(cu_q, starts_q[-1])
    seg_k, off_k, _ = _segments(cu_k, starts_k[-1])
    if q_positions is None:
        len_k_of_q = (cu_k[1:] - cu_k[:-1]).to(torch.int64)[seg_q]
        q_positions = off_q + len_k_of_q - len_q
        k_positions = off_k
    for q0, q1 in _query_ranges(starts_q, starts_q[-1], per_segment):
        # the segments holding rows q0 and q1 - 1 (empty segments are skipped over)
        first, last = bisect_right(starts_q, q0) - 1, bisect_right(starts_q, q1 - 1) - 1
        k0, k1 = starts_k[first], starts_k[last + 1]
        mask = seg_q[q0:q1, None] == seg_k[None, k0:k1]
        delta = q_positions[q0:q1, None] - k_positions[None, k0:k1]
        if spec.causal:
            mask &= delta >= 0
        if spec.window_left >= 0:
            mask &= delta <= spec.window_left
        if spec.window_right >= 0:
            mask &= -delta <= spec.window_right
        yield _Block(q0, q1, k0, k1, mask)


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


class TorchKernel:
    """Any device and float dtype (the reference the other kernels are tested against)."""

    name = "torch"
    masks_by_position = True

    def supports(self, request: BlockRequest) -> str | None:
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: BlockSpec) -> tuple[Tensor, Tensor]:
        acc = accumulate_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
        isolate = not _all_finite(q, k, v)
        for b in _blocks(spec, isolate):
            s = _scores(q[b.q0 : b.q1], k[b.k0 : b.k1], spec.scale, b.mask)
            block_lse = torch.logsumexp(s, dim=-1)
            p = _probabilities(s, block_lse)
            block_out = torch.einsum("hgqk,khd->qhgd", p, v[b.k0 : b.k1].to(acc)).flatten(1, 2)
            out[b.q0 : b.q1] = block_out.to(q.dtype)
            lse[:, b.q0 : b.q1] = block_lse.flatten(0, 1)
        return out, lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        spec: BlockSpec,
    ) -> tuple[Tensor, Tensor, Tensor]:
        acc = accumulate_dtype(q.dtype)
        hkv, group = k.shape[1], q.shape[1] // k.shape[1]
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        isolate = not _all_finite(dout, q, k, v, out, lse=lse)
        for b in _blocks(spec, isolate):
            rows, keys = slice(b.q0, b.q1), slice(b.k0, b.k1)
            q_b, k_b, v_b = q[rows].to(acc), k[keys].to(acc), v[keys].to(acc)
            s = _scores(q_b, k_b, spec.scale, b.mask)
            p = _probabilities(s, lse[:, rows].to(acc).unflatten(0, (hkv, group)))
            dout_g = dout[rows].to(acc).unflatten(1, (hkv, group))
            dv[keys] += torch.einsum("hgqk,qhgd->khd", p, dout_g)
            dp = torch.einsum("qhgd,khd->hgqk", dout_g, v_b)
            row_dot = (dout_g * out[rows].to(acc).unflatten(1, (hkv, group))).sum(-1).permute(1, 2, 0)
            ds = p * (dp - row_dot[..., None])
            dq[rows] = torch.einsum("hgqk,khd->qhgd", ds, k_b).flatten(1, 2) * spec.scale
            dk[keys] += torch.einsum("hgqk,qhgd->khd", ds, q_b.unflatten(1, (hkv, group))) * spec.scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
