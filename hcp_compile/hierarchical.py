"""Hierarchical context-parallel attention of one rank (docs/design.md §3-4): its LOCAL
documents attend on the rank itself with all heads; the rest of its tokens go through the
Ulysses exchange over heads, the ring steps over the ring sections, and the exchange back.
What moves between ranks, and when, is the schedule's collective scheme
(:mod:`hcp_compile.exchange.schemes`); this module decides what is computed and what overlaps what.
Forward and backward are one autograd.Function, because autograd through an unrolled ring
would drop the lse gradients."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from hcp_compile.batch.layout import StepKind
from hcp_compile.batch.schedule import RingSchedule, RingStep
from hcp_compile.exchange.collectives import Issued
from hcp_compile.exchange.mesh import CPGroups
from hcp_compile.exchange.schemes import HeadExchange, KVRing, scheme_named
from hcp_compile.kernels import BlockSpec, run_backward, run_forward
from hcp_compile.kernels.merge import accumulate, merge_partials


def _step_spec(step: RingStep, sched: RingSchedule) -> BlockSpec:
    # the own step (the only causal one) sees its own stream: its segments with queries and keys
    # have as many of each (layout.step_segments), which kernels may use (BlockSpec)
    diagonal = step.kind is StepKind.DIAGONAL
    return BlockSpec(
        step.cu_q, step.cu_k, sched.max_seqlen, sched.max_seqlen, diagonal,
        sched.scale, sched.window_left, sched.window_right, sched.q_positions, step.k_positions,
        step.cache_key, equal_lengths=diagonal,
    )


def _local_spec(sched: RingSchedule) -> BlockSpec:
    # whole documents: positions inside their segments are positions inside the documents
    return BlockSpec(
        sched.local_cu, sched.local_cu, sched.max_seqlen, sched.max_seqlen, sched.causal,
        sched.scale, sched.window_left, sched.window_right, cache_key=sched.local_cache_key,
        covered_rows=sched.sizes.local,  # its documents' rows come first, any pad rows after
    )


def ring_forward(q: Tensor, kv: Tensor, sched: RingSchedule, groups: CPGroups,
                 ring: KVRing) -> tuple[Tensor, Tensor]:
    """Merged ``(out, lse)`` of the exchange stream's queries: the own step against the whole
    stream, each further step against another ring rank's ring section (the first
    ``ring_width`` rows, all the scheme moves), or one gathered step against the keys the
    scheme copies out of every section (``sched.gather_rows``: Note [one gathered step] in
    batch/layout.py). Pad rows come out as (0, -inf)."""
    kv_heads = kv.shape[1] // 2
    out = lse = None
    last = _last_active(sched)
    steps = ring.forward(kv, sched.sizes.ring_width, len(sched.steps), groups, sched.gather_rows)
    for index, step in enumerate(sched.steps):
        current = steps.kv(index)
        if step.active:
            k, v = current.split(kv_heads, dim=1)
            block_out, block_lse = run_forward(sched.kernel, q, k, v, _step_spec(step, sched))
            # the last merge writes the input dtype itself: no separate conversion pass
            out, lse = merge_partials(out, lse, block_out, block_lse,
                                      out_dtype=q.dtype if index == last else None)
            del block_out, block_lse  # merged: not held through the next step's block
    return out.to(q.dtype), lse


def _last_active(sched: RingSchedule) -> int:
    return max(index for index, step in enumerate(sched.steps) if step.active)


def ring_backward(
    dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, sched: RingSchedule,
    groups: CPGroups, carried: Tensor, ring: KVRing,
) -> tuple[Tensor, Tensor]:
    """``(dq, dkv)`` of the exchange stream: each step's block gradient, the keys' part handed
    to the scheme, which returns the ring section's gradient summed over every ring rank; the
    GROUP documents' dKV (the own step's rows past the ring section) stays home. dq sums
    several blocks in fp32 (float64 for float64 inputs)."""
    kv_heads = kv.shape[1] // 2
    width = sched.sizes.ring_width
    dq = home = None
    last = _last_active(sched)
    # ``carried``, one value of the backward's incoming gradient, travels with the keys: without
    # that dependency on the backward's input, a compiler merges these transfers with the
    # forward's identical ones (or moves them into the forward) and keeps every rank's KV
    # alive until the backward
    steps = ring.backward(kv, width, len(sched.steps), groups, carried, sched.gather_rows)
    for index, step in enumerate(sched.steps):
        current = steps.kv(index)
        dkv = None
        if step.active:
            k, v = current.split(kv_heads, dim=1)
            dq_block, dk_block, dv_block = run_backward(
                sched.kernel, dout, q, k, v, out, lse, _step_spec(step, sched)
            )
            dq = accumulate(dq, dq_block, out_dtype=q.dtype if index == last else None)
            dkv = torch.cat([dk_block, dv_block], dim=1)
            del dq_block, dk_block, dv_block  # summed: not held through the next step's block
        if index == 0:  # the own step covers the whole stream: its GROUP rows stay home
            dkv, home = dkv.split([width, dkv.shape[0] - width])
        steps.add(index, dkv)
    return dq.to(q.dtype), torch.cat([steps.result(), home.to(kv.dtype)])


def _repeated_kv(k_x: Tensor, v_x: Tensor, repeat: int) -> tuple[Tensor, Tensor]:
    """The exchange regions of k and v with each head repeated ``repeat`` times where the
    Ulysses group has more ranks than KV heads (every rank then gets one)."""
    if repeat == 1:
        return k_x, v_x
    return k_x.repeat_interleave(repeat, dim=1), v_x.repeat_interleave(repeat, dim=1)


def _scatter_stream(
    heads: HeadExchange, sent: list[Tensor], ulysses: tuple, part: int, parts: int, carried: Tensor,
) -> Issued[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Issue the backward's exchange of head group ``part`` when the forward's exchanged
    tensors were not kept: ``sent`` = the exchange regions of ``[dout, q, out, k, v]``, in one
    all-to-all. The result is ``(dout_s, q_s, out_s, kv_s)``, views of the received buffer
    (the kernels take strided rows; contiguous copies would double the group's memory while
    they are made).

    The gradient goes first: the send buffer's later copies are then written into a buffer
    that holds it, so they depend on the backward's input. Otherwise a compiler's partitioner
    computes the copies of q, out, k and v in the forward, which needs only forward values,
    and saves them: what this mode exists to avoid (the dout element in §4's KV message does
    the same for the ring, docs/design.md §4.1). Without an exchange only k and v are packed,
    side by side for the ring as in the forward, after the gradient's element ``carried``."""
    size = ulysses[1]
    if size == 1:  # the regions are the stream
        kv = heads.scatter(sent[3:], *ulysses, part, parts, after=carried)
        return Issued(kv.pending, lambda kv_s: (*sent[:3], kv.finish(kv_s)), collective=False)
    return _scatter_together(heads, sent, ulysses, part, parts, joined=2)


