"""``varlen_attention``: the ecosystem's varlen attention signature, single-device as the
``torch.ops.hcp.varlen_attention`` custom op, hierarchical CP inside ``context_parallel``."""

from __future__ import annotations

import torch
from torch import Tensor

from hcp_compile import validation
from hcp_compile.batch.cache import BATCHES
from hcp_compile.batch.call import checked_batch
from hcp_compile.batch.prepared import BatchValues, PreparedBatch, find, host_values
from hcp_compile.context import active_context
from hcp_compile.kernels import KERNELS, BlockRequest, BlockSpec, resolve_kernel
from hcp_compile.kernels.precision import accumulate_dtype


@torch.library.custom_op("hcp::varlen_attention", mutates_args=())
def varlen_attention_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, kernel: str,
) -> tuple[Tensor, Tensor]:
    """Single-device varlen attention: ``(out [Tq, Hq, D], lse [Hq, Tq])``, lse in fp32
    (float64 for float64 inputs).

    ``lse`` is returned for inspection and is not differentiable. The inputs are checked
    here, in the op, because a graph compiled by another backend calls it directly: there a
    shard of a context-parallel batch would otherwise attend over the wrong tokens."""
    if active_context() is not None:
        raise validation.InputError(
            "varlen_attention: a graph compiled with a backend other than 'hcp' ran inside "
            "hcp_compile.context_parallel, so its attention would ignore the other ranks' "
            "tokens; compile with backend='hcp' (options={'mesh': mesh}) or run eagerly"
        )
    prepared, keys = _check_single_device(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    spec = BlockSpec(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     window_left, window_right, cache_key=_cache_key(prepared, keys),
                     covered_rows=q.shape[0])
    chosen = _kernel(kernel, q, k, cu_seqlens_q, max(max_seqlen_q, max_seqlen_k), window_left, window_right)
    return KERNELS[chosen].forward(q, k, v, spec)


def _cache_key(prepared: PreparedBatch, keys: BatchValues) -> int:
    """The :attr:`BlockSpec.cache_key` of a batch, handed out by the batch cache for its values
    (``prepared``, the mesh-less batch of ``cu_seqlens_q``, and ``keys``, ``cu_seqlens_k``'s:
    read on the host once per tensor version, as the checks read them), so that the layers of
    a model and the backward share what a kernel derives (flex's mask)."""
    return BATCHES.cache_keys(prepared, ("single device", keys.digest))


def _kernel(name: str, q: Tensor, k: Tensor, cu_q: Tensor, longest: int, window_left: int,
            window_right: int) -> str:
    """The kernel for the call, ``"auto"`` judged by the batch's composition (its document
    count, from the shape, and the longest document's bound)."""
    request = BlockRequest.of(q, k, (window_left, window_right), segments=cu_q.shape[0] - 1, longest=longest)
    return resolve_kernel(name, request, "the op's kernel argument")


@varlen_attention_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left, window_right, kernel):
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        q.new_empty((q.shape[1], q.shape[0]), dtype=accumulate_dtype(q.dtype)),
    )


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, kernel = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, causal, scale, left, right)
    # the request, not its resolution: this runs while AOTAutograd traces, and a backward graph
    # that named the kernel would be reused from Inductor's cache by a process in which that
    # kernel does not load (the cache key is the forward graph, which says "auto")
    ctx.kernel = kernel


def _backward(ctx, grad_out: Tensor, _grad_lse: Tensor):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.hcp.varlen_attention_backward(
        grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.args, ctx.kernel
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


varlen_attention_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("hcp::varlen_attention_backward", mutates_args=())
def varlen_attention_backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool, softmax_scale: float, window_left: int, window_right: int, kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``hcp::varlen_attention``, its autograd formula: the inputs are the
    ones the forward op checked, with its kernel argument, resolved here as the forward
    resolved it. An op of its own, so that a compiled backward finds the batch's cache key
    and kernel when it runs, not when it is traced."""
    spec = BlockSpec(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     window_left, window_right,
                     cache_key=_cache_key(find(cu_seqlens_q, None), host_values(cu_seqlens_k)),
                     covered_rows=q.shape[0])
    chosen = _kernel(kernel, q, k, cu_seqlens_q, max(max_seqlen_q, max_seqlen_k), window_left, window_right)
    return tuple(KERNELS[chosen].backward(grad_out, q, k, v, out, lse, spec))


@varlen_attention_backward_op.register_fake
def _(grad_out, q, k, v, *rest):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
    softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
) -> Tensor:
    """Varlen attention over packed documents (q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``).

    With no context parallelism active this is single-device attention. Inside
    ``hcp_compile.context_parallel(mesh)`` q/k/v are this rank's shards laid out by
    ``shard_plan(cu_seqlens, mesh)``, ``cu_seqlens``/``max_seqlen`` stay the global real ones,
    and the result is this rank's shard of the single-device output.
    ``window_size=(left, right)`` limits each query to keys at most ``left`` positions before
    and ``right`` after it (-1: unlimited).
    """
    if not torch.compiler.is_compiling():
        validation.check_argument_types(
            {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k},
            {"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k},
        )
    window = validation.check_window(window_size)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    # traced, the call stays the single-device op, which the ``hcp`` backend rewrites; the
    # op refuses to run inside context_parallel, so another backend cannot silently skip CP
    cp = None if torch.compiler.is_compiling() else active_context()
    if cp is not None:
        return cp.attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            causal=causal, scale=scale, window=window,
        )
    out, _ = torch.ops.hcp.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
        window[0], window[1], "auto",
    )
    return out


def _check_single_device(q, k, v, cu_q, cu_k, max_q, max_k) -> tuple[PreparedBatch, BatchValues]:
    """Shapes, dtypes, then the batch rules of a single device (``validation.check`` on the
    mesh-less prepared batch): ``cu_seqlens`` against the token counts, ``max_seqlen`` against
    the longest document (the flash kernel sizes its grid by it). ``cu_seqlens`` is read on
    the host once per tensor version, so the layers of a model that share it wait only once.
    Returns the mesh-less prepared batch and ``cu_seqlens_k``'s values, which name the call's
    blocks (:func:`_cache_key`)."""
    validation.check_qkv(q, k, v)
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        validation.check_cu_seqlens_dtype(cu, name)
    prepared = find(cu_q, None)
    keys = None if cu_k is cu_q else host_values(cu_k)
    failures = checked_batch(prepared, keys, (q.shape[0], k.shape[0], v.shape[0]), (max_q, max_k))
    validation.raise_first(failures)
    return prepared, prepared.batch if keys is None else keys
