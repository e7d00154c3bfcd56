"""Find the attention nodes that carry ``cu_seqlens`` in a Dynamo (torch IR) FX graph.

Every supported op is read into one :class:`AttentionCall` (the arguments in
``varlen_attention``'s terms), so the rewrite does not depend on which op was matched.
Matching only reads the graph; it never changes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from hcp_compile.marking import AttentionMark, mark_of
from hcp_compile.validation import InputError


class UnsupportedAttention(InputError):
    """A matched attention node uses a feature hierarchical CP cannot reproduce."""


@dataclass(frozen=True)
class AttentionCall:
    """One attention call's arguments, whatever op spelled them."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    cu_seqlens_q: fx.Node
    cu_seqlens_k: fx.Node
    max_seqlen_q: Any  # int or a symbolic-int node
    max_seqlen_k: Any
    causal: bool
    scale: Any  # float, None (1/sqrt(head dim)) or a symbolic-float node
    window: tuple[int, int]
    out_index: int  # which output of the op is the attention output
    lse_index: int  # which output is the [Hq, T] logsumexp


@dataclass(frozen=True)
class AttentionMatch:
    node: fx.Node
    op: str  # "namespace::name" of the matched op
    call: AttentionCall
    module_path: str  # innermost module of the node ("" at top level)
    mark: AttentionMark | None  # options of the innermost marked module around the node


