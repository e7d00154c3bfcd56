"""The dense kernel (docs/design.md §8.6): how it cuts a block into dense calls and varlen runs,
checked against the contract's element mask, and its forward and backward against the float64
reference on CPU (the CPU flash op as the dense call; cuDNN on CUDA is in test_gpu.py), with
segments long enough to be dense made tiny by lowering ``MIN_DENSE_ROWS`` (and their dense
calls' sizes coarse by lowering ``DENSE_SIZE_BITS``, so that rows are left over for the varlen
kernel). Under eager CP: test_kernels.py."""

from __future__ import annotations

import random

import pytest
import torch

from hcp_compile.testing.reference import reference_with_grads
from checks import assert_matches, nan_filled_results
from cp_cases import HEAD_DIM, cu_seqlens, seeded
from hcp_compile.kernels import BlockSpec, dense, run_backward, run_forward
from hcp_compile.kernels.merge import merge_partials


def contract_mask(cu_q: list[int], cu_k: list[int], causal: bool) -> torch.Tensor:
    """``[Tq, Tk]`` bool from the contract: query segment i sees key segment i, causally
    aligned bottom-right (query j of n sees keys up to m - n + j of m)."""
    mask = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        rows = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        keys = torch.arange(k1 - k0)[None, :]
        mask[q0:q1, k0:k1] = keys <= rows if causal else True
    return mask


def covered(pieces: dense.Cut, cu_q: list[int], cu_k: list[int], causal: bool) -> torch.Tensor:
    """How many times the pieces cover each (query, key) pair."""
    count = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.int64)
    for piece in pieces.dense:
        rows, keys = piece.q.stop - piece.q.start, piece.k.stop - piece.k.start
        block = torch.ones(rows, keys, dtype=torch.int64)
        count[piece.q, piece.k] += block.tril() if piece.causal else block  # top-left causal
    for run in pieces.varlen:  # a stripe's copies of its keys folded back onto them
        mask = contract_mask(list(run.cu_q), list(run.cu_k), run.causal).long()
        count[run.q, run.k] += mask.unflatten(1, (run.repeat, -1)).sum(1)
    return count


def random_block(seed: int) -> tuple[list[int], list[int]]:
    """``cu_q``, ``cu_k`` of a random block of long, short and empty segments, as many keys as
    queries or fewer or more (a ring step's shapes)."""
    rng = random.Random(seed)
    q_lengths = [rng.choice([0, 1, 3, 8, 9, 20, 27, 45]) for _ in range(rng.randint(1, 8))]
    k_lengths = [max(0, n + rng.choice([0, 0, -2, 5, 19])) for n in q_lengths]
    return cu_seqlens(tuple(q_lengths)).tolist(), cu_seqlens(tuple(k_lengths)).tolist()


@pytest.mark.parametrize("bits", [2, 3, 5])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("seed", range(6))
def test_pieces_cover_every_visible_pair_exactly_once(seed, causal, bits):
    """Random blocks (:func:`random_block`); dense calls of ``bits`` significant bits of rows
    and keys."""
    cu_q, cu_k = random_block(seed)
    q_lengths = [b - a for a, b in zip(cu_q, cu_q[1:])]
    k_lengths = [b - a for a, b in zip(cu_k, cu_k[1:])]
    pieces = dense.cut(cu_q, cu_k, causal, min_rows=8, bits=bits, stripe_rows=8)
    assert torch.equal(covered(pieces, cu_q, cu_k, causal), contract_mask(cu_q, cu_k, causal).long())
    long_segments = sum(min(q, k) >= 8 for q, k in zip(q_lengths, k_lengths))
    assert len({p.q.start for p in pieces.dense}) == long_segments
    for piece in pieces.dense:  # the sizes cuDNN builds graphs for: a bounded set
        for rows in (piece.rows, piece.keys):
            assert rows == dense.dense_rows(rows, bits) and rows >= 8
        assert piece.rows >= piece.q.stop - piece.q.start and piece.keys >= piece.k.stop - piece.k.start


def test_dense_rows_keep_the_leading_bits():
    sizes = (31, 32, 33, 4095, 4096, 4100, 4351, 4352, 131071)
    assert [dense.dense_rows(n, 5) for n in sizes] == [31, 32, 32, 3968, 4096, 4096, 4096, 4352, 126976]
    assert [dense.dense_rows(n, 5, up=True) for n in sizes] == [31, 32, 34, 4096, 4096, 4352, 4352, 4352, 131072]


