"""CUDA only: the flash kernel against the plain-PyTorch kernel and the float64 reference, in
bf16 on one device (docs/design.md §6 tolerances: 2.5e-2, 3.5e-2 with GQA)."""

import pytest
import torch

import hcp_compile as hc
from checks import assert_matches, expected_for
from cp_cases import AttentionCase, cu_seqlens

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


def test_auto_kernel_uses_flash_for_bf16_on_cuda():
    case = CASES[0]
    x = {n: t.cuda().bfloat16() for n, t in case.inputs().items()}
    cu = cu_seqlens(case.lengths).cuda()
    longest = max(case.lengths)
    auto = hc.varlen_attention(x["q"], x["k"], x["v"], cu, cu, longest, longest, causal=True)
    flash, _ = torch.ops.hcp.varlen_attention(x["q"], x["k"], x["v"], cu, cu, longest, longest,
                                              True, case.head_dim ** -0.5, -1, -1, "flash")
    assert torch.equal(auto, flash)
