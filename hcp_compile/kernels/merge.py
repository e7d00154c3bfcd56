"""The ring's elementwise passes fused (docs/design.md §3.4, §4): the merge of a block's
partial softmax result into the running one, and the fp32 sums of the backward.

Eagerly on CUDA (fp16/bf16/fp32 outputs, fp32 lse) the merge is ONE Triton kernel that reads
the running ``(out, lse)`` and the block's and writes the merged pair, into the running
buffers when they are already fp32 (only the first merge allocates the fp32 accumulator), and
on the last step optionally straight in the input dtype (``out_dtype``). On CPU, for float64
or anything else unusual, it is the plain torch expression.

Under tracing (``torch.compiler.is_compiling()``, or any dispatch mode) each merge and each sum
is one opaque op, ``hcp::merge_step`` and ``hcp::accumulate_step``, which runs the same code
on new tensors. As torch expressions, Inductor fused a ring's chain of merges (and of dq sums)
into one region at the end, which reads every step's block result: all of them stayed alive
until the last step (docs/benchmarks.md, "Merges and sums as ops"). An op's
result is a buffer of its own, and the block result it read is freed after it.

Both functions CONSUME their running arguments: ``merge_partials``'s ``out`` and ``lse`` and
``accumulate``'s ``acc`` may be overwritten and returned; the caller must own them (the ring
does: they are its kernels' fresh outputs or its own earlier results) and use only what is
returned."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from hcp_compile.kernels.precision import accumulate_dtype

try:  # the module works without Triton: the torch expressions are used everywhere then
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = tl = None

_KERNEL_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KERNEL_DEVICES = ("cuda",)  # where merge_partials and accumulate launch the kernels
# elements of out per program of the merge kernel (a [BLOCK_T, BLOCK_D] tile of one head)
_TILE_ELEMENTS = 4096
_ADD_BLOCK = 4096


# --------------------------------------------------------------------------------------------
# the merge
# --------------------------------------------------------------------------------------------

def merge_partials(
    out: Tensor | None, lse: Tensor | None, block_out: Tensor, block_lse: Tensor,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Merge a block's partial softmax result into the running one, in the lse's precision
    (fp32, or float64 for float64 inputs); rows seen by neither stay (0, -inf). The first
    block is taken as it is, so a one-step ring converts nothing.

    ``out`` ``[T, H, D]`` (None before the first block), ``lse`` ``[H, T]`` natural log, -inf
    for a row with no visible key; the block's pair likewise. Returns ``(out, lse)`` with
    ``lse = logaddexp(lse, block_lse)`` and ``out = out·exp(lse_old − lse) +
    block_out·exp(block_lse − lse)`` (weights 0 where the merged lse is not finite), ``out``
    in the promoted dtype of the four inputs (fp32 for fp16/bf16/fp32 outputs with fp32 lse).

    ``out_dtype``: the dtype of the returned ``out``, the same as ``.to(out_dtype)`` of the
    result but written in that dtype by the merge itself (the ring's last step: no separate
    conversion pass); None keeps the merge's dtype. For the first block it is
    ``block_out.to(out_dtype)``.

    ``out`` and ``lse`` are consumed (see the module docstring)."""
    if out is None:
        return (block_out if out_dtype is None else block_out.to(out_dtype)), block_lse
    if _traced():
        return merge_step(out, lse, block_out, block_lse, out_dtype)
    if _triton_merge_applies(out, lse, block_out, block_lse, out_dtype):
        return merge_partials_triton(out, lse, block_out, block_lse, out_dtype)
    return merge_partials_torch(out, lse, block_out, block_lse, out_dtype)


