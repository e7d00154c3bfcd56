"""The input contract of hcp_compile (docs/design.md §9): every rule, its condition and its
message, in one place.

Errors name the argument, say what was expected and how to fix it, and name only the rules the
input broke (tests/test_error_messages.py checks each text). Two kinds of rules live
here. The rules of a call that need no batch values (types, shapes, head split, window) are
checked by the functions below, on the host by the single-device op and eager CP, and at
compile time by the ``hcp`` rewrite (``passes/rewrite.py``). The rules of a batch (its
``cu_seqlens`` against the call and the mesh) are :class:`Rule` records checked by one
function, :func:`check`, on the host copy of ``cu_seqlens`` that every path reads
anyway; it returns :class:`Failure` records that eager CP raises after the ranks agree and
the compiled path turns into an agreed verdict (:func:`verdict`: per rule and argument of
:data:`BATCH_RULES`, the numbers its message gives, of the lowest rank that broke it). Both
build a failure's text from its numbers with :func:`batch_failure`, so the compiled error
gives the facts eager gives, and the same text on every rank. All checks run before any
collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from hcp_compile.batch.prepared import BatchValues, MeshShape, PreparedBatch


class InputError(ValueError):
    """Bad input to hcp_compile: the message names the argument and the fix."""


@dataclass(frozen=True)
class Rule:
    """One rule of the contract: ``"<argument>: <expected>[, got <found>]; <fix>"``."""

    argument: str
    expected: str
    fix: str

    def message(self, found: str = "", argument: str = "", fix: str = "") -> str:
        got = f", got {found}" if found else ""
        return f"{argument or self.argument}: {self.expected}{got}; {fix or self.fix}"

    def error(self, found: str = "", argument: str = "") -> InputError:
        return InputError(self.message(found, argument))


@dataclass(frozen=True)
class Failure:
    """A rule one call broke for ``argument``, with the message that says how (the value
    found)."""

    rule: Rule
    argument: str
    message: str
    # a batch rule's numbers (batch_failure), which the compiled path agrees on over the mesh
    facts: tuple[int, ...] = ()

    @classmethod
    def of(cls, rule: Rule, found: str = "", argument: str = "") -> "Failure":
        argument = argument or rule.argument
        return cls(rule, argument, rule.message(found, argument))

    def error(self) -> InputError:
        return InputError(self.message)


def raise_first(failures: Sequence[Failure]) -> None:
    """Raise the error of the first of ``failures`` (the order an error reports them in), if any."""
    if failures:
        raise failures[0].error()


# --------------------------------------------------------------------------------------------
# the batch rules (validation.check): every path, the compiled one when its graph runs
# --------------------------------------------------------------------------------------------

CU_STARTS_AT_0 = Rule("cu_seqlens", "must start at 0", "prepend a 0")
CU_NON_DECREASING = Rule(
    "cu_seqlens", "must be non-decreasing (cumulative document lengths)",
    "pass the running sum of the document lengths, starting at 0",
)
# an int by then: the op's schema and varlen_attention's type check (MAX_SEQLEN_INT) make it one
MAX_SEQLEN_COVERS = Rule(
    "max_seqlen", "must be at least the longest document's length",
    "pass the longest document length (or larger)",
)
SHARD_TOKENS = Rule(
    "q, k, v", "under context parallelism must hold this rank's token count of "
    "shard_plan(cu_seqlens, mesh, placement)",
    "pass the local shards, hcp_compile.shard_plan(cu_seqlens, mesh).shard(x)",
)
SAME_DOCUMENTS = Rule(
    "cu_seqlens_k", "must equal cu_seqlens_q under context parallelism (queries and keys "
    "come from the same packed documents)", "pass the same cu_seqlens for both",
)
PLANNED_FOR_THIS_MESH = Rule(
    "cu_seqlens", "must be the batch shard_plan laid out for the attention's mesh shape and "
    "placement", "give shard_plan the mesh and placement the attention runs with",
)
# a single device: each cu_seqlens describes the whole tensor of its side
CU_ENDS_AT_TOKENS = Rule(
    "cu_seqlens", "last entry must equal the number of packed tokens",
    "pass the cu_seqlens of the tensors' own packed batch",
)
SAME_DOCUMENT_COUNT = Rule(
    "cu_seqlens_q, cu_seqlens_k", "expected the same number of documents",
    "pass one entry per document in both",
)
# one fingerprint tells the ranks whether they hold the same batch and options, not which differ
SAME_BATCH = Rule(
    "cu_seqlens", "must be the same on every rank of the context-parallel mesh, as must the mesh "
    "shape and options", "give every rank the same batch (check the data loader) and the same options",
)
BATCHES_DIFFER = (
    "another cu_seqlens, mesh shape, placement, recompute_exchange or scheme on some rank (the "
    "ranks were given different batches or options)"
)
# compiled: the same batch, but a rank runs a broader graph because it could not build the
# graph the others run (graph_variants), so their collectives differ
SAME_GRAPH = Rule(
    "compiled graphs", "every rank must run the graph for what the batch exchanges",
    "see the warning of the rank that could not build its graph",
)
GRAPHS_DIFFER = "graphs built for batches that exchange different things on some ranks"

# the rules of a batch under context parallelism for each argument they check, in the order of
# the compiled path's verdict and of its error's lines
BATCH_RULES: tuple[tuple[Rule, str], ...] = (
    (CU_STARTS_AT_0, "cu_seqlens_q"), (CU_STARTS_AT_0, "cu_seqlens_k"),
    (CU_NON_DECREASING, "cu_seqlens_q"), (CU_NON_DECREASING, "cu_seqlens_k"),
    (SHARD_TOKENS, "q"), (SHARD_TOKENS, "k"), (SHARD_TOKENS, "v"),
    (SAME_DOCUMENTS, "cu_seqlens_k"),
    (MAX_SEQLEN_COVERS, "max_seqlen_q"), (MAX_SEQLEN_COVERS, "max_seqlen_k"),
    (PLANNED_FOR_THIS_MESH, "cu_seqlens"),
)


# the most numbers a batch rule's message gives (PLANNED_FOR_THIS_MESH: two mesh shapes)
FACTS = 6


def batch_failure(rule: Rule, argument: str, facts: Sequence[int]) -> Failure:
    """The failure of the batch rule ``rule`` (one of :data:`BATCH_RULES`) for ``argument``,
    its text built from the numbers ``facts`` (what each rule's are: :data:`_FOUND`). Eager CP
    and the compiled path's agreed verdict both build their message here, so they give the
    same facts."""
    found, fix = _FOUND[rule](facts)
    return Failure(rule, argument, rule.message(found, argument, fix), tuple(facts))


def _starts_at(facts: Sequence[int]) -> tuple[str, str]:
    return str(facts[0]), ""


def _decrease(facts: Sequence[int]) -> tuple[str, str]:
    i, value, before = facts[:3]
    return f"entry {i} ({value}) < entry {i - 1} ({before})", ""


def _shard_tokens(facts: Sequence[int]) -> tuple[str, str]:
    tokens, rank_tokens, num_tokens, ulysses, ring, placement = facts[:6]
    found = (
        f"{tokens} tokens where this cu_seqlens sharded over ulysses={ulysses} x ring={ring} "
        f"(placement {_placement_name(placement)!r}) gives {rank_tokens} per rank"
    )
    if ulysses * ring > 1 and num_tokens <= tokens:
        # one rank of several holds the whole batch cu_seqlens describes: it is the shard's own
        # cu_seqlens (or q, k, v are the global tensors): name both fixes
        return found, (
            f"cu_seqlens ends at {num_tokens}, no more tokens than this rank holds: pass the GLOBAL "
            "cu_seqlens and max_seqlen (of the whole packed batch, the same on every rank) with this "
            "rank's shards of q, k, v, hcp_compile.shard_plan(cu_seqlens, mesh).shard(x)"
        )
    return found, ""


def _no_facts(facts: Sequence[int]) -> tuple[str, str]:
    return "", ""


def _max_seqlen_found(facts: Sequence[int]) -> tuple[str, str]:
    bound, longest = facts[:2]
    return f"{bound} while the longest document in cu_seqlens has {longest} tokens", ""


def _planned_found(facts: Sequence[int]) -> tuple[str, str]:
    from hcp_compile.batch.prepared import MeshShape  # batch imports this module

    planned, running = (MeshShape(u, r, _placement_name(p)) for u, r, p in (facts[:3], facts[3:6]))
    return f"a batch sharded for {planned.describe()}, but the attention runs on {running.describe()}", ""


# each batch rule's text from its numbers (the facts of batch_failure): (what was found, the fix
# where it depends on them, else "")
_FOUND = {
    CU_STARTS_AT_0: _starts_at,  # (first entry,)
    CU_NON_DECREASING: _decrease,  # (i, entry i, entry i - 1) of the first decrease
    # (tokens, the rank's tokens, cu_seqlens' last entry, ulysses, ring, placement index)
    SHARD_TOKENS: _shard_tokens,
    SAME_DOCUMENTS: _no_facts,
    MAX_SEQLEN_COVERS: _max_seqlen_found,  # (max_seqlen, the longest document)
    # (ulysses, ring, placement index) planned, then those the attention runs on
    PLANNED_FOR_THIS_MESH: _planned_found,
}


def _placement_index(name: str) -> int:
    """A placement as a number of a failure's facts."""
    from hcp_compile.batch.placements import PLACEMENTS  # placements import this module

    return list(PLACEMENTS).index(name)


def _placement_name(index: int) -> str:
    from hcp_compile.batch.placements import PLACEMENTS

    return list(PLACEMENTS)[index]


# A verdict on the batch rules: per rule and argument of BATCH_RULES, FACTS slots, each a number
# of the failure with the rank that found it in the bits above, so that a max all-reduced over
# the mesh keeps in all slots of a rule the numbers of the lowest rank that broke it (0: none).
_NUMBER_BITS = 40  # numbers in [-2**39, 2**39): token counts and lengths are int32
_ULYSSES_BITS = 11  # a rank's position: ring rank << 11 | Ulysses rank, each below 2048
_POSITIONS = 1 << (2 * _ULYSSES_BITS)  # above every position: the lowest rank gets the highest slot
VERDICT_LENGTH = len(BATCH_RULES) * FACTS


def verdict(failures: Sequence[Failure], rank: tuple[int, int]) -> list[int]:
    """One rank's verdict on the batch rules of its call (``rank``: ring rank, Ulysses rank),
    :data:`VERDICT_LENGTH` ints, all 0 where ``failures`` is empty: the batch part of an
    agreement's :class:`hcp_compile.exchange.agreement.Verdict`."""
    broken = {(failure.rule, failure.argument): failure.facts for failure in failures}
    unflagged = set(broken) - set(BATCH_RULES)
    if unflagged:  # a failure the compiled path could not report would let the batch run
        names = sorted(f"{argument}: {rule.expected}" for rule, argument in unflagged)
        raise RuntimeError(f"hcp_compile (internal): the compiled batch check has no slot for {names}")
    ring_rank, ulysses_rank = rank
    high = (_POSITIONS - (ring_rank << _ULYSSES_BITS | ulysses_rank)) << _NUMBER_BITS
    slots = []
    for key in BATCH_RULES:
        facts = broken.get(key)
        if facts is None:
            slots += [0] * FACTS
        else:
            slots += [high + number + (1 << (_NUMBER_BITS - 1)) for number in (*facts, *(0,) * (FACTS - len(facts)))]
    return slots


def rejected_batch_error(
    agreed: Sequence[int], *, batches_differ: bool, graphs_differ: bool,
) -> InputError | None:
    """The error of a call's batch check, eager or compiled, from the :func:`verdict` agreed
    over the mesh (None when it accepts the batch): for the lowest rank that broke each rule,
    the rule's line (arguments that broke a rule with the same numbers in one line).
    Ranks given different batches may run different graphs too (each batch picks its own): the
    graphs are named only where the batches agree."""
    messages = []
    if batches_differ:
        messages.append(f"  - {SAME_BATCH.message(BATCHES_DIFFER)}")
    elif graphs_differ:
        messages.append(f"  - {SAME_GRAPH.message(GRAPHS_DIFFER)}")
    by_rank: dict[tuple[int, int], dict[tuple[Rule, tuple[int, ...]], list[str]]] = {}
    numbers = (1 << _NUMBER_BITS) - 1
    for index, (rule, argument) in enumerate(BATCH_RULES):
        slots = agreed[index * FACTS:(index + 1) * FACTS]
        if not slots[0]:
            continue
        position = _POSITIONS - (slots[0] >> _NUMBER_BITS)
        rank = (position >> _ULYSSES_BITS, position & ((1 << _ULYSSES_BITS) - 1))
        facts = tuple((slot & numbers) - (1 << (_NUMBER_BITS - 1)) for slot in slots)
        by_rank.setdefault(rank, {}).setdefault((rule, facts), []).append(argument)
    for (ring_rank, ulysses_rank), failed in sorted(by_rank.items()):
        messages.append(f"  on ring rank {ring_rank}, ulysses rank {ulysses_rank} (the lowest rank that broke these):")
        messages += [f"  - {batch_failure(rule, ', '.join(arguments), facts).message}"
                     for (rule, facts), arguments in failed.items()]
    if not messages:
        return None
    return InputError(
        "the batch check failed on a rank of the context-parallel mesh:\n" + "\n".join(messages)
    )


# --------------------------------------------------------------------------------------------
# rules of the call that the compiled path decides at compile time (and the host always)
# --------------------------------------------------------------------------------------------

def check_same_token_counts(q: Tensor, k: Tensor, v: Tensor) -> None:
    """What a compiled graph decides of :data:`SHARD_TOKENS` at compile time: q, k and v hold
    the same number of tokens (whether it is the rank's count depends on the batch: checked
    when the graph runs)."""
    counts = (q.shape[0], k.shape[0], v.shape[0])
    if counts[1] != counts[0] or counts[2] != counts[0]:
        q_count, k_count, v_count = (_hint(c) for c in counts)
        raise SHARD_TOKENS.error(f"{q_count}, {k_count} and {v_count} tokens (q, k, v)")


def _hint(size: int | torch.SymInt) -> int:
    """A size for a message: a dynamic one (compiled) as its example value, not as a symbol
    the user never named."""
    return size.node.hint if isinstance(size, torch.SymInt) else size


def _shown(t: Tensor) -> tuple[int, ...]:
    return tuple(_hint(size) for size in t.shape)


def check_cu_seqlens_dtype(cu_seqlens: Tensor, name: str) -> None:
    """What can be checked of ``cu_seqlens`` without reading its values (also at compile
    time): a 1-D int32 tensor with at least two entries."""
    if not isinstance(cu_seqlens, Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise InputError(
            f"{name}: expected dtype torch.int32 (as varlen attention kernels take), got "
            f"{cu_seqlens.dtype}; convert with {name}.to(torch.int32)"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise InputError(
            f"{name}: expected a 1-D tensor [num_docs + 1] with at least 2 entries, got shape "
            f"{tuple(cu_seqlens.shape)}; pass the document boundaries [0, ..., tokens]"
        )


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, token_counts: bool = True) -> None:
    """Ranks, shapes, dtypes and devices of q, k, v. ``token_counts=False`` leaves out the
    token dim, which a compiled graph knows only when it runs (checked then,
    :data:`SHARD_TOKENS`)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            shape = _shown(t) if isinstance(t, Tensor) else type(t).__name__
            raise InputError(
                f"{name}: expected a tensor of shape [tokens, heads, head_dim], got {shape}; pass "
                "the packed batch (THD), one row per token"
            )
    first = 0 if token_counts else 1
    if k.shape[first:] != v.shape[first:]:
        raise InputError(f"k, v: expected equal shapes, got {_shown(k)} and {_shown(v)}")
    if q.shape[2] != k.shape[2]:
        raise InputError(
            f"q, k: expected the same head_dim, got {_hint(q.shape[2])} and {_hint(k.shape[2])}"
        )
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise InputError(
            f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype} and {v.dtype}; convert them to one"
        )
    if len({q.device, k.device, v.device}) != 1:
        raise InputError(
            f"q, k, v: expected one device, got {q.device}, {k.device} and {v.device}; move them to one"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise InputError(
            f"q, k: query heads ({_hint(q.shape[1])}) must be a multiple of key/value heads "
            f"({_hint(k.shape[1])}) for grouped-query attention"
        )


def check_head_split(heads_q: int, heads_kv: int, ulysses: int) -> None:
    """The Ulysses exchange splits the query heads evenly and splits (or repeats) KV heads."""
    if heads_q % ulysses:
        raise InputError(
            f"q: {heads_q} query heads cannot be split over ulysses={ulysses} ranks; choose a "
            "mesh whose ulysses size divides the number of query heads"
        )
    if heads_kv % ulysses and ulysses % heads_kv:
        raise InputError(
            f"k: {heads_kv} key/value heads must divide or be divisible by ulysses={ulysses}; "
            "choose another ulysses size"
        )


# --------------------------------------------------------------------------------------------
# rules of a single-device call (and the Python types of any call)
# --------------------------------------------------------------------------------------------

MAX_SEQLEN_INT = Rule("max_seqlen", "expected an int", "pass the longest document length as an int")


def check_argument_types(tensors: Mapping[str, object], max_seqlens: Mapping[str, object]) -> None:
    """The Python types, which the op's schema would reject with a dispatcher error or
    coerce (a bool ``max_seqlen`` becomes an int)."""
    for name, value in tensors.items():
        if not isinstance(value, Tensor):
            raise InputError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    for name, value in max_seqlens.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise MAX_SEQLEN_INT.error(repr(value), name)


def check_window(window_size: tuple[int, int]) -> tuple[int, int]:
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and w >= -1 for w in window_size)
    ):
        raise InputError(
            f"window_size: expected (left, right) ints >= -1 (-1 = unlimited), got {window_size!r}"
        )
    return int(window_size[0]), int(window_size[1])


def check_flags(options: object, names: tuple[str, ...]) -> None:
    """The options ``names`` of ``options`` are bools (a string such as ``"false"`` would
    silently count as true)."""
    for name in names:
        value = getattr(options, name)
        if not isinstance(value, bool):
            raise InputError(f"{name}: expected True or False, got {value!r}")


def check_timeout(seconds: float | None, name: str) -> None:
    """An option holding a timeout: seconds > 0, or None for the process group's own."""
    if seconds is None:
        return
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise InputError(
            f"{name}: expected a number of seconds > 0, or None for the process group's own "
            f"timeout, got {seconds!r}"
        )


# --------------------------------------------------------------------------------------------
# the rules of a batch against one attention call: pure, on the host, no collective; eager CP
# raises the first failure after the ranks agree, the compiled graph's host op turns the
# failures into its verdict, agreed over the mesh; the single-device op raises the first one
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchCall:
    """What one attention call brings to the checks of its batch, as the host sees it."""

    tokens: Mapping[str, int]  # token counts of "q", "k" and "v"
    max_seqlens: Mapping[str, int]  # "max_seqlen_q", "max_seqlen_k" as passed
    keys: BatchValues | None = None  # cu_seqlens_k's values; None: the tensor of cu_seqlens_q
    rank: tuple[int, int] = (0, 0)  # (ring rank, Ulysses rank) under context parallelism
    planned: MeshShape | None = None  # what shard_plan laid these values out for last


def check(prepared: PreparedBatch, call: BatchCall) -> tuple[Failure, ...]:
    """The rules ``call`` breaks on the batch ``prepared`` (its ``cu_seqlens_q``), in the order
    an error should report them; empty when the call may run."""
    own = cu_seqlens_failures(prepared.batch, "cu_seqlens_q")
    if call.keys is not None:
        own += cu_seqlens_failures(call.keys, "cu_seqlens_k")
    if own:  # the other rules read document lengths and counts these values do not give
        return own
    if prepared.mesh is None:
        return _single_device(prepared.batch, call.keys or prepared.batch, call)
    return _context_parallel(prepared, call)


def cu_seqlens_failures(values: BatchValues, argument: str) -> tuple[Failure, ...]:
    """The rules ``cu_seqlens``' values break by themselves (start at 0, never decrease), named
    ``argument``."""
    failed = []
    if values.starts_at != 0:
        failed.append(batch_failure(CU_STARTS_AT_0, argument, (values.starts_at,)))
    if values.decrease is not None:
        failed.append(batch_failure(CU_NON_DECREASING, argument, values.decrease))
    return tuple(failed)


def _single_device(queries: BatchValues, keys: BatchValues, call: BatchCall) -> tuple[Failure, ...]:
    """Each side's ``cu_seqlens`` describes its whole tensor (cross-attention allowed)."""
    failed = []
    for cu_name, values, tensors in (("cu_seqlens_q", queries, "q"), ("cu_seqlens_k", keys, "kv")):
        for name in tensors:
            tokens = call.tokens[name]
            if tokens != values.num_tokens:
                # fewer tokens than the batch: most likely a shard of it, run without its mesh
                fix = (CU_ENDS_AT_TOKENS.fix if tokens > values.num_tokens else
                       f"if {name} is this rank's shard of a packed batch, make the call inside "
                       "hcp_compile.context_parallel(mesh) (or compile it with backend='hcp'); "
                       f"otherwise {CU_ENDS_AT_TOKENS.fix}")
                failed.append(Failure(CU_ENDS_AT_TOKENS, cu_name, (
                    f"{cu_name}: last entry is {values.num_tokens} but {name} has {tokens} tokens; {fix}"
                )))
        failed += _max_seqlen(f"max_seqlen_{cu_name[-1]}", call.max_seqlens, values.longest)
    if queries.values.numel() != keys.values.numel():
        found = f"{queries.values.numel() - 1} and {keys.values.numel() - 1}"
        failed.append(Failure.of(SAME_DOCUMENT_COUNT, found))
    return tuple(failed)


def _context_parallel(prepared: PreparedBatch, call: BatchCall) -> tuple[Failure, ...]:
    """The shards of one batch laid out for this mesh, queries and keys from the same
    documents."""
    batch, mesh = prepared.batch, prepared.mesh
    failed = []
    if call.keys is not None and call.keys.digest != batch.digest:
        failed.append(batch_failure(SAME_DOCUMENTS, SAME_DOCUMENTS.argument, ()))
    for name in ("max_seqlen_q", "max_seqlen_k"):
        failed += _max_seqlen(name, call.max_seqlens, batch.longest)
    if call.planned is not None and call.planned != mesh:
        facts = (*_shape_facts(call.planned), *_shape_facts(mesh))
        failed.append(batch_failure(PLANNED_FOR_THIS_MESH, PLANNED_FOR_THIS_MESH.argument, facts))
    rank_tokens = prepared.rank_tokens(*call.rank)
    for name in ("q", "k", "v"):
        if call.tokens[name] != rank_tokens:
            facts = (call.tokens[name], rank_tokens, batch.num_tokens, *_shape_facts(mesh))
            failed.append(batch_failure(SHARD_TOKENS, name, facts))
    return tuple(failed)


def _shape_facts(mesh: MeshShape) -> tuple[int, int, int]:
    return mesh.ulysses, mesh.ring, _placement_index(mesh.placement)


def _max_seqlen(name: str, max_seqlens: Mapping[str, int], longest: int) -> list[Failure]:
    bound = max_seqlens[name]
    if bound >= longest:
        return []
    return [batch_failure(MAX_SEQLEN_COVERS, name, (bound, longest))]
