"""CUDA only: the flash and flex kernels against the plain-PyTorch kernel and the float64
reference, in bf16 on one device (docs/design.md §6 tolerances: 2.5e-2, 3.5e-2 with GQA),
including flex's backward given the merged out and lse of two blocks (a ring step's shape) and
blocks of several 128-row mask blocks, and the dense kernel (cuDNN) the same way."""

import pytest
import torch

import hcp_compile as hc
from hcp_compile.testing.reference import reference_with_grads
from checks import assert_matches, expected_for, nan_filled_results
from cp_cases import AttentionCase, cu_seqlens, seeded
from hcp_compile.kernels import KERNELS, BlockRequest, measured, BlockSpec, new_cache_key, resolve_kernel, run_backward, run_forward
from hcp_compile.kernels import dense, flex
from hcp_compile.kernels.merge import merge_partials
from test_dense_kernel import check_second_halves
from test_kernels import split_keys

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = [
    AttentionCase(docs, hq, hkv, causal, window, head_dim=64)
    for docs in ("mixed", "long")
    for hq, hkv in ((4, 4), (4, 1))
    for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (4, 0)), (False, (3, 5)))
]


def bf16_tolerance(case: AttentionCase) -> dict:
    tol = 2.5e-2 if case.heads_q == case.heads_kv else 3.5e-2
    return {"atol": tol, "rtol": tol}


def run_kernel(case: AttentionCase, kernel: str) -> dict[str, torch.Tensor]:
    """``torch.ops.hcp.varlen_attention`` with one kernel on CUDA in bf16, with gradients."""
    x = {n: t.cuda().bfloat16() for n, t in case.inputs().items()}
    leaves = [x[n].requires_grad_() for n in ("q", "k", "v")]
    cu = cu_seqlens(case.lengths).cuda()
    longest = max(case.lengths)
    scale = case.head_dim ** -0.5
    out, lse = torch.ops.hcp.varlen_attention(
        *leaves, cu, cu, longest, longest, case.causal, scale, *case.window, kernel
    )
    out.backward(x["dout"])
    grads = {f"d{n}": leaf.grad for n, leaf in zip("qkv", leaves)}
    return {"out": out.detach(), "lse": lse, **grads}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_flash_and_torch_kernels_match_reference_in_bf16(case):
    flash, plain = run_kernel(case, "flash"), run_kernel(case, "torch")
    reference = expected_for(case, torch.bfloat16)
    tol = bf16_tolerance(case)
    for name in ("out", "dq", "dk", "dv"):
        assert_matches(flash[name].cpu(), reference[name], f"flash {name}", **tol)
        assert_matches(plain[name].cpu(), reference[name], f"torch {name}", **tol)
        assert_matches(flash[name].cpu(), plain[name].cpu(), f"flash vs torch {name}", **tol)
    torch.testing.assert_close(flash["lse"], plain["lse"], **tol)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_flex_matches_flash_and_reference_in_bf16(case):
    flex, flash = run_kernel(case, "flex"), run_kernel(case, "flash")
    reference = expected_for(case, torch.bfloat16)
    tol = bf16_tolerance(case)
    for name in ("out", "dq", "dk", "dv"):
        assert_matches(flex[name].cpu(), reference[name], f"flex {name}", **tol)
        assert_matches(flex[name].cpu(), flash[name].cpu(), f"flex vs flash {name}", **tol)
    torch.testing.assert_close(flex["lse"], flash["lse"], **tol)


# several 128-row mask blocks: full, partial and skipped ones, documents spanning blocks
LONG_DOCS = (700, 1, 300, 0, 129, 128, 1000, 5)
LONG_MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (100, 0)), (False, (64, 200))]


def bf16_inputs(name: str, tokens: int, heads_q: int, heads_kv: int, dim: int = 64) -> dict:
    return {"q": seeded(f"{name}/q", tokens, heads_q, dim).bfloat16(),
            "k": seeded(f"{name}/k", tokens, heads_kv, dim).bfloat16(),
            "v": seeded(f"{name}/v", tokens, heads_kv, dim).bfloat16(),
            "dout": seeded(f"{name}/dout", tokens, heads_q, dim).bfloat16()}


