"""``python -m hcp_advise --measure`` and the measurements it stores, on CPU: the table fitted
from timings, the cache file, its precedence over the stored table, the message where neither
exists, the timing loop with the torch kernel and the link measurement between two gloo processes
(the CUDA parts, kernel choice and NCCL, run only on a GPU)."""

from __future__ import annotations

import json
import math
import runpy
import sys

import pytest
import torch

import hcp_advise as advise
from hcp_advise import Timing, measure
from hcp_advise.command import links_of, parser
from hcp_advise.measurements import CACHE_ENV, cache_dir, cache_file, kernel_table, store
from hcp_compile.batch.traffic import CallShape
from hcp_compile.kernels.measured import LOG_UNIFORM, ONE_DOCUMENT, SHORT, WINDOW
from hcp_compile.validation import InputError


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path):
    """An empty cache folder of this test's own, as ``$HCP_ADVISE_CACHE_DIR``."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


def test_the_table_fitted_from_timings_interpolates_in_log_of_the_work(cache):
    """Kernel "a" on one document: 2 calls of 1 TFLOP in 10 ms (200 TF/s), 2 of 40 TFLOP in 200 ms
    (400 TF/s); on short documents 50 TF/s; kernel "b" 100 TF/s on small calls only. The main
    table takes each kernel's largest batches; a call of sqrt(1 * 40) TFLOP runs halfway between."""
    timings = [Timing("a", ONE_DOCUMENT, 4096, 2, 2e12, 0.01), Timing("a", ONE_DOCUMENT, 65536, 2, 80e12, 0.2),
               Timing("b", ONE_DOCUMENT, 4096, 2, 2e12, 0.02), Timing("a", SHORT, 4096, 2, 1e12, 0.02)]
    entry = advise.entry_of(timings)
    assert entry["tflops"] == {ONE_DOCUMENT: {"a": 400.0, "b": 100.0}, SHORT: {"a": 50.0}}
    assert sorted((r["tokens"], r["composition"], r["call_tflop"]) for r in entry["sizes"]) == [
        (4096, ONE_DOCUMENT, 1.0), (4096, SHORT, 0.5), (65536, ONE_DOCUMENT, 40.0)]
    store(cache_file("G"), "G", entry)
    table = kernel_table("G")
    assert table.source == str(cache / "advisor-G.json")
    assert table.throughput("a", ONE_DOCUMENT, 1e12) == pytest.approx(200e12)
    assert table.throughput("a", ONE_DOCUMENT, 1e14) == pytest.approx(400e12)  # beyond: the largest
    assert table.throughput("a", ONE_DOCUMENT, math.sqrt(40) * 1e12) == pytest.approx(300e12)
    assert table.throughput("b", ONE_DOCUMENT, 40e12) == pytest.approx(100e12)  # one size: the main table
    assert table.throughputs() == pytest.approx({"a": 225e12, "b": 100e12})  # unwindowed mean
    with pytest.raises(InputError, match="no kernel could be timed"):
        advise.entry_of([])


def test_the_cache_folder_and_file_name():
    assert cache_file("NVIDIA H200 NVL", cache_dir()) == cache_dir() / "advisor-NVIDIA_H200_NVL.json"
    assert cache_dir().name == "cache"  # the fixture's $HCP_ADVISE_CACHE_DIR


def test_the_cache_comes_before_the_stored_measurements(cache):
    """1024 documents of 256 tokens on 16 GPUs stay whole (64 per rank): every rank's compute is
    64 * 256 * 257 / 2 pairs x 14 x 128 x 32 FLOPs at the cached 1 TF/s, not at the stored table's."""
    store(cache_file("NVIDIA H200"), "NVIDIA H200", {"tflops": {SHORT: {"cudnn": 1.0}}})
    got = advise.advise(advise.cu_seqlens_of([256] * 1024), world=16, gpus_per_node=8, heads_q=32, heads_kv=8,
                        head_dim=128)
    assert got.kernel == "cudnn" and got.measurements == str(cache / "advisor-NVIDIA_H200.json")
    assert got.best.compute_s == pytest.approx(64 * 256 * 257 / 2 * 14 * 128 * 32 / 1e12, rel=1e-9)
    assert "with kernel='cudnn': the runtime's kernel='auto' chooses by" in " ".join(advise.format_advice(got).split())


def test_without_measurements_the_error_says_what_to_run(cache, tmp_path):
    with pytest.raises(InputError) as error:
        advise.advise(advise.cu_seqlens_of([100]), world=2, gpus_per_node=8, heads_q=32, heads_kv=8, head_dim=128,
                      device_kind="NVIDIA A100-SXM4-80GB")
    message = str(error.value)
    assert message.startswith("device_kind: no measurements for 'NVIDIA A100-SXM4-80GB'")
    assert "run `python -m hcp_advise --measure`" in message
    assert str(cache / "advisor-NVIDIA_A100-SXM4-80GB.json") in message
    assert "--device-kind 'NVIDIA H200'" in message
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(InputError, match=f"run `python -m hcp_advise --measure --cache-dir {elsewhere}`"):
        advise.advise(advise.cu_seqlens_of([100]), world=2, gpus_per_node=8, heads_q=32, heads_kv=8, head_dim=128,
                      device_kind="X", cache_dir=elsewhere)


