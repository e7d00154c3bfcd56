"""benchmarks.work_split: each rank's attention work counted from the layout; its command and
benchmarks.held_bytes' (the bytes held for the backward, checked in test_cp_memory.py)."""

import importlib
import sys

import pytest
import torch

from benchmarks.speed_workloads import Workload
from benchmarks.work_split import rank_work, shares
from hcp_compile.batch.placements import PLACEMENTS
from hcp_compile.batch.prepared import MeshShape, host_values, prepare


def test_a_zigzag_document_under_a_window_by_hand():
    """16 tokens on a ring of 2: rank 0 holds positions 0-3 and 12-15, rank 1 4-11; a window of
    2 keys back gives a query min(position, 2) + 1 keys: 1+2+3+3 + 4*3 = 21 against 8*3 = 24."""
    workload = Workload("one", (16,), window_left=2)
    assert shares(workload, 1, 2, "zigzag") == pytest.approx([21 / 22.5, 24 / 22.5])


@pytest.mark.parametrize("ulysses, ring", [(1, 2), (2, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("window_left", [-1, 0, 5, 40])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_ranks_share_every_pair_of_the_batch_once(ulysses, ring, window_left, placement):
    lengths = (0, 1, 7, 3, 130, 0, 2, 61, 29, 300, 5)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    prepared = prepare(host_values(cu), MeshShape(ulysses, ring, placement))
    expected = sum(min(position, window_left if window_left >= 0 else position) + 1
                   for length in lengths for position in range(length))
    assert sum(rank_work(prepared, window_left)) == pytest.approx(expected)


@pytest.mark.parametrize("module", ["benchmarks.work_split", "benchmarks.held_bytes"])
def test_the_commands_print_a_row_per_mesh_and_placement_and_reject_bad_meshes(module, monkeypatch, capsys):
    command = importlib.import_module(module)
    monkeypatch.setattr(sys, "argv", [module, "--workloads", "W2-128K", "--meshes", "2x1", "1x2"])
    command.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("W2-128K")]
    assert len(rows) == 2 * len(PLACEMENTS)
    monkeypatch.setattr(sys, "argv", [module, "--meshes", "2by1"])
    with pytest.raises(SystemExit):
        command.main()
    assert "--meshes: expected ULYSSESxRING" in capsys.readouterr().err
