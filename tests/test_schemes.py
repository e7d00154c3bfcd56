"""Collective schemes (hcp_compile/schemes, docs/extending.md "A collective scheme"): eager CP
under each scheme equals the float64 single-device reference (output and q/k/v gradients,
pads exactly zero), and what each scheme says it sends (``batch.traffic.call_traffic``,
collectives and bytes per group, forward and backward) is what the collectives were measured
sending (tests/traffic.py) on every rank of every mesh."""

from __future__ import annotations

import pytest
import torch

from checks import assert_matches, expected_for, local_rows
from cp_cases import MESHES, cu_seqlens, mesh_id, scheme_cases
import hcp_advise as advise
from hcp_compile.batch import layout
from hcp_compile.batch.placements import placement_rule
from hcp_compile.exchange.schemes import SCHEMES
from hcp_compile.batch.traffic import CallShape, call_traffic
from hcp_compile.plan import format_bytes

CASES = [pytest.param(mesh, case, id=f"{mesh_id(mesh)}-{case.id}")
         for mesh in MESHES for case in scheme_cases()]
BF16_GQA = {"atol": 3.5e-2, "rtol": 3.5e-2}  # README tolerances


def test_every_scheme_is_tested():
    assert {case.scheme for case in scheme_cases()} == set(SCHEMES)


@pytest.mark.parametrize("mesh, case", CASES)
def test_scheme_matches_single_device_reference(cp_world, mesh, case):
    dtype = getattr(torch, case.dtype)
    reference = expected_for(case, dtype)
    tolerance = BF16_GQA if dtype == torch.bfloat16 else {}
    for rank, result in enumerate(cp_world(mesh).values(case.id)):
        index = result["global_index"]
        for name in ("out", "dq", "dk", "dv"):
            got = result[name]
            assert got.dtype == dtype, f"rank {rank} {name}: {got.dtype}"
            assert_matches(got, local_rows(reference[name], index), f"rank {rank} {name}", **tolerance)
            assert (got[index < 0] == 0).all(), f"rank {rank}: {name} is not zero at the pads"


@pytest.mark.parametrize("mesh, case", CASES)
def test_scheme_traffic_is_what_the_collectives_send(cp_world, mesh, case):
    ulysses, ring = mesh
    call = CallShape(case.heads_q, case.heads_kv, case.head_dim, getattr(torch, case.dtype),
                     recompute_exchange=case.recompute_exchange)
    for rank, result in enumerate(cp_world(mesh).values(case.id)):
        sizes = layout.rank_sizes(result["sizes"], result["ulysses_rank"], ulysses)
        said = call_traffic(case.scheme, sizes, call, ulysses, ring)
        for direction in ("forward", "backward"):
            expected = {f"{group}_{what}": getattr(getattr(said, group), f"{direction}_{what}")
                        for group in ("ulysses", "ring") for what in ("calls", "bytes")}
            assert result[direction] == expected, f"rank {rank} {direction}: measured {result[direction]}"


def test_allgather_sends_fewer_ring_collectives_and_bytes_than_the_ring(cp_world):
    """On 1 x 4 (three hops per direction): the all-gather issues one collective forward and two
    backward where the ring issues 3 and 7, and its backward sends one section fewer (each
    gradient goes straight to its owner)."""
    world = cp_world((1, 4))
    ring, gathered = (world.values(f"scheme-{s}-long-h4.2-causal-w4.0")[0] for s in ("ring", "allgather"))
    assert (ring["forward"]["ring_calls"], ring["backward"]["ring_calls"]) == (3, 7)
    assert (gathered["forward"]["ring_calls"], gathered["backward"]["ring_calls"]) == (1, 2)
    assert gathered["forward"]["ring_bytes"] == ring["forward"]["ring_bytes"]
    assert gathered["backward"]["ring_bytes"] < ring["backward"]["ring_bytes"]


def summary_rows(table: str) -> list[dict[str, str]]:
    """The rows of ``ShardPlan.summary``'s markdown table, by header."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


SUMMARY_CASES = [pytest.param(mesh, case, id=f"{mesh_id(mesh)}-{case.id}")
                 for mesh in MESHES for case in scheme_cases() if not case.recompute_exchange]


@pytest.mark.parametrize("mesh, case", SUMMARY_CASES)
def test_shard_plan_summary_is_what_a_call_sends(cp_world, mesh, case):
    """``ShardPlan.summary`` (of the case's scheme) against what each rank was measured to hold
    and send: real tokens and pads from the rank's ``global_index``, the documents per
    placement from ``document_placement``, the bytes of one call (forward and backward) on
    each group from tests/traffic.py."""
    results = cp_world(mesh).values(case.id)
    for rank, result in enumerate(results):
        row = summary_rows(result["summary"])[rank]
        index = result["global_index"]
        assert row["rank (ring, ulysses)"].startswith(f"{rank} "), row
        assert (int(row["real tokens"]), int(row["pads"])) == (int((index >= 0).sum()), int((index < 0).sum()))
        placed = result["document_placement"]
        assert int(row["docs local/group/ring"].split("/")[2]) == placed.count("ring"), row
        sent = {group: result["forward"][f"{group}_bytes"] + result["backward"][f"{group}_bytes"]
                for group in ("ulysses", "ring")}
        assert (row["all-to-all bytes/call"], row["ring bytes/call"]) == (
            format_bytes(sent["ulysses"]), format_bytes(sent["ring"])), f"rank {rank}: {row}, measured {sent}"


ADVISED_CASES = [pytest.param(mesh, case, id=f"{mesh_id(mesh)}-{case.id}")
                 for mesh in MESHES for case in scheme_cases()
                 if case.scheme == advise.SCHEME and not case.recompute_exchange]


@pytest.mark.parametrize("mesh, case", ADVISED_CASES)
def test_advisor_bytes_are_what_a_call_sends(cp_world, mesh, case):
    """The advisor's inputs to its communication part (hcp_advise/)
    against measurement: the sizes it reads off the layout without the prepared batch's tables
    are each rank's measured sizes, and its all-to-all bytes, split into what travels before
    the ring (the rank's own region: none when it has none) and after it (the others'), add up
    to what the rank was measured sending, per direction. (Its ring hops are call_traffic's,
    which test_scheme_traffic_is_what_the_collectives_send checks.)"""
    ulysses, ring = mesh
    call = CallShape(case.heads_q, case.heads_kv, case.head_dim, getattr(torch, case.dtype))
    batch = layout.batch_layout(cu_seqlens(case.lengths), ulysses, ring, placement_rule(case.placement))
    for rank, result in enumerate(cp_world(mesh).values(case.id)):
        ring_rank, ulysses_rank = divmod(rank, ulysses)
        sizes = advise.rank_sizes(batch, ring_rank, ulysses_rank)
        assert sizes == layout.rank_sizes(result["sizes"], result["ulysses_rank"], ulysses), f"rank {rank}"
        forward_in, forward_out, backward_in, backward_out = advise.exchange_bytes(sizes, call, ulysses, ring)
        measured = result["forward"], result["backward"]
        assert (forward_in + forward_out, backward_in + backward_out) == tuple(
            m["ulysses_bytes"] for m in measured), f"rank {rank}"
        # what a rank sends before the ring is its own exchange region's q and KV (dout), what it
        # sends after is the others' results: each share is zero exactly when its regions are
        own, others = sizes.exchange[ulysses_rank], sum(sizes.exchange) - sizes.exchange[ulysses_rank]
        assert (forward_in == 0) == (own == 0 or ulysses == 1) and (forward_out == 0) == (others == 0 or ulysses == 1)
