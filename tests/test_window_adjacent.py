"""A batch laid out for a sliding window in adjacent pairs (``BatchLayout.adjacent``, Note
[adjacent pairs under a window] in hcp_compile/batch/layout.py) on a gloo ring of 4: the
schedule stops after the steps the window reaches (``layout.window_steps``: 2 or 3 of 4), so
the ring's dKV accumulators go home from part of the way round, and every rank still gives
the float64 reference's rows, eagerly under both collective schemes and compiled, for two
windows and two batches in turn. Both doors issue the same ring transfers, those of the
steps the window needs: the compiled door runs a graph of those steps (``GraphKind``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import hcp_compile as hc
from checks import assert_matches, local_rows, run_counting
from compile_cases import VarlenAttention, fresh_dynamo
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


def ring_transfers(attend) -> tuple[dict, int]:
    """``attend()``'s result and how many all-to-alls it ran (on a mesh of one Ulysses rank
    every one is a ring transfer: ``ring_shift``, or the all-gather scheme's gradients)."""
    return run_counting(attend, "_c10d_functional::all_to_all_single")


def compiled_and_counted(world: World) -> tuple[list[dict], dict[str, int]]:
    """One compiled module run on each batch under the first window (its results), then on
    the first batch again (Dynamo's sizes dynamic by then): the ring transfers of that forward
    and backward, and of the same batch's eagerly."""
    window = next(iter(WINDOWS))
    fresh_dynamo()
    model = torch.compile(VarlenAttention(True, None, window), backend=hc.backend(mesh=world.mesh, inner="aot_eager"),
                          fullgraph=True)
    results, counts = [], {}
    for index, docs in enumerate(BATCHES + BATCHES[:1]):
        plan = hc.shard_plan(cu_seqlens(docs), world.mesh, window=window)
        x, cu = global_inputs(docs), cu_seqlens(docs)

        def compiled() -> dict:
            q, k, v = (plan.shard(x[name]).requires_grad_() for name in "qkv")
            out = model(q, k, v, cu, max(docs))
            out.backward(plan.shard(x["dout"]))
            return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

        if index < len(BATCHES):
            results.append(compiled())
            continue
        counts["compiled"] = ring_transfers(compiled)[1]
        counts["eager"] = ring_transfers(lambda: eager(plan, world, docs, window, "ring"))[1]
    return results, counts


@dataclass(frozen=True)
class AdjacentPairsCase:
    """Each batch laid out for each window (the mask the layers then run), attended eagerly
    under each scheme, and compiled under the first window; the rank's steps recorded."""

    id: str = "adjacent-pairs"

    def run(self, world: World) -> dict:
        ring_rank, ulysses_rank = divmod(world.rank, world.ulysses)
        compiled, transfers = compiled_and_counted(world)
        results = {"transfers": transfers}
        for index, docs in enumerate(BATCHES):
            for window in WINDOWS:
                plan = hc.shard_plan(cu_seqlens(docs), world.mesh, window=window)
                steps = plan.prepared.rank_plan(ring_rank, ulysses_rank, True, window).steps
                runs = {scheme: eager(plan, world, docs, window, scheme) for scheme in SCHEMES}
                if window == next(iter(WINDOWS)):
                    runs["compiled"] = compiled[index]
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


def test_both_doors_send_the_transfers_of_the_steps_the_window_needs(values):
    """``S`` steps on the ring scheme: ``S - 1`` KV hops forward, ``S - 1`` KV hops and ``S``
    dKV hops backward; a schedule of every step would send ``3 R - 2``."""
    steps = next(iter(WINDOWS.values()))
    for rank, value in enumerate(values):
        assert value["transfers"] == {"compiled": 3 * steps - 2, "eager": 3 * steps - 2}, f"rank {rank}"


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
