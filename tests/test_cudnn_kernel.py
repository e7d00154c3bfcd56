"""The cuDNN ragged kernel (kernels/cudnn.py): its trimming of rows that see no key and its
buckets on any machine; without the nvidia-cudnn-frontend package, that it is never chosen
and says what to install; with it, on CUDA, against the float64 reference in bf16 (edge
batches, GQA, windows, blocks with more keys than queries or more queries than keys, the
backward given merged results) and that one graph pair serves batches of a bucket."""

from __future__ import annotations

import dataclasses
import random
from unittest import mock

import pytest
import torch

import hcp_compile as hc
from hcp_compile.testing.reference import reference_with_grads
from checks import assert_matches, expected_for, local_rows
from cp_cases import AttentionCase, World, cu_seqlens, seeded
from hcp_compile.kernels import KERNELS, BlockRequest, BlockSpec, cudnn, measured, new_cache_key, resolve_kernel, \
    run_backward, run_forward
from hcp_compile.batch.prepared import host_values
from hcp_compile.batch.prepared import MeshShape
from hcp_compile.kernels.contract import HOST_READS
from hcp_compile.kernels.cudnn import block_calls
from hcp_compile.kernels.merge import merge_partials
from test_dense_kernel import check_second_halves
from test_prepared_batch import CP_DOCS, CP_SHAPES, mesh_id, schedule_blocks
from test_window_pieces import ring_step_blocks

HAS_FRONTEND = cudnn.frontend()[0] is not None
needs_cudnn = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_FRONTEND),
                                 reason="needs a CUDA device and the nvidia-cudnn-frontend package")


def visible_rows(len_q: int, len_k: int, causal: bool, window: tuple[int, int]) -> list[bool]:
    """Per query row of a segment, whether it sees a key (bottom-right alignment), by brute
    force over the keys."""
    left, right = window
    if causal:
        right = 0
    seen = []
    for j in range(len_q):
        diagonal = j + len_k - len_q
        seen.append(any((right < 0 or key <= diagonal + right) and (left < 0 or key >= diagonal - left)
                        for key in range(len_k)))
    return seen


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0)), (False, (-1, 2))])
def test_entries_keep_exactly_the_rows_that_see_a_key(causal, window):
    rng = random.Random(f"{causal}{window}")
    for _ in range(50):
        len_q = [rng.choice([0, 1, 2, 5, 9]) for _ in range(rng.randint(1, 6))]
        len_k = [rng.choice([0, 1, 3, 5, 9]) for _ in len_q]
        cu_q, cu_k = cu_seqlens(tuple(len_q)), cu_seqlens(tuple(len_k))
        spec = BlockSpec(cu_q, cu_k, max(len_q), max(len_k), causal, 1.0, *window)
        entries = cudnn.bucket(len(len_q), 8)
        got = cudnn.ragged(spec, entries)
        kept = torch.zeros(int(cu_q[-1]), dtype=torch.bool)
        for i in range(entries):
            start, length = int(got.q_starts[i]), int(got.q_lengths[i])
            assert int(got.k_starts[i]) == (int(cu_k[i]) if i < len(len_q) else int(cu_k[-1]))
            assert int(got.k_lengths[i]) == (len_k[i] if i < len(len_q) else 0)
            if i >= len(len_q):
                assert length == 0
                continue
            # the kept rows are the segment's last ones
            assert start + length == int(cu_q[i + 1])
            kept[start:start + length] = True
        expected = [seen for lq, lk in zip(len_q, len_k) for seen in visible_rows(lq, lk, causal, window)]
        assert kept.tolist() == expected, (len_q, len_k)
        assert got.q_starts.tolist() == sorted(got.q_starts.tolist())


def test_buckets_cover_the_counts_with_bounded_waste():
    assert [cudnn.bucket(n, 64) for n in (0, 1, 64, 65, 179)] == [64, 64, 64, 128, 256]
    for rows in (1, 7, 8, 9, 1000, 131_071, 131_072, 131_073):
        bound = cudnn.row_bound(rows)
        assert rows <= bound <= rows * 1.125 + 1
    assert len({cudnn.row_bound(rows) for rows in range(65_537, 131_073)}) == 8


def test_mask_bounds_count_the_diagonal_in_the_left_bound():
    spec = lambda causal, window: BlockSpec(torch.zeros(2), torch.zeros(2), 1, 1, causal, 1.0, *window)  # noqa: E731
    assert cudnn.mask_bounds(spec(True, (-1, -1))) == (None, 0)
    assert cudnn.mask_bounds(spec(False, (-1, -1))) == (None, None)
    assert cudnn.mask_bounds(spec(True, (4096, 0))) == (4097, 0)


def cuda_request(window=(-1, -1), cp=False, head_dim=128) -> BlockRequest:
    q = torch.empty(1, 4, head_dim, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 2, head_dim, dtype=torch.bfloat16, device="meta")
    return dataclasses.replace(BlockRequest.of(q, k, window, window_by_position=cp), device=torch.device("cuda"))


@pytest.fixture
def cudnn_fastest(monkeypatch):
    """Measurements that rank cudnn first on a device kind "NVIDIA X", whose device check passes."""
    recorded = {"NVIDIA X": {"cudnn": 500e12, "dense": 480e12, "flash": 300e12}}
    monkeypatch.setattr(cudnn, "device_check", lambda device: None)
    monkeypatch.setattr(measured, "throughputs", lambda kind_of_call=None: recorded)
    monkeypatch.setattr(hc.kernels, "device_kind", lambda device: "NVIDIA X")


