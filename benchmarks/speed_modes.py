"""The modes of benchmarks.speed on one batch repeated: the one-GPU calls (torch's flex, flash
and dense SDPA, hcp's single-device op), hcp's CP call eagerly and compiled on this rank's
shard, and torch's native ring CP; and the kernel hcp resolves for a workload."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import hcp_compile
from benchmarks.speed_measure import measure, one_gpu_trace, trace_name
from benchmarks.speed_rows import Measurement
from benchmarks.speed_setup import Batch, Setup
from benchmarks.speed_workloads import HEADS, Workload
from hcp_compile.batch.layout import window_by_position
from hcp_compile.kernels import BlockRequest, resolve_kernel

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


def one_gpu_call(mode: str, batch: Batch, setup: Setup) -> tuple[Attend, list[Tensor]]:
    """A one-GPU mode's call on the whole batch and its inputs: q, k and v, new leaves that take
    gradients, in the mode's layout (flex's and SDPA's ``[1, H, T, D]``, made before the timing as
    hcp's ``[T, H, D]`` is). The call holds the batch's ``cu_seqlens``, not the batch."""
    bhtd = mode in ("one-gpu-flex", "one-gpu-sdpa")
    inputs = [(t.transpose(0, 1).unsqueeze(0).contiguous() if bhtd else t.clone()).requires_grad_()
              for t in batch.qkv]
    cu, longest, workload = batch.cu, batch.longest, batch.workload
    if mode == "one-gpu-flex":
        mask = document_block_mask(workload, setup.device)
        attend = torch.compile(flex_attention, dynamic=False) if setup.device.type == "cuda" else flex_attention
        gqa = inputs[0].shape[1] != inputs[1].shape[1]
        return (lambda q, k, v: attend(q, k, v, block_mask=mask, enable_gqa=gqa)), inputs
    if mode == "one-gpu-sdpa":
        return dense_causal, inputs
    if mode == "one-gpu-flash":
        return flash_call(cu, longest, workload.window_left), inputs
    module = PackedAttention(workload.window, setup.args.kernel)
    return (lambda q, k, v: module(q, k, v, cu, longest)), inputs


def one_gpu_flex(batch: Batch, setup: Setup) -> Measurement:
    """torch's flex_attention on the whole batch, compiled, with a document + causal (+ window)
    block mask. On CPU it runs uncompiled and fails: torch's flex has no backward there (the
    smoke test records that error)."""
    cuda = setup.device.type == "cuda"
    return measure(*one_gpu_call("one-gpu-flex", batch, setup), setup, alone=True, first_call=cuda,
                   profile=one_gpu_trace(batch, setup, "one-gpu-flex"))


def document_block_mask(workload: Workload, device: torch.device) -> BlockMask:
    """Queries see earlier keys of their own document (and, with a window, at most
    ``window_left`` positions back)."""
    lengths = torch.tensor(workload.lengths, device=device)
    document = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    left = workload.window_left

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)
        return visible & (q_idx - kv_idx <= left) if left >= 0 else visible

    tokens = int(lengths.sum())
    # _compile: without it the mask is evaluated as a dense [T, T] tensor (16 GiB at 128K)
    return create_block_mask(mask_mod, None, None, tokens, tokens, device=device,
                             _compile=device.type == "cuda")


def one_gpu_sdpa(batch: Batch, setup: Setup) -> Measurement:
    """Dense causal ``F.scaled_dot_product_attention`` on ``[1, H, T, D]`` with the backend torch
    picks (cuDNN on an H200 with torch 2.11): exact only for a one-document batch without a
    window, the only workloads it runs on."""
    return measure(*one_gpu_call("one-gpu-sdpa", batch, setup), setup, alone=True,
                   profile=one_gpu_trace(batch, setup, "one-gpu-sdpa"))


def dense_causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def one_gpu_hcp(batch: Batch, setup: Setup) -> Measurement:
    """hcp's single-device ``varlen_attention`` (no context parallelism) on the whole batch,
    with the kernel ``--kernel`` resolves to."""
    return measure(*one_gpu_call("one-gpu-hcp", batch, setup), setup, alone=True,
                   profile=one_gpu_trace(batch, setup, "one-gpu-hcp"))


def one_gpu_flash(batch: Batch, setup: Setup) -> Measurement:
    """``aten._flash_attention_forward`` (differentiable) on the whole batch, as hcp's flash
    kernel calls it: KV heads as they are, the window as flash's left/right sizes."""
    return measure(*one_gpu_call("one-gpu-flash", batch, setup), setup, alone=True,
                   profile=one_gpu_trace(batch, setup, "one-gpu-flash"))


def flash_call(cu: Tensor, longest: int, window_left: int) -> Attend:
    window = {"window_size_left": window_left, "window_size_right": 0} if window_left >= 0 else {}

    def attend(q, k, v):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, **window
        )[0]

    return attend


class PackedAttention(nn.Module):
    """The single-device call that the hcp modes run on shards (compiled: rewritten). The
    window is an attribute, not an argument: a module's ints stay constants in the graph, while
    an int argument that changes between calls would be traced as a symbol, and the backend
    needs the window at compile time."""

    def __init__(self, window: tuple[int, int], kernel: str = "auto"):
        super().__init__()
        self.window, self.kernel = window, kernel

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        if self.kernel != "auto":  # one device, a named kernel (under CP the context or backend names it)
            return torch.ops.hcp.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True,
                                                  q.shape[-1] ** -0.5, *self.window, self.kernel)[0]
        return hcp_compile.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                            causal=True, window_size=self.window)


