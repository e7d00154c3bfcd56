"""What one attention block costs, for FLOP counters and Inductor's overlap scheduler.

The scheduler hides collectives only behind nodes it counts as compute, which are the ops with
a ``torch.utils.flop_counter`` formula; without one, the blocks of the ring would look free and
the ring transfers would be placed next to other work instead of next to them. A block's real
work depends on the document boundaries, which a graph does not know: the formulas give the
bound that every query sees at most ``max_seqlen_k`` keys (half of them on a causal diagonal).
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.flop_counter import register_flop_formula

from hcp_compile.kernels.contract import BlockSpec
from hcp_compile.kernels.measured import device_kind, throughput


def block_flops(
    q_shape: torch.Size, k_shape: torch.Size, max_seqlen_k: int | torch.SymInt | None, causal: bool,
    backward: bool,
) -> int:
    """Upper bound of the FLOPs of one block (q ``[Tq, H, D]``, k ``[Tk, Hkv, D]``)."""
    tokens_q, heads, dim = (size_hint(s) for s in q_shape)
    keys = size_hint(k_shape[0])
    if max_seqlen_k is not None:
        keys = min(keys, size_hint(max_seqlen_k))
    flops = 4 * tokens_q * keys * heads * dim  # q k^T and p v
    if causal:
        flops //= 2
    return flops * 5 // 2 if backward else flops  # the backward runs five such products


@register_flop_formula(torch.ops.hcp.block_forward)
def _block_forward_flops(q_shape, k_shape, v_shape, cu_q_shape, cu_k_shape, max_q, max_k,
                         causal, *args, **kwargs) -> int:
    return block_flops(q_shape, k_shape, max_k, causal, backward=False)


@register_flop_formula(torch.ops.hcp.block_backward)
def _block_backward_flops(dout_shape, q_shape, k_shape, v_shape, output_shape, lse_shape,
                          cu_q_shape, cu_k_shape, max_q, max_k, causal, *args, **kwargs) -> int:
    return block_flops(q_shape, k_shape, max_k, causal, backward=True)


# what a size read from the batch (the layout's sizes) counts as when it has no hint: the
# value Inductor itself assumes for such sizes
UNKNOWN_SIZE = 8192


def size_hint(size: int | torch.SymInt) -> int:
    """A size as an int, without adding a guard for a symbolic one (``UNKNOWN_SIZE`` for a
    size that depends on the batch's values)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    hint = size.node.hint
    return int(hint) if hint is not None else UNKNOWN_SIZE


def estimate_block_runtime_ms(node: fx.Node, override_size: int | None = None) -> float | None:
    """Inductor's ``custom_runtime_estimation`` hook: the time of a block node from its FLOP
    bound at the measured throughput of its kernel on its device (measured.json), None for
    every other node (Inductor's own estimate). It also keeps the scheduler from benchmarking
    a block on random ``cu_seqlens``, which would read out of bounds."""
    target = getattr(node.target, "overloadpacket", node.target)
    if target not in (torch.ops.hcp.block_forward, torch.ops.hcp.block_backward):
        return None
    backward = target is torch.ops.hcp.block_backward
    tensors = 6 if backward else 3  # (dout,) q, k, v (, out, lse); then the spec, the kernel
    q, k = (node.args[i].meta["val"] for i in ((1, 2) if backward else (0, 1)))
    spec = BlockSpec.from_op_args(node.args[tensors:-1])
    max_k = spec.max_k.meta.get("val") if isinstance(spec.max_k, fx.Node) else spec.max_k
    flops = block_flops(q.shape, k.shape, max_k, bool(spec.causal), backward)
    return flops / throughput(node.args[-1], device_kind(q.device)) * 1e3
