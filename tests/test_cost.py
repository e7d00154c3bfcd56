"""The cost model of the attention blocks: the FLOP formulas (what torch's FlopCounterMode and
Inductor's overlap scheduler see) and the runtime hook for the scheduler.

The formulas are checked against counts made without them: the matmuls of a tiny block
counted by hand, and torch's own counts of the same attention written as dense
``scaled_dot_product_attention`` (the bound the formulas give is exact when every document is
``max_seqlen`` long)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

import hcp_compile  # noqa: F401  (registers the ops)
from hcp_compile.kernels import BlockSpec, run_backward, run_forward
from hcp_compile.kernels import measured
from hcp_compile.kernels.cost import estimate_block_runtime_ms
from hcp_compile.kernels.measured import throughput
from cp_cases import cu_seqlens, seeded

DIM = 8


def block_inputs(lengths: tuple[int, ...], heads_q: int, heads_kv: int, dim: int = DIM):
    tokens = sum(lengths)
    return (seeded("cost/q", tokens, heads_q, dim), seeded("cost/k", tokens, heads_kv, dim),
            seeded("cost/v", tokens, heads_kv, dim), cu_seqlens(lengths))


def forward(q, k, v, cu, max_k: int, causal: bool):
    return run_forward("torch", q, k, v, BlockSpec(cu, cu, max_k, max_k, causal, 0.3))


def backward(q, k, v, cu, max_k: int, causal: bool):
    out, lse = forward(q, k, v, cu, max_k, causal)
    return run_backward("torch", out, q, k, v, out, lse, BlockSpec(cu, cu, max_k, max_k, causal, 0.3))


def counted(fn, *args) -> int:
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


def forward_and_backward_flops(inputs, max_k: int, causal: bool) -> tuple[int, int]:
    forward_flops = counted(forward, *inputs, max_k, causal)
    return forward_flops, counted(backward, *inputs, max_k, causal) - forward_flops


@pytest.mark.parametrize("causal, expected", [(False, (1152, 2880)), (True, (576, 1440))])
def test_a_tiny_block_counts_its_matmuls(causal, expected):
    """One document of 6 tokens, 2 query heads sharing 1 KV head, head dim 4. Per head,
    each product of 6 x 6 x 4 multiply-adds is 288 FLOPs. The forward runs two (S = Q K^T,
    O = P V): 2 * 288 * 2 heads = 1152. The backward runs five (S again, dV = P^T dO,
    dP = dO V^T, dQ = dS K, dK = dS^T Q): 2880. Causal counts half of each."""
    inputs = block_inputs((6,), heads_q=2, heads_kv=1, dim=4)
    assert forward_and_backward_flops(inputs, max_k=6, causal=causal) == expected


def dense_sdpa_forward_flops(docs: int, length: int, heads_q: int, heads_kv: int) -> int:
    """What FlopCounterMode counts for sdpa over the documents as a batch: on the meta device
    sdpa runs its math path, so the count is that of its real matmuls."""
    q = torch.empty(docs, heads_q, length, DIM, device="meta")
    k = v = torch.empty(docs, heads_kv, length, DIM, device="meta")
    return counted(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


SDPA_CASES = [pytest.param(1, 16, 4, 4, id="one-doc-mha"), pytest.param(3, 8, 4, 2, id="three-docs-gqa"),
              pytest.param(5, 4, 2, 1, id="five-docs-mqa")]


@pytest.mark.parametrize("docs, length, heads_q, heads_kv", SDPA_CASES)
def test_equal_documents_count_as_dense_sdpa_over_them(docs, length, heads_q, heads_kv):
    inputs = block_inputs((length,) * docs, heads_q, heads_kv)
    forward_flops, backward_flops = forward_and_backward_flops(inputs, max_k=length, causal=False)
    q_shape, kv_shape = (docs, heads_q, length, DIM), (docs, heads_kv, length, DIM)
    assert forward_flops == dense_sdpa_forward_flops(docs, length, heads_q, heads_kv)
    assert forward_flops == flop_counter.sdpa_flop_count(q_shape, kv_shape, kv_shape)
    # torch's formula for its fused kernels' backward, which recompute the scores as ours do
    assert backward_flops == flop_counter.sdpa_backward_flop_count(q_shape, q_shape, kv_shape, kv_shape)


def test_the_bound_follows_max_seqlen_k_not_the_keys_of_the_block():
    """Two documents of 8 and 12 tokens: each query sees at most max_seqlen_k = 12 keys, fewer
    than the 20 of the block, and the count is that of 20 queries against 12 keys each."""
    inputs = block_inputs((8, 12), heads_q=4, heads_kv=2)
    one_doc_of_12 = forward_and_backward_flops(block_inputs((12,), heads_q=4, heads_kv=2), 12, False)
    assert forward_and_backward_flops(inputs, max_k=12, causal=False) == tuple(
        flops * 20 // 12 for flops in one_doc_of_12)
    # a max_seqlen_k beyond the block's keys is capped by them
    assert forward_and_backward_flops(inputs, max_k=40, causal=False) == tuple(
        flops * 20 * 20 // (12 * 12) for flops in one_doc_of_12)


def hook_estimates(inputs, kernel: str = "torch") -> dict:
    """The runtime hook's estimate of every node of a traced block forward + backward."""
    def block(q, k, v, cu):
        spec = BlockSpec(cu, cu, 12, 12, True, 0.3)
        out, lse = run_forward(kernel, q, k, v, spec)
        return run_backward(kernel, out, q, k, v, out, lse, spec)

    graph = make_fx(block, tracing_mode="fake")(*inputs)
    estimates = {}
    for node in graph.graph.nodes:
        target = getattr(node.target, "overloadpacket", None)
        estimate = estimate_block_runtime_ms(node)
        if target in (torch.ops.hcp.block_forward, torch.ops.hcp.block_backward):
            estimates[target] = estimate
        else:
            assert estimate is None, f"{node.format_node()} got an estimate"
    return estimates


