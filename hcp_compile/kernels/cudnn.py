"""cuDNN's ragged (THD) attention through the ``nvidia-cudnn-frontend`` package, a dependency
on Linux (docs/design.md §8.8). Where the package does not load, or its graphs fail a small
check on the device (:func:`device_check`: an older GPU or cuDNN), the kernel supports nothing
and ``kernel="auto"`` takes another.

cuDNN takes a packed batch as ``entries`` padded sequences of at most ``s_max`` rows whose
rows lie at ragged offsets of the packed tensors, with one length per entry. A graph is built
for those bounds, not for the lengths: the lengths and offsets are tensors it reads when it
runs. The bounds come from the block's shapes, not its lengths (``s_max`` the power of two
that holds every row, the entries a power of two of at least 64, the row counts to 4
significant bits for the backward's workspace), so one forward and one backward graph serve
every batch of a size in a stream of new batches, where the dense kernel builds a graph per
new call size. Unused entries and rows cost nothing measurable (docs/design.md §8.8).

Note [rows that see no key]
cuDNN's padding mask with a bottom-right diagonal does not support a segment with more
queries than keys (its first queries see no key), and a segment without keys has no softmax.
The contract wants ``out = 0``, ``lse = -inf`` and no gradient for such rows. So each
segment's query rows are trimmed on the device to those that see a key, before cuDNN sees
them:

    keys   k k k                 (3 keys, bottom-right: query j sees keys up to j - 2)
    rows   q q q q q      ->     q q | q q q     the first 2 rows leave the segment
                                 ^^^ out 0, lse -inf (written before the call)

and the results start out as 0 (-inf for the lse), which is what the rows outside every
trimmed segment keep (with one segmentation whose end is known, only the rows after that end:
:func:`rows_written`). No host sync: the trimmed lengths and offsets are tensor ops on
``cu_q``/``cu_k``, and every bound the graph needs comes from shapes.

Note [a bottom-right diagonal as two top-left calls]
cuDNN skips the masked tiles of a causal block only with its diagonal aligned top-left
(bottom-right runs far slower: docs/design.md §8.8). A causal segment whose queries and keys are one
range (single device, the local region) is the same either way. A ring step's causal
segments can have more keys than queries; each is cut where its diagonal starts, into a
full rectangle and a top-left causal square, one call each over all segments, merged by lse:

    keys   k k k k k k          (6 keys, 3 trimmed queries)
    rows   q q q      ->  A: q q q x k k k   full          B: q q q x k k k   causal, top-left
                             (the first 3 keys)               (the last 3 keys)

A segment without a rectangle has no keys in A, so its rows leave A (its lse -inf there).
Where every segment with queries and keys has as many of each (``BlockSpec.equal_lengths``:
the own ring step), no segment has a rectangle and the square alone is one top-left call.

Note [a backward in chunks of documents]
cuDNN's backward takes a workspace that grows with the rows of the call and the width of the
packed rows (an fp32 dQ accumulator and, under GQA, fp32 dK and dV for every query head,
addressed by the ragged offsets): over a whole batch, more than twice the bytes of q, k, v and
dout (docs/design.md §8.8). Documents do not see each other, so where the host knows the
block's segmentation and the workspace would exceed ``WORKSPACE_SHARE`` of those bytes, the
backward runs over consecutive segments at a time, each chunk on row views of the packed
tensors starting at its first query row and its first key row, through a graph sized for at
most ``limit`` rows:

    rows    [ d0 d0 d0 | d1 d1 | d2 d2 d2 d2 d2 d2 | d3 ]
    chunks    [ d0 d1 ]          [ d2 ]              [ d3 ]     (d2 alone is longer than limit)

The host knows the segmentation (``HOST_READS.values``) of a single device's ``cu_seqlens``,
read once for its checks, and of every block under context parallelism: the local region's and
the ring steps' segmentations are views of the schedule's tables, which the host derived and
copied to the device (prepared.device_tables keeps their host copy, eager and in a compiled
graph's tables op). A ring step's queries and keys are segmented apart (the stream's queries
against another rank's keys, pad rows without keys, pad keys without queries): a chunk takes
the same segments on both sides, its query rows and its key rows each consecutive, so each
document's queries meet its keys in one chunk and its gradients are whole; a chunk in which no
segment has both queries and keys (pad rows, pad keys) has no gradient to give and does not
run. The backward is given the merged out and lse (a ring step's: docs/design.md §4), and a
chunk takes its rows of them. A window by position (``q_positions``: a ring step's under a
window) runs whole.

A segment with more queries or keys than ``limit`` is a chunk of its own.

Note [a long document in tiles]
A segment longer than ``limit`` rows with as many queries as keys and no window (a whole
document, or a ring step's segment of as many queries as keys) runs in tiles: its rows cut
into pieces of ``limit``, each query piece against each key piece it sees, a causal square on
the diagonal and full rectangles below it. The backward is given the whole document's out
and lse, so each tile's gradients are its exact share (as a ring step's are), summed into the
document's rows:

    keys ->   p0  p1  p2
    p0        ◣
    p1        ■   ◣             ◣ causal square (top-left), ■ full rectangle
    p2        ■   ■   ◣

Another long segment (queries and keys of different lengths, or a window) runs whole in its
chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from hcp_compile.kernels.contract import BLOCK_MEMOS
from hcp_compile.kernels.contract import COPIES_KV, FILLS_OUTPUTS, HOST_READS, BlockRequest, BlockSpec
from hcp_compile.kernels.merge import accumulate, merge_partials
from hcp_compile.kernels.window_pieces import PieceKind, reversed_rows, window_pieces

# the name nvidia-cudnn-frontend installs its module under
FRONTEND_MODULE = "cudnn"
INSTALL_HINT = ("pip install nvidia-cudnn-frontend (a dependency of hcp_compile on Linux; "
                "reinstall hcp_compile to bring it)")
# cuDNN's fused attention for fp16/bf16 runs from Ampere on
MIN_CAPABILITY = (8, 0)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128
# chunks of the backward span at least this many rows (smaller ones would cost speed for little memory)
MIN_CHUNK_ROWS = 4096
# the smallest bucket of entries: batches of up to this many documents share a graph
MIN_ENTRIES = 64
# the smallest s_max: cuDNN's graphs for fewer rows take other paths (a 1-row graph failed the
# reference checks), and a bound costs nothing where no entry reaches it
MIN_SEGMENT_ROWS = 128
# the backward's row-count bound kept to this many significant bits (at most 1/8 more
# workspace than the call needs, 8 buckets per octave of rows)
ROW_BOUND_BITS = 4
# graphs kept per process; each is a few MiB of host memory and its plan
MAX_GRAPHS = 64
# a backward's workspace may take this share of the bytes of its q, k, v and dout before the
# call runs in chunks of documents (Note [a backward in chunks of documents])
WORKSPACE_SHARE = 0.15
# blocks whose calls are kept (small int tensors each): a schedule's ring steps and local region
# for a few batches
CACHED_BLOCKS = 256
_NO_WINDOW_BY_POSITION = (
    "cannot apply a window by position (a ring step's, under context parallelism with a ring of "
    "several ranks) unless it is causal with a left bound, window_size=(left, 0)"
)


@functools.cache
def frontend() -> tuple[Any | None, str | None]:
    """``(the cudnn module, None)``, or ``(None, why not)`` when the package is not installed
    or does not load."""
    if importlib.util.find_spec(FRONTEND_MODULE) is None:
        return None, f"needs the nvidia-cudnn-frontend package: {INSTALL_HINT}"
    try:
        module = importlib.import_module(FRONTEND_MODULE)
        module.backend_version()
    except Exception as error:  # a broken install must not break the other kernels
        return None, f"needs a working nvidia-cudnn-frontend package (importing it raised {error!r})"
    return module, None


def bucket(count: int, floor: int) -> int:
    """The power of two at least ``count`` and ``floor``."""
    return max(floor, 1 << max(count - 1, 0).bit_length())


def row_bound(rows: int, bits: int = ROW_BOUND_BITS) -> int:
    """``rows`` rounded up to ``bits`` significant bits (at least 1)."""
    rows = max(rows, 1)
    step = 1 << max(rows.bit_length() - bits, 0)
    return -(-rows // step) * step


@dataclass(frozen=True)
class Mask:
    """One call's mask: cuDNN's diagonal band (see :func:`mask_bounds`) and its alignment."""

    left: int | None
    right: int | None
    bottom_right: bool


def mask_bounds(spec: BlockSpec) -> tuple[int | None, int | None]:
    """cuDNN's ``(left, right)`` diagonal band, aligned bottom-right: ``left`` keys up to and
    including the diagonal, ``right`` keys after it; None: unbounded. Flash's window counts
    the keys before the diagonal, so its left size is one less."""
    right = 0 if spec.causal else (spec.window_right if spec.window_right >= 0 else None)
    left = spec.window_left + 1 if spec.window_left >= 0 else None
    return left, right


@dataclass(frozen=True)
class Ragged:
    """One block as cuDNN's ragged entries: per entry its trimmed query rows and its keys
    (lengths ``[entries, 1, 1, 1]`` int32) and where they start (in rows, ``[entries + 1]``
    int64; unused entries empty at the end)."""

    q_lengths: Tensor
    k_lengths: Tensor
    q_starts: Tensor
    k_starts: Tensor


def ragged(spec: BlockSpec, entries: int) -> Ragged:
    """The block's segments as ``entries`` ragged entries under one bottom-right mask, each
    segment's rows trimmed to those that see a key (Note [rows that see no key]); tensor ops
    only."""
    cu_q, cu_k = spec.cu_q.long(), spec.cu_k.long()
    lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
    blind = _blind_rows(lengths_q, lengths_k, mask_bounds(spec)[1])
    return _entries(cu_q[:-1] + blind, lengths_q - blind, cu_k[:-1], lengths_k, cu_q[-1:], cu_k[-1:], entries)


def split_causal(spec: BlockSpec, entries: int) -> tuple[Ragged, Ragged]:
    """A causal block's segments as two sets of entries, each segment's trimmed rows against
    the keys before its diagonal (a full rectangle) and against the rest (a causal square,
    top-left): Note [a bottom-right diagonal as two top-left calls]."""
    cu_q, cu_k = spec.cu_q.long(), spec.cu_k.long()
    lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
    blind = _blind_rows(lengths_q, lengths_k, 0)
    rows, starts = lengths_q - blind, cu_q[:-1] + blind  # rows <= keys: each sees the first key
    before = lengths_k - rows  # keys before the diagonal
    ends = cu_q[-1:], cu_k[-1:]
    rectangle = _entries(starts, torch.where(before > 0, rows, 0), cu_k[:-1], before, *ends, entries)
    square = _entries(starts, rows, cu_k[:-1] + before, rows, *ends, entries)
    return rectangle, square


def _blind_rows(lengths_q: Tensor, lengths_k: Tensor, right: int | None) -> Tensor:
    """Per segment, its first rows that see no key, bottom-right (row ``j`` sees keys up to
    ``j - (Lq - Lk) + right``)."""
    if right is None:  # every row of a segment with keys sees them all or a window of them
        return torch.where(lengths_k == 0, lengths_q, torch.zeros_like(lengths_q))
    blind = (lengths_q - lengths_k - right).clamp(min=0)
    return torch.where(lengths_k == 0, lengths_q, blind.minimum(lengths_q))


def _entries(q_starts: Tensor, q_lengths: Tensor, k_starts: Tensor, k_lengths: Tensor, q_end: Tensor,
             k_end: Tensor, entries: int) -> Ragged:
    """Segments as ``entries`` ragged entries, the unused ones empty at the ends."""
    unused = entries - q_lengths.shape[0]
    as_entries = lambda t: torch.nn.functional.pad(t, (0, unused)).to(torch.int32).view(entries, 1, 1, 1)  # noqa: E731
    return Ragged(as_entries(q_lengths), as_entries(k_lengths), torch.cat([q_starts, q_end.expand(unused + 1)]),
                  torch.cat([k_starts, k_end.expand(unused + 1)]))


def call_masks(spec: BlockSpec) -> list[Mask]:
    """The masks of a block's cuDNN calls, merged by lse when several: one, top-left where every
    segment's queries and keys are one range or equally many (``spec.equal_lengths``); a causal
    block without a window otherwise two top-left calls (Note [a bottom-right diagonal as two
    top-left calls]); any other block one bottom-right call (a window on the diagonal; without
    a band the alignment does not matter). Shapes only: the advisor counts a rank's calls by it."""
    left, right = mask_bounds(spec)
    if spec.q_positions is not None:  # Note [a window by position as pieces]: typically a band, a full, a tail
        return [Mask(left, right, False), Mask(None, None, False), Mask(None, None, False), Mask(None, 0, False)]
    if spec.one_segmentation or spec.equal_lengths or right is None:
        return [Mask(left, right, False)]
    if right == 0 and left is None:
        return [Mask(None, None, False), Mask(None, 0, False)]
    return [Mask(left, right, True)]


