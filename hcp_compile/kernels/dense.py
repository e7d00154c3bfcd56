"""Long segments of a block as dense attention calls, the rest through a varlen kernel
(docs/design.md §8.6).

cuDNN's dense attention (``aten._scaled_dot_product_cudnn_attention``, what SDPA picks for
``[B, H, T, D]`` tensors) is the fastest kernel on long causal documents, but cuDNN's varlen
form is slow and wrong for segments without keys (§8.2), and cuDNN builds a graph for every
new shape, which a batch with new document lengths every step would pay on every step
(docs/design.md §8.6 has the measurements). So this kernel cuts a block into pieces whose
dense calls come in a bounded set of shapes:

- a segment with at least ``MIN_DENSE_ROWS`` query and key rows gets dense calls whose sizes
  have at most ``DENSE_SIZE_BITS`` significant bits (``dense_rows``). A causal segment (aligned
  bottom-right) is a causal square, made on its rows rounded up: the rows after the segment
  (the next segments', or zeros past the block) are computed and dropped, and the keys after
  it are seen only by them, so the call is exact for the segment's own rows. Its backward
  gives those rows a huge lse, so their softmax weights are 0 and they add nothing to dk and
  dv. Where there are more keys than queries, the keys before the diagonal are a full
  rectangle; a full rectangle is a call on its rows rounded up and its keys rounded down
  (keys past it would be seen), the keys left over (fewer than one in 32) varlen;
- the other segments go, as they are, to the varlen ``SHORT_KERNELS`` kernel of the device:
  each run of varlen segments whose query and key rows follow each other is one varlen call
  on those rows, with no rows gathered.

A row that several pieces cover gets their outputs merged by lse and their dq summed (a
segment's pieces split its keys). The backward runs the same pieces with the merged out and lse (the
dense backward ops take them, so each piece yields its exact share, as every kernel's
backward does). The dense call is cuDNN's on CUDA and
``aten._scaled_dot_product_flash_attention_for_cpu`` on CPU, so that the cutting is tested
against the float64 reference on CPU. The segment boundaries are read on the host (one device
sync per block, none for a block whose ``cache_key`` was seen before or whose length bounds
``max_q``/``max_k`` rule out a dense segment); the varlen runs' boundaries go back to the
device from pinned memory, without a sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from hcp_compile.kernels.contract import BLOCK_MEMOS
from hcp_compile.kernels.contract import HOST_READS, BlockRequest, BlockSpec
from hcp_compile.kernels.flash import FlashKernel
from hcp_compile.kernels.merge import accumulate, merge_partials
from hcp_compile.kernels.precision import accumulate_dtype
from hcp_compile.kernels.torch_kernel import TorchKernel

# a segment with fewer query or key rows runs in the varlen kernel: a dense call has a fixed
# cost, and short segments are many (docs/design.md §8.6)
MIN_DENSE_ROWS = 2048
# dense calls have row and key counts of at most this many significant bits (32 sizes per
# octave), so cuDNN builds a bounded number of graphs however the batches' lengths vary, at
# the price of computing up to 1/32 more rows (docs/design.md §8.6)
DENSE_SIZE_BITS = 6
# a stripe (a full rectangle's keys left over: few keys, many queries) is cut into segments of
# this many query rows, at most STRIPE_PARTS of them (each copies the keys)
STRIPE_ROWS = 1024
STRIPE_PARTS = 16
# the varlen kernel for the short segments, per device type
SHORT_KERNELS = {"cuda": FlashKernel(), "cpu": TorchKernel()}
CUDA_DTYPES = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# the cuts of blocks kept per BlockSpec.cache_key (the eager schedule's steps, a batch's layers)
CACHED_PLANS = 256


@dataclass(frozen=True)
class Dense:
    """One dense call for query rows ``q`` and key rows ``k`` (block row ranges), top-left
    causal or full, made on ``rows`` query rows from ``q.start`` (the rows after ``q`` are
    computed and dropped) and, causal, as many keys from ``k.start`` (the keys after ``k`` are
    seen only by those rows)."""

    q: slice
    k: slice
    causal: bool
    rows: int

    @property
    def keys(self) -> int:
        """The call's key count."""
        return self.rows if self.causal else self.k.stop - self.k.start


