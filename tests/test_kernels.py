"""The block kernels behind one contract (docs/design.md §8): the flex kernel against the
float64 reference on CPU (flex's unfused reference path), each kernel's backward given the
merged out and lse of two blocks (the ring's case), flex's block masks against their element
masks, flex traced by Dynamo as on CUDA (``aot_eager``) without a recompile per batch, each
CPU kernel through ``backend="hcp"`` and under eager CP on a 2 x 2 mesh, and how ``kernel=...``
is resolved. The tests meant for every kernel take them from the registry (``KERNELS``,
``cp_cases.kernels_that_run``). bf16 on CUDA: ``test_gpu.py``."""

from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch

import hcp_compile as hc
from hcp_compile.testing.reference import document_mask, reference_with_grads
from checks import assert_matches, expected_for, nan_filled_results
from cp_cases import HEAD_DIM, AttentionCase, attention_cases, auto_kernel, cu_seqlens, kernels_that_run, seeded, World
from hcp_compile.hierarchical import _join_regions, _split_regions
from hcp_compile.kernels.merge import merge_partials
from hcp_compile.kernels import (
    KERNELS, BlockRequest, BlockSpec, cudnn, dense, flex, flex_mask, measured, resolve_kernel, run_backward,
    run_forward,
)

FLEX_CASES = [c for c in attention_cases() if c.docs == "mixed" and c.heads_kv in (4, 1)] + [
    AttentionCase("long", 4, 2, True), AttentionCase("long", 4, 2, False, (3, 5), scale=0.2)]


def flex_with_grads(case: AttentionCase) -> dict[str, torch.Tensor]:
    x, cu = case.inputs(), cu_seqlens(case.lengths)
    leaves = [x[n].clone().requires_grad_() for n in "qkv"]
    longest = max(case.lengths)
    scale = case.scale if case.scale is not None else case.head_dim ** -0.5
    out, _ = torch.ops.hcp.varlen_attention(*leaves, cu, cu, longest, longest, case.causal, scale,
                                            *case.window, "flex")
    out.backward(x["dout"])
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}


@pytest.mark.parametrize("case", FLEX_CASES, ids=lambda c: c.id)
def test_flex_kernel_matches_reference(case):
    got, expected = flex_with_grads(case), expected_for(case)
    for name in ("out", "dq", "dk", "dv"):
        assert_matches(got[name], expected[name], name)


def test_flex_runs_on_whole_mask_blocks_and_is_told_so(monkeypatch):
    """A block of 207 query and 130 key rows reaches flex padded to 256 and 256 rows (whole
    128-row mask blocks), with the option that lets flex's GPU kernels skip their bounds
    checks, forward and backward; the pad rows change nothing (the float64 reference)."""
    calls = []
    real = flex.flex_attention

    def recording(q, k, v, **options):
        calls.append((q.shape[2], k.shape[2], options["kernel_options"]))
        return real(q, k, v, **options)

    monkeypatch.setattr(flex, "flex_attention", recording)
    q_lengths, k_lengths = (150, 57), (100, 30)
    q, dout = seeded("pad/q", sum(q_lengths), 4, HEAD_DIM), seeded("pad/dout", sum(q_lengths), 4, HEAD_DIM)
    k, v = seeded("pad/k", sum(k_lengths), 2, HEAD_DIM), seeded("pad/v", sum(k_lengths), 2, HEAD_DIM)
    cu_q, cu_k = cu_seqlens(q_lengths), cu_seqlens(k_lengths)
    spec = BlockSpec(cu_q, cu_k, max(q_lengths), max(k_lengths), False, HEAD_DIM ** -0.5)
    out, lse = run_forward("flex", q, k, v, spec)
    assert calls == [(256, 256, {"IS_DIVISIBLE": True})]
    grads = run_backward("flex", dout, q, k, v, out, lse, spec)
    expected = reference_with_grads(q, k, v, dout, cu_q.tolist(), cu_k.tolist(), causal=False)
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert_matches(got, expected[name], name)
    q4, k4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k))
    assert dict(flex._kernel_options(q4, k4, k4))["IS_DIVISIBLE"] is True


# --------------------------------------------------------------------------------------------
# the ring's case: two blocks merged, each backward given the merged out and lse
# --------------------------------------------------------------------------------------------

SPLIT_DOCS = (6, 0, 1, 11, 17)


