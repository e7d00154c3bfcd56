"""benchmarks.work_split: each rank's attention work counted from the layout."""

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
