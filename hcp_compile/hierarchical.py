"""Hierarchical context-parallel attention of one rank (docs/design.md §3-4): its LOCAL
documents attend on the rank itself with all heads; the rest of its tokens go through the
Ulysses all-to-all over heads, the zigzag ring of KV exchanges over the ring sections, and the
all-to-all back. Forward and backward are one autograd.Function, because autograd through an
unrolled ring would drop the lse gradients."""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import BlockSpec, run_backward, run_forward
from .collectives import arrived, gather_heads, ring_shift, scatter_heads
from .kernels.precision import accumulate_dtype
from .layout import StepKind
from .mesh import CPGroups
from .schedule import RingSchedule, RingStep


def kv_head_repeat(kv_heads: int, ulysses: int) -> int:
    """How often to repeat each KV head so the Ulysses exchange can split them (GQA)."""
    return ulysses // kv_heads if kv_heads < ulysses else 1


def _step_spec(step: RingStep, sched: RingSchedule) -> BlockSpec:
    return BlockSpec(
        step.cu_q, step.cu_k, sched.max_seqlen, sched.max_seqlen, step.kind is StepKind.DIAGONAL,
        sched.scale, sched.window_left, sched.window_right, sched.q_positions, step.k_positions,
        step.cache_key,
    )


def _local_spec(sched: RingSchedule) -> BlockSpec:
    # whole documents: positions inside their segments are positions inside the documents
    return BlockSpec(
        sched.local_cu, sched.local_cu, sched.max_seqlen, sched.max_seqlen, sched.causal,
        sched.scale, sched.window_left, sched.window_right, cache_key=sched.local_cache_key,
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
    """Merged ``(out, lse)`` of the exchange stream's queries: the own step against the whole
    stream, each further step against another ring rank's ring section (the first
    ``ring_width`` rows, all a transfer carries). Pad rows come out as (0, -inf)."""
    ring, rank, steps = groups.ring_size, groups.ring_rank, len(sched.steps)
    kv_heads = kv.shape[1] // 2
    section = (sched.sizes.ring_width, *kv.shape[1:])
    out = lse = incoming = None
    for index, step in enumerate(sched.steps):
        current = kv if index == 0 else arrived(incoming, section)
        # issue the next transfer before this step's compute, so the two can overlap
        if index + 1 < steps:
            ring_section = current.split([section[0], current.shape[0] - section[0]])[0]
            incoming = ring_shift(ring_section, groups.ring_group, rank, ring)
        if step.active:
            k, v = current.split(kv_heads, dim=1)
            block_out, block_lse = run_forward(sched.kernel, q, k, v, _step_spec(step, sched))
            out, lse = merge_partials(out, lse, block_out, block_lse)
    return out.to(q.dtype), lse


def ring_backward(
    dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, sched: RingSchedule,
    groups: CPGroups, carried: Tensor,
) -> tuple[Tensor, Tensor]:
    """``(dq, dkv)`` of the exchange stream. The ring sections' KV travels R-1 hops as in the
    forward; a dKV accumulator of the ring section travels with it, R hops, and arrives back at
    its owner after the last step; the GROUP documents' dKV stays home. Sums of several blocks
    are kept in fp32 (float64 for float64 inputs); a block's own gradient and the finished sum
    travel in the input dtype, which rounds nothing that the result would not."""
    ring, rank, steps = groups.ring_size, groups.ring_rank, len(sched.steps)
    kv_heads = kv.shape[1] // 2
    acc = accumulate_dtype(q.dtype)
    width = sched.sizes.ring_width
    section = (width, *kv.shape[1:])
    dq = incoming = travelling = home = None
    # The KV message carries ``carried``, one value of the backward's incoming gradient, along.
    # Without that dependency on the backward's input, a compiler merges these transfers with
    # the forward's identical ones (or moves them into the forward) and keeps every rank's KV
    # alive until the backward.
    own_section = kv.split([width, kv.shape[0] - width])[0]
    message = torch.cat([own_section.reshape(-1), carried.to(kv.dtype)]) if steps > 1 else None
    for index, step in enumerate(sched.steps):
        if index > 0:
            message = arrived(incoming, message.shape)
        current = kv if index == 0 else message[: own_section.numel()].view(section)
        if index + 1 < steps:
            incoming = ring_shift(message, groups.ring_group, rank, ring)
        dkv = None
        if step.active:
            k, v = current.split(kv_heads, dim=1)
            dq_block, dk_block, dv_block = run_backward(
                sched.kernel, dout, q, k, v, out, lse, _step_spec(step, sched)
            )
            dq = dq_block if dq is None else dq.to(acc) + dq_block
            dkv = torch.cat([dk_block, dv_block], dim=1)
        if index == 0:  # the own step covers the whole stream: its GROUP rows stay home
            dkv, home = dkv.split([width, dkv.shape[0] - width])
        if travelling is not None:
            received = arrived(travelling, section).to(acc)
            dkv = received if dkv is None else received + dkv
        if dkv is None:
            dkv = torch.zeros(section, dtype=kv.dtype, device=kv.device)
        if steps > 1:
            last_hop = index == steps - 1
            travelling = ring_shift(dkv.to(kv.dtype) if last_hop else dkv, groups.ring_group, rank, ring)
        else:
            travelling = dkv
    ring_dkv = arrived(travelling, section) if steps > 1 else travelling
    return dq.to(q.dtype), torch.cat([ring_dkv.to(kv.dtype), home.to(kv.dtype)])


def _split_regions(x: Tensor, sched: RingSchedule) -> tuple[Tensor, Tensor]:
    """A rank's ``[T, ...]`` tensor -> its local region and its exchange region."""
    sizes = sched.sizes
    local, exchange, _pads = x.split([sizes.local, sizes.own_exchange, sizes.pad])
    return local, exchange


def _join_regions(local: Tensor, exchange: Tensor, sched: RingSchedule, dim: int = 0) -> Tensor:
    """Inverse of :func:`_split_regions` along ``dim``, the pad rows zero."""
    shape = list(local.shape)
    shape[dim] = sched.sizes.pad
    return torch.cat([local, exchange, local.new_zeros(shape)], dim=dim)


class HierarchicalAttention(torch.autograd.Function):
    """Local token shards in, local output shard out (and, with ``return_lse``, the local
    ``[Hq, T]`` logsumexp, which is not differentiable); see the module docstring."""

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, sched: RingSchedule, groups: CPGroups,
        return_lse: bool,
    ):
        (q_l, q_x), (k_l, k_x), (v_l, v_x) = (_split_regions(t, sched) for t in (q, k, v))
        out_l, lse_l = run_forward(sched.kernel, q_l, k_l, v_l, _local_spec(sched))
        repeat = kv_head_repeat(k.shape[1], groups.ulysses_size)
        if repeat > 1:
            k_x, v_x = k_x.repeat_interleave(repeat, dim=1), v_x.repeat_interleave(repeat, dim=1)
        ulysses = (groups.ulysses_group, groups.ulysses_size, sched.sizes.exchange)
        q_s = scatter_heads([q_x], *ulysses)
        # k and v travel together, so the ring can send them as one contiguous buffer
        kv_s = scatter_heads([k_x, v_x], *ulysses)
        out_s, lse_s = ring_forward(q_s, kv_s, sched, groups)
        ctx.save_for_backward(q_l, k_l, v_l, out_l, lse_l, q_s, kv_s, out_s, lse_s)
        ctx.sched, ctx.groups, ctx.repeat = sched, groups, repeat
        back = (*ulysses, groups.ulysses_rank)
        (out_x,) = gather_heads(out_s, [out_s.shape[1]], *back)
        out = _join_regions(out_l, out_x, sched)
        if not return_lse:
            return out
        # [H_s, stream] -> [stream, H_s, 1]: the token-major layout gather_heads exchanges
        (lse_x,) = gather_heads(lse_s.t().unsqueeze(-1), [lse_s.shape[0]], *back)
        lse_x = lse_x.squeeze(-1).t()
        pads = lse_l.new_full((lse_l.shape[0], sched.sizes.pad), float("-inf"))
        lse = torch.cat([lse_l, lse_x, pads], dim=1)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, *_grad_lse):
        q_l, k_l, v_l, out_l, lse_l, q_s, kv_s, out_s, lse_s = ctx.saved_tensors
        sched, groups = ctx.sched, ctx.groups
        dout_l, dout_x = _split_regions(dout.contiguous(), sched)
        dq_l, dk_l, dv_l = run_backward(
            sched.kernel, dout_l, q_l, k_l, v_l, out_l, lse_l, _local_spec(sched)
        )
        ulysses = (groups.ulysses_group, groups.ulysses_size, sched.sizes.exchange)
        back = (*ulysses, groups.ulysses_rank)
        dout_s = scatter_heads([dout_x], *ulysses)
        # one value of the rank's whole incoming gradient (whose size is the batch's token
        # count, never data-dependent) for the ring messages to carry
        carried = dout.reshape(-1)[:1]
        dq_s, dkv_s = ring_backward(dout_s, q_s, kv_s, out_s, lse_s, sched, groups, carried)
        (dq_x,) = gather_heads(dq_s, [dq_s.shape[1]], *back)
        dk_x, dv_x = gather_heads(dkv_s, [dkv_s.shape[1] // 2] * 2, *back)
        if ctx.repeat > 1:
            dk_x = dk_x.unflatten(1, (-1, ctx.repeat)).sum(2)
            dv_x = dv_x.unflatten(1, (-1, ctx.repeat)).sum(2)
        grads = (_join_regions(l, x, sched) for l, x in ((dq_l, dq_x), (dk_l, dk_x), (dv_l, dv_x)))
        return (*grads, None, None, None)
