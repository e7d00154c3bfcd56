"""The ranks' agreement before a call's first collective: one protocol for both doors
(docs/design.md §9). Eager CP (hcp_compile/context.py), the compiled graph's host op
(hcp_compile/compiled/inserted.py) and ``ShardPlan.unshard`` build a :class:`Verdict` of
their rank's call, agree on it over the mesh (:func:`agree`: one all-reduce per mesh dimension
of more than one rank, waiting at most ``agreement_timeout_s``) and raise what
:func:`raise_agreed` finds, so one bad input gives the same text on every rank, eager or
compiled, and no rank is left waiting in a collective.

Note [the verdict as one vector]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A verdict travels as int64s, all-reduced with ``max``::

    | batch rules (validation.verdict) | other | fp | -fp | graph | -graph |

- batch rules: per rule and argument the failure's numbers, the rank's position in their high
  bits: the max keeps the numbers of the lowest rank that broke each rule;
- other: 1 where the rank failed a rule outside the batch's (its inputs' shapes, the kernel):
  that rank raises its own error, the others say that another rank did;
- fp, -fp: the batch's fingerprint (values, mesh shape and options) and its negation, so the
  max gives the mesh's highest and lowest: apart where ranks were given different batches;
- graph, -graph: the same for the compiled graph a rank runs (eager: 0), apart where ranks run
  graphs built for batches that exchange different things.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from hcp_compile import validation
from hcp_compile.exchange.mesh import CPGroups, agreement_device

ANOTHER_RANK = (
    "another rank of the context-parallel mesh rejected its input (see that rank's error); all "
    "ranks stop here instead of waiting in a collective"
)


class AgreementTimeout(RuntimeError):
    """The agreement before an attention call (or ``plan.unshard``) waited longer than its
    timeout for another rank of the context-parallel mesh: that rank did not make the same
    call (docs/design.md §9)."""


@dataclass(frozen=True)
class Verdict:
    """One rank's verdict on its call (Note [the verdict as one vector])."""

    failed: tuple[int, ...] = field(default=(0,) * validation.VERDICT_LENGTH)  # validation.verdict
    other_error: bool = False
    fingerprint: int = 0
    graph: int = 0

    LENGTH = validation.VERDICT_LENGTH + 5

    def encode(self) -> Tensor:
        fingerprint, graph = self.fingerprint, self.graph
        return torch.tensor([*self.failed, int(self.other_error), fingerprint, -fingerprint, graph, -graph],
                            dtype=torch.int64)


def fingerprint(digest: bytes, mesh: tuple | None, recompute_exchange: bool, scheme: str) -> int:
    """The :class:`Verdict`'s fingerprint of a call: a hash of the batch's values (``digest``,
    their SHA-256), the mesh shape ``(ulysses, ring, placement, layout window)`` (None: a
    single device), ``recompute_exchange`` and the collective scheme (the options every rank
    must share: ranks that differ in them would exchange buffers of different layouts or
    sizes), below 2**62 so that its negation fits an int64. Names, not indices, go in, so any
    number of placements and schemes is told apart; the same in every process."""
    if mesh is None:
        shape = "single"
    else:
        ulysses, ring, placement, window = mesh
        shape = f"{ulysses}x{ring}:{placement}" + ("" if window == (-1, -1) else f":{window}")
    salted = hashlib.sha256(digest + f"|{shape}|{int(recompute_exchange)}|{scheme}".encode())
    return int.from_bytes(salted.digest()[:8], "little") & (2**62 - 1)


def agree(groups: CPGroups, verdict: Tensor, *, timeout_s: float | None, caller: str) -> Tensor:
    """``verdict`` (an encoded :class:`Verdict`) all-reduced with ``max`` over the mesh's groups
    of more than one rank, each all-reduce waiting at most ``timeout_s`` (None: the process
    group's own timeout) before it raises :class:`AgreementTimeout`. It travels as a CPU
    tensor where the groups' backend takes one (gloo, or ``"cpu:gloo,cuda:nccl"``), so reading
    the result waits for no GPU work."""
    agreed = verdict.to(agreement_device(groups))
    for name, group in agreeing_groups(groups):
        _all_reduce_max(agreed, group, name, timeout_s, caller)
    return agreed.cpu()


