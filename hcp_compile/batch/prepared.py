"""Everything the host derives from one batch's ``cu_seqlens`` and the mesh shape, built in one
place and cached by value: :class:`PreparedBatch` (docs/design.md §2, §5.3, §9).

Eager CP, the compiled graph's host ops, ``shard_plan`` and the single-device op (the mesh-less
case) all read the batch from here: the checked host copy of ``cu_seqlens``, the layout, every
rank's sizes, each rank's tokens and its schedule tables.
A batch is found by the digest of its values and the mesh shape in the one batch cache
(hcp_compile/batch/cache.py), so a :class:`PreparedBatch` built ahead of time (``prepare_batch``
in a DataLoader worker: no process group needed, and it pickles) is taken as it is by every path
once ``shard_plan`` adopts it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from hcp_compile import validation
from hcp_compile.batch import layout, pickling
from hcp_compile.batch.cache import BATCHES
from hcp_compile.batch.layout import BatchLayout, RankSizes, StreamTokens
from hcp_compile.batch.placements import (
    DEFAULT_PLACEMENT, NO_WINDOW, check_layout_window, check_placement, placement_rule,
)
from hcp_compile.batch.schedule import RankPlan, ScheduleTables, gathers, plan_rank
from hcp_compile.exchange.schemes import DEFAULT_SCHEME, check_scheme
from hcp_compile.kernels.contract import HOST_READS
from hcp_compile.validation import Failure


@dataclass(frozen=True, eq=False)
class BatchValues:
    """One ``cu_seqlens`` as the host reads it, with the failures of its own rules (start at 0,
    never decrease), which need no mesh and no call."""

    values: Tensor  # [n + 1] int64 on the CPU
    digest: bytes  # SHA-256 of the values: what the caches and the fingerprint key on
    starts_at: int  # values[0]
    decrease: tuple[int, int, int] | None  # (i, values[i], values[i - 1]) of the first decrease
    num_tokens: int  # values[-1]
    longest: int  # the longest document (0 when the values decrease)

    @classmethod
    def of(cls, values: Tensor) -> "BatchValues":
        values = values.to(torch.int64).contiguous()
        lengths = values[1:] - values[:-1]
        drops = (lengths < 0).nonzero()
        decrease = None
        if drops.numel():
            i = int(drops[0]) + 1
            decrease = (i, int(values[i]), int(values[i - 1]))
        return cls(
            values, _digest(values), int(values[0]), decrease, int(values[-1]),
            int(lengths.max()) if lengths.numel() and decrease is None else 0,
        )

    def failures(self, argument: str) -> tuple[Failure, ...]:
        """The failed rules of the values themselves, naming them ``argument``."""
        return validation.cu_seqlens_failures(self, argument)


def _digest(values: Tensor) -> bytes:
    # SHA-256 is cheap beside the layout work and, unlike Python's hash, gives every
    # process the same value, which the fingerprint needs
    return hashlib.sha256(memoryview(values.numpy())).digest()


def host_values(cu_seqlens: Tensor) -> BatchValues:
    """The values of ``cu_seqlens`` (already checked by :func:`validation.check_cu_seqlens_dtype`),
    read to the host once per tensor and version (kept in ``HOST_READS``, where the kernels find
    them too, while the batch cache keeps a batch of these values)."""
    cached = HOST_READS.get(cu_seqlens)
    if cached is not None:
        return cached
    read = BatchValues.of(cu_seqlens.detach().to("cpu", torch.int64))
    HOST_READS.put(cu_seqlens, read, read.digest)
    return read


class Exchanges(enum.Enum):
    """What a batch moves between the ranks of a mesh, broadest first. A compiled graph cannot
    tell from its symbolic sizes, so the backend keeps a graph for each (docs/compiled-path.md,
    "Graph variants"); eagerly the sizes say it themselves."""

    RING = "ring"  # documents go round the ring: every ring step
    HEADS = "heads"  # no ring section, but some Ulysses group exchanges heads: the own step
    NOTHING = "nothing"  # every document whole on one rank: no collective at all

    def covers(self, other: "Exchanges") -> bool:
        """Whether a graph for batches of ``self`` runs batches of ``other`` too."""
        order = list(Exchanges)
        return order.index(self) <= order.index(other)

    def narrowed(self, sizes: RankSizes) -> RankSizes:
        """``sizes`` with what batches of these exchanges leave empty as the constant 0: the ring
        width without a ring section, and every exchange region too without an exchange."""
        if self is Exchanges.RING:
            return sizes
        exchange = (0,) * len(sizes.exchange) if self is Exchanges.NOTHING else sizes.exchange
        return dataclasses.replace(sizes, ring_width=0, exchange=exchange)


class GraphKind(NamedTuple):
    """The batches one compiled graph serves (docs/compiled-path.md, "Graph variants"): what
    they exchange and, for batches laid out for a window in adjacent pairs, how many ring steps
    each causal window of the graph's calls needs (``layout.window_steps``: the schedule ends
    where the window does, as eagerly); a window not listed runs every step. It travels into
    the graph's ops as its :attr:`text`. A tuple, as :class:`MeshShape`: a key that hashes
    without Python code (the backend picks a graph by it on every call)."""

    exchanges: Exchanges = Exchanges.RING
    window_steps: tuple[tuple[int, int], ...] = ()  # (window left, ring steps), by window

    def steps(self, causal: bool, window: tuple[int, int]) -> int | None:
        """The ring steps of a call with this mask; None: as the exchanges decide."""
        return dict(self.window_steps).get(window[0]) if causal else None

    @property
    def text(self) -> str:
        steps = ",".join(f"{left}:{count}" for left, count in self.window_steps)
        return self.exchanges.value + (f";{steps}" if steps else "")

    @classmethod
    def parse(cls, text: str) -> "GraphKind":
        exchanges, _, steps = text.partition(";")
        pairs = (tuple(int(v) for v in pair.split(":")) for pair in steps.split(",")) if steps else ()
        return cls(Exchanges(exchanges), tuple(pairs))

    @property
    def code(self) -> int:
        """The graph as the ranks' agreement compares it (``agreement.Verdict.graph``): the
        exchanges' index for a graph of every step (0: the full graph), else a hash of the text
        above those, below 2**62 so that its negation fits an int64."""
        index = list(Exchanges).index(self.exchanges)
        if not self.window_steps:
            return index
        digest = hashlib.sha256(self.text.encode()).digest()
        return len(Exchanges) + (int.from_bytes(digest[:8], "little") & (2**61 - 1))

    @staticmethod
    def broadest(kinds: Iterable["GraphKind"]) -> "GraphKind":
        """The narrowest kind whose graph runs batches of every one of ``kinds``: the broadest
        exchanges, and for each window the most steps (every step where one lists none)."""
        kinds = list(kinds)
        exchanges = min((k.exchanges for k in kinds), key=list(Exchanges).index)
        steps = [dict(k.window_steps) for k in kinds]
        lefts = set.intersection(*(set(s) for s in steps)) if steps else set()
        return GraphKind(exchanges, tuple((left, max(s[left] for s in steps)) for left in sorted(lefts)))


class MeshShape(NamedTuple):
    """What a batch's layout depends on beside its values: the mesh's shape, the rule and the
    window the rule balances for (``placements.check_layout_window``: ``(-1, -1)`` for none),
    so that a batch laid out for a window is another batch than without (docs/design.md §2.4).
    A tuple, so that the batch cache's keys hash without Python code on every lookup."""

    ulysses: int
    ring: int
    placement: str = DEFAULT_PLACEMENT
    window: tuple[int, int] = NO_WINDOW

    def describe(self) -> str:
        windowed = "" if self.window == NO_WINDOW else f" for window={self.window}"
        return f"ulysses={self.ulysses} x ring={self.ring} with placement={self.placement!r}{windowed}"