def test_the_command_exits_with_that_message_not_a_traceback(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["hcp_advise", "--world", "8", "--device-kind", "NVIDIA A100-SXM4-80GB"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("hcp_advise", run_name="__main__")
    assert str(done.value.code).startswith("error: device_kind: no measurements for 'NVIDIA A100-SXM4-80GB'")
    assert "python -m hcp_advise --measure" in str(done.value.code)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU to measure")
def test_measure_without_a_gpu_says_so():
    with pytest.raises(InputError, match="^measure: needs a CUDA GPU"):
        advise.main(["--measure"])


def test_a_bad_cache_file_names_itself_and_the_fix(cache):
    path = cache_file("G")
    path.parent.mkdir(parents=True)
    path.write_text("{")
    with pytest.raises(InputError, match=f"{path}: expected the measurements of 'G'.*run it again"):
        kernel_table("G")
    store(path, "G", {"tflops": {ONE_DOCUMENT: {"cudnn": -3}}})
    with pytest.raises(InputError, match=r"tflops\['one document'\]\['cudnn'\]: expected a positive number, got -3"):
        kernel_table("G")


def test_timings_on_cpu_fill_a_table_the_advisor_reads(cache):
    """The torch kernel on CPU, batches of 32 and 64 tokens (shorter than every composition's
    shortest document, so each batch is one document) under a window of 3 keys: each composition at
    each size, the window's too (torch takes a causal window). 64 causal tokens see 64 * 65 / 2 pairs;
    32 tokens in the window see 4 * 5 / 2 + 28 * 4; 14 x head dim 8 x 2 query heads FLOPs a pair."""
    lines: list[str] = []
    call = CallShape(2, 1, 8, torch.float32)
    timings, skipped = measure.kernel_timings(["torch"], call, torch.device("cpu"), window=3, sizes=(32, 64),
                                              log=lines.append)
    assert skipped == [] and len(lines) == len(timings) == 8
    assert {(t.composition, t.tokens) for t in timings} == {
        (c, n) for c in (ONE_DOCUMENT, LOG_UNIFORM, SHORT, WINDOW) for n in (32, 64)}
    by_key = {(t.composition, t.tokens): t for t in timings}
    assert by_key[ONE_DOCUMENT, 64].flops == measure.BATCHES * 64 * 65 / 2 * 14 * 8 * 2
    assert by_key[WINDOW, 32].flops == measure.BATCHES * (4 * 5 / 2 + 28 * 4) * 14 * 8 * 2
    assert all(t.seconds > 0 and t.calls == measure.BATCHES for t in timings)
    store(cache_file("cpu"), "cpu", advise.entry_of(timings))
    got = advise.advise(advise.cu_seqlens_of([40, 24]), world=2, gpus_per_node=2, heads_q=2, heads_kv=1, head_dim=8,
                        dtype=torch.float32, device_kind="cpu", window=3)
    assert got.kernel == "torch" and got.measurements == str(cache_file("cpu")) and got.best.compute_s > 0
    # past the budget nothing starts, and each measurement says so
    lines.clear()
    none, skipped = measure.kernel_timings(["torch"], call, torch.device("cpu"), sizes=(32,), budget_s=-1.0,
                                           log=lines.append)
    assert none == [] and len(skipped) == 3 and all("past the -1 s budget" in line for line in skipped)
    assert lines == skipped  # said as they come


def test_links_are_measured_between_two_ranks_or_left_at_the_defaults():
    figures, note = measure.link_figures(2, backend="gloo", size=1 << 16)
    assert set(figures) == {"all_to_all_bytes_per_s", "ring_nvlink_bytes_per_s", "nvlink_latency_s"}
    assert all(value > 0 for value in figures.values()) and note.startswith("links measured between GPUs 0 and 1 (gloo")
    figures, note = measure.link_figures(1)
    assert figures == {} and note.startswith("NVLink not measured: one GPU")


def test_measured_links_stand_unless_an_option_is_given(cache):
    """The cache of "G" measured the all-to-all only: it replaces the default unless the option is
    given; the ring hop and the latency stay an H200's, which a line says, naming their options."""
    store(cache_file("G"), "G", {"tflops": {ONE_DOCUMENT: {"cudnn": 1.0}}, "links": {"all_to_all_bytes_per_s": 1e11},
                                 "links_note": "why not"})
    table = kernel_table("G")
    links, note = links_of(parser().parse_args(["--world", "2"]), table)
    assert links.all_to_all_bytes_per_s == 1e11
    assert links.ring_nvlink_bytes_per_s == advise.Links().ring_nvlink_bytes_per_s
    assert len(note) == 1 and "--ring-nvlink-gbs, --nvlink-latency-us" in note[0] and "why not" in note[0]
    links, _ = links_of(parser().parse_args(["--world", "2", "--all-to-all-gbs", "7"]), table)
    assert links.all_to_all_bytes_per_s == 7e9
    assert links_of(parser().parse_args(["--world", "2"]), kernel_table("NVIDIA H200"))[1] == []
    assert json.loads(cache_file("G").read_text())["devices"]["G"]["links_note"] == "why not"
