"""``hcp_compile.varlen_attention`` with no CP active: results, the isolation of documents
(a non-finite value stays in its document), input validation (also by the op itself, as a
graph compiled by another backend calls it), the ``hcp`` backend's compile-time errors as the
user sees them, and ``opcheck`` of the custom ops ``torch.ops.hcp.varlen_attention`` /
``block_forward`` / ``block_backward``. Random inputs: ``test_fuzz_single_device.py``."""

from __future__ import annotations

import re

import pytest
import torch
from torch import fx

import hcp_compile as hc
from hcp_compile.kernels import BlockSpec, torch_kernel
from hcp_compile.passes.match import UnsupportedAttention
from hcp_compile.testing.reference import reference_with_grads
from checks import assert_matches, assert_rounding_close, expected_for
from cp_cases import HEAD_DIM, AttentionCase, attention_cases, cu_seqlens, seeded


def attention_with_grads(q, k, v, dout, cu_q, cu_k, **kwargs) -> dict[str, torch.Tensor]:
    """``hc.varlen_attention`` (no CP) and the gradients of ``sum(out * dout)``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    max_q = int((cu_q[1:] - cu_q[:-1]).max())
    max_k = int((cu_k[1:] - cu_k[:-1]).max())
    out = hc.varlen_attention(*leaves, cu_q, cu_k, max_q, max_k, **kwargs)
    out.backward(dout)
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def assert_all_match(got: dict, expected: dict, **tol) -> None:
    for name in ("out", "dq", "dk", "dv"):
        assert_matches(got[name], expected[name], name, **tol)


@pytest.mark.parametrize("case", attention_cases(), ids=lambda c: c.id)
def test_matches_reference(case: AttentionCase):
    x, cu = case.inputs(), cu_seqlens(case.lengths)
    got = attention_with_grads(x["q"], x["k"], x["v"], x["dout"], cu, cu, causal=case.causal,
                               softmax_scale=case.scale, window_size=case.window)
    assert_all_match(got, expected_for(case))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_cross_attention_with_different_query_and_key_documents(heads):
    """cu_seqlens_q != cu_seqlens_k, non-causal; includes docs with queries and no keys (their
    output is 0) and keys but no queries."""
    q_lengths, k_lengths = (3, 0, 5, 2, 4), (4, 2, 7, 0, 1)
    cu_q, cu_k = cu_seqlens(q_lengths), cu_seqlens(k_lengths)
    q = seeded("cross/q", sum(q_lengths), heads[0], HEAD_DIM)
    k, v = (seeded(f"cross/{n}", sum(k_lengths), heads[1], HEAD_DIM) for n in "kv")
    dout = seeded("cross/dout", sum(q_lengths), heads[0], HEAD_DIM)
    got = attention_with_grads(q, k, v, dout, cu_q, cu_k, causal=False)
    expected = reference_with_grads(q, k, v, dout, cu_q.tolist(), cu_k.tolist(), causal=False)
    assert_all_match(got, expected)


@pytest.mark.parametrize("query_block", [1, 5, 16])
@pytest.mark.parametrize("case", [c for c in attention_cases() if c.docs in ("mixed", "long")][:16],
                         ids=lambda c: c.id)
def test_torch_kernel_query_blocks_match_reference(monkeypatch, query_block, case):
    """The plain kernel's query blocks (forced small here) cut through and between documents,
    including empty ones; the result must not depend on where the cuts fall."""
    monkeypatch.setattr(torch_kernel, "QUERY_BLOCK", query_block)
    x, cu = case.inputs(), cu_seqlens(case.lengths)
    got = attention_with_grads(x["q"], x["k"], x["v"], x["dout"], cu, cu, causal=case.causal,
                               softmax_scale=case.scale, window_size=case.window)
    assert_all_match(got, expected_for(case))


@pytest.mark.parametrize("query_block", [1, 3])
def test_torch_kernel_query_blocks_in_cross_attention(monkeypatch, query_block):
    monkeypatch.setattr(torch_kernel, "QUERY_BLOCK", query_block)
    test_cross_attention_with_different_query_and_key_documents((4, 2))


# --------------------------------------------------------------------------------------------
# isolation: a non-finite value in one document never reaches another document's results
# --------------------------------------------------------------------------------------------

ISOLATION_DOCS = (5, 0, 9, 3)  # fewer tokens than QUERY_BLOCK: one block holds every document
POISONED = slice(5, 14)  # the tokens of document 2
POISONED_ROW = 8


def poisoned(x: torch.Tensor, value: float) -> torch.Tensor:
    x = x.clone()
    x[POISONED_ROW, 0, 0] = value
    return x


def outside_poisoned(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[: POISONED.start], t[POISONED.stop :]])


def isolation_inputs(heads: tuple[int, int]) -> dict[str, torch.Tensor]:
    tokens = sum(ISOLATION_DOCS)
    return {"q": seeded("isolation/q", tokens, heads[0], HEAD_DIM),
            "k": seeded("isolation/k", tokens, heads[1], HEAD_DIM),
            "v": seeded("isolation/v", tokens, heads[1], HEAD_DIM),
            "dout": seeded("isolation/dout", tokens, heads[0], HEAD_DIM)}


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("tensor", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_non_finite_value_stays_in_its_document(heads, causal, tensor, value):
    """The documents share one block of the plain kernel, whose einsums also multiply the
    masked pairs (by zero, which makes NaN of a NaN); the other documents' results must be
    those of clean inputs, and the poisoned document's must show the value."""
    clean, cu = isolation_inputs(heads), cu_seqlens(ISOLATION_DOCS)
    expected = reference_with_grads(clean["q"], clean["k"], clean["v"], clean["dout"], cu.tolist(),
                                    cu.tolist(), causal=causal)
    x = {**clean, tensor: poisoned(clean[tensor], value)}
    got = attention_with_grads(x["q"], x["k"], x["v"], x["dout"], cu, cu, causal=causal)
    for name in ("out", "dq", "dk", "dv"):
        assert_matches(outside_poisoned(got[name]), outside_poisoned(expected[name]), name)
    in_document = [torch.isfinite(got[name][POISONED]).all() for name in ("out", "dq", "dk", "dv")]
    assert not all(in_document), "the poisoned document's results hid its value"