def test_without_the_package_auto_never_takes_it_and_naming_it_says_what_to_install(monkeypatch, cudnn_fastest):
    monkeypatch.setattr(cudnn, "frontend", lambda: (None, "needs the nvidia-cudnn-frontend package: pip install x"))
    assert resolve_kernel("auto", cuda_request()) == "dense"
    with pytest.raises(hc.InputError, match="kernel='cudnn' needs the nvidia-cudnn-frontend package: pip install x"):
        resolve_kernel("cudnn", cuda_request())


def test_with_the_package_auto_takes_it_where_it_was_measured_fastest(monkeypatch, cudnn_fastest):
    monkeypatch.setattr(cudnn, "frontend", lambda: (object(), None))
    assert resolve_kernel("auto", cuda_request()) == "cudnn"
    # what it cannot run goes elsewhere
    assert resolve_kernel("auto", cuda_request(head_dim=256)) != "cudnn"
    assert resolve_kernel("auto", cuda_request(window=(8, 0), cp=True)) == "cudnn"  # a ring's, in pieces
    assert resolve_kernel("auto", cuda_request(window=(-1, 8), cp=True)) != "cudnn"
    assert KERNELS["cudnn"].supports(cuda_request(window=(8, 3))).startswith("cannot apply a window")
    assert KERNELS["cudnn"].supports(cuda_request(window=(-1, 8), cp=True)) == cudnn._NO_WINDOW_BY_POSITION


# --------------------------------------------------------------------------------------------
# on CUDA with the package
# --------------------------------------------------------------------------------------------

EDGE_DOCS = [(700, 1, 300, 0, 129, 128, 1000, 5), (40, 1, 0, 40), (1, 1, 0, 1), (1, 0), (0, 0, 3), (2048, 2049)]
# on CPU the stand-in's float64 attention of two 2K documents takes seconds per mask; the rest
# cover its entries, trimming and buckets
STAND_IN_DOCS = [lengths for lengths in EDGE_DOCS if max(lengths) < 2048]
MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (100, 0))]


def bf16_inputs(name: str, tokens: int, heads_q: int, heads_kv: int, dim: int = 64) -> dict:
    return {n: seeded(f"{name}/{n}", tokens, h, dim).bfloat16()
            for n, h in (("q", heads_q), ("k", heads_kv), ("v", heads_kv), ("dout", heads_q))}


@needs_cudnn
@pytest.mark.gpu
@pytest.mark.parametrize("lengths", EDGE_DOCS, ids=str)
@pytest.mark.parametrize("causal, window", MASKS, ids=str)
@pytest.mark.parametrize("heads_kv", [8, 2], ids=["mha", "gqa"])
def test_cudnn_matches_reference_in_bf16(lengths, causal, window, heads_kv):
    x = bf16_inputs(f"cudnn-{lengths}-{causal}-{window}", sum(lengths), 8, heads_kv)
    cu = cu_seqlens(lengths)
    leaves = [x[n].cuda().requires_grad_() for n in "qkv"]
    longest = max(lengths)
    out, lse = torch.ops.hcp.varlen_attention(*leaves, cu.cuda(), cu.cuda(), longest, longest, causal, 64 ** -0.5,
                                              *window, "cudnn")
    out.backward(x["dout"].cuda())
    expected = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu.tolist(), cu.tolist(), causal=causal,
                                    window=window)
    got = {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}
    for name in ("out", "dq", "dk", "dv"):
        assert_matches(got[name].cpu(), expected[name], name, atol=3.5e-2, rtol=3.5e-2)
    assert torch.isfinite(lse).all()  # every row sees at least itself


# --------------------------------------------------------------------------------------------
# on CPU through a stand-in for cuDNN's ragged calls, and on CUDA with the package
# --------------------------------------------------------------------------------------------

