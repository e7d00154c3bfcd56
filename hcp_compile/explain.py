"""``hcp_compile.explain``: what the ``hcp`` backend would rewrite, without running the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from hcp_compile.compiled.backend import default_mesh, parse_options, rewrite_config
from hcp_compile.exchange.mesh import CPGroups, resolve_groups
from hcp_compile.plan import ShardPlan

if TYPE_CHECKING:
    from hcp_compile.passes.hierarchical_cp import GraphRecord


# how the rewrite's bytes and the batch's compare (their tables count the same call)
BYTES_NOTE = (
    "bytes per rank and attention call: above, at most (every local token exchanged and sent round the "
    "ring), of the forward (fwd) and of forward and backward (fwd+bwd); below, as this batch lays out "
    "its tokens, of forward and backward"
)


@dataclass(frozen=True)
class Explanation:
    """The rewrite of every graph Dynamo captured: per graph, its code before and after the
    rewrite and the table of matched nodes (``str()`` prints the tables)."""

    graphs: list[GraphRecord]  # one per graph Dynamo captured
    tables: list[str]
    batch: str | None = None  # the shard plan's summary of the batch, when one was given

    def __str__(self) -> str:
        parts = []
        for index, (graph, table) in enumerate(zip(self.graphs, self.tables)):
            parts.append(f"graph {index}: {len(graph.rewritten)} attention node(s) rewritten\n{table}")
        if not parts:
            parts.append("Dynamo captured no graph")
        if self.batch is not None:
            parts.append(BYTES_NOTE)
            parts.append(f"the batch on every rank:\n{self.batch}")
        return "\n\n".join(parts)


def explain(model: nn.Module, *args, plan: ShardPlan | None = None, **options) -> Explanation:
    """Trace ``model(*args)`` as ``torch.compile(model, backend="hcp", options=options)``
    would, and report the rewrite. The model runs on fake tensors only: nothing is computed
    and no collective is issued. ``args`` are this rank's inputs, as for the compiled model;
    with the ``plan`` that sharded them, the report also holds ``plan.summary()`` (tokens,
    pads, work, placements and bytes moved per rank; its heads and head size default to the
    model's first attention node)."""
    from hcp_compile.passes.hierarchical_cp import HierarchicalCPPass  # see HcpBackend.__call__

    parsed = parse_options(options)
    groups: CPGroups = resolve_groups(parsed.mesh if parsed.mesh is not None else default_mesh())
    config = rewrite_config(groups, parsed)
    graphs, tables = [], []

    def record_rewrite(gm: fx.GraphModule, example_inputs):
        untouched = fx.Graph()
        untouched.output(untouched.graph_copy(gm.graph, {}))
        rewrite = HierarchicalCPPass(config)
        rewrite(gm.graph)
        graphs.append(rewrite.record)
        tables.append(rewrite.table())
        return fx.GraphModule(gm, untouched).forward  # runs on the fake inputs: no collectives

    # a backend of its own: Dynamo keeps this trace apart from the model's other compiles
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = tree_map_only(torch.Tensor, mode.from_tensor, args)
        torch.compile(model, backend=record_rewrite)(*fake_args)
    batch = None
    if plan is not None:
        first = next((r for g in graphs for r in g.rewritten), None)
        shape = {} if first is None else {
            "heads_q": first.heads_q, "heads_kv": first.heads_kv, "head_dim": first.head_dim,
            "dtype": first.dtype,
        }
        batch = plan.summary(**shape, scheme=parsed.scheme)
    return Explanation(graphs, tables, batch)
