"""Rows outside every segment, for every kernel (kernels/contract.py, ``BlockSpec``): a query
row past ``cu_q``'s last entry gets out 0, lse -inf and no gradient, a key row past ``cu_k``'s
last entry no gradient, and neither changes another row's results; a table whose segments
are all empty (a ring step the window skips, in a compiled graph: docs/design.md §3.3)
computes nothing. Each kernel on its own (the tables unknown to the host) and through the
ops where the host knows where the segments end (``HOST_READS``: the schedule's tables), then
the merge of a step that computed nothing. CPU: torch, flex, dense (its dense pieces made
tiny) and cudnn's calls through the CPU stand-in of test_cudnn_kernel; CUDA (``gpu``):
flash, cudnn, flex and dense in bf16."""

from __future__ import annotations

import pytest
import torch

from checks import assert_matches
from cp_cases import HEAD_DIM, cu_seqlens, seeded
from hcp_compile.kernels import BlockSpec, cudnn, dense, run_backward, run_forward
from hcp_compile.kernels.contract import HOST_READS
from hcp_compile.kernels.flex_mask import build_document_mask
from hcp_compile.kernels.merge import accumulate, merge_partials
from hcp_compile.testing.reference import reference_with_grads
from test_cudnn_kernel import HAS_FRONTEND, PoisonedBuffers, RaggedStandIn

# a ring step's segments with an empty one, then rows past them: more queries than keys
LENGTHS = (5, 0, 7, 3)
ROWS_PAST = {"q": 6, "k": 4}
MASKS = {"causal": (True, (-1, -1)), "full": (False, (-1, -1)), "causal-w3.0": (True, (3, 0))}
# rows past the segments hold large values: a row that attended them would show
PAST_VALUE = 30.0

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_cudnn = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_FRONTEND),
                                 reason="needs a CUDA device and the nvidia-cudnn-frontend package")
GPU = [pytest.mark.gpu, needs_cuda]
# (kernel, device, variant): "pieces" runs the dense kernel's dense calls (segments made long
# enough), "stand-in" cudnn's calls on CPU
RUNS = [
    pytest.param("torch", "cpu", "", id="torch"),
    pytest.param("flex", "cpu", "", id="flex"),
    pytest.param("dense", "cpu", "", id="dense"),
    pytest.param("dense", "cpu", "pieces", id="dense-pieces"),
    pytest.param("cudnn", "cpu", "stand-in", id="cudnn-stand-in"),
    pytest.param("flash", "cuda", "", id="cuda-flash", marks=GPU),
    pytest.param("cudnn", "cuda", "", id="cuda-cudnn", marks=[*GPU, needs_cudnn]),
    pytest.param("flex", "cuda", "", id="cuda-flex", marks=GPU),
    pytest.param("dense", "cuda", "", id="cuda-dense", marks=GPU),
]


