"""A compiled graph for each kind of batch a mesh can get (docs/compiled-path.md, "Graph
variants").

A compiled graph reads its layout sizes from the batch as symbols, so it cannot tell what a
batch moves between ranks (:class:`prepared.Exchanges`): without a ring section (every document
whole on one ring rank, as short documents are placed) it would keep every ring step, each with
empty blocks, merges and hops, where eager runs the own step alone; and with no exchange region
anywhere (every document whole on one rank) it would keep the Ulysses all-to-alls and the joins
of the regions, where eager runs the local block alone. So the backend keeps up to three graphs
of one Dynamo graph, and the batch's values pick one before any runs::

    args ──► cu_seqlens (a graph input) ──► prepared batch ──► what it exchanges
                                                            ├─ RING ────► full graph (compiled by Dynamo's call)
                                                            │   └─ a window's steps ─► graph of those steps
                                                            ├─ HEADS ───► own-step graph (compiled on first use)
                                                            └─ NOTHING ─► local graph (compiled on first use)

A batch laid out for a window in adjacent pairs needs only the first ring steps of its calls
under that window (``layout.window_steps``), which eager CP runs alone; a graph of those steps
(one per count of steps the graph's windows need, :class:`prepared.GraphKind`) sends no KV for
the others and merges nothing for them.

The batch found here for a ``cu_seqlens`` tensor is the one the graph's batch check takes
(``BatchCache.find`` keeps it per tensor and version), so choosing costs no extra device read
and no second look-up by value; the kind chosen is kept per tensors (``call.KeptCalls``), so
the calls of a step choose without entering the batch package. Ranks given different
batches may choose different graphs; every graph begins with the same agreed check, which then
fails on every rank. So do ranks where a graph could not be built beside ranks where it could
(its check's fingerprint names the batches its graph serves): an error on every rank instead
of one graph's collectives waiting for ranks that never issue them.

A narrower graph is compiled the first time a batch that needs it arrives, under the tracing
context of Dynamo's call, as Dynamo compiles its own specializations. It differs from the full
graph only in what the data-dependent sizes decide, so it adds no guards on the inputs; if it
did (or failed to compile), the next broader graph, right for the batch too, serves it on that
rank, with a warning.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torch import fx

from hcp_compile.batch.call import KeptCalls
from hcp_compile.batch.prepared import Exchanges, GraphKind, MeshShape, find


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
class GraphVariants:
    """The compiled callable the backend returns when a graph can be chosen per batch: the
    full graph, and the narrower ones ``compile_for`` makes on first use."""

    full: Callable
    compile_for: Callable[[GraphKind], Callable]  # the graph for batches of this kind
    inputs: tuple[int, ...]  # positions of the graph's cu_seqlens inputs
    mesh: MeshShape
    guards: Callable[[], Sequence[Any]] | None = None  # Dynamo's shape environment's guards
    windows: tuple[int, ...] = ()  # the keys back of the causal windows of the graph's calls
    graphs: dict[GraphKind, Callable | None] = field(default_factory=dict, init=False)  # None: refused
    chosen: dict[GraphKind, Callable] = field(default_factory=dict, init=False)  # graph_for's answers
    # the graph's kind per cu_seqlens tensors: every call of a step passes the same ones
    kinds: KeptCalls[GraphKind] = field(default_factory=KeptCalls, init=False)

    def __call__(self, *args):
        return self.graph_for(self.needed(args))(*args)

    def needed(self, args: Sequence[Any]) -> GraphKind:
        """The kind of graph the batch of ``args`` needs (the broadest over its cu_seqlens)."""
        tensors = tuple(args[i] for i in self.inputs)
        return self.kinds.kept(tensors, (), lambda: GraphKind.broadest(
            find(cu, self.mesh).graph_kind(self.windows) for cu in tensors))

    def graph_for(self, kind: GraphKind) -> Callable:
        """The narrowest compiled graph that runs batches of ``kind``: a narrower graph where
        it could be built, else the full one. Without a ring the full graph has the own step
        alone, so no graph is kept for HEADS."""
        if kind not in self.chosen:
            self.chosen[kind] = self._narrowest(kind)
        return self.chosen[kind]

    def _narrowest(self, kind: GraphKind) -> Callable:
        exchanges = kind.exchanges
        narrower = [GraphKind(e) for e in (Exchanges.NOTHING, Exchanges.HEADS)
                    if e.covers(exchanges) and not (e is Exchanges.HEADS and self.mesh.ring == 1)]
        for option in narrower + ([kind] if kind.window_steps else []):
            if option not in self.graphs:
                self.graphs[option] = self._compiled(option)
            if self.graphs[option] is not None:
                return self.graphs[option]
        return self.full

    def _compiled(self, kind: GraphKind) -> Callable | None:
        before = len(self.guards()) if self.guards is not None else 0
        try:
            compiled = self.compile_for(kind)
        except Exception as error:  # a broader graph stays right for the batch
            return self._refuse(kind, f"compiling it failed ({type(error).__name__}: {error})")
        added = list(self.guards())[before:] if self.guards is not None else []
        if added:
            shown = "; ".join(str(getattr(guard, "expr", guard)) for guard in added[:3])
            return self._refuse(kind, f"it would add guards on the inputs that Dynamo does not check ({shown})")
        return compiled

    def _refuse(self, kind: GraphKind, why: str) -> None:
        warnings.warn(
            f"hcp backend: the graph for batches that {_serves(kind)} is not used: {why}; "
            "a broader graph runs them on this rank (correct, with empty steps). Where other "
            "ranks built it, such batches fail the agreed batch check on every rank", stacklevel=4,
        )
        return None


def _serves(kind: GraphKind) -> str:
    if kind.window_steps:
        steps = ", ".join(f"{count} under a window of {left}" for left, count in kind.window_steps)
        return f"need only some ring steps ({steps})"
    return {Exchanges.HEADS: "exchange heads but have no ring section",
            Exchanges.NOTHING: "exchange nothing (every document whole on one rank)"}[kind.exchanges]
