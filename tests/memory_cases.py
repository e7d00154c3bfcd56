"""What eager CP keeps for the backward, in a model's terms (run inside the worker processes of
``distributed.py``: ``suite="memory_cases"``). In a decoder layer q, k and v are views of one
projection's output; a forward that saved them whole would keep that output, exchanged rows
included, alive until the backward. Each case records which saved tensors share its storage."""

from __future__ import annotations

from dataclasses import dataclass

import hcp_compile as hc
from cp_cases import DOC_MIXES, World, cu_seqlens, seeded
from hcp_compile.batch.prepared import MeshShape, host_values, prepare

MESH = (2, 2)
SUITE = "memory_cases"
HEADS_Q, HEADS_KV, HEAD_DIM, HIDDEN = 4, 2, 8, 16


@dataclass(frozen=True)
class ProjectionCase:
    docs: str
    recompute_exchange: bool

    @property
    def id(self) -> str:
        return f"{self.docs}-recompute-{self.recompute_exchange}"

    def run(self, world: World) -> dict:
        lengths = DOC_MIXES[self.docs]
        cu = cu_seqlens(lengths)
        plan = hc.shard_plan(cu, world.mesh)
        hidden = plan.shard(seeded(f"{self.id}/x", sum(lengths), HIDDEN))
        weight = seeded(f"{self.id}/w", HIDDEN, (HEADS_Q + 2 * HEADS_KV) * HEAD_DIM).requires_grad_()
        with hc.context_parallel(world.mesh, recompute_exchange=self.recompute_exchange):
            projection = hidden @ weight
            q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)) for t in projection.split(
                [HEADS_Q * HEAD_DIM, HEADS_KV * HEAD_DIM, HEADS_KV * HEAD_DIM], dim=-1))
            out = hc.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
            storage = projection.untyped_storage().data_ptr()
            keeping = sum(t.untyped_storage().data_ptr() == storage for t in out.grad_fn.saved_tensors)
            out.sum().backward()
        sizes = prepare(host_values(cu), MeshShape(world.ulysses, world.ring, "balanced")).rank_sizes(
            world.rank // world.ulysses, world.rank % world.ulysses)
        return {"saved_views_of_projection": keeping, "exchanged_rows": sizes.own_exchange}


def suite(mesh: tuple[int, int]) -> list[ProjectionCase]:
    return [ProjectionCase(docs, recompute) for docs in ("many", "long", "mixed") for recompute in (False, True)]
