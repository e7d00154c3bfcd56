"""The GPU's work besides the attention kernels: the memory-bound passes of one rank's eager call,
counted in the bytes each reads and writes (from the code that issues them:
``hcp_compile/hierarchical.py``, ``exchange/collectives.py``, ``exchange/schemes/ring.py``,
``kernels/merge.py`` and the block kernels' wrappers), timed at the bytes per second that such
passes reach on the device (:data:`records.PASS_BYTES_PER_S`).

Per phase (every head group's passes together; ``X`` the rank's exchange region, ``S`` the
exchange stream, ``W`` the ring section, ``T`` the rank's tokens; ``h_q``, ``h_kv`` the heads a
rank attends with after the exchange, repeated KV heads included):

- packing: the exchange's send buffers, one strided copy per tensor (``collectives._pack``): q
  (in the backward dout and out) where a Ulysses group or several head groups split it, k and v always
  (two tensors in one buffer); k and v first repeated where a group has more ranks than KV heads;
- joining: the gathered head groups back into the rank's heads (``join_heads``), where a Ulysses
  group or several head groups split them: out; dq, dk and dv (the repeats summed); and the local
  and exchange regions into the rank's rows (``_join_regions``), where the rank has an exchange
  region: out; dq, dk and dv;
- each ring step (the step's queries are the whole stream, its keys the stream on the own step,
  the ring section on the others): from the second active step on, the merge of its partial
  output into the running one (``merge_partials``: the running out in bf16 at first, then fp32,
  the last merge written in bf16) and in the backward the same sum of dq (``accumulate``); the
  step's dk and dv joined into one dKV (``torch.cat``); from the second step on the received dKV
  accumulator plus the step's dKV (fp32 between the first and the last hop); in the backward
  the own ring section's message (with its carried element) once, and the own section's sum
  joined to the GROUP rows (``torch.cat``) once;
- what a kernel's wrapper adds on a ring step's block (its optional ``wrapper_passes``, as
  ``kernels/cudnn.py`` and ``kernels/flex.py`` declare them): contiguous copies of the step's k and v (split
  views of one KV buffer), and cuDNN's initial values of its outputs (written in full where the
  block's segments do not cover every row: every ring step). Single-device calls, which
  kernels/measured.json times, have neither, nor any of the passes above.

The lse's passes (1/64 of the output's bytes or less at head dim 128) are left out. The result
is a :class:`Passes` of bytes; :func:`pass_times` turns it into seconds."""

from __future__ import annotations

from collections.abc import Sequence

from hcp_compile.batch.layout import RankSizes, schedule_steps
from hcp_compile.batch.schedule import exchanged_head_groups, kv_head_repeat
from hcp_compile.batch.traffic import CallShape
from hcp_compile.kernels import KERNELS
from hcp_compile.kernels.contract import COPIES_KV, FILLS_OUTPUTS
from hcp_compile.kernels.precision import accumulate_dtype

from .records import PASS_BYTES_PER_S, BlockWork, Passes



def active_steps(work: BlockWork, ring_rank: int, sizes: RankSizes, ring: int) -> list[bool]:
    """Per step of ring rank ``ring_rank``'s schedule (``layout.schedule_steps``: the own step
    alone without a ring section) whether it computes: whether it has visible pairs (under a
    window a step may have none, and the schedule skips it)."""
    return [bool(p > 0) for p in work.steps[ring_rank].tolist()][:schedule_steps(sizes, ring)]


def _sum_pass(count: int, position: int, item: int, accumulate: int) -> int:
    """Bytes per element of the ``position``-th (from 0) of ``count`` sums of a running result
    and a block's (both in ``item`` bytes at first): read both, write the accumulation dtype,
    the last written in ``item`` bytes (``merge_partials``, ``accumulate``)."""
    running = item if position == 0 else accumulate
    written = item if position == count - 1 else accumulate
    return running + item + written


