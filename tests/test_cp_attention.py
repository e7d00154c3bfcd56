"""Hierarchical CP attention (every ulysses x ring mesh) equals single-device attention:
output and q/k/v gradients of every rank's shard, pads exactly zero (DESIGN §1, §6)."""

import pytest
import torch

from checks import assert_matches, expected_for
from cp_cases import MESHES, attention_cases, mesh_id

CASES = [pytest.param(mesh, case, id=f"{mesh_id(mesh)}-{case.id}")
         for mesh in MESHES for case in attention_cases()]


def local_rows(global_tensor: torch.Tensor, global_index: torch.Tensor) -> torch.Tensor:
    """The rows of a global tensor that a rank holds, zeros at its pads (index -1)."""
    pads = (global_index < 0).reshape(-1, *([1] * (global_tensor.dim() - 1)))
    return global_tensor[global_index.clamp(min=0)].masked_fill(pads, 0)


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
