"""What eager CP keeps for the backward, in a model's terms (run inside the worker processes of
``hcp_compile.testing.worlds``: ``suite="memory_cases"``). In a decoder layer q, k and v are views of one
projection's output; a forward that saved them whole would keep that output, exchanged rows
included, alive until the backward. Each case records which saved tensors share its storage."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import Tensor

import hcp_compile as hc
from benchmarks.held_bytes import held_bytes
from cp_cases import DOC_MIXES, World, cu_seqlens, seeded
from hcp_compile.batch.prepared import MeshShape, host_values, prepare

MESH = (2, 2)
SUITE = "memory_cases"
RING_MESH = (1, 4)  # four ring steps: a step's results alive at the second next step show
RING_SUITE = "memory_cases:ring_step_suite"
HEAD_DIM, HIDDEN = 8, 16


@dataclass(frozen=True)
class ProjectionCase:
    docs: str
    recompute_exchange: bool
    heads: tuple[int, int] = (4, 2)  # query, KV; (4, 1) repeats KV heads, (8, 4) two head groups

    @property
    def id(self) -> str:
        return f"{self.docs}-h{self.heads[0]}.{self.heads[1]}-recompute-{self.recompute_exchange}"

    def run(self, world: World) -> dict:
        lengths = DOC_MIXES[self.docs]
        cu = cu_seqlens(lengths)
        plan = hc.shard_plan(cu, world.mesh)
        hidden = plan.shard(seeded(f"{self.id}/x", sum(lengths), HIDDEN))
        heads_q, heads_kv = self.heads
        weight = seeded(f"{self.id}/w", HIDDEN, (heads_q + 2 * heads_kv) * HEAD_DIM).requires_grad_()
        with hc.context_parallel(world.mesh, recompute_exchange=self.recompute_exchange):
            projection = hidden @ weight
            q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)) for t in projection.split(
                [heads_q * HEAD_DIM, heads_kv * HEAD_DIM, heads_kv * HEAD_DIM], dim=-1))
            out = hc.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
            storage = projection.untyped_storage().data_ptr()
            keeping = sum(t.untyped_storage().data_ptr() == storage for t in out.grad_fn.saved_tensors)
            held = held_storage_bytes(out)
            out.sum().backward()
        sizes = prepare(host_values(cu), MeshShape(world.ulysses, world.ring, "balanced")).rank_sizes(
            world.rank // world.ulysses, world.rank % world.ulysses)
        counted = held_bytes(sizes, world.ring, self.heads, HEAD_DIM, world.ulysses,
                             projection.element_size())
        return {"saved_views_of_projection": keeping, "exchanged_rows": sizes.own_exchange,
                "held_bytes": held, "counted_held_bytes": counted}


def held_storage_bytes(out: Tensor) -> int:
    """The bytes of every storage the attention's backward node keeps (its saved tensors and, as
    eager CP keeps them, its head groups' streams), the output's own left out, each once."""
    node = out.grad_fn  # a custom Function's node is its ctx
    kept = [*node.saved_tensors, *(t for group in (node.streams or []) for t in group)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    storages.pop(out.untyped_storage().data_ptr(), None)
    return sum(storages.values())


def suite(mesh: tuple[int, int]) -> list[ProjectionCase]:
    cases = [ProjectionCase(docs, recompute) for docs in ("many", "long", "mixed") for recompute in (False, True)]
    return cases + [ProjectionCase("many", False, heads) for heads in ((4, 1), (8, 4))]


# --------------------------------------------------------------------------------------------
# the ring's block results: alive only while their step needs them
# --------------------------------------------------------------------------------------------

class StepResults:
    """The block results of one ring call's steps, by weak reference, and for each step's
    block the earlier steps whose results were still alive when it started."""

    def __init__(self) -> None:
        self.alive_at_step: list[list[int]] = []  # one list per step of every ring call
        self._earlier: list[list[weakref.ref]] | None = None  # None outside a ring call

    def ring(self, function: Callable) -> Callable:
        def in_ring(*args, **kwargs):
            self._earlier = []
            try:
                return function(*args, **kwargs)
            finally:
                self._earlier = None
        return in_ring

    def block(self, function: Callable) -> Callable:
        def recorded(*args, **kwargs):
            if self._earlier is None:  # the local region's block, outside the ring
                return function(*args, **kwargs)
            self.alive_at_step.append([step for step, refs in enumerate(self._earlier)
                                       if any(ref() is not None for ref in refs)])
            results = function(*args, **kwargs)
            self._earlier.append([weakref.ref(t) for t in results])
            return results
        return recorded


@contextlib.contextmanager
def recording_steps(forward: StepResults, backward: StepResults) -> Iterator[None]:
    """The ring's steps and blocks of ``hcp_compile.hierarchical`` recorded (its module names)."""
    from hcp_compile import hierarchical

    wrapped = {"ring_forward": forward.ring(hierarchical.ring_forward),
               "run_forward": forward.block(hierarchical.run_forward),
               "ring_backward": backward.ring(hierarchical.ring_backward),
               "run_backward": backward.block(hierarchical.run_backward)}
    original = {name: getattr(hierarchical, name) for name in wrapped}
    try:
        for name, function in wrapped.items():
            setattr(hierarchical, name, function)
        yield
    finally:
        for name, function in original.items():
            setattr(hierarchical, name, function)


@dataclass(frozen=True)
class RingStepCase:
    """One long causal document over a ring of four: every step computes a block."""

    docs: str = "long"
    heads: tuple[int, int] = (4, 2)

    @property
    def id(self) -> str:
        return f"ring-steps-{self.docs}-h{self.heads[0]}.{self.heads[1]}"

    def run(self, world: World) -> dict:
        lengths = DOC_MIXES[self.docs]
        cu = cu_seqlens(lengths)
        plan = hc.shard_plan(cu, world.mesh)
        q, k, v = (plan.shard(seeded(f"{self.id}/{name}", sum(lengths), heads, HEAD_DIM)).requires_grad_()
                   for name, heads in (("q", self.heads[0]), ("k", self.heads[1]), ("v", self.heads[1])))
        forward, backward = StepResults(), StepResults()
        with recording_steps(forward, backward), hc.context_parallel(world.mesh):
            out = hc.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
            out.sum().backward()
        return {"forward": forward.alive_at_step, "backward": backward.alive_at_step}


def ring_step_suite(mesh: tuple[int, int]) -> list[RingStepCase]:
    return [RingStepCase(), RingStepCase(heads=(8, 4))]
