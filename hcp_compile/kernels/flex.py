"""flex_attention as a block kernel: the block's segments as a block mask (flex_mask.py), GQA
through ``enable_gqa`` (KV heads not repeated), the window and causal mask in ``mask_mod``.

Forward: the public ``flex_attention`` with ``return_aux=AuxRequest(lse=True)`` (lse in
natural log), on ``[1, H, T, D]`` views of the THD tensors, compiled on CUDA with only the
batch-dependent sizes dynamic and the block mask built inside the compiled function
(docs/design.md §8.5 has the torch 2.11 facts behind each of these choices).

Backward: the ring hands every block the *merged* out and lse of all its blocks. With
``P = exp(S - lse)`` from the merged lse and ``D = rowsum(dO * O)`` from the merged out, flex's
own backward computes ``dS = P * (dO V^T - D)``, which is exactly this block's share of the
merged softmax's gradient; so the backward calls flex's backward operator
(``torch.ops.higher_order.flex_attention_backward``) on the merged out and lse directly. The
alternative, autograd through a recomputed forward of the block with rescaled output and lse
gradients, is as exact but runs the forward again in every backward (40 % more backward work).
Dynamo traces that operator only when its score and mask graphs are submodules of a traced
graph (how compiled autograd calls it, the form torch 2.11 and 2.14 both accept), so the
backward is a small ``fx.GraphModule`` built here, compiled like the forward. Dynamo traces
such a graph once: after ``torch._dynamo.reset()`` (or anything else that drops its compiled
code) it refuses to trace the same module again, so a graph whose compiled code is gone is
built anew before it runs (:class:`_BackwardGraphs`).

Without a compiler (CPU) flex runs its unfused reference path: dense scores over the whole
block, fine for tests, not for long sequences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, fx
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._higher_order_ops.flex_attention import create_fw_bw_graph, flex_attention_backward
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask, flex_attention

from hcp_compile.kernels.contract import COPIES_KV, BlockRequest, BlockSpec
from hcp_compile.kernels.flex_mask import BLOCK_SIZE, DocumentMask, document_mask, mask_function
from hcp_compile.kernels.precision import accumulate_dtype

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# torch.compile backend per device type; other devices run flex uncompiled (tests set "cpu" to
# "aot_eager" to trace the same graphs as on CUDA)
COMPILE_BACKENDS: dict[str, str] = {"cuda": "inductor"}
# flex's backward operator takes the forward operator's lse, which is in base 2
_LN2 = math.log(2.0)
# Every block is padded to a multiple of BLOCK_SIZE query and key rows, and flex is told so
# (IS_DIVISIBLE): its GPU kernels then skip the bounds checks of every tile, which slow the
# forward and backward, with the rows static or dynamic; a 50-row block also failed to compile
# (docs/design.md §8.5). An internal option of flex's Triton templates, which the
# public kernel_options pass through.
KERNEL_OPTIONS = {"IS_DIVISIBLE": True}
# row shapes (query rows, key rows) per compiled function that get a graph specialized on them:
# static rows run a little faster than dynamic ones on whole mask blocks (docs/design.md §8.5). Later shapes share one graph with the
# rows dynamic, so batches of ever-new sizes compile at most this many graphs + 1, and
# repeating ones (a fixed packing length, a ring's steps) run specialized.
STATIC_SHAPES = 4


class FlexKernel:
    name = "flex"
    masks_by_position = True
    wrapper_passes = frozenset({COPIES_KV})  # _thd_to_flex's contiguous()

    def supports(self, request: BlockRequest) -> str | None:
        if request.device.type not in ("cuda", "cpu"):
            return f"needs CUDA or CPU tensors; got {request.device}"
        if request.dtype not in SUPPORTED_DTYPES:
            return f"needs fp16, bf16 or fp32 tensors; got {request.dtype}"
        if request.device.type == "cuda" and request.head_dim < 16:
            return f"needs head_dim of at least 16 on CUDA; got {request.head_dim}"
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: BlockSpec) -> tuple[Tensor, Tensor]:
        if q.shape[0] == 0 or k.shape[0] == 0:  # an empty region or ring section: nothing to see
            lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device,
                             dtype=accumulate_dtype(q.dtype))
            return torch.zeros_like(q), lse
        rows, keys = q.shape[0], k.shape[0]
        (q, k, v), spec = _padded(q, (q, k, v), spec)
        mask = document_mask(spec, q.shape[0], k.shape[0], (rows, keys))
        q4, k4, v4 = _heads_first(q), _heads_first(k), _heads_first(v)
        tensors = (*(getattr(mask.block_mask, name) for name in _BLOCKS), *mask.buffers)
        static = (mask.variant, spec.scale, q4.dtype, q4.shape[1], k4.shape[1], q4.shape[3])
        backend = _backend(q)
        shape = _static_rows.specialize(("forward", backend, static), (q4.shape[2], k4.shape[2]), backend)
        if backend is not None and shape is None:
            tensors = _mark_rows_dynamic((q4, k4, v4), tensors)
        with _top_level_dispatch():
            out, aux = _forward_function(backend, static, shape)(q4, k4, v4, tensors, mask_function(mask.variant),
                                                                 spec.scale)
        del q4, k4, v4  # contiguous copies of q, k, v if they were not: freed first (peak memory)
        lse = aux.lse[0, :, :rows].to(accumulate_dtype(q.dtype)).contiguous()
        return _tokens_first(out)[:rows], lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        spec: BlockSpec,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        rows, keys = q.shape[0], k.shape[0]
        (q, k, v, out, dout), spec = _padded(q, (q, k, v, out, dout), spec)
        lse = torch.cat([lse, lse.new_full((lse.shape[0], q.shape[0] - rows), float("-inf"))], 1)
        mask = document_mask(spec, q.shape[0], k.shape[0], (rows, keys))
        q4, k4, v4, out4, dout4 = (_heads_first(x) for x in (q, k, v, out, dout))
        lse_base2 = (lse.to(torch.float32) / _LN2).unsqueeze(0)
        inputs = (q4, k4, v4, out4, lse_base2, dout4, *_mask_tensors(mask), *mask.buffers)
        backend = _backend(q)
        static = (mask.variant, spec.scale, _template(mask.block_mask.as_tuple()), _kernel_options(q4, k4, v4),
                  _static_shape(inputs))
        shape = _static_rows.specialize(("backward", backend, static), (q4.shape[2], k4.shape[2]), backend)
        if backend is not None and shape is None:
            inputs = (*inputs[:6], *_mark_rows_dynamic(inputs[:6], inputs[6:]))
        with _top_level_dispatch():  # also for tracing the graph, on its first use
            grads = list(_backward_graphs.get(backend, *static, shape)(*inputs))
        # copies of non-contiguous inputs freed, and each gradient freed once in its layout
        # (a copy only where flex's differs; peak memory)
        del inputs, q4, k4, v4, out4, dout4
        return tuple(_tokens_first(grads.pop(0))[:count] for count in (rows, keys, keys))


def _padded(q: Tensor, tensors: tuple[Tensor, ...], spec: BlockSpec) -> tuple[tuple[Tensor, ...], BlockSpec]:
    """``tensors`` = ``(q, k, v, *more with q's rows)`` padded to a multiple of ``BLOCK_SIZE``
    query and key rows (copies; none where the rows are one already), and ``spec`` with the
    positions padded alike. The pad rows lie past the last segment, so they see and are seen
    by nothing (flex_mask.row_values). The cache key stays: the mask cache is keyed on the
    padded and the unpadded row counts too."""
    q_rows, k_rows = q.shape[0], tensors[1].shape[0]
    q_pad, k_pad = -q_rows % BLOCK_SIZE, -k_rows % BLOCK_SIZE
    if q_pad == 0 and k_pad == 0:
        return tensors, spec

    def pad(x: Tensor, extra: int) -> Tensor:
        return torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]) if extra else x

    padded = tuple(pad(x, k_pad if i in (1, 2) else q_pad) for i, x in enumerate(tensors))
    if spec.q_positions is None:
        return padded, spec
    return padded, dataclasses.replace(spec, q_positions=pad(spec.q_positions, q_pad),
                                       k_positions=pad(spec.k_positions, k_pad))


class _StaticRows:
    """Which row shapes get graphs specialized on them: the first :data:`STATIC_SHAPES` seen
    per compiled function; ``None`` (rows dynamic) for the others."""

    def __init__(self) -> None:
        self._seen: dict[tuple, set[tuple[int, int]]] = {}

    def specialize(self, function: tuple, rows: tuple[int, int], backend: str | None) -> tuple[int, int] | None:
        if backend is None:  # uncompiled: one function serves every shape
            return None
        seen = self._seen.setdefault(function, set())
        if rows not in seen and len(seen) >= STATIC_SHAPES:
            return None
        seen.add(rows)
        return rows

    def clear(self) -> None:
        self._seen.clear()


_static_rows = _StaticRows()


def clear_compiled() -> None:
    """Forget the compiled forwards and backwards and the row shapes seen (tests)."""
    _forward_function.cache_clear()
    _backward_graphs.clear()
    _static_rows.clear()


def _mask_tensors(mask: DocumentMask) -> list[Tensor]:
    """The block mask's tensors, in ``BlockMask.as_tuple()`` order."""
    return [t for t in mask.block_mask.as_tuple()[2:-1] if isinstance(t, Tensor)]


def _mark_rows_dynamic(heads_first: tuple[Tensor, ...], mask_inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Mark the sizes that change with the batch dynamic, rows (dim 2 of the ``[1, H, T, ...]``
    tensors) and the mask's block counts and rows, and leave everything else static (the
    compiles are ``dynamic=False``). With every size dynamic, torch 2.11 fails: Inductor writes
    ``floor`` of the symbolic head counts into the backward kernel, and the mask's block size
    becomes symbolic and the forward's lowering fails (docs/design.md §8.5).

    The mask's tensors are marked as aliases, returned: the cached mask may serve a graph
    specialized on its shape later, and Dynamo would read a mark on the cached tensors there."""
    for x in heads_first:
        torch._dynamo.maybe_mark_dynamic(x, 2)
    marked = tuple(x.view(x.shape) for x in mask_inputs)
    for x in marked:  # block-mask tensors [1, 1, blocks(, blocks)] and row buffers [rows]
        for dim in range(max(x.dim() - 2, 0), x.dim()):
            torch._dynamo.maybe_mark_dynamic(x, dim)
    return marked


def _static_shape(inputs: tuple[Tensor, ...]) -> tuple:
    """What a compiled backward graph is specialized on besides the layout: dtype, heads, head
    dim, and per dynamic size whether it is 1 (Dynamo specializes those) and whether q and k
    have as many rows (Inductor's lowering guards on that, torch 2.11). A graph traced once and
    called with different values of these would be traced again, which Dynamo refuses for
    flex's backward operator (torch 2.11 and 2.14), so each combination gets its own graph."""
    q4, k4 = inputs[0], inputs[1]
    ones = tuple(size == 1 for x in inputs for size in x.shape)
    return (q4.dtype, q4.shape[1], k4.shape[1], q4.shape[3], ones, q4.shape[2] == k4.shape[2])


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
    """``[T, H, D]`` -> flex's ``[1, H, T, D]``, a view of the THD tensor made contiguous
    (copied only if it is not): compiled flex runs as fast on this view as on a contiguous
    copy, which would cost a copy per call (docs/design.md §8.5); and one stride pattern is what the compiled graphs are
    specialized on."""
    return x.detach().contiguous().transpose(0, 1).unsqueeze(0)


def _tokens_first(x: Tensor) -> Tensor:
    """Flex's ``[1, H, T, D]`` result -> ``[T, H, D]``, contiguous: a view, since flex lays its
    results out as its inputs (a copy otherwise)."""
    return x[0].transpose(0, 1).contiguous()


def _backend(q: Tensor) -> str | None:
    return COMPILE_BACKENDS.get(q.device.type)


@functools.cache
def _forward_function(backend: str | None, static: tuple, rows: tuple[int, int] | None):
    """The forward compiled for one ``static`` (mask variant, scale, dtype, head counts, head
    dim) and one row shape, or (``rows`` None) with the sizes the caller marks dynamic
    (_mark_rows_dynamic). Dynamo keeps its graphs, and counts recompiles against its limit of
    8, per code object, so each combination compiles a copy of ``_forward`` with a code object
    of its own: with one shared code object, a model (or test session) with more than 8
    combinations failed on the GPU."""
    if backend is None:
        return _forward
    code = _forward.__code__.replace()  # a new code object, the same code
    copy = types.FunctionType(code, _forward.__globals__, _forward.__name__, _forward.__defaults__)
    return torch.compile(copy, backend=backend, dynamic=False, fullgraph=True)


# the block mask's tensors, as BlockMask's constructor takes them after the sequence lengths
_BLOCKS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
           "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _forward(
    q: Tensor, k: Tensor, v: Tensor, tensors: tuple[Tensor, ...], mask: Callable[..., Tensor], scale: float,
) -> tuple[Tensor, AuxOutput]:
    """Flex's forward with the block mask built from its tensors here, inside the compiled
    region: its sequence lengths are then q's and k's (symbolic) row counts. A ``BlockMask``
    built outside carries them as ints, which Dynamo specializes on, compiling again for every
    new block shape. ``mask`` is the variant's :func:`mask_function`, looked up by the caller:
    called here, Dynamo would warn that it traces through that function's cache."""
    *blocks, seg_q, seg_k, pos_q, pos_k = tensors
    mask_mod = functools.partial(mask, seg_q=seg_q, seg_k=seg_k, pos_q=pos_q, pos_k=pos_k)
    block_mask = BlockMask((q.shape[2], k.shape[2]), *blocks, (BLOCK_SIZE, BLOCK_SIZE), mask_mod)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                          return_aux=AuxRequest(lse=True), kernel_options=KERNEL_OPTIONS)


