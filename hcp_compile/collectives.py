"""The two exchanges of hierarchical CP, written with functional collectives so the same code
runs eagerly and under tracing (each collective appears in the graph with its wait).

The ``_c10d_functional`` ops are called directly rather than through
``torch.distributed._functional_collectives``, whose wrappers wait right after issuing when
traced: here every wait sits where its result is first needed, in the eager run and in the
graph alike."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor


def scatter_heads(
    tensors: list[Tensor], group: dist.ProcessGroup, size: int, counts: tuple[int, ...]
) -> Tensor:
    """Ulysses exchange in one all-to-all: ``[T_i, H_i, D]`` with all heads, ``T_i`` this
    rank's entry of ``counts`` (the token count of every rank of the group) ->
    ``[sum(counts), sum(H_i) / size, D]``, this rank's head slice of every tensor (in order)
    over the tokens of every rank of the group in rank order, one contiguous tensor."""
    if size == 1:
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=1)
    tokens, dim = tensors[0].shape[0], tensors[0].shape[2]
    widths = [t.shape[1] // size for t in tensors]
    width = sum(widths)
    # block j of dim 0 holds the heads that go to Ulysses rank j
    send = _pack([t.reshape(tokens, size, w, dim).transpose(0, 1) for t, w in zip(tensors, widths)])
    splits = ([c * width * dim for c in counts], [tokens * width * dim] * size)
    received = _all_to_all(send.view(-1), splits, group)
    # the blocks from Ulysses ranks 0..size-1, concatenated, are the exchange stream
    return _wait(received).view(sum(counts), width, dim)


def gather_heads(
    x: Tensor, widths: list[int], group: dist.ProcessGroup, size: int, counts: tuple[int, ...],
    rank: int,
) -> list[Tensor]:
    """Inverse of :func:`scatter_heads` for one tensor ``[sum(counts), sum(widths), D]`` that
    holds several tensors' head slices side by side: returns ``[counts[rank], size * w, D]``
    for each width. A contiguous ``x`` travels as it is, with no packing copy."""
    if size == 1:
        return list(x.split(widths, dim=1))
    width, dim = x.shape[1], x.shape[2]
    tokens = counts[rank]
    splits = ([tokens * width * dim] * size, [c * width * dim for c in counts])
    received = _all_to_all(x.contiguous().view(-1), splits, group)
    received = _wait(received).view(size, tokens, width, dim)
    return [
        part.transpose(0, 1).reshape(tokens, size * w, dim)
        for part, w in zip(received.split(widths, dim=2), widths)
    ]


def _pack(blocks: list[Tensor]) -> Tensor:
    """Concatenate ``[size, tokens, w_i, D]`` views along dim 2 into one new contiguous
    buffer, one strided copy each (faster than ``torch.cat`` of strided inputs on GPU)."""
    size, tokens, _, dim = blocks[0].shape
    buffer = blocks[0].new_empty((size, tokens, sum(b.shape[2] for b in blocks), dim))
    offset = 0
    for block in blocks:
        buffer[:, :, offset : offset + block.shape[2]].copy_(block)
        offset += block.shape[2]
    return buffer


def gather_tokens(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-gather along dim 0 in group-rank order (waited)."""
    gathered = _all_gather(x.contiguous(), 0, group)
    return funcol.wait_tensor(gathered)


# all_gather_tensor is deprecated from torch 2.12 on; 2.11 has only that name
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def ring_shift(x: Tensor, group: dist.ProcessGroup, rank: int, size: int) -> Tensor:
    """Send ``x`` to ring rank ``rank + 1`` and receive the same shape from ``rank - 1``.

    Returns the flat received tensor, not yet waited for: read it through :func:`arrived`.
    An all-to-all with one non-zero split is the point-to-point transfer that both torch 2.11
    and later support as a functional collective; it is correct only for 1-D tensors.
    """
    flat = x.reshape(-1)
    splits = [0] * size
    splits[(rank + 1) % size] = flat.numel()
    received = [0] * size
    received[(rank - 1) % size] = flat.numel()
    return _all_to_all(flat, (received, splits), group)


def arrived(x: Tensor, shape: torch.Size) -> Tensor:
    """Wait for a transfer issued by :func:`ring_shift` and view it as ``shape``."""
    return _wait(x).view(shape)


def _all_to_all(flat: Tensor, splits: tuple[list[int], list[int]], group: dist.ProcessGroup) -> Tensor:
    """Issue an all-to-all of a 1-D tensor (``splits``: output and input split sizes); the
    result must go through :func:`_wait` before it is read."""
    return torch.ops._c10d_functional.all_to_all_single(flat, *splits, group.group_name)


def _wait(x: Tensor) -> Tensor:
    return torch.ops._c10d_functional.wait_tensor(x)
