"""The mesh advisor (hcp_advise/): each part of the cost model and the
chooser against values computed by hand from the layout rules (docs/design.md §2, §3.3, §3.6,
§4), the bytes of schemes/ulysses.py and schemes/ring.py, and kernels/measured.json read
directly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import hcp_advise as advise
from hcp_compile.batch import layout
from hcp_compile.kernels import KERNELS
from hcp_advise import HopTimes, Links, Option
from hcp_advise.measurements import CACHE_ENV
from hcp_compile.batch.packing import log_uniform_lengths
from hcp_compile.batch.placements import PLACEMENTS, placement_rule
from hcp_compile.batch.prepared import prepare_batch
from hcp_compile.batch.traffic import CallShape
from hcp_compile.kernels import measured
from hcp_compile.validation import InputError

MEASURED = json.loads(measured.MEASURED_FILE.read_text())
H200 = MEASURED["devices"]["NVIDIA H200"]["tflops"]
LINKS = Links()  # 440 / 290 / 50 GB/s, 10 / 25 us
BF16 = 2  # bytes
D = 128
FLOPS_PER_PAIR = 14 * D * 32  # 7 products of 2 D FLOPs, 32 query heads


@pytest.fixture(autouse=True)
def no_cached_measurements(monkeypatch, tmp_path):
    """The stored measurements, whatever this user's --measure cached."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


def tflops(composition: str) -> float:
    return H200[composition]["dense"] * 1e12


def seconds_at(pairs: float, composition: str) -> float:
    return pairs * FLOPS_PER_PAIR / tflops(composition)


def nvlink_a2a(count: float) -> float:
    return count / 440e9 + 10e-6


def passes(count: float) -> float:
    """Seconds of memory-bound passes reading and writing ``count`` bytes (records.PASS_BYTES_PER_S)."""
    return count / 4.2e12


def options_of(advice: advise.Advice) -> list[tuple[int, int, str]]:
    return [(p.ulysses, p.ring, p.placement) for p in advice.predictions]


def prediction(advice: advise.Advice, ulysses: int, ring: int, placement: str) -> advise.Prediction:
    return next(p for p in advice.predictions if (p.ulysses, p.ring, p.placement) == (ulysses, ring, placement))


# --------------------------------------------------------------------------------------------
# the chooser on hand-computed cases
# --------------------------------------------------------------------------------------------

def test_one_long_document_on_two_nodes():
    """One 32K document on 2 nodes of 8 (heads 32/8). On 8 x 2 (zigzag: the document round the
    ring) chunk c = 32768 / 4 = 8192; every ring rank holds two chunks: its own step is
    c(c+1) + c^2 pairs, its other step 2c^2 (docs/design.md §3.3), each over 1/8 of the heads.
    One KV head per rank: one head group. A section is W = 2c tokens of k and v, 8 MiB, over
    the network; the exchange region is 2048 tokens per rank, 14336 on the others."""
    c = 8192
    own_pairs, ring_pairs = (c * (c + 1) + c * c) / 8, 2 * c * c / 8
    own, ring = seconds_at(own_pairs, "one document"), seconds_at(ring_pairs, "one document")
    section = 2 * c * 2 * 1 * D * BF16

    def network(count: float) -> float:
        return count / 50e9 + 25e-6

    # the GPU's passes besides the kernels (hcp_advise/passes.py; the dense kernel adds none): the
    # exchange region X = 2048 tokens, the stream S = ring section W = 16384 (two chunks), 4 q and
    # 1 KV heads after the exchange, elements of D in bf16, each pass read and written
    x, s = 2048, 2 * c
    forward_passes = passes(2 * x * (32 + 16) * D * BF16  # q, k, v packed
                            + 2 * x * 32 * D * BF16  # out joined from the group's ranks
                            + (x + x) * 32 * D * BF16)  # the exchange region into the rank's rows
    backward_passes = passes(2 * x * 64 * D * BF16 + 2 * x * (32 + 16) * D * BF16  # dout, out packed; dq, dk, dv joined
                             + 2 * (2 * s * 2 * D * BF16)  # the own section's message; its sum and the rest joined
                             + (x + x) * (32 + 16) * D * BF16)  # the regions
    merge = passes(s * 4 * D * 3 * BF16)  # step 1's merge (and dq sum): both in bf16, written in bf16
    dkv_join = passes(2 * s * 2 * D * BF16)  # a step's dk and dv into one dKV
    dkv_add = passes(s * 2 * D * 3 * BF16)  # the received dKV plus step 1's, written in bf16
    ring_f = max(own * 2 / 7, network(section)) + ring * 2 / 7 + merge
    # backward: step 0 with the KV hop (+ one carried element), step 1 with the first dKV hop
    # (a block's own gradient, bf16), then the last dKV hop home (bf16)
    ring_b = (max(own * 5 / 7 + dkv_join, network(section + BF16))
              + max(ring * 5 / 7 + dkv_join + merge + dkv_add, network(section)) + network(section))
    exchange = [2048 * (4 + 2) * D * 7 * BF16, 14336 * 4 * D * BF16,  # q, kv in; out back
                2048 * 8 * D * 7 * BF16, 14336 * (4 + 2) * D * BF16]  # dout and out in; dq, dkv back
    # one head group and no local region: every all-to-all waits in line with the ring; the
    # packing and joining passes on top (no host part: none is measured for the dense kernel)
    step = sum(nvlink_a2a(b) for b in exchange) + ring_f + ring_b + forward_passes + backward_passes
    advice = advise.advise(advise.cu_seqlens_of([32768]), world=16, gpus_per_node=8, heads_q=32,
                           heads_kv=8, head_dim=D, kernel="dense")
    got = prediction(advice, 8, 2, "zigzag")
    assert got.compute_s == pytest.approx(own + ring, rel=1e-9)
    assert got.passes_s == pytest.approx(forward_passes + backward_passes + 2 * merge + 2 * dkv_join + dkv_add,
                                         rel=1e-9)
    assert got.exposed_ring_s == pytest.approx(ring_f + ring_b - own - ring - 2 * merge - 2 * dkv_join - dkv_add,
                                               rel=1e-9)
    assert got.step_s == pytest.approx(step, rel=1e-9)
    assert got.ring_link == "network" and got.head_groups == 1
    assert got.all_to_all_bytes == sum(exchange)
    # 1 x 16 cuts the document into chunks of 1024: its 15 other steps are blocks of segments
    # with 1024 keys (or queries), which the dense kernel runs in flash at the short documents'
    # speed (compute.cuts_short_segments); their compute alone exceeds 8 x 2's step
    c = 1024
    alone = seconds_at(2 * c * c + c, "one document") + seconds_at(15 * 2 * c * c, "short documents")
    last = prediction(advice, 1, 16, "balanced")
    assert last.compute_s == pytest.approx(alone, rel=1e-9)
    assert alone > step
    assert options_of(advice)[-len(PLACEMENTS):] == [(1, 16, placement) for placement in PLACEMENTS]
    assert advice.best.ring > 1  # across the two nodes: a ring, never one Ulysses group of 16


