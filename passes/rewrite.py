"""Replace matched attention nodes by the hierarchical CP subgraph, before AOTAutograd.

Each match becomes one call of :func:`hcp_compile.compiled.hierarchical_varlen_attention`
(which AOTAutograd traces into all-to-all -> ring -> all-to-all functional collectives and the
block kernels), preceded, once per ``cu_seqlens``, by :func:`hcp_compile.compiled.checked_layout`:
the device-side check of the batch, its layout and the read of its sizes. Every output the graph
used is rewired: the attention output and the logsumexp.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from hcp_compile.compiled import checked_layout, hierarchical_varlen_attention
from hcp_compile.kernels import resolve_kernel
from hcp_compile.kernels.cost import size_hint
from hcp_compile.mesh import CPGroups
from hcp_compile.validation import (
    InputError, check_cu_seqlens_dtype, check_head_split, check_kernel_window,
)

from .match import AttentionMatch, UnsupportedAttention


@dataclass(frozen=True)
class RewriteConfig:
    groups: CPGroups
    kernel: str  # the backend's kernel; a mark's kernel overrides it
    agree_across_ranks: bool
    placement: str


@dataclass(frozen=True)
class Rewritten:
    """What one match became."""

    match: AttentionMatch
    kernel: str
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: torch.dtype
    local_tokens: int  # this rank's tokens at compile time (a hint when symbolic)
    returns_lse: bool
    checked: bool  # this node carries the batch check and size read of its cu_seqlens
    placement: str


def rewrite_attention(graph: fx.Graph, matches: list[AttentionMatch], config: RewriteConfig) -> list[Rewritten]:
    """Rewrite every match, in ``graph`` or in the nested graph (checkpoint body) it is in."""
    layouts: dict[tuple, fx.Node] = {}
    done = []
    for match in matches:
        done.append(_rewrite_one(match.node.graph, match, config, layouts))
    for touched in {id(m.node.graph): m.node.graph for m in matches}.values():
        touched.lint()
        if touched is not graph and touched.owning_module is not None:
            touched.owning_module.recompile()
    return done


def example_value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _rewrite_one(
    graph: fx.Graph, match: AttentionMatch, config: RewriteConfig,
    layouts: dict[tuple, fx.Node],
) -> Rewritten:
    node, call, groups = match.node, match.call, config.groups
    q_value, k_value = example_value(call.q), example_value(call.k)
    heads_q, heads_kv, head_dim = int(q_value.shape[1]), int(k_value.shape[1]), int(q_value.shape[2])
    kernel = (match.mark.kernel if match.mark and match.mark.kernel else None) or config.kernel
    kernel = resolve_kernel(kernel, q_value)
    _check_static(match, heads_q, heads_kv, kernel, groups)
    outputs = _output_users(node)
    for index in outputs:
        if index not in (call.out_index, call.lse_index):
            raise UnsupportedAttention(
                f"{match.op} at {match.module_path or 'top level'}: output {index} of the op "
                "is used, but under hierarchical context parallelism only the attention "
                "output and the logsumexp exist"
            )
    returns_lse = call.lse_index in outputs
    names = {
        "ulysses_group": groups.ulysses_group.group_name,
        "ring_group": groups.ring_group.group_name,
    }
    local_tokens = q_value.shape[0]
    max_seqlen = call.max_seqlen_q
    sizes_key = (graph, call.cu_seqlens_q, call.cu_seqlens_k, str(local_tokens), str(max_seqlen))
    with graph.inserting_before(node):
        is_checked = sizes_key not in layouts
        if is_checked:
            tokens = graph.call_function(torch.ops.aten.sym_size.int, (call.q, 0))
            layouts[sizes_key] = graph.call_function(
                checked_layout, (call.cu_seqlens_q, call.cu_seqlens_k, tokens, max_seqlen),
                {**names, "placement": config.placement, "agree": config.agree_across_ranks},
            )
        if call.max_seqlen_k is not call.max_seqlen_q and call.max_seqlen_k != call.max_seqlen_q:
            # only a bound for the kernels' grids: the larger one is right for both
            max_seqlen = graph.call_function(torch.sym_max, (call.max_seqlen_q, call.max_seqlen_k))
        scale = call.scale if call.scale is not None else head_dim**-0.5
        attention = graph.call_function(
            hierarchical_varlen_attention,
            (call.q, call.k, call.v, max_seqlen, layouts[sizes_key]),
            {"causal": call.causal, "scale": scale, "window": call.window, "kernel": kernel,
             **names, "return_lse": returns_lse},
        )
        _copy_provenance(node, attention)
        new_outputs = {call.out_index: attention}
        if returns_lse:
            new_outputs = {
                call.out_index: graph.call_function(operator.getitem, (attention, 0)),
                call.lse_index: graph.call_function(operator.getitem, (attention, 1)),
            }
    for index, users in outputs.items():
        for user in users:
            new = new_outputs[index]
            new.meta.update({k: v for k, v in user.meta.items() if k in ("example_value", "val")})
            user.replace_all_uses_with(new)
    for user in list(node.users):  # the getitems, now unused
        graph.erase_node(user)
    graph.erase_node(node)
    return Rewritten(
        match, kernel, heads_q, heads_kv, head_dim, q_value.dtype,
        size_hint(local_tokens), returns_lse, is_checked, config.placement,
    )


def _check_static(match: AttentionMatch, heads_q: int, heads_kv: int, kernel: str, groups: CPGroups) -> None:
    """The eager path's checks that the graph alone can answer, raised at compile time."""
    try:
        for name, cu in (("cu_seqlens_q", match.call.cu_seqlens_q), ("cu_seqlens_k", match.call.cu_seqlens_k)):
            check_cu_seqlens_dtype(example_value(cu), name)
        check_head_split(heads_q, heads_kv, groups.ulysses_size)
        check_kernel_window(
            kernel, match.call.window,
            "mark the module with @hcp_compile.attention(kernel='torch') or compile with "
            "options={'kernel': 'torch'}",
        )
    except InputError as error:
        raise UnsupportedAttention(f"{match.op} at {match.module_path or 'top level'}: {error}") from None


def _output_users(node: fx.Node) -> dict[int, list[fx.Node]]:
    """Output index -> the ``getitem`` nodes that read it."""
    users: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            raise UnsupportedAttention(
                f"{node.name}: expected the op's outputs to be read by indexing, found "
                f"{user.format_node()}"
            )
        if user.users:
            users.setdefault(user.args[1], []).append(user)
    return users


def _copy_provenance(source: fx.Node, target: fx.Node) -> None:
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in source.meta:
            target.meta[key] = source.meta[key]
