"""The seam for collective schemes: how a rank's tokens reach the ranks that attend to them.

Hierarchical CP moves data twice (docs/design.md §3): the Ulysses exchange trades heads for
tokens inside a ring rank (:class:`HeadExchange`), and the ring brings every ring rank the
keys and values of the others' ring sections, and their gradients back (:class:`KVRing`). A
:class:`CollectiveScheme` is one of each under a name; ``hierarchical.py`` runs the attention
and calls nothing but these two, and every byte count (the report, ``ShardPlan.summary``)
comes from their ``traffic``.

Note [the ring as steps]
~~~~~~~~~~~~~~~~~~~~~~~~
The attention asks a :class:`KVRing` for the keys of each ring step in order and hands back,
in the backward, each step's gradient of them; the scheme decides what travels when::

    step:            0            1            2     ...   R-1
    kv(step)         own stream   section of   section of  ...
                                  r-1          r-2
    add(step, dkv)   own section's gradient, then the gradient of the section of r-s
    result()         the own section's dKV summed over every ring rank's queries

A scheme issues each collective where its result is needed next and waits for it where it is
first read (``kv``/``result``), so the compute between them hides the transfer, eagerly and
in a traced graph alike (docs/design.md §5.3).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from hcp_compile.exchange.collectives import Issued
from hcp_compile.exchange.mesh import CPGroups


@dataclass(frozen=True)
class GroupTraffic:
    """What one rank issues on one process group in one attention call: collectives, and the
    bytes it sends to other ranks (its own share, which stays, not counted)."""

    forward_calls: int = 0
    backward_calls: int = 0
    forward_bytes: int = 0
    backward_bytes: int = 0

    def __add__(self, other: GroupTraffic) -> GroupTraffic:
        return GroupTraffic(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def times(self, count: int) -> GroupTraffic:
        return GroupTraffic(*(getattr(self, f.name) * count for f in fields(self)))


@dataclass(frozen=True)
class Traffic:
    """One attention call's traffic on each of the rank's two groups."""

    ulysses: GroupTraffic
    ring: GroupTraffic


@dataclass(frozen=True)
class GroupShape:
    """One head group of one attention call on one rank, as the collectives see it
    (docs/design.md §3.6: every head group has its own exchanges and ring)."""

    counts: tuple[int, ...]  # the exchange region of every Ulysses rank of this ring rank
    rank: int  # this rank's Ulysses index
    ring: int  # ring ranks
    ring_width: int  # W: the ring section's tokens
    steps: int  # ring steps of the schedule (1: nothing goes round the ring)
    heads_q: int  # query heads of the group on this rank after the exchange
    heads_kv: int  # KV heads of the group on this rank after the exchange (repeats included)
    head_dim: int
    itemsize: int  # of q, k, v and their gradients
    accumulate_itemsize: int  # of the lse and of sums kept in the accumulation dtype
    returns_lse: bool = False
    recompute_exchange: bool = False

    @property
    def section(self) -> int:
        """Elements of one ring section's KV, k and v side by side."""
        return self.ring_width * 2 * self.heads_kv * self.head_dim


class HeadExchange(Protocol):
    """The Ulysses exchange (docs/design.md §3.2, §3.5): ``scatter`` trades a rank's heads of
    its exchange region for its heads of every region, ``gather`` sends a result back, ``join``
    puts the gathered head groups in head order. Both collectives return an :class:`Issued`
    so the caller places the wait (the head-group pipeline)."""

    name: str

    def scatter(self, tensors: list[Tensor], group: dist.ProcessGroup, size: int,
                counts: tuple[int, ...], part: int = 0, parts: int = 1,
                after: Tensor | None = None) -> Issued[Tensor]: ...

    def gather(self, x: Tensor, group: dist.ProcessGroup, size: int, counts: tuple[int, ...],
               rank: int) -> Issued[Tensor]: ...

    def join(self, gathered: list[Tensor], repeat: int = 1) -> Tensor: ...

    def traffic(self, shape: GroupShape) -> GroupTraffic:
        """The collectives and bytes of one head group on the Ulysses group."""
        ...


class KVSteps(Protocol):
    """The keys and values of a schedule's ring steps, asked for in step order."""

    def kv(self, step: int) -> Tensor:
        """Step 0: the whole own stream ``[stream, 2h, D]``; step ``s``: the ring section
        ``[W, 2h, D]`` of ring rank ``r - s``."""
        ...


class KVGradSteps(KVSteps, Protocol):
    """:class:`KVSteps` of the backward, which also returns the gradients of the sections."""

    def add(self, step: int, dkv: Tensor | None) -> None:
        """This step's gradient of the keys :meth:`kv` gave it, over the ring section only
        (``[W, 2h, D]``, the input or the accumulation dtype), or None for a step that did
        not compute (outside the window)."""
        ...

    def result(self) -> Tensor:
        """The own ring section's gradient, summed over every step of every ring rank, in
        the keys' dtype. Called once, after the last :meth:`add`."""
        ...


class KVRing(Protocol):
    """How every ring rank gets the others' ring sections and their gradients back. ``kv`` is
    the exchange stream's ``[stream, 2h, D]`` keys and values (the first ``width`` rows: the
    ring section), ``steps`` the schedule's. Every rank must issue the same collectives in the
    same order whatever its batch; ``backward``'s must carry ``carried`` (one element of the
    backward's input), or a compiler merges them with the forward's (docs/design.md §4).

    A scheme that ``gathers`` (every section arrives at once) also runs schedules of one
    gathered step (Note [one gathered step] in batch/layout.py): given ``gather_rows`` (rank
    ``j``'s section row ``i`` is ``j * width + i``), step 1's keys are those rows of the
    gathered sections, and its gradient, added at step 1, goes back to them."""

    name: str
    gathers: bool

    def forward(self, kv: Tensor, width: int | torch.SymInt, steps: int,
                groups: CPGroups, gather_rows: Tensor | None = None) -> KVSteps: ...

    def backward(self, kv: Tensor, width: int | torch.SymInt, steps: int, groups: CPGroups,
                 carried: Tensor, gather_rows: Tensor | None = None) -> KVGradSteps: ...

    def traffic(self, shape: GroupShape) -> GroupTraffic:
        """The collectives and bytes of one head group on the ring group."""
        ...


@dataclass(frozen=True)
class CollectiveScheme:
    """A named way to move q, k, v and the results between the ranks of the mesh."""

    name: str
    heads: HeadExchange
    ring: KVRing
