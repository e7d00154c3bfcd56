"""Document boundaries of packed batches from the ``position_ids`` that data collators emit.

Collators that pack without padding (transformers' ``DataCollatorWithFlattening``, TRL's
padding-free packing) give every token its position inside its document, restarting at 0 where
a document starts, instead of ``cu_seqlens``; varlen attention and ``shard_plan`` need the
boundaries.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hcp_compile.validation import InputError


def cu_seqlens_from_position_ids(position_ids: Tensor) -> tuple[Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of the packed batch whose tokens have ``position_ids``.

    ``position_ids``: ``[T]`` or ``[1, T]`` integers; each document's tokens are numbered
    ``0, 1, 2, ...``, so a 0 starts a new document. Returns int32 ``cu_seqlens [docs + 1]`` on
    ``position_ids``'s device and the longest document's length. The positions are read on
    the host once (``max_seqlen`` must be a host int anyway), so the checks and the
    boundaries cost one device sync.
    """
    values = _checked_host_values(position_ids)
    starts = (values == 0).nonzero().flatten()
    cu_seqlens = torch.cat([starts, torch.tensor([values.numel()])]).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return cu_seqlens.to(position_ids.device), max_seqlen


def _checked_host_values(position_ids: Tensor) -> Tensor:
    """The positions as a 1-D CPU int64 tensor, after checking they describe packed
    documents."""
    if not isinstance(position_ids, Tensor):
        raise InputError(
            f"position_ids: expected a torch.Tensor, got {type(position_ids).__name__}"
        )
    shape = tuple(position_ids.shape)
    if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)) or position_ids.numel() == 0:
        raise InputError(
            f"position_ids: expected a non-empty [T] or [1, T] tensor (one packed row), got "
            f"shape {shape}; pack the batch into one row (e.g. DataCollatorWithFlattening)"
        )
    dtype = position_ids.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise InputError(
            f"position_ids: expected an integer dtype, got {dtype}; convert with "
            "position_ids.long()"
        )
    values = position_ids.detach().reshape(-1).to("cpu", torch.int64)
    negative = (values < 0).nonzero()
    if negative.numel():
        i = int(negative[0])
        raise InputError(
            f"position_ids: positions must be >= 0, but entry {i} is {int(values[i])}; pass "
            "each token's position inside its document"
        )
    if values[0] != 0:
        raise InputError(
            f"position_ids: the first token must start a document (position 0), got "
            f"{int(values[0])}; pass the whole packed row, not a slice from inside a document"
        )
    following = values[1:]
    broken = ((following != 0) & (following != values[:-1] + 1)).nonzero()
    if broken.numel():
        i = int(broken[0]) + 1
        raise InputError(
            f"position_ids: each position must be 0 (a new document) or the previous one + 1, "
            f"but entry {i} is {int(values[i])} after {int(values[i - 1])}; pass positions "
            "counted within each document, as packing collators emit them"
        )
    return values


def log_uniform_lengths(tokens: int, low: int, high: int, seed: int) -> list[int]:
    """Document lengths drawn log-uniformly from [low, high] (seeded) until they hold
    ``tokens``, the last one cut: the synthetic batches of the benchmarks (seed 0 and 128K
    tokens of 256..32K give W2) and of ``python -m hcp_advise``."""
    if not (tokens >= 1 and 1 <= low <= high):
        raise InputError(f"tokens, low, high: expected tokens >= 1 and 1 <= low <= high, got {tokens}, {low}, {high}")
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    total = 0
    while total < tokens:
        u = float(torch.rand((), generator=gen))
        lengths.append(int(math.exp(math.log(low) + u * (math.log(high) - math.log(low)))))
        total += lengths[-1]
    lengths[-1] -= total - tokens
    return [n for n in lengths if n > 0]