class RaggedStandIn:
    """In place of ``cudnn.GRAPHS``: each call computes what cuDNN's ragged SDPA computes, per
    entry in float64 (the entry's rows at their offsets, its mask aligned top-left or
    bottom-right; the backward from the given out and stats), and refuses what cuDNN cannot
    take: a row of an entry that sees no key, a bottom-right band over more queries than keys,
    entries whose rows overlap, an entry longer than the graph's ``s_max``, a tensor without
    elements. ``calls`` records
    each call's mask and direction."""

    def __init__(self):
        self.calls: list[tuple[cudnn.Mask, bool]] = []
        self.rows: list[int] = []  # the query rows of each call

    def get(self, shape: cudnn.Shape, backward: bool) -> "RaggedStandIn.Call":
        return self.Call(self, shape, backward)

    class Call:
        def __init__(self, graphs: "RaggedStandIn", shape: cudnn.Shape, backward: bool):
            self.graphs, self.shape, self.backward = graphs, shape, backward
            # cuDNN's backward workspace: an fp32 dQ accumulator and, under GQA, fp32 dK and dV
            # per query head, over the packed rows
            per_row = shape.heads_q * shape.head_dim * 4
            self.workspace_bytes = 0 if not backward else shape.rows_q * per_row + (
                2 * shape.rows_k * per_row if shape.heads_q != shape.heads_kv else 0)

        def run(self, device: torch.device, t: dict[str, torch.Tensor]) -> None:
            self.graphs.calls.append((self.shape.mask, self.backward))
            self.graphs.rows.append(t["q"].shape[0])
            shape, mask = self.shape, self.shape.mask
            hq, hk, d = shape.heads_q, shape.heads_kv, shape.head_dim
            assert t["q"].shape[0] <= shape.rows_q and t["k"].shape[0] <= shape.rows_k, "more rows than the graph's bounds"
            assert all(x.numel() for x in t.values()), "a tensor without elements (cuDNN: a null pointer)"
            q_starts = (t["q_offsets"].flatten() // (hq * d)).tolist()
            k_starts = (t["k_offsets"].flatten() // (hk * d)).tolist()
            assert (t["stats_offsets"].flatten() // hq).tolist() == q_starts
            q_lengths, k_lengths = t["q_lengths"].flatten().tolist(), t["k_lengths"].flatten().tolist()
            assert len(q_lengths) == shape.entries and q_starts == sorted(q_starts)
            assert max(q_lengths + k_lengths) <= shape.segment_rows, "an entry longer than the graph's s_max"
            for i in range(shape.entries):
                assert q_starts[i] + q_lengths[i] <= q_starts[i + 1] and k_starts[i] + k_lengths[i] <= k_starts[i + 1]
                if q_lengths[i]:
                    self.entry(t, slice(q_starts[i], q_starts[i] + q_lengths[i]),
                               slice(k_starts[i], k_starts[i] + k_lengths[i]), mask, hq // hk)

        def entry(self, t: dict, rows: slice, keys: slice, mask: cudnn.Mask, group: int) -> None:
            lq, lk = rows.stop - rows.start, keys.stop - keys.start
            banded = mask.left is not None or mask.right is not None
            assert not (mask.bottom_right and banded and lq > lk), "a bottom-right band with more queries than keys"
            offset = lk - lq if mask.bottom_right else 0
            j, i = torch.arange(lq)[:, None] + offset, torch.arange(lk)[None, :]
            visible = torch.ones(lq, lk, dtype=torch.bool)
            if mask.right is not None:
                visible &= i <= j + mask.right
            if mask.left is not None:
                visible &= i > j - mask.left
            assert visible.any(1).all(), "a row of an entry sees no key"
            q = t["q"][rows].double().transpose(0, 1)
            k, v = (t[n][keys].double().repeat_interleave(group, 1).transpose(0, 1) for n in ("k", "v"))
            scores = (q @ k.transpose(1, 2) * self.shape.scale).masked_fill(~visible, float("-inf"))
            if not self.backward:
                lse = scores.logsumexp(-1)
                t["out"][rows] = (torch.softmax(scores, -1) @ v).transpose(0, 1).to(t["out"].dtype)
                t["stats"][rows] = lse.t().float()
                return
            lse = t["stats"][rows].t().double()[..., None]
            probs = torch.exp(scores - lse)
            dout, out = (t[n][rows].double().transpose(0, 1) for n in ("dout", "out"))
            dscores = probs * (dout @ v.transpose(1, 2) - (dout * out).sum(-1, keepdim=True))
            heads_kv = lambda g: g.unflatten(0, (-1, group)).sum(1).transpose(0, 1)  # noqa: E731
            t["dq"][rows] = (dscores @ k * self.shape.scale).transpose(0, 1).to(t["dq"].dtype)
            t["dk"][keys] = heads_kv(dscores.transpose(1, 2) @ q * self.shape.scale).to(t["dk"].dtype)
            t["dv"][keys] = heads_kv(probs.transpose(1, 2) @ dout).to(t["dv"].dtype)


class PoisonedBuffers:
    """In place of ``cudnn.uninitialized``: buffers full of NaN, so that a row the kernel
    leaves unwritten shows in the result; ``taken`` counts them."""

    def __init__(self):
        self.taken = 0

    def __call__(self, shape, like, dtype=None):
        self.taken += 1
        return torch.full(shape, float("nan"), dtype=dtype or like.dtype, device=like.device)


@pytest.fixture(autouse=True)
def poisoned(monkeypatch) -> PoisonedBuffers:
    buffers = PoisonedBuffers()
    monkeypatch.setattr(cudnn, "uninitialized", buffers)
    return buffers


@pytest.fixture
def stand_in(monkeypatch) -> RaggedStandIn:
    graphs = RaggedStandIn()
    monkeypatch.setattr(cudnn, "GRAPHS", graphs)
    return graphs


DEVICES = [pytest.param("cpu", id="cpu-stand-in"),
           pytest.param("cuda", id="cuda", marks=[needs_cudnn, pytest.mark.gpu])]


def on(device: str, request: pytest.FixtureRequest) -> tuple[torch.device, torch.dtype, dict]:
    """The device, input dtype and tolerance of a test on ``device`` (CPU: the stand-in)."""
    if device == "cpu":
        request.getfixturevalue("stand_in")
        return torch.device("cpu"), torch.float32, {"atol": 1e-4, "rtol": 1e-4}
    return torch.device("cuda"), torch.bfloat16, {"atol": 3.5e-2, "rtol": 3.5e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [False, True], ids=["one-block", "two-blocks-merged"])
def test_more_keys_than_queries_and_merged_backward(device, split, request):
    """The ring's causal shape (queries of each document's second half against all its keys:
    a full rectangle and a causal square), as one block or as two merged blocks."""
    where, dtype, tolerance = on(device, request)
    check_second_halves((700, 1, 300, 0, 129, 128, 1000, 5), split, where, dtype, kernel="cudnn", **tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_more_queries_than_keys_matches_the_torch_kernel(device, causal, request):
    """Segments with more queries than keys (bottom-right: the first queries see none) and
    segments without keys, against the plain-PyTorch kernel in fp32 on the same values."""
    where, dtype, tolerance = on(device, request)
    len_q, len_k = (9, 300, 5, 0, 40), (3, 100, 0, 7, 40)
    cu_q, cu_k = cu_seqlens(len_q).to(where), cu_seqlens(len_k).to(where)
    q, dout = (seeded(f"more-queries/{n}", sum(len_q), 8, 64).to(where, dtype) for n in ("q", "dout"))
    k, v = (seeded(f"more-queries/{n}", sum(len_k), 2, 64).to(where, dtype) for n in ("k", "v"))
    spec = BlockSpec(cu_q, cu_k, max(len_q), max(len_k), causal, 0.125)
    out, lse = run_forward("cudnn", q, k, v, spec)
    grads = run_backward("cudnn", dout, q, k, v, out, lse, spec)
    wide = [t.float() for t in (q, k, v, dout)]
    out_ref, lse_ref = run_forward("torch", *wide[:3], spec)
    grads_ref = run_backward("torch", wide[3], *wide[:3], out.float(), lse, spec)
    assert_matches(out.float().cpu(), out_ref.cpu(), "out", **tolerance)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[finite], lse_ref[finite], **tolerance)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_matches(got.float().cpu(), ref.cpu(), name, **tolerance)


@pytest.mark.parametrize("lengths", STAND_IN_DOCS, ids=str)
@pytest.mark.parametrize("causal, window", MASKS, ids=str)
@pytest.mark.parametrize("pad_rows", [None, 0, 3], ids=["zeroed", "covered", "covered-then-pads"])
def test_stand_in_calls_match_reference(stand_in, poisoned, lengths, causal, window, pad_rows):
    """The edge batches on CPU: one top-left call per block (cu_q is cu_k), every row of every
    entry seeing a key (the stand-in refuses any other), against the float64 reference. Where
    the spec says which rows the segments cover (``covered_rows``), the outputs start
    uninitialized (here NaN) but for the ``pad_rows`` after them, which must come out as rows
    without keys (0, -inf, no gradient)."""
    tokens = sum(lengths) + (pad_rows or 0)
    x = {n: t.float() for n, t in bf16_inputs(f"stand-in-{lengths}-{causal}-{window}", tokens, 8, 2).items()}
    cu = cu_seqlens(lengths)
    spec = BlockSpec(cu, cu, max(lengths), max(lengths), causal, 64 ** -0.5, *window,
                     covered_rows=-1 if pad_rows is None else sum(lengths))
    kernel = KERNELS["cudnn"]
    out, lse = kernel.forward(x["q"], x["k"], x["v"], spec)
    dq, dk, dv = kernel.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, spec)
    documents = sum(lengths)
    expected = reference_with_grads(*(x[n][:documents] for n in ("q", "k", "v", "dout")), cu.tolist(), cu.tolist(),
                                    causal=causal, window=window)
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_matches(got[:documents], expected[name], name, atol=1e-4, rtol=1e-4)
        assert (got[documents:] == 0).all(), f"{name}: a pad row is not 0"
    assert torch.isneginf(lse[:, documents:]).all()
    assert {mask for mask, _ in stand_in.calls} == {cudnn.Mask(*cudnn.mask_bounds(spec), False)}
    assert poisoned.taken == (0 if pad_rows is None or not sum(lengths) else 5)  # out, lse; dq, dk, dv


def test_a_causal_block_with_its_own_key_segments_runs_two_top_left_calls(stand_in):
    """cuDNN's top-left diagonal skips masked tiles (the bottom-right one did not): a causal
    block whose keys are not its queries' ranges runs a full call and a top-left causal one;
    under a window it stays one bottom-right call; cu_q is cu_k: one top-left call."""
    cu_q, cu_k = cu_seqlens((3, 5)), cu_seqlens((6, 5))
    x = bf16_inputs("two-calls", 11, 4, 2)
    k, v = x["k"].float(), x["v"].float()
    for spec, expected in (
            (BlockSpec(cu_q, cu_k, 5, 6, True, 0.125), {cudnn.Mask(None, None, False), cudnn.Mask(None, 0, False)}),
            (BlockSpec(cu_q, cu_k, 5, 6, True, 0.125, 2, 0), {cudnn.Mask(3, 0, True)}),
            (BlockSpec(cu_k, cu_k, 6, 6, True, 0.125), {cudnn.Mask(None, 0, False)}),
            (BlockSpec(cu_q, cu_k, 5, 6, False, 0.125), {cudnn.Mask(None, None, False)})):
        stand_in.calls.clear()
        KERNELS["cudnn"].forward(x["q"][:int(spec.cu_q[-1])].float(), k, v, spec)
        assert {mask for mask, _ in stand_in.calls} == expected, spec


@pytest.mark.parametrize("device", DEVICES)
def test_the_own_ring_steps_shape_runs_one_top_left_call(device, request):
    """The own ring step's segments (per entry: none, real queries x as many real keys, pad
    queries x no keys, no queries x pad keys; ``equal_lengths``) as one top-left causal call,
    against the plain-PyTorch kernel (which aligns bottom-right) on the same values."""
    where, dtype, tolerance = on(device, request)
    parts_q, parts_k = (0, 5, 3, 0, 0, 300, 2, 0, 0, 1, 0, 0), (0, 5, 0, 3, 0, 300, 0, 2, 0, 1, 0, 0)
    cu_q, cu_k = cu_seqlens(parts_q).to(where), cu_seqlens(parts_k).to(where)
    q, dout = (seeded(f"own-step/{n}", sum(parts_q), 8, 64).to(where, dtype) for n in ("q", "dout"))
    k, v = (seeded(f"own-step/{n}", sum(parts_k), 2, 64).to(where, dtype) for n in ("k", "v"))
    spec = BlockSpec(cu_q, cu_k, 303, 302, True, 0.125, equal_lengths=True)
    out, lse = run_forward("cudnn", q, k, v, spec)
    grads = run_backward("cudnn", dout, q, k, v, out, lse, spec)
    if device == "cpu":
        stand_in = request.getfixturevalue("stand_in")
        assert [mask for mask, _ in stand_in.calls] == [cudnn.Mask(None, 0, False)] * 2  # forward, backward
    wide = [t.float() for t in (q, k, v, dout)]
    out_ref, lse_ref = run_forward("torch", *wide[:3], spec)
    grads_ref = run_backward("torch", wide[3], *wide[:3], out.float(), lse, spec)
    assert_matches(out.float().cpu(), out_ref.cpu(), "out", **tolerance)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    for name, got, ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_matches(got.float().cpu(), ref.cpu(), name, **tolerance)


def test_a_blocks_calls_are_derived_once_per_cache_key(stand_in, monkeypatch):
    """The layers and the backward of one batch ask for the same blocks: with a cache key the
    ragged entries are derived once; without one, per call."""
    derived = []
    monkeypatch.setattr(cudnn, "block_calls", lambda spec, entries: derived.append(spec) or block_calls(spec, entries))
    cu = cu_seqlens((3, 5, 0, 4))
    x = {n: t.float() for n, t in bf16_inputs("cached-calls", 12, 4, 2).items()}
    kernel = KERNELS["cudnn"]
    for cache_key, expected in ((new_cache_key(), 1), (-1, 4)):
        derived.clear()
        spec = BlockSpec(cu, cu, 5, 5, True, 0.125, cache_key=cache_key)
        for _ in range(2):  # two layers
            out, lse = kernel.forward(x["q"], x["k"], x["v"], spec)
            kernel.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, spec)
        assert len(derived) == expected


@needs_cudnn
@pytest.mark.gpu
def test_one_graph_pair_serves_new_batches_of_a_bucket():
    cudnn.GRAPHS.clear()
    rng = random.Random(0)
    for step in range(4):
        lengths = []
        while sum(lengths) < 8192 - 1024:  # up to 64 documents: one bucket
            lengths.append(rng.randint(128, 1024))
        lengths.append(8192 - sum(lengths))
        cu = cu_seqlens(tuple(lengths)).cuda()
        x = bf16_inputs(f"bucket-{step}", 8192, 8, 2)
        leaves = [x[n].cuda().requires_grad_() for n in "qkv"]
        longest = max(lengths)
        out, _ = torch.ops.hcp.varlen_attention(*leaves, cu, cu, longest, longest, True, 0.125, -1, -1, "cudnn")
        out.backward(x["dout"].cuda())
    assert len(cudnn.GRAPHS) == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ring, window", [(2, 40), (2, 300), (3, 150)])
def test_a_window_by_position_runs_in_pieces(device, ring, window, request):
    """Ring steps under a window by position (documents shorter and longer than the window,
    one longer than a chunk by more than it): bands and full pieces in place, tails on
    reversed copies, against the plain-PyTorch kernel in fp32 applying the window to the
    positions; the backward given the step's own out and lse."""
    where, dtype, tolerance = on(device, request)
    lengths = (300, 5, 129, 700, 100, 37)
    pieces_seen = set()
    for rank, source, spec, key_rows in ring_step_blocks(lengths, ring, window):
        spec = dataclasses.replace(spec, **{f.name: getattr(spec, f.name).to(where)
                                            for f in dataclasses.fields(spec) if isinstance(getattr(spec, f.name), torch.Tensor)})
        name = f"by-position-{ring}-{window}-{rank}-{source}"
        rows = spec.q_positions.shape[0]
        q, dout = (seeded(f"{name}/{n}", rows, 8, 64).to(where, dtype) for n in ("q", "dout"))
        k, v = (seeded(f"{name}/{n}", key_rows, 2, 64).to(where, dtype) for n in ("k", "v"))
        out, lse = run_forward("cudnn", q, k, v, spec)
        grads = run_backward("cudnn", dout, q, k, v, out, lse, spec)
        wide = [t.float() for t in (q, k, v, dout)]
        out_ref, lse_ref = run_forward("torch", *wide[:3], spec)
        grads_ref = run_backward("torch", wide[3], *wide[:3], out.float(), lse, spec)
        assert_matches(out.float().cpu(), out_ref.cpu(), f"{name} out", **tolerance)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)), name
        finite = torch.isfinite(lse_ref)
        torch.testing.assert_close(lse[finite], lse_ref[finite], **tolerance)
        for grad, got, expected in zip(("dq", "dk", "dv"), grads, grads_ref):
            assert_matches(got.float().cpu(), expected.cpu(), f"{name} {grad}", **tolerance)
        calls, tails = cudnn._plan(spec, q, k)
        pieces_seen |= {mask for mask, _ in calls} | ({"tail"} if tails else set())
    assert "tail" in pieces_seen and cudnn.Mask(None, None, False) in pieces_seen  # every kind of piece ran