@pytest.mark.parametrize("causal, window", LONG_MASKS, ids=lambda m: str(m))
def test_flex_over_many_mask_blocks_matches_reference_in_bf16(causal, window):
    x = bf16_inputs(f"long-{causal}-{window}", sum(LONG_DOCS), 8, 2)
    cu = cu_seqlens(LONG_DOCS)
    leaves = [x[n].cuda().requires_grad_() for n in "qkv"]
    longest = max(LONG_DOCS)
    out, _ = torch.ops.hcp.varlen_attention(*leaves, cu.cuda(), cu.cuda(), longest, longest, causal,
                                            64 ** -0.5, *window, "flex")
    out.backward(x["dout"].cuda())
    expected = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu.tolist(), cu.tolist(),
                                    causal=causal, window=window)
    got = {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}
    for name in ("out", "dq", "dk", "dv"):
        assert_matches(got[name].cpu(), expected[name], name, atol=3.5e-2, rtol=3.5e-2)


@pytest.mark.parametrize("causal, window", LONG_MASKS, ids=lambda m: str(m))
def test_flex_backward_given_merged_out_and_lse_in_bf16(causal, window):
    """Two blocks over disjoint keys of every document (positions inside the document, as a
    ring step passes them), merged in fp32; each backward gets the merged out and lse, and
    their sum is the whole attention's gradient."""
    x = bf16_inputs(f"merged-{causal}-{window}", sum(LONG_DOCS), 8, 2)
    q, k, v, dout = (x[n].cuda() for n in ("q", "k", "v", "dout"))
    cu = cu_seqlens(LONG_DOCS).cuda()
    positions = torch.cat([torch.arange(n) for n in LONG_DOCS]).cuda()
    blocks = []
    for part in (0, 1):
        rows, cu_k = (t.cuda() for t in split_keys(LONG_DOCS, part))
        blocks.append((rows, BlockSpec(cu, cu_k, max(LONG_DOCS), max(LONG_DOCS), causal, 64 ** -0.5,
                                       *window, positions, positions[rows])))
    out = lse = None
    for rows, spec in blocks:
        out, lse = merge_partials(out, lse, *run_forward("flex", q, k[rows], v[rows], spec))
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rows, spec in blocks:
        dq_b, dk_b, dv_b = run_backward("flex", dout, q, k[rows], v[rows], out.to(q.dtype), lse, spec)
        dq += dq_b
        dk[rows], dv[rows] = dk_b, dv_b
    expected = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu.tolist(), cu.tolist(),
                                    causal=causal, window=window)
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_matches(got.cpu(), expected[name], name, atol=3.5e-2, rtol=3.5e-2)


@pytest.fixture
def dense_from_128_rows(monkeypatch):
    """Segments of LONG_DOCS with 128 rows or more run as cuDNN calls, the others in flash;
    results the kernel leaves uninitialized NaN."""
    monkeypatch.setattr(dense, "MIN_DENSE_ROWS", 128)
    monkeypatch.setattr(dense, "_results", nan_filled_results)


@pytest.mark.parametrize("heads_kv", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dense_matches_flash_and_reference_in_bf16(dense_from_128_rows, causal, heads_kv):
    x = bf16_inputs(f"dense-{causal}-{heads_kv}", sum(LONG_DOCS), 8, heads_kv)
    cu = cu_seqlens(LONG_DOCS)
    expected = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu.tolist(), cu.tolist(), causal=causal)
    results = {}
    for kernel in ("dense", "flash"):
        leaves = [x[n].cuda().requires_grad_() for n in "qkv"]
        out, lse = torch.ops.hcp.varlen_attention(*leaves, cu.cuda(), cu.cuda(), max(LONG_DOCS), max(LONG_DOCS),
                                                  causal, 64 ** -0.5, -1, -1, kernel)
        out.backward(x["dout"].cuda())
        results[kernel] = {"out": out.detach(), "lse": lse, **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}
    for name in ("out", "dq", "dk", "dv"):
        assert_matches(results["dense"][name].cpu(), expected[name], name, atol=3.5e-2, rtol=3.5e-2)
        assert_matches(results["dense"][name].cpu(), results["flash"][name].cpu(), f"dense vs flash {name}",
                       atol=3.5e-2, rtol=3.5e-2)
    torch.testing.assert_close(results["dense"]["lse"], results["flash"]["lse"], atol=3.5e-2, rtol=3.5e-2)


