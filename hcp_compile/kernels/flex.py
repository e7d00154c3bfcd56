"""flex_attention as a block kernel: the block's segments as a block mask (flex_mask.py), GQA
through ``enable_gqa`` (KV heads not repeated), the window and causal mask in ``mask_mod``.

Forward: the public ``flex_attention`` with ``return_aux=AuxRequest(lse=True)`` (lse in
natural log), compiled once per process with dynamic shapes on CUDA.

Backward: the ring hands every block the *merged* out and lse of all its blocks. With
``P = exp(S - lse)`` from the merged lse and ``D = rowsum(dO * O)`` from the merged out, flex's
own backward computes ``dS = P * (dO V^T - D)``, which is exactly this block's share of the
merged softmax's gradient; so the backward calls flex's backward operator
(``torch.ops.higher_order.flex_attention_backward``) on the merged out and lse directly. The
alternative, autograd through a recomputed forward of the block with rescaled output and lse
gradients, is as exact but runs the forward again in every backward (40 % more backward work).
Dynamo traces that operator only when its score and mask graphs are submodules of a traced
graph (how compiled autograd calls it, the form torch 2.11 and 2.14 both accept), so the
backward is a small ``fx.GraphModule`` built here, compiled like the forward.

Without a compiler (CPU) flex runs its unfused reference path: dense scores over the whole
block, fine for tests, not for long sequences.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections.abc import Iterator

import torch
from torch import Tensor, fx
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from torch._higher_order_ops.flex_attention import create_fw_bw_graph, flex_attention_backward
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from .contract import BlockRequest, BlockSpec
from .flex_mask import document_mask, visible
from .precision import accumulate_dtype

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# torch.compile backend per device type; other devices run flex uncompiled (tests set "cpu" to
# "aot_eager" to trace the same graphs as on CUDA)
COMPILE_BACKENDS: dict[str, str] = {"cuda": "inductor"}
# flex's backward operator takes the forward operator's lse, which is in base 2
_LN2 = math.log(2.0)


# measured on one H200 with torch 2.11: the forward runs, the backward's lowering fails; no
# later CUDA torch has been tried, so CUDA stays off until one is (docs/design.md §8.5)
_BACKWARD_LOWERS_ON_CUDA = False

class FlexKernel:
    name = "flex"

    def supports(self, request: BlockRequest) -> str | None:
        if request.device.type not in ("cuda", "cpu"):
            return f"needs CUDA or CPU tensors; got {request.device}"
        if request.dtype not in SUPPORTED_DTYPES:
            return f"needs fp16, bf16 or fp32 tensors; got {request.dtype}"
        if request.device.type == "cuda" and not _BACKWARD_LOWERS_ON_CUDA:
            return (
                "is not available on CUDA with this torch: Inductor fails to lower the flex "
                "backward that the ring needs (given the merged out and lse) on torch 2.11 "
                "('ShapeAsConstantBuffer' has no attribute 'dtype', docs/design.md §8.5)"
            )
        if request.device.type == "cuda" and request.head_dim < 16:
            return f"needs head_dim of at least 16 on CUDA; got {request.head_dim}"
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: BlockSpec) -> tuple[Tensor, Tensor]:
        if q.shape[0] == 0 or k.shape[0] == 0:  # an empty region or ring section: nothing to see
            lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device,
                             dtype=accumulate_dtype(q.dtype))
            return torch.zeros_like(q), lse
        mask = document_mask(spec, q.shape[0], k.shape[0])
        with _top_level_dispatch():
            out, aux = _forward_function(_backend(q))(
                _heads_first(q), _heads_first(k), _heads_first(v), block_mask=mask.block_mask,
                scale=spec.scale, enable_gqa=q.shape[1] != k.shape[1],
                return_aux=AuxRequest(lse=True),
            )
        return _tokens_first(out), aux.lse[0].to(accumulate_dtype(q.dtype)).contiguous()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        spec: BlockSpec,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        mask = document_mask(spec, q.shape[0], k.shape[0])
        q4, k4, v4 = _heads_first(q), _heads_first(k), _heads_first(v)
        layout = mask.block_mask.as_tuple()
        tensors = [t for t in layout[2:-1] if isinstance(t, Tensor)]
        lse_base2 = (lse.to(torch.float32) / _LN2).unsqueeze(0)
        with _top_level_dispatch():  # also for tracing the graph, on its first use
            graph = _backward_graph(_backend(q), mask.variant, spec.scale, _template(layout),
                                    _kernel_options(q4, k4, v4))
            dq, dk, dv = graph(q4, k4, v4, _heads_first(out), lse_base2, _heads_first(dout),
                               *tensors, *mask.buffers)
        return _tokens_first(dq), _tokens_first(dk), _tokens_first(dv)


@contextlib.contextmanager
def _top_level_dispatch() -> Iterator[None]:
    """Run with the dispatch keys of a top-level call excluded no more than autograd's and
    autocast's. Called from a dispatch mode's handler (AOTAutograd checks custom ops for
    aliasing on a compiled graph's first call, torch 2.11 and 2.14), the block op runs with
    the functorch and Python keys excluded, and then both a compiled flex call and flex's CPU
    reference path (vmap) fail."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name, key in torch._C.DispatchKey.__members__.items():
        if not name.startswith(("Autograd", "Autocast")) and _has(exclude, key):
            exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def _has(keys: torch._C.DispatchKeySet, key: torch._C.DispatchKey) -> bool:
    try:
        return keys.has(key)
    except RuntimeError:  # alias keys (e.g. CompositeImplicitAutograd) are not in any set
        return False


def _heads_first(x: Tensor) -> Tensor:
    """``[T, H, D]`` -> flex's ``[1, H, T, D]`` (a view; flex reads strides)."""
    return x.detach().unsqueeze(0).transpose(1, 2)


def _tokens_first(x: Tensor) -> Tensor:
    return x[0].transpose(0, 1).contiguous()


def _backend(q: Tensor) -> str | None:
    return COMPILE_BACKENDS.get(q.device.type)


def _compile(fn, backend: str | None):
    # dynamic: the block sizes change with every batch and ring step
    return fn if backend is None else torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)


