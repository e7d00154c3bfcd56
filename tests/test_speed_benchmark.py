"""The trace arithmetic behind benchmarks.speed's exposed-communication column and its
``--trace`` summary, how its rows relate to the one-GPU row, its ``--fake-rank`` run on CPU, and
its ``--mixed`` stream and ``--scale`` table (their schedule, their arithmetic, a CPU run), and
benchmarks.trace_parts' breakdown of stored traces."""

import gzip
import json
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.common import (
    exposed_length, kernel_intervals, kernel_summary, live_at_peak, stream_seed, union_intervals,
)
from benchmarks import trace_parts
from benchmarks.speed_measure import read_trace
from benchmarks.speed_report import table
from benchmarks.speed_rows import (
    Row, first_extra_s, relate, scale_figures, summarize_compositions, summarize_stream,
)
from benchmarks.speed_run import outputs_gib
from benchmarks.speed_workloads import mixed_steps, reset_steps, workloads


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


def test_live_at_peak_names_what_the_allocator_held_at_its_peak():
    gib = 2**30

    def frames(*names):
        return [{"filename": f"/x/{file}", "line": line, "name": name} for file, line, name in names]

    ours = frames(("torch/functional.py", 1, "cat"), ("hcp_compile/hierarchical.py", 7, "backward"),
                  ("benchmarks/speed.py", 9, "measure"))
    trace = [
        {"action": "alloc", "addr": 1, "size": 2 * gib, "frames": frames(("lib.py", 3, "f"))},
        {"action": "alloc", "addr": 2, "size": 1 * gib, "frames": ours},
        {"action": "free_requested", "addr": 1, "size": 2 * gib},  # counted until its free completes
        {"action": "alloc", "addr": 3, "size": gib // 2, "frames": ours},  # the peak: 3.5 GiB
        {"action": "free_completed", "addr": 1, "size": 2 * gib},
        {"action": "alloc", "addr": 4, "size": 1 * gib, "frames": ours},  # 2.5 GiB
    ]
    lines = live_at_peak(trace).splitlines()
    assert lines[0] == "peak 3.500 GiB allocated, 3 blocks, reached at hierarchical.py:7 backward <- speed.py:9 measure"
    assert lines[1].split() == ["2.000", "GiB", "lib.py:3", "f"]
    assert lines[2].split() == ["1.500", "GiB", "hierarchical.py:7", "backward", "<-", "speed.py:9", "measure"]
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


def test_a_stream_draws_new_lengths_per_step_from_the_workloads_distribution():
    """Step s: the workload's token count in lengths of its range, seeded (seed, step): the
    same in every call (every rank, every run); step 0 is the workload's batch; one document
    stays one document."""
    by_name = workloads()
    w2, w3, w4 = by_name["W2-128K"], by_name["W3-128K"], by_name["W4-128K"]
    assert w2.step(0) == w2 and w3.step(0) == w3
    assert by_name["W1-128K"].step(7) == by_name["W1-128K"]
    steps = [w2.step(s).lengths for s in range(6)]
    assert len(set(steps)) == 6 and steps == [w2.step(s).lengths for s in range(6)]
    for s in range(1, 6):
        assert sum(w2.step(s).lengths) == 128 * 1024 and max(w2.step(s).lengths[:-1]) <= 32768
        assert min(w3.step(s).lengths[:-1]) >= 128 and max(w3.step(s).lengths) <= 2048
        assert w4.step(s).lengths == w2.step(s).lengths and w4.step(s).window_left == 4096  # W2 under a window
    assert stream_seed(0, 0) == 0 and stream_seed(1, 0) == 1 and stream_seed(0, 1) != stream_seed(1, 0)


def test_stream_figures_from_step_times():
    """Steady: the last half of the steps; one-time: the time beyond all steps at the steady
    rate; cumulative time at the end of each tenth of the steps (rounded up)."""
    row = Row("W2-128K", "gqa", "one-gpu-hcp", "-", "flash", "1", 1, stream_steps=4, stream_layers=2,
              step_ms=[5000.0, 1000.0, 1000.0, 1000.0])
    summarize_stream(row, [1e12, 1e12, 2e12, 2e12])  # steady: 4e12 FLOPs in 2 s
    assert (row.stream_s, row.tflops_per_gpu, row.steady_tflops_per_gpu) == (8.0, 0.75, 2.0)
    assert row.one_time_pct == 62.5  # 6e12 FLOPs at 2 TF/s take 3 s of the 8
    assert row.first_step_s == 5.0
    assert row.cumulative_s == [5.0, 5.0, 6.0, 6.0, 6.0, 7.0, 7.0, 8.0, 8.0, 8.0]
    cp = Row("W2-128K", "gqa", "hcp-eager", "balanced", "flash", "2x1", 2, stream_steps=4, stream_layers=2,
             step_ms=[2500.0, 500.0, 500.0, 500.0])
    summarize_stream(cp, [1e12, 1e12, 2e12, 2e12])
    repeated = Row("W2-128K", "gqa", "one-gpu-hcp", "-", "flash", "1", 1, ms=10.0)
    relate([row, cp, repeated])
    assert cp.efficiency == 1.0 and cp.steady_efficiency == 1.0  # 4 s on 2 GPUs vs 8 s on one; 2 TF/s per GPU steady
    assert repeated.efficiency == 1.0 and repeated.steady_efficiency is None
    assert len({r.key() for r in (row, cp, repeated)}) == 3  # merged files keep a stream apart
    text = table([row, cp, repeated])
    assert "steady TF/s/GPU" in text and "5 5 6 6 6 7 7 8 8 8" in text and "exposed ms" in text


def test_stream_on_cpu(tmp_path):
    """--stream 4 --layers 2 as one rank alone (the fake process group): every mode's row has
    the stream's figures, each step a new batch; flex, which has no CPU backward, records
    its error."""
    import json
    import subprocess
    import time

    out = tmp_path / "stream.json"
    command = [sys.executable, "-m", "benchmarks.speed", "--device", "cpu", "--fake-rank", "1", "--ulysses", "1",
               "--ring", "2", "--stream", "4", "--layers", "2", "--shrink", "1024", "--head-dim", "16",
               "--dtype", "float32", "--heads", "gqa", "--workloads", "W2-128K",
               "--modes", "one-gpu-flex,one-gpu-hcp,hcp-eager,hcp-compiled", "--placements", "balanced",
               "--out", str(out)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"stream smoke run: {time.perf_counter() - started:.1f} s")
    data = json.loads(out.read_text())
    assert data["runs"][0]["options"]["stream"] == 4 and data["runs"][0]["options"]["layers"] == 2
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"one-gpu-flex", "one-gpu-hcp", "hcp-eager", "hcp-compiled"}
    assert "backward" in rows["one-gpu-flex"]["error"] and rows["one-gpu-flex"]["stream_s"] is None
    for mode in ("one-gpu-hcp", "hcp-eager", "hcp-compiled"):
        row = rows[mode]
        assert row["error"] is None, row["error"]
        assert (row["stream_steps"], row["stream_layers"], row["ms"]) == (4, 2, None)
        assert len(row["step_ms"]) == 4 and all(t > 0 for t in row["step_ms"])
        cumulative = row["cumulative_s"]
        assert len(cumulative) == 10 and all(a <= b for a, b in zip(cumulative, cumulative[1:]))
        assert cumulative[0] == row["first_step_s"] > 0
        assert abs(cumulative[-1] - row["stream_s"]) <= 1e-3 * row["stream_s"]
        assert row["tflops_per_gpu"] > 0 and row["steady_tflops_per_gpu"] > 0 and row["prepare_ms"] > 0
        assert row["one_time_pct"] < 100 and row["efficiency"] > 0 and row["steady_efficiency"] > 0
    assert rows["one-gpu-hcp"]["efficiency"] == 1.0
    assert rows["hcp-eager"]["mesh"] == "1x2 rank 1 alone" and rows["hcp-eager"]["graphs"] == 0
    assert rows["hcp-compiled"]["graphs"] >= 1  # its compile, in the stream