def test_many_short_documents_stay_whole_and_move_nothing():
    """1024 documents of 256 tokens on 16 GPUs: 64 per rank, each at most 1/8 of a rank's
    tokens, so the balanced rule keeps them all whole on one rank (docs/design.md §2.2):
    no byte moves, every mesh takes 64 * 256 * 257 / 2 pairs at the short documents' speed.
    Zigzag sends them all round the ring and exchanges them."""
    alone = seconds_at(64 * 256 * 257 / 2, "short documents")
    advice = advise.advise(advise.cu_seqlens_of([256] * 1024), world=16, gpus_per_node=8,
                           heads_q=32, heads_kv=8, head_dim=D, kernel="dense")
    assert advice.best.placement == "balanced"
    balanced = [p for p in advice.predictions if p.placement == "balanced"]
    assert [(p.ulysses, p.ring) for p in balanced] == [(1, 16), (2, 8), (4, 4), (8, 2)]
    for p in balanced:
        assert p.step_s == pytest.approx(alone, rel=1e-9)
        assert p.exposed_s == 0 and p.all_to_all_bytes == 0 and p.ring_bytes == 0
    assert all(p.step_s > alone and p.ring_bytes > 0 for p in advice.predictions if p.placement == "zigzag")


def test_gqa_with_fewer_kv_heads_than_a_node_repeats_them_and_pays_the_rings_merges():
    """32/4 heads on one node of 8, one 64K document. ulysses 8 repeats each KV head twice
    (one per rank, one head group, docs/design.md §3.2); with R = 1 the document is one
    GROUP spread over the node, no local region: all four all-to-all phases wait. ring 8 over
    NVLink: chunks of 4096, every step's compute hides its hops, only the last dKV hop (a
    section of 8192 tokens x 4 KV heads, bf16) is exposed; but each of its 7 later steps merges
    its partial output (and sums dq) over all 32 heads of its 8192 queries, in fp32 between
    the first and the last: those passes cost it more than ulysses 8's exchange."""
    length = 65536
    advice = advise.advise(advise.cu_seqlens_of([length]), world=8, gpus_per_node=8, heads_q=32,
                           heads_kv=4, head_dim=D, kernel="dense")
    assert {(p.ulysses, p.ring) for p in advice.predictions} == {(1, 8), (2, 4), (4, 2), (8, 1)}
    whole = seconds_at(length * (length + 1) / 2 / 8, "one document")
    exchange = [8192 * (4 + 2 * 1) * D * 7 * BF16, 57344 * 4 * D * BF16,
                8192 * 8 * D * 7 * BF16, 57344 * (4 + 2 * 1) * D * BF16]  # dout and out in
    # ulysses 8's passes: X = 8192 tokens per rank, the stream S = 65536; 4 KV heads repeated
    # twice (one head of 4 * 2 / 8 per rank after the exchange, 4 q heads)
    x, s = 8192, length
    forward = (x * 2 * 4 * (1 + 2) * D * BF16  # k and v repeated: read once, written twice
               + 2 * x * (32 + 2 * 4 * 2) * D * BF16  # q, k, v packed
               + 2 * x * 32 * D * BF16 + (x + x) * 32 * D * BF16)  # out joined; the regions
    backward = (2 * x * 64 * D * BF16  # dout and out packed
                + (2 * x * 32 + 2 * x * 4 * (2 + 1)) * D * BF16  # dq joined; dk, dv read repeated, summed
                + 2 * s * 2 * D * BF16 + 2 * s * 2 * D * BF16  # the step's dk, dv into dKV; dKV joined to the rows
                + (x + x) * (32 + 8) * D * BF16)  # the regions
    ulysses = prediction(advice, 8, 1, "balanced")
    assert ulysses.all_to_all_bytes == sum(exchange)
    assert ulysses.passes_s == pytest.approx(passes(forward + backward), rel=1e-9)
    assert ulysses.step_s == pytest.approx(whole + sum(nvlink_a2a(b) for b in exchange) + passes(forward + backward),
                                           rel=1e-9)
    c = length // 16
    ring_compute = seconds_at(c * (c + 1) + c * c + 7 * 2 * c * c, "one document")
    last_hop = 2 * c * 2 * 4 * D * BF16 / 290e9 + 10e-6
    # ring 8's passes: S = W = X = 2c tokens, 32 q and 4 KV heads, nothing packed but k and v
    s = w = x = 2 * c
    out, kv = s * 32 * D, w * 2 * 4 * D  # elements of one step's output, of one section's k and v
    merges = out * (8 + 5 * 10 + 8)  # 7 sums: bf16 + bf16 -> fp32, 5 x fp32 + bf16 -> fp32, fp32 + bf16 -> bf16
    dkv_adds = kv * (8 + 5 * 10 + 8)  # the dKV accumulator over steps 1..7, alike
    forward = 2 * x * 2 * 4 * D * BF16 + (x + x) * 32 * D * BF16 + merges  # k, v packed; the regions
    backward = (2 * 2 * kv * BF16  # the own section's message; the section's sum joined to the rows
                + 8 * 2 * kv * BF16  # each step's dk, dv into dKV
                + (x + x) * (32 + 8) * D * BF16 + merges + dkv_adds)
    ring = prediction(advice, 1, 8, "balanced")
    assert ring.ring_link == "nvlink"
    assert ring.passes_s == pytest.approx(passes(forward + backward), rel=1e-9)
    assert ring.step_s == pytest.approx(ring_compute + last_hop + passes(forward + backward), rel=1e-9)
    assert ring.exposed_ring_s == pytest.approx(last_hop, rel=1e-9)
    assert ring.step_s > ulysses.step_s >= advice.best.step_s