def split_keys(lengths: tuple[int, ...], part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key rows of one part of every document (part 0: its first ``length // 3`` tokens,
    part 1: the rest) and the part's ``cu_seqlens``: a ring step's shape, where a block sees
    some of a document's keys at their positions inside the document."""
    rows, counts, start = [], [], 0
    for length in lengths:
        cut = length // 3
        part_rows = range(start, start + cut) if part == 0 else range(start + cut, start + length)
        rows += part_rows
        counts.append(len(part_rows))
        start += length
    return torch.tensor(rows, dtype=torch.int64), cu_seqlens(tuple(counts))


def kernel_masks(masks: dict[str, tuple[bool, tuple[int, int]]], by_position: bool) -> list:
    """``(kernel, causal, window)`` for every CPU kernel and every mask of ``masks`` it takes
    (``by_position``: the window over the positions inside the document, as on a ring)."""
    return [pytest.param(kernel, causal, window, id=f"{mask}-{kernel}") for mask, (causal, window) in masks.items()
            for kernel in kernels_that_run(window, window_by_position=by_position)]


@pytest.mark.parametrize("kernel, causal, window", kernel_masks(
    {"causal": (True, (-1, -1)), "full": (False, (-1, -1)), "causal-w5.0": (True, (5, 0)),
     "full-w4.2": (False, (4, 2))}, by_position=True))
def test_backward_given_merged_out_and_lse_yields_each_blocks_share(kernel, causal, window):
    """Two blocks over disjoint keys, merged as the ring merges them; the sum of the two
    backwards, each given the merged out and lse, is the gradient of the whole attention."""
    tokens = sum(SPLIT_DOCS)
    q, dout = seeded("split/q", tokens, 4, HEAD_DIM), seeded("split/dout", tokens, 4, HEAD_DIM)
    k, v = seeded("split/k", tokens, 2, HEAD_DIM), seeded("split/v", tokens, 2, HEAD_DIM)
    cu = cu_seqlens(SPLIT_DOCS)
    positions = torch.cat([torch.arange(n) for n in SPLIT_DOCS])
    blocks = []
    for part in (0, 1):
        rows, cu_k = split_keys(SPLIT_DOCS, part)
        spec = BlockSpec(cu, cu_k, max(SPLIT_DOCS), max(SPLIT_DOCS), causal, HEAD_DIM ** -0.5,
                         *window, positions, positions[rows])
        blocks.append((rows, spec))
    out = lse = None
    for rows, spec in blocks:
        out, lse = merge_partials(out, lse, *run_forward(kernel, q, k[rows], v[rows], spec))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, spec in blocks:
        dq_b, dk_b, dv_b = run_backward(kernel, dout, q, k[rows], v[rows], out.to(q.dtype), lse, spec)
        dq += dq_b
        dk[rows], dv[rows] = dk_b, dv_b
    expected = reference_with_grads(q, k, v, dout, cu.tolist(), cu.tolist(), causal=causal, window=window)
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_matches(got, expected[name], name)


@pytest.mark.parametrize("kernel, causal, window", kernel_masks(
    {"causal": (True, (-1, -1)), "full-w3.1": (False, (3, 1))}, by_position=False))
def test_rows_past_the_last_segment_leave_the_segments_results_alone(kernel, causal, window):
    """The local region's block of a rank without an exchange region runs over its pad rows
    too (docs/design.md §3, "Buffers"; ``covered_rows``): rows past ``cu_q``'s last entry,
    whatever their values and gradients, change nothing of the segments' rows, which match the
    float64 reference of the segments alone. The pad rows' own results are the caller's."""
    tokens, pads = sum(SPLIT_DOCS), 5
    q, k, v, dout = (seeded(f"pads/{n}", tokens + pads, h, HEAD_DIM) for n, h in zip("qkvd", (4, 2, 2, 4)))
    for x in (q, k, v, dout):
        x[tokens:] = 7.0
    cu = cu_seqlens(SPLIT_DOCS)
    spec = BlockSpec(cu, cu, max(SPLIT_DOCS), max(SPLIT_DOCS), causal, HEAD_DIM ** -0.5, *window,
                     covered_rows=tokens)
    out, lse = run_forward(kernel, q, k, v, spec)
    dq, dk, dv = run_backward(kernel, dout, q, k, v, out, lse, spec)
    expected = reference_with_grads(q[:tokens], k[:tokens], v[:tokens], dout[:tokens], cu.tolist(), cu.tolist(),
                                    causal=causal, window=window)
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_matches(got[:tokens], expected[name], name)


class LeavesRowsPastSegments:
    """The torch kernel, then NaN in every row past ``cu_q``'s and ``cu_k``'s last entry, as
    a kernel that leaves them unwritten (flash) would."""

    name = "leaves-rows"

    def supports(self, request):
        return None

    def forward(self, q, k, v, spec):
        out, lse = KERNELS["torch"].forward(q, k, v, spec)
        end = int(spec.cu_q[-1])
        out[end:], lse[:, end:] = float("nan"), float("nan")
        return out, lse

    def backward(self, dout, q, k, v, out, lse, spec):
        dq, dk, dv = KERNELS["torch"].backward(dout, q, k, v, out, lse, spec)
        for grad, cu in ((dq, spec.cu_q), (dk, spec.cu_k), (dv, spec.cu_k)):
            grad[int(cu[-1]):] = float("nan")
        return dq, dk, dv


def test_the_block_ops_give_rows_past_the_segments_the_results_of_rows_without_keys(monkeypatch):
    """``covered_rows``: whatever a kernel leaves past the segments, the ops hand out rows
    without keys there (out 0, lse -inf, gradients 0: a pad row's gradient reaches the user's
    shard), and the local region's results are the rank's own, with no join that copies them."""
    monkeypatch.setitem(KERNELS, "leaves-rows", LeavesRowsPastSegments())
    tokens, pads = sum(SPLIT_DOCS), 3
    q, k, v, dout = (seeded(f"pads/{n}", tokens + pads, h, HEAD_DIM) for n, h in zip("qkvd", (4, 2, 2, 4)))
    cu = cu_seqlens(SPLIT_DOCS)
    spec = BlockSpec(cu, cu, max(SPLIT_DOCS), max(SPLIT_DOCS), True, HEAD_DIM ** -0.5, covered_rows=tokens)
    out, lse = run_forward("leaves-rows", q, k, v, spec)
    grads = run_backward("leaves-rows", dout, q, k, v, out, lse, spec)
    expected = reference_with_grads(q[:tokens], k[:tokens], v[:tokens], dout[:tokens], cu.tolist(), cu.tolist(),
                                    causal=True)
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert_matches(got[:tokens], expected[name], name)
        assert torch.equal(got[tokens:], torch.zeros_like(got[tokens:])), name
    assert (lse[:, tokens:] == float("-inf")).all()
    # where the rank has no exchange region, its local block's result is its output as it is
    sched = types.SimpleNamespace(sizes=types.SimpleNamespace(local=tokens, own_exchange=0, pad=pads),
                                  local_holds_every_row=True)
    local, exchange = _split_regions(out, sched)
    assert local is out and _join_regions(local, exchange, sched) is out


class _LocalBlock(torch.autograd.Function):
    """One local-region block (one segmentation for queries and keys, pad rows after it) through
    the ops, as hierarchical.py runs it."""

    @staticmethod
    def forward(ctx, q, k, v, cu, covered):
        spec = BlockSpec(cu, cu, max(SPLIT_DOCS), max(SPLIT_DOCS), True, HEAD_DIM ** -0.5, covered_rows=covered)
        out, lse = run_forward("leaves-rows", q, k, v, spec)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu = ctx.saved_tensors
        spec = dataclasses.replace(ctx.spec, cu_q=cu, cu_k=cu)
        return (*run_backward("leaves-rows", dout.contiguous(), q, k, v, out, lse, spec), None, None)


def test_a_compiled_graph_keeps_one_segmentation_so_keys_past_it_get_no_gradient(monkeypatch):
    """The ops tell that keys share the queries' segmentation by the buffer both ``cu`` are
    (``BlockSpec.one_segmentation``): Inductor must hand the op the same buffer twice, or the
    keys' pad rows would keep what the kernel left there (flash: unwritten memory) and reach
    the user's k and v."""
    monkeypatch.setitem(KERNELS, "leaves-rows", LeavesRowsPastSegments())
    tokens, pads = sum(SPLIT_DOCS), 3
    q, k, v = (seeded(f"one-seg/{n}", tokens + pads, h, HEAD_DIM).requires_grad_() for n, h in zip("qkv", (4, 2, 2)))

    def attend(q, k, v, cu):
        return _LocalBlock.apply(q * 1, k * 1, v * 1, cu, tokens) * 2

    torch._dynamo.reset()
    out = torch.compile(attend, backend="inductor", fullgraph=True)(q, k, v, cu_seqlens(SPLIT_DOCS))
    out.sum().backward()
    for name, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.equal(got[tokens:], torch.zeros_like(got[tokens:])), name
        assert torch.isfinite(got).all(), name


# --------------------------------------------------------------------------------------------
# flex's block masks
# --------------------------------------------------------------------------------------------

MASK_SPECS = {
    "docs-causal": (True, (-1, -1), False),
    "docs-full": (False, (-1, -1), False),
    "docs-window": (False, (3, 5), False),
    "positions-causal-window": (True, (6, 0), True),
    "positions-full": (False, (-1, -1), True),
}


@pytest.mark.parametrize("block", [1, 4, 5, 16])
@pytest.mark.parametrize("name", MASK_SPECS)
def test_block_structure_is_exact(name, block):
    """Against the element mask of the same spec: a block pair is skipped exactly when it has
    no visible element, full only with all elements visible; queries of one document against part of its keys
    (positions given) as in a ring step, with empty documents and blocks spanning several."""
    causal, window, with_positions = MASK_SPECS[name]
    lengths = (7, 0, 1, 19, 4, 30, 2)
    cu_q = cu_seqlens(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths])
    rows, cu_k = split_keys(lengths, 1) if with_positions else (torch.arange(sum(lengths)), cu_q)
    spec = BlockSpec(cu_q, cu_k, 30, 30, causal, 1.0, *window,
                     positions if with_positions else None, positions[rows] if with_positions else None)
    q_rows, k_rows = int(cu_q[-1]), int(cu_k[-1])
    seg_q, seg_k, pos_q, pos_k = flex_mask.row_values(spec, q_rows, k_rows)
    partial, full = flex_mask.block_structure(seg_q, seg_k, pos_q, pos_k, causal, *window, block,
                                              len(lengths))
    elements = flex_mask.visible(0, 0, torch.arange(q_rows)[:, None], torch.arange(k_rows)[None, :],
                                 seg_q, seg_k, pos_q, pos_k, causal=causal, left=window[0], right=window[1])
    padded = torch.zeros(partial.shape[0] * block, partial.shape[1] * block, dtype=torch.int64)
    padded[:q_rows, :k_rows] = elements
    per_block = padded.view(partial.shape[0], block, partial.shape[1], block).sum((1, 3))
    assert not (full & partial).any()
    assert torch.equal(per_block > 0, partial | full), "a block is skipped iff it has no visible element"
    assert (per_block[full] == block * block).all(), "a full block has a masked element"
    if not with_positions:  # one document per segment: element masks equal the reference's
        for d, (start, length) in enumerate(zip(cu_q.tolist(), lengths)):
            doc = elements[start:start + length, start:start + length]
            assert torch.equal(doc, document_mask(length, length, causal, window)), f"document {d}"