def test_stream_plans_ahead_and_traces_a_step_on_cpu(tmp_path):
    """--plan-ahead: the CP modes take each step's prepared batch from a DataLoader worker;
    --trace: one more step of a new batch is traced per mode, its host time, busy time and plan
    kept in the row, its trace in the folder (a one-GPU row plans nothing ahead)."""
    import json
    import subprocess

    out, traces = tmp_path / "stream.json", tmp_path / "traces"
    command = [sys.executable, "-m", "benchmarks.speed", "--device", "cpu", "--fake-rank", "0", "--ulysses", "1",
               "--ring", "2", "--stream", "3", "--layers", "2", "--shrink", "1024", "--head-dim", "16",
               "--dtype", "float32", "--heads", "gqa", "--workloads", "W3-128K", "--placements", "balanced",
               "--modes", "one-gpu-hcp,hcp-eager,hcp-compiled", "--plan-ahead", "--trace", str(traces),
               "--out", str(out)]
    done = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"one-gpu-hcp", "hcp-eager", "hcp-compiled"}
    for mode, row in rows.items():
        assert row["error"] is None, row["error"]
        assert row["plan_ahead"] == (mode != "one-gpu-hcp")
        assert row["traced_step_ms"] >= row["traced_plan_ms"] > 0 and row["traced_busy_ms"] == 0  # no GPU
        placement = "-" if mode == "one-gpu-hcp" else "balanced"
        assert (traces / f"W3-128K_gqa_{mode}_{placement}_u1r2_stream_rank0.json.gz").exists()
    assert "plan ahead" in done.stdout and "traced step / busy / plan ms" in done.stdout


