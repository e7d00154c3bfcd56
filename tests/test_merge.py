"""hcp_compile/kernels/merge.py: the ring's merge of partial softmax results and the fp32 sums, against
a float64 reference computed from first principles (the merged lse a logsumexp of the two, the
weights exp(lse_i - lse)), with rows unseen on one side, on both sides, no rows at all, head
dims 8/64/80/128, 1 and 3 heads, bf16 and fp32 outputs:

- the torch expressions on CPU (what eager CPU runs and what a compiled graph fuses);
- the Triton kernels under Triton's interpreter on CPU (``TRITON_INTERPRET=1`` must be set
  before the kernels are defined, so those checks run in a subprocess);
- CUDA (skipped without a device): the Triton path that ``merge_partials`` and ``accumulate``
  take there against the torch expressions and the reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hcp_compile.kernels import merge
from hcp_compile.kernels.merge import accumulate, merge_partials, merge_partials_torch

INF = float("inf")
HEAD_DIMS = (8, 64, 80, 128)
HEADS = (1, 3)
OUT_DTYPES = (torch.bfloat16, torch.float32)
# (tokens, heads, head_dim, out dtype). 0 rows; 1; 45 rows span two 32-row tiles at D = 80 and
# 128 (a tile is 4096 // next_pow2(D) rows, 16..256); 300 rows two 256-row tiles at D = 8.
# The interpreter runs a program in ~25 ms, so CPU takes these; CUDA more and longer.
CASES = [(t, h, d, dt) for t in (0, 1, 45) for h in HEADS for d in HEAD_DIMS for dt in OUT_DTYPES]
CASES += [(300, 3, 8, dt) for dt in OUT_DTYPES]
CUDA_CASES = CASES + [
    (t, h, d, dt)
    for t in (300, 4099) for h in HEADS for d in (*HEAD_DIMS, 256) for dt in OUT_DTYPES
]
TOL = {"atol": 2e-5, "rtol": 2e-5}
BF16_STEP = {"atol": 1e-6, "rtol": 2 ** -7}  # one bf16 rounding step

# tests/test_gpu.py's marks, per test here (the rest of the file runs on CPU)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def case_id(case) -> str:
    tokens, heads, dim, dtype = case
    return f"T{tokens}-H{heads}-D{dim}-{str(dtype).removeprefix('torch.')}"


def make_inputs(tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int = 0,
                device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """A running ``(out, lse)`` and a block's: token ``r`` of head ``h`` is unseen by the running
    result when ``(r + h) % 5 == 0``, by the block when ``== 1``, by both when ``== 2``. The
    out rows of unseen sides are random, not 0: the merge must give them weight 0."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    block_out = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    lse = torch.randn(heads, tokens, generator=g) * 3 + 2
    block_lse = torch.randn(heads, tokens, generator=g) * 3 + 2
    which = (torch.arange(tokens)[None, :] + torch.arange(heads)[:, None]) % 5
    lse[(which == 0) | (which == 2)] = -INF
    block_lse[(which == 1) | (which == 2)] = -INF
    return tuple(t.to(device) for t in (out, lse, block_out, block_lse))