def _kernel_options(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """The options flex's forward gives its backward when the lse is returned (as a hashable
    tuple of items)."""
    options = flex_module._apply_kernel_options(q, k, v, False, KERNEL_OPTIONS, AuxRequest(lse=True))
    return tuple(sorted(options.items()))


def _template(layout: tuple) -> tuple:
    """The part of ``BlockMask.as_tuple()`` that a backward graph bakes in: the fields between
    the sequence lengths and mask_mod, each tensor replaced by a marker (block sizes stay, as
    do absent fields; the layout differs between torch versions)."""
    return tuple(_TENSOR if isinstance(x, Tensor) else x for x in layout[2:-1])


_TENSOR = "<tensor>"


class _BackwardGraphs:
    """The backward graphs by their arguments (:func:`_backward_graph`), each built anew when
    Dynamo no longer holds compiled code for it (after ``torch._dynamo.reset()``, for one):
    Dynamo refuses to trace a graph calling flex's backward operator a second time, "failed to
    handle argument for FlexAttentionBackward HOP" (torch 2.11 and 2.14)."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, tuple[Callable, bool]] = {}  # arguments -> (graph, has been called)
        self._lock = threading.Lock()

    def get(self, *arguments: Any) -> Callable:
        with self._lock:
            graph, called = self._graphs.get(arguments, (None, False))
            if graph is None or (called and not _has_compiled_code(graph)):
                graph = _backward_graph(*arguments)
            self._graphs[arguments] = (graph, True)
            return graph

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()


def _has_compiled_code(graph: Callable) -> bool:
    """Whether Dynamo holds compiled code for ``graph`` (a module ``torch.compile`` wrapped;
    an uncompiled graph needs none)."""
    module = getattr(graph, "_orig_mod", None)
    return module is None or bool(_debug_get_cache_entry_list(module.forward.__code__))


_backward_graphs = _BackwardGraphs()


def _backward_graph(
    backend: str | None, variant: tuple[bool, int, int], scale: float, template: tuple,
    kernel_options: tuple, static_shape: tuple, rows: tuple[int, int] | None,
) -> Callable:
    """``(q, k, v, out, lse_base2, dout, *block mask tensors, *mask buffers) -> (dq, dk, dv)``
    in flex's ``[1, H, T, D]`` layout, as a compiled graph calling flex's backward operator,
    one per row shape ``rows``, or (``rows`` None) with the sizes the caller marked dynamic
    symbolic and the rest ``static_shape``'s."""
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
    module = fx.GraphModule(root, graph)
    return module if backend is None else torch.compile(module, backend=backend, dynamic=False, fullgraph=True)


def _index_scalars() -> tuple[Tensor, ...]:
    """Example values of mask_mod's and score_mod's ``b, h, q_idx, kv_idx``."""
    return tuple(torch.zeros((), dtype=torch.int) for _ in range(4))


def _score_graphs() -> tuple[fx.GraphModule, fx.GraphModule]:
    """The identity score_mod and its joint graph, as flex's backward operator takes them."""
    examples = (torch.zeros((), requires_grad=True), *_index_scalars())
    score = make_fx(_identity_score)(*examples)
    return score, create_fw_bw_graph(score, examples, ())[1]


def _identity_score(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
    # unannotated: make_fx copies a return annotation into the graph's code, as the string this
    # module's ``from __future__ import annotations`` makes of it, and torch 2.11's FX graph cache
    # then fails to pickle the graph (a traceback in the log, nothing cached)
    return score


def _mask_graph(variant: tuple[bool, int, int]) -> fx.GraphModule:
    """The forward's mask function for one variant as a graph of ``(b, h, q_idx, kv_idx,
    seg_q, seg_k, pos_q, pos_k)``; indexing traced as flex traces it (``aten.index``)."""
    rows = [torch.zeros(1, dtype=torch.int32) for _ in range(4)]  # distinct: one placeholder each
    with TransformGetItemToIndex():
        return make_fx(mask_function(variant))(*_index_scalars(), *rows)
