"""``context_parallel(mesh)``: run ``varlen_attention`` as hierarchical CP on local shards."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import layout, validation
from .hierarchical import HierarchicalAttention
from .kernels import KERNEL_CHOICES, resolve_kernel
from .mesh import CPGroups, MeshLike, agree_on_error, resolve_groups
from .schedule import RingSchedule, build_schedule
from .validation import InputError

_ACTIVE: contextvars.ContextVar["ContextParallel | None"] = contextvars.ContextVar(
    "hcp_compile_context_parallel", default=None
)


@dataclass(frozen=True)
class CPOptions:
    """Options of hierarchical CP attention.

    kernel: ``"auto"`` (flash on CUDA in fp16/bf16, else the plain-PyTorch kernel),
        ``"flash"`` or ``"torch"``.
    skip_outside_window: with a sliding window, skip the ring steps whose blocks lie wholly
        outside it (costs one small device-to-host read per new ``cu_seqlens``).
    """

    kernel: str = "auto"
    skip_outside_window: bool = True

    def __post_init__(self) -> None:
        if self.kernel not in KERNEL_CHOICES:
            raise InputError(f"kernel: expected one of {KERNEL_CHOICES}, got {self.kernel!r}")


def active_context() -> "ContextParallel | None":
    return _ACTIVE.get()


class ContextParallel:
    """The state of one ``context_parallel`` block: the mesh's groups, the options, and the
    ring schedules already built for the ``cu_seqlens`` tensors seen (every layer of a model
    passes the same one, so it is validated and laid out once per batch)."""

    def __init__(self, mesh: MeshLike, options: CPOptions):
        self.groups: CPGroups = resolve_groups(mesh)
        self.options = options
        self._schedules = WeakIdKeyDictionary()  # cu_seqlens tensor -> {signature: schedule}
        self._token: contextvars.Token | None = None

    def __enter__(self) -> "ContextParallel":
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        max_seqlen_q: int, max_seqlen_k: int, *, causal: bool, scale: float,
        window: tuple[int, int],
    ) -> Tensor:
        sched = self.schedule(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            causal=causal, scale=scale, window=window,
        )
        return HierarchicalAttention.apply(q, k, v, sched, self.groups)

    def schedule(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        max_seqlen_q: int, max_seqlen_k: int, *, causal: bool, scale: float,
        window: tuple[int, int],
    ) -> RingSchedule:
        """Validate the call on every rank (all raise together) and build the ring schedule;
        both are cached per ``cu_seqlens`` tensor and call signature."""
        key = (
            cu_seqlens_q._version, id(cu_seqlens_k), cu_seqlens_k._version, tuple(q.shape),
            tuple(k.shape), tuple(v.shape), q.dtype, q.device, max_seqlen_q, max_seqlen_k,
            causal, scale, window,
        )
        per_tensor = self._schedules.setdefault(cu_seqlens_q, {})
        if key in per_tensor:
            return per_tensor[key]
        error, kernel, stream_length = None, None, None
        try:
            kernel, stream_length = self._validate(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window
            )
        except InputError as exc:
            error = exc
        agree_on_error(self.groups, error)
        groups = self.groups
        sched = build_schedule(
            cu_seqlens_q.to(q.device), max_seqlen_q, groups.ring_rank, groups.ring_size,
            groups.ulysses_size, stream_length, causal=causal, scale=scale, window=window,
            kernel=kernel, skip_outside_window=self.options.skip_outside_window,
        )
        for stale in [old for old in per_tensor if old[0] != key[0]]:
            del per_tensor[stale]  # written in place since: those schedules are out of date
        per_tensor[key] = sched
        return sched

    def _validate(self, q, k, v, cu_q, cu_k, max_q, max_k, window) -> tuple[str, int]:
        groups = self.groups
        validation.check_qkv(q, k, v)
        values = validation.check_cu_seqlens(cu_q, "cu_seqlens_q")
        if cu_k is not cu_q:
            values_k = validation.check_cu_seqlens(cu_k, "cu_seqlens_k")
            if not torch.equal(values, values_k):
                raise InputError(
                    "cu_seqlens_k: under context parallelism queries and keys come from the "
                    "same packed documents, so cu_seqlens_k must equal cu_seqlens_q"
                )
        if max_q != max_k:
            raise InputError(
                f"max_seqlen_k: must equal max_seqlen_q under context parallelism, got "
                f"{max_k} and {max_q}"
            )
        validation.check_max_seqlen(max_q, values, "max_seqlen_q")
        heads_q, heads_kv, ulysses = q.shape[1], k.shape[1], groups.ulysses_size
        if heads_q % ulysses:
            raise InputError(
                f"q: {heads_q} query heads cannot be split over ulysses={ulysses} ranks; use a "
                "ulysses size that divides the number of query heads"
            )
        if heads_kv % ulysses and ulysses % heads_kv:
            raise InputError(
                f"k: {heads_kv} key/value heads must divide or be divisible by ulysses="
                f"{ulysses}; choose another ulysses size"
            )
        chunk_total = int(layout.chunk_sizes(values[1:] - values[:-1], groups.ring_size).sum())
        stream_length = layout.ring_stream_length(chunk_total, groups.ring_size, ulysses)
        local = stream_length // ulysses
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[0] != local:
                raise InputError(
                    f"{name}: has {t.shape[0]} tokens but this cu_seqlens sharded over ulysses="
                    f"{ulysses} x ring={groups.ring_size} gives {local} per rank; pass the "
                    "local shard from hcp_compile.shard_plan(cu_seqlens, mesh).shard(x)"
                )
        kernel = resolve_kernel(self.options.kernel, q)
        if kernel == "flash" and window != (-1, -1):
            raise InputError(
                "window_size: the flash kernel cannot apply a sliding window under context "
                "parallelism; use context_parallel(mesh, kernel='torch') or no window"
            )
        return kernel, stream_length


def context_parallel(mesh: MeshLike, **options) -> ContextParallel:
    """Context manager: inside it, ``hcp_compile.varlen_attention`` takes this rank's shards
    (laid out by ``shard_plan`` for the same mesh) and runs hierarchical CP attention.

    ``mesh``: a ``("ring", "ulysses")`` DeviceMesh from ``make_mesh``, or a pair
    ``(ulysses_group, ring_group)``. ``options``: the fields of :class:`CPOptions`.
    """
    return ContextParallel(mesh, CPOptions(**options))
