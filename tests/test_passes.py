"""The passes of the ``hcp`` backend in one process (docs/design.md §5): matching attention nodes in
Dynamo graphs (``find_attention``), the decorator's scoping, the rewrite and its report, the
backend's options and errors, ``explain`` and the dump folder.

Graphs are captured from Dynamo on fake tensors (no kernel runs, so ops without a CPU kernel
such as ``varlen_attn`` and ``aten._flash_attention_forward`` trace too). What needs process
groups runs on a world of one rank (gloo, mesh 1 x 1) set up for this module and torn down
after it; the rewrite's structure for larger meshes is checked with stand-in groups, since
the rewrite only reads their names and sizes.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import operator
import re
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention.varlen import AuxRequest, varlen_attn
from torch.utils._pytree import tree_map_only

import hcp_compile as hc
from hcp_compile.testing.reference import reference_attention, reference_with_grads
from checks import assert_matches
from compile_cases import counting_runs
from cp_cases import HEAD_DIM, MESHES, cu_seqlens, mesh_id, scheme_cases, seeded
from hcp_compile.compiled.inserted import checked_layout, hierarchical_varlen_attention
from hcp_compile.exchange.mesh import CPGroups, resolve_groups
from hcp_compile.exchange.schemes import SCHEMES
from hcp_compile.marking import AttentionMark
from hcp_compile.passes import report
from hcp_compile.passes.hierarchical_cp import HierarchicalCPPass
from hcp_compile.plan import format_bytes
from hcp_compile.passes.match import (
    AttentionCall, AttentionMatch, UnsupportedAttention, find_attention, readable_module_path,
)
from hcp_compile.passes.rewrite import RewriteConfig, rewrite_attention

BACKEND_MODULE = importlib.import_module("hcp_compile.compiled.backend")  # hc.backend is the function
DUMP_FILES = {"before_rewrite.py", "after_rewrite.py", "aot_forward.py", "aot_backward.py", "matches.md"}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo world and its 1 x 1 mesh, for this module only (other modules test
    behaviour before init_process_group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield hc.make_mesh(1, 1, "cpu")
    finally:
        dist.destroy_process_group()


def stand_in_groups(ulysses: int, ring: int) -> CPGroups:
    """Groups of a larger mesh for the rewrite, which reads only names and sizes."""
    return CPGroups(SimpleNamespace(group_name="ulysses-group"), SimpleNamespace(group_name="ring-group"),
                    ulysses, ring, 0, 0, "cpu")


def capture(fn, *args) -> list[fx.GraphModule]:
    """The graphs Dynamo captures from ``fn(*args)`` (on fake copies of the tensors)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = tree_map_only(torch.Tensor, mode.from_tensor, args)
        torch.compile(fn, backend=backend, fullgraph=True)(*fake)
    return graphs


def placeholders(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}


def calls_to(graph: fx.Graph, target) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def qkv(tokens: int = 12, heads_q: int = 4, heads_kv: int = 2, name: str = "passes"):
    return (seeded(f"{name}/q", tokens, heads_q, HEAD_DIM), seeded(f"{name}/k", tokens, heads_kv, HEAD_DIM),
            seeded(f"{name}/v", tokens, heads_kv, HEAD_DIM))


CU = cu_seqlens((5, 0, 7))  # 12 tokens


# --------------------------------------------------------------------------------------------
# find_attention: every supported op read into one AttentionCall
# --------------------------------------------------------------------------------------------

class HcpAttention(nn.Module):
    def forward(self, q, k, v, cu_q, cu_k):
        return hc.varlen_attention(q, k, v, cu_q, cu_k, 9, 8, causal=True, softmax_scale=0.3,
                                   window_size=(4, 0))


class Holder(nn.Module):
    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attn = attention

    def forward(self, q, k, v, cu_q, cu_k):
        return self.attn(q, k, v, cu_q, cu_k)


