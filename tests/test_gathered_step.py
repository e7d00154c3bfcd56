"""The gathered step (Note [one gathered step] in hcp_compile/batch/layout.py): under
``scheme="allgather"`` a causal call without a window by position computes the ring steps after
the own one as one kernel call over keys copied out of the gathered sections.

On the host: every query chunk's gathered keys are exactly the real keys of its document before
it that other ring ranks hold, found by brute force from every ring rank's section, in zigzag
and in adjacent pairs; which calls gather. On a gloo ring of 4: eager and compiled calls give
the float64 reference's rows on two batches in turn, with three blocks per call (the local
region, the own step, the gathered step) where the ring scheme runs five."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import hcp_compile as hc
from checks import assert_matches, local_rows, run_counting
from compile_cases import VarlenAttention, fresh_dynamo
from cp_cases import World, cu_seqlens, seeded
from hcp_compile.batch import layout, schedule
from hcp_compile.batch.placements import placement_rule
from hcp_compile.testing.reference import reference_with_grads

# documents that go round a ring of 4 (several per batch, some shorter than 2R chunks of one row)
BATCHES = ((3, 40, 2, 57, 6, 1, 23), (90, 5, 31, 7))
HEADS, HEAD_DIM = (4, 2), 8
MESH = (1, 4)
SUITE = "test_gathered_step:suite"


def _section_tokens(batch: layout.BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(document, position) of every row of every ring rank's section, ring rank major."""
    width = int(batch.ring_width)
    tokens = [layout.stream_tokens(layout.stream_table(batch, j, with_group=False), j, batch.ring, width)
              for j in range(batch.ring)]
    return torch.cat([t.doc for t in tokens]), torch.cat([t.position for t in tokens])


@pytest.mark.parametrize("window", [-1, 6])  # -1: zigzag pairs; 6: adjacent pairs where they balance
@pytest.mark.parametrize("seed", range(6))
def test_gathered_keys_are_the_earlier_keys_other_ring_ranks_hold(seed, window):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 70, (int(torch.randint(1, 7, (), generator=generator)),), generator=generator)
    ulysses, ring = 1 + seed % 2, 2 + seed % 3
    batch = layout.batch_layout(torch.nn.functional.pad(lengths.cumsum(0), (1, 0)), ulysses, ring,
                                placement_rule("zigzag" if seed % 2 else "balanced"), window)
    key_doc, key_position = _section_tokens(batch)
    for r in range(ring):
        step = layout.gathered_step(batch, r)
        sizes = layout.rank_sizes(layout.rank_size_values(batch, r, 0).tolist(), 0, ulysses)
        stream = layout.stream_tokens(layout.stream_table(batch, r), r, ring, sizes.stream)
        held = set(zip(stream.doc.tolist(), stream.position.tolist()))
        cu_q, cu_k = step.cu_q.tolist(), step.cu_k.tolist()
        assert cu_q[-1] == sizes.stream and cu_k[-1] == step.rows.numel() == sizes.gathered_keys
        for segment in range(len(cu_q) - 1):
            queries, keys = range(cu_q[segment], cu_q[segment + 1]), step.rows[cu_k[segment]:cu_k[segment + 1]]
            docs = set(stream.doc[list(queries)].tolist()) if queries else set()
            positions = stream.position[list(queries)].tolist()
            real = queries and docs != {-1} and len(docs) == 1
            if not real:  # pad rows, a GROUP document's rows: no key
                assert keys.numel() == 0, f"rank {r} segment {segment}"
                continue
            (doc,) = docs
            assert positions == list(range(positions[0], positions[0] + len(positions)))
            expected = [p for p in range(positions[0]) if (doc, p) not in held]
            assert key_doc[keys].tolist() == [doc] * len(expected), f"rank {r} segment {segment}"
            assert key_position[keys].tolist() == expected, f"rank {r} segment {segment}"


def test_only_causal_allgather_calls_without_a_window_by_position_gather():
    assert schedule.gathers("allgather", True, (-1, -1), 4)
    assert schedule.gathers("allgather", True, (-1, -1), 4, "cudnn")
    assert not schedule.gathers("allgather", True, (-1, -1), 4, "flash")  # schedule.KEEP_STEPS_KERNELS
    assert not schedule.gathers("allgather", True, (-1, -1), 1)  # no ring
    assert not schedule.gathers("allgather", False, (-1, -1), 4)
    assert not schedule.gathers("allgather", True, (5, 0), 4)
    assert not schedule.gathers("ring", True, (-1, -1), 4)
    prepared = hc.prepare_batch(cu_seqlens(BATCHES[0]), ulysses=MESH[0], ring=MESH[1], rank=0, scheme="allgather")
    plan = prepared.rank_plan(0, 0, True, (-1, -1), gathered=True)
    assert (plan.steps, plan.shape.gathered) == (2, True)
    assert plan is prepared.rank_plan(0, 0, True, (-1, -1), gathered=True)  # what the worker prepared
    assert plan.tables.gather_rows.numel() == plan.sizes.gathered_keys > 0
    assert prepared.rank_plan(0, 0, True, (-1, -1)).steps == MESH[1]


