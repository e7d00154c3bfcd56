"""How evenly a placement shares a batch's attention work among the ranks, counted from the
layout (no GPU, no process group): the rank's visible query-key pairs, causal or under a
sliding window, as a share of the mean.

    python -m benchmarks.work_split --workloads W4-128K --meshes 1x2 2x1
    python -m benchmarks.work_split --workloads W4-1M,W2-1M --meshes 1x8 2x4

A workload under a window is laid out twice: as for plain causal attention (layout window
"none") and for its window (``shard_plan(..., window=...)``, layout window "left,0").

A rank computes its LOCAL documents' rows with every head and, after the Ulysses exchange, its
group's exchange streams with ``1/A`` of the heads: its work is the pairs of its local region's
queries plus those of its Ulysses group's exchange regions over ``A`` (a query's pairs: the keys
it sees in its document, wherever they lie). A window changes a query's pairs to
``min(position, left) + 1``. Laid out for plain causal attention, the balanced placement evens
causal pairs per document and every ring document's zigzag chunk 0 (on ring rank 0) holds
fewer of them (docs/benchmarks.md, per-rank ceiling); laid out for the window, it weighs the
windowed pairs and turns the ring documents' light chunks round the ring ranks
(docs/design.md §2.2).
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

from benchmarks.speed_workloads import Workload, workloads
from hcp_compile.batch.placements import NO_WINDOW, PLACEMENTS, check_layout_window
from hcp_compile.batch import layout
from hcp_compile.batch.layout import Kind
from hcp_compile.batch.prepared import MeshShape, PreparedBatch, host_values, prepare


def visible_pairs(positions: torch.Tensor, window_left: int) -> int:
    """The query-key pairs of queries at these ``positions`` in their documents (-1: a pad):
    causal, or under a window of ``window_left`` keys back (< 0: none)."""
    seen = positions + 1 if window_left < 0 else positions.clamp(max=window_left) + 1
    return int(seen.sum())


def rank_work(prepared: PreparedBatch, window_left: int) -> list[float]:
    """Each rank's work (in rank order ``r * A + a``), as pairs with all heads."""
    mesh = prepared.mesh
    work = []
    for ring_rank in range(mesh.ring):
        exchanged = 0
        local = []
        for ulysses_rank in range(mesh.ulysses):
            sizes = prepared.rank_sizes(ring_rank, ulysses_rank)
            tokens = prepared.tokens(ring_rank, ulysses_rank)
            positions = torch.where(tokens.valid, tokens.position, -1)  # a pad sees no key
            local.append(visible_pairs(positions[: sizes.local], window_left))
            exchanged += visible_pairs(positions[sizes.local : sizes.local + sizes.own_exchange], window_left)
        work += [pairs + exchanged / mesh.ulysses for pairs in local]
    return work


def laid_out(workload: Workload, ulysses: int, ring: int, placement: str, for_window: bool = False) -> PreparedBatch:
    """The workload's batch laid out for its window (``for_window``) or for plain causal
    attention."""
    lengths = torch.tensor(workload.lengths)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    window = check_layout_window(workload.window if for_window else NO_WINDOW)
    return prepare(host_values(cu), MeshShape(ulysses, ring, placement, window))


def shares(workload: Workload, ulysses: int, ring: int, placement: str, for_window: bool = False) -> list[float]:
    """Each rank's work over the mean, the batch laid out for the workload's window
    (``for_window``) or for plain causal attention."""
    work = rank_work(laid_out(workload, ulysses, ring, placement, for_window), workload.window_left)
    mean = sum(work) / len(work)
    return [w / mean for w in work]


def cut_documents(prepared: PreparedBatch) -> str:
    """``ring / group``: the documents split round the ring and over a Ulysses group, and how
    the ring documents' chunks pair (``BatchLayout.adjacent``)."""
    laid = prepared.layout
    ring = int((laid.kind == Kind.RING).sum())
    pairs = "" if ring == 0 else (", adjacent" if laid.adjacent else ", zigzag")
    return f"{ring} / {int((laid.kind == Kind.GROUP).sum())}{pairs}"


def ring_steps(prepared: PreparedBatch, window_left: int) -> str:
    """The ring steps of an eager schedule under the workload's window
    (``layout.own_steps``: the same on every rank), of the ring's."""
    steps = layout.own_steps(prepared.layout, prepared.rank_sizes(0, 0), True, (window_left, 0))
    return f"{steps} of {prepared.mesh.ring}"


def pads(prepared: PreparedBatch) -> float:
    """Pad tokens, a share of all the ranks' tokens."""
    mesh = prepared.mesh
    return 1 - prepared.batch.num_tokens / (int(prepared.layout.local_tokens) * mesh.ulysses * mesh.ring)


def parse_selection(parser: argparse.ArgumentParser, default_workloads: str = "W4-128K"
                    ) -> tuple[list[str], list[tuple[int, int]], list[str]]:
    """``--workloads``, ``--meshes`` and ``--placements`` added to ``parser``, parsed and checked:
    the workload names, the ``(ulysses, ring)`` meshes and the placements."""
    parser.add_argument("--workloads", default=default_workloads, help="comma-separated names of benchmarks.speed")
    parser.add_argument("--meshes", nargs="+", default=["1x2", "2x1"], metavar="AxR")
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    args, _ = parser.parse_known_args()
    known = workloads()
    names, placements = args.workloads.split(","), args.placements.split(",")
    for name in names:
        if name not in known:
            parser.error(f"--workloads: expected names of {sorted(known)}, got {name!r}")
    for placement in placements:
        if placement not in PLACEMENTS:
            parser.error(f"--placements: expected some of {tuple(PLACEMENTS)}, got {placement!r}")
    meshes = []
    for mesh in args.meshes:
        sides = mesh.split("x")
        if len(sides) != 2 or not all(side.isdigit() and int(side) > 0 for side in sides):
            parser.error(f"--meshes: expected ULYSSESxRING such as 2x4, got {mesh!r}")
        meshes.append((int(sides[0]), int(sides[1])))
    return names, meshes, placements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names, meshes, placements = parse_selection(parser)
    parser.parse_args()  # nothing else is accepted
    known, rows = workloads(), []
    for name in names:
        for ulysses, ring in meshes:
            for placement in placements:
                for for_window in (False, True) if known[name].window != NO_WINDOW else (False,):
                    split = shares(known[name], ulysses, ring, placement, for_window)
                    prepared = laid_out(known[name], ulysses, ring, placement, for_window)
                    laid_for = f"{known[name].window_left},0" if for_window else "none"
                    rows.append([name, f"{ulysses}x{ring}", placement, laid_for, round(min(split), 3),
                                 round(max(split), 3), cut_documents(prepared),
                                 ring_steps(prepared, known[name].window_left), f"{100 * pads(prepared):.2f} %",
                                 " ".join(f"{s:.3f}" for s in split)])
    print(tabulate(rows, headers=["workload", "mesh", "placement", "layout window", "least", "most",
                                  "cut: ring / group, pairs", "ring steps", "pads", "every rank / mean"]))


if __name__ == "__main__":
    main()
