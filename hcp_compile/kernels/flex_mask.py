"""The block mask of one block (a :class:`BlockSpec`) for flex_attention, and its cache.

Every query and key row gets its segment id and its position (``BlockSpec``'s rule: the given
positions inside the document, else the offset inside the segment aligned bottom-right). The
element mask (``mask_mod``) is "same segment, and the causal mask and the window allow the
pair". The block structure is derived from extremes of those values instead of evaluating
``mask_mod`` on every pair (``create_block_mask`` would, Tq x Tk evaluations or a compile of
its own): a block pair is skipped when no pair in it is visible, which is decided per piece
(the rows of one block in one segment, whose positions are consecutive), and marked full
(``mask_mod`` not applied) when one segment fills both blocks and every pair is visible;
anything else is partial and ``mask_mod`` decides. Both tests are exact, so flex computes no
block pair it could have skipped.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from hcp_compile.kernels.contract import BLOCK_MEMOS
from hcp_compile.kernels.contract import BlockSpec

# the rows of a mask block: what flex's GPU kernels are tiled for
BLOCK_SIZE = 128
# masks kept for reuse (a batch needs one per ring step plus the local region and per mask,
# shared by every layer and by the backward); the least recently used is dropped first once
# there are more, or once they hold more device memory than CACHE_BYTES (a mask of Tq x Tk rows
# holds 16 (Tq/128)(Tk/128) bytes of indices: 16 MiB at 131K x 131K, 1 GiB at 1M x 1M;
# docs/design.md §8.5)
CACHE_CAPACITY = 64
CACHE_BYTES = 2 * 2**30


@dataclass(frozen=True)
class DocumentMask:
    block_mask: BlockMask
    # int32 segment id and position of every query row and key row: what mask_mod reads
    buffers: tuple[Tensor, Tensor, Tensor, Tensor]
    variant: tuple[bool, int, int]  # causal, window_left, window_right: the mask_mod's constants


def visible(
    b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, seg_q: Tensor, seg_k: Tensor,
    pos_q: Tensor, pos_k: Tensor, *, causal: bool, left: int, right: int,
) -> Tensor:
    """Whether query ``q_idx`` sees key ``kv_idx`` (flex's mask_mod, with the rows' values
    passed explicitly)."""
    keep = seg_q[q_idx] == seg_k[kv_idx]
    if causal or left >= 0 or right >= 0:
        delta = pos_q[q_idx] - pos_k[kv_idx]
        if causal:
            keep = keep & (delta >= 0)
        if left >= 0:
            keep = keep & (delta <= left)
        if right >= 0:
            keep = keep & (delta >= -right)
    return keep


def _rows(cu: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Segment id, offset inside the segment and segment length of every row (int64); a row
    past the last segment gets the id ``n`` (the segment count) and length 0."""
    cu = cu.to(torch.int64)
    row = torch.arange(rows, device=cu.device)
    seg = torch.searchsorted(cu[1:], row, right=True)
    return seg, row - cu[seg], _segment_lengths(cu)[seg]


def _segment_lengths(cu: Tensor) -> Tensor:
    """The segments' lengths (int64) and a 0 after them, the length of the rows past them."""
    cu = cu.to(torch.int64)
    return torch.cat([cu[1:] - cu[:-1], cu.new_zeros(1)])


