"""``examples/train_packed.py`` in a reduced form (as a subprocess, the way users run it), and
the ``("data", "ring", "ulysses")`` mesh of ``make_mesh(..., data=D)`` in a 4-process world
(suite :func:`suite` of this module, run by ``hcp_compile/testing/worlds.py``), where the example's worker
then trains with data-parallel replicas."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hcp_compile as hc
from checks import assert_matches
from cp_cases import World
from hcp_compile.testing.worlds import WORLD_DIR_ENV, run_script
from hcp_compile.exchange.mesh import resolve_groups

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_packed.py"
SMALL = ["--layers", "1", "--tokens", "160", "--min-doc", "8", "--max-doc", "60"]
RUN_DEADLINE_S = 300  # generous: the machine's cores may be shared
WORLD = (1, 4)  # a 4-rank world: (ulysses, ring) of its own mesh, which the case does not use
SUITE = "test_train_example:suite"
WORLD_DEADLINE_S = 240


def run_example(*args: str, plot: Path) -> str:
    return run_script(EXAMPLE, [*args, "--plot", str(plot)], RUN_DEADLINE_S)


def losses(output: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step +\d+ \| loss (\S+) \|", output, re.MULTILINE)]


def test_example_trains_and_matches_one_process(tmp_path: Path) -> None:
    """With its batches and their plans built by a DataLoader worker (the in-process path runs
    in the data-parallel case below): the first step matches one process without CP."""
    output = run_example(*SMALL, "--steps", "3", "--loader-workers", "1", plot=tmp_path / "loss.png")
    assert "data 1 x ulysses 2 x ring 2" in output
    assert re.search(r"^first-step check .*: PASS$", output, re.MULTILINE), output
    curve = losses(output)
    assert len(curve) == 3 and all(math.isfinite(loss) for loss in curve), output
    assert curve[-1] < curve[0], output
    shapes = re.findall(r"batch: (\d+) documents, (\d+) tokens", output)
    assert len(set(shapes)) == 3, f"the batches should differ in shape: {shapes}"
    assert "compiled graphs: 1 in 3 steps" in output, output


# --------------------------------------------------------------------------- the 3-D mesh


@dataclass(frozen=True)
class DataParallelCase:
    """data 2 x ring 2 x ulysses 1 on the world's 4 ranks: :func:`check_data_mesh`, then the
    example's worker on that mesh (each replica trains on its own batches; the one-process
    check covers both replicas' batches). One world for both: starting ranks costs more than
    either."""

    id: str = "data-parallel-mesh-and-example"

    def run(self, world: World) -> dict:
        check_data_mesh(world.rank)
        return {"example_passed": _example_worker_passes(world.rank, 4, os.environ[WORLD_DIR_ENV])}


def suite(mesh: tuple[int, int]) -> list:
    return [DataParallelCase()]


def test_data_parallel_mesh_and_example(cp_world) -> None:
    results = cp_world(WORLD, suite=SUITE, deadline_s=WORLD_DEADLINE_S).values(DataParallelCase().id)
    for rank, result in enumerate(results):
        assert result["example_passed"], f"rank {rank}: the example's checks failed"


def _example_worker_passes(rank: int, world: int, tmp: str) -> bool:
    """The example's worker as its launcher runs it, in this already initialized world, with
    the compiled graph run eagerly after the rewrite (``--inner eager``: the AOT trace is
    what the other test covers)."""
    import train_packed
    from _common import Worker

    args = train_packed.parse_args([
        *SMALL, "--steps", "2", "--data", "2", "--ulysses", "1", "--ring", "2",
        "--inner", "eager", "--plot", str(Path(tmp) / "loss.png"),
    ])
    return train_packed.worker(Worker(rank, world, torch.device("cpu")), args)


def check_data_mesh(rank: int) -> None:
    """data 2 x ring 2 x ulysses 1: the layout of the ranks, the CP groups taken from the full
    mesh and from its ``["ring", "ulysses"]`` submesh, what is rejected, and CP attention
    confined to each replica (each attends over a different batch)."""
    mesh = hc.make_mesh(ulysses=1, ring=2, device_type="cpu", data=2)
    assert mesh.mesh_dim_names == ("data", "ring", "ulysses")
    assert mesh.mesh.tolist() == [[[0], [1]], [[2], [3]]]  # a replica's ranks are contiguous
    replica, ring_rank = divmod(rank, 2)
    for cp_mesh in (mesh, mesh["ring", "ulysses"]):
        groups = resolve_groups(cp_mesh)
        assert (groups.ring_size, groups.ulysses_size) == (2, 1)
        assert (groups.ring_rank, groups.ulysses_rank) == (ring_rank, 0)
        assert dist.get_process_group_ranks(groups.ring_group) == [2 * replica, 2 * replica + 1]
    for wrong in (mesh["data", "ring"], mesh["data"]):
        with pytest.raises(ValueError, match=r"mesh: expected a DeviceMesh with dims"):
            resolve_groups(wrong)
    with pytest.raises(ValueError, match=r"data \* ulysses \* ring = 3 \* 1 \* 2 = 6"):
        hc.make_mesh(ulysses=1, ring=2, device_type="cpu", data=3)
    with pytest.raises(ValueError, match="make_mesh: data must be a positive int"):
        hc.make_mesh(ulysses=1, ring=2, device_type="cpu", data=0)
    _check_attention_per_replica(mesh, replica)


def _check_attention_per_replica(mesh, replica: int) -> None:
    lengths = ((5, 3, 8), (2, 11, 4, 1))[replica]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    generator = torch.Generator().manual_seed(replica)
    q, k, v = (torch.randn(sum(lengths), 2, 4, generator=generator) for _ in range(3))
    longest = max(lengths)
    plan = hc.shard_plan(cu, mesh)
    with hc.context_parallel(mesh):
        local = hc.varlen_attention(
            plan.shard(q), plan.shard(k), plan.shard(v), cu, cu, longest, longest, causal=True
        )
    expected = hc.varlen_attention(q, k, v, cu, cu, longest, longest, causal=True)
    assert_matches(plan.unshard(local), expected, f"replica {replica} out")  # CP vs one device: §6
