"""``hcp_compile.explain``: what the ``hcp`` backend would rewrite, without running the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from .backend import default_mesh, parse_options
from .mesh import CPGroups, resolve_groups

if TYPE_CHECKING:
    from .passes.hierarchical_cp import GraphRecord


@dataclass(frozen=True)
class Explanation:
    """The rewrite of every graph Dynamo captured: per graph, its code before and after the
    rewrite and the table of matched nodes (``str()`` prints the tables)."""

    graphs: list[GraphRecord]  # one per graph Dynamo captured
    tables: list[str]

    def __str__(self) -> str:
        parts = []
        for index, (graph, table) in enumerate(zip(self.graphs, self.tables)):
            parts.append(f"graph {index}: {len(graph.rewritten)} attention node(s) rewritten\n{table}")
        return "\n\n".join(parts) if parts else "Dynamo captured no graph"


def explain(model: nn.Module, *args, **options) -> Explanation:
    """Trace ``model(*args)`` as ``torch.compile(model, backend="hcp", options=options)``
    would, and report the rewrite. The model runs on fake tensors only: nothing is computed
    and no collective is issued. ``args`` are this rank's inputs, as for the compiled model."""
    from .passes.hierarchical_cp import HierarchicalCPPass  # see HcpBackend.__call__
    from .passes.rewrite import RewriteConfig

    parsed = parse_options(options)
    groups: CPGroups = resolve_groups(parsed.mesh if parsed.mesh is not None else default_mesh())
    config = RewriteConfig(groups, parsed.kernel, parsed.agree_across_ranks)
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
    return Explanation(graphs, tables)
