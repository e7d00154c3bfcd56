"""``shard_plan``: which global tokens each rank holds, and moving tensors between the global
packed layout and the local shards (docs/design.md §2; what is derived from the batch lives in
``prepared``, the rules in ``placements``, the layout math in ``layout``)."""

from __future__ import annotations

import torch
from tabulate import tabulate
from torch import Tensor

from hcp_compile import validation
from hcp_compile.batch import layout
from hcp_compile.batch.layout import Kind
from hcp_compile.batch.placements import DEFAULT_PLACEMENT, NO_WINDOW, check_layout_window, check_placement
from hcp_compile.batch.cache import BATCHES
from hcp_compile.batch.prepared import MeshShape, PreparedBatch, host_values, prepare
from hcp_compile.exchange.collectives import gather_tokens
from hcp_compile.exchange.agreement import Verdict, agree, raise_agreed
from hcp_compile.exchange.mesh import CPGroups, MeshLike, resolve_groups
from hcp_compile.exchange.schemes import DEFAULT_SCHEME
from hcp_compile.batch.traffic import CallShape, call_traffic
from hcp_compile.validation import InputError

PLACEMENT_NAMES = {Kind.LOCAL: "local", Kind.GROUP: "group", Kind.RING: "ring"}


class ShardPlan:
    """The token layout of one packed batch on one context-parallel mesh: this rank's view of
    a :class:`prepared.PreparedBatch`, which the attention of the batch finds by value.

    Attributes:
        prepared: everything derived from the batch and the mesh shape (picklable).
        placement: the rule that laid the batch out (``"balanced"`` or ``"zigzag"``).
        window: the sliding window the rule balanced the work for, ``(left, 0)``, or
            ``(-1, -1)``: none (plain causal work).
        document_placement: one entry per document of ``cu_seqlens``: ``"local"`` (whole on
            one rank), ``"group"`` (inside one Ulysses group) or ``"ring"``.
        num_tokens: global real token count (``cu_seqlens[-1]``).
        local_tokens: tokens every rank holds, pads included (equal on all ranks).
        position_ids: ``[local_tokens]`` position of each local token inside its document
            (0 for pads), for rotary embeddings.
        valid: ``[local_tokens]`` bool, True for real tokens, False for pads.
        global_index: ``[local_tokens]`` index of each local token in the global packed
            tensor, -1 for pads.
    """

    def __init__(
        self, cu_seqlens: Tensor | PreparedBatch, mesh: MeshLike, placement: str = DEFAULT_PLACEMENT,
        window: tuple[int, int] = NO_WINDOW,
    ):
        self.groups: CPGroups = resolve_groups(mesh)
        self.placement = check_placement(placement)
        self.window = check_layout_window(window)
        groups = self.groups
        shape = MeshShape(groups.ulysses_size, groups.ring_size, placement, self.window)
        self.prepared = _prepared(cu_seqlens, shape)
        BATCHES.record_plan(self.prepared)  # the attention checks that it runs on this shape
        if isinstance(cu_seqlens, Tensor):
            # what the attention of this tensor on this mesh finds (prepared.find: the doors ask
            # without the layout's window, which this plan's recording decides), so that its
            # first call neither reads nor hashes the values again
            BATCHES.find(cu_seqlens, shape._replace(window=NO_WINDOW), lambda: self.prepared)
        self.layout = self.prepared.layout
        self.local_tokens = self.prepared.rank_tokens(groups.ring_rank, groups.ulysses_rank)
        self.num_tokens = self.prepared.batch.num_tokens
        self.document_placement = [PLACEMENT_NAMES[Kind(k)] for k in self.layout.kind.tolist()]
        tokens = self.prepared.tokens(groups.ring_rank, groups.ulysses_rank)
        device = cu_seqlens.device if isinstance(cu_seqlens, Tensor) else _mesh_device(groups)
        self.global_index = tokens.global_index.to(device)
        self.valid = tokens.valid.to(device)
        self.position_ids = tokens.position.to(device)

    def shard(self, x: Tensor, pad_value: float = 0) -> Tensor:
        """Global ``[num_tokens, ...]`` -> this rank's ``[local_tokens, ...]`` (pads filled)."""
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] != self.num_tokens:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise InputError(
                f"x: expected the global packed tensor with {self.num_tokens} tokens on dim 0 "
                f"(cu_seqlens[-1]), got {got}"
            )
        index = self.global_index.to(x.device)
        local = x.index_select(0, index.clamp(min=0))
        pad = (index < 0).reshape(-1, *([1] * (x.dim() - 1)))
        return local.masked_fill(pad, pad_value)

    def unshard(self, x_local: Tensor) -> Tensor:
        """All ranks' shards -> the global ``[num_tokens, ...]`` on every rank, pads dropped.

        Differentiable like DTensor's Shard -> Replicate: the gradient each rank receives is its
        own slice of the incoming gradient, which must be the same on every rank (a loss
        computed from the unsharded tensor identically everywhere)."""
        error = None
        if not isinstance(x_local, Tensor) or x_local.dim() == 0 or x_local.shape[0] != self.local_tokens:
            got = tuple(x_local.shape) if isinstance(x_local, Tensor) else type(x_local).__name__
            error = InputError(
                f"x_local: expected this rank's shard with {self.local_tokens} tokens on dim 0, "
                f"got {got}; pass a tensor produced by plan.shard or by attention on its output"
            )
        agreed = agree(self.groups, Verdict(other_error=error is not None).encode(), timeout_s=None,
                       caller="plan.unshard")
        raise_agreed(agreed.tolist(), error)
        gathered = _GatherShards.apply(x_local, self.groups)
        # derived on first use: the other ranks' tokens, which a step that never unshards
        # does not need (a prepared batch for one rank leaves them out)
        return gathered.index_select(0, self.prepared.unshard_rows().to(x_local.device))

    def summary(
        self, heads_q: int = 32, heads_kv: int = 8, head_dim: int = 128,
        dtype: torch.dtype = torch.bfloat16, scheme: str = DEFAULT_SCHEME,
    ) -> str:
        """A table per rank: real tokens, pads, causal work (query-key pairs, under the plan's
        window where it has one), documents per placement, and the bytes one attention call
        (forward and backward) sends through the Ulysses all-to-all and the ring under the
        collective ``scheme`` (its own counts), for attention of ``heads_q``/``heads_kv`` heads
        of ``head_dim`` in ``dtype``."""
        work = layout.attention_work(self.layout, window=self.window[0])
        sizes_of = self.prepared.rank_sizes
        kind, ring_rank = self.layout.kind, self.layout.ring_rank
        ulysses, ring = self.groups.ulysses_size, self.groups.ring_size
        call = CallShape(heads_q, heads_kv, head_dim, dtype)
        rows = []
        for r in range(ring):
            for a in range(ulysses):
                sizes = sizes_of(r, a)
                real = int(self.prepared.tokens(r, a).valid.sum())
                local_docs = int(self.layout.is_local_on(r, a).sum())
                group_docs = int(((kind == Kind.GROUP) & (ring_rank == r)).sum())
                ring_docs = int((kind == Kind.RING).sum())
                moved = call_traffic(scheme, sizes, call, ulysses, ring,
                                     layout.own_steps(self.layout, sizes, True, self.window))
                all_to_all = moved.ulysses.forward_bytes + moved.ulysses.backward_bytes
                ring_bytes = moved.ring.forward_bytes + moved.ring.backward_bytes
                rows.append([
                    f"{r * ulysses + a} ({r}, {a})", real, sizes.tokens - real,
                    f"{float(work[r, a]):.4g}", f"{local_docs}/{group_docs}/{ring_docs}",
                    format_bytes(all_to_all), format_bytes(ring_bytes),
                ])
        weighed = "causal work (pairs)" if self.window == NO_WINDOW else f"work (pairs, window {self.window})"
        headers = ["rank (ring, ulysses)", "real tokens", "pads", weighed,
                   "docs local/group/ring", "all-to-all bytes/call", "ring bytes/call"]
        return tabulate(rows, headers=headers, tablefmt="github")


