"""The choice between a compiled graph and its narrower variants
(``hcp_compile.compiled.graph_variants``), with stand-in graphs: which one each batch runs, each
narrower graph compiled once and on first use, and a broader graph kept for the batches whose
graph cannot be used. The graphs themselves run in tests/test_compile.py (gqa-graph-variants)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from hcp_compile.batch import layout
from hcp_compile.batch.layout import Kind
from hcp_compile.batch.placements import placement_rule
from hcp_compile.batch.prepared import Exchanges, GraphKind, MeshShape
from hcp_compile.compiled.graph_variants import GraphVariants, cu_seqlens_inputs, graph_copy

MESH = MeshShape(ulysses=2, ring=2, placement="balanced")
NOTHING = (2,) * 32  # every document whole on its rank (balanced, 2 x 2)
RING = (0, 1, 7, 3, 13, 0, 2, 29, 0)
HEADS_NO_RING = (0, 1, 7, 3, 13, 0, 2, 29, 0)  # on 2 x 1: split over the Ulysses group only


def cu(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def kinds(lengths: tuple[int, ...], mesh: MeshShape = MESH) -> set[Kind]:
    """Independently of the prepared batch: the layout's own placement of the documents."""
    batch = layout.batch_layout(cu(lengths), mesh.ulysses, mesh.ring, placement_rule(mesh.placement))
    return {Kind(int(kind)) for kind, length in zip(batch.kind, batch.lengths) if length > 0}


def test_premise_of_the_batches():
    assert kinds(NOTHING) == {Kind.LOCAL}
    assert Kind.RING in kinds(RING)
    assert kinds(HEADS_NO_RING, MeshShape(2, 1, "balanced")) == {Kind.LOCAL, Kind.GROUP}


class Graphs:
    """Stand-ins for the compiled graphs, recording what ran."""

    def __init__(self, fail: tuple[Exchanges | GraphKind, ...] = (), guards_added: int = 0):
        self.ran: list[str] = []
        self.compiled: list[Exchanges | GraphKind] = []  # the exchanges of a graph of every step
        self.guards: list[str] = []
        self.fail, self.guards_added = fail, guards_added

    def full(self, *args):
        self.ran.append("ring")
        return "ring"

    def compile_for(self, kind: GraphKind):
        named = kind if kind.window_steps else kind.exchanges
        self.compiled.append(named)
        self.guards += [f"Eq(s{len(self.guards)}, 7)"] * self.guards_added
        if named in self.fail:
            raise RuntimeError("no graph today")

        def graph(*args):
            self.ran.append(kind.text)
            return kind.text

        return graph

    def variants(self, mesh: MeshShape = MESH, inputs: tuple[int, ...] = (1,), windows: tuple[int, ...] = ()
                 ) -> GraphVariants:
        return GraphVariants(self.full, self.compile_for, inputs, mesh, guards=lambda: self.guards, windows=windows)


def test_each_batch_runs_the_narrowest_graph_and_each_compiles_once():
    graphs = Graphs()
    variants = graphs.variants()
    for lengths in (RING, NOTHING, RING, NOTHING):
        variants("x", cu(lengths), "y")
    assert graphs.ran == ["ring", "nothing", "ring", "nothing"]
    assert graphs.compiled == [Exchanges.NOTHING]


def test_batches_that_exchange_heads_run_their_own_graph_where_there_is_a_ring():
    graphs = Graphs()
    variants = graphs.variants()
    assert [variants.graph_for(GraphKind(e))() for e in (Exchanges.HEADS, Exchanges.NOTHING, Exchanges.HEADS)] == [
        "heads", "nothing", "heads"]
    assert graphs.compiled == [Exchanges.HEADS, Exchanges.NOTHING]


def test_without_a_ring_the_full_graph_runs_batches_that_exchange_heads():
    graphs = Graphs()
    variants = graphs.variants(MeshShape(2, 1, "balanced"))
    assert variants.needed(("x", cu(HEADS_NO_RING))) == GraphKind(Exchanges.HEADS)
    assert variants("x", cu(HEADS_NO_RING)) == "ring"
    assert variants("x", cu(NOTHING)) == "nothing"
    assert graphs.compiled == [Exchanges.NOTHING]


@pytest.mark.parametrize("why, graphs, refused", [
    ("compiling it failed", Graphs(fail=(Exchanges.NOTHING,)), ["nothing"]),
    ("guards on the inputs", Graphs(guards_added=1), ["nothing", "heads"]),
])
def test_an_unusable_graph_leaves_the_next_broader_one_for_its_batches(why, graphs, refused):
    variants = graphs.variants()
    with pytest.warns(UserWarning) as warned:
        broader = variants("x", cu(NOTHING), "y")
    assert [str(w.message).split("exchange ")[1].split(" ")[0] for w in warned] == refused
    assert all(why in str(w.message) for w in warned)
    if graphs.guards_added:  # the warning names the guards, for a report
        assert [str(w.message).count("Eq(s") for w in warned] == [1, 1]
    # the graph for batches that exchange heads serves them, unless it is unusable too
    assert broader == ("heads" if len(refused) == 1 else "ring")
    assert variants("x", cu(NOTHING), "y") == broader
    assert graphs.compiled == [Exchanges.NOTHING, Exchanges.HEADS]


def test_a_batch_that_cannot_be_laid_out_runs_the_full_graph_which_checks_it():
    graphs = Graphs()
    bad = torch.tensor([0, 5, 3, 8], dtype=torch.int32)  # decreasing: the full graph's check rejects it
    assert graphs.variants()("x", bad, "y") == "ring" and graphs.compiled == []


