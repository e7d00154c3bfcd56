"""``shard_plan``: which global tokens each rank holds, and moving tensors between the global
packed layout and the local shards (docs/design.md §2; the rules live in ``placements``, the
layout math in ``layout``)."""

from __future__ import annotations

import torch
from tabulate import tabulate
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import layout, validation
from .collectives import gather_tokens
from .hierarchical import kv_head_repeat
from .layout import BatchLayout, Kind, RankSizes
from .mesh import CPGroups, MeshLike, agree_on_error, resolve_groups
from .placements import DEFAULT_PLACEMENT, check_placement, placement_rule
from .validation import InputError, check_cu_seqlens

PLACEMENT_NAMES = {Kind.LOCAL: "local", Kind.GROUP: "group", Kind.RING: "ring"}

# cu_seqlens tensor -> (its version, the plan's mesh shape and placement), so that an attention
# call can tell that its batch was sharded for another mesh or placement
_PLANS = WeakIdKeyDictionary()


def check_plan_agrees(cu_seqlens: Tensor, ulysses: int, ring: int, placement: str) -> None:
    """Raise if ``cu_seqlens`` (this very tensor, unchanged) was given to ``shard_plan`` with
    another mesh shape or placement than the attention call is about to use."""
    made = _PLANS.get(cu_seqlens)
    if made is None or made[0] != cu_seqlens._version:
        return
    planned = made[1]
    if planned != (ulysses, ring, placement):
        raise validation.PLANNED_FOR_THIS_MESH.error(
            f"a batch sharded for ulysses={planned[0]} x ring={planned[1]} with "
            f"placement={planned[2]!r}, but the attention runs on ulysses={ulysses} x "
            f"ring={ring} with placement={placement!r}"
        )


class ShardPlan:
    """The token layout of one packed batch on one context-parallel mesh.

    Attributes:
        placement: the rule that laid the batch out (``"balanced"`` or ``"zigzag"``).
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

    def __init__(self, cu_seqlens: Tensor, mesh: MeshLike, placement: str = DEFAULT_PLACEMENT):
        self.groups: CPGroups = resolve_groups(mesh)
        self.placement = check_placement(placement)
        groups = self.groups
        values = check_cu_seqlens(cu_seqlens)
        self.layout: BatchLayout = layout.batch_layout(
            values, groups.ulysses_size, groups.ring_size, placement_rule(placement)
        )
        self._sizes = _every_rank_sizes(self.layout)
        sizes = self._sizes[groups.ring_rank][groups.ulysses_rank]
        self.local_tokens = sizes.tokens
        self.num_tokens = int(values[-1])
        self.document_placement = [PLACEMENT_NAMES[Kind(k)] for k in self.layout.kind.tolist()]
        tokens = layout.rank_tokens(self.layout, sizes, groups.ring_rank)
        device = cu_seqlens.device
        self.global_index = tokens.global_index.to(device)
        self.valid = tokens.valid.to(device)
        self.position_ids = tokens.position.to(device)
        self._unshard_index = self._gathered_rows()
        _PLANS[cu_seqlens] = (
            cu_seqlens._version, (groups.ulysses_size, groups.ring_size, placement)
        )

    def _gathered_rows(self) -> Tensor:
        """Row of each global token in the shards gathered ring rank major, Ulysses minor."""
        gathered = torch.cat([
            layout.rank_tokens(self.layout, sizes, ring_rank).global_index
            for ring_rank, row in enumerate(self._sizes) for sizes in row
        ])
        # pads (-1) scatter into one extra slot that is cut off afterwards
        slot = torch.where(gathered >= 0, gathered, self.num_tokens)
        rows = torch.empty(self.num_tokens + 1, dtype=torch.int64)
        rows.scatter_(0, slot, torch.arange(gathered.numel()))
        return rows[:-1]

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
        agree_on_error(self.groups, error, caller="plan.unshard")
        gathered = _GatherShards.apply(x_local, self.groups)
        return gathered.index_select(0, self._unshard_index.to(x_local.device))

    def summary(
        self, heads_q: int = 32, heads_kv: int = 8, head_dim: int = 128,
        dtype: torch.dtype = torch.bfloat16,
    ) -> str:
        """A table per rank: real tokens, pads, causal work (query-key pairs), documents per
        placement, and the bytes one attention call (forward and backward) sends through the
        Ulysses all-to-all and the ring, for attention of ``heads_q``/``heads_kv`` heads of
        ``head_dim`` in ``dtype``."""
        work = layout.attention_work(self.layout)
        kind, ring_rank = self.layout.kind, self.layout.ring_rank
        ulysses, ring = self.groups.ulysses_size, self.groups.ring_size
        kv_heads = heads_kv * kv_head_repeat(heads_kv, ulysses)
        element = head_dim * dtype.itemsize
        rows = []
        for r, row in enumerate(self._sizes):
            for a, sizes in enumerate(row):
                real = int(layout.rank_tokens(self.layout, sizes, r).valid.sum())
                local_docs = int(self.layout.is_local_on(r, a).sum())
                group_docs = int(((kind == Kind.GROUP) & (ring_rank == r)).sum())
                ring_docs = int((kind == Kind.RING).sum())
                # q, k, v in and out back; dout in and dq, dk, dv back: all but the own 1/A
                exchanged = sizes.own_exchange * (4 * heads_q + 4 * kv_heads) * element
                all_to_all = exchanged * (ulysses - 1) // ulysses
                # KV: R-1 hops forward and backward, its gradient R hops; this rank's heads
                ring_bytes = (3 * ring - 2) * sizes.ring_width * 2 * kv_heads // ulysses * element
                rows.append([
                    f"{r * ulysses + a} ({r}, {a})", real, sizes.tokens - real,
                    f"{float(work[r, a]):.4g}", f"{local_docs}/{group_docs}/{ring_docs}",
                    format_bytes(all_to_all), format_bytes(ring_bytes if ring > 1 else 0),
                ])
        headers = ["rank (ring, ulysses)", "real tokens", "pads", "causal work (pairs)",
                   "docs local/group/ring", "all-to-all bytes/call", "ring bytes/call"]
        return tabulate(rows, headers=headers, tablefmt="github")


def format_bytes(count: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:g} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _every_rank_sizes(batch: BatchLayout) -> list[list[RankSizes]]:
    """``[ring rank][Ulysses rank]`` sizes, read to the host in one go."""
    values = torch.stack([
        layout.rank_size_values(batch, r, a)
        for r in range(batch.ring) for a in range(batch.ulysses)
    ]).tolist()
    return [[layout.rank_sizes(values[r * batch.ulysses + a], a, batch.ulysses) for a in range(batch.ulysses)]
            for r in range(batch.ring)]


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


def shard_plan(cu_seqlens: Tensor, mesh: MeshLike, *, placement: str = DEFAULT_PLACEMENT) -> ShardPlan:
    """The layout of the packed batch described by ``cu_seqlens`` (global, real document
    boundaries, int32) on ``mesh`` (a ``("ring", "ulysses")`` DeviceMesh or a group pair).

    ``placement``: ``"balanced"`` (default: short documents whole on one rank, long ones split
    over a Ulysses group or the ring) or ``"zigzag"`` (every document round the ring). The
    attention must use the same placement (``context_parallel(mesh, placement=...)`` or the
    hcp backend's ``placement`` option)."""
    return ShardPlan(cu_seqlens, mesh, placement)