COMPOSITIONS = ["W1-128K", "W1-256K", "W2-128K", "W2-256K", "W3-128K", "W3-256K", "W4-128K", "W4-256K"]


def test_a_mixed_stream_meets_every_workload_in_seeded_rounds_and_resets_on_schedule():
    """Rounds of all eight workloads, each round shuffled, the same in every call; every step a
    new batch of its workload (its own step index); a longer stream starts with these steps;
    Dynamo resets before every K-th step after the first, never for K = 0."""
    by_name = workloads()
    compositions = [by_name[n] for n in COMPOSITIONS]
    steps = mixed_steps(compositions, 24)
    names = [w.name for w in steps]
    assert steps == mixed_steps(compositions, 24) and mixed_steps(compositions, 26)[:24] == steps
    for start in range(0, 24, 8):
        assert sorted(names[start:start + 8]) == sorted(COMPOSITIONS)
    assert names[:8] != COMPOSITIONS and names[:8] != names[8:16]  # shuffled, anew each round
    assert [w.name for w in mixed_steps(compositions, 24, seed=1)] != names
    assert all(w == by_name[w.name].step(s) for s, w in enumerate(steps))
    drawn = [w.lengths for w in steps if not w.name.startswith("W1")]
    assert len(set(drawn)) == len(drawn)  # no batch repeats another, W4 (W2's lengths) included
    assert reset_steps(200, 25) == [25, 50, 75, 100, 125, 150, 175]
    assert reset_steps(50, 25) == [25] and reset_steps(200, 0) == []


def test_first_step_of_each_workload_against_its_median():
    """Per workload: its first step after the stream's first minus the median of its steps after
    the stream's first, in seconds; the stream's first step belongs to none of them."""
    names = ["A", "B", "A", "C", "B", "A", "B", "A"]
    step_ms = [9000.0, 900.0, 700.0, 50.0, 100.0, 500.0, 120.0, 400.0]
    # A after step 0: 700, 500, 400 (median 500); B: 900, 100, 120 (median 120); C: 50 alone
    assert first_extra_s(names, step_ms) == {"A": 0.2, "B": 0.78, "C": 0.0}
    assert first_extra_s(["A", "B", "B"], [5000.0, 300.0, 100.0]) == {"A": None, "B": 0.1}