def test_masks_are_reused_for_a_cache_key_and_rebuilt_without_one():
    cu = cu_seqlens((5, 9))
    keyed = BlockSpec(cu, cu, 9, 9, True, 1.0, cache_key=hc.kernels.new_cache_key())
    assert flex_mask.document_mask(keyed, 14, 14) is flex_mask.document_mask(keyed, 14, 14)
    unkeyed = dataclasses.replace(keyed, cache_key=-1)
    assert flex_mask.document_mask(unkeyed, 14, 14) is not flex_mask.document_mask(unkeyed, 14, 14)


def test_spec_cache_keeps_a_device_s_entries_apart():
    """One cache key on two devices (a single-device key comes from cu_seqlens' values, which
    batches on two GPUs can share): each device gets what was built for it (its tensors)."""
    cache = hc.kernels.contract.SpecCache(capacity=8)
    key = hc.kernels.new_cache_key()
    specs = {device: BlockSpec(cu_seqlens((4,)).to(device), cu_seqlens((4,)).to(device), 4, 4, True, 1.0,
                               cache_key=key) for device in ("cpu", "meta")}
    built = {device: cache.get(spec, (), lambda spec=spec: spec.cu_q + 0) for device, spec in specs.items()}
    assert {t.device.type for t in built.values()} == {"cpu", "meta"}
    assert cache.get(specs["meta"], (), lambda: None) is built["meta"]