# --------------------------------------------------------------------------------------------
# under eager CP on CPU, through the stand-in
# --------------------------------------------------------------------------------------------

CP_MESH = (2, 2)
SUITE = "test_cudnn_kernel:suite"


def supports_windows_only(kernel: cudnn.CudnnKernel, request: BlockRequest) -> str | None:
    """The kernel's refusals of a window, its CUDA-only checks waived."""
    left, right = request.window
    return cudnn._NO_WINDOW_BY_POSITION if request.window_by_position and not (left >= 0 and right == 0) else None


@dataclasses.dataclass(frozen=True)
class StandInCase(AttentionCase):
    """The attention under eager CP with every block on the cudnn kernel, its cuDNN calls run
    by :class:`RaggedStandIn` and its local region's outputs starting as NaN (in the world's
    processes, which the test's monkeypatch does not reach; the kernel's CUDA-only checks
    are waived there, its refusals of windows kept)."""

    @property
    def id(self) -> str:
        return f"cudnn-stand-in-{super().id}"

    def run(self, world: World) -> dict:
        with mock.patch.object(cudnn, "GRAPHS", RaggedStandIn()), \
                mock.patch.object(cudnn, "uninitialized", PoisonedBuffers()), \
                mock.patch.object(cudnn.CudnnKernel, "supports", supports_windows_only), \
                hc.context_parallel(world.mesh, placement=self.placement, kernel="cudnn"):
            return self.attend(world, cu_seqlens(self.lengths), max(self.lengths))