def test_mixed_table_reads_the_targets_off_the_step_times():
    """The mixed streams' table: overall over steady TF/s, the first step beyond flash's first
    in the same stream, and per workload the first step after the stream's first beyond its
    median."""
    def mixed_row(mode: str, step_ms: list[float]) -> Row:
        row = Row("mixed", "gqa", mode, "-", mode[8:], "1", 1, stream_steps=4, stream_layers=1, mixed_reset=2,
                  step_workloads=["A", "B", "A", "B"], step_ms=step_ms)
        summarize_stream(row, [1e12] * 4)
        summarize_compositions(row)
        return row

    hcp = mixed_row("one-gpu-hcp", [1000.0, 500.0, 250.0, 250.0])  # 4e12 FLOPs in 2 s; steady 2e12 in 0.5 s
    flash = mixed_row("one-gpu-flash", [400.0, 300.0, 200.0, 200.0])
    assert hcp.first_extra_s == {"A": 0.0, "B": 0.125}  # B: 500 ms against the median of 500 and 250
    lines = table([hcp, flash]).split("mixed streams; per workload")[1].splitlines()
    hcp_line = next(line for line in lines if "one-gpu-hcp" in line)
    assert hcp_line.split()[-5:] == ["0.5", "1", "0.6", "0", "0.125"]  # overall/steady, first s, - flash's, A, B


def test_scale_rows_split_the_peak_and_relate_to_the_smallest_size():
    """out, dq, dk, dv from shapes (GQA 32/8 x 128 bf16 at 128K tokens: 2.5 GiB, as q, k, v and
    dout); extra = peak - those, over the inputs; ms per FLOP and peak per token over the
    smallest size's of the same heads and mode; a failed size stays blank."""
    from types import SimpleNamespace

    import torch

    setup = SimpleNamespace(args=SimpleNamespace(head_dim=128), dtype=torch.bfloat16)
    assert outputs_gib(131072, "gqa", setup) == 2.5 and outputs_gib(4 * 131072, "mha", setup) == 16.0

    def scale_row(workload: str, mode: str, outputs: float, **measured) -> Row:
        return Row(workload, "gqa", mode, "-", "cudnn", "1", 1, scale=True, outputs_gib=outputs, **measured)

    small = scale_row("W2-128K", "one-gpu-hcp", 2.5, ms=100.0, peak_gib=3.0)
    large = scale_row("W2-512K", "one-gpu-hcp", 10.0, ms=1700.0, peak_gib=13.0)
    failed = scale_row("W2-1M", "one-gpu-hcp", 20.0, error="OutOfMemoryError: CUDA out of memory")
    flex = scale_row("W2-512K", "one-gpu-flex", 10.0, ms=2000.0, peak_gib=10.5)
    for row, flops in ((small, 4e13), (large, 64e13), (failed, 256e13), (flex, 64e13)):
        scale_figures(row, flops)
    assert (small.tflops_per_gpu, small.extra_gib, small.extra_vs_inputs) == (400.0, 0.5, 0.2)
    assert (large.tflops_per_gpu, large.extra_gib, large.extra_vs_inputs) == (376.5, 3.0, 0.3)
    relate([large, failed, flex, small])
    assert (small.flop_time_vs_smallest, small.token_peak_vs_smallest) == (1.0, 1.0)
    # 16x the FLOPs in 17x the time; 1.3 GiB per GiB of outputs against 1.2
    assert (large.flop_time_vs_smallest, large.token_peak_vs_smallest) == (1.062, 1.083)
    assert (failed.tflops_per_gpu, failed.extra_gib, failed.flop_time_vs_smallest) == (None, None, None)
    assert (flex.flop_time_vs_smallest, flex.token_peak_vs_smallest) == (1.0, 1.0)  # its own smallest
    assert Row("W2-128K", "gqa", "one-gpu-hcp", "-", "cudnn", "1", 1).key() != small.key()
    text = table([small, large, failed, flex])
    assert "extra/inputs" in text and "1.083" in text and "OutOfMemoryError" in text
    assert "exposed ms" not in text  # no table of repeated batches without such rows