def _inputs(docs: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {name: seeded(f"gathered-step/{name}", sum(docs), heads, HEAD_DIM)
            for name, heads in (("q", HEADS[0]), ("k", HEADS[1]), ("v", HEADS[1]), ("dout", HEADS[0]))}


def _blocks(attend) -> tuple[dict, int]:
    """``attend()``'s result and how many forward blocks it ran."""
    return run_counting(attend, "hcp::block_forward")


@dataclass(frozen=True)
class GatheredCase:
    """Each batch attended eagerly under both schemes and compiled under the all-gather one,
    the forward blocks of each counted."""

    id: str = "gathered"

    def run(self, world: World) -> dict:
        fresh_dynamo()
        model = torch.compile(VarlenAttention(True, None, (-1, -1)),
                              backend=hc.backend(mesh=world.mesh, inner="aot_eager", scheme="allgather"), fullgraph=True)
        results = {}
        for index, docs in enumerate(BATCHES):
            plan = hc.shard_plan(cu_seqlens(docs), world.mesh)
            x, cu = _inputs(docs), cu_seqlens(docs)

            def attend(scheme: str | None) -> dict:
                q, k, v = (plan.shard(x[name]).requires_grad_() for name in "qkv")
                if scheme is None:
                    out = model(q, k, v, cu, max(docs))
                else:
                    with hc.context_parallel(world.mesh, scheme=scheme):
                        out = hc.varlen_attention(q, k, v, cu, cu, max(docs), max(docs), causal=True)
                out.backward(plan.shard(x["dout"]))
                return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

            runs = {name: _blocks(lambda: attend(scheme))
                    for name, scheme in (("allgather", "allgather"), ("ring", "ring"), ("compiled", None))}
            # counted again once compiled (a compilation's tracing runs the blocks on fake tensors)
            runs["compiled"] = (runs["compiled"][0], _blocks(lambda: attend(None))[1])
            results[index] = {"global_index": plan.global_index, "runs": runs}
        return results


def suite(mesh: tuple[int, int]) -> list:
    return [GatheredCase()]


@pytest.fixture(scope="module")
def values(cp_world) -> list[dict]:
    return cp_world(MESH, suite=SUITE).values(GatheredCase.id)


@pytest.mark.parametrize("index", range(len(BATCHES)))
def test_gathered_step_matches_the_reference_eagerly_and_compiled(values, index):
    docs = BATCHES[index]
    x, cu = _inputs(docs), cu_seqlens(docs).tolist()
    reference = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu, cu, causal=True)
    for rank, value in enumerate(values):
        result = value[index]
        for path, (run, _) in result["runs"].items():
            for name in ("out", "dq", "dk", "dv"):
                assert_matches(run[name], local_rows(reference[name], result["global_index"]),
                               f"rank {rank} batch {index} {path} {name}")


def test_gathered_call_runs_three_blocks_where_the_ring_runs_one_per_step(values):
    for rank, value in enumerate(values):
        for index, result in value.items():
            blocks = {path: count for path, (_, count) in result["runs"].items()}
            assert blocks == {"allgather": 3, "compiled": 3, "ring": 1 + MESH[1]}, f"rank {rank} batch {index}"


def test_a_gathered_schedule_under_a_scheme_that_does_not_gather_raises():
    """The ring scheme would give the gathered step one section's keys: refused, not computed."""
    prepared = hc.prepare_batch(cu_seqlens(BATCHES[0]), ulysses=MESH[0], ring=MESH[1], rank=0)
    plan = prepared.rank_plan(0, 0, True, (-1, -1), gathered=True)
    with pytest.raises(ValueError, match="does not gather"):
        schedule.assemble_schedule(plan.tables, plan.sizes, plan.shape, max(BATCHES[0]), 0, MESH[1], causal=True, scale=1.0,
                                   window=(-1, -1), kernel="torch", first_cache_key=None, scheme="ring",
                                   kv_heads=1, ulysses=MESH[0])