def format_bytes(count: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:g} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _prepared(cu_seqlens: Tensor | PreparedBatch, shape: MeshShape) -> PreparedBatch:
    """The batch prepared for ``shape``: a ``cu_seqlens`` tensor checked and prepared here, or
    a :class:`PreparedBatch` built ahead of time (``prepared.prepare_batch``), taken as it is."""
    if isinstance(cu_seqlens, PreparedBatch):
        if cu_seqlens.mesh != shape:
            made = "no mesh" if cu_seqlens.mesh is None else cu_seqlens.mesh.describe()
            raise InputError(
                f"cu_seqlens: a PreparedBatch for {made}, but shard_plan lays out for "
                f"{shape.describe()}; give prepare_batch the mesh's ulysses and ring sizes, "
                "the placement of shard_plan and its window as layout_window"
            )
        return BATCHES.adopt(cu_seqlens)
    validation.check_cu_seqlens_dtype(cu_seqlens, "cu_seqlens")
    batch = host_values(cu_seqlens)
    validation.raise_first(batch.failures("cu_seqlens"))
    return prepare(batch, shape)


def _mesh_device(groups: CPGroups) -> torch.device:
    """Where the plan's tensors go when it was given no tensor: the mesh's device."""
    if groups.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(groups.device_type)


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local: Tensor, groups: CPGroups) -> Tensor:
        ctx.groups, ctx.local = groups, x_local.shape[0]
        return gather_tokens(gather_tokens(x_local, groups.ulysses_group), groups.ring_group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        groups = ctx.groups
        start = (groups.ring_rank * groups.ulysses_size + groups.ulysses_rank) * ctx.local
        return grad[start : start + ctx.local], None


def shard_plan(
    cu_seqlens: Tensor | PreparedBatch, mesh: MeshLike, *, placement: str = DEFAULT_PLACEMENT,
    window: tuple[int, int] = NO_WINDOW,
) -> ShardPlan:
    """The layout of the packed batch described by ``cu_seqlens`` (global, real document
    boundaries, int32) on ``mesh`` (a ``("ring", "ulysses")`` DeviceMesh or a group pair).
    ``cu_seqlens`` may also be a :class:`prepared.PreparedBatch` that
    ``prepared.prepare_batch`` built ahead of time (in a DataLoader worker) for this mesh's
    shape and placement: then nothing is derived again, here or in the batch's attention.

    ``placement``: ``"balanced"`` (default: short documents whole on one rank, long ones split
    over a Ulysses group or the ring) or ``"zigzag"`` (every document round the ring). The
    attention must use the same placement (``context_parallel(mesh, placement=...)`` or the
    hcp backend's ``placement`` option).

    ``window``: the sliding window ``(left, right)`` of the causal attention the balanced rule
    evens the work for (as ``varlen_attention``'s ``window_size``; ``right`` changes nothing
    under causal attention); ``(-1, -1)``: plain causal work. The attention is not told it: it
    runs on the layout this call recorded for these values and mesh (docs/design.md §2.4), so
    lay a batch out once per step, as its shards are made, and run the attention before
    ``hcp_compile.clear_batch_cache()``."""
    return ShardPlan(cu_seqlens, mesh, placement, window)