@dataclass(frozen=True)
class Varlen:
    """One varlen call: query rows ``q`` and key rows ``k`` of the block, cut into segments by
    ``cu_q``/``cu_k`` (relative to the rows' starts), causal (aligned bottom-right) or full."""

    q: slice
    k: slice
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    causal: bool
    # a stripe: the keys ``k`` given this many times over, one copy per segment
    repeat: int = 1


@dataclass(frozen=True)
class Cut:
    dense: tuple[Dense, ...]
    varlen: tuple[Varlen, ...]


def dense_rows(rows: int, bits: int = DENSE_SIZE_BITS, up: bool = False) -> int:
    """``rows`` rounded down (``up``: up) to ``bits`` significant bits."""
    step = 1 << max(rows.bit_length() - bits, 0)
    return rows - rows % step + (step if up and rows % step else 0)


def cut(cu_q: list[int], cu_k: list[int], causal: bool, min_rows: int = MIN_DENSE_ROWS,
        bits: int = DENSE_SIZE_BITS, stripe_rows: int = STRIPE_ROWS) -> Cut:
    """The pieces of a block of segments ``cu_q``/``cu_k`` (pure; see the module docstring)."""
    pieces = _Pieces(min_rows, bits, stripe_rows)
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if min(q1 - q0, k1 - k0) < min_rows:
            pieces.varlen(q0, q1, k0, k1, causal)
        elif not causal:
            pieces.rectangle(q0, q1, k0, k1)
        else:
            pieces.causal(q0, q1, k0, k1)
    return pieces.cut()