@pytest.mark.parametrize("ranges, total, fills", [
    ([(0, 4), (4, 8)], 8, True),
    ([(0, 4)], 8, False),  # rows 4..8 unwritten: they need zeros first
    ([(0, 8), (2, 6)], 8, True),  # a merge with rows written before
    ([(0, 4), (2, 6), (6, 8)], 8, False),  # rows 4..6 merged before any piece wrote them
    ([(0, 4), (4, 8), (2, 6)], 8, True),
    ([(3, 3)], 0, True),
])
def test_results_need_no_zeros_only_when_every_row_is_written_before_a_merge(ranges, total, fills):
    assert dense._fills([slice(a, b) for a, b in ranges], total) is fills


def test_short_segments_next_to_each_other_are_one_varlen_run():
    pieces = dense.cut([0, 2, 4, 20, 21, 23], [0, 2, 4, 20, 21, 23], True, min_rows=8)
    assert [(r.q, r.k, r.cu_q, r.cu_k) for r in pieces.varlen] == [
        (slice(0, 4), slice(0, 4), (0, 2, 4), (0, 2, 4)), (slice(20, 23), slice(20, 23), (0, 1, 3), (0, 1, 3))]
    assert pieces.dense == (dense.Dense(slice(4, 20), slice(4, 20), True, 16),)


def test_a_long_segment_is_one_dense_call_on_its_rows_rounded_up():
    """20 rows with 2 bits: a causal call of 24 rows from the segment's first; a full segment
    of 20 x 20: 24 rows, 16 keys, the last 4 keys varlen."""
    pieces = dense.cut([0, 3, 23, 25], [0, 3, 23, 25], True, min_rows=8, bits=2)
    assert pieces.dense == (dense.Dense(slice(3, 23), slice(3, 23), True, 24),)
    assert [(r.q, r.k, r.cu_q, r.cu_k) for r in pieces.varlen] == [
        (slice(0, 3), slice(0, 3), (0, 3), (0, 3)), (slice(23, 25), slice(23, 25), (0, 2), (0, 2))]
    pieces = dense.cut([0, 20], [0, 20], False, min_rows=8, bits=2, stripe_rows=8)
    assert pieces.dense == (dense.Dense(slice(0, 20), slice(0, 16), False, 24),)
    # the 20 queries against the last 4 keys: three parts, each against its own copy of them
    assert pieces.varlen == (dense.Varlen(slice(0, 20), slice(16, 20), (0, 7, 14, 20), (0, 4, 8, 12), False, 3),)


LENGTHS = (9, 0, 3, 17, 1, 12)


@pytest.fixture
def tiny_dense_segments(monkeypatch):
    """Segments of 8 rows and more dense, in dense calls of 2 significant bits (9 rows: a call
    of 12 rows; 9 keys of a full segment: a call of 8, the last key in stripes of 4 rows);
    results the kernel leaves uninitialized NaN."""
    monkeypatch.setattr(dense, "MIN_DENSE_ROWS", 8)
    monkeypatch.setattr(dense, "DENSE_SIZE_BITS", 2)
    monkeypatch.setattr(dense, "STRIPE_ROWS", 4)
    monkeypatch.setattr(dense, "_results", nan_filled_results)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a whole block under the ``[Tq, Tk]`` element mask, plainly (KV heads
    repeated for GQA; a row with no visible key gives out 0 and lse -inf)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k).mul(scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(torch.where(mask.any(1)[:, None], scores, 0.0), dim=-1) * mask
    return torch.einsum("hqk,khd->qhd", probs, v), lse


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("seed", range(8))
def test_random_blocks_match_the_contract_s_attention(tiny_dense_segments, seed, causal):
    """The kernel's forward and backward on random ring-step-shaped blocks
    (:func:`random_block`: rectangles, stripes, rounded-up squares, rows and keys no piece
    covers) against float64 attention under the contract's element mask."""
    cu_q, cu_k = random_block(seed)
    tokens_q, tokens_k, scale = cu_q[-1], cu_k[-1], HEAD_DIM ** -0.5
    q, dout = (seeded(f"dense-random/{seed}/{n}", tokens_q, 4, HEAD_DIM).double() for n in ("q", "dout"))
    k, v = (seeded(f"dense-random/{seed}/{n}", tokens_k, 2, HEAD_DIM).double() for n in ("k", "v"))
    longest = max(1, *(b - a for cu in (cu_q, cu_k) for a, b in zip(cu, cu[1:])))
    spec = BlockSpec(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                     longest, longest, causal, scale)
    out, lse = run_forward("dense", q, k, v, spec)
    dq, dk, dv = run_backward("dense", dout, q, k, v, out, lse, spec)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected_out, expected_lse = masked_attention(*leaves, contract_mask(cu_q, cu_k, causal), scale)
    expected = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(expected_out, leaves, dout)))
    assert_matches(out, expected_out.detach(), "out")
    torch.testing.assert_close(lse, expected_lse.detach())
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_matches(got, expected[name], name)


