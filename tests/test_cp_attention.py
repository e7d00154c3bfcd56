"""Hierarchical CP attention (every ulysses x ring mesh) equals single-device attention:
output and q/k/v gradients of every rank's shard, pads exactly zero (docs/design.md §1, §6)."""

import pytest

from checks import assert_matches, expected_for, local_rows
from cp_cases import MESHES, SHORT_DOCS, GroupReleaseCase, attention_cases, mesh_id, recompute_exchange_cases, traffic_cases

CASES = [pytest.param(mesh, case, id=f"{mesh_id(mesh)}-{case.id}")
         for mesh in MESHES for case in attention_cases()]


@pytest.mark.parametrize("mesh, case", CASES)
def test_cp_attention_matches_single_device_reference(cp_world, mesh, case):
    reference = expected_for(case)
    for rank, result in enumerate(cp_world(mesh).values(case.id)):
        index = result["global_index"]
        for name in ("out", "dq", "dk", "dv"):
            got = result[name]
            assert_matches(got, local_rows(reference[name], index), f"rank {rank} {name}")
            assert (got[index < 0] == 0).all(), f"rank {rank}: {name} is not zero at the pads"
        assert_matches(result["unsharded_out"], reference["out"], f"rank {rank} unshard(out)")


@pytest.mark.parametrize("mesh", MESHES, ids=mesh_id)
def test_recompute_exchange_saves_only_the_inputs_and_output(cp_world, mesh):
    """With recompute_exchange, the forward saves no tensor with a head dimension other than
    q, k, v and the output (the lse are 2-D); without it, a batch whose document crosses
    ranks saves the exchanged copies, which the probe sees."""
    world = cp_world(mesh)
    for case in recompute_exchange_cases():
        default = case.default_case
        for rank, (lean, full) in enumerate(zip(world.values(case.id), world.values(default.id))):
            assert lean["saved_besides_inputs"] == [], f"rank {rank} {case.id}: {lean['saved_besides_inputs']}"
            if case.docs == "long":
                assert full["saved_besides_inputs"], f"rank {rank} {default.id}: saved no exchanged copy"


@pytest.mark.parametrize("mesh", MESHES, ids=mesh_id)
def test_eager_backward_frees_each_head_group_before_the_next(cp_world, mesh):
    """Eagerly, a head group's exchanged tensors are gone when the next group's ring backward
    starts; with two head groups (a Ulysses group of 2 ranks, two KV heads each) there are two."""
    case = GroupReleaseCase("many", 4, 4, True)
    for rank, result in enumerate(cp_world(mesh).values(case.id)):
        alive = result["earlier_groups_alive"]
        assert alive == [0] * len(alive), f"rank {rank}: earlier groups' tensors alive at each group: {alive}"
        if mesh[0] == 2:
            assert len(alive) == 2, f"rank {rank}: expected two head groups, ran {len(alive)}"


TRAFFIC = [pytest.param(mesh, id=mesh_id(mesh)) for mesh in MESHES]


@pytest.mark.parametrize("mesh", TRAFFIC)
def test_balanced_short_documents_stay_home_and_long_ones_travel(cp_world, mesh):
    """A batch of short documents sends nothing round the ring and (almost) nothing through
    the Ulysses exchange under "balanced"; "zigzag" sends every document through both."""
    ulysses, ring = mesh
    sent = {case.id: cp_world(mesh).values(case.id) for case in traffic_cases()}
    for rank, (short, short_zigzag, long) in enumerate(zip(
        sent["traffic-short-balanced"], sent["traffic-short-zigzag"], sent["traffic-long-balanced"]
    )):
        assert short["ring"] == 0, f"rank {rank}: short documents crossed the ring"
        placed = short["document_placement"]
        assert placed.count("ring") == 0 and placed.count("group") <= ulysses * ring
        if ring > 1:
            assert short_zigzag["ring"] > 0 and long["ring"] > 0
        if ulysses > 1:
            assert short["ulysses"] * 4 < short_zigzag["ulysses"], f"rank {rank}: {short}, {short_zigzag}"
    assert len(SHORT_DOCS) == len(sent["traffic-short-balanced"][0]["document_placement"])
