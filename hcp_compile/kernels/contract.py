"""The kernel contract's types: what one block is (:class:`BlockSpec`), what a call asks of a
kernel (:class:`BlockRequest`) and what a kernel is (:class:`Kernel`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, fields
from typing import Protocol, TypeVar

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary


@dataclass(frozen=True)
class BlockSpec:
    """One attention block besides q, k, v: query segment ``i`` (rows ``cu_q[i]:cu_q[i+1]``)
    attends to key segment ``i`` under the causal mask and the window.

    ``q_positions``/``k_positions``, when given, are the rows' positions inside their
    documents (a ring step under a window passes them); otherwise positions are the offsets
    inside the segment, aligned bottom-right (flash's convention when a segment has more keys
    than queries). ``max_q``/``max_k`` bound the segment lengths. ``cache_key`` names the
    values of ``cu_q``, ``cu_k`` and the positions: blocks with the same key (and the same
    causal flag and window) have the same values, so a kernel may cache what it derives from
    them across layers and the backward; -1: derive it per call. The keys come from
    :func:`new_cache_key`, handed out per batch by the batch cache (``hcp_compile.batch.cache``:
    the values read on the host name the batch, eager or compiled, whose buffers Inductor
    reuses for other values, and single-device calls). ``equal_lengths``: every
    segment that has both queries and keys has as many of each (the own ring step, whose
    ``cu_q`` and ``cu_k`` differ only in their pad segments), so the causal diagonal is the same
    aligned top-left or bottom-right; a kernel may use it to take the cheaper one.
    ``covered_rows``: ``cu_q``'s last entry, known on the host (a single device's checked
    batch, the local region; -1: not known): q's rows from there on lie outside every segment,
    and so do k's where ``cu_k`` is ``cu_q`` (:meth:`one_segmentation`). With one segmentation
    every row before it sees at least itself, so a kernel that writes every row of its
    segments need initialize only the rows after it.

    Rows outside every segment (past ``cu_q``'s or ``cu_k``'s last entry; every row where all
    segments are empty, a ring step the window skips in a compiled graph) see nothing and are
    seen by nothing: such a query row gets out 0, lse -inf and no gradient, such a key row no
    gradient, and it changes no other row's results. Every kernel keeps to that on its own
    (flash by a pass on the device where the host does not know where the segments end). Where
    the host knows it (:meth:`segment_ends`), the ops (``hcp::block_forward/backward``) also
    write those rows' results themselves, in place and inside the op, so a compiled graph holds
    no copy for them and a kernel may leave them as they are (flash leaves them unwritten), and
    a block with no query or no key inside its segments calls no kernel at all."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int | torch.SymInt
    max_k: int | torch.SymInt
    causal: bool
    scale: float
    window_left: int = -1
    window_right: int = -1
    q_positions: Tensor | None = None
    k_positions: Tensor | None = None
    cache_key: int = -1
    equal_lengths: bool = False
    covered_rows: int | torch.SymInt = -1

    def op_args(self) -> tuple:
        """The fields in order, as ``hcp::block_forward/backward`` take them (a custom op's
        schema has flat arguments)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def from_op_args(cls, args: tuple | list) -> "BlockSpec":
        """Inverse of :meth:`op_args`."""
        return cls(*args)

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    def segment_ends(self) -> tuple[int | None, int | None]:
        """``(q_end, k_end)``: ``cu_q``'s and ``cu_k``'s last entries, the first rows of q and
        k outside every segment, where the host knows them without reading the device:
        :attr:`covered_rows` (for k too with :attr:`one_segmentation`), else the host copy of a
        table copied to the device (:data:`HOST_READS`: a schedule's segmentations); None where
        it does not."""
        q_end = k_end = None
        if self.covered_rows >= 0:
            q_end = int(self.covered_rows)
            k_end = q_end if self.one_segmentation else None
        if q_end is None:
            q_end = _last_value(self.cu_q)
        if k_end is None:
            k_end = _last_value(self.cu_k)
        return q_end, k_end

    @property
    def one_segmentation(self) -> bool:
        """Whether ``cu_q`` and ``cu_k`` are one tensor (self-attention of whole documents), so
        every segment has as many queries as keys; known without reading the values."""
        cu_q, cu_k = self.cu_q, self.cu_k
        return (cu_q.data_ptr() == cu_k.data_ptr() and cu_q.shape == cu_k.shape and cu_q.stride() == cu_k.stride()
                and cu_q.dtype == cu_k.dtype)


def _last_value(cu: Tensor) -> int | None:
    """The last entry of the segmentation ``cu`` where the host knows its values."""
    values = HOST_READS.values(cu)
    return None if values is None or values.numel() == 0 else int(values[-1])


_next_cache_key = 0
_cache_keys_lock = threading.Lock()
T = TypeVar("T")


def new_cache_key(count: int = 1) -> int:
    """The first of ``count`` consecutive :attr:`BlockSpec.cache_key` values never handed out
    before in this process."""
    global _next_cache_key
    with _cache_keys_lock:
        first = _next_cache_key
        _next_cache_key += count
    return first


class HostReads:
    """What the host knows of a device tensor's values without reading it: what was read to the
    host from it, kept per tensor and version while the tensor lives (a batch's ``cu_seqlens``
    is read once for its checks: prepared.host_values), and the host copies of tables copied
    to the device (a schedule's segmentations: prepared.device_tables), kept while the device
    table's storage lives, which a kernel finds for any view of them (:meth:`values`).

    Each is put with its owner, what the batch cache (``hcp_compile.batch.cache``) names a
    batch by, which owns the one instance, :data:`HOST_READS`: it drops what a batch owns when
    it forgets the batch (:meth:`drop`), and everything on ``clear_batch_cache``.

    A table is found by its storage because the views a kernel gets are other tensors: the
    schedule's split of the flat table eagerly, and in a compiled graph aliases that Inductor
    makes of the tables op's output. The tables are only ever read, so their storage holds the
    copied values for as long as any view of it reaches a kernel."""

    def __init__(self) -> None:
        self._reads = WeakIdKeyDictionary()  # tensor -> (version, read, owner)
        self._tables = WeakIdKeyDictionary()  # device storage -> (dtype, first element, host values, owner)
        self._lock = threading.Lock()

    def get(self, tensor: Tensor) -> object | None:
        """The read kept for ``tensor`` itself by :meth:`put` (None: none, or the tensor was
        written since)."""
        with self._lock:
            kept = self._reads.get(tensor)
        return kept[1] if kept is not None and kept[0] == tensor._version else None

    def put(self, tensor: Tensor, read: object, owner: Hashable) -> None:
        """Keep ``read`` for ``tensor`` as long as ``owner`` is kept: anything whose ``values``
        attribute is the host copy of the tensor's values (:meth:`values` answers with them)."""
        with self._lock:
            self._reads[tensor] = (tensor._version, read, owner)

    def put_table(self, tensor: Tensor, values: Tensor, owner: Hashable = None) -> None:
        """Keep ``values`` (on the host) as the values of the 1-D device table ``tensor``,
        copied from them and never written, for any view of it, as long as ``owner`` is kept
        (None: a table no batch owns, a kernel's own in a memo the batch cache drives: kept
        while the table lives, or until ``clear_batch_cache``)."""
        if tensor.dim() != 1 or tensor.shape != values.shape or not tensor.is_contiguous():
            raise ValueError(f"a table is a contiguous 1-D tensor of its values' length; got {tuple(tensor.shape)} "
                             f"with strides {tensor.stride()} for values of {tuple(values.shape)}")
        with self._lock:
            self._tables[tensor.untyped_storage()] = (tensor.dtype, tensor.storage_offset(), values, owner)

    def values(self, tensor: Tensor) -> Tensor | None:
        """The host values of the 1-D ``tensor``: the ``values`` of a read kept for it, or the
        slice of a table's host copy that it views; None where the host does not know them."""
        read = self.get(tensor)
        if read is not None:
            return read.values
        if tensor.dim() != 1 or (tensor.numel() > 1 and tensor.stride(0) != 1):
            return None
        with self._lock:
            table = self._tables.get(tensor.untyped_storage())
        if table is None:
            return None
        dtype, first, values, _ = table
        start = tensor.storage_offset() - first
        if tensor.dtype != dtype or start < 0 or start + tensor.numel() > values.numel():
            return None
        return values[start:start + tensor.numel()]

    def drop(self, owners: Collection[Hashable]) -> None:
        """Forget every read and table of one of ``owners``."""
        with self._lock:
            for kept in (self._reads, self._tables):
                for key in [key for key, entry in kept.items() if entry[-1] in owners]:
                    del kept[key]

    def clear(self) -> None:
        with self._lock:
            self._reads.clear()
            self._tables.clear()


HOST_READS = HostReads()


class SpecCache:
    """What a kernel derives from a block's segmentation, kept for the specs that have a
    :attr:`BlockSpec.cache_key` (the layers and the backward of one batch ask for the same
    blocks), the least recently used dropped beyond ``capacity`` entries or, with ``size_of``,
    beyond ``max_bytes`` (the newest entry always stays); derived per call for the others. The
    kernels' instances are :data:`BLOCK_MEMOS`'s, which the batch cache drives."""

    def __init__(self, capacity: int, max_bytes: int | None = None, size_of: Callable[[object], int] | None = None):
        self.capacity, self.max_bytes, self.size_of = capacity, max_bytes, size_of
        self._entries: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # CUDA's autograd thread runs kernels beside the user's

    def get(self, spec: BlockSpec, extra: tuple, build: Callable[[], T]) -> T:
        """``build()``, or its earlier result for the same ``cache_key``, device, mask constants
        and ``extra``."""
        if spec.cache_key < 0:
            return build()
        # the device too: what is kept holds tensors on the spec's device, and a single-device
        # call's key comes from cu_seqlens' values, which other devices' batches can share
        key = (spec.cache_key, spec.cu_q.device, spec.causal, spec.window_left, spec.window_right, *extra)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key][0]
        value = build()
        size = self.size_of(value) if self.size_of is not None else 0
        with self._lock:
            if key not in self._entries:
                self._entries[key] = (value, size)
                self._bytes += size
            while len(self._entries) > self.capacity or (
                self.max_bytes is not None and self._bytes > self.max_bytes and len(self._entries) > 1
            ):
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
        return value

    def drop(self, cache_keys: set[int]) -> None:
        """Forget what was derived for the blocks of ``cache_keys``."""
        with self._lock:
            for key in [key for key in self._entries if key[0] in cache_keys]:
                self._bytes -= self._entries.pop(key)[1]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        """The bytes of the entries kept, as ``size_of`` counts them."""
        return self._bytes


class BlockMemos:
    """The kernels' :class:`SpecCache` memos by name, and the cache keys a kernel derives from
    a block's (its chunks). Below the batch cache (``hcp_compile.batch.cache``), which owns the
    one instance, :data:`BLOCK_MEMOS`: it drops a batch's keys, with the keys derived from them,
    when it forgets the batch (:meth:`drop`), and everything on ``clear_batch_cache``."""

    def __init__(self) -> None:
        self._memos: dict[str, SpecCache] = {}
        self._derived_from: dict[int, int] = {}  # a derived cache key -> the key it came from
        self._lock = threading.Lock()

    def memo(self, name: str, capacity: int, max_bytes: int | None = None,
             size_of: Callable[[object], int] | None = None) -> SpecCache:
        """The memo ``name``, made with these bounds on first use."""
        with self._lock:
            if name not in self._memos:
                self._memos[name] = SpecCache(capacity, max_bytes, size_of)
            return self._memos[name]

    def derived_key(self, cache_key: int) -> int:
        """A fresh cache key for a block derived from the block ``cache_key``, dropped with it;
        -1 for -1."""
        if cache_key < 0:
            return -1
        fresh = new_cache_key()
        with self._lock:
            self._derived_from[fresh] = cache_key
        return fresh

    def drop(self, cache_keys: set[int]) -> None:
        """Forget what was derived for the blocks of ``cache_keys`` and of the keys derived from
        them."""
        with self._lock:
            dropped, grown = set(cache_keys), True
            while grown:
                derived = {key for key, source in self._derived_from.items() if source in dropped} - dropped
                dropped |= derived
                grown = bool(derived)
            for key in dropped:
                self._derived_from.pop(key, None)
            memos = list(self._memos.values())
        for memo in memos:
            memo.drop(dropped)

    def clear(self) -> None:
        with self._lock:
            self._derived_from.clear()
            memos = list(self._memos.values())
        for memo in memos:
            memo.clear()


BLOCK_MEMOS = BlockMemos()


@dataclass(frozen=True)
class BlockRequest:
    """What a call asks of a kernel, known before any block runs (for choosing one)."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    heads_q: int
    heads_kv: int
    window: tuple[int, int] = (-1, -1)
    # the window masks by positions inside the document, not inside the block's segments
    # (ring steps under context parallelism with a ring of several ranks)
    window_by_position: bool = False
    # the batch's composition where the caller knows it on the host: its number of documents
    # and the longest (``kernel="auto"`` judges a call by them; None: unknown)
    segments: int | None = None
    longest: int | None = None

    @classmethod
    def of(cls, q: Tensor, k: Tensor, window: tuple[int, int] = (-1, -1), *,
           window_by_position: bool = False, segments: int | None = None,
           longest: int | None = None) -> "BlockRequest":
        windowed = window != (-1, -1)
        return cls(q.device, q.dtype, int(q.shape[-1]), int(q.shape[1]), int(k.shape[1]),
                   window, window_by_position and windowed, segments, longest)


# the kernels' optional ``wrapper_passes`` (:class:`Kernel`)
COPIES_KV = "copies k, v"  # contiguous copies of the block's k and v (split views of one buffer)
FILLS_OUTPUTS = "fills outputs"  # initial values of the outputs, written in full


class Kernel(Protocol):
    """One attention kernel (one file in this package, registered in ``KERNELS``).

    ``forward(q [Tq, Hq, D], k, v [Tk, Hkv, D], spec) -> (out, lse)``: ``out [Tq, Hq, D]`` in
    q's dtype, ``lse [Hq, Tq]`` in the accumulation dtype (fp32; float64 for float64 inputs),
    natural log, both contiguous; a row with no visible key has ``out = 0``, ``lse = -inf``.
    ``backward(dout, q, k, v, out, lse, spec) -> (dq, dk, dv)`` in the inputs' dtypes, where
    ``out``/``lse`` may be the merge of several blocks (the ring backward passes the merged
    ones): the result is then this block's exact share of the merged attention's gradient;
    rows with ``lse = -inf`` get none. Hkv may divide Hq (GQA): kernels take the KV heads as
    they are, without repeating them.

    Optional, for the advisor's cost model (``hcp_advise``, which reads them with a default):
    ``calls(spec) -> int``, how many kernel invocations a block with queries and keys costs
    where that is more than one; ``wrapper_passes``, which full passes over a ring step's block
    the kernel adds around its calls (of :data:`COPIES_KV`, :data:`FILLS_OUTPUTS`; default
    none); ``short_segment_rows``, below how many query or key rows a segment runs in another,
    varlen kernel (default 0: none)."""

    name: str
    # whether it can mask a window by positions inside the document (a ring step under a
    # window, ``BlockRequest.window_by_position``), not only by offsets inside its segments
    masks_by_position: bool

    def supports(self, request: BlockRequest) -> str | None:
        """None when the kernel can run ``request``, else what it needs ("needs ...",
        "cannot ..."), said so that ``kernel=<name> <reason>`` reads as a sentence."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: BlockSpec) -> tuple[Tensor, Tensor]:
        ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        spec: BlockSpec,
    ) -> tuple[Tensor, Tensor, Tensor]:
        ...
