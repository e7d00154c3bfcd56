"""Invalid input under CP: every rank raises, naming the argument, and no rank hangs; a batch
rule broken on one rank raises its error on every rank, and when a single rank's input fails
another rule (its dtype, ...) the others raise a RuntimeError pointing at another rank."""

import pytest

import hcp_compile as hc

from checks import assert_raised
from cp_cases import ERROR_MESH, MESHES, ONE_BAD_RANK, error_cases, mesh_id

CASES = [pytest.param(ERROR_MESH, case, id=f"{mesh_id(ERROR_MESH)}-{case.id}")
         for case in error_cases()]
CASES += [pytest.param(mesh, ONE_BAD_RANK, id=f"{mesh_id(mesh)}-{ONE_BAD_RANK.id}")
          for mesh in MESHES]


@pytest.mark.parametrize("mesh, case", CASES)
def test_invalid_input_raises_on_every_rank(cp_world, mesh, case):
    for rank, record in enumerate(cp_world(mesh).per_rank(case.id)):
        if case.expects_own_error(rank):
            assert_raised(record, case.error, case.match, f"rank {rank}")
        else:
            assert_raised(record, RuntimeError, "another rank", f"rank {rank}")


@pytest.mark.parametrize("name", ["skip_outside_window", "agree_across_ranks", "recompute_exchange"])
def test_flag_options_must_be_bools(name):
    """A string such as "false" would silently count as true."""
    with pytest.raises(hc.InputError, match=f"{name}: expected True or False, got 'false'"):
        hc.CPOptions(**{name: "false"})
