"""The table of rewritten attention nodes: what was matched, how it is split over the mesh,
which collectives the rewrite inserts and how many bytes they send per rank and call, in the
forward and in the forward and backward together, at most (when every local token goes through
the exchange and round the ring; the batch's placement decides how many do: ``ShardPlan.summary``
counts a batch's, forward and backward together). Counts and bytes are the collective scheme's own
(``hcp_compile.exchange.schemes``), for a compiled graph, which has every ring step, unless it is built
for batches without a ring section (one step) or without an exchange (no collective at all:
``hcp_compile.compiled.graph_variants``)."""

from __future__ import annotations

from dataclasses import dataclass

from tabulate import tabulate

from hcp_compile.batch.prepared import Exchanges
from hcp_compile.exchange.mesh import CPGroups
from hcp_compile.exchange.schemes import Traffic
from hcp_compile.batch.traffic import CallShape, call_traffic, whole_exchange_sizes
from hcp_compile.plan import format_bytes
from hcp_compile.passes.rewrite import Rewritten

HEADERS = (
    "module", "op", "heads q/kv", "head dim", "dtype", "ulysses x ring", "placement", "kernel",
    "scheme", "collectives fwd", "collectives bwd", "all-to-all bytes/rank/call fwd (max)",
    "ring bytes/rank/call fwd (max)", "ring steps", "all-to-all bytes/rank/call fwd+bwd (max)",
    "ring bytes/rank/call fwd+bwd (max)",
)


@dataclass(frozen=True)
class Collectives:
    """Collectives one rewritten node adds to the forward and backward graphs."""

    forward_all_to_all: int  # Ulysses exchanges
    forward_ring: int  # collectives on the ring group
    forward_all_reduce: int  # the batch check's agreement
    backward_all_to_all: int
    backward_ring: int


def traffic(node: Rewritten, groups: CPGroups) -> Traffic:
    """The node's collectives and bytes per rank when all of its tokens are exchanged and go
    round the ring (``node.local_tokens`` per rank), as far as its graph has them."""
    ulysses, ring = groups.ulysses_size, groups.ring_size
    call = CallShape(node.heads_q, node.heads_kv, node.head_dim, node.dtype, node.returns_lse)
    sizes = node.graph_for.exchanges.narrowed(whole_exchange_sizes(node.local_tokens, ulysses, ring))
    return call_traffic(node.scheme, sizes, call, ulysses, ring, steps=ring_steps(node, groups))


def ring_steps(node: Rewritten, groups: CPGroups) -> int:
    if node.graph_for.exchanges is not Exchanges.RING:
        return 1
    steps = node.graph_for.steps(node.match.call.causal, node.match.call.window)
    return groups.ring_size if steps is None else steps


def collectives(node: Rewritten, groups: CPGroups, agree: bool, moved: Traffic | None = None) -> Collectives:
    """The scheme's collectives of the node (its :func:`traffic`, unless given), and the batch
    check's all-reduces: once per cu_seqlens, one per mesh dimension of more than one rank."""
    moved = moved or traffic(node, groups)
    checks = int(groups.ulysses_size > 1) + int(groups.ring_size > 1)
    return Collectives(
        forward_all_to_all=moved.ulysses.forward_calls, forward_ring=moved.ring.forward_calls,
        forward_all_reduce=checks if node.checked and agree else 0,
        backward_all_to_all=moved.ulysses.backward_calls, backward_ring=moved.ring.backward_calls,
    )


def row(node: Rewritten, groups: CPGroups, agree: bool) -> list[str]:
    moved = traffic(node, groups)
    count = collectives(node, groups, agree, moved)
    forward = [f"{count.forward_all_to_all} all_to_all", f"{count.forward_ring} ring"]
    if count.forward_all_reduce:
        forward.append(f"{count.forward_all_reduce} all_reduce (check)")
    return [
        node.match.module_path or "-",
        node.match.op,
        f"{node.heads_q}/{node.heads_kv}",
        str(node.head_dim),
        str(node.dtype).removeprefix("torch."),
        f"{groups.ulysses_size} x {groups.ring_size}",
        node.placement,
        node.kernel,
        node.scheme,
        ", ".join(forward),
        f"{count.backward_all_to_all} all_to_all, {count.backward_ring} ring",
        format_bytes(moved.ulysses.forward_bytes),
        format_bytes(moved.ring.forward_bytes) if groups.ring_size > 1 else "-",
        str(ring_steps(node, groups)),
        # what plan.summary() counts per call of a batch, so that the two tables compare
        format_bytes(moved.ulysses.forward_bytes + moved.ulysses.backward_bytes),
        format_bytes(moved.ring.forward_bytes + moved.ring.backward_bytes) if groups.ring_size > 1 else "-",
    ]


def table(nodes: list[Rewritten], groups: CPGroups, agree: bool) -> str:
    if not nodes:
        return "no attention node with cu_seqlens was found"
    return tabulate([row(n, groups, agree) for n in nodes], headers=HEADERS, tablefmt="github")