def prepared_kernel(kernel: str, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if variant == "pieces":
        monkeypatch.setattr(dense, "MIN_DENSE_ROWS", 4)
        monkeypatch.setattr(dense, "DENSE_SIZE_BITS", 2)
    if variant == "stand-in":
        monkeypatch.setattr(cudnn, "GRAPHS", RaggedStandIn())
        monkeypatch.setattr(cudnn, "uninitialized", PoisonedBuffers())


def block(device: str, empty: bool, host_knows: bool, causal: bool, window: tuple[int, int]) -> BlockSpec:
    """The block's spec on ``device``: queries and keys segmented alike (two tables, as a ring
    step's), or every segment empty; the tables' host copies kept in ``HOST_READS`` where
    ``host_knows`` (as the schedule's are), else unknown to the host."""
    cu = cu_seqlens(LENGTHS)
    tables = [torch.zeros_like(cu) if empty else cu for _ in "qk"]
    on_device = [t.to(device, copy=True) for t in tables]
    if host_knows:
        for table, values in zip(on_device, tables):
            HOST_READS.put_table(table, values)
    return BlockSpec(*on_device, max(LENGTHS), max(LENGTHS), causal, 64 ** -0.5, *window, equal_lengths=True)


def inputs(device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    dim = HEAD_DIM if device == "cpu" else 64
    rows = {"q": sum(LENGTHS) + ROWS_PAST["q"], "k": sum(LENGTHS) + ROWS_PAST["k"]}
    x = {n: seeded(f"past/{n}", rows[side], heads, dim)
         for n, side, heads in (("q", "q", 4), ("k", "k", 2), ("v", "k", 2), ("dout", "q", 4))}
    for name, t in x.items():
        t[sum(LENGTHS):] = PAST_VALUE
    return {n: t.to(device, dtype) for n, t in x.items()}


@pytest.mark.parametrize("kernel, device, variant", RUNS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("empty", [False, True], ids=["segments", "all-empty"])
@pytest.mark.parametrize("host_knows", [False, True], ids=["kernel", "op"])
def test_rows_outside_every_segment_see_nothing(kernel, device, variant, mask, empty, host_knows, monkeypatch):
    """Against the float64 reference of the segments' rows alone; every row past the segments
    (all of them where the segments are empty) out 0, lse -inf, gradient 0."""
    causal, window = MASKS[mask]
    if kernel == "dense" and window != (-1, -1):
        pytest.skip("the dense kernel takes no window")
    prepared_kernel(kernel, variant, monkeypatch)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = inputs(device, dtype)
    spec = block(device, empty, host_knows, causal, window)
    out, lse = run_forward(kernel, x["q"], x["k"], x["v"], spec)
    dq, dk, dv = run_backward(kernel, x["dout"], x["q"], x["k"], x["v"], out, lse, spec)
    inside = 0 if empty else sum(LENGTHS)
    tolerance = {} if device == "cpu" else {"atol": 3.5e-2, "rtol": 3.5e-2}
    if inside:
        cu = cu_seqlens(LENGTHS).tolist()
        expected = reference_with_grads(*(x[n][:inside].cpu().float() for n in ("q", "k", "v", "dout")), cu, cu,
                                        causal=causal, window=window, scale=64 ** -0.5)
        for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert_matches(got[:inside].cpu().float(), expected[name], name, **tolerance)
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert (got[inside:] == 0).all(), f"{name}: a row past the segments is not 0"
    assert torch.isneginf(lse[:, inside:]).all()


@pytest.mark.parametrize("kernel, device, variant", RUNS)
def test_merging_a_step_that_computed_nothing_changes_nothing(kernel, device, variant, monkeypatch):
    """The ring merges every step (compiled: the steps a window skips too, their tables empty):
    a step whose segments are all empty leaves the merged out, lse and gradients of the others
    as they are, rows no step saw included (0, -inf)."""
    prepared_kernel(kernel, variant, monkeypatch)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = inputs(device, dtype)
    seen = block(device, False, False, True, (-1, -1))
    skipped = block(device, True, False, True, (-1, -1))
    out, lse = run_forward(kernel, x["q"], x["k"], x["v"], seen)
    merged_out, merged_lse = merge_partials(out.clone(), lse.clone(), *run_forward(kernel, x["q"], x["k"], x["v"],
                                                                                   skipped), out_dtype=dtype)
    assert torch.equal(merged_out, out) and torch.equal(merged_lse, lse)
    grads = run_backward(kernel, x["dout"], x["q"], x["k"], x["v"], out, lse, seen)
    nothing = run_backward(kernel, x["dout"], x["q"], x["k"], x["v"], out, lse, skipped)
    for grad, none in zip(grads, nothing):
        assert torch.equal(accumulate(grad.clone(), none, out_dtype=dtype), grad)


def test_flex_builds_no_block_for_rows_outside_every_segment():
    """Flex's block mask: the rows past the segments (queries and keys alike) are in no block
    pair, and a table of empty segments leaves every pair out (flex then computes nothing)."""
    q_rows, k_rows = 300, 260
    for lengths in ((100, 0, 28), (0, 0, 0)):
        cu = cu_seqlens(lengths)
        mask = build_document_mask(BlockSpec(cu, cu.clone(), 128, 128, False, 1.0), q_rows, k_rows).block_mask
        pairs = mask.kv_num_blocks + mask.full_kv_num_blocks
        blocks = -(-sum(lengths) // 128)
        assert pairs[0, 0, :blocks].tolist() == [1] * blocks, lengths
        assert (pairs[0, 0, blocks:] == 0).all(), lengths
