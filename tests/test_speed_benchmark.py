"""The trace arithmetic behind benchmarks.speed's exposed-communication column and its
``--trace`` summary, how its rows relate to the one-GPU row, and its ``--fake-rank`` run on CPU."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package

from dataclasses import replace  # noqa: E402

from benchmarks.common import exposed_length, kernel_intervals, kernel_summary, union_intervals  # noqa: E402
from benchmarks.speed import Row, relate  # noqa: E402


def test_union_merges_overlapping_and_touching_intervals():
    assert union_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (8, 9)]) == [(0, 4), (5, 7), (8, 9)]
    assert union_intervals([]) == []


def test_exposed_is_communication_outside_every_compute_interval():
    # comm [0, 10] and [20, 30]; compute covers 2..4, 3..6 (one union 2..6), 8..22, 25..26
    comm = [(0, 10), (20, 30), (21, 23)]
    compute = [(3, 6), (2, 4), (8, 22), (25, 26)]
    # hidden: 2..6 (4) + 8..10 (2) + 20..22 (2) + 25..26 (1) of a comm union of 20
    assert exposed_length(comm, compute) == 20 - 9


def test_exposed_edge_cases():
    assert exposed_length([], [(0, 5)]) == 0
    assert exposed_length([(0, 5)], []) == 5
    assert exposed_length([(1, 2)], [(0, 5)]) == 0
    assert exposed_length([(0, 2), (4, 6)], [(1, 5)]) == 2  # one compute interval spans two comms


def test_kernel_intervals_split_nccl_from_other_kernels():
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "ncclDevKernel_AllToAll", "ts": 10, "dur": 5},
        {"cat": "kernel", "name": "flash_fwd_kernel", "ts": 0, "dur": 12},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "no duration", "ts": 3},
    ]}
    assert kernel_intervals(trace) == ([(10.0, 15.0)], [(0.0, 12.0)])


def test_kernel_summary_counts_busy_time_and_ranks_kernels_by_time():
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "copy", "ts": 0, "dur": 1000},
        {"cat": "kernel", "name": "attention", "ts": 500, "dur": 2000},
        {"cat": "kernel", "name": "copy", "ts": 4000, "dur": 1000},
        {"cat": "cpu_op", "name": "aten::cat", "ts": 0, "dur": 9000},
    ]}
    lines = kernel_summary(trace).splitlines()
    # span 0..5000 us; busy 0..2500 and 4000..5000
    assert lines[0] == "span 5.00 ms, some kernel running 3.50 ms, 3 kernels"
    assert lines[1].split() == ["2.000", "ms", "2x", "copy"]
    assert lines[2].split() == ["2.000", "ms", "1x", "attention"]
    assert len(lines) == 3


def test_memory_ratios_need_no_time_and_the_recompute_option_keys_its_own_row():
    """A --share-gpu row has no time (so no efficiency) but its memory ratios; rows with and
    without recompute_exchange are distinct (merged files keep both)."""
    one_gpu = Row("W1-128K", "gqa", "one-gpu-flex", "-", "flex", "1", 1, ms=100.0, peak_gib=4.0, saved_gib=1.0)
    shared = Row("W1-128K", "gqa", "hcp-eager", "balanced", "dense", "2x1 shared", 2, peak_gib=5.0,
                 saved_gib=0.5, recompute_exchange=True)
    relate([one_gpu, shared])
    assert (shared.efficiency, shared.peak_vs_one_gpu, shared.saved_vs_one_gpu) == (None, 1.25, 0.5)
    assert replace(shared, recompute_exchange=False).key() != shared.key()


def test_fake_rank_times_one_rank_alone_on_cpu(tmp_path):
    """--fake-rank: one process, no torchrun, runs as rank 1 of ulysses 1 x ring 2 over torch's
    fake process group (hcp's agreement then stays on the CPU); its CP rows are labelled as one
    rank alone and related to the one-GPU row of the same run."""
    import json
    import subprocess

    out = tmp_path / "fake.json"
    command = [sys.executable, "-m", "benchmarks.speed", "--device", "cpu", "--fake-rank", "1", "--ulysses", "1",
               "--ring", "2", "--shrink", "512", "--head-dim", "16", "--dtype", "float32", "--heads", "gqa",
               "--workloads", "W2-128K", "--modes", "one-gpu-hcp,hcp-eager", "--placements", "balanced",
               "--warmup", "0", "--iters", "1", "--out", str(out)]
    done = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"one-gpu-hcp", "hcp-eager"}
    cp = rows["hcp-eager"]
    assert cp["error"] is None and cp["mesh"] == "1x2 rank 1 alone" and cp["gpus"] == 2
    assert cp["efficiency"] == round(rows["one-gpu-hcp"]["ms"] / (2 * cp["ms"]), 3)