@dataclass(frozen=True, eq=False)
class PreparedBatch:
    """One batch prepared for one mesh shape (``mesh=None``: a single device, the identity
    layout): picklable, built without a process group.

    Attributes:
        batch: the checked host copy of ``cu_seqlens`` (:class:`BatchValues`).
        mesh: the mesh shape and placement, or None for a single device.
        layout: the :class:`layout.BatchLayout` on the host; None for a single device or when
            ``cu_seqlens`` breaks its own rules (then nothing is laid out).

    What is derived per rank ``(ring rank, Ulysses rank)`` or per mask is kept in the fields
    after these on first use (or by :meth:`warm`) and pickled along, but for the pinned copies.
    """

    batch: BatchValues
    mesh: MeshShape | None
    layout: BatchLayout | None = None
    _sizes: dict[tuple[int, int], RankSizes] = field(default_factory=dict, repr=False)
    _tokens: dict[tuple[int, int], StreamTokens] = field(default_factory=dict, repr=False)
    _plans: dict[tuple[int, int, bool, tuple[int, int], int | None, bool], RankPlan] = field(default_factory=dict,
                                                                                             repr=False)
    _graph_kinds: dict[tuple[int, ...], GraphKind] = field(default_factory=dict, repr=False)
    # the plans' tables in pinned memory, by the tables' id (their plans, which hold them, are
    # kept as long), this process's only: a worker's would arrive as plain memory
    _pinned: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def key(self) -> tuple[bytes, MeshShape | None]:
        """What names the batch in the batch cache (hcp_compile/batch/cache.py)."""
        return self.batch.digest, self.mesh

    @property
    def laid_out(self) -> bool:
        return self.layout is not None

    def rank_tokens(self, ring_rank: int, ulysses_rank: int) -> int:
        """The tokens rank ``(ring_rank, ulysses_rank)`` holds, pads included: q, k and v's token
        count (the ``tokens`` of its :meth:`rank_sizes`)."""
        if self.mesh is None:
            return self.batch.num_tokens
        return self.rank_sizes(ring_rank, ulysses_rank).tokens

    def rank_sizes(self, ring_rank: int, ulysses_rank: int) -> RankSizes:
        """Rank ``(ring_rank, ulysses_rank)``'s sizes (:func:`layout.rank_size_values`), derived
        for the ranks that ask (each costs a few table builds: all 64 of an 8 x 8 mesh, a
        second)."""
        rank = (ring_rank, ulysses_rank)
        if rank not in self._sizes:
            values = layout.rank_size_values(self.layout, ring_rank, ulysses_rank).tolist()
            self._sizes[rank] = layout.rank_sizes(values, ulysses_rank, self.layout.ulysses)
        return self._sizes[rank]

    @functools.cached_property
    def exchanges(self) -> Exchanges:
        """What the batch moves between ranks (:class:`Exchanges`); RING when nothing is laid
        out, so that a caller takes the path that checks the batch. Without a ring section
        (``W == 0``) every schedule of the batch is its own step alone
        (:func:`layout.schedule_steps`)."""
        if self.layout is None or int(self.layout.ring_width) > 0:
            return Exchanges.RING
        return Exchanges.HEADS if int(self.layout.exchange_extent.sum()) else Exchanges.NOTHING

    def graph_kind(self, windows: Iterable[int]) -> GraphKind:
        """The :class:`GraphKind` of the compiled graph that runs this batch with calls under
        causal windows of these ``windows`` keys back: the ring steps of each where it ends
        the schedule early. Kept per ``windows``: a compiled graph asks on every call."""
        windows = tuple(sorted(set(windows)))
        if windows not in self._graph_kinds:
            self._graph_kinds[windows] = self._graph_kind(windows)
        return self._graph_kinds[windows]

    def _graph_kind(self, windows: tuple[int, ...]) -> GraphKind:
        if self.exchanges is not Exchanges.RING or self.layout is None:
            return GraphKind(self.exchanges)
        steps = ((left, layout.window_steps(self.layout, left)) for left in windows)
        return GraphKind(Exchanges.RING, tuple((left, count) for left, count in steps if count < self.mesh.ring))

    def tokens(self, ring_rank: int, ulysses_rank: int) -> StreamTokens:
        """Where each token rank ``(ring_rank, ulysses_rank)`` holds comes from (host)."""
        rank = (ring_rank, ulysses_rank)
        if rank not in self._tokens:
            self._tokens[rank] = self._tokens_unkept(ring_rank, ulysses_rank)
        return self._tokens[rank]

    def _tokens_unkept(self, ring_rank: int, ulysses_rank: int) -> StreamTokens:
        """The rank's tokens as kept by :meth:`tokens`, else derived without keeping them."""
        kept = self._tokens.get((ring_rank, ulysses_rank))
        if kept is not None:
            return kept
        return layout.rank_tokens(self.layout, self.rank_sizes(ring_rank, ulysses_rank), ring_rank)

    def unshard_rows(self) -> Tensor:
        """Row of each global token in every rank's shard gathered ring rank major, Ulysses
        minor (what ``ShardPlan.unshard`` selects)."""
        return self._unshard_rows

    @functools.cached_property
    def _unshard_rows(self) -> Tensor:
        # the other ranks' tokens are not kept: only their order matters here (their sizes
        # are: a ShardPlan of another rank, or the summary, needs them)
        gathered = torch.cat([
            self._tokens_unkept(r, a).global_index
            for r in range(self.mesh.ring) for a in range(self.mesh.ulysses)
        ])
        total = self.batch.num_tokens
        # pads (-1) scatter into one extra slot that is cut off afterwards
        slot = torch.where(gathered >= 0, gathered, total)
        rows = torch.empty(total + 1, dtype=torch.int64)
        rows.scatter_(0, slot, torch.arange(gathered.numel()))
        return rows[:-1]

    def rank_plan(self, ring_rank: int, ulysses_rank: int, causal: bool, window: tuple[int, int],
                  steps: int | None = None, gathered: bool = False) -> RankPlan:
        """Rank ``(ring_rank, ulysses_rank)``'s :class:`RankPlan` for calls with this mask, with
        one gathered step where ``gathered`` (:func:`schedule.gathers`), kept under the mask as
        given (warm() and both doors ask alike): of its own ring steps, or of ``steps`` (a
        compiled graph's: every step, or those of its ``GraphKind``), which must be at least its
        own."""
        asked = (ring_rank, ulysses_rank, causal, window, steps, gathered)
        plan = self._plans.get(asked)
        if plan is None:
            plan = plan_rank(self.layout, self.rank_sizes(ring_rank, ulysses_rank), ring_rank, causal, window,
                             steps, gathered)
            # the rank's own steps asked for with their count (a compiled graph) or without: one plan
            plan = self._plans.setdefault((*asked[:4], len(plan.shape.sources), gathered), plan)
            self._plans[asked] = plan
        return plan

    def tables(self, ring_rank: int, ulysses_rank: int, causal: bool, window: tuple[int, int],
               steps: int | None = None, gathered: bool = False) -> ScheduleTables:
        """The host tables of the rank's schedule for this mask (:meth:`rank_plan`)."""
        return self.rank_plan(ring_rank, ulysses_rank, causal, window, steps, gathered).tables

    def warm(self, ranks: Iterable[int] | None = None, *, causal: bool = True,
             window: tuple[int, int] = (-1, -1), scheme: str = DEFAULT_SCHEME) -> "PreparedBatch":
        """Derive now what the attention and ``shard_plan`` of the CP ``ranks`` (``r * A + a``;
        None: every rank) would derive on first use, for calls with this mask: their tokens,
        their schedule tables under ``scheme``, the steps a window skips and, for every rank, the unshard rows
        (``ShardPlan.unshard``: every rank's tokens; a worker preparing one rank's batch leaves
        them out, which halves what it sends). For a DataLoader worker, so that the training
        step finds it all done; returns ``self``."""
        if not self.laid_out:
            return self
        mesh = self.mesh
        for rank in range(mesh.ulysses * mesh.ring) if ranks is None else ranks:
            ring_rank, ulysses_rank = divmod(check_rank(rank, mesh), mesh.ulysses)
            self.tokens(ring_rank, ulysses_rank)  # and the rank's sizes
            self.rank_plan(ring_rank, ulysses_rank, causal, window,
                           gathered=gathers(scheme, causal, window, mesh.ring))
        if ranks is None:
            self.unshard_rows()
        return self

    def device_tables(
        self, ring_rank: int, ulysses_rank: int, causal: bool, window: tuple[int, int], device: torch.device,
        steps: int | None = None, skip_inactive: bool = False, gathered: bool = False,
    ) -> tuple[RankPlan, tuple[Tensor, Tensor]]:
        """The rank's :meth:`rank_plan` and its tables copied to ``device``, the segmentations'
        host copy kept in ``HOST_READS`` (:meth:`HostReads.put_table`), where a kernel finds the
        segmentation of any block of the schedule without reading it back (cudnn's backward in
        chunks of documents; the rows outside every segment, BlockSpec.segment_ends). With
        ``skip_inactive`` (a compiled graph, which runs every step) the tables of the steps a
        window leaves without a visible key are empty (``RankPlan.flat_skipping``). On CUDA
        the copy comes from pinned memory (kept in this process only) and waits for nothing: a
        copy from pageable memory waits for all the work queued before it."""
        plan = self.rank_plan(ring_rank, ulysses_rank, causal, window, steps, gathered)
        flat = plan.flat_skipping if skip_inactive else plan.flat
        if device.type == "cuda":
            # by the tables' id (the plan keeps them as long as it is kept): a plan has two
            # sets where a window skips steps
            if id(flat) not in self._pinned:
                self._pinned[id(flat)] = tuple(t.pin_memory() for t in flat)
            flat = self._pinned[id(flat)]
        copies = tuple(t.to(device, copy=True, non_blocking=device.type == "cuda") for t in flat)
        HOST_READS.put_table(copies[0], flat[0], self.key)
        return plan, copies

    def __reduce__(self) -> tuple:
        # its tensors as one buffer (hcp_compile/batch/pickling.py: a DataLoader moves each tensor
        # through a shared-memory segment of its own); the pinned copies stay in this process
        state = {name: value for name, value in vars(self).items() if name != "_pinned"}
        return _unpickled, pickling.pack(state)