@pytest.mark.parametrize("tensor", ["q", "k", "v", "dout"])
def test_block_ops_keep_a_non_finite_value_in_its_segment(tensor):
    """The ring's view: block_forward/backward on segments with global positions (a window),
    the poisoned results compared with the same ops on clean inputs (up to rounding: a
    non-finite value cuts the blocks at segment boundaries, so other matmul shapes)."""
    x, cu = isolation_inputs((4, 2)), cu_seqlens(ISOLATION_DOCS)
    positions = torch.arange(sum(ISOLATION_DOCS))
    args = (*BlockSpec(cu, cu, 9, 9, False, 0.35, 6, 2, positions, positions).op_args(), "torch")

    def forward_backward(x: dict) -> list[torch.Tensor]:
        out, lse = torch.ops.hcp.block_forward(x["q"], x["k"], x["v"], *args)
        grads = torch.ops.hcp.block_backward(x["dout"], x["q"], x["k"], x["v"], out, lse, *args)
        return [out, lse.t(), *grads]

    clean = forward_backward(x)
    got = forward_backward({**x, tensor: poisoned(x[tensor], float("nan"))})
    for name, g, c in zip(("out", "lse", "dq", "dk", "dv"), got, clean):
        assert_rounding_close(outside_poisoned(g), outside_poisoned(c), name)


# --------------------------------------------------------------------------------------------
# input validation (no CP)
# --------------------------------------------------------------------------------------------

DOCS = (5, 0, 9)
CU = cu_seqlens(DOCS)
Q = seeded("errors/q", 14, 4, HEAD_DIM)
KV = seeded("errors/kv", 14, 2, HEAD_DIM)
INT32 = torch.int32


def call(attention=hc.varlen_attention, **overrides):
    args = {"q": Q, "k": KV, "v": KV, "cu_seqlens_q": CU, "cu_seqlens_k": CU,
            "max_seqlen_q": 9, "max_seqlen_k": 9, "causal": True}
    return attention(**{**args, **overrides})