def bound_arguments(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = _overload(node.target)._schema
    bound = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(node.args):
            bound[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
        else:
            bound[argument.name] = None
    return bound


def _require_absent(op: str, args: dict[str, Any], names_and_defaults: dict[str, Any]) -> None:
    for name, default in names_and_defaults.items():
        if args.get(name, default) != default:
            raise UnsupportedAttention(
                f"{op}: argument {name}={args[name]!r} is not supported under hierarchical "
                f"context parallelism (expected {default!r}); call it without {name} or mark "
                "only other attention modules with @hcp_compile.attention"
            )


def _window(left: Any, right: Any) -> tuple[int, int]:
    left = -1 if left is None else left
    right = -1 if right is None else right
    if not isinstance(left, int) or not isinstance(right, int):
        raise UnsupportedAttention(
            f"window_size: expected constant ints, got ({left!r}, {right!r}); a window that "
            "changes between calls cannot be laid out at compile time"
        )
    return left, right


def _from_hcp(args: dict[str, Any]) -> AttentionCall:
    return AttentionCall(
        args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
        args["max_seqlen_q"], args["max_seqlen_k"], args["causal"], args["softmax_scale"],
        _window(args["window_left"], args["window_right"]), out_index=0, lse_index=1,
    )


def _from_torch_varlen(args: dict[str, Any]) -> AttentionCall:
    op = "torch_attn::_varlen_attn"
    _require_absent(op, args, {"seqused_k": None, "block_table": None})
    causal = bool(args.get("is_causal", False))
    window = _window(*(args.get("window_size") or (-1, -1)))
    if causal and window == (-1, 0):  # varlen_attn's spelling of plain causal attention
        window = (-1, -1)
    return AttentionCall(
        args["query"], args["key"], args["value"], args["cu_seq_q"],
        args["cu_seq_k"] if args["cu_seq_k"] is not None else args["cu_seq_q"],
        args["max_q"], args["max_k"], causal, args.get("scale"), window, out_index=0,
        lse_index=1,
    )


def _from_aten_flash(args: dict[str, Any]) -> AttentionCall | None:
    if args["cum_seq_q"] is None:  # the dense (batch, seq) form: no documents to lay out
        return None
    op = "aten::_flash_attention_forward"
    _require_absent(op, args, {"dropout_p": 0.0, "return_debug_mask": False,
                               "seqused_k": None, "alibi_slopes": None})
    return AttentionCall(
        args["query"], args["key"], args["value"], args["cum_seq_q"], args["cum_seq_k"],
        args["max_q"], args["max_k"], bool(args["is_causal"]), args.get("scale"),
        _window(args.get("window_size_left"), args.get("window_size_right")),
        out_index=0, lse_index=1,
    )


def _from_flash_attn(args: dict[str, Any]) -> AttentionCall:
    op = "flash_attn::_flash_attn_varlen_forward"
    _require_absent(op, args, {"dropout_p": 0.0, "softcap": 0.0, "alibi_slopes": None,
                               "return_softmax": False, "block_table": None,
                               "leftpad_k": None, "seqused_k": None})
    return AttentionCall(
        args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
        args["max_seqlen_q"], args["max_seqlen_k"], bool(args["causal"]),
        args.get("softmax_scale"),
        _window(args.get("window_size_left"), args.get("window_size_right")),
        out_index=0, lse_index=1,
    )


# "namespace::name" -> reader; an op that is not registered (flash_attn not installed)
# simply never appears in a graph
READERS: dict[str, Callable[[dict[str, Any]], AttentionCall | None]] = {
    "hcp::varlen_attention": _from_hcp,
    "torch_attn::_varlen_attn": _from_torch_varlen,
    "aten::_flash_attention_forward": _from_aten_flash,
    "flash_attn::_flash_attn_varlen_forward": _from_flash_attn,
}


def op_name(target: Any) -> str | None:
    overload = _overload(target)
    return overload._schema.name if overload is not None else None


# higher-order ops whose body AOTAutograd traces by running it, so a rewrite inside it works
REWRITABLE_REGIONS = ("tag_activation_checkpoint",)


def find_attention(graph: fx.Graph) -> list[AttentionMatch]:
    """Every attention node with ``cu_seqlens`` in ``graph`` and in the bodies of its
    activation-checkpoint regions. When any node lies inside a module marked with
    ``@hcp_compile.attention``, only nodes inside marked modules count.

    Raises :class:`UnsupportedAttention` for such a node inside any other nested graph (the
    body of an ``autograd.Function`` such as flash_attn's, ...): it cannot be rewritten
    there, and left alone it would attend over this rank's shard as if it were the whole
    batch."""
    found, unreachable = _scan(graph)
    marked = _any_marked(found + [m for *_, m in unreachable])
    in_scope = [(name, region, m) for name, region, m in unreachable if m.mark is not None or not marked]
    if in_scope:
        where = ", ".join(f"{m.op} in {region} body {name!r} ({m.module_path or 'top level'})"
                          for name, region, m in in_scope)
        raise UnsupportedAttention(
            f"{where}: attention inside this higher-order region (an autograd.Function such "
            "as flash_attn_varlen_func, ...) cannot be rewritten for context parallelism; "
            "call it outside that region, or through hcp_compile.varlen_attention or "
            "torch.nn.attention.varlen.varlen_attn (activation checkpointing is supported)"
        )
    return [m for m in found if m.mark is not None] if marked else found


def find_unmarked(graph: fx.Graph) -> list[AttentionMatch]:
    """The attention nodes :func:`find_attention` leaves out because other modules are
    marked and theirs is not (in ``graph`` and its activation-checkpoint bodies)."""
    found, unreachable = _scan(graph)
    if not _any_marked(found + [m for *_, m in unreachable]):
        return []
    return [m for m in found if m.mark is None]


def _scan(graph: fx.Graph) -> tuple[list[AttentionMatch], list[tuple[str, str, AttentionMatch]]]:
    """The matches that can be rewritten (``graph`` and its checkpoint bodies), and those in
    other nested graphs as ``(body name, region, match)``."""
    found, unreachable = _matches(graph), []
    for name, module, region in _nested_graphs(graph):
        nested = _matches(module.graph)
        if region in REWRITABLE_REGIONS:
            found += nested
        else:
            unreachable += [(name, region, m) for m in nested]
    return found, unreachable


def _any_marked(matches: list[AttentionMatch]) -> bool:
    return any(m.mark is not None for m in matches)


def _matches(graph: fx.Graph) -> list[AttentionMatch]:
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node.target)
        reader = READERS.get(name)
        if reader is None:
            continue
        call = reader(bound_arguments(node))
        if call is None:
            continue
        path, mark = _innermost_module(node)
        found.append(AttentionMatch(node, name, call, path, mark))
    return found


def _nested_graphs(graph: fx.Graph) -> list[tuple[str, fx.GraphModule, str]]:
    """``(name, body, region)`` for every graph nested in ``graph``'s module, ``region``
    being the name of the higher-order op that runs it directly from ``graph`` ("nested"
    for one nested deeper)."""
    root = graph.owning_module
    if root is None:
        return []
    regions = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            for user in node.users:
                regions[node.target] = getattr(user.target, "__name__", str(user.target))
    return [(name, module, regions.get(name, "nested"))
            for name, module in root.named_modules()
            if module is not root and isinstance(module, fx.GraphModule)]


def _overload(target: Any) -> torch._ops.OpOverload | None:
    if isinstance(target, torch._ops.OpOverload):
        return target
    if isinstance(target, torch._ops.OpOverloadPacket):
        return getattr(target, "default", None)
    return None


def _innermost_module(node: fx.Node) -> tuple[str, AttentionMark | None]:
    stack = node.meta.get("nn_module_stack") or {}
    path, mark = "", None
    for entry in stack.values():
        entry_path, module_type = entry[0], entry[1]
        path = readable_module_path(entry_path)
        found = mark_of(module_type) if isinstance(module_type, type) else None
        if found is not None:
            mark = found
    return path, mark


def readable_module_path(dynamo_path: str) -> str:
    """``"L['self'].layers[0].attn"`` -> ``"layers.0.attn"``."""
    path = re.sub(r"^L\['[^']*'\]", "", dynamo_path)
    path = path.replace("._modules", "").replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
    return path.lstrip(".")