def test_runtime_hook_estimates_blocks_only_from_their_flops():
    """The hook reads a block's shapes, max_seqlen_k and causal from its graph node; what the
    FLOP counter counts for the same calls, at the kernel's measured throughput on the
    device (here unmeasured: the fallback of measured.throughput), is its estimate."""
    inputs = block_inputs((8, 12), heads_q=4, heads_kv=2)
    forward_flops, backward_flops = forward_and_backward_flops(inputs, max_k=12, causal=True)
    per_s = throughput("torch", "cpu")
    assert hook_estimates(inputs) == {
        torch.ops.hcp.block_forward: forward_flops / per_s * 1e3,
        torch.ops.hcp.block_backward: backward_flops / per_s * 1e3,
    }


def test_runtime_hook_takes_the_throughput_of_the_nodes_kernel_and_device(monkeypatch):
    """Kernels measured at 100 and 400 TFLOP/s on this device kind: the estimates differ by 4x."""
    monkeypatch.setattr(measured, "throughputs", lambda kind_of_call=None: {"cpu": {"torch": 100e12, "flex": 400e12}})
    inputs = block_inputs((8, 12), heads_q=4, heads_kv=2)
    slow, fast = hook_estimates(inputs, "torch"), hook_estimates(inputs, "flex")
    forward_flops, _ = forward_and_backward_flops(inputs, max_k=12, causal=True)
    assert slow[torch.ops.hcp.block_forward] == forward_flops / 100e12 * 1e3
    assert fast == {op: ms / 4 for op, ms in slow.items()}


def test_unmeasured_devices_and_kernels_fall_back_to_other_measurements(monkeypatch):
    monkeypatch.setattr(measured, "throughputs", lambda kind_of_call=None: {
        "A": {"flash": 300e12, "flex": 400e12}, "B": {"flash": 100e12}})
    assert measured.throughput("flex", "A") == 400e12
    assert measured.throughput("flash", "unknown GPU") == 200e12  # flash's mean over A and B
    assert measured.throughput("torch", "A") == 800e12 / 3  # no torch anywhere: everything's mean
    assert measured.fastest("A", ["flash", "flex", "torch"]) == "flex"
    assert measured.fastest("A", ["flash", "torch"]) == "flash"
    assert measured.fastest("unknown GPU", ["flash", "flex"]) is None


