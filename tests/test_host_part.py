"""The advisor's host part: the call counts (and those before a phase's first kernel) against a
real eager call, the fit of benchmarks/host_times.py, the rule by which the GPU waits for the
host's launches, the record's loader, and the measuring command on CPU."""

import json

import pytest
import torch
from hcp_compile.testing.worlds import fake_world

import hcp_advise as advise
import hcp_compile as hc
from hcp_advise import HostCounts, PhaseTimes, cu_seqlens_of, host_counts, host_measured, rank_sizes
from hcp_advise.host_measured import HostConstants, HostRecord
from hcp_compile import InputError, hierarchical
from hcp_compile.batch import layout
from hcp_compile.batch.placements import placement_rule
from hcp_compile.kernels import KERNELS, cudnn

from benchmarks import host_times

HEADS_Q, HEADS_KV, HEAD_DIM = 8, 4, 8


class CountingKernel:
    """The torch kernel, counting per direction the blocks it gets, those with queries and
    keys, and the cuDNN calls the same specs would take (``cudnn.call_masks``)."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.counts = {d: {"ops": 0, "blocks": 0, "cudnn": 0} for d in ("forward", "backward")}
        # per direction, the first block with queries and keys: (the local region's?, its cuDNN calls)
        self.first = {}

    def supports(self, request):
        return self.inner.supports(request)

    def _count(self, direction, q, k, spec):
        counts = self.counts[direction]
        counts["ops"] += 1
        if q.shape[0] and k.shape[0]:
            counts["blocks"] += 1
            counts["cudnn"] += len(cudnn.call_masks(spec))
            # the local region's spec says which rows its segments cover; a ring step's does not
            self.first.setdefault(direction, (spec.covered_rows >= 0, len(cudnn.call_masks(spec))))

    def forward(self, q, k, v, spec):
        self._count("forward", q, k, spec)
        return self.inner.forward(q, k, v, spec)

    def backward(self, dout, q, k, v, out, lse, spec):
        self._count("backward", q, k, spec)
        return self.inner.backward(dout, q, k, v, out, lse, spec)


def short(tokens, size):
    return (size,) * (tokens // size)


CASES = [  # (lengths, ulysses, ring, rank)
    ((256,), 1, 2, 1),  # one document: every step, no local region
    ((256,), 2, 2, 0),  # two head groups
    (short(512, 8), 2, 4, 0),  # short documents: the local region alone, no collective (no head group)
    ((256,) + short(256, 8), 2, 4, 7),  # a mix
    ((96, 40) + short(120, 8), 4, 2, 5),  # a ring document, a straddling one; one head group
]


@pytest.mark.parametrize("lengths, ulysses, ring, rank", CASES)
def test_counts_match_the_kernel_calls_of_a_real_eager_call(monkeypatch, lengths, ulysses, ring, rank):
    counting = CountingKernel(KERNELS["torch"])
    monkeypatch.setitem(KERNELS, "torch", counting)
    rings = []
    real_ring = hierarchical.ring_forward
    monkeypatch.setattr(hierarchical, "ring_forward", lambda *a: rings.append(1) or real_ring(*a))
    cu = cu_seqlens_of(lengths)
    with fake_world(ulysses, ring, rank) as mesh:
        plan = hc.shard_plan(cu, mesh)
        tokens = sum(lengths)
        qkv = [torch.randn(tokens, h, HEAD_DIM) for h in (HEADS_Q, HEADS_KV, HEADS_KV)]
        local = [plan.shard(t).requires_grad_() for t in qkv]
        with hc.context_parallel(mesh, kernel="torch"):
            out = hc.varlen_attention(*local, cu, cu, max(lengths), max(lengths), causal=True)
            out.sum().backward()
    batch = layout.batch_layout(cu, ulysses, ring, placement_rule("balanced"))
    sizes = rank_sizes(batch, rank // ulysses, rank % ulysses)
    as_cudnn = host_counts(sizes, rank // ulysses, ring, "cudnn", HEADS_KV)
    as_torch = host_counts(sizes, rank // ulysses, ring, "torch", HEADS_KV)
    assert len(rings) == as_cudnn.groups
    for direction in ("forward", "backward"):
        seen = counting.counts[direction]
        assert seen["ops"] == 1 + as_cudnn.steps  # the local region's op and every step's
        assert seen["blocks"] == as_torch.calls
        assert seen["cudnn"] == as_cudnn.calls
    assert as_cudnn.calls > 0
    # before each phase's first kernel: the first block's calls, and a ring-step iteration
    # where that block is the own step rather than the local region; one head group's exchange
    # where the call has any
    lead = advise.lead_counts(sizes, rank // ulysses, ring, "cudnn", HEADS_KV)
    for direction in ("forward", "backward"):
        local_first, calls = counting.first[direction]
        assert (lead.calls, lead.steps, lead.groups) == (calls, 0 if local_first else 1, min(1, as_cudnn.groups))


def test_cudnn_splits_a_causal_block_of_more_keys_than_queries_into_two_calls():
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    spec = hc.kernels.BlockSpec(cu_q, cu_k, 4, 4, True, 1.0)
    assert len(cudnn.call_masks(spec)) == 2
    assert advise.kernel_calls("cudnn", layout.StepKind.DIAGONAL) == 1  # equal lengths: one top-left call
    assert advise.kernel_calls("cudnn", layout.StepKind.LOWER) == 1  # not causal
    assert advise.kernel_calls("cudnn", None) == 1  # the local region: one segmentation
    assert advise.kernel_calls("flex", layout.StepKind.DIAGONAL) == 1


COUNTS = [HostCounts(c, s, g) for c, s, g in [(1, 1, 1), (2, 2, 1), (4, 4, 2), (1, 2, 2), (9, 8, 2), (3, 2, 1),
                                             (8, 8, 1), (5, 4, 2)]]


def synthetic(constants, counts):
    return [host_times.predicted_ms(constants, c) / 1e3 for c in counts]


def test_the_fit_recovers_known_constants():
    known = HostConstants(3e-3, 5e-4, 2e-4, 1e-3)
    got = host_times.fit(COUNTS, synthetic(known, COUNTS))
    for name in host_measured.COEFFICIENTS:
        assert getattr(got, name) == pytest.approx(getattr(known, name), rel=1e-6, abs=1e-12)
    # a constant the times do not need is 0, not negative
    no_groups = HostConstants(1e-3, 4e-4, 0.0, 0.0)
    noisy = [t * (1 + 0.01 * (-1) ** i) for i, t in enumerate(synthetic(no_groups, COUNTS))]
    got = host_times.fit(COUNTS, noisy)
    assert min(getattr(got, n) for n in host_measured.COEFFICIENTS) >= 0
    assert got.per_call_s + got.per_step_s == pytest.approx(4e-4, rel=0.1)
    with pytest.raises(InputError, match="fit"):
        host_times.fit(COUNTS, [1.0])


def test_the_gpu_waits_for_the_hosts_launches():
    """One call issued alone: the host issues the forward, then at once the backward; the GPU
    runs each phase once the host has issued its first kernel, and ends a phase no sooner than
    the host has issued its last block and the GPU has run it."""
    step = advise.step_with_host
    # no lead, no tail: a host-bound forward (5) then the backward's GPU (3)
    assert step(PhaseTimes(2.0, 3.0), PhaseTimes(5.0, 1.0)) == 5.0 + 3.0
    # the backward's host (1..5) runs under the forward's GPU (0..2); the GPU is done at 5 too
    assert step(PhaseTimes(2.0, 3.0), PhaseTimes(1.0, 4.0)) == 5.0
    assert step(PhaseTimes(2.0, 3.0), PhaseTimes()) == 5.0  # not modelled: the GPU's
    # one kernel per phase, issued at the end of its host work (lead = host, tail = the kernel):
    # forward host 0..0.75, kernel 0.75..1.25; backward host 0.75..1.75, kernel 1.75..3.25
    one = (PhaseTimes(0.5, 1.5), PhaseTimes(0.75, 1.0), PhaseTimes(0.75, 1.0), PhaseTimes(0.5, 1.5))
    assert step(*one) == 3.25
    # a lead and a tail: forward GPU 0.5..2.5 (its host until 1, its last block 1..1.5);
    # backward GPU from 2.5 (its first kernel issued at 1 + 1) to 5.5, but its host issues its
    # last block at 5, which runs 5..7
    assert step(PhaseTimes(2.0, 3.0), PhaseTimes(1.0, 4.0), PhaseTimes(0.5, 1.0), PhaseTimes(0.5, 2.0)) == 7.0
    # predict_rank: forward local 1 + step 1 (GPU 0..2, its last block issued at 5: ends 6),
    # backward local 2 + step 2 (GPU 6..10): 10, of which 4 the host's
    compute = advise.ComputeTimes(1.0, 2.0, (1.0,), (2.0,))
    assert advise.predict_rank(compute, advise.ExchangeTimes(), advise.HopTimes(), 1, PhaseTimes(5.0, 1.0)) \
        == (10.0, 0.0, 0.0, 4.0)
    record = HostRecord(HostConstants(1e-3, 1e-4, 2e-4, 3e-4), HostConstants(2e-3, 0.0, 0.0, 0.0))
    assert advise.host_times(HostCounts(2, 3, 1), record) == PhaseTimes(pytest.approx(2.1e-3), 2e-3)
    assert advise.host_times(HostCounts(2, 3, 1), None) == PhaseTimes()


def test_the_advisor_bounds_its_steps_by_the_host_where_measured(monkeypatch):
    batch = cu_seqlens_of(short(65536, 1024))
    options = dict(world=8, gpus_per_node=8, heads_q=32, heads_kv=8, head_dim=128)
    monkeypatch.setattr(host_measured, "find", lambda *key: None)  # a device without a record
    without = advise.advise(batch, **options)
    assert not without.host_modelled and all(p.host_s == 0 and p.host_wait_s == 0 for p in without.predictions)
    assert "host part not modelled" in advise.format_advice(without)
    slow = HostConstants(0.05, 0.0, 0.0, 0.0)  # 50 ms a phase: every option host-bound
    monkeypatch.setattr(host_measured, "find", lambda *key: HostRecord(slow, slow))
    bound = advise.advise(batch, **options)
    assert bound.host_modelled and "host part: hcp-eager" in advise.format_advice(bound)
    for p in bound.predictions:
        assert p.host_s == pytest.approx(0.1) and p.step_s > 0.1
        assert p.host_wait_s == pytest.approx(p.step_s - p.compute_s - p.passes_s - p.exposed_s)
        if p.placement == "balanced":
            # every document whole on its rank (no exchange, no passes): one local block per
            # phase, issued 50 ms into it; the backward's (5/7 of the compute) after both
            # phases' host work
            assert p.step_s == pytest.approx(0.1 + p.compute_s * 5 / 7)
            assert p.passes_s == 0 and p.exposed_s == 0
    with pytest.raises(InputError, match="mode"):
        advise.advise(batch, **options, mode="hcp-compiled")


GOOD = {"forward": {n: 1e-4 for n in host_measured.COEFFICIENTS},
        "backward": {n: 2e-4 for n in host_measured.COEFFICIENTS}}


@pytest.mark.parametrize("devices, message", [
    ({"H": {"date": "x"}}, r"devices\['H'\] has no 'modes'.*benchmarks.host_times"),
    ({"H": {"modes": {"hcp-eager": {"cudnn": {"forward": GOOD["forward"]}}}}}, "no 'backward' constants"),
    ({"H": {"modes": {"hcp-eager": {"cudnn": {**GOOD, "forward": {**GOOD["forward"], "per_call_s": "1"}}}}}},
     r"forward\.per_call_s: expected a finite number"),
    ([], "expected 'devices' to be an object"),
])
def test_the_loader_names_what_is_missing(tmp_path, devices, message):
    path = tmp_path / "host.json"
    path.write_text(json.dumps({"devices": devices}))
    with pytest.raises(InputError, match=message):
        host_measured.recorded(path)


def test_the_loader_reads_a_record_and_says_how_to_add_a_missing_one(tmp_path):
    path = tmp_path / "host.json"
    path.write_text(json.dumps({"devices": {"H": {"date": "x", "modes": {"hcp-eager": {"cudnn": GOOD}}}}}))
    assert host_measured.recorded(path)["H"]["hcp-eager"]["cudnn"].backward.floor_s == 2e-4
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(InputError, match="could not read"):
        host_measured.recorded(tmp_path / "broken.json")
    assert host_measured.find("no such device", "hcp-eager", "cudnn") is None
    with pytest.raises(InputError, match="no host times for kernel 'cudnn'.*--record"):
        host_measured.host_record("no such device", "hcp-eager", "cudnn")


def test_the_measuring_command_runs_on_cpu_and_its_record_reads_back(tmp_path, monkeypatch):
    out = tmp_path / "host.json"
    host_times.main(["--device", "cpu", "--kernels", "torch", "--meshes", "1x2,2x1", "--ranks", "0",
                     "--head-dim", "16", "--dtype", "float32", "--rank-tokens", "16", "--warmup", "0",
                     "--iters", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    points = result["points"]
    assert len(points) == 6 and all(p["forward_ms"] > 0 and p["backward_ms"] > 0 for p in points)
    # the short documents of 1 x 2 stay local: the local region's call only, nothing exchanged
    short_1x2 = next(p for p in points if p["mesh"] == "1x2" and p["batch"] == "short documents")
    assert (short_1x2["calls"], short_1x2["steps"], short_1x2["groups"]) == (1, 0, 0)
    into = tmp_path / "host_measured.json"
    into.write_text(json.dumps({"devices": {"NVIDIA H200": {"modes": {"hcp-eager": {"cudnn": GOOD}}}}}))
    host_times.record(out, into)
    recorded = host_measured.recorded(into)
    assert set(recorded) == {"NVIDIA H200", "cpu"} and set(recorded["cpu"]["hcp-eager"]) == {"torch"}
    assert recorded["NVIDIA H200"]["hcp-eager"]["cudnn"].forward.floor_s == 1e-4  # kept


def test_a_record_for_another_kernel_keeps_the_setup_of_the_kernels_it_keeps(tmp_path):
    """Recording flex beside cudnn's constants: both kernels' setups stay said; recording
    cudnn again over the only kernel there replaces the setup."""
    into, flex, cudnn = tmp_path / "host_measured.json", tmp_path / "flex.json", tmp_path / "cudnn.json"
    into.write_text(json.dumps({"devices": {"H": {"setup": "nine meshes", "modes": {"hcp-eager": {"cudnn": GOOD}}}}}))
    flex.write_text(json.dumps({"devices": {"H": {"setup": "six meshes", "modes": {"hcp-eager": {"flex": GOOD}}}}}))
    host_times.record(flex, into)
    entry = json.loads(into.read_text())["devices"]["H"]
    assert entry["setup"] == "nine meshes; flex: six meshes"
    assert set(entry["modes"]["hcp-eager"]) == {"cudnn", "flex"}
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps({"devices": {"H": {"setup": "nine meshes", "modes": {"hcp-eager": {"cudnn": GOOD}}}}}))
    cudnn.write_text(json.dumps({"devices": {"H": {"setup": "again", "modes": {"hcp-eager": {"cudnn": GOOD}}}}}))
    host_times.record(cudnn, alone)
    assert json.loads(alone.read_text())["devices"]["H"]["setup"] == "again"