def _unpickled(buffer: Tensor, data: bytes) -> PreparedBatch:
    prepared = PreparedBatch.__new__(PreparedBatch)
    vars(prepared).update(pickling.unpack(buffer, data), _pinned={})
    return prepared


def check_rank(rank: int, mesh: MeshShape) -> int:
    ranks = mesh.ulysses * mesh.ring
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
        raise validation.InputError(
            f"rank: expected a rank of the context-parallel mesh, 0 <= rank < {ranks} "
            f"(ring rank * ulysses + ulysses rank), got {rank!r}"
        )
    return rank


def _build(batch: BatchValues, mesh: MeshShape | None) -> PreparedBatch:
    if mesh is None or batch.failures("cu_seqlens"):
        return PreparedBatch(batch, mesh)  # nothing to lay out (or nothing that can be)
    laid = layout.batch_layout(batch.values, mesh.ulysses, mesh.ring, placement_rule(mesh.placement), mesh.window[0])
    return PreparedBatch(batch, mesh, laid)


def prepare(batch: BatchValues, mesh: MeshShape | None) -> PreparedBatch:
    """The batch prepared for ``mesh`` (None: a single device): from the batch cache when these
    values were prepared (or adopted) for it before, else built now and kept."""
    return BATCHES.prepared((batch.digest, mesh), lambda: _build(batch, mesh))


