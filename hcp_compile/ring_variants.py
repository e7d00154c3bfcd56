"""A compiled graph for the batches that need no ring steps (docs/compiled-path.md, "Ring
variants").

A compiled graph reads its layout sizes from the batch as symbols, so it cannot tell that a
batch has no ring section (every document placed whole on one ring rank, as short documents
are): it keeps every ring step, each with empty blocks, merges and hops, where eager runs the
own step alone. So the backend keeps two graphs of one Dynamo graph, and the batch's values
pick one before either runs::

    args ──► cu_seqlens (a graph input) ──► prepared batch ──► ring section?
                                                            ├─ yes ──► full graph (compiled by Dynamo's call)
                                                            └─ no ───► own-step graph (compiled on first use)

The host copy of ``cu_seqlens`` made here is the one the graph's batch check reads
(:func:`prepared.host_values` keeps it per tensor and version), and the prepared batch is the
one the graph's check takes, so choosing costs no extra device read. Ranks given different
batches may choose different graphs; both begin with the same agreed check, which then fails
on every rank. So do ranks where the graph without ring steps could not be built beside
ranks where it could (its check's fingerprint differs: ``own_step_only``): an error on every
rank instead of the full graph's ring hops waiting for ranks that never send.

The own-step graph is compiled the first time a batch without a ring section arrives, under
the tracing context of Dynamo's call, as Dynamo compiles its own specializations. Its graph
differs from the full one only in ring steps, whose sizes are data-dependent symbols, so it
adds no guards on the inputs; if it did (or failed to compile), the full graph, right for
every batch, keeps serving them all on that rank, with a warning.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torch import fx

from .prepared import MeshShape, host_values, prepare


def cu_seqlens_inputs(graph: fx.Graph, matches: Sequence[Any]) -> tuple[int, ...] | None:
    """Which inputs of ``graph`` (placeholder positions) are the ``cu_seqlens`` of the
    attention ``matches`` (``passes.match.AttentionMatch``), or None when a graph choice cannot
    be made before it runs: no match, a match inside a nested region, or a ``cu_seqlens``
    the graph computes."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    nodes = {cu for m in matches for cu in (m.call.cu_seqlens_q, m.call.cu_seqlens_k)}
    if not matches or any(m.node.graph is not graph for m in matches) or not nodes <= set(placeholders):
        return None
    return tuple(sorted(placeholders.index(node) for node in nodes))


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A module of a copy of ``gm``'s graph (its nodes' metadata shared), for a second rewrite:
    compiling rewrites the graph it is given in place."""
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    copied.meta = dict(gm.meta)
    return copied


@dataclass
class RingVariants:
    """The compiled callable the backend returns when a graph can be chosen per batch: the
    full graph, and the own-step graph made by ``compile_own_step`` on first use."""

    full: Callable
    compile_own_step: Callable[[], Callable]
    inputs: tuple[int, ...]  # positions of the graph's cu_seqlens inputs
    mesh: MeshShape
    guard_count: Callable[[], int] | None = None  # the guards of Dynamo's shape environment
    own_step: Callable | None = field(default=None, init=False)
    refused: bool = field(default=False, init=False)  # the own-step graph failed: full only

    def __call__(self, *args):
        if self.refused or any(prepare(host_values(args[i]), self.mesh).has_ring_section for i in self.inputs):
            return self.full(*args)
        if self.own_step is None:
            self.own_step = self._compiled_own_step()
            if self.own_step is None:
                return self.full(*args)
        return self.own_step(*args)

    def _compiled_own_step(self) -> Callable | None:
        before = self.guard_count() if self.guard_count is not None else 0
        try:
            compiled = self.compile_own_step()
        except Exception as error:  # the full graph stays right for every batch
            return self._refuse(f"compiling it failed ({type(error).__name__}: {error})")
        if self.guard_count is not None and self.guard_count() != before:
            return self._refuse("it would add guards on the inputs that Dynamo does not check")
        return compiled

    def _refuse(self, why: str) -> None:
        self.refused = True
        warnings.warn(
            f"hcp backend: the graph for batches without a ring section is not used: {why}; "
            "the full graph runs every batch on this rank (correct, with empty ring steps). Where "
            "other ranks built it, such batches fail the agreed batch check on every rank", stacklevel=3,
        )
        return None