def test_spec_cache_drops_the_least_recently_used_beyond_its_bytes_but_keeps_the_newest():
    cache = hc.kernels.contract.SpecCache(capacity=3, max_bytes=100, size_of=len)
    cu = cu_seqlens((4,))
    specs = [BlockSpec(cu, cu, 4, 4, True, 1.0, cache_key=hc.kernels.new_cache_key()) for _ in range(5)]
    builds = []

    def get(index: int, size: int) -> bytes:
        return cache.get(specs[index], (), lambda: builds.append(index) or b"x" * size)

    get(0, 40), get(1, 40), get(0, 40)  # the third is a hit, and makes 1 the least recent
    get(2, 40)  # 120 bytes: 1 goes
    assert builds == [0, 1, 2] and cache.nbytes == 80
    get(1, 40)
    assert builds[-1] == 1 and cache.nbytes == 80  # rebuilt; 0 went
    get(3, 150)  # alone over the budget: everything else goes, the newest stays
    assert cache.nbytes == 150
    get(3, 150)
    assert builds == [0, 1, 2, 1, 3]
    get(4, 1), get(2, 1)  # 3 goes; then the count: at most 3 entries
    get(0, 1), get(1, 1)
    assert builds[-2:] == [0, 1] and cache.nbytes == 3


def test_mask_bytes_count_the_block_indices_and_the_row_values():
    cu = cu_seqlens((100, 156))
    spec = BlockSpec(cu, cu, 156, 156, True, 1.0)
    mask = flex_mask.build_document_mask(spec, 256, 256)
    blocks = 2  # 256 rows of 128
    # 4 index matrices and 4 count vectors (int32), 4 row vectors (int32)
    assert flex_mask.mask_bytes(mask) == 4 * 4 * blocks * blocks + 4 * 4 * blocks + 4 * 4 * 256


LAYER_WINDOWS = ((-1, -1), (2, 0), (-1, -1), (2, 0))  # layers alternating two masks