@dataclasses.dataclass(frozen=True)
class ChunkedStandInCase(StandInCase):
    """:class:`StandInCase` with every block's backward over its workspace budget, in chunks
    of at most 8 rows where the host knows the block's segmentation (the local region and the
    ring steps: the schedule's tables; not a window by position)."""

    @property
    def id(self) -> str:
        return f"chunked-{super().id}"

    def run(self, world: World) -> dict:
        with mock.patch.object(cudnn, "MIN_CHUNK_ROWS", 8), mock.patch.object(cudnn, "WORKSPACE_SHARE", 0.0):
            return super().run(world)


# a window on a mesh without a ring masks by the offsets in the segments (layout.window_by_position);
# with a ring (2 x 2) by positions, in pieces; the stand-in, like cuDNN, ignores positions, so a
# block run as if its offsets were positions would give a wrong answer here
WINDOW_CASES = [StandInCase("long", 4, 2, True, (17, 0)), StandInCase("mixed", 4, 2, True, (4, 0))]
CP_CASES = [StandInCase("many", 4, 2, True), StandInCase("mixed", 4, 1, True), StandInCase("long", 4, 4, False),
            StandInCase("mixed", 4, 2, True, placement="zigzag"), *WINDOW_CASES,
            StandInCase("long", 4, 2, True, (40, 0), placement="zigzag"),
            ChunkedStandInCase("long", 4, 2, True), ChunkedStandInCase("many", 4, 2, False, placement="zigzag"),
            ChunkedStandInCase("mixed", 4, 2, True, (4, 0))]