class Layers(nn.Module):
    """``layers.1.attn`` is the attention (``layers.0`` is never called)."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList([nn.Identity(), Holder(attention)])

    def forward(self, q, k, v, cu_q, cu_k):
        return self.layers[1](q, k, v, cu_q, cu_k)


def test_matches_hcp_varlen_attention():
    q, k, v = qkv()
    (gm,) = capture(Layers(HcpAttention()), q, k, v, CU, CU.clone())
    (match,) = find_attention(gm.graph)
    inputs = placeholders(gm)
    call = match.call
    assert isinstance(match, AttentionMatch) and isinstance(call, AttentionCall)
    assert match.op == "hcp::varlen_attention"
    assert match.node.target in (torch.ops.hcp.varlen_attention, torch.ops.hcp.varlen_attention.default)
    assert (call.q, call.k, call.v) == (inputs["l_q_"], inputs["l_k_"], inputs["l_v_"])
    assert (call.cu_seqlens_q, call.cu_seqlens_k) == (inputs["l_cu_q_"], inputs["l_cu_k_"])
    assert (call.max_seqlen_q, call.max_seqlen_k) == (9, 8)
    assert (call.causal, call.scale, call.window) == (True, 0.3, (4, 0))
    assert (call.out_index, call.lse_index) == (0, 1)
    assert match.module_path == "layers.1.attn"
    assert match.mark is None


class TorchVarlen(nn.Module):
    def __init__(self, window=(-1, 0), scale=None, same_cu=False, lse=False):
        super().__init__()
        self.window, self.scale, self.same_cu, self.lse = window, scale, same_cu, lse

    def forward(self, q, k, v, cu):
        aux = AuxRequest(lse=True) if self.lse else None
        return varlen_attn(q, k, v, cu, None if self.same_cu else cu, 7, 7, return_aux=aux,
                           scale=self.scale, window_size=self.window, enable_gqa=True)


@pytest.mark.parametrize("window, causal, expected_window", [
    ((-1, 0), True, (-1, -1)),  # varlen_attn's spelling of causal attention
    ((-1, -1), False, (-1, -1)),
    ((3, 0), False, (3, 0)),  # a causal sliding window, as a window
    ((2, 5), False, (2, 5)),
])
def test_matches_torch_varlen_attn(window, causal, expected_window):
    q, k, v = qkv()
    (gm,) = capture(TorchVarlen(window), q, k, v, CU)
    (match,) = find_attention(gm.graph)
    call = match.call
    assert match.op == "torch_attn::_varlen_attn"
    assert (call.causal, call.window) == (causal, expected_window)
    assert call.scale is None  # 1/sqrt(head dim), filled in by the rewrite
    assert call.q is placeholders(gm)["l_q_"] and call.cu_seqlens_q is placeholders(gm)["l_cu_"]
    assert (call.max_seqlen_q, call.max_seqlen_k, call.out_index, call.lse_index) == (7, 7, 0, 1)


def test_torch_varlen_attn_without_cu_seq_k_uses_cu_seq_q():
    q, k, v = qkv()
    (gm,) = capture(TorchVarlen(scale=0.25, same_cu=True), q, k, v, CU)
    (match,) = find_attention(gm.graph)
    assert match.call.cu_seqlens_k is match.call.cu_seqlens_q
    assert match.call.scale == 0.25


def flash_varlen(q, k, v, cu):
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 7, 7, 0.0, True, False, scale=0.3,
                                                  window_size_left=4, window_size_right=0)
    return out[0], out[1]


def flash_dense(q, k, v):
    return torch.ops.aten._flash_attention_forward(q, k, v, None, None, 7, 7, 0.0, True, False)[0]


def test_matches_aten_flash_attention_with_cum_seq_q():
    q, k, v = qkv(heads_kv=4)
    (gm,) = capture(flash_varlen, q, k, v, CU)
    (match,) = find_attention(gm.graph)
    call = match.call
    assert match.op == "aten::_flash_attention_forward"
    assert (call.q, call.cu_seqlens_q, call.cu_seqlens_k) == (
        placeholders(gm)["l_q_"], placeholders(gm)["l_cu_"], placeholders(gm)["l_cu_"])
    assert (call.causal, call.scale, call.window, call.max_seqlen_q) == (True, 0.3, (4, 0), 7)
    assert match.module_path == ""


def test_dense_aten_flash_attention_is_not_matched():
    """Without cum_seq_q it is (batch, seq) attention: no documents to lay out."""
    q, k, v = (t.unsqueeze(0) for t in qkv(heads_kv=4))
    (gm,) = capture(flash_dense, q, k, v)
    assert any(n.op == "call_function" and "flash" in str(n.target) for n in gm.graph.nodes)
    assert find_attention(gm.graph) == []


def _flash_attn_varlen_forward_op():
    """flash_attn's varlen forward op (flash_attn 2.7's schema), or a CPU stand-in with that
    schema where the package is not installed: the pass matches the op by name."""
    if hasattr(torch.ops.flash_attn, "_flash_attn_varlen_forward"):
        return torch.ops.flash_attn._flash_attn_varlen_forward

    @torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=())
    def stand_in(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
        softmax_scale: float, causal: bool, window_size_left: int = -1,
        window_size_right: int = -1, softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False,
        block_table: torch.Tensor | None = None, leftpad_k: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None, zero_tensors: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        raise AssertionError("only traced on fake tensors here")

    @stand_in.register_fake
    def _(q, k, v, cu_seqlens_q, *args, **kwargs):
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        return torch.empty_like(q), lse, q.new_empty(0), q.new_empty(2, dtype=torch.int64)

    return torch.ops.flash_attn._flash_attn_varlen_forward


def test_matches_flash_attn_varlen_forward():
    op = _flash_attn_varlen_forward_op()

    def attention(q, k, v, cu):
        out, lse, _, _ = op(q, k, v, cu, cu, 7, 7, 0.0, 0.3, True, 4, 0)
        return out, lse

    q, k, v = qkv()
    (gm,) = capture(attention, q, k, v, CU)
    (match,) = find_attention(gm.graph)
    call = match.call
    assert match.op == "flash_attn::_flash_attn_varlen_forward"
    assert (call.q, call.k, call.cu_seqlens_q) == (
        placeholders(gm)["l_q_"], placeholders(gm)["l_k_"], placeholders(gm)["l_cu_"])
    assert (call.causal, call.scale, call.window, call.out_index, call.lse_index) == (True, 0.3, (4, 0), 0, 1)
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    node.kwargs = {**node.kwargs, "softcap": 30.0}
    with pytest.raises(UnsupportedAttention, match="argument softcap="):
        find_attention(gm.graph)


def _with_argument(gm: fx.GraphModule, position: int, value) -> fx.Graph:
    """The captured graph with one positional argument of the attention op replaced."""
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    args = list(node.args)
    args[position] = value
    node.args = tuple(args)
    return gm.graph


@pytest.mark.parametrize("position, value, name", [
    (7, 0.1, "dropout_p"),
    (9, True, "return_debug_mask"),
])
def test_unsupported_aten_flash_arguments_are_named(position, value, name):
    q, k, v = qkv(heads_kv=4)
    (gm,) = capture(flash_varlen, q, k, v, CU)
    with pytest.raises(UnsupportedAttention, match=f"argument {name}="):
        find_attention(_with_argument(gm, position, value))


@pytest.mark.parametrize("position, name", [(11, "seqused_k"), (12, "block_table")])
def test_unsupported_torch_varlen_arguments_are_named(position, name):
    """varlen_attn's paged-KV and seqused_k inputs (written into the captured node: on CPU
    they do not trace) are refused by name."""
    q, k, v = qkv()
    (gm,) = capture(TorchVarlen(), q, k, v, CU)
    with pytest.raises(UnsupportedAttention, match=f"argument {name}=") as raised:
        find_attention(_with_argument(gm, position, placeholders(gm)["l_cu_"]))
    assert isinstance(raised.value, ValueError)
    assert "is not supported under hierarchical context parallelism" in str(raised.value)


@pytest.mark.parametrize("dynamo_path, readable", [
    ("L['self'].layers[0].attn", "layers.0.attn"),
    ("L['self']._modules['layers']._modules['0']._modules['attn']", "layers.0.attn"),
    ("L['self'].blocks['first'].mixer", "blocks.first.mixer"),
    ("L['self']", ""),
    ("L['model'].encoder", "encoder"),
])
def test_readable_module_path(dynamo_path, readable):
    assert readable_module_path(dynamo_path) == readable


# --------------------------------------------------------------------------------------------
# the decorator's scoping (marks are class attributes: every test defines its own classes)
# --------------------------------------------------------------------------------------------

class Plain(nn.Module):
    def forward(self, q, k, v, cu):
        return hc.varlen_attention(q, k, v, cu, cu, 7, 7, causal=True)


class Two(nn.Module):
    def __init__(self, first: nn.Module, second: nn.Module):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, q, k, v, cu):
        return self.first(q, k, v, cu) + self.second(q, k, v, cu)


def matched_paths(model: nn.Module) -> list[tuple[str, AttentionMark | None]]:
    q, k, v = qkv()
    (gm,) = capture(model, q, k, v, CU)
    return [(m.module_path, m.mark) for m in find_attention(gm.graph)]


def test_without_marks_every_attention_is_matched():
    class A(Plain): ...
    class B(Plain): ...
    assert matched_paths(Two(A(), B())) == [("first", None), ("second", None)]


def test_marked_class_scopes_the_rewrite_to_it():
    @hc.attention
    class Marked(Plain): ...

    class Unmarked(Plain): ...

    assert matched_paths(Two(Unmarked(), Marked())) == [("second", AttentionMark())]


def test_marked_class_with_options():
    @hc.attention(kernel="torch")
    class Marked(Plain): ...

    class Unmarked(Plain): ...

    assert matched_paths(Two(Marked(), Unmarked())) == [("first", AttentionMark(kernel="torch"))]


def test_marked_instance_marks_only_that_instance():
    class Shared(Plain): ...

    model = Two(Shared(), Shared())
    second = model.second
    assert hc.attention(second, kernel="torch") is second
    assert type(model.first) is Shared and isinstance(second, Shared) and type(second) is not Shared
    assert type(second).__name__ == "Shared" and type(second).__qualname__ == Shared.__qualname__
    assert matched_paths(model) == [("second", AttentionMark(kernel="torch"))]


def test_attention_inside_a_marked_block_counts_as_marked_and_the_innermost_mark_wins():
    class Inner(Plain): ...

    @hc.attention(kernel="flash")
    class Block(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return self.inner(*args)

    class Unmarked(Plain): ...

    assert matched_paths(Two(Block(Inner()), Unmarked())) == [("first.inner", AttentionMark(kernel="flash"))]
    marked_inner = hc.attention(kernel="torch")(type("MarkedInner", (Plain,), {}))
    assert matched_paths(Two(Block(marked_inner()), Unmarked())) == [
        ("first.inner", AttentionMark(kernel="torch"))]


def test_invalid_marks_raise():
    with pytest.raises(hc.InputError, match="kernel=...\\): expected one of"):
        hc.attention(kernel="fast")
    with pytest.raises(TypeError, match="expected an nn.Module subclass or instance, got int"):
        hc.attention(42)


# --------------------------------------------------------------------------------------------
# the rewrite and its report
# --------------------------------------------------------------------------------------------

class ThreeCalls(nn.Module):
    """Two calls on one cu_seqlens, one with the lse used, one on another cu_seqlens."""

    def forward(self, q, k, v, cu, other_cu):
        a = hc.varlen_attention(q, k, v, cu, cu, 7, 7, causal=True)
        b, lse = varlen_attn(q, k, v, cu, cu, 7, 7, return_aux=AuxRequest(lse=True), enable_gqa=True)
        c = hc.varlen_attention(q, k, v, other_cu, other_cu, 12, 12, causal=False, window_size=(2, 3))
        return a + b + c, lse


def rewritten_three_calls(groups: CPGroups, kernel: str = "auto"):
    q, k, v = qkv()
    (gm,) = capture(ThreeCalls(), q, k, v, CU, cu_seqlens((12,)))
    done = rewrite_attention(gm.graph, find_attention(gm.graph), RewriteConfig(groups, kernel, True, "balanced"))
    return gm, done


def test_rewrite_replaces_every_match_and_checks_each_cu_seqlens_once():
    gm, done = rewritten_three_calls(stand_in_groups(2, 2))
    graph = gm.graph
    assert find_attention(graph) == []  # no matched op is left
    attention = calls_to(graph, hierarchical_varlen_attention)
    checks = calls_to(graph, checked_layout)
    assert len(attention) == 3 and len(checks) == 2
    inputs = placeholders(gm)
    assert [c.args[0] for c in checks] == [inputs["l_cu_"], inputs["l_other_cu_"]]
    assert all(c.kwargs == {"ulysses_group": "ulysses-group", "ring_group": "ring-group",
                            "placement": "balanced", "agree": True, "recompute_exchange": False,
                            "scheme": "ring", "graph_for": "ring", "agreement_timeout_s": None}
               for c in checks)
    # every call reads the checked layout of its own cu_seqlens
    assert [a.args[4] for a in attention] == [checks[0], checks[0], checks[1]]
    scale = HEAD_DIM**-0.5
    assert [(a.kwargs["causal"], a.kwargs["scale"], a.kwargs["window"], a.kwargs["return_lse"])
            for a in attention] == [(True, scale, (-1, -1), False), (False, scale, (-1, -1), True),
                                    (False, scale, (2, 3), False)]
    assert all(a.kwargs["kernel"] == "torch" and a.kwargs["ulysses_group"] == "ulysses-group"
               and a.kwargs["ring_group"] == "ring-group" for a in attention)
    assert [a.args[3] for a in attention] == [7, 7, 12]
    assert [(r.heads_q, r.heads_kv, r.head_dim, r.dtype, r.local_tokens) for r in done] == [
        (4, 2, HEAD_DIM, torch.float32, 12)] * 3
    assert [(r.returns_lse, r.checked, r.kernel) for r in done] == [
        (False, True, "torch"), (True, False, "torch"), (False, True, "torch")]
    # the lse is rewired: the graph's second output reads the rewritten node's second output
    (output,) = [n for n in graph.nodes if n.op == "output"]
    lse = output.args[0][1]
    assert lse.target is operator.getitem and lse.args == (attention[1], 1)


def test_report_table_rows_and_collectives():
    _, done = rewritten_three_calls(stand_in_groups(2, 2))
    table = report.table(done, stand_in_groups(2, 2), agree=True)
    lines = table.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(report.HEADERS)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[1] for row in rows] == ["hcp::varlen_attention", "torch_attn::_varlen_attn",
                                        "hcp::varlen_attention"]
    assert all(row[2:9] == ["4/2", str(HEAD_DIM), "float32", "2 x 2", "balanced", "torch", "ring"]
               for row in rows)
    assert [row[9] for row in rows] == ["3 all_to_all, 1 ring, 2 all_reduce (check)",
                                        "4 all_to_all, 1 ring",
                                        "3 all_to_all, 1 ring, 2 all_reduce (check)"]
    assert all(row[10] == "3 all_to_all, 3 ring" and row[13] == "2" for row in rows)
    assert report.table([], stand_in_groups(2, 2), agree=True) == "no attention node with cu_seqlens was found"


REPORT_MEASURED = [pytest.param(mesh, scheme, id=f"{mesh_id(mesh)}-{scheme}")
                   for mesh in MESHES for scheme in SCHEMES]


@pytest.mark.parametrize("mesh, scheme", REPORT_MEASURED)
def test_report_counts_and_bytes_are_what_the_collectives_send(cp_world, mesh, scheme):
    """The report's collectives and its bytes "(max)", for a call whose tokens all go through
    the exchange and round the ring (zigzag "8.8" on every mesh: no pads, the ring section is
    the whole stream), against what eager CP's collectives were measured sending on every rank
    (tests/traffic.py); a compiled graph runs the same collectives."""
    ulysses, ring = mesh
    groups = stand_in_groups(ulysses, ring)
    (case,) = [c for c in scheme_cases() if c.docs == "8.8" and c.scheme == scheme]
    _, done = rewritten_three_calls(groups)
    for rank, measured in enumerate(cp_world(mesh).values(case.id)):
        tokens = measured["global_index"].numel()
        assert (measured["global_index"] >= 0).all(), f"rank {rank}: premise: no pads"
        node = dataclasses.replace(done[0], heads_q=case.heads_q, heads_kv=case.heads_kv,
                                   head_dim=case.head_dim, local_tokens=tokens, scheme=scheme)
        counts = report.collectives(node, groups, agree=False)
        forward, backward = measured["forward"], measured["backward"]
        assert (counts.forward_all_to_all, counts.forward_ring, counts.backward_all_to_all,
                counts.backward_ring) == (forward["ulysses_calls"], forward["ring_calls"],
                                          backward["ulysses_calls"], backward["ring_calls"]), f"rank {rank}"
        row = report.row(node, groups, agree=False)
        assert row[11] == format_bytes(forward["ulysses_bytes"]), f"rank {rank}: {row}, {forward}"
        assert row[12] == (format_bytes(forward["ring_bytes"]) if ring > 1 else "-"), f"rank {rank}: {row}"
        moved = report.traffic(node, groups)
        assert (moved.ulysses.backward_bytes, moved.ring.backward_bytes) == (
            backward["ulysses_bytes"], backward["ring_bytes"]), f"rank {rank}: {moved}, {backward}"


@pytest.mark.parametrize("heads_q, heads_kv, ulysses, message", [
    (3, 1, 2, "3 query heads cannot be split over ulysses=2 ranks; choose a mesh whose ulysses "
              "size divides the number of query heads"),
    (6, 3, 2, "3 key/value heads must divide or be divisible by ulysses=2; choose another ulysses size"),
    (12, 3, 4, "3 key/value heads must divide or be divisible by ulysses=4"),
])
def test_rewrite_refuses_head_counts_the_mesh_cannot_split(heads_q, heads_kv, ulysses, message):
    q, k, v = qkv(heads_q=heads_q, heads_kv=heads_kv)
    (gm,) = capture(Layers(HcpAttention()), q, k, v, CU, CU)
    with pytest.raises(UnsupportedAttention, match="hcp::varlen_attention at layers.1.attn") as raised:
        rewrite_attention(gm.graph, find_attention(gm.graph),
                          RewriteConfig(stand_in_groups(ulysses, 1), "auto", True, "balanced"))
    assert message in str(raised.value)


@pytest.mark.parametrize("ulysses, heads_kv", [(4, 1), (4, 2), (2, 4), (8, 2)])
def test_rewrite_accepts_kv_heads_that_divide_or_are_divisible_by_ulysses(ulysses, heads_kv):
    q, k, v = qkv(heads_q=8, heads_kv=heads_kv)
    (gm,) = capture(Layers(HcpAttention()), q, k, v, CU, CU)
    (done,) = rewrite_attention(gm.graph, find_attention(gm.graph),
                                RewriteConfig(stand_in_groups(ulysses, 2), "auto", True, "balanced"))
    assert (done.heads_q, done.heads_kv) == (8, heads_kv)


def test_rewrite_refuses_outputs_other_than_out_and_lse():
    def uses_third_output(q, k, v, cu):
        outputs = torch.ops.torch_attn._varlen_attn(q, k, v, cu, cu, 7, 7, True, None, [-1, 0], True)
        return outputs[0], outputs[2]

    q, k, v = qkv()
    (gm,) = capture(uses_third_output, q, k, v, CU)
    with pytest.raises(UnsupportedAttention, match="output 2 of the op is used"):
        rewrite_attention(gm.graph, find_attention(gm.graph), RewriteConfig(stand_in_groups(2, 2), "auto", True, "balanced"))


def test_mark_kernel_overrides_the_backend_kernel():
    @hc.attention(kernel="torch")
    class Marked(Plain): ...

    q, k, v = qkv()
    (gm,) = capture(Two(Marked(), Marked()), q, k, v, CU)
    # the backend asks for flash, which cannot run on CPU; the marks' "torch" wins
    done = rewrite_attention(gm.graph, find_attention(gm.graph), RewriteConfig(stand_in_groups(2, 2), "flash", True, "balanced"))
    assert [r.kernel for r in done] == ["torch", "torch"]
    (gm,) = capture(Two(Plain(), Plain()), q, k, v, CU)
    with pytest.raises(hc.InputError, match="kernel='flash' needs CUDA"):
        rewrite_attention(gm.graph, find_attention(gm.graph), RewriteConfig(stand_in_groups(2, 2), "flash", True, "balanced"))


def test_pass_uuid_is_stable_and_keyed_by_options_and_marks(mesh):
    groups = resolve_groups(mesh)

    def uuid(kernel="auto", agree=True, placement="balanced", scheme="ring"):
        return HierarchicalCPPass(RewriteConfig(groups, kernel, agree, placement, scheme=scheme)).uuid()

    gc.collect()  # the marks are weakly held: no marked class of another test may vanish now
    gc.disable()
    try:
        first = uuid()
        assert uuid() == first
        assert len({first, uuid(kernel="torch"), uuid(agree=False), uuid(placement="zigzag"),
                    uuid(scheme="allgather")}) == 5
        newly_marked = hc.attention(type("NewlyMarked", (Plain,), {}))
        assert uuid() != first
        del newly_marked
    finally:
        gc.enable()


# --------------------------------------------------------------------------------------------
# the backend's options, entry point and errors
# --------------------------------------------------------------------------------------------

def test_backend_entry_point_is_registered():
    assert torch._dynamo.lookup_backend("hcp") is BACKEND_MODULE.hcp


@pytest.mark.parametrize("options, message", [
    ({"meshh": None}, "options: unknown ['meshh'] for the hcp backend; expected some of"),
    ({"inner": "tvm"}, "inner: expected one of ('inductor', 'aot_eager', 'eager'), got 'tvm'"),
    ({"kernel": "fast"}, "kernel: expected one of"),
    ({"recompute_exchange": "false"}, "recompute_exchange: expected True or False, got 'false'"),
    ({"agree_across_ranks": 0}, "agree_across_ranks: expected True or False, got 0"),
    ({"scheme": "tree"}, f"scheme: expected one of {sorted(SCHEMES)}, got 'tree'"),
])
def test_invalid_backend_options_raise(options, message):
    with pytest.raises(hc.InputError) as raised:
        hc.backend(**options)
    assert message in str(raised.value)


def test_unknown_option_through_torch_compile_names_it():
    q, k, v = qkv()
    compiled = torch.compile(Plain(), backend="hcp", options={"inner": "aot_eager", "dump": "/tmp"})
    with pytest.raises(hc.InputError, match=r"options: unknown \['dump'\]"):
        compiled(q, k, v, CU)


def test_no_mesh_without_torch_distributed_raises(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(hc.InputError, match="no mesh was given and torch.distributed is not initialized"):
        BACKEND_MODULE.default_mesh()


def test_default_mesh_needs_local_world_size_to_divide_the_world(mesh, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(hc.InputError, match="LOCAL_WORLD_SIZE=3 does not divide the world size 1"):
        BACKEND_MODULE.default_mesh()


# --------------------------------------------------------------------------------------------
# explain, compile and dump on a 1 x 1 mesh
# --------------------------------------------------------------------------------------------

class TorchVarlenBlock(nn.Module):
    """A layer written against torch only (varlen_attn has no CPU kernel)."""

    def __init__(self, lse: bool):
        super().__init__()
        self.lse = lse
        self.qkv = nn.Linear(16, 8 * HEAD_DIM)

    def forward(self, x, cu, max_seqlen):
        q, k, v = self.qkv(x).split([4 * HEAD_DIM, 2 * HEAD_DIM, 2 * HEAD_DIM], -1)
        q, k, v = q.reshape(-1, 4, HEAD_DIM), k.reshape(-1, 2, HEAD_DIM), v.reshape(-1, 2, HEAD_DIM)
        if self.lse:
            out, lse = varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, return_aux=AuxRequest(lse=True),
                                   window_size=(-1, 0), enable_gqa=True)
            return out.reshape(x.shape[0], -1)[:, :16] + lse.t().sum(1, keepdim=True)
        out = varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, window_size=(-1, 0), enable_gqa=True)
        return out.reshape(x.shape[0], -1)[:, :16]


class TorchVarlenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([TorchVarlenBlock(lse=False), TorchVarlenBlock(lse=True)])

    def forward(self, x, cu, max_seqlen):
        for block in self.blocks:
            x = x + block(x, cu, max_seqlen)
        return x


def test_explain_reports_without_running_the_model(mesh):
    """The model cannot run on CPU (varlen_attn has no CPU kernel), yet explain reports,
    calling nothing that running the model would call; compiled and run, the model calls all
    of it (so the counting sees a run)."""
    model = TorchVarlenModel()
    x = torch.randn(12, 16, requires_grad=True)
    with counting_runs() as runs:
        explanation = hc.explain(model, x, CU, 7, mesh=mesh)
    assert set(runs.values()) == {0}, f"explain ran the model: {runs}"
    (graph,) = explanation.graphs
    assert [r.match.module_path for r in graph.rewritten] == ["blocks.0", "blocks.1"]
    assert [r.match.op for r in graph.rewritten] == ["torch_attn::_varlen_attn"] * 2
    assert [(r.returns_lse, r.checked, r.local_tokens) for r in graph.rewritten] == [
        (False, True, 12), (True, False, 12)]
    assert graph.before.count("torch.ops.torch_attn._varlen_attn(") == 2
    assert "torch_attn" not in graph.after and graph.after.count("hierarchical_varlen_attention(") == 2
    (table,) = explanation.tables
    assert "| blocks.0 " in table and "| blocks.1 " in table and "1 x 1" in table
    assert str(explanation).startswith("graph 0: 2 attention node(s) rewritten\n|")
    with pytest.raises(hc.InputError, match="unknown"):
        hc.explain(model, x, CU, 7, mesh=mesh, bogus=True)
    with counting_runs() as runs:
        torch.compile(model, backend=hc.backend(mesh=mesh, inner="aot_eager"))(
            hc.shard_plan(CU, mesh).shard(x), CU, 7)
    assert 0 not in runs.values(), f"the counting missed a run: {runs}"


def test_explain_batch_is_the_plans_summary_for_the_models_heads(mesh):
    """``Explanation.batch``: the plan's summary for the heads, head size and dtype of the
    model's attention (4/2 heads of HEAD_DIM in fp32, not the summary's defaults), its one rank
    holding the batch's 12 real tokens and the plan's pads; printed after the tables."""
    model = TorchVarlenModel()
    plan = hc.shard_plan(CU, mesh)
    x = torch.randn(12, 16)
    explanation = hc.explain(model, plan.shard(x), CU, 7, mesh=mesh, plan=plan)
    assert explanation.batch == plan.summary(heads_q=4, heads_kv=2, head_dim=HEAD_DIM, dtype=torch.float32)
    (row,) = [line for line in explanation.batch.splitlines() if line.startswith("| 0 (0, 0)")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert (int(cells[1]), int(cells[2])) == (12, plan.local_tokens - 12)
    assert str(explanation).endswith(f"the batch on every rank:\n{explanation.batch}")
    assert hc.explain(model, plan.shard(x), CU, 7, mesh=mesh).batch is None


def test_explain_of_a_model_without_attention(mesh):
    explanation = hc.explain(nn.Linear(16, 16), torch.randn(12, 16), mesh=mesh)
    assert [g.rewritten for g in explanation.graphs] == [[]]
    assert explanation.tables == ["no attention node with cu_seqlens was found"]


def test_torch_varlen_attn_compiles_and_matches_reference_on_one_rank(mesh):
    """End to end on a 1 x 1 mesh: the plan still pads documents to even lengths; out, lse
    and gradients against the float64 reference; explain first must not change the compile."""
    lengths = (5, 0, 7, 1)
    cu = cu_seqlens(lengths)
    q, k, v = qkv(13, name="one-rank")
    dout = seeded("one-rank/dout", 13, 4, HEAD_DIM)
    plan = hc.shard_plan(cu, mesh)
    shards = [plan.shard(t).requires_grad_() for t in (q, k, v)]
    module = TorchVarlen(lse=True)
    hc.explain(module, *shards, cu, mesh=mesh)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return hc.backend(mesh=mesh, inner="aot_eager")(gm, example_inputs)

    out, lse = torch.compile(module, backend=counting, fullgraph=True)(*shards, cu)
    out.backward(plan.shard(dout))
    assert len(graphs) == 1
    expected = reference_with_grads(q, k, v, dout, cu.tolist(), cu.tolist(), causal=True)
    index = plan.global_index
    for name, got in zip(("out", "dq", "dk", "dv"), (out.detach(), *(s.grad for s in shards))):
        assert_matches(got[index >= 0], expected[name][index[index >= 0]], name)
        assert (got[index < 0] == 0).all(), f"{name} at the pads"
    assert torch.isneginf(lse[:, index < 0]).all()
    assert torch.isfinite(lse[:, index >= 0]).all()


class TwoWindows(nn.Module):
    """Four attention layers alternating two windows, on one q, k, v, summed."""

    windows = ((-1, -1), (3, 0), (-1, -1), (3, 0))

    def forward(self, q, k, v, cu, max_seqlen):
        return sum(hc.varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, window_size=w)
                   for w in self.windows)


def test_compiled_flex_builds_one_mask_per_batch_and_window(mesh, mask_builds):
    """Compiled on one rank with the flex kernel: the block keys read from the batch let
    the layers and the backward share the masks of one batch (one per window), a batch of the
    same values in a new tensor builds none, another batch builds its own; each result
    against the float64 reference."""
    compiled = torch.compile(TwoWindows(), backend=hc.backend(mesh=mesh, inner="aot_eager", kernel="flex"),
                             dynamic=True, fullgraph=True)
    for lengths, expected_builds in (((5, 9, 3), 2), ((5, 9, 3), 2), ((9, 5, 3), 4)):
        cu = cu_seqlens(lengths)  # a new tensor every batch
        q, k, v = qkv(17, name="windows")
        dout = seeded("windows/dout", 17, 4, HEAD_DIM)
        plan = hc.shard_plan(cu, mesh)
        shards = [plan.shard(t).requires_grad_() for t in (q, k, v)]
        out = compiled(*shards, cu, max(lengths))
        out.backward(plan.shard(dout))
        per_window = [reference_with_grads(q, k, v, dout, cu.tolist(), cu.tolist(), causal=True, window=w)
                      for w in TwoWindows.windows]
        index = plan.global_index
        for name, got in zip(("out", "dq", "dk", "dv"), (out.detach(), *(s.grad for s in shards))):
            expected = sum(r[name] for r in per_window)
            assert_matches(got[index >= 0], expected[index[index >= 0]], f"{lengths} {name}")
        assert mask_builds[0] == expected_builds, (
            f"{lengths}: {mask_builds[0]} masks built in all, expected {expected_builds}")


class GraphBreak(nn.Module):
    def forward(self, q, k, v, cu):
        a = hc.varlen_attention(q, k, v, cu, cu, 7, 7, causal=True)
        torch._dynamo.graph_break()
        return hc.varlen_attention(a, k, v, cu, cu, 7, 7, causal=False)


def test_dump_dir_writes_every_graphs_files(mesh, tmp_path):
    cu = cu_seqlens((5, 7))
    plan = hc.shard_plan(cu, mesh)
    shards = [plan.shard(t).requires_grad_() for t in qkv(12, name="dump")]
    compiled = torch.compile(GraphBreak(), backend=hc.backend(mesh=mesh, inner="aot_eager", dump_dir=str(tmp_path)))
    compiled(*shards, cu).sum().backward()
    folders = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("*/*"))
    assert folders == ["rank0/graph_0", "rank0/graph_1"]
    for folder in folders:
        files = {p.name for p in (tmp_path / folder).iterdir()}
        assert files == DUMP_FILES, f"{folder}: {sorted(files)}"
        texts = {name: (tmp_path / folder / name).read_text() for name in files}
        assert "torch.ops.hcp.varlen_attention(" in texts["before_rewrite.py"]
        assert "hierarchical_varlen_attention(" in texts["after_rewrite.py"]
        assert "torch.ops.hcp.block_forward" in texts["aot_forward.py"]
        assert "torch.ops.hcp.block_backward" in texts["aot_backward.py"]
        assert "| hcp::varlen_attention " in texts["matches.md"]


def test_dump_dir_from_the_environment(mesh, tmp_path, monkeypatch):
    monkeypatch.setenv("HCP_DUMP_DIR", str(tmp_path))
    cu = cu_seqlens((5, 7))
    plan = hc.shard_plan(cu, mesh)
    shards = [plan.shard(t) for t in qkv(12, name="dump-env")]
    torch.compile(Plain(), backend=hc.backend(mesh=mesh, inner="eager"))(*shards, cu)
    written = {p.name for p in (tmp_path / "rank0" / "graph_0").iterdir()}
    assert {"before_rewrite.py", "after_rewrite.py", "matches.md", "aot_forward.py"} <= written
    assert "no AOT graphs" in (tmp_path / "rank0" / "graph_0" / "aot_forward.py").read_text()


def test_another_backend_inside_context_parallel_refuses_instead_of_skipping_cp(mesh):
    """Traced, varlen_attention stays the single-device op for the hcp backend to rewrite; a
    graph compiled with another backend would run it on local shards as if they were the
    whole batch, so the op raises when it runs inside context_parallel."""
    cu = cu_seqlens((5, 7))
    q, k, v = qkv(12, name="other-backend")
    compiled = torch.compile(Plain(), backend="aot_eager")
    expected = reference_attention(q.double(), k.double(), v.double(), cu.tolist(), cu.tolist(), causal=True)
    assert_matches(compiled(q, k, v, cu), expected, "outside context_parallel")
    with hc.context_parallel(mesh), pytest.raises(hc.InputError, match="backend='hcp'"):
        compiled(q, k, v, cu)


class _AttentionFunction(torch.autograd.Function):
    """Attention wrapped in an autograd.Function, as flash_attn_varlen_func does."""

    @staticmethod
    def forward(ctx, q, cu):
        return hc.varlen_attention(q, q, q, cu, cu, 7, 7, causal=True)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def test_attention_inside_an_autograd_function_is_refused_not_left_single_device():
    q, _, _ = qkv(heads_q=2, heads_kv=2)
    (gm,) = capture(lambda q, cu: _AttentionFunction.apply(q, cu), q.requires_grad_(), CU)
    with pytest.raises(UnsupportedAttention, match="cannot be rewritten for context parallelism"):
        find_attention(gm.graph)


def test_attention_inside_a_checkpoint_region_is_matched():
    def attend(q, cu):
        return hc.varlen_attention(q, q, q, cu, cu, 7, 7, causal=True)

    q, _, _ = qkv(heads_q=2, heads_kv=2)
    checkpointed = lambda q, cu: torch.utils.checkpoint.checkpoint(attend, q, cu, use_reentrant=False)
    (gm,) = capture(checkpointed, q.requires_grad_(), CU)
    (match,) = find_attention(gm.graph)
    assert match.node.graph is not gm.graph  # found in the checkpoint body
    assert match.op == "hcp::varlen_attention"


# --------------------------------------------------------------------------------------------
# the compiled batch check (one rank), and nested contexts
# --------------------------------------------------------------------------------------------

class GivenMaxSeqlen(nn.Module):
    def forward(self, q, k, v, cu, max_seqlen: int):
        return hc.varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True)


def compiled_on(mesh, model: nn.Module):
    return torch.compile(model, backend="hcp", options={"mesh": mesh, "inner": "aot_eager"})


def test_compiled_refuses_max_seqlen_below_the_longest_document(mesh):
    q, k, v = qkv()
    with pytest.raises(hc.InputError, match="max_seqlen_q, max_seqlen_k: must be at least the longest document's length"):
        compiled_on(mesh, GivenMaxSeqlen())(q, k, v, CU, 6)


def test_compiled_refuses_int64_cu_seqlens_at_compile_time(mesh):
    q, k, v = qkv()
    with pytest.raises(hc.InputError, match="cu_seqlens_q: expected dtype torch.int32"):
        compiled_on(mesh, Plain())(q, k, v, CU.long())


def test_compiled_refuses_q_k_v_of_different_token_counts_at_compile_time(mesh):
    """The graph alone decides that k, v cannot hold the rank's token count when q holds
    another one; the same rule as eagerly, with the token counts found."""
    q, k, v = qkv()
    with pytest.raises(UnsupportedAttention, match=re.escape(
            "q, k, v: under context parallelism must hold this rank's token count")) as raised:
        compiled_on(mesh, Plain())(q, k[:10], v[:10], CU)
    assert "got 12, 10 and 10 tokens (q, k, v)" in str(raised.value)


def test_compiled_refuses_q_k_v_of_another_token_count_on_the_device(mesh):
    q, k, v = (t[:10] for t in qkv())
    with pytest.raises(hc.InputError, match=re.escape(
            "- q, k, v: under context parallelism must hold this rank's token count")):
        compiled_on(mesh, Plain())(q, k, v, CU)


def test_compiled_refuses_a_batch_planned_with_another_placement(mesh):
    q, k, v = qkv()
    cu = CU.clone()
    hc.shard_plan(cu, mesh, placement="zigzag")  # the backend's placement is "balanced"
    with pytest.raises(hc.InputError, match="cu_seqlens: must be the batch shard_plan laid out for the attention's mesh shape and placement"):
        compiled_on(mesh, Plain())(q, k, v, cu)


def test_nested_context_parallel_restores_each_outer_context(mesh):
    from hcp_compile.context import active_context

    outer, inner = hc.context_parallel(mesh), hc.context_parallel(mesh, placement="zigzag")
    with outer:
        with inner:
            with inner:  # the same context entered twice
                assert active_context() is inner
            assert active_context() is inner
        assert active_context() is outer
    assert active_context() is None
