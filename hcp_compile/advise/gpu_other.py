"""The GPU's work besides the attention op: the bytes one rank's eager call moves through
memory in the kernels it runs outside its attention op (``hcp::block_forward`` and
``hcp::block_backward``), counted from its layout as the code runs them, and the seconds that
the constants measured for the device (kernels/gpu_other_measured.json, fitted by
``benchmarks/gpu_other.py``) turn them into.

What is counted, per phase (every count is a read or a write of a whole tensor in its dtype, as
the op sees it; views, ``.contiguous()`` of a contiguous tensor and ``.to`` of the same dtype
are free):

- the Ulysses exchange's packing and unpacking (:func:`collectives.scatter_heads`' strided
  copies into the send buffer, :func:`collectives.join_heads`' copy of the gathered heads, the
  repeat of KV heads where the group has more ranks than KV heads);
- the region join: :func:`hierarchical._join_regions`' pad fill and concatenation of ``out``
  (forward) and of ``dq``, ``dk``, ``dv`` (backward); the split is a view;
- the ring: each step's merge of the partial output (:func:`merge.merge_partials`, one fused
  pass reading both outputs and lse and writing the merged pair), the backward's dq and dKV
  sums (:func:`merge.accumulate`: in place or one fused pass), its ``cat`` of dk and dv, the
  own section's message with the carried element, the final ``cat`` with the GROUP rows.

The attention op's own passes (a kernel's fills, transposes, the ring's K/V halves made
contiguous) are the compute part's: kernels/measured.json timed the op with them
(:func:`kernel_own_bytes` counts cuDNN's, for the measuring command to show).

Bytes rather than kernel launches: the time of these passes at real sizes is their memory
traffic (a merge of a 128K-token stream moves hundreds of MB); a launch's fixed cost is a few
microseconds of GPU time, small beside its host's cost of issuing it, which the host part
already bounds each phase by. One constant per phase, ``seconds = per_byte_s * bytes``,
fitted through the origin on real-size ranks. Covered: causal calls without a window, without
``return_lse`` or ``recompute_exchange`` (the advisor's calls)."""

from __future__ import annotations

from ..kernels.gpu_other_measured import GpuOtherRecord
from ..layout import RankSizes, step_kind, step_sources
from ..precision import accumulate_dtype
from ..schedule import head_groups, kv_head_repeat, rank_kv_heads, schedule_steps
from ..schemes.traffic import CallShape
from ..validation import InputError
from .host import kernel_calls
from .records import GpuOtherBytes, PhaseTimes


def sum_bytes(index: int, steps: int, elements: int, item: int, acc_item: int) -> int:
    """One step's :func:`merge.accumulate` of a block of ``elements`` into the running sum of
    the ring (dq, and the dKV that travels): the first block is taken as it is; the second is
    added to it in one pass that writes the accumulation dtype; later ones in place
    (``add_``); the last step writes the input dtype in one pass."""
    if index == 0:
        return 0
    before = item if index == 1 else acc_item
    after = item if index == steps - 1 else acc_item
    return elements * (before + item + after)


def merge_bytes(index: int, steps: int, rows: int, heads: int, dim: int, item: int, acc_item: int) -> int:
    """Step ``index``'s merge of its partial output into the running one
    (:func:`merge.merge_partials`, the fused pass): the out as :func:`sum_bytes` has a sum
    (the first block's out taken as it is, the last merge writing the input dtype), and both
    lse read and the merged one written."""
    if index == 0:
        return 0
    return sum_bytes(index, steps, rows * heads * dim, item, acc_item) + 3 * rows * heads * acc_item