def layers_with_grads(lengths: tuple[int, ...], cu: torch.Tensor) -> tuple[dict, dict]:
    """Single-device flex attention of one q, k, v per window of :data:`LAYER_WINDOWS`
    (layers sharing ``cu``), summed, forward and backward; and the float64 reference."""
    q, k, v = (seeded(f"layers/{n}", sum(lengths), heads, HEAD_DIM) for n, heads in (("q", 4), ("k", 2), ("v", 2)))
    dout = seeded("layers/dout", *q.shape)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    longest = max(lengths)
    out = sum(torch.ops.hcp.varlen_attention(*leaves, cu, cu, longest, longest, True, 0.5, *window, "flex")[0]
              for window in LAYER_WINDOWS)
    out.backward(dout)
    got = {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    per_layer = [reference_with_grads(q, k, v, dout, bounds, bounds, causal=True, window=w, scale=0.5)
                 for w in LAYER_WINDOWS]
    expected = {name: sum(r[name] for r in per_layer) for name in got}
    return got, expected


def test_single_device_flex_builds_one_mask_per_batch_and_window(mask_builds):
    """Four layers of two windows sharing one batch, forward and backward: one mask per
    window; the same values in a new tensor: none; other values: new ones. Each result
    against the float64 reference (a mask reused across windows or batches would fail it)."""
    for lengths, cu, builds in (((5, 9, 3), cu_seqlens((5, 9, 3)), 2),
                                ((5, 9, 3), cu_seqlens((5, 9, 3)).clone(), 2),
                                ((9, 5, 3), cu_seqlens((9, 5, 3)), 4)):
        got, expected = layers_with_grads(lengths, cu)
        for name in got:
            assert_matches(got[name], expected[name], f"{lengths} {name}")
        assert mask_builds[0] == builds, f"{lengths}: {mask_builds[0]} masks built in all, expected {builds}"


# --------------------------------------------------------------------------------------------
# flex traced by Dynamo (as on CUDA, with aot_eager instead of Inductor)
# --------------------------------------------------------------------------------------------

def test_traced_flex_matches_reference_without_a_recompile_per_batch(traced_flex):
    """Three batches of different sizes, each with a new mask (new cu_seqlens): one graph for
    the forward and one for the backward."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for docs in ("mixed", "long", "many"):
        case = AttentionCase(docs, 4, 2, True, (4, 0))
        got, expected = flex_with_grads(case), expected_for(case)
        for name in ("out", "dq", "dk", "dv"):
            assert_matches(got[name], expected[name], f"{docs} {name}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_traced_flex_takes_non_contiguous_inputs_without_another_graph(traced_flex):
    """Flex runs on views of the THD tensors: q, k and v split from one projection buffer (as
    a model or the ring's KV exchange passes them) give the results of contiguous ones
    through the same graphs, and every result comes back contiguous."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    case = AttentionCase("long", 4, 2, True, (4, 0))
    x, cu = case.inputs(), cu_seqlens(case.lengths)
    longest, scale = max(case.lengths), HEAD_DIM ** -0.5
    spec = BlockSpec(cu, cu, longest, longest, True, scale, 4, 0)
    packed = torch.cat([x["q"], x["k"], x["v"]], dim=1)  # [T, 4 + 2 + 2, D]
    split = packed.split([4, 2, 2], dim=1)
    assert not any(t.is_contiguous() for t in split)
    results = []
    for q, k, v in ((x["q"], x["k"], x["v"]), split):
        out, lse = run_forward("flex", q, k, v, spec)
        grads = run_backward("flex", x["dout"], q, k, v, out, lse, spec)
        assert all(t.is_contiguous() for t in (out, lse, *grads))
        results.append((out, lse, *grads))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    expected = expected_for(case)
    for name, got in zip(("out", "dq", "dk", "dv"), (results[0][0], *results[0][2:])):
        assert_matches(got, expected[name], name)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_traced_flex_serves_blocks_of_equal_and_of_unequal_row_counts(traced_flex):
    """A ring's own step has as many key rows as query rows, its other steps fewer. The forward
    traced on the first must serve the others without compiling again for each new block shape;
    the backward has one graph for equal and one for unequal row counts, since Inductor's
    lowering guards on their equality on CUDA and Dynamo refuses to trace flex's backward graph
    again when a guard fails. Each must serve all blocks of its kind."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    lengths = (150, 0, 1, 190, 40, 300, 2)  # > 128 rows in every block: no padding evens them out
    tokens = sum(lengths)
    q, dout = seeded("rows/q", tokens, 4, HEAD_DIM), seeded("rows/dout", tokens, 4, HEAD_DIM)
    k, v = seeded("rows/k", tokens, 2, HEAD_DIM), seeded("rows/v", tokens, 2, HEAD_DIM)
    cu = cu_seqlens(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths])
    blocks = [(torch.arange(tokens), BlockSpec(cu, cu, max(lengths), max(lengths), True, HEAD_DIM ** -0.5))]
    for part in (0, 1):
        rows, cu_k = split_keys(lengths, part)
        blocks.append((rows, BlockSpec(cu, cu_k, max(lengths), max(lengths), True, HEAD_DIM ** -0.5,
                                       -1, -1, positions, positions[rows])))
    for rows, spec in blocks:
        got, expected = (run_forward(kernel, q, k[rows], v[rows], spec) for kernel in ("flex", "torch"))
        for name, a, b in zip(("out", "lse"), got, expected):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{len(rows)} keys {name}")
        grads = (run_backward(kernel, dout, q, k[rows], v[rows], *expected, spec) for kernel in ("flex", "torch"))
        for name, a, b in zip(("dq", "dk", "dv"), *grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{len(rows)} keys {name}")
    # one forward graph; one backward graph for equal and one for unequal row counts (_static_shape)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3


def test_traced_flex_specializes_the_first_row_shapes_and_serves_later_ones_dynamically(traced_flex, monkeypatch):
    """With a budget of two static shapes: the first two row shapes get graphs of their own, the
    third and fourth share one graph with dynamic rows, and a shape seen before reuses its
    graph; every call matches the reference."""
    monkeypatch.setattr(flex, "STATIC_SHAPES", 2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # padded to 256, 384, 512 and 640 rows (multiples of 128, the block size): four shapes with
    # more than one mask block, so the backward's other static facts (_static_shape) are the
    # same for all
    batches = [(150, 40), (190, 3, 120), (300, 150), (170, 90, 300), (150, 40)]
    for number, lengths in enumerate(batches):
        tokens = sum(lengths)
        q, dout = seeded(f"shapes/q{number}", tokens, 4, HEAD_DIM), seeded(f"shapes/o{number}", tokens, 4, HEAD_DIM)
        k, v = seeded(f"shapes/k{number}", tokens, 2, HEAD_DIM), seeded(f"shapes/v{number}", tokens, 2, HEAD_DIM)
        spec = BlockSpec(cu_seqlens(lengths), cu_seqlens(lengths), max(lengths), max(lengths), True, HEAD_DIM ** -0.5)
        got, expected = (run_forward(kernel, q, k, v, spec) for kernel in ("flex", "torch"))
        for name, a, b in zip(("out", "lse"), got, expected):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{lengths} {name}")
        grads = (run_backward(kernel, dout, q, k, v, *expected, spec) for kernel in ("flex", "torch"))
        for name, a, b in zip(("dq", "dk", "dv"), *grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{lengths} {name}")
    # forward and backward: two static graphs and one with dynamic rows each (all static: four);
    # the repeat adds none
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 6
    assert flex._forward_function.cache_info().currsize == 3


def test_traced_flex_compiles_each_static_combination_within_its_own_recompile_budget(traced_flex):
    """Mask variants, scales, dtypes and head counts are static in the traced forward: a model
    with more of them than Dynamo's recompile limit must still run (one code object per
    combination; with one shared code object the GPU tests failed at Dynamo's limit of 8)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (4, 0))):
            case = AttentionCase("mixed", 4, 2, causal, window)
            got, expected = flex_with_grads(case), expected_for(case)
            for name in ("out", "dq"):
                assert_matches(got[name], expected[name], f"{case.id} {name}")



def test_flex_builds_graphs_whose_code_holds_no_string_globals(traced_flex):
    """The graphs the flex kernel builds and hands to the compiler: torch 2.11's FX graph cache
    cannot pickle generated code with a string global (a string annotation, as ``from
    __future__ import annotations`` makes them), and logs a traceback per compile."""
    case = AttentionCase("mixed", 4, 2, True, (4, 0))
    flex_with_grads(case)
    graphs = [module._orig_mod for module, _ in flex._backward_graphs._graphs.values()]
    assert graphs
    for graph in graphs:
        for name, module in graph.named_modules():
            if isinstance(module, torch.fx.GraphModule):
                found = module.graph.python_code("self").globals
                assert not {n: v for n, v in found.items() if isinstance(v, str)}, name or "the backward graph"


def test_traced_flex_runs_again_after_dynamo_forgets_its_graphs(traced_flex):
    """``torch._dynamo.reset()`` between batches (a notebook, a fixture, a trainer compiling a
    new model): the next forward and backward trace flex again and match the reference. Dynamo
    refuses to trace one backward graph twice, so without a new graph the backward raised."""
    torch._dynamo.reset()
    for docs in ("mixed", "long", "mixed"):
        case = AttentionCase(docs, 4, 2, True, (4, 0))
        got, expected = flex_with_grads(case), expected_for(case)
        for name in ("out", "dq", "dk", "dv"):
            assert_matches(got[name], expected[name], f"{docs} {name}")
        torch._dynamo.reset()


def test_traced_flex_runs_inside_models_compiled_around_it(traced_flex):
    """Flex (traced) inside the compiled graphs of two models compiled around the single-device
    op, then again after ``torch._dynamo.reset()``: no kernel raises, every result matches the
    reference."""
    case = AttentionCase("mixed", 4, 2, True, (4, 0))
    x, cu = case.inputs(), cu_seqlens(case.lengths)
    longest, scale = max(case.lengths), case.head_dim ** -0.5
    expected = expected_for(case)

    def attend(q, k, v):
        return torch.ops.hcp.varlen_attention(q, k, v, cu, cu, longest, longest, True, scale, *case.window,
                                              "flex")[0]

    def scaled_attend(q, k, v):
        return attend(q * 1.0, k, v) * 1.0

    for round_ in range(2):
        for model in (attend, scaled_attend):
            leaves = [x[n].clone().requires_grad_() for n in "qkv"]
            out = torch.compile(model, backend="aot_eager", fullgraph=True)(*leaves)
            out.backward(x["dout"])
            got = {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}
            for name in ("out", "dq", "dk", "dv"):
                assert_matches(got[name], expected[name], f"round {round_} {model.__name__} {name}")
        torch._dynamo.reset()

# every CPU kernel besides the one "auto" (the other tests' default) runs: windowed if it takes a window
NAMED_KERNELS = [k for k in kernels_that_run() if k != auto_kernel()]


@pytest.mark.parametrize("kernel, window", [(k, (4, 0) if k in kernels_that_run((4, 0)) else (-1, -1))
                                            for k in NAMED_KERNELS])
def test_kernel_through_the_hcp_backend(one_rank_mesh, monkeypatch, kernel, window):
    """``backend="hcp"`` with a named kernel (aot_eager): the block ops run it inside (dense
    with segments of 8 rows and more as dense calls)."""
    monkeypatch.setattr(dense, "MIN_DENSE_ROWS", 8)
    torch._dynamo.reset()  # else the other case's window, traced again, would become symbolic
    case = AttentionCase("mixed", 4, 2, True, window)
    x, cu = case.inputs(), cu_seqlens(case.lengths)
    plan = hc.shard_plan(cu, one_rank_mesh)
    leaves = [plan.shard(x[n]).requires_grad_() for n in "qkv"]

    def attend(q, k, v, cu, longest):
        return hc.varlen_attention(q, k, v, cu, cu, longest, longest, causal=True, window_size=window)

    compiled = torch.compile(attend, backend="hcp", options={
        "mesh": one_rank_mesh, "inner": "aot_eager", "kernel": kernel})
    out = compiled(*leaves, cu, max(case.lengths))
    out.backward(plan.shard(x["dout"]))
    expected = expected_for(case)
    for name, got in (("out", out.detach()), *((f"d{n}", t.grad) for n, t in zip("qkv", leaves))):
        assert_matches(plan.unshard(got), expected[name], name)


# --------------------------------------------------------------------------------------------
# every CPU kernel under eager CP (a 2 x 2 world: local, group and ring documents, windows by
# position)
# --------------------------------------------------------------------------------------------

CP_MESH = (2, 2)
SUITE = "test_kernels:suite"


@dataclasses.dataclass(frozen=True)
class KernelCase(AttentionCase):
    """The attention under eager CP with every ring step on ``kernel`` (dense: segments of 4
    rows and more as dense calls of 2 significant bits, keys left over in stripes of 3 rows,
    results it leaves uninitialized NaN)."""

    kernel: str = "flex"

    @property
    def id(self) -> str:
        return f"{self.kernel}-{super().id}"

    def run(self, world: World) -> dict:
        saved = dense.MIN_DENSE_ROWS, dense.DENSE_SIZE_BITS, dense.STRIPE_ROWS, dense._results
        dense.MIN_DENSE_ROWS, dense.DENSE_SIZE_BITS, dense.STRIPE_ROWS = 4, 2, 3
        dense._results = nan_filled_results
        try:
            with hc.context_parallel(world.mesh, placement=self.placement, kernel=self.kernel):
                return self.attend(world, cu_seqlens(self.lengths), max(self.lengths))
        finally:
            dense.MIN_DENSE_ROWS, dense.DENSE_SIZE_BITS, dense.STRIPE_ROWS, dense._results = saved


CP_SHAPES = [KernelCase("many", 4, 2, True), KernelCase("mixed", 4, 1, True, (4, 0)),
             KernelCase("long", 4, 4, False, (3, 5)), KernelCase("long", 4, 4, True),
             KernelCase("mixed", 4, 1, False, placement="zigzag")]
# each case on every kernel besides "auto"'s that takes its window (by position: ring steps)
CP_CASES = [dataclasses.replace(case, kernel=kernel) for kernel in NAMED_KERNELS for case in CP_SHAPES
            if kernel in kernels_that_run(case.window, window_by_position=True, heads=(case.heads_q, case.heads_kv))]


def suite(mesh: tuple[int, int]) -> list:
    return CP_CASES


@pytest.mark.parametrize("case", CP_CASES, ids=lambda c: c.id)
def test_kernel_under_context_parallelism_matches_reference(cp_world, case):
    reference = expected_for(case)
    for rank, result in enumerate(cp_world(CP_MESH, suite=SUITE).values(case.id)):
        index = result["global_index"]
        for name in ("out", "dq", "dk", "dv"):
            got = result[name]
            pads = index < 0
            expected = reference[name][index.clamp(min=0)].masked_fill(pads[:, None, None], 0)
            assert_matches(got, expected, f"rank {rank} {name}")


# --------------------------------------------------------------------------------------------
# choosing a kernel
# --------------------------------------------------------------------------------------------

def request(device="cpu", dtype=torch.float32, head_dim=64, window=(-1, -1), cp=False) -> BlockRequest:
    q = torch.empty(1, 4, head_dim, dtype=dtype, device="meta")
    k = torch.empty(1, 2, head_dim, dtype=dtype, device="meta")
    return dataclasses.replace(BlockRequest.of(q, k, window, window_by_position=cp), device=torch.device(device))


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_registered_kernel_runs_by_its_name_or_says_why_not(traced_flex, name):
    """The op's ``kernel`` argument reaches that kernel: where it can run the call (on CPU:
    those of ``kernels_that_run()``) it gives the float64 reference's output and gradients; where it cannot, an
    InputError names it and why, never another kernel's answer."""
    lengths = (5, 9, 1)
    x = {n: seeded(f"registered/{n}", sum(lengths), 2, 8) for n in ("q", "k", "v", "dout")}
    cu = cu_seqlens(lengths)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v")]

    def attend(kernel: str) -> torch.Tensor:
        return torch.ops.hcp.varlen_attention(*leaves, cu, cu, max(lengths), max(lengths), True, 8 ** -0.5,
                                              -1, -1, kernel)[0]

    if KERNELS[name].supports(BlockRequest.of(leaves[0], leaves[1], (-1, -1))) is not None:
        with pytest.raises(hc.InputError, match=rf"\b{name}\b"):
            attend(name)
        return
    out = attend(name)
    out.backward(x["dout"])
    expected = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu.tolist(), cu.tolist(), causal=True)
    for got, want in zip((out.detach(), *(leaf.grad for leaf in leaves)), ("out", "dq", "dk", "dv")):
        assert_matches(got, expected[want], f"{name} {want}")


def test_auto_takes_the_fastest_measured_kernel_that_supports_the_call(monkeypatch):
    unwindowed = {"cpu": {"flex": 2e12, "torch": 1e12}, "NVIDIA X": {"flex": 400e12, "flash": 300e12}}
    windowed = {"cpu": {"flex": 2e12, "torch": 1e12}, "NVIDIA X": {"flex": 200e12, "flash": 300e12}}
    monkeypatch.setattr(measured, "throughputs",
                        lambda kind_of_call=None: windowed if kind_of_call == measured.WINDOW else unwindowed)
    monkeypatch.setattr(measured, "device_kind", lambda device: "NVIDIA X" if device.type == "cuda" else "cpu")
    monkeypatch.setattr(hc.kernels, "device_kind", measured.device_kind)
    assert resolve_kernel("auto", request("cpu")) == "flex"
    assert resolve_kernel("auto", request("cuda", torch.bfloat16)) == "flex"
    # flex cannot take head_dim 8 on CUDA: the next fastest measured one that can
    assert resolve_kernel("auto", request("cuda", torch.bfloat16, head_dim=8)) == "flash"
    # under a window, by the windowed measurements; a ring step's window rules flash out
    assert resolve_kernel("auto", request("cuda", torch.bfloat16, window=(8, 0))) == "flash"
    assert resolve_kernel("auto", request("cuda", torch.bfloat16, window=(8, 0), cp=True)) == "flex"


def test_auto_falls_back_to_cudnn_flash_flex_on_cuda_and_torch_on_cpu_when_unmeasured(monkeypatch):
    monkeypatch.setattr(measured, "throughputs", lambda kind_of_call=None: {})
    monkeypatch.setattr(hc.kernels, "device_kind", lambda device: "unmeasured")
    monkeypatch.setattr(cudnn, "frontend", lambda: (object(), None))
    monkeypatch.setattr(cudnn, "device_check", lambda device: None)
    assert resolve_kernel("auto", request("cpu")) == "torch"
    assert resolve_kernel("auto", request("cuda", torch.bfloat16)) == "cudnn"
    assert resolve_kernel("auto", request("cuda", torch.bfloat16, head_dim=8)) == "flash"  # cudnn: 16s only
    monkeypatch.setattr(cudnn, "device_check", lambda device: "failed its check on device 0")
    assert resolve_kernel("auto", request("cuda", torch.bfloat16)) == "flash"
    assert resolve_kernel("auto", request("cuda", torch.float32)) == "flex"  # fp16/bf16 kernels ruled out
    # a window by position (a ring step) rules cudnn and flash out: flex, not the torch reference
    assert resolve_kernel("auto", request("cuda", torch.bfloat16, window=(8, 0), cp=True)) == "flex"
    assert resolve_kernel("auto", request("cpu", window=(8, 0), cp=True)) == "torch"


def test_cudnn_that_fails_its_device_check_is_skipped_by_auto_and_named_raises_why(monkeypatch):
    """Where cuDNN's graphs fail on the device (an older cuDNN or GPU, a frontend that does not
    match the library), "auto" takes the next measured kernel without a word, and
    ``kernel="cudnn"`` raises the check's reason."""
    fastest_first = {"NVIDIA X": {"cudnn": 500e12, "flex": 400e12, "flash": 300e12}}
    monkeypatch.setattr(measured, "throughputs", lambda kind_of_call=None: fastest_first)
    monkeypatch.setattr(hc.kernels, "device_kind", lambda device: "NVIDIA X")
    monkeypatch.setattr(cudnn, "frontend", lambda: (object(), None))
    monkeypatch.setattr(cudnn, "device_check", lambda device: None)
    assert resolve_kernel("auto", request("cuda", torch.bfloat16)) == "cudnn"
    reason = "failed its check on device 0 (RuntimeError: no graph)"
    monkeypatch.setattr(cudnn, "device_check", lambda device: reason)
    assert resolve_kernel("auto", request("cuda", torch.bfloat16)) == "flex"
    with pytest.raises(hc.InputError, match=re.escape(f"kernel='cudnn' {reason}")):
        resolve_kernel("cudnn", request("cuda", torch.bfloat16))


def test_a_named_kernel_that_cannot_run_the_call_raises_its_reason(monkeypatch):
    ring_window = request("cuda", torch.bfloat16, window=(8, 0), cp=True)
    with pytest.raises(hc.InputError, match=re.escape(
            "kernel='flash' cannot apply a sliding window under context parallelism")) as raised:
        resolve_kernel("flash", ring_window, "X(kernel=...)")
    able = [name for name, kernel in KERNELS.items() if kernel.supports(ring_window) is None]
    assert "flex" in able and f"one of {able} (X(kernel=...))" in str(raised.value)
    with pytest.raises(hc.InputError, match="kernel='flex' needs fp16, bf16 or fp32 tensors; got torch.float64"):
        resolve_kernel("flex", request(dtype=torch.float64))
    with pytest.raises(hc.InputError, match="kernel='flex' needs head_dim of at least 16 on CUDA"):
        resolve_kernel("flex", request("cuda", torch.bfloat16, head_dim=8))
    assert resolve_kernel("flex", request("cuda", torch.bfloat16, window=(8, 0), cp=True)) == "flex"
    # one device, the window is by offsets inside the documents: flash can apply it
    assert resolve_kernel("flash", request("cuda", torch.bfloat16, window=(8, 0))) == "flash"