def block_calls(spec: BlockSpec, entries: int) -> list[tuple[Mask, Ragged]]:
    """The cuDNN calls of a block (:func:`call_masks`) with their ragged entries."""
    masks = call_masks(spec)
    if len(masks) == 2:
        return list(zip(masks, split_causal(spec, entries)))
    return [(masks[0], ragged(spec, entries))]


@dataclass(frozen=True)
class Shape:
    """What a graph is built for: everything but the lengths and offsets."""

    device: int
    dtype: torch.dtype
    heads_q: int
    heads_kv: int
    head_dim: int
    entries: int
    segment_rows: int
    rows_q: int
    rows_k: int
    mask: Mask
    scale: float

    @classmethod
    def of(cls, q: Tensor, k: Tensor, spec: BlockSpec, mask: Mask, rows: int = 0) -> "Shape":
        """The shape of a call of ``spec`` over ``q`` and ``k``, its bounds sized for at least
        ``rows`` rows (the chunks of a backward share a graph: Note [a backward in chunks of
        documents])."""
        rows_q, rows_k = max(q.shape[0], rows), max(k.shape[0], rows)
        return cls(q.device.index or 0, q.dtype, q.shape[1], k.shape[1], q.shape[2], entries_for(spec),
                   bucket(max(rows_q, rows_k), MIN_SEGMENT_ROWS), row_bound(rows_q), row_bound(rows_k), mask,
                   float(spec.scale))


