"""The rewrite as one graph pass: match, rewrite, record (and dump) what was done.

It is an Inductor ``CustomGraphPass`` so that, handed to Inductor as its pre-grad pass, it
runs before AOTAutograd and keys Inductor's caches by :meth:`uuid` (stable across process
starts); the other inner compilers get the same pass applied by the backend.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

import hcp_compile.marking as marking

from hcp_compile.passes import report
from hcp_compile.passes.match import find_attention, find_unmarked
from hcp_compile.passes.rewrite import RewriteConfig, Rewritten, refuse_unmarked, rewrite_attention


@dataclass
class GraphRecord:
    """What the pass did to one graph."""

    before: str = ""
    after: str = ""
    rewritten: list[Rewritten] = field(default_factory=list)


class HierarchicalCPPass(CustomGraphPass):
    """Rewrite every (marked) attention node with ``cu_seqlens`` into hierarchical CP, and
    refuse the unmarked ones that take a rewritten node's ``cu_seqlens``."""

    def __init__(self, config: RewriteConfig, dump: "GraphDump | None" = None):
        self.config = config
        self.dump = dump
        self.record = GraphRecord()

    def __deepcopy__(self, memo) -> "HierarchicalCPPass":
        # Inductor copies and pickles its config for cache keys (torch 2.11); process groups
        # can be neither, and what identifies the pass is its uuid
        return self

    def __reduce__(self):
        return (str, (self.uuid(),))

    def __call__(self, graph: fx.Graph) -> None:
        record = self.record
        record.before = _readable(graph)
        matches, unmarked = find_attention(graph), find_unmarked(graph)
        record.rewritten = rewrite_attention(graph, matches, self.config)
        refuse_unmarked(graph, unmarked, matches)
        if graph.owning_module is not None:
            graph.owning_module.recompile()
        record.after = _readable(graph)
        if self.dump is not None:
            self.dump.write("before_rewrite.py", record.before)
            self.dump.write("after_rewrite.py", record.after)
            self.dump.write("matches.md", self.table() + "\n")

    def table(self) -> str:
        return report.table(self.record.rewritten, self.config.groups, self.config.agree_across_ranks)

    def uuid(self) -> str:
        """Everything the rewritten graph depends on besides the input graph: this code,
        the mesh as this rank sees it, the options and the module marks."""
        groups = self.config.groups
        package = Path(marking.__file__).parent  # hcp_compile/
        sources = sorted(package.rglob("*.py")) + sorted(Path(__file__).parent.glob("*.py"))
        mesh = (
            groups.ulysses_group.group_name, groups.ring_group.group_name, groups.ulysses_size,
            groups.ring_size, groups.ulysses_rank, groups.ring_rank, groups.device_type,
        )
        config = self.config
        facts = repr((mesh, config.kernel, config.agree_across_ranks, config.placement,
                      config.recompute_exchange, config.scheme, config.graph_for,
                      marking.marks_digest()))
        return hashlib.sha256((get_hash_for_files(tuple(sources)).hex() + facts).encode()).hexdigest()


def _readable(graph: fx.Graph) -> str:
    """The graph's code, followed by the bodies of its nested regions (checkpoints)."""
    parts = [graph.python_code("self").src]
    root = graph.owning_module
    if root is not None:
        parts += [f"\n# body of {name}:{module.graph.python_code('self').src}"
                  for name, module in root.named_modules()
                  if module is not root and isinstance(module, fx.GraphModule)]
    return "".join(parts)


@dataclass(frozen=True)
class GraphDump:
    """The folder one compiled graph's files go to."""

    folder: Path

    def write(self, name: str, text: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / name).write_text(text)