def _scatter_gradient(
    heads: HeadExchange, sent: list[Tensor], ulysses: tuple, part: int, parts: int, carried: Tensor,
) -> Issued[tuple[Tensor, Tensor]]:
    """Issue the backward's exchange of head group ``part`` when the forward kept the exchanged
    q and KV: ``sent`` = the exchange regions of ``[dout, out]``, in one all-to-all, into
    ``(dout_s, out_s)``. The forward keeps no exchanged copy of the output: the rank's output,
    which the next layer keeps anyway, travels again beside its gradient (docs/design.md §4).
    The gradient goes first into the send buffer, so the output's copy depends on the
    backward's input and a partitioner cannot move it into the forward (as in
    :func:`_scatter_stream`). Without a Ulysses group the regions are the stream: taken as they
    are where there is one head group, else the output's part is packed after ``carried``."""
    size = ulysses[1]
    if size == 1:
        dout_s = heads.scatter(sent[:1], *ulysses, part, parts)
        out_s = heads.scatter(sent[1:], *ulysses, part, parts, after=carried)
        return Issued(dout_s.pending, lambda dout: (dout_s.finish(dout), out_s.wait()), collective=False)
    return _scatter_together(heads, sent, ulysses, part, parts)


def _scatter_together(heads: HeadExchange, sent: list[Tensor], ulysses: tuple, part: int, parts: int,
                      joined: int = 1) -> Issued[tuple[Tensor, ...]]:
    """One all-to-all of head group ``part`` of the exchange regions ``sent``, received as one
    view per tensor, the last ``joined`` side by side in one view (k and v, as the ring sends
    them)."""
    widths = [t.shape[1] // (ulysses[1] * parts) for t in sent]
    widths[len(widths) - joined:] = [sum(widths[len(widths) - joined:])]
    issued = heads.scatter(sent, *ulysses, part, parts)
    return Issued(issued.pending, lambda received: tuple(issued.finish(received).split(widths, dim=1)))


def _split_regions(x: Tensor, sched: RingSchedule) -> tuple[Tensor, Tensor]:
    """A rank's ``[T, ...]`` tensor -> its local region and its exchange region; the local
    region with the pad rows after it (every row) where ``sched.local_holds_every_row``."""
    sizes = sched.sizes
    local, exchange, _pads = x.split([sizes.local, sizes.own_exchange, sizes.pad])
    return (x if sched.local_holds_every_row else local), exchange


def _join_regions(local: Tensor, exchange: Tensor, sched: RingSchedule, dim: int = 0,
                  pad_value: float = 0.0) -> Tensor:
    """Inverse of :func:`_split_regions` along ``dim``, the pad rows ``pad_value``."""
    if sched.local_holds_every_row:
        # its pad rows come out of the block op as rows without keys (BlockSpec.covered_rows),
        # set inside the op: a fill here would be a mutation a compiled graph functionalizes
        return local
    shape = list(local.shape)
    shape[dim] = sched.sizes.pad
    return torch.cat([local, exchange, local.new_full(shape, pad_value)], dim=dim)


class HierarchicalAttention(torch.autograd.Function):
    """Local token shards in, local output shard out (and, with ``return_lse``, the local
    ``[Hq, T]`` logsumexp, which is not differentiable); see the module docstring.

    The heads a rank attends with after the exchange are split into ``G`` head groups
    (:func:`schedule.head_groups`, docs/design.md §3.6), each with its own all-to-alls and its
    own ring: group ``g + 1``'s exchange is issued before group ``g``'s ring computes, and
    group ``g``'s results are sent back as soon as they are computed, so the exchange overlaps
    the attention; group 0's overlaps the local region's.

    For the backward it saves the shards, the output and the logsumexps; with
    ``recompute_exchange`` False also every group's exchanged q and KV, which the backward
    otherwise exchanges again, together with the gradient it sends anyway (docs/design.md
    §4.1). The exchanged output is never kept: it travels again beside its gradient."""

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, sched: RingSchedule, groups: CPGroups,
        return_lse: bool, recompute_exchange: bool = False,
    ):
        (q_l, q_x), (k_l, k_x), (v_l, v_x) = (_split_regions(t, sched) for t in (q, k, v))
        k_x, v_x = _repeated_kv(k_x, v_x, sched.kv_repeat)
        scheme = scheme_named(sched.scheme)
        heads = scheme.heads
        # 0 where nothing is exchanged (a batch of short documents): no collective at all
        parts = sched.head_groups
        ulysses = (groups.ulysses_group, groups.ulysses_size, sched.sizes.exchange)
        back = (*ulysses, groups.ulysses_rank)

        def scatter(part: int) -> tuple[Issued, Issued]:
            # k and v travel together, so the ring can send them as one contiguous buffer
            return (heads.scatter([q_x], *ulysses, part, parts),
                    heads.scatter([k_x, v_x], *ulysses, part, parts))

        incoming = scatter(0) if parts else None  # issued first: the local region's attention hides it
        out_l, lse_l = run_forward(sched.kernel, q_l, k_l, v_l, _local_spec(sched))
        streams, outgoing = [], []
        for part in range(parts):
            arriving = incoming
            if part + 1 < parts:  # the next group's exchange overlaps this group's ring
                incoming = scatter(part + 1)
            q_s, kv_s = (issued.wait() for issued in arriving)
            out_s, lse_s = ring_forward(q_s, kv_s, sched, groups, scheme.ring)
            streams.append((lse_s,) if recompute_exchange else (q_s, kv_s, lse_s))
            # sent back at once
            lse_back = heads.gather(lse_s.t().unsqueeze(-1), *back) if return_lse else None
            outgoing.append((heads.gather(out_s, *back), lse_back))
        # waited only here, where the output is assembled
        out_x = heads.join([out_back.wait() for out_back, _ in outgoing]) if parts else None
        out = _join_regions(out_l, out_x, sched)
        # the joined output rather than out_l: the caller's next layer usually keeps it anyway.
        # q, k and v whole only where the backward exchanges them again or all rows are local:
        # else it reads just their local rows, and a view of those would keep the exchanged
        # rows' storage (in a model, the projection's whole output) alive until the backward
        whole = recompute_exchange or sched.local_holds_every_row
        kept = (q, k, v) if whole else (q_l.clone(), k_l.clone(), v_l.clone())
        _save(ctx, (*kept, out, lse_l), streams)
        ctx.sched, ctx.groups, ctx.parts, ctx.recompute = sched, groups, parts, recompute_exchange
        ctx.whole = whole
        if not return_lse:
            return out
        # the lse travels token-major ([stream, H_s, 1]), as the exchange gathers
        lse_x = heads.join([lse_back.wait() for _, lse_back in outgoing]).squeeze(-1).t() if parts else None
        lse = _join_regions(lse_l, lse_x, sched, dim=1, pad_value=float("-inf"))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, *_grad_lse):
        (q, k, v, out, lse_l), streams = _saved(ctx)
        sched, groups, parts, recompute = ctx.sched, ctx.groups, ctx.parts, ctx.recompute
        repeat = sched.kv_repeat
        scheme = scheme_named(sched.scheme)
        heads = scheme.heads
        dout = dout.contiguous()
        (out_l, out_x), (dout_l, dout_x) = (_split_regions(t, sched) for t in (out, dout))
        if ctx.whole:
            (q_l, q_x), (k_l, k_x), (v_l, v_x) = (_split_regions(t, sched) for t in (q, k, v))
        else:  # the forward kept the local rows only (the exchanged ones are not read again)
            q_l, k_l, v_l = q, k, v
        ulysses = (groups.ulysses_group, groups.ulysses_size, sched.sizes.exchange)
        back = (*ulysses, groups.ulysses_rank)
        # one value of the rank's whole incoming gradient (whose size is the batch's token
        # count, never data-dependent) for the ring messages to carry
        carried = dout.reshape(-1)[:1]
        if recompute:
            sent = [dout_x, q_x, out_x, *_repeated_kv(k_x, v_x, repeat)]

            def scatter(part: int) -> Issued:
                return _scatter_stream(heads, sent, ulysses, part, parts, carried)
        else:
            def scatter(part: int) -> Issued:
                return _scatter_gradient(heads, [dout_x, out_x], ulysses, part, parts, carried)

        incoming = scatter(0) if parts else None  # hidden by the local region
        dq_l, dk_l, dv_l = run_backward(
            sched.kernel, dout_l, q_l, k_l, v_l, out_l, lse_l, _local_spec(sched)
        )
        outgoing = []
        for part in range(parts):
            arriving, incoming = incoming, None  # held no longer than this group's ring
            if part + 1 < parts:  # the next group's exchange overlaps this group's ring
                incoming = scatter(part + 1)
            *kept, lse_s = streams[part]
            streams[part] = None  # the group's exchanged tensors go as soon as its ring is done
            if recompute:
                dout_s, q_s, out_s, kv_s = arriving.wait()
            else:
                (q_s, kv_s), (dout_s, out_s) = kept, arriving.wait()
            dq_s, dkv_s = ring_backward(dout_s, q_s, kv_s, out_s, lse_s, sched, groups, carried,
                                        scheme.ring)
            outgoing.append((heads.gather(dq_s, *back), heads.gather(dkv_s, *back)))
            del arriving, kept, q_s, kv_s, out_s, lse_s, dout_s, dq_s, dkv_s
        dq_x = dk_x = dv_x = None
        if parts:
            dq_x = heads.join([dq_back.wait() for dq_back, _ in outgoing])
            dk_v = [dkv_back.wait().chunk(2, dim=2) for _, dkv_back in outgoing]
            del outgoing
            dk_x = heads.join([dk_s for dk_s, _ in dk_v], repeat)
            dv_x = heads.join([dv_s for _, dv_s in dk_v], repeat)
            del dk_v
        regions = [(dq_l, dq_x), (dk_l, dk_x), (dv_l, dv_x)]
        del dq_l, dq_x, dk_l, dk_x, dv_l, dv_x
        return (*_joined_gradients(regions, sched), None, None, None, None)