def hcp_mode(
    batch: Batch, setup: Setup, placement: str, compiled: Callable[..., Tensor] | None,
    recompute_exchange: bool,
) -> Measurement:
    """hcp on this rank's shard: eagerly in ``context_parallel``, or through ``compiled`` (a
    compiled :class:`PackedAttention` of the batch's window, with the same
    ``recompute_exchange``)."""
    if setup.fake and setup.device.type == "cuda":
        fill_free_memory(setup.device)
    profile = trace_name(batch, setup, "hcp-compiled" if compiled is not None else "hcp-eager", placement)
    if compiled is None:
        with hcp_eager(batch, setup, placement, recompute_exchange) as (attend, local):
            return measure(attend, local, setup, profile=profile)
    local = sharded(batch, setup, placement)
    # the token count, the document count and the longest document vary across workloads:
    # traced as symbols, so that one graph per (placement, window) serves them all (but a
    # one-document batch, whose 2-entry cu_seqlens gets specialized, has a graph of its own)
    for t in (*local, batch.cu):
        torch._dynamo.maybe_mark_dynamic(t, 0)

    def step(q, k, v):
        with torch.compiler.config.patch(dynamic_sources="L['max_seqlen']"):
            return compiled(q, k, v, batch.cu, batch.longest)

    return measure(step, local, setup, first_call=True, profile=profile)


def sharded(batch: Batch, setup: Setup, placement: str) -> list[Tensor]:
    """This rank's shards of q, k and v under ``placement``, leaves that take gradients."""
    plan = hcp_compile.shard_plan(batch.cu, setup.hcp_mesh(), placement=placement,
                                  window=setup.layout_window(batch.workload.window))
    return [plan.shard(t).requires_grad_() for t in batch.qkv]


@contextlib.contextmanager
def hcp_eager(batch: Batch, setup: Setup, placement: str,
              recompute_exchange: bool = False) -> Iterator[tuple[Callable[..., Tensor], list[Tensor]]]:
    """``(attend, shards)``: this rank's eager CP call on its shards (``attend(*shards)``),
    valid inside the block (``context_parallel`` of ``--kernel`` is active there)."""
    local = sharded(batch, setup, placement)
    attend = PackedAttention(batch.workload.window)
    with hcp_compile.context_parallel(setup.hcp_mesh(), kernel=setup.args.kernel, placement=placement,
                                      recompute_exchange=recompute_exchange, scheme=setup.args.scheme):
        yield (lambda q, k, v: attend(q, k, v, batch.cu, batch.longest)), local


def fill_free_memory(device: torch.device) -> None:
    """Most of the GPU's free memory, written with bf16 normal samples and left in the caching
    allocator, which carves later buffers out of it: what a fake collective "receives"."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    filler = torch.empty(int(0.8 * free) // 2, dtype=torch.bfloat16, device=device)
    filler.normal_()
    del filler


def compile_hcp(
    setup: Setup, placement: str, window: tuple[int, int], recompute_exchange: bool,
) -> Callable[..., Tensor]:
    args = setup.args
    backend = hcp_compile.backend(mesh=setup.hcp_mesh(), placement=placement, kernel=args.kernel,
                                  inner=args.inner, recompute_exchange=recompute_exchange, scheme=args.scheme)
    return torch.compile(PackedAttention(window), backend=backend, fullgraph=True)


def hcp_kernel(workload: Workload, heads: str, setup: Setup, cp: bool = True) -> str:
    """The kernel hcp runs this workload with (the choice context_parallel and the backend
    make, or the single-device op's with ``cp=False``) for ``--kernel``; the option itself when
    none can (the mode then fails and its row says why)."""
    kernel = setup.args.kernel
    q, k = (torch.empty(0, h, setup.args.head_dim, device=setup.device, dtype=setup.dtype) for h in HEADS[heads])
    # one device judges each call by its batch's composition (the op passes it); CP by the mean
    composition = {} if cp else {"segments": len(workload.lengths), "longest": max(workload.lengths)}
    by_position = cp and window_by_position(workload.window, setup.args.ring)
    request = BlockRequest.of(q, k, workload.window, window_by_position=by_position, **composition)
    try:
        return resolve_kernel(kernel, request)
    except hcp_compile.InputError:
        return kernel


def torch_native_cp(batch: Batch, setup: Setup) -> Measurement:
    """torch's ring CP: SDPA inside ``context_parallel``, which shards the [1, H, T, D] buffers
    in place (head-tail load balancing) and patches ``F.scaled_dot_product_attention``."""
    from torch.distributed.tensor.experimental import context_parallel

    q, k, v = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in batch.qkv)
    with context_parallel(setup.sequence_mesh(), buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                          no_restore_buffers={q, k, v}):
        local = [t.requires_grad_() for t in (q, k, v)]
        # F's attribute is looked up per call: the patched function
        return measure(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), local,
                       setup, profile=trace_name(batch, setup, "torch-native-cp", "head-tail"))
