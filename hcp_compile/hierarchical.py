"""Hierarchical context-parallel attention: Ulysses all-to-all over heads, then a zigzag ring
of KV exchanges, then the all-to-all back (DESIGN §3-4). Forward and backward are one
autograd.Function, because autograd through an unrolled ring would drop the lse gradients."""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernels  # noqa: F401  (registers torch.ops.hcp.block_*)
from .collectives import arrived, gather_heads, ring_shift, scatter_heads
from .kernels.precision import accumulate_dtype
from .layout import StepKind
from .mesh import CPGroups
from .schedule import RingSchedule, RingStep


def kv_head_repeat(kv_heads: int, ulysses: int) -> int:
    """How often to repeat each KV head so the Ulysses exchange can split them (GQA)."""
    return ulysses // kv_heads if kv_heads < ulysses else 1


def _block_args(step: RingStep, sched: RingSchedule) -> tuple:
    return (
        step.cu_q, step.cu_k, sched.max_seqlen, sched.max_seqlen, step.kind is StepKind.DIAGONAL,
        sched.scale, sched.window_left, sched.window_right, sched.q_positions, step.k_positions,
        sched.kernel,
    )


def merge_partials(
    out: Tensor | None, lse: Tensor | None, block_out: Tensor, block_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Merge a block's partial softmax result into the running one, in the lse's precision
    (fp32, or float64 for float64 inputs); rows seen by neither stay (0, -inf). The first
    block is taken as it is, so a one-step ring converts nothing."""
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(merged)
    reference = torch.where(finite, merged, 0)
    old_weight = torch.where(finite, torch.exp(lse - reference), 0).t().unsqueeze(-1)
    new_weight = torch.where(finite, torch.exp(block_lse - reference), 0).t().unsqueeze(-1)
    return out * old_weight + block_out * new_weight, merged


def ring_forward(q: Tensor, kv: Tensor, sched: RingSchedule, groups: CPGroups) -> tuple[Tensor, Tensor]:
    """Merged ``(out, lse)`` of the local queries against every ring rank's KV. Pad rows
    come out as (0, -inf): the step segmentation gives them no keys."""
    ring, rank = groups.ring_size, groups.ring_rank
    kv_heads = kv.shape[1] // 2
    out = lse = incoming = None
    for index, step in enumerate(sched.steps):
        current = kv if index == 0 else arrived(incoming, kv.shape)
        # issue the next transfer before this step's compute, so the two can overlap
        incoming = ring_shift(current, groups.ring_group, rank, ring) if index + 1 < ring else None
        if step.active:
            k, v = current.split(kv_heads, dim=1)
            block_out, block_lse = torch.ops.hcp.block_forward(q, k, v, *_block_args(step, sched))
            out, lse = merge_partials(out, lse, block_out, block_lse)
    if out is None:
        out = torch.zeros_like(q)
        lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=accumulate_dtype(q.dtype))
    return out.to(q.dtype), lse


def ring_backward(
    dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, sched: RingSchedule,
    groups: CPGroups,
) -> tuple[Tensor, Tensor]:
    """``(dq, dkv)``. KV travels R-1 hops as in the forward; a dKV accumulator travels with
    it, R hops, and arrives back at its owner after the last step. Sums of several blocks
    are kept in fp32 (float64 for float64 inputs); a block's own gradient and the finished
    sum travel in the input dtype, which rounds nothing that the result would not."""
    ring, rank = groups.ring_size, groups.ring_rank
    kv_heads = kv.shape[1] // 2
    acc = accumulate_dtype(q.dtype)
    dq = incoming = travelling = None
    # The KV message carries one element of dout along. Without that dependency on the
    # backward's input, a compiler merges these transfers with the forward's identical ones
    # (or moves them into the forward) and keeps every rank's KV alive until the backward.
    message = torch.cat([kv.reshape(-1), dout.reshape(-1)[:1]]) if ring > 1 else None
    for index, step in enumerate(sched.steps):
        if index > 0:
            message = arrived(incoming, message.shape)
        current = kv if index == 0 else message[: kv.numel()].view(kv.shape)
        incoming = ring_shift(message, groups.ring_group, rank, ring) if index + 1 < ring else None
        dkv = None
        if step.active:
            k, v = current.split(kv_heads, dim=1)
            dq_block, dk_block, dv_block = torch.ops.hcp.block_backward(
                dout, q, k, v, out, lse, *_block_args(step, sched)
            )
            dq = dq_block if dq is None else dq.to(acc) + dq_block
            dkv = torch.cat([dk_block, dv_block], dim=1)
        if travelling is not None:
            received = arrived(travelling, kv.shape).to(acc)
            dkv = received if dkv is None else received + dkv
        if dkv is None:
            dkv = torch.zeros_like(kv)
        if ring > 1:
            last_hop = index == ring - 1
            travelling = ring_shift(dkv.to(kv.dtype) if last_hop else dkv, groups.ring_group, rank, ring)
        else:
            travelling = dkv
    if dq is None:
        dq = torch.zeros_like(q)
    dkv = arrived(travelling, kv.shape) if ring > 1 else travelling
    return dq.to(q.dtype), dkv.to(kv.dtype)


class HierarchicalAttention(torch.autograd.Function):
    """Local token shards in, local output shard out (and, with ``return_lse``, the local
    ``[Hq, T_local]`` logsumexp, which is not differentiable); see the module docstring."""

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, sched: RingSchedule, groups: CPGroups,
        return_lse: bool,
    ):
        repeat = kv_head_repeat(k.shape[1], groups.ulysses_size)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        ulysses = (groups.ulysses_group, groups.ulysses_size)
        q_s = scatter_heads([q], *ulysses)
        # k and v travel together, so the ring can send them as one contiguous buffer
        kv_s = scatter_heads([k, v], *ulysses)
        out_s, lse_s = ring_forward(q_s, kv_s, sched, groups)
        ctx.save_for_backward(q_s, kv_s, out_s, lse_s)
        ctx.sched, ctx.groups, ctx.repeat = sched, groups, repeat
        (out,) = gather_heads(out_s, [out_s.shape[1]], *ulysses)
        if not return_lse:
            return out
        # [H_s, T_r] -> [T_r, H_s, 1]: the token-major layout gather_heads exchanges
        (lse,) = gather_heads(lse_s.t().unsqueeze(-1), [lse_s.shape[0]], *ulysses)
        lse = lse.squeeze(-1).t().contiguous()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, *_grad_lse):
        q_s, kv_s, out_s, lse_s = ctx.saved_tensors
        groups = ctx.groups
        ulysses = (groups.ulysses_group, groups.ulysses_size)
        dout_s = scatter_heads([dout.contiguous()], *ulysses)
        dq_s, dkv_s = ring_backward(dout_s, q_s, kv_s, out_s, lse_s, ctx.sched, groups)
        (dq,) = gather_heads(dq_s, [dq_s.shape[1]], *ulysses)
        dk, dv = gather_heads(dkv_s, [dkv_s.shape[1] // 2] * 2, *ulysses)
        if ctx.repeat > 1:
            dk = dk.unflatten(1, (-1, ctx.repeat)).sum(2)
            dv = dv.unflatten(1, (-1, ctx.repeat)).sum(2)
        return dq, dk, dv, None, None, None
