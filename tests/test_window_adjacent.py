"""A batch laid out for a sliding window in adjacent pairs (``BatchLayout.adjacent``, Note
[adjacent pairs under a window] in hcp_compile/batch/layout.py) on a gloo ring of 4: the
schedule stops after the steps the window reaches (``layout.window_steps``: 2 or 3 of 4), so
the ring's dKV accumulators go home from part of the way round, and every rank still gives
the float64 reference's rows, eagerly under both collective schemes and compiled, for two
windows and two batches in turn."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import hcp_compile as hc
from checks import assert_matches, local_rows
from compile_cases import sharded_attention
from cp_cases import World, cu_seqlens, seeded
from hcp_compile.batch import layout
from hcp_compile.testing.reference import reference_with_grads

# batches whose documents longer than half a rank's tokens go round the ring in adjacent pairs
# (their turned work even within layout.ADJACENT_WORK_STRAY) and the rest stays whole
BATCHES = ((1, 1, 4, 4, 75, 66, 1, 68, 68, 3), (6, 98, 97, 4, 5, 77, 3, 7, 3, 85, 2))
# ring chunks of 9-13 rows: a window of 6 back reaches one pair back (2 steps), 30 back two (3)
WINDOWS = {(6, 0): 2, (30, 0): 3}
SCHEMES = ("ring", "allgather")
HEADS, HEAD_DIM = (4, 2), 8
MESH = (1, 4)
SUITE = "test_window_adjacent:suite"


def global_inputs(docs: tuple[int, ...]) -> dict[str, torch.Tensor]:
    tokens = sum(docs)
    return {name: seeded(f"window-adjacent/{name}", tokens, heads, HEAD_DIM)
            for name, heads in (("q", HEADS[0]), ("k", HEADS[1]), ("v", HEADS[1]), ("dout", HEADS[0]))}


def eager(plan: hc.ShardPlan, world: World, docs: tuple[int, ...], window: tuple[int, int], scheme: str) -> dict:
    x, cu = global_inputs(docs), cu_seqlens(docs)
    q, k, v = (plan.shard(x[name]).requires_grad_() for name in "qkv")
    with hc.context_parallel(world.mesh, scheme=scheme):
        out = hc.varlen_attention(q, k, v, cu, cu, max(docs), max(docs), causal=True, window_size=window)
    out.backward(plan.shard(x["dout"]))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@dataclass(frozen=True)
class AdjacentPairsCase:
    """Each batch laid out for each window (the mask the layers then run), attended eagerly
    under each scheme, and compiled under the first window; the rank's steps recorded."""

    id: str = "adjacent-pairs"

    def run(self, world: World) -> dict:
        ring_rank, ulysses_rank = divmod(world.rank, world.ulysses)
        results = {}
        for index, docs in enumerate(BATCHES):
            for window in WINDOWS:
                plan = hc.shard_plan(cu_seqlens(docs), world.mesh, window=window)
                steps = plan.prepared.rank_plan(ring_rank, ulysses_rank, True, window).steps
                runs = {scheme: eager(plan, world, docs, window, scheme) for scheme in SCHEMES}
                if window == (6, 0):
                    runs["compiled"] = sharded_attention(plan, world, global_inputs(docs), cu_seqlens(docs),
                                                         max(docs), True, window, compiled=True)
                results[index, window] = {"adjacent": plan.layout.adjacent, "steps": steps,
                                          "global_index": plan.global_index, "runs": runs}
        return results


def suite(mesh: tuple[int, int]) -> list:
    return [AdjacentPairsCase()]


@pytest.fixture(scope="module")
def values(cp_world) -> list[dict]:
    return cp_world(MESH, suite=SUITE).values(AdjacentPairsCase.id)


@pytest.mark.parametrize("index", range(len(BATCHES)))
@pytest.mark.parametrize("window", sorted(WINDOWS))
def test_adjacent_pairs_stop_where_the_window_does_and_match_the_reference(values, index, window):
    docs = BATCHES[index]
    x, cu = global_inputs(docs), cu_seqlens(docs).tolist()
    reference = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu, cu, causal=True, window=window)
    for rank, value in enumerate(values):
        result = value[index, window]
        assert result["adjacent"], f"rank {rank}: the layout of batch {index} for {window} is not in adjacent pairs"
        assert result["steps"] == WINDOWS[window] < MESH[1], f"rank {rank}: {result['steps']} steps"
        for path, run in result["runs"].items():
            for name in ("out", "dq", "dk", "dv"):
                assert_matches(run[name], local_rows(reference[name], result["global_index"]),
                               f"rank {rank} batch {index} window {window} {path} {name}")


def test_window_steps_is_the_last_step_any_rank_sees_a_key_in_plus_one():
    """``layout.window_steps`` against each ring rank's own steps that see a key
    (``step_sees_any_key``), for the benchmark's windows of the two batches."""
    for docs in BATCHES:
        for window in WINDOWS:
            batch = layout.batch_layout(cu_seqlens(docs), *MESH, hc.batch.placements.PLACEMENTS["balanced"], window[0])
            last = 0
            for r in range(MESH[1]):
                own = layout.stream_table(batch, r)
                for step, source in enumerate(layout.step_sources(r, MESH[1], MESH[1])[1:], start=1):
                    kind = layout.step_kind(r, source, causal=True)
                    if bool(layout.step_sees_any_key(own, layout.stream_table(batch, source, False), r, source,
                                                     MESH[1], kind, *window)):
                        last = max(last, step)
            assert layout.window_steps(batch, window[0]) == last + 1 == WINDOWS[window]