# --------------------------------------------------------------------------------------------
# the parts
# --------------------------------------------------------------------------------------------

def test_the_slowest_member_of_an_all_to_all_sets_its_time():
    """One 1001-token document on ulysses 2: exchange regions of 501 and 500 tokens. Rank 0
    sends more before the attention (its own 501 tokens), rank 1 more after it (the other's
    501): each phase waits for its busier member. Heads 4/2 of 8: per rank 2 q heads and 1 KV
    head (one head group), no local region, no ring: every phase is exposed."""
    call = CallShape(4, 2, 8, torch.bfloat16)
    links = Links(all_to_all_bytes_per_s=1e6, nvlink_latency_s=0.0)
    got = advise.predict([advise.cu_seqlens_of([1001])], Option(2, 1, "balanced"), 8, call,
                         "dense", advise.kernel_table("NVIDIA H200"), links)
    phases = [501 * (2 + 2) * 8 * 2, 501 * 2 * 8 * 2, 501 * 4 * 8 * 2, 501 * (2 + 2) * 8 * 2]  # dout and out in
    assert got.exposed_all_to_all_s == pytest.approx(sum(phases) / 1e6, rel=1e-9)
    assert got.exposed_ring_s == 0


def test_compute_splits_forward_and_backward_as_two_products_of_seven():
    work = advise.BlockWork(torch.tensor([[7e6]], dtype=torch.float64),
                            torch.tensor([[14e6, 0.0]], dtype=torch.float64),
                            [["short documents"]], [["one document", None]])
    got = advise.compute_times(work, 0, 0, CallShape(32, 8, D, torch.bfloat16), "dense",
                               advise.kernel_table("NVIDIA H200"))
    local, step = seconds_at(7e6, "short documents"), seconds_at(14e6, "one document")
    assert got.local_forward == pytest.approx(local * 2 / 7, rel=1e-12)
    assert got.local_backward == pytest.approx(local * 5 / 7, rel=1e-12)
    assert got.step_forward == pytest.approx((step * 2 / 7, 0.0), rel=1e-12)
    assert got.step_backward == pytest.approx((step * 5 / 7, 0.0), rel=1e-12)


