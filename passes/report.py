"""The table of rewritten attention nodes: what was matched, how it is split over the mesh,
which collectives the rewrite inserts and how many bytes they move per rank at most (when
every local token goes through the exchange; the batch's placement decides how many do, see
``ShardPlan.summary``)."""

from __future__ import annotations

from dataclasses import dataclass

from tabulate import tabulate

from hcp_compile.mesh import CPGroups
from hcp_compile.plan import format_bytes
from hcp_compile.schedule import head_groups, kv_head_repeat, rank_kv_heads

from .rewrite import Rewritten

HEADERS = (
    "module", "op", "heads q/kv", "head dim", "dtype", "ulysses x ring", "placement", "kernel",
    "collectives fwd", "collectives bwd", "all-to-all bytes/rank fwd (max)",
    "ring bytes/rank/step (max)", "ring steps",
)


@dataclass(frozen=True)
class Collectives:
    """Collectives one rewritten node adds to the forward and backward graphs."""

    forward_all_to_all: int  # Ulysses exchanges
    forward_ring: int  # KV transfers
    forward_all_reduce: int  # the batch check's agreement
    backward_all_to_all: int
    backward_ring: int  # KV and dKV transfers


def collectives(node: Rewritten, groups: CPGroups, agree: bool) -> Collectives:
    ulysses, ring = groups.ulysses_size, groups.ring_size
    # every head group has its own exchanges and its own ring (docs/design.md §3.6), per
    # group: q and kv in, out back (and the lse when the graph reads it); dout in, dq and dkv
    # back. The batch check's all-reduces are once per cu_seqlens, whatever the groups, one
    # per mesh dimension of more than one rank.
    parts = head_groups(rank_kv_heads(node.heads_kv, ulysses), ulysses)
    exchanges = ulysses > 1
    return Collectives(
        forward_all_to_all=parts * (3 + node.returns_lse) if exchanges else 0,
        forward_ring=parts * (ring - 1),
        forward_all_reduce=int(ulysses > 1) + int(ring > 1) if node.checked and agree else 0,
        backward_all_to_all=parts * 3 if exchanges else 0,
        backward_ring=parts * (2 * ring - 1) if ring > 1 else 0,  # R-1 KV hops, R dKV hops
    )


def row(node: Rewritten, groups: CPGroups, agree: bool) -> list[str]:
    ulysses = groups.ulysses_size
    element = node.dtype.itemsize
    kv_heads = node.heads_kv * kv_head_repeat(node.heads_kv, ulysses)
    per_head = node.local_tokens * node.head_dim * element
    # every rank keeps 1/A of what it exchanges: q, k, v in and out back
    all_to_all = (ulysses - 1) * (2 * node.heads_q + 2 * kv_heads) * per_head // ulysses
    ring_step = 2 * kv_heads * per_head  # this rank's stream of its head slice: A*T/A tokens
    count = collectives(node, groups, agree)
    forward = [f"{count.forward_all_to_all} all_to_all", f"{count.forward_ring} ring"]
    if count.forward_all_reduce:
        forward.append(f"{count.forward_all_reduce} all_reduce (check)")
    return [
        node.match.module_path or "-",
        node.match.op,
        f"{node.heads_q}/{node.heads_kv}",
        str(node.head_dim),
        str(node.dtype).removeprefix("torch."),
        f"{ulysses} x {groups.ring_size}",
        node.placement,
        node.kernel,
        ", ".join(forward),
        f"{count.backward_all_to_all} all_to_all, {count.backward_ring} ring",
        format_bytes(all_to_all),
        format_bytes(ring_step) if groups.ring_size > 1 else "-",
        str(groups.ring_size),
    ]


def table(nodes: list[Rewritten], groups: CPGroups, agree: bool) -> str:
    if not nodes:
        return "no attention node with cu_seqlens was found"
    return tabulate([row(n, groups, agree) for n in nodes], headers=HEADERS, tablefmt="github")
