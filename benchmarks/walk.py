"""How the host code walks through the package's modules for one attention call: rank 0 of a
fake 2 x 2 world (torch's fake process group: collectives return at once and move no data), on
the CPU, its forward only.

    python -m benchmarks.walk [--lengths 300,120,60,20] [--inner aot_eager]

``sys.setprofile`` sees every Python call and return while the call runs; the events of
functions outside ``hcp_compile`` are left out. An *entry* is a call into a module from code
of another module (a door asking the batch package, the batch package asking the layout):
how often the walk enters each room. A *stop* is an event (call or return) whose module
differs from the previous event's: control moved from one module to another, in or back out.
A *return* is a stop into a module that control had already been in during this call: the
back-and-forth between layers. A dataclass's generated methods count in its class's module,
and so does a lambda in the module that wrote it. Counted per module and in total, for

- eager, first call: ``shard_plan`` prepared the batch (not counted), then the first attention
  call of a ``context_parallel`` block: it checks the call, agrees and builds the schedule;
- eager, batch seen: the next call of the same batch (another layer);
- compiled, batch seen: ``torch.compile(backend=hcp_compile.backend(inner=--inner))`` after a
  first call that compiled the graph and checked the batch;
- one device, batch seen: the single-device op on the whole batch, outside ``context_parallel``,
  after a first call.

The counts depend on the code only, not on the machine: a refactoring's effect on the host
walk, not its time (benchmarks/host_times.py times an eager call's host work).
"""

from __future__ import annotations

import argparse
import sys
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tabulate import tabulate

import hcp_compile
from benchmarks.speed_setup import fake_process_group

PACKAGE = "hcp_compile"
ULYSSES, RING = 2, 2
HEADS, HEAD_DIM = 4, 16


@dataclass
class Walk:
    """The stops and returns of one profiled stretch, per module."""

    entries: Counter = field(default_factory=Counter)
    stops: Counter = field(default_factory=Counter)
    returns: Counter = field(default_factory=Counter)
    _previous: str | None = None
    _visited: set[str] = field(default_factory=set)

    def event(self, frame: types.FrameType, event: str, _arg: object) -> None:
        if event not in ("call", "return"):
            return  # C functions: torch's own work, not a module of the package
        module = frame.f_globals.get("__name__", "")
        if module != PACKAGE and not module.startswith(PACKAGE + "."):
            return
        caller = frame.f_back.f_globals.get("__name__") if frame.f_back is not None else None
        if event == "call" and caller != module:
            self.entries[module] += 1
        if module != self._previous:
            self.stops[module] += 1
            if module in self._visited:
                self.returns[module] += 1
        self._visited.add(module)
        self._previous = module


def walk(call: Callable[[], object]) -> Walk:
    """The walk of ``call()`` through the package."""
    seen = Walk()
    sys.setprofile(seen.event)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def walks(lengths: list[int], inner: str) -> dict[str, Walk]:
    """The four walks, this process being rank 0 of the fake world (set up by the caller)."""
    mesh = hcp_compile.make_mesh(ULYSSES, RING, "cpu")
    cu, longest = cu_seqlens(lengths), max(lengths)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), HEADS, HEAD_DIM, generator=gen) for _ in range(3))

    def attend(q_, k_, v_, cu_, longest_):
        return hcp_compile.varlen_attention(q_, k_, v_, cu_, cu_, longest_, longest_, causal=True)

    found = {}
    hcp_compile.clear_batch_cache()
    plan = hcp_compile.shard_plan(cu, mesh)
    local = [plan.shard(t) for t in (q, k, v)]
    with hcp_compile.context_parallel(mesh):
        found["eager, first call"] = walk(lambda: attend(*local, cu, longest))
        found["eager, batch seen"] = walk(lambda: attend(*local, cu, longest))
    compiled = torch.compile(attend, backend=hcp_compile.backend(mesh=mesh, inner=inner), fullgraph=True)
    compiled(*local, cu, longest)
    found["compiled, batch seen"] = walk(lambda: compiled(*local, cu, longest))
    attend(q, k, v, cu, longest)
    found["one device, batch seen"] = walk(lambda: attend(q, k, v, cu, longest))
    return found


def table(found: dict[str, Walk]) -> str:
    modules = sorted(set().union(*(w.stops for w in found.values())))

    def cell(w: Walk, module: str | None) -> str:
        counts = [w.entries, w.stops, w.returns]
        return " / ".join(str(c[module] if module else sum(c.values())) for c in counts)

    rows = [[module.removeprefix(PACKAGE + ".")] + [cell(w, module) for w in found.values()] for module in modules]
    rows.append(["total"] + [cell(w, None) for w in found.values()])
    return tabulate(rows, headers=["module (entries / stops / returns)", *found])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--lengths", default="300,120,60,20",
                        help="the batch's document lengths, comma-separated (default: %(default)s)")
    parser.add_argument("--inner", default="aot_eager", help="the hcp backend's inner compiler (default: %(default)s)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    with fake_process_group(0, ULYSSES * RING):
        print(table(walks(lengths, args.inner)))


if __name__ == "__main__":
    main()