def pass_bytes(sizes: RankSizes, active: Sequence[bool], call: CallShape, ulysses: int,
               kernel: str) -> Passes:
    """The bytes the memory-bound passes of one rank's eager call read and write (module
    docstring), per phase: ``forward`` and ``backward`` those of the call and its head groups,
    ``step_forward[s]`` and ``step_backward[s]`` those of ring step ``s`` (every head group's).
    ``active``: per step of the rank's schedule (``layout.schedule_steps``) whether it
    computes (a step wholly outside a window does not)."""
    steps = len(active)
    groups = exchanged_head_groups(sizes, steps, call.heads_kv, ulysses)
    item, accumulate = call.dtype.itemsize, accumulate_dtype(call.dtype).itemsize
    dim = call.head_dim
    repeat = kv_head_repeat(call.heads_kv, ulysses)
    heads_q, heads_kv = call.heads_q, call.heads_kv  # the rank's, before the exchange
    rank_q, rank_kv = heads_q // ulysses, heads_kv * repeat // ulysses  # after it
    own, stream, width = sizes.own_exchange, sizes.stream, sizes.ring_width
    forward = backward = 0
    step_forward, step_backward = [0] * steps, [0] * steps
    if groups:
        split = ulysses > 1 or groups > 1  # q, and dout and out, packed; the results joined
        # packing: q, k and v (repeated first: one read, ``repeat`` writes)
        if repeat > 1:
            forward += own * 2 * heads_kv * (1 + repeat) * dim * item
        forward += 2 * own * (heads_q * split + 2 * heads_kv * repeat) * dim * item
        if call.recompute_exchange:  # dout, q, out, k and v in one buffer (only k and v without a group)
            sent = 3 * heads_q + 2 * heads_kv * repeat if ulysses > 1 else 2 * heads_kv * repeat
            backward += 2 * own * sent * dim * item
        else:
            backward += 2 * own * 2 * heads_q * split * dim * item  # dout and out
        if split:  # joining: out; dq, and dk, dv (read with their repeats, written summed)
            forward += 2 * own * heads_q * dim * item
            backward += (2 * own * heads_q + 2 * own * heads_kv * (repeat + 1)) * dim * item
        if steps > 1:  # the own section's first message, with the carried element
            backward += 2 * width * 2 * rank_kv * dim * item
        backward += 2 * stream * 2 * rank_kv * dim * item  # the section's sum joined to the GROUP rows
        extra = getattr(KERNELS.get(kernel), "wrapper_passes", frozenset())
        computed = [s for s in range(steps) if active[s] and stream]
        for position, s in enumerate(computed):
            keys = stream if s == 0 else width
            kv = keys * 2 * rank_kv * dim * item  # the step's k and v (or dk and dv)
            if COPIES_KV in extra:
                step_forward[s] += 2 * kv
                step_backward[s] += 2 * kv
                if call.recompute_exchange and ulysses > 1:  # q and out: views of the received buffer
                    step_backward[s] += 2 * 2 * stream * rank_q * dim * item
            if FILLS_OUTPUTS in extra:
                step_forward[s] += stream * rank_q * dim * item
                step_backward[s] += stream * rank_q * dim * item + kv
            step_backward[s] += 2 * kv  # dk and dv joined
            if position > 0:  # the merge; the sum of dq
                per_element = _sum_pass(len(computed) - 1, position - 1, item, accumulate)
                step_forward[s] += stream * rank_q * dim * per_element
                step_backward[s] += stream * rank_q * dim * per_element
        for s in range(1, steps):  # the received dKV accumulator plus this step's
            received = item if s == 1 else accumulate
            written = item if s == steps - 1 else accumulate
            block = item if active[s] and stream else 0
            step_backward[s] += width * 2 * rank_kv * dim * (received + block + written)
    if own:  # the local and exchange regions joined into the rank's rows (pads written)
        rows = sizes.local + own + sizes.tokens
        forward += rows * heads_q * dim * item
        backward += rows * (heads_q + 2 * heads_kv) * dim * item
    return Passes(float(forward), float(backward), tuple(map(float, step_forward)), tuple(map(float, step_backward)))


def pass_times(sizes: RankSizes, active: Sequence[bool], call: CallShape, ulysses: int, kernel: str,
               bytes_per_s: float = PASS_BYTES_PER_S) -> Passes:
    """:func:`pass_bytes` in seconds at ``bytes_per_s`` (read and written)."""
    return pass_bytes(sizes, active, call, ulysses, kernel).scaled(1 / bytes_per_s)