class _Pieces:
    """The pieces of a block as :func:`cut` adds them, segment by segment."""

    def __init__(self, min_rows: int, bits: int, stripe_rows: int) -> None:
        self.min_rows, self.bits, self.stripe_rows = min_rows, bits, stripe_rows
        self.dense: list[Dense] = []
        self.runs: list[tuple[bool, list[tuple[int, int, int, int]]]] = []  # causal, segments (q0, q1, k0, k1)
        self.stripes: list[Varlen] = []

    def varlen(self, q0: int, q1: int, k0: int, k1: int, causal: bool) -> None:
        """A varlen segment: it extends the last run where its rows follow that run's."""
        if self.runs and self.runs[-1][0] == causal and self.runs[-1][1][-1][1::2] == (q0, k0):
            self.runs[-1][1].append((q0, q1, k0, k1))
        else:
            self.runs.append((causal, [(q0, q1, k0, k1)]))

    def rectangle(self, q0: int, q1: int, k0: int, k1: int) -> None:
        """Every query sees every key: one dense call on the queries and the first keys, the
        later keys (fewer than one in 32) a stripe; too short a rectangle all varlen."""
        if min(q1 - q0, k1 - k0) < self.min_rows:
            self.varlen(q0, q1, k0, k1, False)
            return
        keys = dense_rows(k1 - k0, self.bits)
        self.dense.append(Dense(slice(q0, q1), slice(k0, k0 + keys), False, dense_rows(q1 - q0, self.bits, up=True)))
        if k0 + keys < k1:
            self.stripe(q0, q1, k0 + keys, k1)

    def stripe(self, q0: int, q1: int, k0: int, k1: int) -> None:
        """Many queries against a few keys, every pair visible: the queries cut into parts of
        at most ``stripe_rows``, each a segment with its own copy of the keys. The varlen
        kernels' backward runs one program per key block over all its queries: for a few
        keys a long serial loop on a few multiprocessors, which the copies share out."""
        parts = min(-(-(q1 - q0) // self.stripe_rows), STRIPE_PARTS)
        step = -(-(q1 - q0) // parts)
        cu_q = tuple(min(i * step, q1 - q0) for i in range(parts + 1))
        cu_k = tuple(i * (k1 - k0) for i in range(parts + 1))
        self.stripes.append(Varlen(slice(q0, q1), slice(k0, k1), cu_q, cu_k, False, parts))

    def causal(self, q0: int, q1: int, k0: int, k1: int) -> None:
        """Aligned bottom-right: query ``j`` sees the keys up to ``k1 - q1 + j``. Fewer keys
        than queries: the first queries see none. More: the keys before the diagonal are a
        rectangle; the rest is a causal square, one dense call."""
        if k1 - k0 < q1 - q0:
            q0 = q1 - (k1 - k0)
        diagonal = k1 - (q1 - q0)
        if diagonal > k0:
            self.rectangle(q0, q1, k0, diagonal)
        self.dense.append(Dense(slice(q0, q1), slice(diagonal, k1), True, dense_rows(q1 - q0, self.bits, up=True)))

    def cut(self) -> Cut:
        varlen = []
        for causal, run in self.runs:
            (q0, _, k0, _), (_, q1, _, k1) = run[0], run[-1]
            cu_q = (0, *(stop - q0 for _, stop, _, _ in run))
            cu_k = (0, *(stop - k0 for _, _, _, stop in run))
            if q1 > q0:  # a run without queries computes nothing
                varlen.append(Varlen(slice(q0, q1), slice(k0, k1), cu_q, cu_k, causal))
        return Cut(tuple(self.dense), (*varlen, *self.stripes))


@dataclass(frozen=True)
class _Plan:
    """A block's cut, the varlen runs' boundaries on the block's device, which pieces share
    rows with a piece before them (in the order the pieces run: the varlen runs, then the
    dense calls), and whether the pieces write every row and every key (then the results need
    no zeros first)."""

    cut: Cut
    run_cu: tuple[tuple[Tensor, Tensor], ...]
    shared_rows: tuple[bool, ...]
    whole_varlen: bool
    whole_dense: bool
    fills_rows: bool
    fills_keys: bool

    def pieces(self) -> Iterator[tuple[Dense | Varlen, tuple[Tensor, Tensor] | None, bool]]:
        """``(piece, its boundaries on the device (None for a dense call), shares rows)`` in the
        order the pieces run. Keys are never shared: a segment's pieces split its keys."""
        boundaries = (*self.run_cu, *(None for _ in self.cut.dense))
        return zip((*self.cut.varlen, *self.cut.dense), boundaries, self.shared_rows)


def _plan(spec: BlockSpec, q_rows: int, k_rows: int) -> _Plan:
    cu_q, cu_k = _host_boundaries(spec)
    pieces = cut(cu_q, cu_k, spec.causal, MIN_DENSE_ROWS, DENSE_SIZE_BITS, STRIPE_ROWS)
    ordered = (*pieces.varlen, *pieces.dense)
    only = ordered[0] if len(ordered) == 1 else None
    everything = (0, q_rows, 0, k_rows)
    return _Plan(
        pieces, _on_device([(run.cu_q, run.cu_k) for run in pieces.varlen], spec.cu_q.device),
        _shared([piece.q for piece in ordered]),
        fills_rows=_fills([piece.q for piece in ordered], q_rows),
        fills_keys=_fills([piece.k for piece in ordered], k_rows),
        whole_varlen=not pieces.dense and (not pieces.varlen or isinstance(only, Varlen)
                                           and _span(only) == everything),
        whole_dense=isinstance(only, Dense) and _span(only) == everything and only.rows == q_rows
        and only.keys == k_rows,
    )


def _span(piece: Dense | Varlen) -> tuple[int, int, int, int]:
    return piece.q.start, piece.q.stop, piece.k.start, piece.k.stop


def _shared(ranges: list[slice]) -> tuple[bool, ...]:
    """Per range, whether it meets one before it."""
    return tuple(any(r.start < s.stop and s.start < r.stop for s in ranges[:i]) for i, r in enumerate(ranges))


def _fills(ranges: list[slice], total: int) -> bool:
    """Whether pieces writing ``ranges`` in this order write all of ``[0, total)`` before any
    piece merges with what is there: every range that meets an earlier one lies inside their
    union (a merge with rows no piece wrote would read uninitialized memory)."""
    union: list[tuple[int, int]] = []  # disjoint and not touching, so a range inside it is inside one
    for r in ranges:
        if r.start == r.stop:
            continue
        meets = any(r.start < b and a < r.stop for a, b in union)
        if meets and not any(a <= r.start and r.stop <= b for a, b in union):
            return False
        touching = [(a, b) for a, b in union if r.start <= b and a <= r.stop]
        low, high = min([r.start, *(a for a, _ in touching)]), max([r.stop, *(b for _, b in touching)])
        union = sorted([*(iv for iv in union if iv not in touching), (low, high)])
    return total == 0 or union == [(0, total)]


def _on_device(boundaries: list[tuple[tuple[int, ...], tuple[int, ...]]],
               device: torch.device) -> tuple[tuple[Tensor, Tensor], ...]:
    """The runs' ``cu_q``/``cu_k`` as int32 tensors on ``device``, in one copy from pinned
    memory, queued without waiting for the device (from pageable memory the copy would wait
    for everything queued before it)."""
    flat = [value for pair in boundaries for cu in pair for value in cu]
    if not flat:
        return ()
    host = torch.tensor(flat, dtype=torch.int32)
    values = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    # the varlen kernel then knows where the runs' segments end (each run's rows: they cover
    # them), and needs no pass on the device for rows past them (BlockSpec.segment_ends)
    HOST_READS.put_table(values, host)
    sizes = [len(cu) for pair in boundaries for cu in pair]
    parts = values.split(sizes)
    return tuple(zip(parts[::2], parts[1::2]))


def _repeated(run: Varlen, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The run's keys and values, given ``run.repeat`` times over (copies only then)."""
    keys = run.k
    if run.repeat == 1:
        return k[keys], v[keys]
    return k[keys].repeat(run.repeat, 1, 1), v[keys].repeat(run.repeat, 1, 1)


def _summed_copies(grad: Tensor, repeat: int) -> Tensor:
    """The gradient of keys given ``repeat`` times over, summed per key."""
    if repeat == 1:
        return grad
    return grad.unflatten(0, (repeat, -1)).sum(0, dtype=accumulate_dtype(grad.dtype)).to(grad.dtype)


def _run_spec(spec: BlockSpec, run: Varlen, cu: tuple[Tensor, Tensor]) -> BlockSpec:
    def longest(bounds: tuple[int, ...]) -> int:
        return max(1, *(b - a for a, b in zip(bounds, bounds[1:])))

    return BlockSpec(cu[0], cu[1], longest(run.cu_q), longest(run.cu_k), run.causal, spec.scale)


class DenseKernel:
    name = "dense"
    masks_by_position = False
    short_segment_rows = MIN_DENSE_ROWS  # shorter segments go through flash

    def supports(self, request: BlockRequest) -> str | None:
        device = request.device.type
        if device == "cuda":
            if request.dtype not in CUDA_DTYPES or request.head_dim % 8 or request.head_dim > 128:
                return (f"needs fp16/bf16 CUDA tensors with head_dim a multiple of 8 and at most 128 "
                        f"(cuDNN); got {request.dtype} with head_dim {request.head_dim}")
        elif device == "cpu":
            if request.dtype not in CPU_DTYPES:
                return f"needs fp32, float64 or bf16 tensors on CPU; got {request.dtype}"
        else:
            return f"needs CUDA or CPU tensors; got {request.device}"
        if request.window != (-1, -1):
            return "cannot apply a sliding window (its dense calls mask only causally)"
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: BlockSpec) -> tuple[Tensor, Tensor]:
        if _all_short(spec):
            return _short_kernel(q).forward(q, k, v, spec)
        plan = _cached_plan(spec, q, k)
        if plan.whole_varlen:
            return _short_kernel(q).forward(q, k, v, spec)
        if plan.whole_dense:
            out, lse = _dense_forward(q, k, v, plan.cut.dense[0].causal, spec.scale)
            return out.contiguous(), lse.contiguous()
        out = _results(q, plan.fills_rows)
        lse = _results(q, plan.fills_rows, (q.shape[1], q.shape[0]), accumulate_dtype(q.dtype), float("-inf"))
        for piece, cu, shared in plan.pieces():  # one piece's result alive at a time
            rows = piece.q
            if cu is None:
                piece_out, piece_lse = _dense_piece_forward(q, k, v, piece, spec.scale)
            else:
                piece_out, piece_lse = _short_kernel(q).forward(
                    q[rows], *_repeated(piece, k, v), _run_spec(spec, piece, cu))
            if shared:  # rows another piece saw too: merged by their lse (on CUDA into out's rows)
                piece_out, piece_lse = merge_partials(out[rows], lse[:, rows], piece_out, piece_lse, q.dtype)
            out[rows], lse[:, rows] = piece_out, piece_lse  # copy_ skips a result already in place
        return out, lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        spec: BlockSpec,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if _all_short(spec):
            return _short_kernel(q).backward(dout, q, k, v, out, lse, spec)
        plan = _cached_plan(spec, q, k)
        if plan.whole_varlen:
            return _short_kernel(q).backward(dout, q, k, v, out, lse, spec)
        if plan.whole_dense:
            grads = _dense_backward(dout, q, k, v, out, lse, plan.cut.dense[0].causal, spec.scale)
            return tuple(g.contiguous() for g in grads)
        # written in the inputs' dtypes; a row that several pieces cover has each piece's dq
        # added in the accumulation dtype (a whole-block fp32 accumulator costs more time and
        # memory on log-uniform documents)
        dq = _results(q, plan.fills_rows)
        dk, dv = _results(k, plan.fills_keys), _results(v, plan.fills_keys)
        for piece, cu, shared in plan.pieces():
            rows, keys = piece.q, piece.k
            if cu is None:
                grads = _dense_piece_backward(dout, q, k, v, out, lse, piece, spec.scale)
            else:
                dq_run, *dkv = _short_kernel(q).backward(dout[rows], q[rows], *_repeated(piece, k, v), out[rows],
                                                         lse[:, rows], _run_spec(spec, piece, cu))
                grads = (dq_run, *(_summed_copies(g, piece.repeat) for g in dkv))
            dq[rows] = accumulate(dq[rows], grads[0], q.dtype) if shared else grads[0]
            dk[keys], dv[keys] = grads[1], grads[2]
        return dq, dk, dv


def _results(like: Tensor, filled: bool, shape: tuple[int, ...] | None = None,
             dtype: torch.dtype | None = None, unwritten: float = 0.0) -> Tensor:
    """A contiguous tensor (``like``'s shape and dtype unless given) for results the pieces
    write: uninitialized when they write all of it (``filled``), else ``unwritten`` throughout
    (what the rows or keys no piece writes must hold)."""
    result = like.new_empty(like.shape if shape is None else shape, dtype=dtype)
    return result if filled else result.fill_(unwritten)


def _all_short(spec: BlockSpec) -> bool:
    """The length bounds rule out a dense segment: the block goes to the varlen kernel as it
    is, without reading its boundaries (a device sync)."""
    return min(spec.max_q, spec.max_k) < MIN_DENSE_ROWS


def _short_kernel(q: Tensor) -> FlashKernel | TorchKernel:
    return SHORT_KERNELS[q.device.type]


def _cached_plan(spec: BlockSpec, q: Tensor, k: Tensor) -> _Plan:
    if spec.windowed:
        raise ValueError("the dense kernel was given a windowed block; kernel resolution refuses that")
    rows = (q.shape[0], k.shape[0])
    plans = BLOCK_MEMOS.memo("dense plans", CACHED_PLANS)
    return plans.get(spec, (*rows, MIN_DENSE_ROWS, DENSE_SIZE_BITS, STRIPE_ROWS), lambda: _plan(spec, *rows))


def _host_boundaries(spec: BlockSpec) -> tuple[list[int], list[int]]:
    """``cu_q`` and ``cu_k`` as host lists, in one device-to-host copy (one sync)."""
    both = torch.cat([spec.cu_q, spec.cu_k]).tolist()
    return both[: spec.cu_q.shape[0]], both[spec.cu_q.shape[0] :]


def _call_rows(x: Tensor, rows: slice, count: int, zeros_after: bool = True) -> Tensor:
    """``count`` rows of ``x`` from ``rows.start``: the piece's ``rows``, then zeros (a copy),
    or with ``zeros_after`` False the block's next rows as they are (zeros past its end; a
    copy only then)."""
    real = (rows.stop if zeros_after else rows.start + count) - rows.start
    taken = x[rows.start : rows.start + real]
    if taken.shape[0] == count:
        return taken
    call = x.new_empty((count, *x.shape[1:]))  # one copy and one fill, no zeros read back
    call[: taken.shape[0]].copy_(taken)
    call[taken.shape[0] :].zero_()
    return call


def _dense_piece_forward(q: Tensor, k: Tensor, v: Tensor, piece: Dense, scale: float) -> tuple[Tensor, Tensor]:
    """A piece's dense call, the results of its own rows. Its keys past the piece are zeros:
    no row of the piece sees them, but a product of a masked weight, 0, with a non-finite
    value of another segment would still be NaN (its rows past the piece may read the block's
    next rows: their results are dropped)."""
    rows, keys = piece.q, piece.k
    out, lse = _dense_forward(_call_rows(q, rows, piece.rows, zeros_after=False), _call_rows(k, keys, piece.keys),
                              _call_rows(v, keys, piece.keys), piece.causal, scale)
    count = rows.stop - rows.start
    return out[:count], lse[:, :count]


# the lse given to the dense backward for the rows a call computes beyond its piece's (zeros):
# their softmax weights exp(s - lse) are then 0, so they add nothing to dk and dv
_DROPPED_ROW_LSE = 1e30


def _dense_piece_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, piece: Dense, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """A piece's dense call backward: dq of its rows, dk and dv of its keys, every row and key
    past the piece zeros (no other segment's value reaches them)."""
    rows, keys = piece.q, piece.k
    count = rows.stop - rows.start
    call_lse = lse[:, rows]
    if piece.rows > count:
        call_lse = torch.cat([call_lse, call_lse.new_full((lse.shape[0], piece.rows - count), _DROPPED_ROW_LSE)], 1)
    dq, dk, dv = _dense_backward(
        *(_call_rows(x, rows, piece.rows) for x in (dout, q)), *(_call_rows(x, keys, piece.keys) for x in (k, v)),
        _call_rows(out, rows, piece.rows), call_lse, piece.causal, scale)
    key_count = keys.stop - keys.start
    return dq[:count], dk[:key_count], dv[:key_count]


def _heads_first(x: Tensor) -> Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D], a view


def _tokens_first(x: Tensor) -> Tensor:
    return x[0].transpose(0, 1)


def _repeat_kv(k: Tensor, heads_q: int) -> Tensor:
    return k.repeat_interleave(heads_q // k.shape[1], dim=1) if k.shape[1] != heads_q else k


def _dense_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``(out [Tq, Hq, D], lse [Hq, Tq])`` of one dense call (tokens-first in and out)."""
    if q.device.type == "cuda":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _heads_first(q), _heads_first(k), _heads_first(v), None, True, 0.0, causal, False, scale=scale)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _heads_first(q), _heads_first(_repeat_kv(k, q.shape[1])), _heads_first(_repeat_kv(v, q.shape[1])),
            0.0, causal, scale=scale)
    return _tokens_first(out), lse.reshape(q.shape[1], q.shape[0]).to(accumulate_dtype(q.dtype))


def _dense_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One dense call's gradients given the merged ``out`` and ``lse`` of its rows."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    if q.device.type == "cuda":
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unused
        # torch caches cuDNN's backward graph by q, k and v's sizes and strides, not out's,
        # dout's or the lse's: those always come in one layout (contiguous), or a graph built
        # for one layout reads another's values wrong (docs/design.md §8.6)
        dout, out = dout.contiguous(), out.contiguous()
        stats = lse.float().contiguous().reshape(1, heads, q.shape[0], 1)
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _heads_first(dout), _heads_first(q), _heads_first(k), _heads_first(v), _heads_first(out),
            stats, seed, offset, None, None, None, q.shape[0], k.shape[0], 0.0, causal, scale=scale)
        return tuple(_tokens_first(g) for g in grads)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _heads_first(dout), _heads_first(q), _heads_first(_repeat_kv(k, heads)),
        _heads_first(_repeat_kv(v, heads)), _heads_first(out), lse.reshape(1, heads, q.shape[0]), 0.0, causal,
        scale=scale)
    reduce = lambda g: _tokens_first(g).unflatten(1, (k.shape[1], group)).sum(2)  # noqa: E731
    return _tokens_first(dq), reduce(dk), reduce(dv)
