"""``shard_plan``: which global tokens each rank holds, and moving tensors between the global
packed layout and the local shards (DESIGN §2; the rule itself lives in ``layout``)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import layout
from .collectives import gather_tokens
from .mesh import CPGroups, MeshLike, agree_on_error, resolve_groups
from .validation import InputError, check_cu_seqlens


class ShardPlan:
    """The token layout of one packed batch on one context-parallel mesh.

    Attributes:
        num_tokens: global real token count (``cu_seqlens[-1]``).
        local_tokens: tokens every rank holds, pads included (equal on all ranks).
        position_ids: ``[local_tokens]`` position of each local token inside its document
            (0 for pads), for rotary embeddings.
        valid: ``[local_tokens]`` bool, True for real tokens, False for pads.
        global_index: ``[local_tokens]`` index of each local token in the global packed
            tensor, -1 for pads.
    """

    def __init__(self, cu_seqlens: Tensor, mesh: MeshLike):
        self.groups: CPGroups = resolve_groups(mesh)
        groups = self.groups
        values = check_cu_seqlens(cu_seqlens)
        rank = layout.rank_layout(
            values, groups.ring_size, groups.ulysses_size, groups.ring_rank, groups.ulysses_rank
        )
        self.ring_stream_length = rank.stream_length
        self.local_tokens = rank.local_tokens
        self.num_tokens = int(values[-1])
        self._unshard_index = rank.unshard_index
        device = cu_seqlens.device
        tokens = rank.tokens
        self.global_index = tokens.global_index.to(device)
        self.valid = tokens.valid.to(device)
        self.position_ids = torch.where(tokens.valid, tokens.position, 0).to(device)

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
        agree_on_error(self.groups, error)
        gathered = _GatherShards.apply(x_local, self.groups)
        return gathered.index_select(0, self._unshard_index.to(x_local.device))


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


def shard_plan(cu_seqlens: Tensor, mesh: MeshLike) -> ShardPlan:
    """The layout of the packed batch described by ``cu_seqlens`` (global, real document
    boundaries, int32) on ``mesh`` (a ``("ring", "ulysses")`` DeviceMesh or a group pair)."""
    return ShardPlan(cu_seqlens, mesh)