def cudnn_forward_bytes(rows: int, keys: int, heads_q: int, heads_kv: int, dim: int, item: int, acc_item: int,
                        calls: int, strided_kv: bool, filled: int | None = None) -> int:
    """cuDNN's own passes around one block's forward (:meth:`CudnnKernel.forward`): per call
    the zero-filled output and -inf-filled stats (``filled`` rows of them, all where None),
    merged by lse when several calls, else the stats' transpose made contiguous;
    ``strided_kv``: k and v are made contiguous."""
    if not (rows and keys):
        return 0
    f = acc_item  # the stats and lse
    fills = calls * (rows if filled is None else filled) * heads_q * (dim * item + f)
    tail = (calls - 1) * rows * heads_q * (3 * dim * item + 3 * f) if calls > 1 else 2 * rows * heads_q * f
    return fills + tail + (4 * keys * heads_kv * dim * item if strided_kv else 0)


def cudnn_backward_bytes(rows: int, keys: int, heads_q: int, heads_kv: int, dim: int, item: int, acc_item: int,
                         calls: int, strided_kv: bool, filled: int | None = None) -> int:
    """cuDNN's own passes around one block's backward (:meth:`CudnnKernel.backward`): the lse
    transposed to contiguous stats, per call the zero-filled dq, dk, dv (``filled`` rows of
    each, all where None), the sums of several calls' gradients (dq in one fused pass, dk and
    dv by ``+``); ``strided_kv`` as in :func:`cudnn_forward_bytes`."""
    if not (rows and keys):
        return 0
    f = acc_item  # the stats and lse
    q_elements, kv_elements = rows * heads_q * dim, keys * heads_kv * dim
    fills = calls * ((q_elements + 2 * kv_elements) if filled is None else filled * (heads_q + 2 * heads_kv) * dim) * item
    sums = (calls - 1) * (3 * q_elements + 6 * kv_elements) * item
    return 2 * rows * heads_q * f + fills + sums + (4 * kv_elements * item if strided_kv else 0)


def group_heads(call: CallShape, ulysses: int) -> tuple[int, int, int, int]:
    """``(head groups, query heads, KV heads, KV repeat)`` of one head group of a rank after the
    exchange (repeated KV heads included), as the schedule splits them."""
    repeat = kv_head_repeat(call.heads_kv, ulysses)
    groups = head_groups(rank_kv_heads(call.heads_kv, ulysses), ulysses)
    return groups, call.heads_q // (ulysses * groups), call.heads_kv * repeat // (ulysses * groups), repeat


def gpu_other_bytes(sizes: RankSizes, ring: int, call: CallShape) -> GpuOtherBytes:
    """The bytes the kernels of a rank's eager call that run outside its attention op read and
    write, per phase (the module docstring says what is counted)."""
    if call.returns_lse or call.recompute_exchange:
        raise InputError("call: the GPU-other count covers calls without returns_lse and recompute_exchange "
                         f"(the advisor's), got {call}")
    ulysses = len(sizes.exchange)
    item, acc_item, dim = call.dtype.itemsize, accumulate_dtype(call.dtype).itemsize, call.head_dim
    groups, hq, hkv, repeat = group_heads(call, ulysses)
    own, tokens, stream, width = sizes.own_exchange, sizes.tokens, sizes.stream, sizes.ring_width
    steps = schedule_steps(sizes, ring)
    exchanged = ulysses > 1

    def rows_bytes(rows: int, heads: int) -> int:
        return rows * heads * dim * item

    def join_regions(heads: int) -> int:  # the pad fill, then the cat reads all three and writes T rows
        if not own:  # the local block's outputs hold every row (hierarchical._local_holds_every_row)
            return 0
        return rows_bytes(sizes.pad, heads) + 2 * rows_bytes(tokens, heads)

    # the exchange's send buffers: one strided copy per tensor (q alone skips it without an exchange)
    pack_q = 2 * rows_bytes(own, call.heads_q) if exchanged else 0
    pack_kv = 2 * 2 * rows_bytes(own, call.heads_kv * repeat)
    # repeat_interleave: a copy of the expanded heads (the op reads every repeated element)
    repeat_kv = 2 * 2 * rows_bytes(own, call.heads_kv * repeat) if repeat > 1 else 0

    def join(heads: int, width: int) -> int:
        """:func:`collectives.join_heads` of ``heads`` gathered in groups of ``width`` per rank:
        a copy, but for one group whose ranks' slices are one head wide (a view then)."""
        return 2 * rows_bytes(own, heads) if exchanged and (groups > 1 or width > 1) else 0

    if repeat > 1:  # the repeated heads' gradients summed (one group, one head per rank)
        join_kv = 2 * (rows_bytes(own, call.heads_kv * repeat) + rows_bytes(own, call.heads_kv))
    else:
        join_kv = 2 * join(call.heads_kv, hkv)
    join_q = join(call.heads_q, hq)
    forward = repeat_kv + pack_q + pack_kv + join_q + join_regions(call.heads_q)
    backward = pack_q + join_q + join_kv + join_regions(call.heads_q) + 2 * join_regions(call.heads_kv)

    section = width * 2 * hkv * dim
    ring_f = ring_b = 0  # one head group's ring
    if steps > 1:  # the own section's message with the carried element
        ring_b += 2 * (section + 1) * item
    for index in range(steps):
        keys = stream if index == 0 else width
        ring_f += merge_bytes(index, steps, stream, hq, dim, item, acc_item)
        ring_b += sum_bytes(index, steps, stream * hq * dim, item, acc_item)  # dq
        ring_b += 2 * keys * 2 * hkv * dim * item  # cat of dk and dv
        ring_b += sum_bytes(index, steps, section, item, acc_item)  # the travelling dKV
    ring_b += 2 * stream * 2 * hkv * dim * item  # the ring section's dKV joined with the GROUP rows'
    return GpuOtherBytes(forward + groups * ring_f, backward + groups * ring_b)