def raise_agreed(agreed: Sequence[int], own_error: Exception | None = None) -> None:
    """Raise what the agreed verdict ``agreed`` (or a rank's own, unagreed) says, the same on
    every rank: this rank's ``own_error`` (a failure outside the batch rules), else the batch
    rules the mesh broke and ranks given different batches or running different graphs
    (:func:`validation.rejected_batch_error`), else that another rank failed."""
    if own_error is not None:
        raise own_error
    *failed, other, highest, negated_lowest, highest_graph, negated_lowest_graph = agreed
    # a rank that failed before it knew its batch sends no fingerprint: not a different batch
    error = validation.rejected_batch_error(
        failed, batches_differ=not other and highest != -negated_lowest,
        graphs_differ=not other and highest_graph != -negated_lowest_graph)
    if error is not None:
        raise error
    if other:
        raise RuntimeError(ANOTHER_RANK)


def agreeing_groups(groups: CPGroups) -> list[tuple[str, dist.ProcessGroup]]:
    """The mesh's groups an agreement all-reduces over, by name: those of more than one rank
    (over one rank the all-reduce would change nothing and still cost a collective)."""
    named = (("ulysses", groups.ulysses_group, groups.ulysses_size), ("ring", groups.ring_group, groups.ring_size))
    return [(name, group) for name, group, size in named if size > 1]


def _all_reduce_max(
    flags: Tensor, group: dist.ProcessGroup, name: str, timeout_s: float | None, caller: str,
) -> None:
    """``flags`` all-reduced (max) over ``group`` in place, waiting at most ``timeout_s``."""
    timeout = (
        datetime.timedelta(seconds=timeout_s) if timeout_s is not None
        else _group_timeout(group, flags.device)
    )
    started = time.monotonic()
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
    try:
        # with a timeout, gloo and NCCL block this thread until the all-reduce is done or
        # raise once the time is up (NCCL also aborts the group's communicator)
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as failure:
        waited = time.monotonic() - started
        if timeout is None or waited < timeout.total_seconds():
            raise  # not a timeout (a peer's connection closed, ...): the backend's own error
        raise AgreementTimeout(_timeout_message(group, name, waited, timeout_s, caller)) from failure


def _timeout_message(
    group: dist.ProcessGroup, name: str, waited: float, timeout_s: float | None, caller: str
) -> str:
    option = (
        f"agreement_timeout_s={timeout_s:g}" if timeout_s is not None
        else "agreement_timeout_s=None, the process group's timeout"
    )
    return (
        f"{caller}: the agreement all-reduce before the call (over this rank's {name} group, "
        f"global ranks {dist.get_process_group_ranks(group)}) timed out after {waited:.1f} s "
        f"({option}): another rank of the context-parallel mesh did not reach it; it probably "
        "skipped this call or stopped (for example it caught an exception and went on, or "
        "crashed: see its output). Every rank of the mesh must make the same calls in the "
        "same order: re-raise the exception (or stop every rank) instead of letting one rank "
        "go on. If a rank may legitimately arrive this late (it writes a checkpoint alone, "
        "...), raise the agreement_timeout_s option (context_parallel(mesh, agreement_timeout_s=...) "
        "or the hcp backend's options) or the process group's timeout. The process group is "
        "unusable after a timeout: restart the job"
    )


def _group_timeout(group: dist.ProcessGroup, device: torch.device) -> datetime.timedelta | None:
    """The timeout the group's backend was created with (``init_process_group(timeout=...)``,
    ``new_group(timeout=...)``), or None where the backend does not tell."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
