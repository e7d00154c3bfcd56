"""Long segments of a block as dense attention calls, the rest through a varlen kernel
(docs/design.md §8.6).

On an H200 with torch 2.11, cuDNN's dense attention (``aten._scaled_dot_product_cudnn_attention``,
what SDPA picks for ``[B, H, T, D]`` tensors) ran fwd+bwd of one causal 131K document at
568 TFLOP/s, against 398 for flex and 330 for flash; but cuDNN's varlen form is slow and wrong
for segments without keys (§8.2). So this kernel cuts a block into pieces:

- a segment with at least ``MIN_DENSE_ROWS`` query and key rows becomes one or two dense calls:
  under the causal mask (aligned bottom-right, the contract's convention) its keys before the
  diagonal are a full rectangle and the rest a top-left causal square, merged by their lse;
  queries before the first visible key see nothing;
- each run of consecutive shorter segments goes, as it is, to the varlen ``SHORT_KERNELS``
  kernel of the device (their rows are contiguous, so nothing is gathered).

The backward runs the same pieces with the merged out and lse (the dense backward ops take
them, so each piece yields its exact share, as every kernel's backward does).
The dense call is cuDNN's on CUDA and ``aten._scaled_dot_product_flash_attention_for_cpu``
on CPU, so that the cutting is tested against the float64 reference on CPU. The segment
boundaries are read on the host (one device sync per block, none for a block whose
``cache_key`` was seen before or whose length bounds ``max_q``/``max_k`` rule out a dense
segment).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..merge import merge_partials_torch
from .contract import BlockRequest, BlockSpec, SpecCache
from .precision import accumulate_dtype

# a segment with fewer query or key rows runs in the varlen kernel: a dense call has a fixed
# cost, and short segments are many (docs/design.md §8.6)
MIN_DENSE_ROWS = 4096
# the varlen kernel for the short segments, per device type
SHORT_KERNELS = {"cuda": "flash", "cpu": "torch"}
CUDA_DTYPES = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# host copies of segment boundaries, kept per BlockSpec.cache_key (the eager schedule's steps)
_boundaries = SpecCache(256)


@dataclass(frozen=True)
class Dense:
    """One dense call: query rows ``q``, key rows ``k`` (block row ranges), top-left causal
    or full."""

    q: slice
    k: slice
    causal: bool


@dataclass(frozen=True)
class Varlen:
    """A run of consecutive short segments ``first:stop``, rows ``q`` and ``k`` of the block."""

    q: slice
    k: slice
    first: int
    stop: int


@dataclass(frozen=True)
class Cut:
    dense: tuple[Dense, ...]
    varlen: tuple[Varlen, ...]


def cut(cu_q: list[int], cu_k: list[int], causal: bool, min_rows: int = MIN_DENSE_ROWS) -> Cut:
    """The pieces of a block of segments ``cu_q``/``cu_k`` (pure; see the module docstring)."""
    dense: list[Dense] = []
    varlen: list[Varlen] = []
    run_start = None
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if min(q1 - q0, k1 - k0) < min_rows:
            run_start = i if run_start is None else run_start
            continue
        if run_start is not None:
            varlen.append(_run(cu_q, cu_k, run_start, i))
            run_start = None
        dense += _dense_pieces(q0, q1, k0, k1, causal)
    if run_start is not None:
        varlen.append(_run(cu_q, cu_k, run_start, len(cu_q) - 1))
    return Cut(tuple(dense), tuple(v for v in varlen if v.q.stop > v.q.start))


def _run(cu_q: list[int], cu_k: list[int], first: int, stop: int) -> Varlen:
    return Varlen(slice(cu_q[first], cu_q[stop]), slice(cu_k[first], cu_k[stop]), first, stop)


def _dense_pieces(q0: int, q1: int, k0: int, k1: int, causal: bool) -> list[Dense]:
    if not causal:
        return [Dense(slice(q0, q1), slice(k0, k1), False)]
    queries, keys = q1 - q0, k1 - k0
    if keys <= queries:  # the first queries - keys rows see no key
        return [Dense(slice(q1 - keys, q1), slice(k0, k1), True)]
    diagonal = k1 - queries  # query row j sees keys up to diagonal + j
    return [Dense(slice(q0, q1), slice(diagonal, k1), True), Dense(slice(q0, q1), slice(k0, diagonal), False)]


class DenseKernel:
    name = "dense"

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
        pieces = _cut(spec)
        if _whole_varlen(pieces, spec):
            return _short_kernel(q).forward(q, k, v, spec)
        if _whole_dense(pieces, q, k):
            out, lse = _dense_forward(q, k, v, pieces.dense[0].causal, spec.scale)
            return out.contiguous(), lse
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=accumulate_dtype(q.dtype),
                         device=q.device)
        for run in pieces.varlen:
            run_out, run_lse = _short_kernel(q).forward(q[run.q], k[run.k], v[run.k], _run_spec(spec, run))
            out[run.q], lse[:, run.q] = run_out, run_lse
        merged: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        for piece in pieces.dense:  # a segment's pieces share its query rows: merged first
            rows = (piece.q.start, piece.q.stop)
            piece_out, piece_lse = _dense_forward(q[piece.q], k[piece.k], v[piece.k], piece.causal, spec.scale)
            if rows in merged:
                piece_out, piece_lse = merge_partials_torch(*merged[rows], piece_out, piece_lse, q.dtype)
            merged[rows] = piece_out, piece_lse
        for (start, stop), (piece_out, piece_lse) in merged.items():
            out[start:stop], lse[:, start:stop] = piece_out, piece_lse
        return out, lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        spec: BlockSpec,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if _all_short(spec):
            return _short_kernel(q).backward(dout, q, k, v, out, lse, spec)
        pieces = _cut(spec)
        if _whole_varlen(pieces, spec):
            return _short_kernel(q).backward(dout, q, k, v, out, lse, spec)
        if _whole_dense(pieces, q, k):
            grads = _dense_backward(dout, q, k, v, out, lse, pieces.dense[0].causal, spec.scale)
            return tuple(g.contiguous() for g in grads)
        # pieces cover disjoint keys, and rows only within one segment's two pieces: written in
        # the inputs' dtypes, only a shared row's two dq summed in the accumulation dtype
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for run in pieces.varlen:
            grads = _short_kernel(q).backward(dout[run.q], q[run.q], k[run.k], v[run.k], out[run.q],
                                              lse[:, run.q], _run_spec(spec, run))
            dq[run.q], dk[run.k], dv[run.k] = grads
        row_grads: dict[tuple[int, int], Tensor] = {}
        for piece in pieces.dense:
            rows, keys = piece.q, piece.k
            grads = _dense_backward(dout[rows], q[rows], k[keys], v[keys], out[rows], lse[:, rows],
                                    piece.causal, spec.scale)
            dk[keys], dv[keys] = grads[1], grads[2]
            shared = (rows.start, rows.stop)
            if shared in row_grads:
                dq[rows] = row_grads.pop(shared).to(accumulate_dtype(q.dtype)) + grads[0]
            else:
                row_grads[shared] = grads[0]
        for (start, stop), grad in row_grads.items():
            dq[start:stop] = grad
        return dq, dk, dv


def _all_short(spec: BlockSpec) -> bool:
    """The length bounds rule out a dense segment: the block goes to the varlen kernel as it
    is, without reading its boundaries (a device sync)."""
    return min(spec.max_q, spec.max_k) < MIN_DENSE_ROWS


def _whole_varlen(pieces: Cut, spec: BlockSpec) -> bool:
    """Every segment is short: the block goes to the varlen kernel as it is (no copies)."""
    return not pieces.dense and (
        not pieces.varlen or pieces.varlen[0].first == 0 and pieces.varlen[0].stop == spec.cu_q.shape[0] - 1)


def _whole_dense(pieces: Cut, q: Tensor, k: Tensor) -> bool:
    """The block is one dense call over all its rows and keys (one document)."""
    if pieces.varlen or len(pieces.dense) != 1:
        return False
    piece = pieces.dense[0]
    return (piece.q.start, piece.q.stop, piece.k.start, piece.k.stop) == (0, q.shape[0], 0, k.shape[0])


def _short_kernel(q: Tensor):
    from . import KERNELS  # the registry imports this module

    return KERNELS[SHORT_KERNELS[q.device.type]]


def _cut(spec: BlockSpec) -> Cut:
    if spec.windowed:
        raise ValueError("the dense kernel was given a windowed block; kernel resolution refuses that")
    return cut(*_boundaries.get(spec, (), lambda: _host_boundaries(spec)), spec.causal, MIN_DENSE_ROWS)


def _host_boundaries(spec: BlockSpec) -> tuple[list[int], list[int]]:
    """``cu_q`` and ``cu_k`` as host lists, in one device-to-host copy (one sync)."""
    both = torch.cat([spec.cu_q, spec.cu_k]).tolist()
    return both[: spec.cu_q.shape[0]], both[spec.cu_q.shape[0] :]


def _run_spec(spec: BlockSpec, run: Varlen) -> BlockSpec:
    """The spec of a run of short segments, its boundaries relative to the run's first rows."""
    cu_q = spec.cu_q[run.first : run.stop + 1] - run.q.start
    cu_k = spec.cu_k[run.first : run.stop + 1] - run.k.start
    return BlockSpec(cu_q, cu_k, spec.max_q, spec.max_k, spec.causal, spec.scale)


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