def test_dense_backward_after_a_call_of_the_same_shape_in_other_layouts(dense_from_128_rows):
    """torch caches cuDNN's backward graph by q, k and v's layouts only. A block that is one
    256-row document, then a block whose 256-row segment is one of its dense calls (its lse a
    slice of the block's) given an output gradient laid out heads-first: both must match the
    reference (they did not while the lse and the gradient were passed in their own layouts)."""
    for lengths, heads_first_dout in (((256,), False), ((256, 100), True)):
        tokens, cu = sum(lengths), cu_seqlens(lengths)
        x = bf16_inputs(f"dense-layouts-{tokens}", tokens, 8, 2)
        dout = x["dout"].cuda()
        if heads_first_dout:  # the same values, in [H, T, D] memory
            dout = dout.transpose(0, 1).contiguous().transpose(0, 1)
        leaves = [x[n].cuda().requires_grad_() for n in "qkv"]
        out, _ = torch.ops.hcp.varlen_attention(*leaves, cu.cuda(), cu.cuda(), max(lengths), max(lengths), True,
                                                64 ** -0.5, -1, -1, "dense")
        out.backward(dout)
        expected = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu.tolist(), cu.tolist(), causal=True)
        for name, got in zip(("dq", "dk", "dv"), (t.grad for t in leaves)):
            assert_matches(got.cpu(), expected[name], f"{lengths} {name}", atol=3.5e-2, rtol=3.5e-2)


@pytest.mark.parametrize("split", [False, True], ids=["one-block", "two-blocks-merged"])
def test_dense_backward_given_merged_out_and_lse_in_bf16(dense_from_128_rows, split):
    check_second_halves(LONG_DOCS, split, torch.device("cuda"), torch.bfloat16, atol=3.5e-2, rtol=3.5e-2)


def test_auto_kernel_is_the_fastest_measured_on_this_device():
    """kernel="auto" runs what resolve_kernel picks for the call (the fastest kernel that
    kernels/measured.json records for this device among those that can run the call), and gives
    that kernel's result."""
    case = CASES[0]
    x = {n: t.cuda().bfloat16() for n, t in case.inputs().items()}
    cu = cu_seqlens(case.lengths).cuda()
    longest = max(case.lengths)
    request = BlockRequest.of(x["q"], x["k"])
    chosen = resolve_kernel("auto", request)
    recorded = measured.throughputs().get(measured.device_kind(x["q"].device))
    able = {name: speed for name, speed in (recorded or {}).items() if KERNELS[name].supports(request) is None}
    if able:  # the fastest measured kernel that can run here (cudnn only where its package works)
        assert chosen == max(able, key=able.get)
    auto = hc.varlen_attention(x["q"], x["k"], x["v"], cu, cu, longest, longest, causal=True)
    named, _ = torch.ops.hcp.varlen_attention(x["q"], x["k"], x["v"], cu, cu, longest, longest,
                                              True, case.head_dim ** -0.5, -1, -1, chosen)
    assert torch.equal(auto, named)




def test_flex_block_of_padded_rows_queues_without_waiting_for_the_gpu():
    """A block whose rows are no multiple of 128 is padded to whole mask blocks; once warm
    (compiled, its mask cached under the spec's key, as every layer after the first finds it),
    its forward and backward queue their work without a host sync. A sync per block left the
    GPU idle while the host caught up: 4-7 ms per step of W4 under CP on an H200."""
    flex.clear_compiled()  # this block's row shape gets graphs of its own, as a model's first shapes do
    x = bf16_inputs("no-sync", sum(LONG_DOCS), 8, 2)
    q, k, v, dout = (x[n].cuda() for n in ("q", "k", "v", "dout"))
    cu = cu_seqlens(LONG_DOCS).cuda()
    assert q.shape[0] % 128 != 0  # premise: the block is padded
    spec = BlockSpec(cu, cu, max(LONG_DOCS), max(LONG_DOCS), True, 64 ** -0.5, 100, 0,
                     cache_key=new_cache_key(1))
    out, lse = run_forward("flex", q, k, v, spec)
    run_backward("flex", dout, q, k, v, out, lse, spec)  # warm: compiled, mask cached
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = run_forward("flex", q, k, v, spec)
        dq, dk, dv = run_backward("flex", dout, q, k, v, out, lse, spec)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu.tolist(), cu.tolist(),
                                    causal=True, window=(100, 0))
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_matches(got.cpu(), expected[name], name, atol=3.5e-2, rtol=3.5e-2)