WINDOW_MESH = (2, 1)


def suite(mesh: tuple[int, int]) -> list:
    return WINDOW_CASES if tuple(mesh) == WINDOW_MESH else CP_CASES


@pytest.mark.parametrize("case", CP_CASES, ids=lambda c: c.id)
def test_under_context_parallelism_matches_reference(cp_world, case):
    """Every ring step's blocks (causal ones with more keys than queries, run as two top-left
    calls; full ones; under a window, pieces of the window by position) and the local region
    through the kernel's calls, on 2 x 2; and with every backward in chunks of documents."""
    reference = expected_for(case)
    for rank, result in enumerate(cp_world(CP_MESH, suite=SUITE).values(case.id)):
        index = result["global_index"]
        for name in ("out", "dq", "dk", "dv"):
            assert_matches(result[name], local_rows(reference[name], index), f"rank {rank} {name}")


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: c.id)
def test_a_window_on_a_mesh_without_a_ring_matches_reference(cp_world, case):
    """Ulysses alone (2 x 1) under a sliding window: every block through the kernel's calls
    with the window by offsets."""
    reference = expected_for(case)
    for rank, result in enumerate(cp_world(WINDOW_MESH, suite=SUITE).values(case.id)):
        index = result["global_index"]
        for name in ("out", "dq", "dk", "dv"):
            assert_matches(result[name], local_rows(reference[name], index), f"rank {rank} {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("share, known, causal, call_rows", [
    (1e9, True, True, [1234]),
    (0.3, True, True, [305, 129, 370, 330, 330, 100]),  # the 700-row document in tiles of 370
    (0.0, True, True, [300, 134, 300, 300, 300, 100, 100, 100, 100]),
    (0.0, True, False, [300, 134] + [300] * 6 + [100] * 3 + [100]),
    (0.0, False, True, [1234])], ids=["whole", "chunks", "smallest-chunks", "smallest-chunks-full", "batch-unknown"])
def test_a_backward_over_its_workspace_budget_runs_in_chunks_of_documents(device, share, known, causal, call_rows,
                                                                           request, monkeypatch):
    """A backward whose workspace exceeds ``WORKSPACE_SHARE`` of its inputs, where the host
    knows the batch (a single device's op reads cu_seqlens for its checks), runs over
    consecutive documents at a time on row views, a document longer than a chunk in tiles
    (causal squares on the diagonal, full rectangles elsewhere), and gives the whole call's
    results (the float64 reference); where the host does not know it, in one call. On CPU the
    stand-in's workspace (cuDNN's fp32 dQ and per-query-head dK/dV over the packed rows) fixes
    the chunks, at least ``MIN_CHUNK_ROWS`` (here 300) rows unless one document is longer."""
    where, dtype, tolerance = on(device, request)
    monkeypatch.setattr(cudnn, "WORKSPACE_SHARE", share)
    monkeypatch.setattr(cudnn, "MIN_CHUNK_ROWS", 300)
    lengths = (300, 5, 129, 700, 100)
    tokens = sum(lengths)
    cu = cu_seqlens(lengths).to(where)
    if known:
        host_values(cu)
    q, dout = (seeded(f"chunks/{n}", tokens, 8, 64).to(where, dtype) for n in ("q", "dout"))
    k, v = (seeded(f"chunks/{n}", tokens, 4, 64).to(where, dtype) for n in ("k", "v"))
    spec = BlockSpec(cu, cu, max(lengths), max(lengths), causal, 0.125, cache_key=new_cache_key(), covered_rows=tokens)
    kernel = KERNELS["cudnn"]
    out, lse = kernel.forward(q, k, v, spec)
    grads = kernel.backward(dout, q, k, v, out, lse, spec)
    if device == "cpu":
        stand_in = request.getfixturevalue("stand_in")
        assert [rows for (_, backward), rows in zip(stand_in.calls, stand_in.rows) if backward] == call_rows
    expected = reference_with_grads(*(t.double().cpu() for t in (q, k, v, dout)), cu.tolist(), cu.tolist(),
                                    causal=causal)
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert_matches(got.float().cpu(), expected[name], name, **tolerance)


# the rows of a chunk in the tests of CP blocks: every block but the shortest runs in chunks
CP_CHUNK_ROWS = 128
# documents for the backward of CP blocks: a few longer than a chunk on a rank of 2 x 2
CP_CHUNK_DOCS = (150, 5, 0, 129, 400, 1, 60, 2, 37, 0, 600, 3)