INVALID_CALLS = {
    "cu-q-int64": ({"cu_seqlens_q": CU.long()}, "cu_seqlens_q: expected dtype torch.int32"),
    "cu-k-int64": ({"cu_seqlens_k": CU.long()}, "cu_seqlens_k: expected dtype torch.int32"),
    "cu-2d": ({"cu_seqlens_q": CU.reshape(1, -1)}, "cu_seqlens_q: expected a 1-D tensor"),
    "cu-single-entry": ({"cu_seqlens_q": CU[:1]}, "cu_seqlens_q: expected a 1-D tensor"),
    "cu-not-from-0": ({"cu_seqlens_q": CU + 1}, "cu_seqlens_q: must start at 0"),
    "cu-decreasing": ({"cu_seqlens_k": torch.tensor([0, 9, 5, 14], dtype=INT32)},
                      "cu_seqlens_k: must be non-decreasing"),
    "cu-q-last-entry": ({"cu_seqlens_q": cu_seqlens((5, 0, 8))},
                        "cu_seqlens_q: last entry is 13 but q has 14 tokens"),
    "cu-k-last-entry": ({"cu_seqlens_k": cu_seqlens((5, 0, 10))},
                        "cu_seqlens_k: last entry is 15 but k has 14 tokens"),
    "cu-doc-counts-differ": ({"cu_seqlens_k": cu_seqlens((5, 9)), "causal": False},
                             "cu_seqlens_q, cu_seqlens_k: expected the same number of documents"),
    "max-seqlen-q-too-small": ({"max_seqlen_q": 8}, "max_seqlen_q: must be at least the longest document's length, got 8"),
    "max-seqlen-k-too-small": ({"max_seqlen_k": 3}, "max_seqlen_k: must be at least the longest document's length, got 3"),
    "max-seqlen-not-int": ({"max_seqlen_q": 9.0}, "max_seqlen_q: expected an int, got 9.0"),
    "window-below-minus-1": ({"window_size": (-2, 0)}, "window_size"),
    "window-one-entry": ({"window_size": (3,)}, "window_size"),
    "window-float": ({"window_size": (1.5, 0)}, "window_size"),
    "q-2d": ({"q": Q[:, 0]}, "q: expected a tensor of shape [tokens, heads, head_dim]"),
    "k-v-shapes-differ": ({"v": KV[:, :1]}, "k, v: expected equal shapes"),
    "head-dims-differ": ({"k": KV[..., :4], "v": KV[..., :4]}, "q, k: expected the same head_dim"),
    "dtypes-differ": ({"v": KV.double()}, "q, k, v: expected one dtype"),
    "gqa-heads-not-multiple": ({"q": seeded("q3", 14, 3, HEAD_DIM)},
                               "q, k: query heads (3) must be a multiple of key/value heads (2)"),
}


@pytest.mark.parametrize("overrides, match", INVALID_CALLS.values(), ids=INVALID_CALLS.keys())
def test_invalid_input_raises_input_error_naming_the_argument(overrides, match):
    with pytest.raises(hc.InputError, match=re.escape(match)):
        call(**overrides)


# what a graph compiled by another backend hands the op: no wrapper checks ran before it
OP_ONLY_INVALID_CALLS = {
    "q-is-a-shard": ({"q": Q[:10]}, "cu_seqlens_q: last entry is 14 but q has 10 tokens"),
    "k-v-are-shards": ({"k": KV[:12], "v": KV[:12]}, "cu_seqlens_k: last entry is 14 but k has 12 tokens"),
    "max-seqlen-q-too-small": ({"max_seqlen_q": 4}, "max_seqlen_q: must be at least the longest document's length, got 4"),
    "max-seqlen-k-too-small": ({"max_seqlen_k": 8}, "max_seqlen_k: must be at least the longest document's length, got 8"),
    "cu-q-int64": ({"cu_seqlens_q": CU.long()}, "cu_seqlens_q: expected dtype torch.int32"),
    "cu-k-int64": ({"cu_seqlens_k": CU.long()}, "cu_seqlens_k: expected dtype torch.int32"),
}


