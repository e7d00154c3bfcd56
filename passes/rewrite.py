"""Replace matched attention nodes by the hierarchical CP subgraph, before AOTAutograd.

Each match becomes one call of :func:`hcp_compile.compiled.inserted.hierarchical_varlen_attention`
(which AOTAutograd traces into all-to-all -> ring -> all-to-all functional collectives and the
block kernels), preceded, once per ``cu_seqlens``, by :func:`hcp_compile.compiled.inserted.checked_layout`:
the check of the batch, its layout and the read of its sizes when the graph runs. Every output the graph
used is rewired: the attention output and the logsumexp.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import fx

from hcp_compile.batch.layout import window_by_position
from hcp_compile.batch.prepared import GraphKind
from hcp_compile.compiled.inserted import checked_layout, hierarchical_varlen_attention
from hcp_compile.exchange.mesh import CPGroups
from hcp_compile.exchange.schemes import DEFAULT_SCHEME
from hcp_compile.kernels import BlockRequest, resolve_kernel
from hcp_compile.kernels.cost import size_hint
from hcp_compile.validation import (
    InputError, check_cu_seqlens_dtype, check_head_split, check_qkv, check_same_token_counts,
)

from hcp_compile.passes.match import AttentionMatch, UnsupportedAttention


@dataclass(frozen=True)
class RewriteConfig:
    """What the rewrite needs of the backend's options (the backend builds it: this package
    sits below the backend and imports nothing of it)."""

    groups: CPGroups
    kernel: str  # the backend's kernel; a mark's kernel overrides it
    agree_across_ranks: bool
    placement: str
    recompute_exchange: bool = False
    scheme: str = DEFAULT_SCHEME  # the collective scheme, a key of hcp_compile.exchange.schemes.SCHEMES
    graph_for: GraphKind = GraphKind()  # the batches the graph serves (hcp_compile.compiled.graph_variants)
    agreement_timeout_s: float | None = None  # the agreement's wait for the other ranks (None: the groups')


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
    scheme: str
    graph_for: GraphKind  # the batches its graph serves (hcp_compile.compiled.graph_variants)


def rewrite_attention(graph: fx.Graph, matches: list[AttentionMatch], config: RewriteConfig) -> list[Rewritten]:
    """Rewrite every match, in ``graph`` or in the nested graph (checkpoint body) it is in."""
    layouts: dict[tuple, fx.Node] = {}
    done = []
    for match in matches:
        done.append(_rewrite_one(match.node.graph, match, config, layouts))
    _recompile_nested(graph, matches)
    return done


def refuse_unmarked(graph: fx.Graph, unmarked: list[AttentionMatch], rewritten: list[AttentionMatch]) -> None:
    """Every node of ``unmarked`` (left single-device: its module is not marked, others are)
    that takes a ``cu_seqlens`` of a ``rewritten`` node reads it through
    :func:`refuse_single_device`, which raises on every rank alike (at compile time): the
    node would attend over this rank's shard as if it were the whole batch. Nodes with a
    ``cu_seqlens`` of their own (single-device attention over inputs that are not sharded)
    stay as they are."""
    batch = {n for m in rewritten for n in (m.call.cu_seqlens_q, m.call.cu_seqlens_k)}
    refused = [m for m in unmarked if {m.call.cu_seqlens_q, m.call.cu_seqlens_k} & batch]
    for match in refused:
        node, cu = match.node, match.call.cu_seqlens_q
        with node.graph.inserting_before(node):
            refusal = node.graph.call_function(
                refuse_single_device, (cu,), {"op": match.op, "module": match.module_path}
            )
        refusal.meta.update({k: v for k, v in cu.meta.items() if k in ("example_value", "val")})
        # the node reads it, so no dead-code pass can drop the refusal
        node.replace_input_with(cu, refusal)
    _recompile_nested(graph, refused)


def refuse_single_device(cu_seqlens: torch.Tensor, *, op: str, module: str) -> torch.Tensor:
    """Put by :func:`refuse_unmarked` in front of an attention node that is left
    single-device (its module is not marked, others are) although it takes the
    ``cu_seqlens`` the marked modules attend over with context parallelism. Raises when
    AOTAutograd traces the graph, i.e. at compile time (with ``inner="eager"``, when the graph
    runs), on every rank alike; ``explain``, which traces nothing, still reports the graph."""
    raise UnsupportedAttention(
        f"{op} at {module or 'top level'}: this attention is in no module marked with "
        "@hcp_compile.attention, so the hcp backend leaves it single-device, but it takes the "
        "cu_seqlens of the batch the marked modules attend over with context parallelism: it "
        "would attend over this rank's shard as if it were the whole batch; mark its module "
        "too (@hcp_compile.attention on the class, or hcp_compile.attention(module) for one "
        "instance), or mark no module (then every attention with cu_seqlens is rewritten)"
    )


def _recompile_nested(graph: fx.Graph, changed: list[AttentionMatch]) -> None:
    """Lint the graphs ``changed`` nodes are in and recompile the nested ones (checkpoint
    bodies); the caller recompiles ``graph``'s own module."""
    for touched in {id(m.node.graph): m.node.graph for m in changed}.values():
        touched.lint()
        if touched is not graph and touched.owning_module is not None:
            touched.owning_module.recompile()