def paired_segments(cu_q: list[int], cu_k: list[int], first_row: int = 0, first_key: int = 0) -> list[tuple]:
    """The segments with both queries and keys: their rows and keys, from ``first_row`` and
    ``first_key``."""
    return [(first_row + a, first_row + b, first_key + c, first_key + d)
            for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]) if b > a and d > c]


def check_chunks(spec: BlockSpec, chunks: list, limit: int) -> list:
    """That ``chunks`` take every segment of ``spec`` with both queries and keys exactly once
    and in order, a chunk's segments the same consecutive ones on the query and on the key side
    (its specs' segmentations, on the device, the host values from its first row and key), its
    rows and keys after the previous chunk's; a chunk over ``limit`` rows being one segment,
    tiled where it has as many queries as keys and no window. Returns the tiled chunks."""
    cu_q, cu_k = HOST_READS.values(spec.cu_q).tolist(), HOST_READS.values(spec.cu_k).tolist()
    taken, segment, rows, keys, tiled = [], 0, 0, 0, []
    for chunk in chunks:
        assert chunk.q_rows.start >= rows and chunk.k_rows.start >= keys, "chunks overlap"
        rows, keys = chunk.q_rows.stop, chunk.k_rows.stop
        part_q = [c + chunk.q_rows.start for c in chunk.spec.cu_q.tolist()]
        part_k = [c + chunk.k_rows.start for c in chunk.spec.cu_k.tolist()]
        assert len(part_q) == len(part_k) and (part_q[0], part_q[-1], part_k[0], part_k[-1]) == (
            chunk.q_rows.start, rows, chunk.k_rows.start, keys)
        count = len(part_q) - 1
        while (cu_q[segment:segment + count + 1], cu_k[segment:segment + count + 1]) != (part_q, part_k):
            segment += 1
            assert segment + count < len(cu_q), "a chunk's segments are not consecutive segments of the block"
        segment += count
        taken += paired_segments(part_q, part_k)
        length_q, length_k = chunk.q_rows.stop - chunk.q_rows.start, chunk.k_rows.stop - chunk.k_rows.start
        if max(length_q, length_k) > limit:
            assert count == 1, "a chunk over the limit is one segment"
            assert bool(chunk.tiles) == (length_q == length_k and not spec.windowed)
        if chunk.tiles:
            tiled.append(chunk)
            pieces = -(-length_q // limit)
            assert len(chunk.tiles) == (pieces * (pieces + 1) // 2 if spec.causal else pieces ** 2)
            assert {(t.q_rows.start, t.q_rows.stop) for t in chunk.tiles} == {
                (start, min(start + limit, length_q)) for start in range(0, length_q, limit)}
    assert taken == paired_segments(cu_q, cu_k), "every segment with queries and keys, once"
    return tiled


# (queries, keys) per segment of a block segmented apart, as a ring step's are: queries
# without keys and keys without queries in a chunk of their own (which does not run), a long
# segment of as many queries as keys (tiles), pads of either kind alone in a chunk, an empty
# segment, a long segment of more keys than queries (whole: when causal, a rectangle and a
# square); chunks of 100 rows
APART_SEGMENTS = ((3, 0), (0, 4), (150, 150), (10, 0), (0, 200), (2, 2), (0, 0), (90, 120))
APART_CHUNKS = [(slice(3, 153), slice(4, 154), True), (slice(163, 165), slice(354, 356), False),
                (slice(165, 255), slice(356, 476), False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_a_block_segmented_apart_runs_in_chunks_of_its_segments(device, causal, request, monkeypatch):
    """A block whose queries and keys are segmented apart (the host copy of its tables in
    ``HOST_READS``, its segmentations views of them, as a schedule's) runs its backward in
    chunks of the same segments on both sides, leaving out the chunks where no segment has
    both, and gives the gradients of the float64 plain-PyTorch kernel given the same out and
    lse."""
    where, dtype, tolerance = on(device, request)
    monkeypatch.setattr(cudnn, "MIN_CHUNK_ROWS", 100)
    monkeypatch.setattr(cudnn, "WORKSPACE_SHARE", 0.0)
    len_q, len_k = zip(*APART_SEGMENTS)
    host = torch.cat([cu_seqlens(len_q), cu_seqlens(len_k)])
    table = host.to(where)
    HOST_READS.put_table(table, host)
    cu_q, cu_k = table.split(len(APART_SEGMENTS) + 1)
    spec = BlockSpec(cu_q, cu_k, max(len_q), max(len_k), causal, 0.125, cache_key=new_cache_key())
    q, dout = (seeded(f"apart/{n}", sum(len_q), 8, 64).to(where, dtype) for n in ("q", "dout"))
    k, v = (seeded(f"apart/{n}", sum(len_k), 2, 64).to(where, dtype) for n in ("k", "v"))
    chunks = cudnn.backward_chunks(spec, q, k)
    assert [(c.q_rows, c.k_rows, bool(c.tiles)) for c in chunks] == APART_CHUNKS
    check_chunks(spec, chunks, 100)
    out, lse = run_forward("cudnn", q, k, v, spec)
    grads = run_backward("cudnn", dout, q, k, v, out, lse, spec)
    expected = KERNELS["torch"].backward(*(t.double() for t in (dout, q, k, v, out)), lse.double(), spec)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, expected):
        assert_matches(got.double().cpu(), ref.cpu(), name, **tolerance)


@pytest.mark.parametrize("mesh", CP_SHAPES, ids=mesh_id)
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (True, (40, 0))], ids=str)
def test_cp_blocks_plan_their_backward_in_chunks_of_segments(mesh, causal, window, monkeypatch):
    """Under context parallelism the host knows every block's segmentation (the schedule's
    tables), so the local region and each ring step plan their backward in chunks where the
    workspace is over budget (here always: ``workspace_per_row`` reads a cuDNN graph, replaced
    by an endless one), each segment with queries and keys in exactly one chunk, the same on
    both sides (a ring step's queries in the chunk of their keys), long ones in tiles where
    they have as many queries as keys (the own step's too); a window by position (a ring's,
    under a window) runs whole."""
    monkeypatch.setattr(cudnn, "MIN_CHUNK_ROWS", CP_CHUNK_ROWS)
    monkeypatch.setattr(cudnn, "workspace_per_row", lambda shape: float("inf"))
    # tiled_apart: the tiles of blocks whose queries and keys are segmented apart (ring steps)
    two_segmentations = tiled = tiled_apart = 0
    for rank, blocks in schedule_blocks(CP_DOCS, mesh, causal=causal, window=window):
        for block in blocks:
            q, k = torch.empty(block.rows_q, 4, 16), torch.empty(block.rows_k, 2, 16)
            chunks = cudnn.backward_chunks(block.spec, q, k)
            if block.spec.q_positions is not None or max(block.rows_q, block.rows_k) <= CP_CHUNK_ROWS:
                assert chunks is None, f"rank {rank} {block.name}"
                continue
            assert chunks is not None, f"rank {rank} {block.name}: runs whole"
            tiles = len(check_chunks(block.spec, chunks, CP_CHUNK_ROWS))
            tiled += tiles
            if not block.spec.one_segmentation:
                two_segmentations, tiled_apart = two_segmentations + 1, tiled_apart + tiles
            assert cudnn.backward_chunks(block.spec, q, k) is chunks  # planned once per spec
    by_position = window != (-1, -1) and mesh.ring > 1  # every ring step runs whole
    assert two_segmentations or by_position, "no ring step ran in chunks"
    assert (tiled and tiled_apart) or window != (-1, -1), "no long document ran in tiles"


# (mesh, causal): a ring (its own step causal, the others full; or every step full), Ulysses
# alone, both
CP_CHUNK_CASES = [(MeshShape(1, 2, "balanced"), True), (MeshShape(1, 2, "zigzag"), False),
                  (MeshShape(2, 1, "balanced"), True), (MeshShape(2, 2, "zigzag"), True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mesh, causal", CP_CHUNK_CASES,
                         ids=lambda c: mesh_id(c) if isinstance(c, MeshShape) else ("causal" if c else "full"))
def test_cp_blocks_backward_in_chunks_matches_reference(device, mesh, causal, request, monkeypatch):
    """Every block of every rank's schedule (the local region, the ring steps; the backward
    given the rank's merged out and lse, as the ring's is) in chunks of at most
    ``CP_CHUNK_ROWS`` rows and whole, against the float64 plain-PyTorch kernel given the same
    out and lse: the chunks' gradients are the whole block's."""
    where, dtype, tolerance = on(device, request)
    monkeypatch.setattr(cudnn, "MIN_CHUNK_ROWS", CP_CHUNK_ROWS)
    kernel, chunked = KERNELS["cudnn"], 0
    for rank, blocks in schedule_blocks(CP_CHUNK_DOCS, mesh, where, causal=causal):
        name = f"cp-chunks-{mesh_id(mesh)}-{causal}-{rank}"
        local, steps = blocks[0], blocks[1:]
        x = {n: seeded(f"{name}/{n}", rows, heads, 32).to(where, dtype) for n, rows, heads in (
            ("q_local", local.rows_q, 4), ("kv_local", local.rows_k, 2), ("dout_local", local.rows_q, 4),
            ("q", steps[0].rows_q, 4), ("dout", steps[0].rows_q, 4),
            *((f"kv{i}", step.rows_k, 2) for i, step in enumerate(steps)))}
        block_inputs = [(local, x["q_local"], *x["kv_local"].chunk(2, dim=1), x["dout_local"])]
        block_inputs += [(step, x["q"], *x[f"kv{i}"].chunk(2, dim=1), x["dout"]) for i, step in enumerate(steps)]
        merged = {}
        for block, q, k, v, _ in block_inputs:  # the stream's out and lse merged over the ring steps
            block_out, block_lse = kernel.forward(q, k, v, block.spec)
            key = "local" if block is local else "stream"
            merged[key] = merge_partials(*merged.get(key, (None, None)), block_out, block_lse)
        for block, q, k, v, dout in block_inputs:
            out, lse = merged["local" if block is local else "stream"]
            out = out.to(dtype)
            monkeypatch.setattr(cudnn, "WORKSPACE_SHARE", 0.0)
            chunks = cudnn.backward_chunks(block.spec, q.contiguous(), k.contiguous())
            assert (chunks is None) == (max(block.rows_q, block.rows_k) <= CP_CHUNK_ROWS), f"{name} {block.name}"
            chunked += chunks is not None
            in_chunks = kernel.backward(dout, q, k, v, out, lse, block.spec)
            monkeypatch.setattr(cudnn, "WORKSPACE_SHARE", 1e9)
            whole = kernel.backward(dout, q, k, v, out, lse, block.spec)
            wide = [t.double() for t in (dout, q, k, v, out)]
            expected = KERNELS["torch"].backward(*wide, lse.double(), block.spec)
            for grad, got_chunks, got_whole, ref in zip(("dq", "dk", "dv"), in_chunks, whole, expected):
                label = f"{name} {block.name} {grad}"
                assert_matches(got_chunks.double().cpu(), ref.cpu(), f"{label} in chunks", **tolerance)
                assert_matches(got_whole.double().cpu(), ref.cpu(), f"{label} whole", **tolerance)
    assert chunked, "no block ran in chunks"