@functools.cache
def _forward_function(backend: str | None):
    return _compile(flex_attention, backend)


def _kernel_options(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """The options flex's forward gives its backward when the lse is returned (as a hashable
    tuple of items)."""
    options = flex_module._apply_kernel_options(q, k, v, False, None, AuxRequest(lse=True))
    return tuple(sorted(options.items()))


def _template(layout: tuple) -> tuple:
    """The part of ``BlockMask.as_tuple()`` that a backward graph bakes in: the fields between
    the sequence lengths and mask_mod, each tensor replaced by a marker (block sizes stay, as
    do absent fields; the layout differs between torch versions)."""
    return tuple(_TENSOR if isinstance(x, Tensor) else x for x in layout[2:-1])


_TENSOR = "<tensor>"


@functools.cache
def _backward_graph(
    backend: str | None, variant: tuple[bool, int, int], scale: float, template: tuple,
    kernel_options: tuple,
):
    """``(q, k, v, out, lse_base2, dout, *block mask tensors, *mask buffers) -> (dq, dk, dv)``
    in flex's ``[1, H, T, D]`` layout, as a compiled graph calling flex's backward operator."""
    root = torch.nn.Module()
    root.score_graph, root.joint_graph = _score_graphs()
    root.mask_graph = _mask_graph(variant)
    graph = fx.Graph()
    q, k, v, out, lse, dout = (graph.placeholder(n) for n in ("q", "k", "v", "out", "lse", "dout"))
    layout = [graph.call_method("size", (q, 2)), graph.call_method("size", (k, 2))]
    layout += [graph.placeholder(f"block_mask_{i}") if x == _TENSOR else x for i, x in enumerate(template)]
    layout.append(graph.get_attr("mask_graph"))
    buffers = tuple(graph.placeholder(n) for n in ("seg_q", "seg_k", "pos_q", "pos_k"))
    grads = graph.call_function(flex_attention_backward, (
        q, k, v, out, lse, dout, None, graph.get_attr("score_graph"), graph.get_attr("joint_graph"),
        tuple(layout), scale, dict(kernel_options), (), buffers,
    ))
    graph.output(tuple(graph.call_function(operator.getitem, (grads, i)) for i in range(3)))
    return _compile(fx.GraphModule(root, graph), backend)


def _index_scalars() -> tuple[Tensor, ...]:
    """Example values of mask_mod's and score_mod's ``b, h, q_idx, kv_idx``."""
    return tuple(torch.zeros((), dtype=torch.int) for _ in range(4))


def _score_graphs() -> tuple[fx.GraphModule, fx.GraphModule]:
    """The identity score_mod and its joint graph, as flex's backward operator takes them."""
    examples = (torch.zeros((), requires_grad=True), *_index_scalars())
    score = make_fx(_identity_score)(*examples)
    return score, create_fw_bw_graph(score, examples, ())[1]


def _identity_score(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return score


def _mask_graph(variant: tuple[bool, int, int]) -> fx.GraphModule:
    """:func:`flex_mask.visible` for one variant as a graph of ``(b, h, q_idx, kv_idx,
    seg_q, seg_k, pos_q, pos_k)``; indexing traced as flex traces it (``aten.index``)."""
    causal, left, right = variant

    def mask(b, h, q_idx, kv_idx, seg_q, seg_k, pos_q, pos_k):
        return visible(b, h, q_idx, kv_idx, seg_q, seg_k, pos_q, pos_k,
                       causal=causal, left=left, right=right)

    rows = [torch.zeros(1, dtype=torch.int32) for _ in range(4)]  # distinct: one placeholder each
    with TransformGetItemToIndex():
        return make_fx(mask)(*_index_scalars(), *rows)
