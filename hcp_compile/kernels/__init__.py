"""Attention kernels behind one contract, exposed as ``torch.ops.hcp.block_forward/backward``.

The contract (contract.py, docs/design.md §8): a block is q ``[Tq, Hq, D]``, k and v
``[Tk, Hkv, D]`` (Hkv dividing Hq, taken without repeating heads) and a :class:`BlockSpec`.

- ``forward(q, k, v, spec) -> (out, lse)``: ``out [Tq, Hq, D]`` in q's dtype, ``lse [Hq, Tq]``
  in fp32 (float64 for float64 inputs), natural log, both contiguous; a row with no visible
  key has ``out = 0`` and ``lse = -inf``.
- ``backward(dout, q, k, v, out, lse, spec) -> (dq, dk, dv)``, where ``out`` and ``lse`` may
  be the merged results of several blocks (the ring backward passes them), and the result is
  this block's exact share of the merged attention's gradient; rows with ``lse = -inf`` give
  no gradient.

A kernel is one class in one file implementing :class:`Kernel` (``name``, ``supports``,
``forward``, ``backward``), registered in ``KERNELS``. ``kernel="auto"`` takes the fastest
supporting kernel measured on the device for the call's composition (measured.json: one
document, log-uniform or short documents, a window; measured.py), else the first supporting
one of ``FALLBACK``. The cudnn kernel supports nothing where its package does not load or where
it fails its check on the device (``cudnn.device_check``): "auto" then takes another.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hcp_compile.kernels.contract import BlockRequest, BlockSpec, Kernel, new_cache_key
from hcp_compile.kernels.cudnn import CudnnKernel
from hcp_compile.kernels.dense import DenseKernel
from hcp_compile.kernels.flash import FlashKernel
from hcp_compile.kernels.flex import FlexKernel
from hcp_compile.kernels.measured import composition, device_kind, fastest
from hcp_compile.kernels.precision import accumulate_dtype
from hcp_compile.kernels.torch_kernel import TorchKernel
from hcp_compile.validation import InputError

KERNELS: dict[str, Kernel] = {
    k.name: k for k in (TorchKernel(), FlashKernel(), FlexKernel(), DenseKernel(), CudnnKernel())
}
KERNEL_CHOICES = ("auto", *KERNELS)
# "auto" on a device kind without measurements: the first of these that supports the call, by
# device type; on CUDA flex before the torch reference (it masks a ring's window by position
# without the cudnn package, and takes fp32), on CPU after it (there flex is the uncompiled
# reference path)
FALLBACK: dict[str, tuple[str, ...]] = {"cuda": ("cudnn", "flash", "flex", "torch"), "cpu": ("torch", "flex")}


def resolve_kernel(name: str, request: BlockRequest, how_to_choose: str = "kernel=...") -> str:
    """The kernel to run ``request`` with. ``"auto"``: the fastest supporting kernel measured
    on the device for the request's composition (:func:`measured.composition`), else the first
    supporting one of ``FALLBACK``. A named kernel that cannot run it raises
    :class:`InputError` with its reason and the kernels that can, which the caller passes as
    ``how_to_choose``."""
    if name not in KERNEL_CHOICES:
        raise InputError(f"kernel: expected one of {KERNEL_CHOICES}, got {name!r}")
    reasons = {n: kernel.supports(request) for n, kernel in KERNELS.items()}
    able = [n for n, reason in reasons.items() if reason is None]
    if name == "auto":
        kind_of_call = composition(request.window != (-1, -1), request.segments, request.longest)
        fallback = FALLBACK.get(request.device.type, ("torch",))
        return fastest(device_kind(request.device), able, kind_of_call) or next(n for n in fallback if n in able)
    if reasons[name] is not None:
        raise InputError(
            f"kernel={name!r} {reasons[name]}; pass 'auto' or one of {able} ({how_to_choose})"
        )
    return name


def run_forward(kernel: str, q: Tensor, k: Tensor, v: Tensor, spec: BlockSpec) -> tuple[Tensor, Tensor]:
    """One block's forward through the ``hcp::block_forward`` op (one opaque graph node)."""
    return torch.ops.hcp.block_forward(q, k, v, *spec.op_args(), kernel)


def run_backward(
    kernel: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    spec: BlockSpec,
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's backward through the ``hcp::block_backward`` op."""
    return torch.ops.hcp.block_backward(dout, q, k, v, out, lse, *spec.op_args(), kernel)


@torch.library.custom_op("hcp::block_forward", mutates_args=())
def block_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
    causal: bool, scale: float, window_left: int, window_right: int,
    q_positions: Tensor | None, k_positions: Tensor | None, cache_key: int, equal_lengths: bool,
    covered_rows: int, kernel: str,
) -> tuple[Tensor, Tensor]:
    """One attention block: ``(out, lse)`` under the kernel contract above; the arguments
    between v and kernel are :meth:`BlockSpec.op_args`."""
    spec = BlockSpec(cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right,
                     q_positions, k_positions, cache_key, equal_lengths, covered_rows)
    q_end, k_end = spec.segment_ends()
    if _nothing_inside(q, k, q_end, k_end):
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=accumulate_dtype(q.dtype), device=q.device)
        return torch.zeros_like(q, memory_format=torch.contiguous_format), lse
    out, lse = KERNELS[kernel].forward(q, k, v, spec)
    rows = _rows_outside(q_end, q.shape[0])
    if rows is not None:  # rows without keys, whatever the kernel left there
        out[rows].zero_()
        lse[:, rows].fill_(float("-inf"))
    return out, lse


def _nothing_inside(q: Tensor, k: Tensor, q_end: int | None, k_end: int | None) -> bool:
    """Whether the host knows that the block has rows but no query or no key inside its
    segments (a ring step the window skips, in a compiled graph): then no kernel is called,
    which would still derive its masks or entries and launch. A block without rows is every
    kernel's own early return."""
    return (q_end == 0 or k_end == 0) and q.shape[0] > 0 and k.shape[0] > 0


def _rows_outside(end: int | None, rows: int) -> slice | None:
    """The rows from ``end`` on, where the segments end (BlockSpec.segment_ends; None where
    there are no rows after it or it is not known)."""
    return slice(end, None) if end is not None and end < rows else None


@block_forward.register_fake
def _(q, k, v, *spec_and_kernel):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=accumulate_dtype(q.dtype))
    return out, lse


@torch.library.custom_op("hcp::block_backward", mutates_args=())
def block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
    causal: bool, scale: float, window_left: int, window_right: int,
    q_positions: Tensor | None, k_positions: Tensor | None, cache_key: int, equal_lengths: bool,
    covered_rows: int, kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one attention block given the (possibly merged) ``out`` and ``lse``."""
    spec = BlockSpec(cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right,
                     q_positions, k_positions, cache_key, equal_lengths, covered_rows)
    q_end, k_end = spec.segment_ends()
    if _nothing_inside(q, k, q_end, k_end):
        return tuple(torch.zeros_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    dq, dk, dv = KERNELS[kernel].backward(dout, q, k, v, out, lse, spec)
    rows, keys = _rows_outside(q_end, q.shape[0]), _rows_outside(k_end, k.shape[0])
    if rows is not None:
        dq[rows].zero_()
    if keys is not None:
        dk[keys].zero_()
        dv[keys].zero_()
    return dq, dk, dv


@block_backward.register_fake
def _(dout, q, k, v, out, lse, *spec_and_kernel):
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(v.shape, dtype=v.dtype, device=v.device),
    )


from hcp_compile.kernels import cost  # noqa: E402,F401  (registers the ops' FLOP formulas)