def test_a_block_is_timed_at_the_speed_of_calls_of_its_work(recorded_measurements):
    """With sizes recorded (kernels/measured.py): a 1-TFLOP local block runs at the speed
    halfway in log between the 0.1- and 10-TFLOP calls (200 TF/s); a 0.2-TFLOP ring step on
    ulysses 2 with 8 KV heads runs as two head groups' calls of 0.1 TFLOP each (100 TF/s), not
    as one call of 0.2 (130 TF/s); the main table (250 TF/s) is not used."""
    short = measured.SHORT
    recorded_measurements({"devices": {"G": {
        "tflops": {short: {"cudnn": 250}},
        "sizes": [{"tokens": 4096, "composition": short, "call_tflop": 0.1, "tflops": {"cudnn": 100}},
                  {"tokens": 131072, "composition": short, "call_tflop": 10.0, "tflops": {"cudnn": 300}}],
    }}})
    local_flops, step_flops = 1e12, 0.2e12
    work = advise.BlockWork(torch.tensor([[local_flops / FLOPS_PER_PAIR, 0.0]], dtype=torch.float64),
                            torch.tensor([[step_flops / FLOPS_PER_PAIR]], dtype=torch.float64),
                            [[short, None]], [[short]])
    got = advise.compute_times(work, 0, 0, CallShape(32, 8, D, torch.bfloat16), "cudnn", advise.kernel_table("G"))
    assert got.local_forward + got.local_backward == pytest.approx(local_flops / 200e12, rel=1e-9)
    assert sum(got.step_forward) + sum(got.step_backward) == pytest.approx(step_flops / 100e12, rel=1e-9)


def test_exposed_ring_counts_every_head_groups_ring():
    """Two head groups, each with half of every step: forward steps 0.5, 0.5 behind hops of
    3 (ring 3.5 per group); backward steps 1, 1: the KV hop 3, then no dKV cost, the last hop
    1 (ring 5 per group). No exchange time: the call is 2 x 3.5 + 2 x 5 = 17, of which the
    compute is 6 and the rest (11) the ring's."""
    compute = advise.ComputeTimes(0.0, 0.0, (1.0, 1.0), (2.0, 2.0))
    hops = HopTimes(forward=3.0, backward_kv=3.0, backward_dkv=0.0, last_dkv=1.0)
    assert advise.predict_rank(compute, advise.ExchangeTimes(), hops, groups=2) == (17.0, 0.0, 11.0, 0.0)


def test_passes_count_the_bytes_of_the_calls_copies_and_sums():
    """A rank of ulysses 3 x ring 2 with 12/6 heads of 8 in bf16: 4 q and 2 KV heads after the
    exchange, two head groups; local region 10 tokens, its exchange region X = 70 of the stream
    S = 50 + 70 + 30 = 150, ring section W = 20, T = 100 rows. Every pass reads and writes its
    elements (2 bytes, fp32 sums 4), counted by hand from hierarchical.py, collectives.py,
    schemes/ring.py and the cuDNN kernel's wrapper."""
    sizes = layout.RankSizes(100, 10, (50, 70, 30), 20, 1, 3, (4, 4))
    call = CallShape(12, 6, 8, torch.bfloat16)
    x, s, w, rows = 70, 150, 20, 10 + 70 + 100  # the regions' join reads local + X rows, writes T
    forward = (2 * x * (12 + 2 * 6) * 8 * 2  # q, k, v packed
               + 2 * x * 12 * 8 * 2  # out joined from the head groups and ranks
               + rows * 12 * 8 * 2)  # out's regions
    backward = (2 * x * 24 * 8 * 2  # dout and out packed
                + 2 * x * (12 + 2 * 6) * 8 * 2  # dq, dk, dv joined
                + 2 * w * 2 * 2 * 8 * 2  # the own section's message
                + 2 * s * 2 * 2 * 8 * 2  # the section's dKV joined to the GROUP rows
                + rows * (12 + 2 * 6) * 8 * 2)  # dq, dk, dv's regions
    kv0, kv1 = s * 2 * 2 * 8 * 2, w * 2 * 2 * 8 * 2  # bytes of each step's k and v (step 0: the stream)
    out = s * 4 * 8 * 2  # bytes of a step's output
    merge = s * 4 * 8 * (2 + 2 + 2)  # the one merge (and dq sum): bf16 + bf16 -> bf16
    dkv_add = w * 2 * 2 * 8 * (2 + 2 + 2)
    got = advise.pass_bytes(sizes, (True, True), call, 3, "cudnn")
    # cuDNN copies k and v contiguous and fills its outputs (out; dq, dk, dv) on every ring step
    assert got == advise.Passes(forward, backward,
                                (2 * kv0 + out, 2 * kv1 + out + merge),
                                (2 * kv0 + out + kv0 + 2 * kv0, 2 * kv1 + out + kv1 + 2 * kv1 + merge + dkv_add))
    assert advise.pass_bytes(sizes, (True, True), call, 3, "flash") == advise.Passes(
        forward, backward, (0, merge), (2 * kv0, 2 * kv1 + merge + dkv_add))
    # step 1 outside a window: no block, no merge; the received dKV still passes on (bf16 to bf16)
    assert advise.pass_bytes(sizes, (True, False), call, 3, "flash") == advise.Passes(
        forward, backward, (0, 0), (2 * kv0, w * 2 * 2 * 8 * (2 + 2)))
    # seconds at the H200's bandwidth; a rank of whole documents (no exchange region) has none
    assert advise.pass_times(sizes, (True, True), call, 3, "flash").forward == pytest.approx(forward / 4.2e12)
    assert advise.pass_bytes(layout.RankSizes(100, 100, (0, 0, 0), 0, 1, 5, (0,)), (True,), call, 3, "cudnn") \
        == advise.Passes(0, 0, (0,), (0,))