@pytest.mark.parametrize("overrides, match", OP_ONLY_INVALID_CALLS.values(), ids=OP_ONLY_INVALID_CALLS.keys())
def test_op_checks_its_inputs_in_a_graph_compiled_by_another_backend(overrides, match):
    def attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        return hc.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   causal=causal)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    with pytest.raises(hc.InputError, match=re.escape(match)):
        call(**overrides, attention=compiled)


@pytest.mark.parametrize("overrides, match", OP_ONLY_INVALID_CALLS.values(), ids=OP_ONLY_INVALID_CALLS.keys())
def test_op_called_directly_checks_its_inputs(overrides, match):
    args = {"q": Q, "k": KV, "v": KV, "cu_seqlens_q": CU, "cu_seqlens_k": CU, "max_seqlen_q": 9,
            "max_seqlen_k": 9, "causal": True, "softmax_scale": 0.3, "window_left": -1,
            "window_right": -1, "kernel": "torch"}
    with pytest.raises(hc.InputError, match=re.escape(match)):
        torch.ops.hcp.varlen_attention(**{**args, **overrides})


def test_unknown_kernel_is_rejected():
    with pytest.raises(hc.InputError, match="kernel: expected one of"):
        torch.ops.hcp.varlen_attention(Q, KV, KV, CU, CU, 9, 9, True, 0.3, -1, -1, "fast")
    with pytest.raises(hc.InputError, match="kernel: expected one of"):
        hc.CPOptions(kernel="fast")


def test_flash_kernel_is_rejected_on_cpu():
    with pytest.raises(hc.InputError, match="kernel='flash' needs CUDA"):
        torch.ops.hcp.varlen_attention(Q, KV, KV, CU, CU, 9, 9, True, 0.3, -1, -1, "flash")