def test_a_calls_throughput_follows_its_work_between_the_recorded_sizes(recorded_measurements):
    """Linear in log(FLOPs per call) between two recorded sizes, the nearest size's outside
    them; no size term where a kernel or composition has fewer than two sizes, and the main
    table alone still decides ``kernel="auto"``."""
    short = measured.SHORT
    recorded = {"devices": {"A": {
        "tflops": {short: {"cudnn": 250, "flash": 180}},
        "sizes": [
            {"tokens": 4096, "composition": short, "call_tflop": 0.1, "tflops": {"cudnn": 100, "flash": 90}},
            {"tokens": 131072, "composition": short, "call_tflop": 10.0, "tflops": {"cudnn": 300}},
            {"tokens": 16384, "composition": short, "call_tflop": 1.0, "tflops": {"cudnn": 200}},
        ],
    }}}
    recorded_measurements(recorded)
    assert measured.throughput_at("cudnn", "A", short, 1e12) == pytest.approx(200e12)
    # halfway in log between 0.1 and 1 TFLOP (about 0.316): halfway between 100 and 200 TF/s
    assert measured.throughput_at("cudnn", "A", short, 10 ** -0.5 * 1e12) == pytest.approx(150e12)
    assert measured.throughput_at("cudnn", "A", short, 10 ** 0.25 * 1e12) == pytest.approx(225e12)
    assert measured.throughput_at("cudnn", "A", short, 1e9) == pytest.approx(100e12)  # below: the smallest
    assert measured.throughput_at("cudnn", "A", short, 1e15) == pytest.approx(300e12)  # above: the largest
    assert measured.throughput_at("flash", "A", short, 1e12) is None  # one size only
    assert measured.throughput_at("cudnn", "A", measured.LOG_UNIFORM, 1e12) is None
    assert measured.throughput_at("cudnn", "B", short, 1e12) is None
    assert measured.throughputs(short)["A"] == {"cudnn": 250e12, "flash": 180e12}


def test_calls_are_judged_by_the_measurements_of_their_composition(recorded_measurements):
    """A device's row for the call's composition decides; a composition it did not record, or
    an unknown one, the mean over its unwindowed rows."""
    recorded = {"devices": {
        "A": {"tflops": {"one document": {"dense": 500, "cudnn": 450},
                         "log-uniform documents": {"dense": 300, "cudnn": 450},
                         "window": {"flash": 250, "flex": 150}}},
        "B": {"tflops": {"one document": {"flash": 100}}},
    }}
    recorded_measurements(recorded)
    assert measured.throughputs() == {"A": {"dense": 400e12, "cudnn": 450e12}, "B": {"flash": 100e12}}
    assert measured.throughputs(measured.WINDOW) == {"A": {"flash": 250e12, "flex": 150e12},
                                                     "B": {"flash": 100e12}}
    one = measured.composition(False, segments=1, longest=131_072)
    many = measured.composition(False, segments=20, longest=30_000)
    assert (one, many) == (measured.ONE_DOCUMENT, measured.LOG_UNIFORM)
    assert measured.fastest("A", ["dense", "cudnn"], one) == "dense"
    assert measured.fastest("A", ["dense", "cudnn"], many) == "cudnn"
    assert measured.fastest("A", ["dense", "cudnn"], None) == "cudnn"  # by the means
    # short documents: A did not record them, so the means decide
    assert measured.fastest("A", ["dense", "cudnn"], measured.composition(False, 200, 1500)) == "cudnn"
    assert measured.fastest("A", ["flash", "flex"], measured.composition(True, 20, 30_000)) == "flash"


def test_the_recorded_measurements_load():
    """measured.json as shipped: every device lists TFLOP/s per kernel for every composition
    ``kernel="auto"`` judges calls by."""
    for kind_of_call in (None, *measured.recorded()["NVIDIA H200"]):
        table = measured.throughputs(kind_of_call)
        assert table and all(per_kernel for per_kernel in table.values())
        assert all(1e12 < v < 1e16 for per_kernel in table.values() for v in per_kernel.values())
    assert set(measured.recorded()["NVIDIA H200"]) == {
        measured.ONE_DOCUMENT, measured.LOG_UNIFORM, measured.SHORT, measured.WINDOW}
    sizes = measured.recorded_sizes()["NVIDIA H200"]
    assert set(sizes) == set(measured.recorded()["NVIDIA H200"])
    for per_kernel in sizes.values():
        for points in per_kernel.values():
            work = [w for w, _ in points]
            assert len(points) >= 2 and work == sorted(set(work))
            assert all(1e9 < w < 1e16 and 1e12 < f < 1e16 for w, f in points)