def test_a_ring_steps_segments_are_timed_as_documents_of_two_chunks():
    """One document of 12000 tokens on ring 4: chunks of 1500. The own step holds two chunks each
    side; every other step's segment 2 x 1500 query rows against 1500 keys (or 1500 x 3000),
    2 c^2 pairs as a causal document of 3000 has: one document's speed, not the short ones'.
    The dense kernel sends segments with fewer than 2048 keys or queries to flash: for it they
    are short."""
    batch = layout.batch_layout(advise.cu_seqlens_of([12000]), 1, 4, placement_rule("balanced"))
    assert advise.block_work(batch).step_kind[0] == ["one document"] * 4
    assert advise.block_work(batch, by_chunk=True).step_kind[0] == ["one document"] + ["short documents"] * 3
    assert advise.cuts_short_segments("dense") and not advise.cuts_short_segments("cudnn")


def test_auto_is_the_best_mean_over_the_unwindowed_compositions(monkeypatch):
    """"a" wins one document and the window by far, "b" the mean of the three unwindowed
    compositions (a: 200, b: 300 TF/s): the advisor's kernel is "b", and under a window the
    best windowed kernel that masks by position."""
    table = {"NVIDIA X": {"one document": {"a": 400e12, "b": 300e12},
                          "log-uniform documents": {"a": 100e12, "b": 300e12},
                          "short documents": {"a": 100e12, "b": 300e12},
                          "window": {"a": 900e12, "b": 100e12, "flex": 50e12}}}
    monkeypatch.setattr(measured, "recorded", lambda: table)
    measured._throughputs.cache_clear()
    try:
        assert advise.cuda_kernel(advise.kernel_table("NVIDIA X")) == "b"
        assert advise.cuda_kernel(advise.kernel_table("NVIDIA X"), windowed=True) == "flex"  # a, b: no such kernels
    finally:
        measured._throughputs.cache_clear()


def test_valid_meshes_keep_ulysses_in_a_node_and_split_the_heads():
    assert [(o.ulysses, o.ring) for o in advise.mesh_options(16, 8, 32, 4, ["balanced"])] == [
        (1, 16), (2, 8), (4, 4), (8, 2)]  # 4 KV heads over 8 ranks: repeated
    assert [(o.ulysses, o.ring) for o in advise.mesh_options(16, 8, 24, 3, ["zigzag"])] == [(1, 16)]
    assert [(o.ulysses, o.ring) for o in advise.mesh_options(12, 4, 32, 8, ["balanced"])] == [
        (1, 12), (2, 6), (4, 3)]  # not 3 (heads) nor 6, 12 (beyond a node of 4)
    # 24/6 heads split over 3 and 6, but a group of 3 or 6 would straddle nodes of 8
    assert [(o.ulysses, o.ring) for o in advise.mesh_options(12, 8, 24, 6, ["balanced"])] == [(1, 12), (2, 6)]
    assert [o.placement for o in advise.mesh_options(2, 8, 32, 8)] == [*PLACEMENTS] * 2  # every placement


def test_block_pairs_sum_to_each_ranks_causal_work():
    """The per-step pairs, summed, equal layout.attention_work (written independently)."""
    lengths = log_uniform_lengths(40000, 16, 9000, seed=3) + [0, 1, 7]
    cu = advise.cu_seqlens_of(lengths)
    for ulysses, ring, placement in [(2, 2, "balanced"), (1, 4, "zigzag"), (2, 3, "balanced"), (4, 1, "zigzag")]:
        batch = layout.batch_layout(cu, ulysses, ring, placement_rule(placement))
        work = advise.block_work(batch)
        total = work.local + work.steps.sum(1, keepdim=True)
        # attention_work divides by A in float32: equal to its precision
        torch.testing.assert_close(total, layout.attention_work(batch).double(), rtol=2e-7, atol=0)