def row_values(spec: BlockSpec, q_rows: int, k_rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(seg_q, seg_k, pos_q, pos_k)``, int32. Rows outside every segment (BlockSpec) get ids
    that no row of the other side has: queries ``n``, keys ``n + 1`` (``n`` segments)."""
    seg_q, off_q, len_q = _rows(spec.cu_q, q_rows)
    seg_k, off_k, _ = _rows(spec.cu_k, k_rows)
    seg_k = torch.where(seg_k < spec.cu_k.shape[0] - 1, seg_k, spec.cu_k.shape[0])
    if spec.q_positions is None:
        len_k_of_q = _segment_lengths(spec.cu_k)[seg_q]
        pos_q, pos_k = off_q + len_k_of_q - len_q, off_k
    else:
        pos_q, pos_k = spec.q_positions, spec.k_positions
    # copies: a cached mask must not hold the spec's tensors, which in a compiled graph are
    # buffers that Inductor reuses for other values
    return tuple(t.to(torch.int32, copy=True) for t in (seg_q, seg_k, pos_q, pos_k))


def _per_block(values: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Min and max of ``values`` over each block of rows (the last block padded with its last
    row, which changes neither)."""
    blocks = -(-values.shape[0] // block)
    padded = torch.cat([values, values[-1:].expand(blocks * block - values.shape[0])])
    grouped = padded.view(blocks, block)
    return grouped.amin(1), grouped.amax(1)


@dataclass(frozen=True)
class _Pieces:
    """The rows cut where the block or the segment changes: piece ``p`` holds the rows of
    block ``block[p]`` in segment ``segment[p]``, positions ``lo[p]..hi[p]``. Segment ids never
    decrease along the rows, so ``block + segment`` grows at every cut and indexes the pieces
    without a host read; indices no row maps to stay ``valid = False``."""

    block: Tensor
    segment: Tensor
    lo: Tensor
    hi: Tensor
    valid: Tensor


def _pieces(seg: Tensor, pos: Tensor, block: int, segments: int) -> _Pieces:
    rows = seg.shape[0]
    row_block = torch.arange(rows, device=seg.device) // block
    index = (row_block + seg).to(torch.int64)
    count = -(-rows // block) + segments

    def reduce(values: Tensor, how: str, empty: int) -> Tensor:
        out = torch.full((count,), empty, dtype=torch.int64, device=seg.device)
        return out.scatter_reduce(0, index, values.to(torch.int64), how, include_self=False)

    lo = reduce(pos, "amin", 0)
    return _Pieces(reduce(row_block, "amax", 0), reduce(seg, "amax", -1), lo,
                   reduce(pos, "amax", 0), reduce(seg, "amax", -1) >= 0)


def _visible_somewhere(q: _Pieces, k: _Pieces, causal: bool, left: int, right: int) -> Tensor:
    """``[query pieces, key pieces]``: whether some pair of rows is visible. Exact: the
    differences ``pos_q - pos_k`` of two pieces fill the interval from ``lo_q - hi_k`` to
    ``hi_q - lo_k`` (positions inside a piece are consecutive)."""
    some = (q.segment[:, None] == k.segment[None, :]) & q.valid[:, None] & k.valid[None, :]
    low, high = q.lo[:, None] - k.hi[None, :], q.hi[:, None] - k.lo[None, :]
    if causal:
        some &= high >= 0
    if left >= 0:
        some &= low <= left
    if right >= 0:
        some &= high >= -right
    return some


def block_structure(
    seg_q: Tensor, seg_k: Tensor, pos_q: Tensor, pos_k: Tensor, causal: bool, left: int,
    right: int, block: int, segments: int,
) -> tuple[Tensor, Tensor]:
    """``(partial, full)`` bool ``[query blocks, key blocks]`` (see the module docstring) for
    rows in ``segments`` segments."""
    q_blocks, k_blocks = -(-seg_q.shape[0] // block), -(-seg_k.shape[0] // block)
    pieces_q, pieces_k = _pieces(seg_q, pos_q, block, segments), _pieces(seg_k, pos_k, block, segments)
    visible = _visible_somewhere(pieces_q, pieces_k, causal, left, right)
    pair = pieces_q.block[:, None] * k_blocks + pieces_k.block[None, :]
    some = torch.zeros(q_blocks * k_blocks, dtype=torch.int32, device=seg_q.device)
    some = some.scatter_reduce(0, pair.flatten(), visible.flatten().to(torch.int32), "amax")
    some = some.view(q_blocks, k_blocks) > 0
    # every pair is visible: one segment filling both blocks, and the extremes satisfy the mask
    seg_q_lo, seg_q_hi = _per_block(seg_q, block)
    seg_k_lo, seg_k_hi = _per_block(seg_k, block)
    pos_q_lo, pos_q_hi = (t[:, None] for t in _per_block(pos_q, block))
    pos_k_lo, pos_k_hi = (t[None, :] for t in _per_block(pos_k, block))
    complete_q = torch.arange(1, q_blocks + 1, device=seg_q.device) * block <= seg_q.shape[0]
    complete_k = torch.arange(1, k_blocks + 1, device=seg_k.device) * block <= seg_k.shape[0]
    one_q, one_k = (seg_q_lo == seg_q_hi) & complete_q, (seg_k_lo == seg_k_hi) & complete_k
    every = one_q[:, None] & one_k[None, :] & (seg_q_lo[:, None] == seg_k_lo[None, :])
    if causal:
        every &= pos_q_lo >= pos_k_hi
    if left >= 0:
        every &= pos_q_hi - pos_k_lo <= left
    if right >= 0:
        every &= pos_k_hi - pos_q_lo <= right
    return some & ~every, every


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """BlockMask's form of a ``[query blocks, key blocks]`` bool matrix: the count of set key
    blocks per query block and the key block indices, those set first, each part in index order
    (what a stable argsort gives, from a prefix sum and a scatter), int32, batch and head
    dims 1, row-major: flex's GPU kernels read the indices as contiguous rows (argsort of a
    transposed matrix keeps its strides, and the backward's dK and dV came out wrong, torch
    2.11)."""
    blocks = blocks.contiguous()
    counts = blocks.sum(-1, dtype=torch.int32)
    set_so_far = blocks.cumsum(-1, dtype=torch.int32)  # column j: set blocks among 0..j
    columns = torch.arange(blocks.shape[-1], dtype=torch.int32, device=blocks.device).expand_as(set_so_far)
    # a set block goes after the set ones before it, an unset one after all set ones and the
    # unset ones before it (columns - set_so_far of them)
    slot = torch.where(blocks, set_so_far - 1, counts[:, None] + columns - set_so_far).to(torch.int64)
    indices = torch.empty_like(columns).scatter_(-1, slot, columns)
    return counts[None, None].contiguous(), indices[None, None]


@functools.cache
def mask_function(variant: tuple[bool, int, int]):
    """:func:`visible` with the variant's constants closed over: Dynamo makes the ints of a
    ``functools.partial`` symbolic under ``dynamic=True``, and flex's forward then fails to
    lower a window (torch 2.11)."""
    causal, left, right = variant

    def mask(b, h, q_idx, kv_idx, seg_q, seg_k, pos_q, pos_k):
        return visible(b, h, q_idx, kv_idx, seg_q, seg_k, pos_q, pos_k, causal=causal, left=left, right=right)

    return mask


def build_document_mask(spec: BlockSpec, q_rows: int, k_rows: int, block: int = BLOCK_SIZE) -> DocumentMask:
    """The block mask of ``spec`` for ``q_rows`` queries and ``k_rows`` keys (both > 0)."""
    buffers = row_values(spec, q_rows, k_rows)
    variant = (spec.causal, spec.window_left, spec.window_right)
    # the ids of the n segments and of the rows past them, queries' and keys' (row_values)
    partial, full = block_structure(*buffers, *variant, block, spec.cu_q.shape[0] + 1)
    seg_q, seg_k, pos_q, pos_k = buffers
    mask_mod = functools.partial(mask_function(variant), seg_q=seg_q, seg_k=seg_k, pos_q=pos_q, pos_k=pos_k)
    # the query-major halves (for the backward's dK, dV) are the transposed matrices;
    # BlockMask.from_kv_blocks would derive them with vmap, which fails inside the block op
    # when it runs in an AOTAutograd-compiled graph
    block_mask = BlockMask(
        (q_rows, k_rows), *_ordered(partial), *_ordered(full), *_ordered(partial.t()),
        *_ordered(full.t()), (block, block), mask_mod,
    )
    return DocumentMask(block_mask, buffers, variant)


def mask_bytes(mask: DocumentMask) -> int:
    """The memory a mask holds: its block tensors and its row values."""
    tensors = [t for t in mask.block_mask.as_tuple() if isinstance(t, Tensor)] + list(mask.buffers)
    return sum(t.numel() * t.element_size() for t in tensors)


def document_mask(spec: BlockSpec, q_rows: int, k_rows: int, key_extra: tuple = ()) -> DocumentMask:
    """:func:`build_document_mask`, reused for a spec with a ``cache_key`` (and the same rows
    and ``key_extra``)."""
    masks = BLOCK_MEMOS.memo("flex masks", CACHE_CAPACITY, CACHE_BYTES, mask_bytes)
    return masks.get(spec, (q_rows, k_rows, *key_extra), lambda: build_document_mask(spec, q_rows, k_rows))