def test_make_mesh_rejects_bad_sizes_and_missing_process_group():
    with pytest.raises(ValueError, match="make_mesh: ulysses must be a positive int"):
        hc.make_mesh(ulysses=0, ring=1)
    with pytest.raises(ValueError, match="make_mesh: ring must be a positive int"):
        hc.make_mesh(ulysses=1, ring=2.0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        hc.make_mesh(ulysses=1, ring=1)


def test_shard_plan_rejects_something_that_is_not_a_mesh():
    with pytest.raises(TypeError, match="mesh: expected a DeviceMesh"):
        hc.shard_plan(CU, "not a mesh")


# --------------------------------------------------------------------------------------------
# errors of the hcp backend at compile time reach the user as themselves
# --------------------------------------------------------------------------------------------

def flash_attention_with_dropout(q, k, v, cu):
    """Varlen attention whose dropout hierarchical CP cannot reproduce."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 9, 9, 0.1, True, False)[0]


@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
def test_unsupported_argument_reaches_the_user_as_the_input_error(one_rank_mesh, inner):
    compiled = torch.compile(flash_attention_with_dropout, backend="hcp",
                             options={"mesh": one_rank_mesh, "inner": inner})
    with pytest.raises(hc.InputError, match="argument dropout_p=0.1 is not supported") as raised:
        compiled(Q, KV, KV, CU)
    assert type(raised.value) is UnsupportedAttention, f"got {type(raised.value).__mro__}"


def test_unknown_option_reaches_the_user_as_the_input_error():
    compiled = torch.compile(flash_attention_with_dropout, backend="hcp", options={"dump": "/tmp"})
    with pytest.raises(hc.InputError, match=re.escape("options: unknown ['dump'] for the hcp backend")) as raised:
        compiled(Q, KV, KV, CU)
    assert type(raised.value) is hc.InputError


def test_backend_called_without_dynamo_raises_an_input_error_chaining_the_original():
    with pytest.raises(hc.InputError, match="options: unknown") as raised:
        torch._dynamo.lookup_backend("hcp")(fx.symbolic_trace(lambda x: x), [], {"dump": "/tmp"})
    assert type(raised.value.__cause__) is hc.InputError
    assert raised.value.args == raised.value.__cause__.args


# --------------------------------------------------------------------------------------------
# opcheck: schema, fake (meta) kernels, autograd registration, AOT dispatch
# --------------------------------------------------------------------------------------------

OPCHECK_HEADS = [pytest.param((4, 4), id="mha"), pytest.param((4, 2), id="gqa")]
OPCHECK_MASKS = {  # (causal, window, positions: the block ops get global ones under a window)
    "causal": (True, (-1, -1), None),
    "window": (False, (2, 1), torch.arange(14)),
}
SCALE = 0.35


def qkv(heads: tuple[int, int]) -> list[torch.Tensor]:
    heads_q, heads_kv = heads
    return [seeded("opcheck/q", 14, heads_q, HEAD_DIM), seeded("opcheck/k", 14, heads_kv, HEAD_DIM),
            seeded("opcheck/v", 14, heads_kv, HEAD_DIM)]


def block_args(mask: str) -> tuple:
    """The arguments of block_forward/backward after the tensors."""
    causal, (left, right), positions = OPCHECK_MASKS[mask]
    return (*BlockSpec(CU, CU, 9, 9, causal, SCALE, left, right, positions, positions).op_args(), "torch")


@pytest.mark.parametrize("mask", OPCHECK_MASKS)
@pytest.mark.parametrize("heads", OPCHECK_HEADS)
def test_opcheck_varlen_attention(heads, mask):
    causal, (left, right), _ = OPCHECK_MASKS[mask]
    leaves = [t.requires_grad_() for t in qkv(heads)]
    torch.library.opcheck(torch.ops.hcp.varlen_attention,
                          (*leaves, CU, CU, 9, 9, causal, SCALE, left, right, "auto"))


@pytest.mark.parametrize("mask", OPCHECK_MASKS)
@pytest.mark.parametrize("heads", OPCHECK_HEADS)
def test_opcheck_block_forward(heads, mask):
    torch.library.opcheck(torch.ops.hcp.block_forward, (*qkv(heads), *block_args(mask)))


@pytest.mark.parametrize("mask", OPCHECK_MASKS)
@pytest.mark.parametrize("heads", OPCHECK_HEADS)
def test_opcheck_block_backward(heads, mask):
    q, k, v = qkv(heads)
    out, lse = torch.ops.hcp.block_forward(q, k, v, *block_args(mask))
    dout = seeded("opcheck/dout", *q.shape)
    torch.library.opcheck(torch.ops.hcp.block_backward, (dout, q, k, v, out, lse, *block_args(mask)))


@pytest.mark.parametrize("mask", OPCHECK_MASKS)
@pytest.mark.parametrize("heads", OPCHECK_HEADS)
def test_opcheck_varlen_attention_backward(heads, mask):
    causal, (left, right), _ = OPCHECK_MASKS[mask]
    q, k, v = qkv(heads)
    args = (CU, CU, 9, 9, causal, SCALE, left, right)
    out, lse = torch.ops.hcp.varlen_attention(q, k, v, *args, "torch")
    dout = seeded("opcheck/dout", *q.shape)
    torch.library.opcheck(torch.ops.hcp.varlen_attention_backward, (dout, q, k, v, out, lse, *args, "torch"))


def test_compiled_backward_resolves_the_kernel_when_it_runs_not_when_traced():
    """Inductor's cache is keyed by the forward graph, which says ``"auto"``; a backward graph
    that named the kernel chosen at trace time would be reused by a process where that kernel
    does not load (cudnn without its package)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    backward_kernels = []

    def keep_backward(gm: fx.GraphModule, _inputs):
        backward_kernels.extend(node.args[-1] for node in gm.graph.nodes
                                if node.target is torch.ops.hcp.varlen_attention_backward.default)
        return make_boxed_func(gm)

    torch._dynamo.reset()
    compiled = torch.compile(hc.varlen_attention, fullgraph=True, backend=aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=keep_backward))
    leaves = [t.requires_grad_() for t in qkv((4, 2))]
    compiled(*leaves, CU, CU, 9, 9, causal=True).sum().backward()
    torch._dynamo.reset()
    assert backward_kernels == ["auto"]
