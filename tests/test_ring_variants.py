"""The choice between a compiled graph and its graph without ring steps
(``hcp_compile.ring_variants``), with stand-in graphs: which one each batch runs, the second
compiled once and on first use, and the full graph kept for every batch when the second
cannot be used. The graphs themselves run in tests/test_compile.py (gqa-ring-variants)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from hcp_compile import layout
from hcp_compile.placements import placement_rule
from hcp_compile.prepared import MeshShape
from hcp_compile.ring_variants import RingVariants, cu_seqlens_inputs, graph_copy

MESH = MeshShape(ulysses=2, ring=2, placement="balanced")
NO_RING = (2,) * 32  # every document whole on its rank (balanced, 2 x 2)
WITH_RING = (0, 1, 7, 3, 13, 0, 2, 29, 0)


def cu(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def ring_width(lengths: tuple[int, ...]) -> int:
    """Independently of the prepared batch: the layout's own ring section."""
    batch = layout.batch_layout(cu(lengths), MESH.ulysses, MESH.ring, placement_rule(MESH.placement))
    return int(batch.ring_width)


def test_premise_one_batch_has_a_ring_section_and_one_has_none():
    assert ring_width(NO_RING) == 0 and ring_width(WITH_RING) > 0


class Graphs:
    """Stand-ins for the two compiled graphs, recording what ran."""

    def __init__(self, fail: bool = False, guards_added: int = 0):
        self.ran: list[str] = []
        self.compiles = 0
        self.guards = 0
        self.fail, self.guards_added = fail, guards_added

    def full(self, *args):
        self.ran.append("full")
        return "full"

    def compile_own_step(self):
        self.compiles += 1
        self.guards += self.guards_added
        if self.fail:
            raise RuntimeError("no graph today")

        def own_step(*args):
            self.ran.append("own")
            return "own"

        return own_step

    def variants(self) -> RingVariants:
        return RingVariants(self.full, self.compile_own_step, (1,), MESH, guard_count=lambda: self.guards)


def test_each_batch_runs_the_graph_its_ring_section_needs_and_the_second_compiles_once():
    graphs = Graphs()
    variants = graphs.variants()
    for lengths in (WITH_RING, NO_RING, WITH_RING, NO_RING):
        variants("x", cu(lengths), "y")
    assert graphs.ran == ["full", "own", "full", "own"]
    assert graphs.compiles == 1


@pytest.mark.parametrize("why, graphs", [
    ("compiling it failed", Graphs(fail=True)),
    ("guards on the inputs", Graphs(guards_added=1)),
])
def test_an_unusable_own_step_graph_leaves_the_full_graph_for_every_batch(why, graphs):
    variants = graphs.variants()
    with pytest.warns(UserWarning, match=why):
        assert variants("x", cu(NO_RING), "y") == "full"
    assert variants("x", cu(NO_RING), "y") == "full"
    assert graphs.compiles == 1 and graphs.ran == ["full", "full"]


def test_a_batch_that_cannot_be_laid_out_runs_the_full_graph_which_checks_it():
    graphs = Graphs()
    bad = torch.tensor([0, 5, 3, 8], dtype=torch.int32)  # decreasing: the full graph's check rejects it
    assert graphs.variants()("x", bad, "y") == "full" and graphs.compiles == 0


def test_every_cu_seqlens_input_must_lack_a_ring_section():
    graphs = Graphs()
    variants = RingVariants(graphs.full, graphs.compile_own_step, (0, 1), MESH)
    variants(cu(NO_RING), cu(WITH_RING))
    variants(cu(NO_RING), cu(NO_RING))
    assert graphs.ran == ["full", "own"]


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