def enumerated_work(batch: layout.BatchLayout, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local [R, A], steps [R, R])`` by enumerating every visible pair of every document on
    the ranks the layout gives it (the two chunks of its pair ``(r - turn) mod R`` of a RING
    document, adjacent or zigzag as the layout holds them, at their positions)."""
    ring, ulysses = batch.ring, batch.ulysses
    local, steps = torch.zeros(ring, ulysses, dtype=torch.float64), torch.zeros(ring, ring, dtype=torch.float64)

    def pairs(queries, keys) -> int:
        return sum(1 for q in queries for k in keys if 0 <= q - k and (window < 0 or q - k <= window))

    for kind, length, r, a, chunk, turn in zip(batch.kind.tolist(), batch.lengths.tolist(), batch.ring_rank.tolist(),
                                               batch.ulysses_rank.tolist(), batch.chunk.tolist(), batch.turn.tolist()):
        if length == 0:
            continue
        if kind == layout.Kind.LOCAL:
            local[r, a] += pairs(range(length), range(length))
        elif kind == layout.Kind.GROUP:
            steps[r, 0] += pairs(range(length), range(length)) / ulysses
        else:
            def held(rank):
                q = (rank - turn) % ring
                chunks = (2 * q, 2 * q + 1) if batch.adjacent else (q, 2 * ring - 1 - q)
                return [p for c in chunks for p in range(c * chunk, (c + 1) * chunk) if p < length]
            for rank in range(ring):
                for step in range(ring):
                    steps[rank, step] += pairs(held(rank), held((rank - step) % ring)) / ulysses
    return local, steps


@pytest.mark.parametrize("window, laid_out_for_it", [(-1, False), (0, False), (3, False), (11, False),
                                                    (0, True), (3, True), (11, True)])
def test_block_pairs_under_a_window_match_an_enumeration(window, laid_out_for_it):
    """Also for a batch laid out for its window (``shard_plan(..., window=)``: turned pairs,
    adjacent where even enough), whose schedule ends where the window does: no visible pair
    in the steps it leaves out."""
    cu = advise.cu_seqlens_of([0, 1, 7, 13, 29, 5, 40, 2, 17])
    pairings = set()
    for ulysses, ring, placement in [(2, 2, "balanced"), (1, 3, "zigzag"), (2, 1, "balanced"), (1, 4, "zigzag")]:
        batch = layout.batch_layout(cu, ulysses, ring, placement_rule(placement), window if laid_out_for_it else -1)
        pairings.add(batch.adjacent)
        work = advise.block_work(batch, window)
        local, steps = enumerated_work(batch, window)
        scheduled = work.steps.shape[1]
        assert scheduled == layout.window_steps(batch, window)
        torch.testing.assert_close(work.local, local, rtol=0, atol=1e-9)
        torch.testing.assert_close(work.steps, steps[:, :scheduled], rtol=0, atol=1e-9)
        assert not steps[:, scheduled:].any()
    assert (True in pairings) if laid_out_for_it else pairings == {False}


def test_visible_pairs_count_every_pair_in_the_window():
    for q0, nq, k0, nk, window in [(5, 4, 0, 3, 4), (0, 6, 0, 6, -1), (0, 6, 0, 6, 0), (10, 3, 2, 9, 5), (0, 3, 7, 4, 9)]:
        expected = sum(1 for q in range(q0, q0 + nq) for k in range(k0, k0 + nk)
                       if 0 <= q - k and (window < 0 or q - k <= window))
        got = advise.visible_pairs(*(torch.tensor([x]) for x in (q0, nq, k0, nk)), window)
        assert int(got) == expected, (q0, nq, k0, nk, window)


def test_a_window_under_cp_takes_the_fastest_kernel_that_masks_by_position_where_a_ring_needs_it(monkeypatch):
    windowed = {name: value for name, value in H200["window"].items() if KERNELS[name].masks_by_position}
    assert advise.cuda_kernel(advise.kernel_table("NVIDIA H200"), windowed=True) \
        == max(windowed, key=windowed.__getitem__) == max(H200["window"], key=H200["window"].__getitem__) == "cudnn"
    batch = advise.cu_seqlens_of([3000, 900, 5000, 131])
    # a fastest kernel that masks by offsets only (as cudnn did before it cut a window by
    # position into pieces) is taken without a ring, never on one
    monkeypatch.setattr(KERNELS["cudnn"], "masks_by_position", False)
    assert advise.cuda_kernel(advise.kernel_table("NVIDIA H200"), windowed=True) == "flex"
    assert advise.cuda_kernel(advise.kernel_table("NVIDIA H200"), windowed=True, by_position=False) == "cudnn"
    advice = advise.advise(batch, world=2, gpus_per_node=8, heads_q=32, heads_kv=8, head_dim=128, window=1024)
    assert prediction(advice, 2, 1, "balanced").kernel == "cudnn"
    assert prediction(advice, 1, 2, "balanced").kernel == "flex"
    whole = advise.advise(batch, world=2, gpus_per_node=8, heads_q=32, heads_kv=8, head_dim=128, kernel="flex")
    assert prediction(advice, 2, 1, "balanced").compute_s < prediction(whole, 2, 1, "balanced").compute_s
    named = advise.advise(batch, world=2, gpus_per_node=8, heads_q=32, heads_kv=8, head_dim=128, kernel="cudnn",
                          window=1024)
    assert {(p.ring, p.kernel) for p in named.predictions} == {(1, "cudnn")}  # the ring cannot run it
    with pytest.raises(InputError, match="kernel: 'cudnn' cannot mask a window by positions"):
        advise.advise(advise.cu_seqlens_of([3000, 900]), world=2, gpus_per_node=1, heads_q=32, heads_kv=8,
                      head_dim=128, kernel="cudnn", window=1024)


def test_rank_sizes_match_the_prepared_batch():
    cu = advise.cu_seqlens_of(log_uniform_lengths(30000, 16, 6000, seed=5))
    for ulysses, ring, placement in [(2, 2, "balanced"), (1, 3, "zigzag"), (3, 2, "balanced")]:
        prepared = prepare_batch(cu, ulysses=ulysses, ring=ring, placement=placement, rank=0)
        for r in range(ring):
            for a in range(ulysses):
                assert advise.rank_sizes(prepared.layout, r, a) == prepared.rank_sizes(r, a)


def test_block_composition_judges_short_segments_short_first():
    assert advise.block_composition(0, 0) is None
    assert advise.block_composition(1, 2047) == "short documents"
    assert advise.block_composition(1, 2048) == "one document"
    assert advise.block_composition(5, 2048) == "log-uniform documents"
    assert advise.block_composition(5, 100) == "short documents"


def test_ring_forward_hides_each_hop_behind_the_step_before():
    # steps 3, 1, 2 with hops of 2: max(3, 2) + max(1, 2) + 2
    assert advise.ring_forward([3.0, 1.0, 2.0], 2.0) == 7.0
    assert advise.ring_forward([3.0], 2.0) == 3.0


def test_ring_backward_carries_kv_and_dkv_and_exposes_the_last_hop():
    hops = HopTimes(backward_kv=1.0, backward_dkv=1.5, last_dkv=0.5)
    # step 0: the KV hop (1); step 1: KV + dKV (2.5); step 2: the dKV hop (1.5); + last 0.5
    assert advise.ring_backward([3.0, 1.0, 2.0], hops) == 3.0 + 2.5 + 2.0 + 0.5
    assert advise.ring_backward([3.0], hops) == 3.0


def test_pipeline_hides_the_next_groups_exchange_behind_a_ring():
    # group 0 in: 0..2 (local 0..1); group 1 in: 2..4; ring 0: 2..5; out 0: 5..6;
    # ring 1: 5..8; out 1: 8..9
    assert advise.pipeline(1.0, 2.0, [3.0, 3.0], 1.0) == 9.0
    # one group: in 0..2, ring 2..5, out 5..6
    assert advise.pipeline(1.0, 2.0, [3.0], 1.0) == 6.0
    # a local region longer than the exchange hides it
    assert advise.pipeline(4.0, 2.0, [3.0], 1.0) == 8.0
    # group 0 in 0..1 under the local region 0..3; group 1 in issued at 3: 3..4; ring 0
    # 3..3.5; out 0 waits for the link: 4..5; ring 1 waits for its exchange: 4..4.5; out 1 5..6
    assert advise.pipeline(3.0, 1.0, [0.5, 0.5], 1.0) == 6.0


def test_exchange_bytes_split_what_goes_before_and_after_the_ring():
    sizes = layout.RankSizes(100, 10, (50, 70, 30), 0, 1, 0, (0,))
    call = CallShape(12, 6, 8, torch.bfloat16)  # per rank 4 q and 2 kv heads, one group: 2 KV
    forward_in, forward_out, backward_in, backward_out = advise.exchange_bytes(sizes, call, 3, 1)
    assert forward_in == 70 * (4 + 4) * 8 * 2 * 2  # own tokens, the other 2 ranks' heads
    assert forward_out == (50 + 30) * 4 * 8 * 2
    assert backward_in == 70 * 8 * 8 * 2 * 2  # dout and out
    assert backward_out == (50 + 30) * (4 + 4) * 8 * 2


def test_hop_times_from_the_ring_schemes_bytes():
    """4 ring steps, a section of 10 tokens x 2 KV heads x 8 in bf16 (320 bytes), two head
    groups of one KV head each: a group's forward hop 160 bytes, its middle dKV hops fp32."""
    sizes = layout.RankSizes(10, 0, (10, 10), 20, 0, 0, (1, 1, 1, 1))
    call = CallShape(4, 4, 8, torch.bfloat16)
    links = Links(network_bytes_per_s=100.0, network_latency_s=1.0)
    hops = advise.hop_times(sizes, call, 2, 4, "network", links, groups=2)
    section = 20 * 2 * 1 * 8  # elements of one group's section (W = 20 tokens)
    assert hops.forward == section * 2 / 100 + 1
    assert hops.backward_kv == (section + 1) * 2 / 100 + 1
    # dKV hops 0..2: a block's own gradient (bf16), then two sums (fp32); hop 3 home in bf16
    assert hops.backward_dkv == pytest.approx((section * 2 + 2 * section * 4) / 3 / 100 + 1)
    assert hops.last_dkv == section * 2 / 100 + 1


