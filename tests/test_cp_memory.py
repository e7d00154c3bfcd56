"""Eager CP's forward keeps no view of the rank's q, k, v shards (in a model, of the projection's
whole output) unless its backward needs their exchanged rows: with ``recompute_exchange``
(it sends them again), or where the rank exchanges nothing (all its rows are local, kept as
they are). Ring and Ulysses together (2 x 2), documents kept local, cut and spread."""

from __future__ import annotations

import pytest

from memory_cases import MESH, RING_MESH, RING_SUITE, SUITE, ring_step_suite, suite


@pytest.fixture(scope="module")
def memory_world(cp_world):
    return cp_world(MESH, suite=SUITE)


@pytest.mark.parametrize("case", suite(MESH), ids=lambda c: c.id)
def test_forward_keeps_the_projection_only_where_the_backward_reads_its_exchanged_rows(memory_world, case):
    for rank, result in enumerate(memory_world.values(case.id)):
        whole = case.recompute_exchange or result["exchanged_rows"] == 0
        # whole: q, k and v (three views); else the local rows' copies, no view
        assert result["saved_views_of_projection"] == (3 if whole else 0), (
            f"rank {rank}: {result['saved_views_of_projection']} saved tensors share the projection's storage "
            f"({result['exchanged_rows']} exchanged rows, recompute_exchange={case.recompute_exchange})")
    assert any(r["exchanged_rows"] for r in memory_world.values(case.id)), "no rank exchanges: the case tests nothing"


@pytest.mark.parametrize("case", [c for c in suite(MESH) if not c.recompute_exchange], ids=lambda c: c.id)
def test_held_bytes_counted_from_the_layout_are_what_the_forward_keeps(memory_world, case):
    """benchmarks/held_bytes.py's count (issue 48's "held" at scale) against the storages the
    forward really keeps, on every rank."""
    for rank, result in enumerate(memory_world.values(case.id)):
        assert result["counted_held_bytes"] == result["held_bytes"], f"rank {rank}: {result}"


@pytest.mark.parametrize("case", ring_step_suite(RING_MESH), ids=lambda c: c.id)
def test_a_ring_step_holds_no_earlier_steps_block_results(cp_world, case):
    """When a ring step's block starts, forward or backward, no earlier step's block result is
    alive but the first step's, which the running output and lse (forward) and the running
    dq sum (backward) begin as: each step's results are merged or summed and dropped before the
    next block (docs/benchmarks.md, "Merges and sums as ops")."""
    world = cp_world(RING_MESH, suite=RING_SUITE)
    for rank, result in enumerate(world.values(case.id)):
        for direction in ("forward", "backward"):
            alive = result[direction]
            assert len(alive) == RING_MESH[1], f"rank {rank} {direction}: {len(alive)} ring steps: the case tests nothing"
            assert all(set(steps) <= {0} for steps in alive), (
                f"rank {rank} {direction}: earlier steps alive at each step's block: {alive}")