def kernel_own_bytes(sizes: RankSizes, ring_rank: int, ring: int, call: CallShape, kernel: str) -> GpuOtherBytes:
    """The bytes of the passes a rank's attention op runs besides its kernels, per phase: for
    cuDNN its fills, lse transposes and merges of split calls (:func:`cudnn_forward_bytes`),
    and in every ring step the copies of the strided K/V halves; 0 for the other kernels,
    whose passes are not counted. Not in the advisor's time: kernels/measured.json's
    throughputs are timed through the op, passes included, on contiguous single-device
    inputs, so only the ring's K/V copies are missing from them (benchmarks/gpu_other.py
    shows these bytes beside the op's profiled non-attention time)."""
    if kernel != "cudnn":
        return GpuOtherBytes()
    ulysses = len(sizes.exchange)
    item, acc_item, dim = call.dtype.itemsize, accumulate_dtype(call.dtype).itemsize, call.head_dim
    groups, hq, hkv, _ = group_heads(call, ulysses)
    stream, steps = sizes.stream, schedule_steps(sizes, ring)
    # the local block covers its rows (cudnn.rows_written) and, where the rank has no exchange
    # region, runs over the pad rows too, which alone are filled
    pads = 0 if sizes.own_exchange else sizes.pad
    local = sizes.local + pads
    calls = kernel_calls(kernel, None)
    forward = cudnn_forward_bytes(local, local, call.heads_q, call.heads_kv, dim, item, acc_item, calls, False, pads)
    backward = cudnn_backward_bytes(local, local, call.heads_q, call.heads_kv, dim, item, acc_item, calls, False,
                                    pads)
    for index, source in enumerate(step_sources(ring_rank, ring, steps)):
        keys = stream if index == 0 else sizes.ring_width
        calls = kernel_calls(kernel, step_kind(ring_rank, source, True))
        forward += groups * cudnn_forward_bytes(stream, keys, hq, hkv, dim, item, acc_item, calls, True)
        backward += groups * cudnn_backward_bytes(stream, keys, hq, hkv, dim, item, acc_item, calls, True)
    return GpuOtherBytes(forward, backward)


def gpu_other_times(moved: GpuOtherBytes, record: GpuOtherRecord | None) -> PhaseTimes:
    """The seconds of ``moved`` at the measured constants; 0 without a record (not modelled)."""
    if record is None:
        return PhaseTimes()
    return PhaseTimes(record.forward.per_byte_s * moved.forward, record.backward.per_byte_s * moved.backward)