def _run_speed(arguments: list[str], out: Path, shrink: int = 1024):
    import subprocess

    command = [sys.executable, "-m", "benchmarks.speed", "--device", "cpu", "--shrink", str(shrink), "--head-dim",
               "16", "--dtype", "float32", "--heads", "gqa", *arguments, "--out", str(out)]
    done = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_mixed_stream_on_cpu(tmp_path):
    """--mixed 6 over three workloads (two rounds: one document, a window, twice the tokens),
    Dynamo reset before step 3, as one rank alone: each mode's row holds the seeded order, its
    stream figures and its figure per workload; hcp's CP mode takes each step's window; flex's
    error names the step it failed."""
    import json

    out = tmp_path / "mixed.json"
    names = ["W1-128K", "W4-128K", "W2-256K"]
    done = _run_speed(["--fake-rank", "0", "--ulysses", "1", "--ring", "2", "--mixed", "6", "--layers", "1",
                       "--mixed-reset", "3", "--workloads", ",".join(names), "--placements", "balanced",
                       "--modes", "one-gpu-flex,one-gpu-hcp,hcp-eager"], out, shrink=2048)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    by_name = workloads(2048)
    order = [w.name for w in mixed_steps([by_name[n] for n in names], 6)]
    assert "torch._dynamo.reset() before steps 3\n" in done.stdout and "mixed streams; per workload" in done.stdout
    assert rows["one-gpu-flex"]["error"].startswith(f"NotImplementedError at step 0 ({order[0]}): ")
    for mode in ("one-gpu-hcp", "hcp-eager"):
        row = rows[mode]
        assert row["error"] is None, row["error"]
        assert (row["workload"], row["stream_steps"], row["mixed_reset"]) == ("mixed", 6, 3)
        assert row["step_workloads"] == order and len(row["step_ms"]) == 6
        assert list(row["first_extra_s"]) == list(dict.fromkeys(order))
        assert row["first_step_s"] > 0 and row["steady_tflops_per_gpu"] > 0


def test_scale_on_cpu(tmp_path):
    """--scale on CPU: hcp's call at each size (no peak without CUDA), smallest first; flex's row
    keeps its error (no CPU backward) and the run goes on; flash, which needs CUDA, is skipped."""
    import json

    out = tmp_path / "scale.json"
    done = _run_speed(["--scale", "256K,128K", "--warmup", "0", "--iters", "1"], out)
    rows = json.loads(out.read_text())["rows"]
    hcp = sorted((r for r in rows if r["mode"] == "one-gpu-hcp"), key=lambda r: r["outputs_gib"])
    assert [r["workload"] for r in hcp] == ["W2-128K", "W2-256K"] and all(r["scale"] for r in rows)
    assert all(r["error"] is None and r["ms"] > 0 and r["peak_gib"] is None for r in hcp)
    assert abs(hcp[1]["outputs_gib"] / hcp[0]["outputs_gib"] - 2) < 1e-3 and hcp[0]["flop_time_vs_smallest"] == 1.0
    assert {r["workload"] for r in rows if r["mode"] == "one-gpu-flex" and "backward" in r["error"]} == {
        "W2-128K", "W2-256K"}
    assert "one-gpu-flash: skipped" in done.stdout and "one call fwd+bwd, one GPU" in done.stdout


def test_trace_parts_name_each_kernel_and_divide_each_trace(tmp_path):
    names = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": "attention kernels",
        "void cudnn::fusion::fmha_reduce_head_ragged<true>(void const*)": "kernel helpers",
        "void cudnn::fusion::compute_dot_do_o_ragged_specialized<true, 128>": "kernel helpers",
        "void at::native::vectorized_gather_kernel<16, long>(char*)": "copies",
        "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>>": "fills",
        "_merge_kernel": "sums and merges",
        "ncclDevKernel_AllGather_RING_LL": "communication",
        "some_new_kernel": "other",
    }
    for kernel, part in names.items():
        assert trace_parts.part_of(kernel).startswith(part), kernel
    one = {"traceEvents": [{"cat": "kernel", "name": "flash_fwd_kernel", "ts": 0, "dur": 8000},
                           {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]}
    rank = {"traceEvents": [{"cat": "kernel", "name": "flash_fwd_kernel", "ts": 0, "dur": 1500},
                            {"cat": "kernel", "name": "_merge_kernel", "ts": 0, "dur": 500}]}
    paths = [tmp_path / "one.json.gz", tmp_path / "rank.json"]
    with gzip.open(paths[0], "wt") as file:
        json.dump(one, file)
    paths[1].write_text(json.dumps(rank))
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:4]]
            for line in trace_parts.table([read_trace(p) for p in paths], ["one", "rank"], [8, 1]).splitlines()[2:]}
    assert rows["attention kernels"] == ["1.0 (1)", "1.5 (1)"]
    assert rows["sums and merges"] == ["-", "0.5 (1)"]
    assert rows["total"] == ["1.0 (1)", "2.0 (2)"]
