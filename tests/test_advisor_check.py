"""benchmarks.advisor_check on CPU: one rank alone measured through ``speed.py --fake-rank``,
set against the advisor's compute prediction, which is checked here against the pair count
of the batch and the throughput kernels/measured.json records."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.advisor_check import Comparison, predicted_ms
from benchmarks.speed_workloads import workloads
from hcp_advise.measurements import CACHE_ENV

ROOT = Path(__file__).resolve().parents[1]

DEVICE = "NVIDIA H200"


@pytest.fixture(autouse=True)
def no_cached_measurements(monkeypatch, tmp_path):
    """The stored measurements, whatever this user's ``--measure`` cached (the environment
    reaches the subprocesses too)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


def test_one_rank_measured_and_predicted_on_cpu(tmp_path):
    command = [sys.executable, "-m", "benchmarks.advisor_check", "--device", "cpu", "--shrink", "512",
               "--meshes", "2x1", "--ranks", "0,5", "--workloads", "W1-128K,W4-128K", "--kernel", "torch",
               "--warmup", "0", "--iters", "1", "--predict-kernel", "cudnn", "--device-kind", DEVICE,
               "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 5 is not of a 2-rank mesh: skipped
    comparison, windowed = json.loads((tmp_path / "advisor_check.json").read_text())
    assert (comparison["workload"], comparison["mesh"], comparison["rank"]) == ("W1-128K", "2x1", 0)
    assert (windowed["workload"], windowed["mesh"], windowed["rank"]) == ("W4-128K", "2x1", 0)
    # the window (8 keys back, shrunk 512 times) leaves fewer pairs than the same batch without it
    w4 = workloads(512)["W4-128K"]
    unwindowed, _ = predicted_ms(w4.lengths, 2, 1, 0, "balanced", "cudnn", "gqa", 128, DEVICE)
    assert 0 < windowed["predicted_ms"] < unwindowed and windowed["measured_ms"] > 0
    assert comparison["error"] is None and comparison["measured_ms"] > 0
    # W1 shrunk 512 times: one document of 256 tokens, exchanged over the 2 Ulysses ranks (each
    # with 16 of the 32 query heads), a document shorter than 2048 rows: cuDNN's "short
    # documents" throughput, at the smallest call size recorded (the call is smaller still)
    tokens, heads_q, head_dim = 256, 32, 128
    flops = tokens * (tokens + 1) / 2 * (heads_q // 2) * 14 * head_dim
    recorded = json.loads((ROOT / "hcp_compile/kernels/measured.json").read_text())
    short = [r for r in recorded["devices"][DEVICE]["sizes"] if r["composition"] == "short documents"]
    smallest = min(short, key=lambda r: r["call_tflop"])
    assert flops < smallest["call_tflop"] * 1e12
    tflops = smallest["tflops"]["cudnn"]
    assert abs(comparison["predicted_ms"] - flops / (tflops * 1e12) * 1e3) < 1e-9
    assert "W1-128K" in (tmp_path / "advisor_check.md").read_text()


def test_the_error_is_the_prediction_over_the_measurement_in_percent():
    """A prediction of 11 ms for a rank measured at 10 ms is 10 % long; 9 ms, 10 % short; no
    error where either side is missing (a failed run, a kernel the model does not cover)."""
    def error(predicted, measured):
        return Comparison("W1-128K", "2x1", 0, "balanced", "cudnn", measured, predicted).error_pct

    assert abs(error(11.0, 10.0) - 10.0) < 1e-9 and abs(error(9.0, 10.0) + 10.0) < 1e-9
    assert error(None, 10.0) is None and error(11.0, None) is None