def test_ring_link_is_the_network_once_the_mesh_spans_nodes():
    assert advise.ring_link(2, 4, 8) == "nvlink"
    assert advise.ring_link(1, 16, 8) == "network"
    assert advise.ring_link(8, 1, 8) == "-"


# --------------------------------------------------------------------------------------------
# the command and its errors
# --------------------------------------------------------------------------------------------

def test_command_prints_the_table_and_the_mesh_to_make(tmp_path):
    batch_file = tmp_path / "lengths.txt"
    batch_file.write_text("32768\n16384 16384\n")
    out = advise.main(["--world", "16", "--lengths", str(batch_file), "--kernel", "dense"])
    expected = advise.advise([advise.cu_seqlens_of([32768]), advise.cu_seqlens_of([16384, 16384])],
                             world=16, gpus_per_node=8, heads_q=32, heads_kv=8, head_dim=D,
                             kernel="dense")
    best = expected.best
    assert f"make_mesh(ulysses={best.ulysses}, ring={best.ring})" in out
    assert f"{best.step_s * 1e3:.2f}" in out.splitlines()[2]  # the first row is the best
    assert "2 batch(es)" in out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    splits = 4  # 16 x 1 does not fit in a node of 8
    assert len(rows) == 1 + splits * len(PLACEMENTS) and [name.strip() for name in rows[0].split("|")[1:-1]] == [
        "split", "placement", "ms per call", "vs best", "exposed ms", "efficiency", "balance"]
    assert max(len(line) for line in out.splitlines()) <= 100  # the table and its prose
    # every part, with --verbose: 18 columns
    verbose = advise.main(["--world", "16", "--lengths", str(batch_file), "--kernel", "dense", "--verbose"])
    assert [len(line.split("|")) - 2 for line in verbose.splitlines() if line.startswith("| ")] == [18] * len(rows)


