"""``context_parallel(mesh)``: run ``varlen_attention`` as hierarchical CP on local shards."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import layout, validation
from .hierarchical import HierarchicalAttention
from .kernels import KERNEL_CHOICES, BlockRequest, new_cache_key, resolve_kernel
from .layout import BatchLayout, RankSizes
from .mesh import CPGroups, MeshLike, agree_on_error, resolve_groups
from .placements import DEFAULT_PLACEMENT, check_placement, placement_rule
from .plan import check_plan_agrees
from .schedule import RingSchedule, build_schedule, cache_keys_needed
from .validation import InputError

_ACTIVE: contextvars.ContextVar["ContextParallel | None"] = contextvars.ContextVar(
    "hcp_compile_context_parallel", default=None
)


@dataclass(frozen=True)
class CPOptions:
    """Options of hierarchical CP attention.

    placement: the token layout rule, as given to ``shard_plan`` (``"balanced"``: short
        documents whole on one rank, or ``"zigzag"``: every document round the ring).
    kernel: ``"auto"`` (the fastest kernel measured on the device that supports the call,
        kernels/measured.json; unmeasured devices: flash where it can run, else the
        plain-PyTorch kernel), ``"dense"``, ``"flex"``, ``"flash"`` or ``"torch"``.
    skip_outside_window: with a sliding window, skip the ring steps whose blocks lie wholly
        outside it (costs one small device-to-host read per new ``cu_seqlens``).
    agree_across_ranks: before the first collective of every call, all ranks agree that
        every rank's input is valid and that all were given the same batch (one all-reduce
        and a host read; on a process group with a CPU backend, e.g.
        ``init_process_group("cpu:gloo,cuda:nccl")``, it does not wait for the GPU). Off:
        checks stay local, which is cheaper, but one rank's bad input can leave the other
        ranks waiting in a collective.
    recompute_exchange: keep for the backward only what one GPU keeps (the q, k and v shards,
        the output and the logsumexps) and exchange the exchange regions' q, KV and output
        again in the backward, in the all-to-all that sends the gradient: a layer's saved
        tensors per rank fall by the exchanged copies (about the size of its q, k, v and
        output shards), for about twice the backward's all-to-all bytes (docs/design.md §4.1).
    agreement_timeout_s: how long that agreement waits for the other ranks before it raises
        :class:`hcp_compile.AgreementTimeout` (a rank that skipped the call, e.g. because it
        caught an exception and went on, would leave the others waiting); None: the process
        group's own timeout (``init_process_group(timeout=...)``).
    """

    placement: str = DEFAULT_PLACEMENT
    kernel: str = "auto"
    skip_outside_window: bool = True
    agree_across_ranks: bool = True
    agreement_timeout_s: float | None = None
    recompute_exchange: bool = False

    def __post_init__(self) -> None:
        check_placement(self.placement)
        if self.kernel not in KERNEL_CHOICES:
            raise InputError(f"kernel: expected one of {KERNEL_CHOICES}, got {self.kernel!r}")
        validation.check_timeout(self.agreement_timeout_s, "agreement_timeout_s")
        validation.check_flags(self, ("skip_outside_window", "agree_across_ranks", "recompute_exchange"))


def active_context() -> "ContextParallel | None":
    return _ACTIVE.get()


@dataclass(frozen=True)
class _BatchFacts:
    """What the checks and the schedule need from one ``cu_seqlens`` version."""

    version: int
    values: Tensor  # host copy, int64
    layout: BatchLayout  # on the host; the schedule moves it to the attention's device
    sizes: RankSizes  # this rank's sizes under the layout
    fingerprint: int


class ContextParallel:
    """The state of one ``context_parallel`` block: the mesh's groups, the options, and what
    was derived from the ``cu_seqlens`` tensors seen (every layer of a model passes the same
    tensor, so it is read, checked and laid out once per batch)."""

    def __init__(self, mesh: MeshLike, options: CPOptions):
        self.groups: CPGroups = resolve_groups(mesh)
        self.options = options
        self._facts_of = WeakIdKeyDictionary()  # cu_seqlens tensor -> _BatchFacts
        self._schedules = WeakIdKeyDictionary()  # cu_seqlens tensor -> {signature: schedule}
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> "ContextParallel":
        self._tokens.append(_ACTIVE.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._tokens.pop())

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        max_seqlen_q: int, max_seqlen_k: int, *, causal: bool, scale: float,
        window: tuple[int, int],
    ) -> Tensor:
        error, kernel, facts = None, None, None
        try:
            facts = self._facts(cu_seqlens_q)
            kernel = self._check_call(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, facts
            )
        except InputError as exc:
            error = exc
        if self.options.agree_across_ranks:
            agree_on_error(
                self.groups, error, facts.fingerprint if facts is not None else None,
                timeout_s=self.options.agreement_timeout_s,
            )
        elif error is not None:
            raise error
        # max_seqlen only bounds the kernels' segments: the larger one is right for both
        max_seqlen = max(max_seqlen_q, max_seqlen_k)
        sched = self._schedule(q, cu_seqlens_q, facts, max_seqlen, causal, scale, window, kernel)
        return HierarchicalAttention.apply(q, k, v, sched, self.groups, False, self.options.recompute_exchange)

    def _facts(self, cu_seqlens: Tensor) -> _BatchFacts:
        facts = self._facts_of.get(cu_seqlens)
        if facts is None or facts.version != cu_seqlens._version:
            values = validation.check_cu_seqlens(cu_seqlens, "cu_seqlens_q")
            groups = self.groups
            batch = layout.batch_layout(
                values, groups.ulysses_size, groups.ring_size, placement_rule(self.options.placement)
            )
            sizes = layout.rank_sizes(
                layout.rank_size_values(batch, groups.ring_rank, groups.ulysses_rank).tolist(),
                groups.ulysses_rank, groups.ulysses_size,
            )
            salt = validation.fingerprint_salt(self.options.placement, self.options.recompute_exchange)
            fingerprint = int(validation.batch_fingerprint(values, salt))
            facts = _BatchFacts(cu_seqlens._version, values, batch, sizes, fingerprint)
            self._facts_of[cu_seqlens] = facts
        return facts

    def _schedule(
        self, q: Tensor, cu_seqlens: Tensor, facts: _BatchFacts, max_seqlen: int, causal: bool,
        scale: float, window: tuple[int, int], kernel: str,
    ) -> RingSchedule:
        """The ring schedule, cached per ``cu_seqlens`` tensor version and call signature
        (building it runs no collective, so a cache miss on one rank only is harmless)."""
        key = (cu_seqlens._version, q.device, max_seqlen, causal, scale, window, kernel)
        per_tensor = self._schedules.setdefault(cu_seqlens, {})
        if key not in per_tensor:
            for stale in [old for old in per_tensor if old[0] != key[0]]:
                del per_tensor[stale]  # the tensor was written in place since
            groups = self.groups
            per_tensor[key] = build_schedule(
                facts.layout.to(q.device), facts.sizes, max_seqlen, groups.ring_rank, causal=causal, scale=scale,
                window=window, kernel=kernel, skip_outside_window=self.options.skip_outside_window,
                first_cache_key=new_cache_key(cache_keys_needed(groups.ring_size)),
            )
        return per_tensor[key]

    def _check_call(self, q, k, v, cu_q, cu_k, max_q, max_k, window, facts: _BatchFacts) -> str:
        """The rules of one call (validation.py; no collective); returns the kernel to run."""
        groups, placement = self.groups, self.options.placement
        validation.check_qkv(q, k, v)
        if cu_k is not cu_q:
            validation.check_same_documents(
                facts.values, validation.check_cu_seqlens(cu_k, "cu_seqlens_k")
            )
        for name, max_seqlen in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
            validation.check_max_seqlen(max_seqlen, facts.values, name)
        validation.check_head_split(q.shape[1], k.shape[1], groups.ulysses_size)
        check_plan_agrees(cu_q, groups.ulysses_size, groups.ring_size, placement)
        validation.check_shard_tokens(
            {"q": q, "k": k, "v": v}, facts.sizes.tokens, groups.ulysses_size, groups.ring_size,
            placement,
        )
        return resolve_kernel(
            self.options.kernel, BlockRequest.of(q, k, window, context_parallel=True),
            "context_parallel(mesh, kernel=...)",
        )


def context_parallel(mesh: MeshLike, **options) -> ContextParallel:
    """Context manager: inside it, ``hcp_compile.varlen_attention`` takes this rank's shards
    (laid out by ``shard_plan`` for the same mesh and placement) and runs hierarchical CP
    attention.

    ``mesh``: a ``("ring", "ulysses")`` DeviceMesh from ``make_mesh``, or a pair
    ``(ulysses_group, ring_group)``. ``options``: the fields of :class:`CPOptions`.
    """
    return ContextParallel(mesh, CPOptions(**options))