@torch.library.custom_op("hcp::merge_step", mutates_args=())
def merge_step(
    out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor, out_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:
    """:func:`merge_partials` of two blocks as one op of a traced graph, into new tensors (an
    op's outputs may not alias its inputs): see the module docstring."""
    if _triton_merge_applies(out, lse, block_out, block_lse, out_dtype):
        return merge_partials_triton(out, lse, block_out, block_lse, out_dtype, in_place=False)
    # contiguous, as the fake results are: a compiled graph checks an op's strides
    return tuple(t.contiguous() for t in merge_partials_torch(out, lse, block_out, block_lse, out_dtype))


@merge_step.register_fake
def _(out, lse, block_out, block_lse, out_dtype):
    merged_dtype = functools.reduce(torch.promote_types, (out.dtype, block_out.dtype, lse.dtype, block_lse.dtype))
    return (out.new_empty(torch.broadcast_shapes(out.shape, block_out.shape), dtype=out_dtype or merged_dtype),
            lse.new_empty(torch.broadcast_shapes(lse.shape, block_lse.shape),
                          dtype=torch.promote_types(lse.dtype, block_lse.dtype)))


def merge_partials_torch(
    out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """The merge as torch ops (not in place): the eager path off CUDA, and the traced op's
    off CUDA."""
    merged = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(merged)
    reference = torch.where(finite, merged, 0)
    old_weight = torch.where(finite, torch.exp(lse - reference), 0).t().unsqueeze(-1)
    new_weight = torch.where(finite, torch.exp(block_lse - reference), 0).t().unsqueeze(-1)
    result = out * old_weight + block_out * new_weight
    return (result if out_dtype is None else result.to(out_dtype)), merged


def _traced() -> bool:
    """Dynamo tracing, or any dispatch mode (make_fx, FakeTensorMode, a counting mode) that a
    raw kernel launch would bypass: one op then, which the mode sees."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def _plain(*tensors: Tensor) -> bool:
    """Real tensors (no FakeTensor, FunctionalTensor or other subclass) outside autograd, which
    a raw kernel may read and write."""
    grad = torch.is_grad_enabled()
    return all(type(t) is Tensor and not (grad and t.requires_grad) for t in tensors)


def _triton_merge_applies(
    out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor, out_dtype: torch.dtype | None,
) -> bool:
    if triton is None:
        return False
    tensors = (out, lse, block_out, block_lse)
    if not _plain(*tensors):
        return False
    device = out.device
    if device.type not in _KERNEL_DEVICES or any(t.device != device for t in tensors):
        return False
    if out.dtype not in _KERNEL_OUT_DTYPES or block_out.dtype not in _KERNEL_OUT_DTYPES:
        return False
    if lse.dtype != torch.float32 or block_lse.dtype != torch.float32:
        return False
    if out_dtype is not None and out_dtype not in _KERNEL_OUT_DTYPES:
        return False
    # exactly the ring's shapes (with a head dim); anything broadcast goes through torch
    return (out.dim() == 3 and out.shape[2] > 0 and block_out.shape == out.shape
            and lse.shape == block_lse.shape == (out.shape[1], out.shape[0]))


def merge_partials_triton(
    out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor,
    out_dtype: torch.dtype | None = None, *, block_t: int | None = None,
    num_warps: int = 4, in_place: bool = True,
) -> tuple[Tensor, Tensor]:
    """The merge as one Triton kernel, on any strides (fp16/bf16/fp32 outputs, fp32 lse,
    ``out``/``block_out`` ``[T, H, D]``, ``lse``/``block_lse`` ``[H, T]``; what
    :func:`merge_partials` checks). The merged out (fp32, or ``out_dtype``) is written into
    ``out`` when ``out`` is contiguous and already of that dtype, the merged lse into ``lse``
    when it is contiguous (``in_place``); otherwise into new contiguous tensors. Runs on CUDA,
    and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` before this module
    is imported). ``block_t`` and ``num_warps``: tile rows and warps (benchmarks)."""
    if triton is None:
        raise RuntimeError("merge_partials_triton needs Triton")
    tokens, heads, dim = out.shape
    result_dtype = torch.float32 if out_dtype is None else out_dtype
    if in_place and out.dtype == result_dtype and out.is_contiguous():
        merged_out = out
    else:
        merged_out = torch.empty((tokens, heads, dim), dtype=result_dtype, device=out.device)
    if in_place and lse.is_contiguous():
        merged_lse = lse
    else:
        merged_lse = torch.empty_like(lse, memory_format=torch.contiguous_format)
    if tokens == 0 or heads == 0:
        return merged_out, merged_lse
    block_d = max(8, triton.next_power_of_2(dim))
    if block_t is None:
        block_t = min(256, max(16, _TILE_ELEMENTS // block_d))
    grid = (triton.cdiv(tokens, block_t), heads)
    with _device(out):
        _merge_kernel[grid](
            out, lse, block_out, block_lse, merged_out, merged_lse,
            tokens, dim,
            *out.stride(), *lse.stride(), *block_out.stride(), *block_lse.stride(),
            *merged_out.stride(), *merged_lse.stride(),
            BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps,
        )
    return merged_out, merged_lse


# --------------------------------------------------------------------------------------------
# the fp32 sums of the backward
# --------------------------------------------------------------------------------------------

def accumulate(acc: Tensor | None, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """``acc + x`` kept in the accumulation dtype: None -> ``x`` as it is (a single block is
    not converted); else fp32 (float64 for float64 inputs), the same values as
    ``acc.to(accumulate_dtype) + x``. ``out_dtype``: the dtype of the result, the same as
    ``.to(out_dtype)`` of it (the last sum, written in the input dtype without a separate
    conversion pass); None keeps the accumulation dtype.

    When ``acc`` is already of the result's dtype, contiguous and of the result's shape, it is
    updated in place (``acc.add_(x)``: on CUDA one pass that reads ``x`` in its own dtype).
    Eagerly on CUDA, otherwise (the first sum, of two blocks in the input dtype, or a sum
    written in ``out_dtype``), one Triton pass writes a new result. Under tracing it is one op,
    ``hcp::accumulate_step``, with a new result. ``acc`` is consumed (see the module docstring)."""
    if acc is None:
        return x if out_dtype is None else x.to(out_dtype)
    if _traced():
        return accumulate_step(acc, x, out_dtype)
    dtype = accumulate_dtype(torch.promote_types(acc.dtype, x.dtype))
    if _plain(acc, x):
        same_shape = acc.shape == x.shape
        if (out_dtype in (None, dtype) and acc.dtype == dtype and acc.is_contiguous()
                and (same_shape or torch.broadcast_shapes(acc.shape, x.shape) == acc.shape)
                and not (acc.is_inference() and not torch.is_inference_mode_enabled())):
            return acc.add_(x)
        if _triton_add_applies(acc, x, out_dtype):
            return add_triton(acc, x, out_dtype)
    return _sum(acc, x, out_dtype)


def _triton_add_applies(acc: Tensor, x: Tensor, out_dtype: torch.dtype | None) -> bool:
    return (triton is not None and acc.shape == x.shape
            and accumulate_dtype(torch.promote_types(acc.dtype, x.dtype)) == torch.float32
            and acc.device.type in _KERNEL_DEVICES and x.device == acc.device
            and acc.is_contiguous() and x.is_contiguous()
            and acc.dtype in _KERNEL_OUT_DTYPES and x.dtype in _KERNEL_OUT_DTYPES
            and out_dtype in (None, *_KERNEL_OUT_DTYPES))


def _sum(acc: Tensor, x: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    result = acc.to(accumulate_dtype(torch.promote_types(acc.dtype, x.dtype))) + x
    return result if out_dtype is None else result.to(out_dtype)


@torch.library.custom_op("hcp::accumulate_step", mutates_args=())
def accumulate_step(acc: Tensor, x: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    """:func:`accumulate` of a running sum and a block as one op of a traced graph, into a new
    tensor: see the module docstring."""
    if _triton_add_applies(acc, x, out_dtype):
        return add_triton(acc, x, out_dtype)
    return _sum(acc, x, out_dtype).contiguous()


@accumulate_step.register_fake
def _(acc, x, out_dtype):
    dtype = out_dtype or accumulate_dtype(torch.promote_types(acc.dtype, x.dtype))
    return acc.new_empty(torch.broadcast_shapes(acc.shape, x.shape), dtype=dtype)


def add_triton(a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """A new contiguous ``a + b`` of two same-shape fp16/bf16/fp32 tensors, summed in fp32 and
    written in ``out_dtype`` (None: fp32), one pass (on CUDA, or CPU tensors under Triton's
    interpreter)."""
    a, b = a.contiguous(), b.contiguous()
    result = torch.empty(a.shape, dtype=out_dtype or torch.float32, device=a.device)
    n = a.numel()
    if n:
        with _device(a):
            _add_kernel[(triton.cdiv(n, _ADD_BLOCK),)](a, b, result, n, BLOCK=_ADD_BLOCK,
                                                       num_warps=4)
    return result


def _device(t: Tensor):
    """Launch on ``t``'s GPU whatever the current device is."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# the kernels
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _merge_kernel(
        out_ptr, lse_ptr, bout_ptr, blse_ptr, mout_ptr, mlse_ptr,
        T, D,
        so_t, so_h, so_d, sl_h, sl_t,
        sb_t, sb_h, sb_d, sbl_h, sbl_t,
        sm_t, sm_h, sm_d, sml_h, sml_t,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Grid ``(cdiv(T, BLOCK_T), H)``: a program merges ``BLOCK_T`` rows of one head (the
        lse contiguous along tokens, each row of out ``D`` contiguous values, masked inside
        the power-of-two ``BLOCK_D``); offsets in int64. The lse follows ``torch.logaddexp``
        (equal infinities give themselves; log1p as ``log(u)·x/(u−1)``, the interpreter has no
        libdevice), the weights :func:`merge_partials_torch`'s rule."""
        head = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_D)
        row_mask = rows < T
        a = tl.load(lse_ptr + head * sl_h + rows * sl_t, mask=row_mask, other=0.0)
        b = tl.load(blse_ptr + head * sbl_h + rows * sbl_t, mask=row_mask, other=0.0)
        # torch.logaddexp: max + log1p(exp(-|a - b|)), a itself for equal infinities
        x = tl.exp(-tl.abs(a - b))  # NaN for a NaN input or equal infinities
        u = 1.0 + x
        log1p = tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))
        same_infinity = (a == b) & (tl.abs(a) == float("inf"))
        merged = tl.where(same_infinity, a, tl.maximum(a, b) + log1p)
        finite = tl.abs(merged) < float("inf")  # False for NaN too
        reference = tl.where(finite, merged, 0.0)
        old_weight = tl.where(finite, tl.exp(a - reference), 0.0)
        new_weight = tl.where(finite, tl.exp(b - reference), 0.0)

        tile_mask = row_mask[:, None] & (cols[None, :] < D)
        old = tl.load(out_ptr + rows[:, None] * so_t + head * so_h + cols[None, :] * so_d,
                      mask=tile_mask, other=0.0).to(tl.float32)
        new = tl.load(bout_ptr + rows[:, None] * sb_t + head * sb_h + cols[None, :] * sb_d,
                      mask=tile_mask, other=0.0).to(tl.float32)
        result = old * old_weight[:, None] + new * new_weight[:, None]
        tl.store(mout_ptr + rows[:, None] * sm_t + head * sm_h + cols[None, :] * sm_d,
                 result.to(mout_ptr.dtype.element_ty), mask=tile_mask)
        tl.store(mlse_ptr + head * sml_h + rows * sml_t, merged, mask=row_mask)

    @triton.jit
    def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        a = tl.load(a_ptr + offsets, mask=mask).to(tl.float32)
        b = tl.load(b_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offsets, (a + b).to(out_ptr.dtype.element_ty), mask=mask)
