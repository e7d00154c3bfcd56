"""The advisor at scale (issue 48, item 5): each option's predicted efficiency (one GPU's time for
the whole batch over N x its slowest rank's) and its layout's balance (a rank's tokens with pads
over the mean), each against a reference computed here without the advisor's own code for it:
the one-GPU call from measured.json read directly, the balance from ``shard_plan`` on torch's fake
process group."""

from __future__ import annotations

import json

import pytest
import torch

import hcp_advise as advise
import hcp_compile as hc
from hcp_advise import Links, Option, host_measured
from hcp_advise.measurements import CACHE_ENV
from hcp_compile.batch.traffic import CallShape
from hcp_compile.kernels import measured
from hcp_compile.testing.worlds import fake_world

H200 = json.loads(measured.MEASURED_FILE.read_text())["devices"]["NVIDIA H200"]
LENGTHS = (8192, 3000, 1500, 700, 2600)  # hand-made: one long document, a few short ones
HEADS_Q, HEADS_KV, D = 32, 8, 128
CALL = CallShape(HEADS_Q, HEADS_KV, D, torch.bfloat16)
FREE = Links(all_to_all_bytes_per_s=1e30, ring_nvlink_bytes_per_s=1e30, network_bytes_per_s=1e30,
             nvlink_latency_s=0.0, network_latency_s=0.0)
# how far a rank's blocks may run above one GPU's whole call: measured.json's cudnn rates fall
# slightly with the call's size past 32K tokens (514.5 to 504.8 TF/s on one document)
RATE_SPREAD = 0.03


@pytest.fixture(autouse=True)
def no_cached_measurements(monkeypatch, tmp_path):
    """The stored measurements, whatever this user's --measure cached."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


def advice_of(lengths: tuple[int, ...], world: int, links: Links = Links()) -> advise.Advice:
    return advise.advise(advise.cu_seqlens_of(lengths), world=world, gpus_per_node=8, heads_q=HEADS_Q,
                         heads_kv=HEADS_KV, head_dim=D, kernel="cudnn", links=links)


def one_gpu_seconds(lengths: tuple[int, ...]) -> float:
    """One cudnn call of every document on one GPU: its causal pairs x 14 D FLOPs per query
    head, at the H200's rate for log-uniform documents at calls of that work, interpolated in
    log(work) between the recorded sizes."""
    flops = sum(n * (n + 1) // 2 for n in lengths) * 14 * D * HEADS_Q
    points = sorted((r["call_tflop"] * 1e12, r["tflops"]["cudnn"] * 1e12) for r in H200["sizes"]
                    if r["composition"] == measured.LOG_UNIFORM)
    assert points[0][0] < flops < points[-1][0], "the batch must lie inside the measured call sizes"
    return flops / measured.interpolated(points, flops)


def test_efficiency_is_one_gpus_time_over_n_times_the_slowest_ranks():
    advice = advice_of(LENGTHS, 4)
    expected_one_gpu = one_gpu_seconds(LENGTHS)
    (call,) = advice.one_gpu
    assert call.seconds == pytest.approx(expected_one_gpu, rel=1e-9) and call.within_measured
    table = advise.kernel_table("NVIDIA H200")
    for p in advice.predictions:
        slowest = advise.predict([advise.cu_seqlens_of(LENGTHS)], p.option, 8, CALL, "cudnn", table, Links(),
                                 host_measured.find("NVIDIA H200", "hcp-eager", "cudnn"))
        assert p.step_s == pytest.approx(slowest.step_s, rel=1e-12)
        assert p.efficiency == pytest.approx(expected_one_gpu / (4 * slowest.step_s), rel=1e-9)


@pytest.mark.parametrize("ulysses, ring, placement", [(2, 2, "balanced"), (2, 2, "zigzag"), (1, 4, "balanced"),
                                                      (4, 2, "zigzag")])
def test_balance_is_the_largest_ranks_tokens_over_the_mean_of_the_shard_plan(ulysses, ring, placement):
    cu = advise.cu_seqlens_of(LENGTHS)
    with fake_world(ulysses, ring) as mesh:
        plan = hc.shard_plan(cu, mesh, placement=placement)
        largest = max(plan.prepared.rank_tokens(r, a) for r in range(ring) for a in range(ulysses))
    ranks = ulysses * ring
    predicted = advise.predict([cu], Option(ulysses, ring, placement), 8, CALL, "cudnn",
                               advise.kernel_table("NVIDIA H200"), Links())
    assert predicted.balance == pytest.approx(largest / (plan.num_tokens / ranks), rel=1e-12)
    assert predicted.balance >= 1


@pytest.mark.parametrize("lengths", [LENGTHS, (65536,), (300,) * 40 + (20000,)])
@pytest.mark.parametrize("world", [4, 8])
def test_efficiency_is_at_most_one_where_communication_is_free(lengths, world):
    """With links of no cost the ranks only split one GPU's work (and add passes and host
    work): N ranks are no faster than N x one GPU, up to the kernels' rate spread."""
    for p in advice_of(lengths, world, FREE).predictions:
        assert 0 < p.efficiency <= 1 + RATE_SPREAD, (p.option, p.efficiency)


def test_the_command_prints_efficiency_and_balance():
    out = advise.main(["--world", "8", "--tokens", "65536", "--kernel", "cudnn"])
    expected = advise.advise(advise.batches_from("loguniform:256:32768", 65536, 1, 0), world=8, gpus_per_node=8,
                             heads_q=HEADS_Q, heads_kv=HEADS_KV, head_dim=D, kernel="cudnn")
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    assert rows[0][-2:] == ["efficiency", "balance"]
    assert [row[-2:] for row in rows[1:]] == [[f"{p.efficiency:.3f}", f"{p.balance:.3f}"]
                                              for p in expected.predictions]
    assert "outside the calls measured" not in out  # 65536 tokens lie inside them
    verbose = advise.main(["--world", "8", "--tokens", "65536", "--kernel", "cudnn", "--verbose"])
    assert [cell.strip() for cell in verbose.splitlines()[0].split("|")[-3:-1]] == ["efficiency", "balance"]


def test_a_one_gpu_call_beyond_the_measured_sizes_is_named():
    """One document of 1M tokens is far beyond the largest call measured (128K tokens): the
    report says its efficiency rests on an extrapolated rate."""
    out = advise.main(["--world", "8", "--tokens", str(1 << 20), "--lengths", "one", "--kernel", "cudnn"])
    call = advise.one_gpu_call(advise.cu_seqlens_of([1 << 20]), CALL, "cudnn", advise.kernel_table("NVIDIA H200"))
    assert not call.within_measured and call.flops > call.measured_flops[1]
    note = " ".join(out.split())
    assert f"{call.flops / 1e12:,.1f} TFLOP of one document with cudnn) lies outside the calls measured" in note
    assert "an extrapolation" in note
