"""``shard_plan`` on real meshes: what every rank holds, and shard/unshard (docs/design.md §2)."""

import pytest
import torch

from cp_cases import MESHES, PAD_VALUE, cu_seqlens, mesh_id, plan_cases

CASES = [pytest.param(mesh, case, id=f"{mesh_id(mesh)}-{case.id}")
         for mesh in MESHES for case in plan_cases()]


@pytest.mark.parametrize("mesh, case", CASES)
def test_every_real_token_is_held_by_exactly_one_rank(cp_world, mesh, case):
    results = cp_world(mesh).values(case.id)
    counts = {r["local_tokens"] for r in results} | {r["global_index"].numel() for r in results}
    assert len(counts) == 1, f"local token counts differ between ranks: {counts}"
    held = torch.cat([r["global_index"] for r in results])
    real = held[held >= 0]
    assert sorted(real.tolist()) == list(range(sum(case.lengths)))


@pytest.mark.parametrize("mesh, case", CASES)
def test_position_ids_and_valid_describe_the_held_tokens(cp_world, mesh, case):
    cu = cu_seqlens(case.lengths).long()
    for rank, r in enumerate(cp_world(mesh).values(case.id)):
        index, valid = r["global_index"], r["valid"]
        assert torch.equal(valid, index >= 0), f"rank {rank}: valid != (global_index >= 0)"
        doc = torch.searchsorted(cu[1:], index.clamp(min=0), right=True)
        expected = torch.where(valid, index - cu[doc], 0)
        assert torch.equal(r["position_ids"], expected), f"rank {rank}: position_ids"


@pytest.mark.parametrize("mesh, case", CASES)
def test_shard_then_unshard_is_identity_and_unshard_backward_is_own_slice(cp_world, mesh, case):
    x = case.inputs()
    for rank, r in enumerate(cp_world(mesh).values(case.id)):
        index, valid = r["global_index"], r["valid"]
        expected_shard = torch.where(valid[:, None], x["x"][index.clamp(min=0)], PAD_VALUE)
        assert torch.equal(r["sharded"], expected_shard), f"rank {rank}: plan.shard"
        assert torch.equal(r["unsharded"], x["x"]), f"rank {rank}: unshard(shard(x)) != x"
        expected_grad = torch.where(valid[:, None], x["w"][index.clamp(min=0)], 0)
        assert torch.equal(r["unshard_grad"], expected_grad), f"rank {rank}: unshard backward"