def find(cu_seqlens: Tensor, mesh: MeshShape | None) -> PreparedBatch:
    """The batch of the ``cu_seqlens`` tensor (dtype checked) prepared for ``mesh`` (a door's,
    :func:`as_planned`): what a door starts from (:func:`host_values`, then :func:`prepare`),
    kept per tensor and version in the batch cache (``BatchCache.find``)."""
    return BATCHES.find(cu_seqlens, mesh, lambda: find_by_value(cu_seqlens, mesh))


def find_by_value(cu_seqlens: Tensor, mesh: MeshShape | None) -> PreparedBatch:
    """:func:`find` without the look-up per tensor: what the batch cache falls back to for a
    tensor it has not seen (or not since it changed)."""
    values = host_values(cu_seqlens)
    return prepare(values, None if mesh is None else as_planned(values.digest, mesh))


def as_planned(digest: bytes, mesh: MeshShape) -> MeshShape:
    """The shape the attention of these values runs on: its own mesh and placement (``mesh``),
    laid out for the window ``shard_plan`` laid them out for last on that mesh and placement
    (docs/design.md §2.4). The attention is not told the layout's window (a model's layers may
    run other windows than the one balanced for), so it takes the one that sharded its tokens;
    a plan for another mesh or placement leaves ``mesh`` as it is, which the batch check then
    refuses on every rank (``validation.PLANNED_FOR_THIS_MESH``)."""
    planned = BATCHES.planned(digest)
    if planned is not None and planned._replace(window=mesh.window) == mesh:
        return planned
    return mesh