def test_the_broadest_cu_seqlens_input_decides():
    graphs = Graphs()
    variants = graphs.variants(inputs=(0, 1))
    variants(cu(NOTHING), cu(RING))
    variants(cu(NOTHING), cu(NOTHING))
    assert graphs.ran == ["ring", "nothing"]


# laid out for a window of 6 on a ring of 4 in adjacent pairs: ring chunks of 9-13 rows, so a
# window of 6 back needs 2 steps and one of 30 back 3 (tests/test_window_adjacent.py)
WINDOWED_MESH = MeshShape(1, 4, "balanced", (6, 0))
ADJACENT = ((1, 1, 4, 4, 75, 66, 1, 68, 68, 3), (6, 98, 97, 4, 5, 77, 3, 7, 3, 85, 2))


def test_a_window_s_batches_run_a_graph_of_the_steps_they_need():
    """A batch laid out for a window in adjacent pairs runs the graph of the ring steps each of
    the graph's windows needs, compiled once per count; a window the steps do not shorten (or
    a batch not in adjacent pairs) keeps the full graph's every step."""
    graphs = Graphs()
    variants = graphs.variants(WINDOWED_MESH, windows=(6, 30))
    for lengths in ADJACENT + ADJACENT:
        variants("x", cu(lengths))
    kind = GraphKind(Exchanges.RING, ((6, 2), (30, 3)))
    assert variants.needed(("x", cu(ADJACENT[0]))) == kind
    assert graphs.ran == ["ring;6:2,30:3"] * 4 and graphs.compiled == [kind]
    assert GraphKind.parse(kind.text) == kind and kind.code not in (0, 1, 2)
    assert kind.steps(True, (6, 0)) == 2 and kind.steps(False, (6, 0)) is None and kind.steps(True, (-1, -1)) is None
    # the zigzag's batches need every step: the full graph
    assert graphs.variants(MESH, windows=(6,))("x", cu(RING)) == "ring"


def test_a_graph_of_fewer_steps_that_cannot_be_used_leaves_the_full_one():
    kind = GraphKind(Exchanges.RING, ((6, 2),))
    graphs = Graphs(fail=(kind,))
    variants = graphs.variants(WINDOWED_MESH, windows=(6,))
    with pytest.warns(UserWarning, match=r"need only some ring steps \(2 under a window of 6\)"):
        assert variants("x", cu(ADJACENT[0])) == "ring"
    assert variants("x", cu(ADJACENT[1])) == "ring" and graphs.compiled == [kind]


def test_the_broadest_kind_runs_every_input_s_batch():
    ring = Exchanges.RING
    assert GraphKind.broadest([GraphKind(ring, ((6, 2), (30, 3))), GraphKind(ring, ((6, 3),))]) == GraphKind(ring, ((6, 3),))
    assert GraphKind.broadest([GraphKind(Exchanges.NOTHING), GraphKind(ring, ((6, 2),))]) == GraphKind(ring)
    assert GraphKind.broadest([GraphKind(Exchanges.NOTHING), GraphKind(Exchanges.HEADS)]) == GraphKind(Exchanges.HEADS)


class _Call:
    def __init__(self, cu_q: fx.Node, cu_k: fx.Node):
        self.cu_seqlens_q, self.cu_seqlens_k = cu_q, cu_k


class _Match:
    def __init__(self, node: fx.Node, cu_q: fx.Node, cu_k: fx.Node):
        self.node, self.call = node, _Call(cu_q, cu_k)


def _graph() -> tuple[fx.Graph, list[fx.Node]]:
    graph = fx.Graph()
    q, cu_a, cu_b = (graph.placeholder(n) for n in ("q", "cu_a", "cu_b"))
    computed = graph.call_function(torch.add, (cu_b, 1))
    attention = graph.call_function(torch.mul, (q, 2))
    graph.output(attention)
    return graph, [q, cu_a, cu_b, computed, attention]


def test_inputs_are_the_positions_of_the_cu_seqlens_placeholders():
    graph, (_, cu_a, cu_b, computed, attention) = _graph()
    assert cu_seqlens_inputs(graph, [_Match(attention, cu_a, cu_a)]) == (1,)
    assert cu_seqlens_inputs(graph, [_Match(attention, cu_b, cu_a)]) == (1, 2)
    # a cu_seqlens the graph computes cannot be read before it runs; no match, nothing to choose
    assert cu_seqlens_inputs(graph, [_Match(attention, computed, cu_a)]) is None
    assert cu_seqlens_inputs(graph, []) is None
    # a match inside a nested graph (a checkpoint body) keeps the full graph alone
    nested, (*_, nested_attention) = _graph()
    assert cu_seqlens_inputs(graph, [_Match(nested_attention, cu_a, cu_a)]) is None


def test_graph_copy_leaves_the_original_graph_untouched_by_a_rewrite():
    graph, _ = _graph()
    module = fx.GraphModule(torch.nn.Module(), graph)
    module.meta["note"] = 1
    copied = graph_copy(module)
    for node in list(copied.graph.nodes):
        if node.target is torch.mul:
            node.target = torch.sub
    copied.recompile()
    assert [n.target for n in module.graph.nodes if n.op == "call_function"] == [torch.add, torch.mul]
    assert copied.meta == {"note": 1}
    x = torch.ones(2)
    assert torch.equal(module(x, x, x), 2 * x) and torch.equal(copied(x, x, x), x - 2)