def _joined_gradients(regions: list[tuple[Tensor, Tensor | None]], sched: RingSchedule) -> Iterator[Tensor]:
    """Each gradient's regions joined (:func:`_join_regions`) one at a time, a gradient's
    regions released before the next is joined, and no name in the backward's frame bound to a
    result (a frame kept past the call, as a memory profiler's stack keeps it, would hold it)."""
    while regions:
        local, exchange = regions.pop(0)
        joined = _join_regions(local, exchange, sched)
        del local, exchange
        yield joined


def _save(ctx, shards: tuple[Tensor, ...], streams: list[tuple[Tensor, ...]]) -> None:
    """Keep the rank's ``shards`` and each head group's exchanged ``streams`` for the backward.

    Eager autograd holds a Function's saved tensors until its backward returns, so eagerly the
    streams are kept on ``ctx`` instead, where the backward drops each group's once its ring is
    done (docs/design.md §4). Where something else decides what is kept, they go through
    ``save_for_backward``: a traced graph (which frees every tensor after its last use), and
    saved-tensor hooks (activation checkpointing, offloading), which must see them."""
    ctx.shards = len(shards)
    if torch.compiler.is_compiling() or _saved_tensor_hooks_active():
        ctx.save_for_backward(*shards, *(t for group in streams for t in group))
        ctx.groups_saved, ctx.streams = len(streams), None
    else:
        ctx.save_for_backward(*shards)
        ctx.streams = streams


def _saved(ctx) -> tuple[tuple[Tensor, ...], list[tuple[Tensor, ...] | None]]:
    """``(shards, streams)`` as :func:`_save` kept them, the streams in a list the backward may
    empty: taken from ``ctx`` unless autograd keeps the graph for another backward
    (``retain_graph``)."""
    saved = ctx.saved_tensors
    shards, flat = saved[: ctx.shards], saved[ctx.shards :]
    if ctx.streams is not None:
        streams = list(ctx.streams)
        if not torch._C._autograd._get_current_graph_task_keep_graph():  # private, as AOTAutograd asks it
            ctx.streams = None
        return shards, streams
    size = len(flat) // ctx.groups_saved if flat else 1
    return shards, [tuple(flat[i : i + size]) for i in range(0, len(flat), size)]


def _saved_tensor_hooks_active() -> bool:
    # private, the query torch.utils.checkpoint makes (torch 2.11 and 2.14 alike)
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