def prepare_batch(
    cu_seqlens: Tensor, *, ulysses: int, ring: int, placement: str = DEFAULT_PLACEMENT,
    rank: int | None = None, causal: bool = True, window: tuple[int, int] = (-1, -1),
    layout_window: tuple[int, int] = NO_WINDOW, scheme: str = DEFAULT_SCHEME,
) -> PreparedBatch:
    """The batch ``cu_seqlens`` (global, real, int32) prepared on the host for a ``ulysses x
    ring`` mesh, without a process group: for a DataLoader worker to build while the previous
    step runs. Pass it (pickled across the worker boundary as it is) to ``shard_plan`` in
    place of ``cu_seqlens``; the attention of that batch, eager or compiled, then derives
    nothing again. ``rank`` (``r * ulysses + a``; None: every rank), the mask (``causal``,
    ``window``) and the collective ``scheme`` say which ranks' tokens and schedule tables to derive now
    (:meth:`PreparedBatch.warm`). ``layout_window``: the window the layout balances the work
    for, ``shard_plan``'s ``window`` (docs/design.md §2.2); the mask's ``window`` does not
    change the layout."""
    validation.check_cu_seqlens_dtype(cu_seqlens, "cu_seqlens")
    for name, size in (("ulysses", ulysses), ("ring", ring)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise validation.InputError(f"{name}: expected a positive int (the mesh's size), got {size!r}")
    window = validation.check_window(window)
    if not isinstance(causal, bool):
        raise validation.InputError(f"causal: expected True or False, got {causal!r}")
    batch = BatchValues.of(cu_seqlens.detach().to("cpu", torch.int64))
    validation.raise_first(batch.failures("cu_seqlens"))
    shape = MeshShape(ulysses, ring, check_placement(placement), check_layout_window(layout_window, "layout_window"))
    prepared = _build(batch, shape)
    return prepared.warm(None if rank is None else [rank], causal=causal, window=window,
                         scheme=check_scheme(scheme))
