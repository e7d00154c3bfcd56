"""CUDA flash varlen attention through ``aten._flash_attention_forward/backward``.

Adapts flash's conventions to the shared kernel contract: flash marks rows with no visible key
with lse = +inf, the contract with -inf (so that the ring merge is a plain logaddexp).

The query bound handed to aten is at least 2 whatever the block's segments are, which keeps
flash's GQA decoding shortcut out of reach (Note [flash's special paths] below, docs/design.md
§8.4).

Those aten ops are what torch's FA3/FA4 integrations replace: after
``torch.nn.attention.activate_flash_attention_impl("FA3")`` (or ``"FA4"``, with the package
installed) this kernel runs that implementation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hcp_compile.kernels.contract import BlockRequest, BlockSpec
from hcp_compile.validation import InputError

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

# Note [flash's special paths]
# FlashAttention-2's varlen forward (what aten._flash_attention_forward runs) takes a decoding
# shortcut when max_seqlen_q == 1 and Hq > Hkv (GQA, no window): it reshapes q as if every
# segment held exactly one query, ``[segments, Hkv, Hq/Hkv, D]``, which raises as soon as one
# segment is empty (a 1-token document beside an empty one, or a ring step's query chunk of
# 0 or 1 rows):
#
#     cu_q = [0, 1, 1, 2]   3 segments, 2 rows  ->  reshape [3, Hkv, g, D] of 2 rows: error
#
# max_seqlen_q only sizes the grid (in 128-row tiles), so a bound of 2 costs nothing and keeps
# the shortcut out of reach. The other shape-dependent paths (no rows, no keys, a bound of 0)
# are handled before aten or cannot occur under the contract (docs/design.md §8.4).
MIN_MAX_SEQLEN_Q = 2


def flash_bounds(spec: BlockSpec) -> tuple[int, int]:
    """``(max_seqlen_q, max_seqlen_k)`` handed to aten: the spec's bounds (they cover the
    segments), the query bound raised to ``MIN_MAX_SEQLEN_Q``."""
    return max(int(spec.max_q), MIN_MAX_SEQLEN_Q), int(spec.max_k)

# flash applies a window by offsets inside its segments, which under context parallelism are
# not positions inside the document
_NO_WINDOW_BY_POSITION = (
    "cannot apply a sliding window under context parallelism (its masks are local to a "
    "block; the window needs positions inside the document)"
)


class FlashKernel:
    name = "flash"
    masks_by_position = False

    def supports(self, request: BlockRequest) -> str | None:
        if not (request.device.type == "cuda" and request.dtype in SUPPORTED_DTYPES
                and request.head_dim % 8 == 0 and request.head_dim <= 256):
            return (
                f"needs CUDA tensors in fp16/bf16 with head_dim a multiple of 8 and at most "
                f"256; got {request.dtype} on {request.device} with head_dim {request.head_dim}"
            )
        if request.window_by_position and not self.masks_by_position:
            return _NO_WINDOW_BY_POSITION
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: BlockSpec) -> tuple[Tensor, Tensor]:
        left, right = _window(spec)
        if q.shape[0] == 0 or k.shape[0] == 0:  # an empty region or ring section: nothing to see
            lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
            return torch.zeros_like(q), lse
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, spec.cu_q, spec.cu_k, *flash_bounds(spec), 0.0, spec.causal, False,
            scale=spec.scale, window_size_left=left, window_size_right=right,
        )
        lse = lse.masked_fill(lse == float("inf"), float("-inf"))
        q_end, _ = spec.segment_ends()
        if q_end is None:  # else the op writes the rows past the segments
            outside = _rows_outside(spec.cu_q, q.shape[0])
            out, lse = out.masked_fill(outside[:, None, None], 0), lse.masked_fill(outside, float("-inf"))
        return out, lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        spec: BlockSpec,
    ) -> tuple[Tensor, Tensor, Tensor]:
        left, right = _window(spec)
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(),
            lse.masked_fill(lse == float("-inf"), float("inf")).contiguous(),
            spec.cu_q, spec.cu_k, *flash_bounds(spec), 0.0, spec.causal, rng_state, unused,
            scale=spec.scale, window_size_left=left, window_size_right=right,
        )
        q_end, k_end = spec.segment_ends()  # where known, the op writes the rows past the segments
        if q_end is None:
            dq = dq.masked_fill(_rows_outside(spec.cu_q, q.shape[0])[:, None, None], 0)
        if k_end is None:
            keys = _rows_outside(spec.cu_k, k.shape[0])[:, None, None]
            dk, dv = dk.masked_fill(keys, 0), dv.masked_fill(keys, 0)
        return dq, dk, dv


def _rows_outside(cu: Tensor, rows: int) -> Tensor:
    """Per row, whether it lies past the segments ``cu``, compared on the device: flash leaves
    such rows unwritten (BlockSpec's rows outside every segment)."""
    return torch.arange(rows, device=cu.device) >= cu[-1]


def _window(spec: BlockSpec) -> tuple[int | None, int | None]:
    """Flash's window arguments; a window by positions (a ring step) is refused."""
    if spec.q_positions is not None and spec.windowed:
        raise InputError(f"window_size: the flash kernel {_NO_WINDOW_BY_POSITION}; use kernel='flex' or 'torch'")
    return (spec.window_left if spec.window_left >= 0 else None,
            spec.window_right if spec.window_right >= 0 else None)