def entries_for(spec: BlockSpec) -> int:
    """The entries of a block's graphs: its segment count's bucket."""
    return bucket(spec.cu_q.shape[0] - 1, MIN_ENTRIES)


class _Graphs:
    """The built graphs by :class:`Shape` (forward and backward apart), least recently used
    dropped past ``MAX_GRAPHS``, and one cuDNN handle per device."""

    def __init__(self) -> None:
        self._graphs: dict[tuple[bool, Shape], "_Graph"] = {}
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()

    def get(self, shape: Shape, backward: bool) -> "_Graph":
        with self._lock:
            key = (backward, shape)
            graph = self._graphs.pop(key, None)
            if graph is None:
                graph = _Graph(shape, backward, self._handle(shape.device))
            self._graphs[key] = graph  # most recently used last
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
            return graph

    def _handle(self, device: int) -> Any:
        if device not in self._handles:
            with torch.cuda.device(device):
                self._handles[device] = frontend()[0].create_handle()
        return self._handles[device]

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()


GRAPHS = _Graphs()


class _Graph:
    """One built forward or backward graph and its named tensors."""

    def __init__(self, shape: Shape, backward: bool, handle: Any) -> None:
        cudnn = frontend()[0]
        self.handle = handle
        io_type = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[shape.dtype]
        graph = cudnn.pygraph(io_data_type=io_type, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        b, s, d = shape.entries, shape.segment_rows, shape.head_dim

        def offsets(name: str) -> Any:
            return graph.tensor(name=name, dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                                data_type=cudnn.data_type.INT64)

        def lengths(name: str) -> Any:
            return graph.tensor(name=name, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)

        def rows(name: str, heads: int, width: int, offset: Any, data_type: Any = None) -> Any:
            # [entries, heads, s_max, width] over the packed [rows, heads, width] tensor
            tensor = graph.tensor(name=name, dim=[b, heads, s, width],
                                  stride=[s * heads * width, width, heads * width, 1], data_type=data_type or io_type)
            tensor.set_ragged_offset(offset)
            return tensor

        def mark_output(tensor: Any, like: Any, offset: Any) -> None:
            tensor.set_output(True).set_dim(list(like.dim)).set_stride(list(like.stride)).set_ragged_offset(offset)

        hq, hk = shape.heads_q, shape.heads_kv
        self.names = names = {n: offsets(n) for n in ("q_offsets", "k_offsets", "stats_offsets")}
        names["q_lengths"], names["k_lengths"] = lengths("q_lengths"), lengths("k_lengths")
        names["q"] = rows("q", hq, d, names["q_offsets"])
        names["k"] = rows("k", hk, d, names["k_offsets"])
        names["v"] = rows("v", hk, d, names["k_offsets"])
        mask = dict(use_padding_mask=True, seq_len_q=names["q_lengths"], seq_len_kv=names["k_lengths"],
                    diagonal_alignment=(cudnn.diagonal_alignment.BOTTOM_RIGHT if shape.mask.bottom_right
                                        else cudnn.diagonal_alignment.TOP_LEFT),
                    diagonal_band_left_bound=shape.mask.left, diagonal_band_right_bound=shape.mask.right,
                    attn_scale=shape.scale)
        stats_like = dict(dim=[b, hq, s, 1], stride=[s * hq, 1, hq, 1])
        if not backward:
            out, stats = graph.sdpa(name="forward", q=names["q"], k=names["k"], v=names["v"], generate_stats=True,
                                    **mask)
            mark_output(out, names["q"], names["q_offsets"])
            stats.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(stats_like["dim"]).set_stride(
                stats_like["stride"]).set_ragged_offset(names["stats_offsets"])
            names["out"], names["stats"] = out, stats
        else:
            names["out"] = rows("out", hq, d, names["q_offsets"])
            names["dout"] = rows("dout", hq, d, names["q_offsets"])
            names["stats"] = rows("stats", hq, 1, names["stats_offsets"], cudnn.data_type.FLOAT)
            dq, dk, dv = graph.sdpa_backward(
                name="backward", q=names["q"], k=names["k"], v=names["v"], o=names["out"], dO=names["dout"],
                stats=names["stats"], max_total_seq_len_q=shape.rows_q, max_total_seq_len_kv=shape.rows_k, **mask)
            for grad, like, offset in ((dq, "q", "q_offsets"), (dk, "k", "k_offsets"), (dv, "v", "k_offsets")):
                mark_output(grad, names[like], names[offset])
            names["dq"], names["dk"], names["dv"] = dq, dk, dv
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace_bytes = graph.get_workspace_size()

    def run(self, device: torch.device, tensors: dict[str, Tensor]) -> None:
        cudnn = frontend()[0]
        cudnn.set_stream(self.handle, torch.cuda.current_stream(device).cuda_stream)
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
        self.graph.execute({self.names[n]: t for n, t in tensors.items()}, workspace, handle=self.handle)


def _calls(spec: BlockSpec, q: Tensor, k: Tensor) -> list[tuple[Mask, dict[str, Tensor]]]:
    """Each cuDNN call of the block on its rows where they lie: its mask and its entries'
    lengths and offsets, derived once per ``spec.cache_key`` (the layers and the backward of
    one batch share them: 36 small ops for one call, 58 for a split block, that the host would
    otherwise issue again; eager ranks of a few ms per call wait on the host,
    docs/benchmarks.md)."""
    return _plan(spec, q, k)[0]


@dataclass(frozen=True)
class Tail:
    """One layer of a window by position's tail pieces (Note [a window by position as pieces]):
    the rows and keys it copies, each piece's in reverse, and the causal block they make."""

    rows: Tensor
    keys: Tensor
    spec: BlockSpec


def _plan(spec: BlockSpec, q: Tensor, k: Tensor) -> tuple[list[tuple[Mask, dict[str, Tensor]]], list[Tail]]:
    """The block's calls in place (:func:`_calls`) and, under a window by position, its tails."""
    def build() -> tuple[list[tuple[Mask, dict[str, Tensor]]], list[Tail]]:
        if spec.q_positions is None:
            return [(mask, _bound_tensors(q, k, entries)) for mask, entries in block_calls(spec, entries_for(spec))], []
        return _position_plan(spec, q, k)

    calls = BLOCK_MEMOS.memo("cudnn calls", CACHED_BLOCKS)
    return calls.get(spec, (q.shape[1], k.shape[1], q.shape[2], spec.equal_lengths), build)


def _position_plan(spec: BlockSpec, q: Tensor, k: Tensor) -> tuple[list[tuple[Mask, dict[str, Tensor]]], list[Tail]]:
    """A window by position's calls in place (bands, full pieces) and its tails, from the
    block's segments and positions read to the host once per ``cache_key`` (Note [a window by
    position as pieces])."""
    left, right = mask_bounds(spec)
    if left is None or right != 0:  # supports() refuses these; a direct call must not run them wrong
        raise ValueError(f"cudnn: a window by position must be causal with a left bound, got left {spec.window_left}, "
                         f"right {spec.window_right}, causal {spec.causal}")
    tables = (spec.cu_q, spec.cu_k, spec.q_positions, spec.k_positions)
    host = torch.cat([t.detach().long() for t in tables]).cpu().split([t.numel() for t in tables])  # one read
    pieces = window_pieces(*host, spec.window_left)
    device, entries = q.device, entries_for(spec)
    ends = spec.cu_q[-1:].long(), spec.cu_k[-1:].long()

    def cumulative(counts: Tensor) -> Tensor:
        return torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(device, torch.int32)

    calls, tails = [], []
    for kind, layer in pieces.groups():
        group = pieces.select(kind, layer)
        if kind is PieceKind.TAIL:
            tails.append(Tail(
                reversed_rows(group.q_start, group.q_rows).to(device),
                reversed_rows(group.k_start, group.k_rows).to(device),
                BlockSpec(cumulative(group.q_rows), cumulative(group.k_rows), int(group.q_rows.max()),
                          int(group.k_rows.max()), True, spec.scale,
                          cache_key=BLOCK_MEMOS.derived_key(spec.cache_key),
                          # a chunk's first W rows against the last W keys of the chunk before
                          equal_lengths=bool((group.q_rows == group.k_rows).all()))))
            continue
        square = group.q_rows == group.k_rows
        masks = ([(Mask(left, 0, False), square), (Mask(left, 0, True), ~square)] if kind is PieceKind.BAND
                 else [(Mask(None, None, False), torch.ones_like(square))])
        for mask, chosen in masks:
            if chosen.any():
                columns = (group.q_start, group.q_rows, group.k_start, group.k_rows)
                q_starts, q_rows, k_starts, k_rows = (c[chosen].to(device) for c in columns)
                calls.append((mask, _bound_tensors(q, k, _entries(q_starts, q_rows, k_starts, k_rows, *ends, entries))))
    return calls, tails


def _bound_tensors(q: Tensor, k: Tensor, entries: Ragged) -> dict[str, Tensor]:
    """The lengths and element offsets of a call's ragged entries."""
    heads_q, heads_kv, dim = q.shape[1], k.shape[1], q.shape[2]
    return {
        "q_lengths": entries.q_lengths, "k_lengths": entries.k_lengths,
        "q_offsets": (entries.q_starts * (heads_q * dim)).view(-1, 1, 1, 1),
        "k_offsets": (entries.k_starts * (heads_kv * dim)).view(-1, 1, 1, 1),
        "stats_offsets": (entries.q_starts * heads_q).view(-1, 1, 1, 1),
    }


def rows_written(spec: BlockSpec) -> int | None:
    """The leading rows that cuDNN's one call writes in full, outputs and gradients, or None
    where that is not known: with one segmentation for queries and keys every row in a segment
    sees itself (no row is trimmed: Note [rows that see no key]), and ``spec.covered_rows``
    says where the segments end. Only the rows after it then need their initial values, which
    saves zeroing every output on short-document batches (docs/design.md §8.8)."""
    if spec.covered_rows < 0 or not spec.one_segmentation or spec.q_positions is not None:
        return None
    return int(spec.covered_rows)


def initialized_after(shape: tuple[int, ...], like: Tensor, written: int | None, value: float = 0.0,
                      dtype: torch.dtype | None = None) -> Tensor:
    """A buffer for a call's output: ``value`` in its rows from ``written`` on (all of them
    where ``written`` is None), the rest left for the call to write."""
    dtype = dtype or like.dtype
    if written is None:
        return torch.full(shape, value, dtype=dtype, device=like.device)
    buffer = uninitialized(shape, like, dtype)
    buffer[written:].fill_(value)
    return buffer


def uninitialized(shape: tuple[int, ...], like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A buffer whose rows a call writes (:func:`rows_written`); the tests fill it with NaN
    instead, so that a row left unwritten shows."""
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def device_check(device: torch.device) -> str | None:
    """None where cuDNN's ragged attention runs right on the CUDA ``device``, else why not
    (:func:`checked_device`)."""
    if not torch.cuda.is_available():
        return "needs a CUDA device; none is available"
    return checked_device(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def checked_device(index: int) -> str | None:
    """None where cuDNN's ragged attention runs right on CUDA device ``index``, else why not.
    Right means: a small causal GQA batch (documents shorter and longer than a tile, one of
    one row) forward and backward within bf16 tolerance of the plain-PyTorch kernel. An older
    GPU, a cuDNN library without these graphs or a frontend that does not match it then
    leaves ``kernel="auto"`` to the other kernels instead of failing a call."""
    capability = torch.cuda.get_device_capability(index)
    if capability < MIN_CAPABILITY:
        return f"needs a GPU of compute capability {MIN_CAPABILITY} or later; device {index} has {capability}"
    try:
        with unset_fake_temporarily(), torch.no_grad():
            error = _largest_error_against_torch(torch.device("cuda", index))
    except Exception as failure:  # any failure of the library means: not on this device
        return f"failed its check on device {index} ({type(failure).__name__}: {failure})"
    if not error <= CHECK_TOLERANCE:
        return (f"failed its check on device {index}: results differ from the torch kernel by {error:.3g} "
                "of their largest value")
    return None


# the device check's largest difference of bf16 results from fp32 ones, relative to the largest value
CHECK_TOLERANCE = 2e-2


def _largest_error_against_torch(device: torch.device) -> float:
    from hcp_compile.kernels.torch_kernel import TorchKernel  # the reference kernel, imported only for the check

    lengths = (1, 200, 57)
    generator = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(sum(lengths), 4, 64, generator=generator) for _ in range(2))
    k, v = (torch.randn(sum(lengths), 2, 64, generator=generator) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    spec = BlockSpec(cu, cu, max(lengths), max(lengths), True, 0.125)
    half = [t.to(device, torch.bfloat16) for t in (q, k, v, dout)]
    wide = [t.to(device) for t in (q, k, v, dout)]
    kernel, reference = CudnnKernel(), TorchKernel()
    out, lse = kernel.forward(*half[:3], spec)
    got = (out, *kernel.backward(half[3], *half[:3], out, lse, spec))
    out_ref, lse_ref = reference.forward(*wide[:3], spec)
    expected = (out_ref, *reference.backward(wide[3], *wide[:3], out_ref, lse_ref, spec))
    return max(float((a.float() - b).abs().max() / b.abs().max()) for a, b in zip(got, expected))


class CudnnKernel:
    name = "cudnn"
    masks_by_position = True  # a causal window, in pieces (Note [a window by position as pieces])
    wrapper_passes = frozenset({COPIES_KV, FILLS_OUTPUTS})  # q, k, v.contiguous(), initialized_after

    def calls(self, spec: BlockSpec) -> int:
        return len(call_masks(spec))

    def supports(self, request: BlockRequest) -> str | None:
        _, missing = frontend()
        if missing is not None:
            return missing
        if not (request.device.type == "cuda" and request.dtype in SUPPORTED_DTYPES
                and request.head_dim % 16 == 0 and request.head_dim <= MAX_HEAD_DIM):
            return (f"needs CUDA tensors in fp16/bf16 with head_dim a multiple of 16 and at most {MAX_HEAD_DIM}; "
                    f"got {request.dtype} on {request.device} with head_dim {request.head_dim}")
        left, right = request.window
        if request.window_by_position and not (left >= 0 and right == 0):
            return _NO_WINDOW_BY_POSITION
        if left >= 0 and right != 0:
            return ("cannot apply a window with keys on both sides of the diagonal (cuDNN's left bound "
                    "needs a causal mask)")
        return device_check(request.device)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: BlockSpec) -> tuple[Tensor, Tensor]:
        if not (q.shape[0] and k.shape[0]):
            return torch.zeros_like(q), q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = lse = None
        written = rows_written(spec)
        calls, tails = _plan(spec, q, k)
        for mask, bounds in calls:
            part_out = initialized_after(q.shape, q, written)
            stats = initialized_after((q.shape[0], q.shape[1]), q, written, float("-inf"), torch.float32)
            GRAPHS.get(Shape.of(q, k, spec, mask), backward=False).run(q.device, {
                **bounds, "q": q, "k": k, "v": v, "out": part_out, "stats": stats})
            out, lse = merge_partials(out, lse, part_out, stats.t(), q.dtype)
        if out is None:  # a window by position with no piece in place
            out, lse = torch.zeros_like(q), q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
        for tail in tails:
            tail_out, tail_lse = self.forward(q[tail.rows], k[tail.keys], v[tail.keys], tail.spec)
            out[tail.rows], lse[:, tail.rows] = merge_partials(out[tail.rows], lse[:, tail.rows], tail_out, tail_lse,
                                                               q.dtype)
        return out.contiguous(), lse.contiguous()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        spec: BlockSpec,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if not (q.shape[0] and k.shape[0]):
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
        chunks = backward_chunks(spec, q, k)
        if chunks is None:
            calls, tails = _plan(spec, q, k)
            grads = _backward_block(dout, q, k, v, out, lse, spec, calls=calls)
            if grads[0] is None:  # a window by position with no piece in place
                grads = tuple(torch.zeros_like(t) for t in (q, k, v))
            for tail in tails:
                shares = self.backward(dout[tail.rows], q[tail.rows], k[tail.keys], v[tail.keys], out[tail.rows],
                                       lse[:, tail.rows], tail.spec)
                for grad, share, where in zip(grads, shares, (tail.rows, tail.keys, tail.keys)):
                    grad[where] = grad[where] + share  # a layer's rows and keys are distinct: no index_add
            return grads
        # zeros: rows outside every chunk lie outside every segment, and a chunk's call writes
        # its gradients into these rows in place
        grads = tuple(torch.zeros_like(t) for t in (q, k, v))
        for chunk in chunks:
            rows, keys = chunk.q_rows, chunk.k_rows
            views = (grads[0][rows], grads[1][keys], grads[2][keys])
            if not chunk.tiles:
                _backward_block(dout[rows], q[rows], k[keys], v[keys], out[rows], lse[:, rows], chunk.spec,
                                chunk.bound, into=views)
            for tile in chunk.tiles:  # each tile's share of the document's gradients, summed
                tile_rows, tile_keys = _within(rows, tile.q_rows), _within(keys, tile.k_rows)
                shares = _backward_block(dout[tile_rows], q[tile_rows], k[tile_keys], v[tile_keys], out[tile_rows],
                                         lse[:, tile_rows], tile.spec, chunk.bound)
                for view, share, where in zip(views, shares, (tile.q_rows, tile.k_rows, tile.k_rows)):
                    view[where] += share
        return grads


def _within(outer: slice, inner: slice) -> slice:
    """``inner`` (relative to ``outer``'s start) as absolute rows."""
    return slice(outer.start + inner.start, outer.start + inner.stop)


def _backward_block(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: BlockSpec,
                    rows: int = 0, into: tuple[Tensor, Tensor, Tensor] | None = None,
                    calls: list[tuple[Mask, dict[str, Tensor]]] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of one block's ``calls`` in place (default: :func:`_calls`), one per mask,
    through graphs sized for at least ``rows`` rows; with ``into`` (zeroed buffers), the
    gradients are written there."""
    # rows outside every call's entries are not read; a row whose merged lse is -inf (no
    # key in any block) is outside them (Note [rows that see no key])
    stats = lse.t().float().contiguous()
    dq = dk = dv = None
    written = rows_written(spec)
    calls = _calls(spec, q, k) if calls is None else calls
    for mask, bounds in calls:
        in_place = into is not None and len(calls) == 1
        grads = into if in_place else tuple(initialized_after(t.shape, t, written) for t in (q, k, v))
        GRAPHS.get(Shape.of(q, k, spec, mask, rows), backward=True).run(q.device, {
            **bounds, "q": q, "k": k, "v": v, "out": out, "dout": dout, "stats": stats,
            "dq": grads[0], "dk": grads[1], "dv": grads[2]})
        # the calls' keys are disjoint (exact sums); their rows are not, summed in fp32
        dq = accumulate(dq, grads[0], q.dtype)
        dk, dv = (grads[1], grads[2]) if dk is None else (dk + grads[1], dv + grads[2])
    if into is not None and len(calls) > 1:
        for buffer, grad in zip(into, (dq, dk, dv)):
            buffer.copy_(grad)
    return dq, dk, dv


@dataclass(frozen=True)
class Tile:
    """Query rows against key rows of one document (relative to its chunk) and their spec."""

    q_rows: slice
    k_rows: slice
    spec: BlockSpec


@dataclass(frozen=True)
class Chunk:
    """Consecutive segments of a block: their query rows, their key rows, the block spec of the
    row views (segments from 0 on both sides, one segmentation kept), the rows its graphs are
    sized for, and for a segment longer than that, the tiles it runs in (Note [a long document
    in tiles])."""

    q_rows: slice
    k_rows: slice
    spec: BlockSpec
    bound: int
    tiles: tuple[Tile, ...] = ()


def document_chunks(cu_q: Sequence[int], cu_k: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive segments ``[first, stop)`` grouped greedily, each group spanning at most
    ``limit`` query rows and ``limit`` key rows unless it is one segment longer than that."""
    groups, first = [], 0
    for stop in range(2, len(cu_q)):
        if cu_q[stop] - cu_q[first] > limit or cu_k[stop] - cu_k[first] > limit:
            groups.append((first, stop - 1))
            first = stop - 1
    groups.append((first, len(cu_q) - 1))
    return groups


def backward_chunks(spec: BlockSpec, q: Tensor, k: Tensor) -> list[Chunk] | None:
    """The chunks a backward of ``spec`` runs in, None where it runs whole: its workspace fits
    ``WORKSPACE_SHARE`` of its inputs' bytes, the host does not know its segmentation
    (``HOST_READS``: a single device's checked ``cu_seqlens``, or a schedule's tables), or its
    window is by position (Note [a backward in chunks of documents])."""
    host_q, host_k = HOST_READS.values(spec.cu_q), HOST_READS.values(spec.cu_k)
    if host_q is None or host_k is None or spec.q_positions is not None:
        return None
    rows = max(q.shape[0], k.shape[0])
    per_row = workspace_per_row(Shape.of(q, k, spec, call_masks(spec)[0]))
    budget = WORKSPACE_SHARE * 2 * (q.nbytes + k.nbytes)  # q and dout, k and v
    limit = max(int(budget // per_row), MIN_CHUNK_ROWS)
    if limit >= rows:
        return None
    chunks = BLOCK_MEMOS.memo("cudnn chunks", CACHED_BLOCKS)
    return chunks.get(spec, (q.shape[0], k.shape[0], limit), lambda: _chunks(spec, host_q, host_k, limit))


_PER_ROW: dict[Shape, float] = {}


def workspace_per_row(shape: Shape) -> float:
    """The backward workspace per row of calls like ``shape``, read off the graph of a call of
    ``MIN_CHUNK_ROWS`` rows (it grows with the rows: Note [a backward in chunks of documents])."""
    probe = dataclasses.replace(shape, entries=MIN_ENTRIES, segment_rows=bucket(MIN_CHUNK_ROWS, MIN_SEGMENT_ROWS),
                                rows_q=MIN_CHUNK_ROWS, rows_k=MIN_CHUNK_ROWS)
    if probe not in _PER_ROW:
        _PER_ROW[probe] = max(GRAPHS.get(probe, backward=True).workspace_bytes / MIN_CHUNK_ROWS, 1.0)
    return _PER_ROW[probe]


def _chunks(spec: BlockSpec, cu_q: Tensor, cu_k: Tensor, limit: int) -> list[Chunk]:
    """The chunks of :func:`backward_chunks` from the host values of the segmentations, those
    in which no segment has both queries and keys left out (they have no gradient to give)."""
    chunks = []
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for first, stop in document_chunks(cu_q, cu_k, limit):
        if not any(cu_q[i + 1] > cu_q[i] and cu_k[i + 1] > cu_k[i] for i in range(first, stop)):
            continue
        rows, keys = slice(cu_q[first], cu_q[stop]), slice(cu_k[first], cu_k[stop])
        length_q, length_k = rows.stop - rows.start, keys.stop - keys.start
        segments_q = spec.cu_q[first:stop + 1] - rows.start
        segments_k = segments_q if spec.one_segmentation else spec.cu_k[first:stop + 1] - keys.start
        chunk_spec = dataclasses.replace(
            spec, cu_q=segments_q, cu_k=segments_k, covered_rows=length_q,
            cache_key=BLOCK_MEMOS.derived_key(spec.cache_key))
        long = stop - first == 1 and max(length_q, length_k) > limit
        tiles = document_tiles(chunk_spec, length_q, limit) if long and tileable(spec, length_q, length_k) else ()
        chunks.append(Chunk(rows, keys, chunk_spec, limit, tiles))
    return chunks


def tileable(spec: BlockSpec, length_q: int, length_k: int) -> bool:
    """Whether one segment of ``spec`` with ``length_q`` queries and ``length_k`` keys can run
    in tiles: as many queries as keys (a causal diagonal is then the same aligned top-left or
    bottom-right, and the queries' pieces are the keys') and no window bounds it (a tile is
    then a full rectangle or a causal square)."""
    return length_q == length_k and spec.q_positions is None and not spec.windowed


def document_tiles(spec: BlockSpec, rows: int, size: int) -> tuple[Tile, ...]:
    """The tiles of one document of ``rows`` rows (``spec``: its chunk, one segment from 0):
    pieces of ``size`` rows, each query piece against each key piece it sees (Note [a long
    document in tiles]). The tiles' segmentations come from ``spec.cu_q`` on the device."""
    pieces = [slice(start, min(start + size, rows)) for start in range(0, rows, size)]
    segmentations: dict[int, Tensor] = {}
    specs: dict[tuple[int, int, bool], BlockSpec] = {}  # tiles of one shape share a spec and its cache key

    def segmentation(length: int) -> Tensor:  # [0, length], from the chunk's [0, rows]
        if length not in segmentations:
            segmentations[length] = spec.cu_q.clamp(max=length)
        return segmentations[length]

    def tile_spec(rows_q: int, rows_k: int, diagonal: bool) -> BlockSpec:
        if (rows_q, rows_k, diagonal) not in specs:
            cu_q = segmentation(rows_q)
            specs[rows_q, rows_k, diagonal] = dataclasses.replace(
                spec, cu_q=cu_q, cu_k=cu_q if diagonal else segmentation(rows_k), causal=spec.causal and diagonal,
                max_q=rows_q, max_k=rows_k, covered_rows=rows_q, equal_lengths=diagonal,
                cache_key=BLOCK_MEMOS.derived_key(spec.cache_key))
        return specs[rows_q, rows_k, diagonal]

    return tuple(Tile(query, key, tile_spec(query.stop - query.start, key.stop - key.start, i == j))
                 for i, query in enumerate(pieces) for j, key in enumerate(pieces) if not (spec.causal and j > i))
