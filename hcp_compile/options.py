"""The options both doors take: ``context_parallel(mesh, **options)`` (:class:`CPOptions`,
hcp_compile/context.py) and the ``hcp`` backend's ``options=`` (:class:`BackendOptions`,
hcp_compile/compiled/backend.py) add their own fields to these."""

from __future__ import annotations

from dataclasses import dataclass

from hcp_compile.batch.placements import DEFAULT_PLACEMENT, check_placement
from hcp_compile.exchange.schemes import DEFAULT_SCHEME, check_scheme
from hcp_compile.kernels import KERNEL_CHOICES
from hcp_compile.validation import InputError, check_flags, check_timeout


@dataclass(frozen=True)
class AttentionOptions:
    """How hierarchical CP attention runs, eagerly or compiled.

    placement: the token layout rule, as given to ``shard_plan`` (``"balanced"``: short
        documents whole on one rank, or ``"zigzag"``: every document round the ring).
    kernel: ``"auto"`` (the fastest kernel measured on the device that supports the call,
        kernels/measured.json; unmeasured devices: cudnn, else flash where it can run, else
        the plain-PyTorch kernel), ``"dense"``, ``"cudnn"`` (where its package loads and it
        passes its check on the device), ``"flex"``, ``"flash"`` or ``"torch"``; under the
        backend a module's ``@hcp_compile.attention(kernel=...)`` mark overrides it.
    agree_across_ranks: before the first collective of every call (compiled: of every
        batch), all ranks agree that every rank's input is valid and that all were given the
        same batch and options (one all-reduce per mesh dimension larger than 1 and a host
        read; on a process group with a CPU backend, e.g.
        ``init_process_group("cpu:gloo,cuda:nccl")``, it does not wait for the GPU). Off:
        checks stay local, which is cheaper, but one rank's bad input can leave the other
        ranks waiting in a collective.
    recompute_exchange: keep for the backward only the q, k and v shards, the output and the
        logsumexps, and exchange the exchange regions' q and KV again in the backward, in the
        all-to-all that sends the gradient and the output (which travels again by default):
        a layer's saved tensors per rank fall by the exchanged q and KV, for about 1.4 times
        the backward's all-to-all bytes (docs/design.md §4.1).
    scheme: the collective scheme that moves KV between the ring ranks, a key of
        ``hcp_compile.exchange.schemes.SCHEMES`` (``"ring"``: hops round the ring, each behind
        a step's blocks; ``"allgather"``: one all-gather, for rings of short steps;
        docs/extending.md).
    agreement_timeout_s: how long the agreement before a call's first collective (compiled:
        before a batch's) waits for the other ranks before it raises
        :class:`hcp_compile.AgreementTimeout` (a rank that skipped the call, e.g. because it
        caught an exception and went on, would leave the others waiting); None: the process
        group's own timeout (``init_process_group(timeout=...)``).
    """

    placement: str = DEFAULT_PLACEMENT
    kernel: str = "auto"
    agree_across_ranks: bool = True
    recompute_exchange: bool = False
    scheme: str = DEFAULT_SCHEME
    agreement_timeout_s: float | None = None

    def __post_init__(self) -> None:
        check_timeout(self.agreement_timeout_s, "agreement_timeout_s")
        check_placement(self.placement)
        check_scheme(self.scheme)
        if self.kernel not in KERNEL_CHOICES:
            raise InputError(f"kernel: expected one of {KERNEL_CHOICES}, got {self.kernel!r}")
        check_flags(self, ("agree_across_ranks", "recompute_exchange"))