def test_command_names_every_split_it_leaves_out():
    """--heads 12/4 on 16 GPUs, 8 a node: 8 x 2 cannot split the query heads, 16 x 1 does not fit
    in a node; each is named, with why, beside the splits predicted."""
    out = advise.main(["--world", "16", "--heads", "12/4", "--tokens", "65536"])
    assert [line for line in out.splitlines() if line.startswith("left out")] == [
        "left out 8 x 2: ulysses 8 does not divide the 12 query heads",
        "left out 16 x 1: a Ulysses group of 16 GPUs does not fit evenly in a node of 8 (--gpus-per-node)"]
    splits = {line.split("|")[1].strip() for line in out.splitlines()[2:] if line.startswith("| ")}
    assert splits == {"1 x 16", "2 x 8", "4 x 4"}
    # a kernel that cannot mask a window on a ring leaves out every split with one
    windowed = advise.advise(advise.cu_seqlens_of([8192]), world=4, gpus_per_node=4, heads_q=32, heads_kv=8,
                             head_dim=D, kernel="flash", window=1024)
    assert windowed.left_out == tuple(
        (a, 4 // a, f"kernel 'flash' cannot mask the window by positions in the document, as a ring of "
                    f"{4 // a} ranks needs") for a in (1, 2))


def test_loguniform_batches_are_seeded_draws_of_the_tokens():
    cus = advise.batches_from("loguniform:256:32768", 131072, 2, seed=0)
    assert len(cus) == 2 and all(int(cu[-1]) == 131072 for cu in cus)
    lengths = cus[0].diff()
    assert int(lengths.min()) >= 1 and int(lengths[:-1].min()) >= 256 and int(lengths.max()) <= 32768
    assert not torch.equal(cus[0], cus[1])


@pytest.mark.parametrize("kwargs, argument", [
    ({"world": 0}, "world: expected a positive int"),
    ({"heads_kv": 5}, "heads: 32 query heads are not a multiple of 5"),
    ({"kernel": "nope"}, "kernel: 'nope' was not measured"),
    ({"device_kind": "TPU"}, "device_kind: no measurements for 'TPU'"),
    ({"placements": ["ring"]}, "placements: expected names of"),
    ({"batches": []}, "batches: expected a cu_seqlens"),
    ({"batches": torch.tensor([1, 4], dtype=torch.int32)}, "batches[0]: expected a 1-D cu_seqlens"),
])
def test_errors_name_the_bad_argument(kwargs, argument):
    call = {"batches": advise.cu_seqlens_of([100]), "world": 4, "gpus_per_node": 8,
            "heads_q": 32, "heads_kv": 8, "head_dim": D, **kwargs}
    with pytest.raises(InputError) as error:
        advise.advise(call.pop("batches"), **call)
    assert str(error.value).startswith(argument)


def test_command_errors_name_the_argument():
    with pytest.raises(InputError, match="^lengths: expected 'one'"):
        advise.main(["--world", "4", "--lengths", "/no/such/file"])
    with pytest.raises(InputError, match="^heads: expected HQ/HKV"):
        advise.main(["--world", "4", "--heads", "32"])


def test_the_runtime_never_imports_the_advisor():
    """The advisor is a tool beside the runtime: importing the library, its backend and its
    passes loads no module of ``hcp_advise``."""
    script = ("import sys, hcp_compile, hcp_compile.compiled.backend, hcp_compile.passes.hierarchical_cp\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'hcp_advise'))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