# long and short segments; one long segment with rows left over; one whose rows are a dense
# size (the block is one dense call); only short ones (the block goes to the varlen kernel as
# it is)
BLOCKS = {"mixed": LENGTHS, "one": (20,), "aligned": (24,), "short": (3, 0, 5)}


@pytest.mark.parametrize("docs, dtype", [("mixed", torch.float64), ("mixed", torch.float32),
                                         ("one", torch.float64), ("aligned", torch.float64),
                                         ("short", torch.float64)], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
def test_dense_kernel_matches_reference(tiny_dense_segments, heads_kv, causal, docs, dtype):
    lengths = BLOCKS[docs]
    tokens, cu = sum(lengths), cu_seqlens(lengths)
    q, dout = (seeded(f"dense/{n}", tokens, 4, HEAD_DIM).to(dtype) for n in ("q", "dout"))
    k, v = (seeded(f"dense/{n}", tokens, heads_kv, HEAD_DIM).to(dtype) for n in ("k", "v"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = torch.ops.hcp.varlen_attention(*leaves, cu, cu, max(lengths), max(lengths), causal,
                                            HEAD_DIM ** -0.5, -1, -1, "dense")
    out.backward(dout)
    expected = reference_with_grads(q, k, v, dout, cu.tolist(), cu.tolist(), causal=causal)
    for name, got in (("out", out), ("dq", leaves[0].grad), ("dk", leaves[1].grad), ("dv", leaves[2].grad)):
        assert_matches(got, expected[name], name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_every_dense_call_has_a_size_of_the_bounded_set(tiny_dense_segments, monkeypatch, causal):
    """Batches of ever-new lengths: the dense op is called, forward and backward, only with
    row and key counts of 2 significant bits (what keeps cuDNN's graphs few), and the results
    stay the reference's."""
    calls = []
    for name in ("_dense_forward", "_dense_backward"):
        original = getattr(dense, name)

        def recording(*args, original=original, **kwargs):
            q, k = args[:2] if original is dense._dense_forward else args[1:3]
            calls.append((q.shape[0], k.shape[0]))
            return original(*args, **kwargs)

        monkeypatch.setattr(dense, name, recording)
    rng = random.Random(7)
    for batch in range(4):
        lengths = tuple(rng.randint(1, 40) for _ in range(rng.randint(2, 5)))
        tokens, cu = sum(lengths), cu_seqlens(lengths)
        q, dout = (seeded(f"dense-sizes/{batch}/{n}", tokens, 4, HEAD_DIM).double() for n in ("q", "dout"))
        k, v = (seeded(f"dense-sizes/{batch}/{n}", tokens, 2, HEAD_DIM).double() for n in ("k", "v"))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = torch.ops.hcp.varlen_attention(*leaves, cu, cu, max(lengths), max(lengths), causal,
                                                HEAD_DIM ** -0.5, -1, -1, "dense")
        out.backward(dout)
        expected = reference_with_grads(q, k, v, dout, cu.tolist(), cu.tolist(), causal=causal)
        for name, got in (("out", out), *((f"d{n}", t.grad) for n, t in zip("qkv", leaves))):
            assert_matches(got, expected[name], f"batch {batch} {name}")
    assert calls and all(n == dense.dense_rows(n, 2) for call in calls for n in call), calls


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("tensor", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_a_call_rounded_up_past_its_segment_keeps_the_next_segments_values_out(
        tiny_dense_segments, causal, tensor, value):
    """A 9-row document is a dense call of 12 rows (2 bits), which covers the next document's
    first 3 rows: a non-finite value there must reach neither the first document's results
    nor the third's."""
    lengths, poisoned_row = (9, 5, 6), 10
    tokens, cu = sum(lengths), cu_seqlens(lengths)
    clean = {n: seeded(f"dense-isolation/{n}", tokens, h, HEAD_DIM).double()
             for n, h in (("q", 4), ("k", 2), ("v", 2), ("dout", 4))}
    x = dict(clean)
    x[tensor] = clean[tensor].clone()
    x[tensor][poisoned_row, 0, 0] = value
    leaves = [x[n].clone().requires_grad_() for n in "qkv"]
    out, _ = torch.ops.hcp.varlen_attention(*leaves, cu, cu, max(lengths), max(lengths), causal,
                                            HEAD_DIM ** -0.5, -1, -1, "dense")
    out.backward(x["dout"])
    expected = reference_with_grads(clean["q"], clean["k"], clean["v"], clean["dout"], cu.tolist(), cu.tolist(),
                                    causal=causal)
    others = torch.cat([torch.arange(0, 9), torch.arange(14, tokens)])
    for name, got in (("out", out), *((f"d{n}", t.grad) for n, t in zip("qkv", leaves))):
        assert_matches(got[others], expected[name][others], name)


def test_blocks_whose_bounds_rule_out_a_dense_segment_skip_the_host_read(tiny_dense_segments, monkeypatch):
    """max_q/max_k below MIN_DENSE_ROWS: the varlen kernel runs the block without the
    boundaries being read on the host (a sync); a bound that allows a dense segment reads them."""
    reads = []
    read = dense._host_boundaries
    monkeypatch.setattr(dense, "_host_boundaries", lambda spec: reads.append(spec) or read(spec))
    lengths = BLOCKS["short"]
    tokens, cu = sum(lengths), cu_seqlens(lengths)
    q, k, v = (seeded(f"dense-bounds/{n}", tokens, 4, HEAD_DIM).double() for n in "qkv")
    expected = reference_with_grads(q, k, v, torch.zeros_like(q), cu.tolist(), cu.tolist(), causal=True)
    for bound, host_reads in ((max(lengths), 0), (dense.MIN_DENSE_ROWS, 1)):
        out, _ = run_forward("dense", q, k, v, BlockSpec(cu, cu, bound, bound, True, HEAD_DIM ** -0.5))
        assert_matches(out, expected["out"], f"bound {bound}")
        assert len(reads) == host_reads


def halves(lengths: tuple[int, ...], part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the first (0) or second (1) half of every document, and their cu_seqlens."""
    rows, counts, start = [], [], 0
    for n in lengths:
        half = range(start, start + n // 2) if part == 0 else range(start + n // 2, start + n)
        rows += half
        counts.append(len(half))
        start += n
    return torch.tensor(rows, dtype=torch.int64), cu_seqlens(tuple(counts))


@pytest.mark.parametrize("split", [False, True], ids=["one-block", "two-blocks-merged"])
def test_second_halves_against_whole_documents(tiny_dense_segments, split):
    check_second_halves(LENGTHS, split, torch.device("cpu"), torch.float64)


def check_second_halves(lengths: tuple[int, ...], split: bool, device: torch.device, dtype: torch.dtype,
                        kernel: str = "dense", **tol) -> None:
    """Queries of each document's second half, causal, against all its keys: one block (more
    keys than queries, aligned bottom-right: a full rectangle and a causal square), or the
    ring's two blocks (first halves full, second halves causal) merged, each backward given
    the merged out and lse. Against the reference of whole documents with the first halves'
    output gradient zero."""
    tokens, cu = sum(lengths), cu_seqlens(lengths)
    q, dout, k, v = (seeded(f"dense-halves/{n}", tokens, h, HEAD_DIM).to(dtype)
                     for n, h in (("q", 4), ("dout", 4), ("k", 2), ("v", 2)))
    rows, cu_q = halves(lengths, 1)
    first, cu_first = halves(lengths, 0)
    scale, longest = HEAD_DIM ** -0.5, max(lengths)
    if split:
        blocks = [(first, BlockSpec(cu_q, cu_first, longest, longest, False, scale)),
                  (rows, BlockSpec(cu_q, cu_q, longest, longest, True, scale))]
    else:
        blocks = [(torch.arange(tokens), BlockSpec(cu_q, cu, longest, longest, True, scale))]
    on = lambda t: t.to(device)  # noqa: E731
    blocks = [(keys, BlockSpec(on(spec.cu_q), on(spec.cu_k), longest, longest, spec.causal, scale))
              for keys, spec in blocks]
    out = lse = None
    for keys, spec in blocks:
        out, lse = merge_partials(out, lse, *run_forward(kernel, on(q[rows]), on(k[keys]), on(v[keys]), spec))
    out = out.to(dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    for keys, spec in blocks:
        grads = run_backward(kernel, on(dout[rows]), on(q[rows]), on(k[keys]), on(v[keys]), out, lse, spec)
        dq[rows] += grads[0].cpu().double()
        dk[keys] += grads[1].cpu().double()
        dv[keys] += grads[2].cpu().double()
    dout_second = torch.zeros_like(dout)
    dout_second[rows] = dout[rows]
    expected = reference_with_grads(q, k, v, dout_second, cu.tolist(), cu.tolist(), causal=True)
    assert_matches(out.cpu(), expected["out"][rows], "out", **tol)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_matches(got, expected[name], name, **tol)