def example_value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _rewrite_one(
    graph: fx.Graph, match: AttentionMatch, config: RewriteConfig,
    layouts: dict[tuple, fx.Node],
) -> Rewritten:
    node, call, groups = match.node, match.call, config.groups
    q_value, k_value, v_value = (example_value(t) for t in (call.q, call.k, call.v))
    _check_static(match, q_value, k_value, v_value, groups)
    heads_q, heads_kv, head_dim = int(q_value.shape[1]), int(k_value.shape[1]), int(q_value.shape[2])
    kernel = (match.mark.kernel if match.mark and match.mark.kernel else None) or config.kernel
    with _refusing(match):
        kernel = resolve_kernel(
            kernel, BlockRequest.of(q_value, k_value, match.call.window,
                                      window_by_position=window_by_position(match.call.window, groups.ring_size)),
            "@hcp_compile.attention(kernel=...) on the module, or options={'kernel': ...}",
        )
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
    max_seqlen, max_seqlens = call.max_seqlen_q, (call.max_seqlen_q, call.max_seqlen_k)
    token_counts = tuple(str(t.shape[0]) for t in (q_value, k_value, v_value))
    sizes_key = (graph, call.cu_seqlens_q, call.cu_seqlens_k, token_counts, str(max_seqlens))
    with graph.inserting_before(node):
        is_checked = sizes_key not in layouts
        if is_checked:
            tokens = tuple(graph.call_function(torch.ops.aten.sym_size.int, (t, 0))
                           for t in (call.q, call.k, call.v))
            layouts[sizes_key] = graph.call_function(
                checked_layout, (call.cu_seqlens_q, call.cu_seqlens_k, tokens, max_seqlens),
                {**names, "placement": config.placement, "agree": config.agree_across_ranks,
                 "recompute_exchange": config.recompute_exchange, "scheme": config.scheme,
                 "graph_for": config.graph_for.text, "agreement_timeout_s": config.agreement_timeout_s},
            )
        if call.max_seqlen_k is not call.max_seqlen_q and call.max_seqlen_k != call.max_seqlen_q:
            # only a bound for the kernels' grids: the larger one is right for both
            max_seqlen = graph.call_function(torch.sym_max, (call.max_seqlen_q, call.max_seqlen_k))
        scale = call.scale if call.scale is not None else head_dim**-0.5
        attention = graph.call_function(
            hierarchical_varlen_attention,
            (call.q, call.k, call.v, max_seqlen, layouts[sizes_key]),
            {"causal": call.causal, "scale": scale, "window": call.window, "kernel": kernel,
             **names, "return_lse": returns_lse, "recompute_exchange": config.recompute_exchange,
             "scheme": config.scheme, "graph_for": config.graph_for.text},
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
        size_hint(local_tokens), returns_lse, is_checked, config.placement, config.scheme,
        config.graph_for,
    )


def _check_static(match: AttentionMatch, q: Any, k: Any, v: Any, groups: CPGroups) -> None:
    """The rules of validation.py that the graph alone decides, raised at compile time on
    every rank alike (the batch's rules are checked when the graph runs: checked_layout)."""
    with _refusing(match):
        for name, cu in (("cu_seqlens_q", match.call.cu_seqlens_q), ("cu_seqlens_k", match.call.cu_seqlens_k)):
            check_cu_seqlens_dtype(example_value(cu), name)
        check_qkv(q, k, v, token_counts=False)
        check_same_token_counts(q, k, v)
        check_head_split(int(q.shape[1]), int(k.shape[1]), groups.ulysses_size)


@contextlib.contextmanager
def _refusing(match: AttentionMatch) -> Iterator[None]:
    """An InputError of a rule becomes the node's UnsupportedAttention, naming op and module."""
    try:
        yield
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
