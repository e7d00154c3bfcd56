"""``context_parallel(mesh)``: run ``varlen_attention`` as hierarchical CP on local shards."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
from torch import Tensor

from hcp_compile import validation
from hcp_compile.batch.cache import BATCHES
from hcp_compile.batch.call import KeptCalls, checked_batch
from hcp_compile.batch.layout import window_by_position
from hcp_compile.batch.prepared import MeshShape, PreparedBatch, find_by_value, host_values
from hcp_compile.batch.schedule import RingSchedule, prepared_schedule
from hcp_compile.exchange.agreement import Verdict, agree, fingerprint, raise_agreed
from hcp_compile.exchange.mesh import CPGroups, MeshLike, resolve_groups
from hcp_compile.hierarchical import HierarchicalAttention
from hcp_compile.kernels import BlockRequest, resolve_kernel
from hcp_compile.options import AttentionOptions
from hcp_compile.validation import InputError

_ACTIVE: contextvars.ContextVar["ContextParallel | None"] = contextvars.ContextVar(
    "hcp_compile_context_parallel", default=None
)


@dataclass(frozen=True)
class CPOptions(AttentionOptions):
    """Options of ``context_parallel``: those of :class:`AttentionOptions`, and

    skip_outside_window: with a sliding window, skip the ring steps whose blocks lie wholly
        outside it (decided on the host from the batch's layout; the compiled door empties
        those steps' tables instead, docs/design.md §3.3).
    """

    skip_outside_window: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.check_flags(self, ("skip_outside_window",))


# Note [the context in a backward]
#
#   user thread:      with context_parallel(mesh):   loss.backward()  ----+
#                     (_ACTIVE set here)                                   | runs on
#   autograd thread:  checkpoint recomputes a layer: varlen_attention <---+ CUDA's own
#                     (_ACTIVE unset: a ContextVar does not cross threads)   backward thread
#
# A checkpointed layer's forward runs again inside the backward, which CUDA's autograd engine
# runs on a thread of its own. The recomputed attention must be CP again (it saves what the
# first forward's CP backward reads), so the open blocks are also listed process-wide and,
# inside a backward with no block of its own thread, the one open block is taken; with
# several open in other threads, which one started this backward is unknown: an error.
_OPEN: list["ContextParallel"] = []


def active_context() -> "ContextParallel | None":
    own = _ACTIVE.get()
    if own is not None or torch._C._current_graph_task_id() == -1 or not _OPEN:
        return own
    candidates = {id(block): block for block in list(_OPEN)}
    if len(candidates) > 1:
        raise InputError(
            "context_parallel: varlen_attention ran inside a backward on a thread of its own (a "
            f"checkpointed layer recomputed on CUDA's autograd thread) while {len(candidates)} "
            "context_parallel blocks are open in other threads, so which one started this backward "
            "is unknown; keep one context_parallel block open per process while its backward runs"
        )
    return next(iter(candidates.values()))


class ContextParallel:
    """The state of one ``context_parallel`` block: the mesh's groups, the options, and the
    schedules built for the batches seen (every layer of a model passes the same batch, so it
    is read, checked and laid out once per batch: ``prepared``)."""

    def __init__(self, mesh: MeshLike, options: CPOptions):
        self.groups: CPGroups = resolve_groups(mesh)
        self.options = options
        self.shape = MeshShape(self.groups.ulysses_size, self.groups.ring_size, options.placement)
        # (prepared batch, call signature) -> schedule, for the latest batch only
        self._schedules: dict[tuple, RingSchedule] = {}
        # the checked call per cu_seqlens tensors and call sizes
        self._checks: KeptCalls[_CheckedCall] = KeptCalls()
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> "ContextParallel":
        self._tokens.append(_ACTIVE.set(self))
        _OPEN.append(self)  # see Note [the context in a backward]
        return self

    def __exit__(self, *exc) -> None:
        _OPEN.remove(self)
        _ACTIVE.reset(self._tokens.pop())

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        max_seqlen_q: int, max_seqlen_k: int, *, causal: bool, scale: float,
        window: tuple[int, int],
    ) -> Tensor:
        groups = self.groups
        error, kernel, checked, failures = None, None, None, ()
        try:
            checked = self._checked_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            failures = checked.failures
            if not failures:
                kernel = resolve_kernel(
                    self.options.kernel,
                    BlockRequest.of(q, k, window, window_by_position=window_by_position(window, groups.ring_size)),
                    "context_parallel(mesh, kernel=...)",
                )
        except InputError as exc:
            error = exc
        # the protocol the compiled graph's host op follows too (exchange/agreement.py); without
        # the agreement a rank raises what its own verdict says, and builds none for a good call
        if self.options.agree_across_ranks or error is not None or failures:
            verdict = Verdict(
                tuple(validation.verdict(failures, (groups.ring_rank, groups.ulysses_rank))), error is not None,
                0 if checked is None else checked.fingerprint,
            ).encode()
            if self.options.agree_across_ranks:
                verdict = agree(groups, verdict, timeout_s=self.options.agreement_timeout_s, caller="varlen_attention")
            raise_agreed(verdict.tolist(), error)
        # max_seqlen only bounds the kernels' segments: the larger one is right for both
        max_seqlen = max(max_seqlen_q, max_seqlen_k)
        sched = self._schedule(q, k, checked.prepared, max_seqlen, causal, scale, window, kernel)
        return HierarchicalAttention.apply(q, k, v, sched, self.groups, False, self.options.recompute_exchange)

    def _schedule(
        self, q: Tensor, k: Tensor, prepared: PreparedBatch, max_seqlen: int, causal: bool, scale: float,
        window: tuple[int, int], kernel: str,
    ) -> RingSchedule:
        """The ring schedule from the prepared batch's host tables, kept per batch and call
        signature: the layers of a model share one (building it runs no collective, so a cache
        miss on one rank only is harmless). Per prepared batch, not per value: a batch the
        batch cache dropped and prepared again has new cache keys and host copies of tables."""
        key = (prepared, q.device, max_seqlen, causal, scale, window, kernel, k.shape[1])
        if key not in self._schedules:
            for stale in [old for old in self._schedules if old[0] is not prepared]:
                del self._schedules[stale]  # another batch: the old one's layers are done
            groups, options = self.groups, self.options
            self._schedules[key] = prepared_schedule(
                prepared, groups.ring_rank, groups.ulysses_rank, groups.ring_size, q.device, max_seqlen,
                causal=causal, scale=scale, window=window, kernel=kernel, scheme=options.scheme,
                kv_heads=k.shape[1], ulysses=groups.ulysses_size, skip_outside_window=options.skip_outside_window,
            )
        return self._schedules[key]

    def _checked_call(self, q, k, v, cu_q, cu_k, max_q, max_k) -> "_CheckedCall":
        """The call checked against its batch (validation.py; no collective), after the rules of
        its inputs' shapes, which raise. Kept per ``cu_seqlens`` tensors and the call's sizes
        (:class:`call.KeptCalls`), as the compiled graph's check is kept per call: the layers of
        a model make the same call, and find their batch here without asking the batch package."""
        groups = self.groups
        validation.check_cu_seqlens_dtype(cu_q, "cu_seqlens_q")
        validation.check_qkv(q, k, v)
        validation.check_head_split(q.shape[1], k.shape[1], groups.ulysses_size)
        if cu_k is not cu_q:
            validation.check_cu_seqlens_dtype(cu_k, "cu_seqlens_k")
        tokens, maxes = (q.shape[0], k.shape[0], v.shape[0]), (max_q, max_k)
        return self._checks.kept((cu_q, cu_k), (tokens, maxes), lambda: self._check(cu_q, cu_k, tokens, maxes))

    def _check(self, cu_q: Tensor, cu_k: Tensor, tokens: tuple[int, ...], maxes: tuple[int, int]) -> "_CheckedCall":
        """The call checked against its batch, found by value (``shard_plan`` prepared it
        already, here or in a DataLoader worker, unless the cache lost it) where the batch
        cache has not seen the tensor."""
        keys = None if cu_k is cu_q else host_values(cu_k)
        rank = (self.groups.ring_rank, self.groups.ulysses_rank)
        call = ("eager", None if keys is None else keys.digest, tokens, maxes, rank)
        prepared, failures = BATCHES.checked(
            cu_q, self.shape, lambda: find_by_value(cu_q, self.shape), call,
            lambda batch, planned: checked_batch(batch, keys, tokens, maxes, rank, planned),
        )
        options = self.options
        return _CheckedCall(prepared, failures,
                            fingerprint(prepared.batch.digest, prepared.mesh, options.recompute_exchange, options.scheme))


@dataclass(frozen=True)
class _CheckedCall:
    """One call of a batch as its check left it: the prepared batch, the batch rules the call
    breaks, and the fingerprint the ranks agree on."""

    prepared: PreparedBatch
    failures: tuple
    fingerprint: int


def context_parallel(mesh: MeshLike, **options) -> ContextParallel:
    """Context manager: inside it, ``hcp_compile.varlen_attention`` takes this rank's shards
    (laid out by ``shard_plan`` for the same mesh and placement) and runs hierarchical CP
    attention.

    ``mesh``: a ``("ring", "ulysses")`` DeviceMesh from ``make_mesh``, or a pair
    ``(ulysses_group, ring_group)``. ``options``: the fields of :class:`CPOptions`.
    """
    return ContextParallel(mesh, CPOptions(**options))