def reference(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, from first principles: lse = log(exp(a) + exp(b)) (shifted by the larger),
    out = sum_i out_i exp(lse_i - lse); a row neither side saw is (0, -inf)."""
    a, b = lse.double(), block_lse.double()
    high = torch.maximum(a, b)
    seen = high > -INF
    shift = torch.where(seen, high, 0)
    merged = torch.where(seen, shift + torch.log(torch.exp(a - shift) + torch.exp(b - shift)), -INF)
    base = torch.where(seen, merged, 0)
    old = torch.where(seen, torch.exp(a - base), 0).t().unsqueeze(-1)
    new = torch.where(seen, torch.exp(b - base), 0).t().unsqueeze(-1)
    return out.double() * old + block_out.double() * new, merged


def special_inputs(dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Every pair of lse values from {-inf, -3, 0.5, 7, +inf, nan}, one token each (2 heads)."""
    values = torch.tensor([-INF, -3.0, 0.5, 7.0, INF, float("nan")])
    a, b = torch.cartesian_prod(values, values).t()
    lse = torch.stack([a, b.flip(0)])
    block_lse = torch.stack([b, a.flip(0)])
    g = torch.Generator().manual_seed(3)
    out = torch.randn(a.numel(), 2, 24, generator=g).to(dtype)
    block_out = torch.randn(a.numel(), 2, 24, generator=g).to(dtype)
    return tuple(t.to(device) for t in (out, lse, block_out, block_lse))


class RecordOps(TorchDispatchMode):
    """The aten ops run under it (a dispatch mode, as make_fx or an op counter uses)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def check_against_reference(got_out, got_lse, inputs, out_dtype=torch.float32):
    expected_out, expected_lse = (t.cpu() for t in reference(*inputs))
    assert got_out.dtype == out_dtype and got_lse.dtype == torch.float32
    assert got_out.shape == inputs[0].shape and got_lse.shape == inputs[1].shape
    torch.testing.assert_close(got_lse.double().cpu(), expected_lse, **TOL)
    torch.testing.assert_close(got_out.double().cpu(), expected_out, **TOL)
    unseen = (expected_lse == -INF).t().cpu()
    assert (got_out.cpu()[unseen] == 0).all() and (got_lse.cpu().t()[unseen] == -INF).all()


# --------------------------------------------------------------------------------------------
# (a) the torch expressions, on CPU
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_torch_merge_matches_reference(case):
    inputs = make_inputs(*case)
    check_against_reference(*merge_partials(*inputs), inputs)


def test_merge_dtypes_and_first_block():
    out, lse, block_out, block_lse = make_inputs(5, 2, 8, torch.bfloat16)
    # the first block is taken as it is (no copy), or converted when asked
    first = merge_partials(None, None, block_out, block_lse)
    assert first[0] is block_out and first[1] is block_lse
    first = merge_partials(None, None, block_out, block_lse, out_dtype=torch.float32)
    assert first[0].dtype == torch.float32 and torch.equal(first[0], block_out.float())
    # fp16 / bf16 outputs with fp32 lse merge in fp32; float64 in float64
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        merged = merge_partials(out.to(dtype), lse, block_out.to(dtype), block_lse)
        assert merged[0].dtype == torch.float32 and merged[1].dtype == torch.float32
    inputs64 = [t.double() for t in (out, lse, block_out, block_lse)]
    merged = merge_partials(*inputs64)
    assert merged[0].dtype == torch.float64 and merged[1].dtype == torch.float64
    torch.testing.assert_close(merged[0], reference(*inputs64)[0], rtol=1e-12, atol=1e-12)
    # out_dtype is .to(out_dtype) of the result
    full = merge_partials(out, lse, block_out, block_lse)
    last = merge_partials(out, lse, block_out, block_lse, out_dtype=torch.bfloat16)
    assert torch.equal(last[0], full[0].to(torch.bfloat16)) and torch.equal(last[1], full[1])


def test_accumulate_on_cpu():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 8, generator=g).bfloat16()
    y = torch.randn(6, 3, 8, generator=g).bfloat16()
    assert accumulate(None, x) is x  # one block: not converted
    first = accumulate(x.clone(), y)  # a block in the input dtype: a new fp32 sum
    assert first.dtype == torch.float32 and torch.equal(first, x.float() + y.float())
    expected = first + x.float()
    again = accumulate(first, x)  # fp32, contiguous: in place
    assert again is first and torch.equal(again, expected)
    strided = torch.randn(8, 3, 6, generator=g).transpose(0, 2)  # fp32, not contiguous
    summed = accumulate(strided, x)
    assert summed is not strided and torch.equal(summed, strided + x.float())
    x64 = x.double()
    assert accumulate(x64.clone(), y.double()).dtype == torch.float64
    leaf = torch.zeros(6, 3, 8, requires_grad=True)  # autograd: never in place
    assert accumulate(leaf, x) is not leaf
    # out_dtype: .to() of the sum (the last sum, in the input dtype)
    acc = torch.randn(6, 3, 8, generator=g)
    expected = (acc + x.float()).to(torch.bfloat16)
    assert torch.equal(accumulate(acc, x, out_dtype=torch.bfloat16), expected)
    assert accumulate(None, x, out_dtype=torch.float32).dtype == torch.float32
    # under a dispatch mode (make_fx, an op counter): one op, into a new tensor
    before = acc.clone()
    with RecordOps() as mode:
        summed = accumulate(acc, x)
    assert summed is not acc and torch.equal(acc, before)
    assert mode.ops == [torch.ops.hcp.accumulate_step.default]
    assert torch.equal(summed, before + x.float())


def test_compiled_graph_calls_one_op_per_merge_and_sum():
    """Traced, each is one functional op (``hcp::merge_step``, ``hcp::accumulate_step``) in one
    graph (no break at the eager branches, nothing written into the inputs), with the eager
    values. As torch expressions, Inductor fused a ring's chain of them into one region that
    kept every step's block result alive (kernels/merge.py)."""
    import torch._dynamo

    def ring_like(out, lse, block_out, block_lse, acc, x):
        merged, merged_lse = merge_partials(out, lse, block_out, block_lse,
                                            out_dtype=torch.bfloat16)
        return merged, merged_lse, accumulate(acc, x)

    inputs = make_inputs(9, 2, 8, torch.float32)
    acc, x = torch.randn(9, 2, 8), torch.randn(9, 2, 8).bfloat16()
    keep = [t.clone() for t in (*inputs, acc)]
    torch._dynamo.reset()
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(ring_like, backend=keep_graph, fullgraph=True)
    got = compiled(*inputs, acc, x)
    (graph,) = graphs
    called = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.hcp.merge_step.default in called and torch.ops.hcp.accumulate_step.default in called
    assert torch.logaddexp not in called and torch.ops.aten.logaddexp.default not in called
    for before, after in zip(keep, (*inputs, acc)):
        assert torch.equal(before, after)
    expected = ring_like(*keep[:4], keep[4].clone(), x)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                              (torch.bfloat16, torch.bfloat16), (torch.float64, None)])
