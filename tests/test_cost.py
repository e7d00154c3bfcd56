"""The cost model of the attention blocks: FLOP formulas (what torch's FlopCounterMode and
Inductor's overlap scheduler see) and the runtime hook for the scheduler."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

import hcp_compile  # noqa: F401  (registers the ops)
from hcp_compile.kernels.cost import ATTENTION_FLOPS_PER_S, estimate_block_runtime_ms

TOKENS, HEADS, KV_HEADS, DIM = 20, 4, 2, 8
CU = torch.tensor([0, 8, 20], dtype=torch.int32)


def inputs():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(TOKENS, HEADS, DIM, generator=generator)
    kv = torch.randn(TOKENS, KV_HEADS, DIM, generator=generator)
    return q, kv, kv.clone(), CU


def forward(q, k, v, cu, max_k: int, causal: bool):
    return torch.ops.hcp.block_forward(q, k, v, cu, cu, max_k, max_k, causal, 0.3, -1, -1, None, None, "torch")


def backward(q, k, v, cu, max_k: int, causal: bool):
    out, lse = forward(q, k, v, cu, max_k, causal)
    return torch.ops.hcp.block_backward(out, q, k, v, out, lse, cu, cu, max_k, max_k, causal, 0.3,
                                        -1, -1, None, None, "torch")


def expected_flops(max_k: int, causal: bool, backward: bool) -> int:
    # every query sees at most min(keys, max_seqlen_k) keys; two products of D per pair
    pairs = TOKENS * min(TOKENS, max_k) * HEADS
    flops = 2 * 2 * pairs * DIM // (2 if causal else 1)
    return flops * 5 // 2 if backward else flops


def test_flop_counter_counts_the_blocks():
    for max_k in (12, 40):
        for causal in (True, False):
            with FlopCounterMode(display=False) as counter:
                forward(*inputs(), max_k, causal)
            assert counter.get_total_flops() == expected_flops(max_k, causal, backward=False)
            with FlopCounterMode(display=False) as counter:
                backward(*inputs(), max_k, causal)
            total = expected_flops(max_k, causal, False) + expected_flops(max_k, causal, True)
            assert counter.get_total_flops() == total


def test_runtime_hook_estimates_blocks_only():
    graph = make_fx(lambda q, k, v, cu: backward(q, k, v, cu, 12, True), tracing_mode="fake")(*inputs())
    estimates = {}
    for node in graph.graph.nodes:
        target = getattr(node.target, "overloadpacket", None)
        estimate = estimate_block_runtime_ms(node)
        if target in (torch.ops.hcp.block_forward, torch.ops.hcp.block_backward):
            estimates[target] = estimate
        else:
            assert estimate is None, f"{node.format_node()} got an estimate"
    assert estimates == {
        torch.ops.hcp.block_forward: expected_flops(12, True, False) / ATTENTION_FLOPS_PER_S * 1e3,
        torch.ops.hcp.block_backward: expected_flops(12, True, True) / ATTENTION_FLOPS_PER_S * 1e3,
    }