def test_step_ops_pass_opcheck_and_match_the_expressions(dtype, out_dtype):
    """The ops' schemas, fake kernels and traced use agree with their real kernels
    (``torch.library.opcheck``); their values are the torch expressions'."""
    out, lse, block_out, block_lse = make_inputs(7, 2, 8, dtype)
    merge_args = (out, lse, block_out, block_lse, out_dtype)
    torch.library.opcheck(merge.merge_step, merge_args)
    got = merge.merge_step(*merge_args)
    for g, e in zip(got, merge_partials_torch(*merge_args)):
        assert g.dtype == e.dtype and torch.equal(g, e)
    acc = torch.randn(7, 2, 8, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    sum_args = (acc, block_out, out_dtype)
    torch.library.opcheck(merge.accumulate_step, sum_args)
    expected = acc + block_out.to(acc.dtype)
    assert torch.equal(merge.accumulate_step(*sum_args), expected if out_dtype is None else expected.to(out_dtype))


# --------------------------------------------------------------------------------------------
# (b) the Triton kernels under Triton's interpreter, in a subprocess
# --------------------------------------------------------------------------------------------

def interpreter_checks() -> None:
    """Run in a process started with TRITON_INTERPRET=1 (see the test below)."""
    import numpy as np

    np.seterr(all="ignore")  # the interpreter's numpy meets inf - inf on purpose
    assert os.environ.get("TRITON_INTERPRET") == "1"
    triton_merge = merge.merge_partials_triton
    for seed, case in enumerate(CASES):
        inputs = make_inputs(*case, seed=seed)
        got = triton_merge(*(t.clone() for t in inputs))
        check_against_reference(*got, inputs)
        # and close to the torch expression it replaces
        torch.testing.assert_close(got[0], merge_partials_torch(*inputs)[0], **TOL)
    # in place into a running fp32 result; a bf16 first block gets a new fp32 accumulator
    out, lse, block_out, block_lse = make_inputs(45, 3, 80, torch.float32)
    expected = reference(out, lse, block_out, block_lse)
    run_out, run_lse = out.clone(), lse.clone()
    got_out, got_lse = triton_merge(run_out, run_lse, block_out, block_lse)
    assert got_out is run_out and got_lse is run_lse
    check_against_reference(got_out, got_lse, (out, lse, block_out, block_lse))
    bf16 = out.bfloat16()
    got_out, got_lse = triton_merge(bf16, lse.clone(), block_out, block_lse)
    assert got_out.dtype == torch.float32 and got_out.data_ptr() != bf16.data_ptr()
    # strided inputs (a wider lse buffer, head-major out) read right, written to new tensors
    wide_lse = torch.full((3, 60), 5.0)
    wide_lse[:, :45] = lse
    head_major = out.transpose(0, 1).contiguous().transpose(0, 1)
    got_out, got_lse = triton_merge(head_major, wide_lse[:, :45], block_out, block_lse)
    assert got_out.is_contiguous() and got_lse.is_contiguous()
    torch.testing.assert_close(got_out.double(), expected[0], **TOL)
    assert (wide_lse[:, 45:] == 5.0).all()
    # the last step in the input dtype: .to(bf16) of the fp32 merge (the interpreter rounds
    # fp32 -> bf16 toward zero, CUDA to nearest even: compared to one bf16 step here)
    fp32_out, _ = triton_merge(out.clone(), lse.clone(), block_out, block_lse)
    last, _ = triton_merge(out.clone(), lse.clone(), block_out, block_lse, torch.bfloat16)
    assert last.dtype == torch.bfloat16
    torch.testing.assert_close(last.float(), fp32_out.bfloat16().float(), **BF16_STEP)
    # special values: the torch rule (torch.logaddexp, weights 0 where the lse is not finite)
    for dtype in OUT_DTYPES:
        inputs = special_inputs(dtype)
        got, expected_special = triton_merge(*(t.clone() for t in inputs)), merge_partials_torch(*inputs)
        for g, e in zip(got, expected_special):
            torch.testing.assert_close(g, e, equal_nan=True, **TOL)
    # the first fp32 sum of two bf16 blocks
    a, b = torch.randn(1000).bfloat16(), torch.randn(1000).bfloat16()
    assert torch.equal(merge.add_triton(a, b), a.float() + b.float())
    assert merge.add_triton(a[:0], b[:0]).shape == (0,)
    c = torch.randn(1000)
    summed = merge.add_triton(c, a, torch.bfloat16)
    assert summed.dtype == torch.bfloat16  # one bf16 step: the interpreter rounds toward zero
    torch.testing.assert_close(summed.float(), (c + a.float()).bfloat16().float(), **BF16_STEP)
    print("interpreter checks passed")


# The subprocess loads hcp_compile/kernels/merge.py (and precision.py, all it imports from the package)
# without running the packages' __init__ files, which import Dynamo: seconds saved.
INTERPRETER_MAIN = """
import sys, types
from pathlib import Path
root = Path.cwd().parent / "hcp_compile"
for name, folder in (("hcp_compile", root), ("hcp_compile.kernels", root / "kernels")):
    package = types.ModuleType(name)
    package.__path__ = [str(folder)]
    sys.modules[name] = package
import test_merge
test_merge.interpreter_checks()
"""


def test_triton_kernels_in_interpreter():
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-c", INTERPRETER_MAIN], env=env, cwd=here,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "interpreter checks passed" in result.stdout


# --------------------------------------------------------------------------------------------
# (c) CUDA: the Triton path against the torch expressions
# --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CUDA_CASES, ids=case_id)
def test_cuda_merge_matches_torch_and_reference(case):
    inputs = make_inputs(*case, device="cuda")
    assert merge._triton_merge_applies(*inputs, None)
    run = [t.clone() for t in inputs]
    got = merge_partials(*run)
    if case[3] == torch.float32:  # written into the running buffers
        assert got[0] is run[0] and got[1] is run[1]
    check_against_reference(*got, inputs)
    expected = merge_partials_torch(*inputs)
    torch.testing.assert_close(got[0], expected[0], **TOL)
    torch.testing.assert_close(got[1], expected[1], **TOL)
    # the last step in the input dtype: .to() of the fp32 merge (one bf16 step apart at most)
    last, _ = merge_partials(*(t.clone() for t in inputs), out_dtype=torch.bfloat16)
    assert last.dtype == torch.bfloat16
    torch.testing.assert_close(last.float(), got[0].bfloat16().float(), **BF16_STEP)


@pytest.mark.gpu
@needs_cuda
def test_cuda_special_values_strides_and_accumulate():
    for dtype in (torch.float16, *OUT_DTYPES):
        inputs = special_inputs(dtype, "cuda")
        got, expected = merge_partials(*(t.clone() for t in inputs)), merge_partials_torch(*inputs)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype
            torch.testing.assert_close(g, e, equal_nan=True, **TOL)
    out, lse, block_out, block_lse = make_inputs(300, 3, 80, torch.bfloat16, device="cuda")
    wide = torch.full((3, 320), 5.0, device="cuda")
    wide[:, :300] = lse
    head_major = block_out.transpose(0, 1).contiguous().transpose(0, 1)
    got = merge_partials(out, wide[:, :300], head_major, block_lse)
    check_against_reference(*got, (out, lse, block_out, block_lse))
    assert (wide[:, 300:] == 5.0).all()
    with RecordOps() as mode:  # a dispatch mode sees the op, not a raw launch
        merge_partials(out, lse, block_out, block_lse)
    assert mode.ops == [torch.ops.hcp.merge_step.default]
    # fp32 sums: in place into fp32; the first sum of two bf16 blocks in one pass
    x, y = block_out.clone(), out.clone()
    first = accumulate(x, y)
    assert first.dtype == torch.float32 and torch.equal(first, x.float() + y.float())
    expected = first + x.float()
    assert accumulate(first, x) is first and torch.equal(first, expected)
    last = accumulate(first.clone(), y, out_dtype=torch.bfloat16)  # one Triton pass, RTNE
    assert last.dtype == torch.bfloat16 and torch.equal(last, (first + y.float()).bfloat16())
    # and inside a compiled graph: the op, into new tensors
    compiled = torch.compile(lambda *t: merge_partials(*t), backend="eager", fullgraph=True)
    inputs = make_inputs(45, 3, 64, torch.float32, device="cuda")
    keep = [t.clone() for t in inputs]
    got = compiled(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(keep, inputs))
    torch.testing.assert_close(got[0], merge_partials_torch(*keep)[0], **TOL)
