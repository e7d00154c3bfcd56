"""The whole text of every error hcp_compile raises for bad input, each triggered by a minimal
input: it names the argument, what was expected and the fix, and no rule the input did not break
(hcp_compile/validation.py). An exact comparison checks both at once.

Single-process: one device, or a one-rank gloo world (``one_rank_mesh``) for the eager and
compiled context-parallel doors; the errors that need ranks to disagree run in one 2-rank world
(:func:`rank_cases`). The errors of the mesh, plans, packing, kernels, marks and transformers
are checked, by the rule they name, with the features they belong to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

import hcp_compile as hc
from hcp_compile import validation
from hcp_compile.batch.placements import PLACEMENTS
from hcp_compile.batch.prepared import prepare_batch
from hcp_compile.compiled.backend import default_mesh
from hcp_compile.exchange.schemes import SCHEMES
from hcp_compile.kernels import KERNEL_CHOICES
from hcp_compile.passes.match import UnsupportedAttention, _window
from cp_cases import ErrorSetup, World, cu_seqlens, seeded

DOCS = (5, 0, 9)  # 14 tokens, the longest 9
CU = cu_seqlens(DOCS)
Q = seeded("messages/q", 14, 4, 8)
KV = seeded("messages/kv", 14, 2, 8)


def message_of(action: Callable[[], object], error: type[BaseException] = hc.InputError) -> str:
    with pytest.raises(error) as raised:
        action()
    return str(raised.value)


def call(**overrides) -> dict:
    return {"q": Q, "k": KV, "v": KV, "cu_seqlens_q": CU, "cu_seqlens_k": CU, "max_seqlen_q": 9,
            "max_seqlen_k": 9, "causal": True, **overrides}


# --------------------------------------------------------------------------------------------
# one device: varlen_attention with no context parallelism
# --------------------------------------------------------------------------------------------

SINGLE_DEVICE = {
    "q-not-a-tensor": ({"q": Q.tolist()}, "q: expected a torch.Tensor, got list"),
    "max-seqlen-not-int": (
        {"max_seqlen_q": 9.0},
        "max_seqlen_q: expected an int, got 9.0; pass the longest document length as an int"),
    "window": (
        {"window_size": (-2, 0)},
        "window_size: expected (left, right) ints >= -1 (-1 = unlimited), got (-2, 0)"),
    "q-2d": (
        {"q": Q[:, 0]},
        "q: expected a tensor of shape [tokens, heads, head_dim], got (14, 8); pass the packed "
        "batch (THD), one row per token"),
    "k-v-shapes": ({"v": KV[:, :1]}, "k, v: expected equal shapes, got (14, 2, 8) and (14, 1, 8)"),
    "head-dim": ({"k": KV[..., :4], "v": KV[..., :4]}, "q, k: expected the same head_dim, got 8 and 4"),
    # one dtype differs: the message does not speak of devices
    "dtype": (
        {"v": KV.double()},
        "q, k, v: expected one dtype, got torch.float32, torch.float32 and torch.float64; convert "
        "them to one"),
    "gqa-heads": (
        {"q": Q[:, :3]},
        "q, k: query heads (3) must be a multiple of key/value heads (2) for grouped-query attention"),
    "cu-dtype": (
        {"cu_seqlens_k": CU.long()},
        "cu_seqlens_k: expected dtype torch.int32 (as varlen attention kernels take), got "
        "torch.int64; convert with cu_seqlens_k.to(torch.int32)"),
    "cu-shape": (
        {"cu_seqlens_q": CU[None]},
        "cu_seqlens_q: expected a 1-D tensor [num_docs + 1] with at least 2 entries, got shape "
        "(1, 4); pass the document boundaries [0, ..., tokens]"),
    # cu_seqlens + 1 also ends past the tokens: only its own rule is named
    "cu-start": ({"cu_seqlens_q": CU + 1}, "cu_seqlens_q: must start at 0, got 1; prepend a 0"),
    "cu-decreasing": (
        {"cu_seqlens_k": torch.tensor([0, 9, 5, 14], dtype=torch.int32)},
        "cu_seqlens_k: must be non-decreasing (cumulative document lengths), got entry 2 (5) < "
        "entry 1 (9); pass the running sum of the document lengths, starting at 0"),
    "cu-last-entry": (
        {"cu_seqlens_q": cu_seqlens((5, 0, 8)), "max_seqlen_q": 8},
        "cu_seqlens_q: last entry is 13 but q has 14 tokens; pass the cu_seqlens of the tensors' "
        "own packed batch"),
    # a rank's shard with the global batch's cu_seqlens, outside context_parallel
    "cu-last-entry-shard-outside-cp": (
        {"q": Q[:6], "k": KV[:6], "v": KV[:6]},
        "cu_seqlens_q: last entry is 14 but q has 6 tokens; if q is this rank's shard of a packed "
        "batch, make the call inside hcp_compile.context_parallel(mesh) (or compile it with "
        "backend='hcp'); otherwise pass the cu_seqlens of the tensors' own packed batch"),
    "document-counts": (
        {"cu_seqlens_k": cu_seqlens((5, 9)), "causal": False},
        "cu_seqlens_q, cu_seqlens_k: expected the same number of documents, got 3 and 2; pass one "
        "entry per document in both"),
    "max-seqlen-too-small": (
        {"max_seqlen_k": 8},
        "max_seqlen_k: must be at least the longest document's length, got 8 while the longest "
        "document in cu_seqlens has 9 tokens; pass the longest document length (or larger)"),
}


@pytest.mark.parametrize("overrides, message", SINGLE_DEVICE.values(), ids=SINGLE_DEVICE.keys())
def test_single_device_error_text(overrides, message):
    assert message_of(lambda: hc.varlen_attention(**call(**overrides))) == message


def test_device_differs_error_text():
    """Not reachable through the op on a CPU-only machine (the dispatcher picks the meta
    kernel first): the rule itself."""
    message = message_of(lambda: validation.check_qkv(Q, KV, KV.to("meta")))
    assert message == "q, k, v: expected one device, got cpu, cpu and meta; move them to one"


def test_unknown_kernel_error_text():
    message = message_of(lambda: torch.ops.hcp.varlen_attention(Q, KV, KV, CU, CU, 9, 9, True, 0.3, -1, -1, "x"))
    assert message == f"kernel: expected one of {KERNEL_CHOICES}, got 'x'"


# --------------------------------------------------------------------------------------------
# eager context parallelism on a one-rank mesh
# --------------------------------------------------------------------------------------------

def attend_cp(mesh, planned: torch.Tensor | None = None, **overrides) -> torch.Tensor:
    """``call(**overrides)`` inside ``context_parallel(mesh)`` after ``shard_plan`` of ``planned``
    (default: the call's ``cu_seqlens_q``), as a user does; it also replaces what another test's
    plan of these values recorded."""
    hc.shard_plan(overrides.get("cu_seqlens_q", CU) if planned is None else planned, mesh)
    with hc.context_parallel(mesh):
        return hc.varlen_attention(**call(**overrides))


def shard_tokens(tokens: int, arguments: str = "q") -> str:
    """The eager (and compiled) text of q, k, v holding ``tokens`` where the one-rank mesh's
    shard of ``CU`` holds 14."""
    return (
        f"{arguments}: under context parallelism must hold this rank's token count of "
        f"shard_plan(cu_seqlens, mesh, placement), got {tokens} tokens where this cu_seqlens sharded "
        "over ulysses=1 x ring=1 (placement 'balanced') gives 14 per rank; pass the local shards, "
        "hcp_compile.shard_plan(cu_seqlens, mesh).shard(x)")


def max_seqlen_short(arguments: str) -> str:
    return (
        f"{arguments}: must be at least the longest document's length, got 8 while the longest "
        "document in cu_seqlens has 9 tokens; pass the longest document length (or larger)")


DECREASING = torch.tensor([0, 9, 5, 14], dtype=torch.int32)
SAME_DOCUMENTS = (
    "cu_seqlens_k: must equal cu_seqlens_q under context parallelism (queries and keys come "
    "from the same packed documents); pass the same cu_seqlens for both")
PLANNED_ZIGZAG = (
    "cu_seqlens: must be the batch shard_plan laid out for the attention's mesh shape and "
    "placement, got a batch sharded for ulysses=1 x ring=1 with placement='zigzag', but the "
    "attention runs on ulysses=1 x ring=1 with placement='balanced'; give shard_plan the mesh "
    "and placement the attention runs with")

# the batch rules under context parallelism: (overrides, the line of the error both doors raise),
# every argument that broke a rule with the same numbers in one line
CP_BATCH = {
    "tokens": ({"q": Q[:12], "k": KV[:12], "v": KV[:12]}, shard_tokens(12, "q, k, v")),
    "max-seqlen-both": ({"max_seqlen_q": 8, "max_seqlen_k": 8}, max_seqlen_short("max_seqlen_q, max_seqlen_k")),
    "max-seqlen-k": ({"max_seqlen_k": 8}, max_seqlen_short("max_seqlen_k")),
    "same-documents": ({"cu_seqlens_k": cu_seqlens((9, 0, 5))}, SAME_DOCUMENTS),
    "cu-start": ({"cu_seqlens_q": CU + 1, "cu_seqlens_k": CU}, "cu_seqlens_q: must start at 0, got 1; prepend a 0"),
    "cu-decreasing": (
        {"cu_seqlens_k": DECREASING},
        "cu_seqlens_k: must be non-decreasing (cumulative document lengths), got entry 2 (5) < entry 1 "
        "(9); pass the running sum of the document lengths, starting at 0"),
}


@pytest.mark.parametrize("overrides, line", CP_BATCH.values(), ids=CP_BATCH.keys())
def test_cp_batch_error_text_is_the_same_through_both_doors(one_rank_mesh, compiled, overrides, line):
    eager = message_of(lambda: attend_cp(one_rank_mesh, planned=CU, **overrides))
    assert compiled(**call()).shape == Q.shape  # the valid batch runs
    assert eager == message_of(lambda: compiled(**call(**overrides))) == CHECK_FAILED + on_rank(0, 0, line)


def test_cp_planned_for_another_placement_error_text(one_rank_mesh, compiled):
    cu = cu_seqlens((6, 8))  # values of its own: the record of the plan is kept by value
    hc.shard_plan(cu, one_rank_mesh, placement="zigzag")
    with hc.context_parallel(one_rank_mesh):
        eager = message_of(lambda: hc.varlen_attention(**call(cu_seqlens_q=cu, cu_seqlens_k=cu)))
    assert eager == message_of(lambda: compiled(**call(cu_seqlens_q=cu, cu_seqlens_k=cu)))
    assert eager == CHECK_FAILED + on_rank(0, 0, PLANNED_ZIGZAG)


def test_graph_of_another_backend_inside_context_parallel_error_text(one_rank_mesh):
    compiled = torch.compile(hc.varlen_attention, backend="aot_eager", fullgraph=True)
    with hc.context_parallel(one_rank_mesh):
        message = message_of(lambda: compiled(**call()))
    assert message == (
        "varlen_attention: a graph compiled with a backend other than 'hcp' ran inside "
        "hcp_compile.context_parallel, so its attention would ignore the other ranks' tokens; "
        "compile with backend='hcp' (options={'mesh': mesh}) or run eagerly")


# --------------------------------------------------------------------------------------------
# the compiled door on a one-rank mesh: the agreed batch check gives eager's facts
# --------------------------------------------------------------------------------------------

CHECK_FAILED = "the batch check failed on a rank of the context-parallel mesh:\n"


def on_rank(ring_rank: int, ulysses_rank: int, *lines: str) -> str:
    """The compiled error's lines for what rank ``(ring_rank, ulysses_rank)`` broke first."""
    return (f"  on ring rank {ring_rank}, ulysses rank {ulysses_rank} (the lowest rank that broke "
            "these):\n" + "\n".join(f"  - {line}" for line in lines))


# eager and compiled: ranks given different batches or options
SAME_BATCH = (
    "cu_seqlens: must be the same on every rank of the context-parallel mesh, as must the mesh "
    "shape and options, got another cu_seqlens, mesh shape, placement, recompute_exchange or scheme "
    "on some rank (the ranks were given different batches or options); give every rank the same "
    "batch (check the data loader) and the same options")


def compiled_attention(mesh) -> Callable:
    """``varlen_attention`` compiled by the hcp backend for ``mesh`` (eager inner compiler: the
    fastest), every argument an input."""
    def attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        return hc.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   causal=causal)

    return torch.compile(attend, backend="hcp", fullgraph=True, options={"mesh": mesh, "inner": "eager"})


@pytest.fixture
def compiled(one_rank_mesh) -> Iterator[Callable]:
    """:func:`compiled_attention` on the one-rank mesh, the batch ``CU`` planned for it."""
    torch._dynamo.reset()
    hc.shard_plan(CU, one_rank_mesh)
    yield compiled_attention(one_rank_mesh)
    torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_token_counts_differ_error_text(compiled, dynamic):
    """At compile time, with the sizes found (a dynamic size as its value, not its symbol)."""
    if dynamic:
        compiled(**call())
        compiled(**call(q=Q[:13], k=KV[:13], v=KV[:13], cu_seqlens_q=cu_seqlens((5, 0, 8)),
                        cu_seqlens_k=cu_seqlens((5, 0, 8)), max_seqlen_q=8, max_seqlen_k=8))
    message = message_of(lambda: compiled(**call(k=KV[:10], v=KV[:10])), UnsupportedAttention)
    assert message == (
        "hcp::varlen_attention at top level: q, k, v: under context parallelism must hold this "
        "rank's token count of shard_plan(cu_seqlens, mesh, placement), got 14, 10 and 10 tokens "
        "(q, k, v); pass the local shards, hcp_compile.shard_plan(cu_seqlens, mesh).shard(x)")


def test_compiled_cu_seqlens_dtype_error_text(compiled):
    message = message_of(lambda: compiled(**call(cu_seqlens_q=CU.long(), cu_seqlens_k=CU.long())),
                         UnsupportedAttention)
    assert message == (
        "hcp::varlen_attention at top level: cu_seqlens_q: expected dtype torch.int32 (as varlen "
        "attention kernels take), got torch.int64; convert with cu_seqlens_q.to(torch.int32)")


def test_compiled_ranks_that_differ_error_text():
    """What ranks given different batches, or running different graphs of one batch, raise (the
    flags as agreed over the mesh; ranks that differ: tests/test_compile.py). Different batches
    may pick different graphs: then only the batches are named."""
    fine = validation.verdict((), (0, 0))
    batches = f"  - {SAME_BATCH}"
    graphs = ("  - compiled graphs: every rank must run the graph for what the batch exchanges, got "
              "graphs built for batches that exchange different things on some ranks; see the warning "
              "of the rank that could not build its graph")
    for batches_differ, graphs_differ, line in ((True, False, batches), (True, True, batches),
                                                (False, True, graphs)):
        error = validation.rejected_batch_error(fine, batches_differ=batches_differ, graphs_differ=graphs_differ)
        assert str(error) == CHECK_FAILED + line
    assert validation.rejected_batch_error(fine, batches_differ=False, graphs_differ=False) is None


# --------------------------------------------------------------------------------------------
# options, the backend, and the host-side helpers
# --------------------------------------------------------------------------------------------

OPTIONS = {
    "flag": (lambda: hc.CPOptions(recompute_exchange="false"),
             "recompute_exchange: expected True or False, got 'false'"),
    "timeout": (lambda: hc.CPOptions(agreement_timeout_s=0),
                "agreement_timeout_s: expected a number of seconds > 0, or None for the process "
                "group's own timeout, got 0"),
    "kernel": (lambda: hc.CPOptions(kernel="x"), f"kernel: expected one of {KERNEL_CHOICES}, got 'x'"),
    "placement": (lambda: hc.CPOptions(placement="x"), f"placement: expected one of {tuple(PLACEMENTS)}, got 'x'"),
    "scheme": (lambda: hc.CPOptions(scheme="x"), f"scheme: expected one of {sorted(SCHEMES)}, got 'x'"),
    "inner": (lambda: hc.backend(inner="x"),
              "inner: expected one of ('inductor', 'aot_eager', 'eager'), got 'x'"),
    "no-mesh": (default_mesh,
                "mesh: no mesh was given and torch.distributed is not initialized; call "
                "init_process_group (or launch with torchrun) or pass options={'mesh': mesh}"),
    "prepare-batch-ring": (lambda: prepare_batch(CU, ulysses=2, ring=0),
                           "ring: expected a positive int (the mesh's size), got 0"),
    "prepare-batch-causal": (lambda: prepare_batch(CU, ulysses=2, ring=1, causal="yes"),
                             "causal: expected True or False, got 'yes'"),
    "prepare-batch-cu": (lambda: prepare_batch(CU + 1, ulysses=2, ring=1),
                         "cu_seqlens: must start at 0, got 1; prepend a 0"),
    "window-not-constant": (lambda: _window("left", -1),
                            "window_size: expected constant ints, got ('left', -1); a window that "
                            "changes between calls cannot be laid out at compile time"),
}


@pytest.mark.parametrize("action, message", OPTIONS.values(), ids=OPTIONS.keys())
def test_option_and_helper_error_text(action, message):
    assert message_of(action) == message


def test_head_split_error_text():
    """The rules of a Ulysses size above 1 (on every rank of a mesh: tests/test_cp_errors.py)."""
    assert message_of(lambda: validation.check_head_split(3, 1, 2)) == (
        "q: 3 query heads cannot be split over ulysses=2 ranks; choose a mesh whose ulysses size "
        "divides the number of query heads")
    assert message_of(lambda: validation.check_head_split(6, 3, 2)) == (
        "k: 3 key/value heads must divide or be divisible by ulysses=2; choose another ulysses size")


# --------------------------------------------------------------------------------------------
# ranks that disagree: one 2-rank world (ulysses=2)
# --------------------------------------------------------------------------------------------

RANK_MESH = (2, 1)
ANOTHER_RANK = (
    "another rank of the context-parallel mesh rejected its input (see that rank's error); all "
    "ranks stop here instead of waiting in a collective")


@dataclass(frozen=True)
class RankCase:
    """``action`` on every rank of the world; ``messages[rank]``: the text that rank raises."""

    id: str
    action: Callable[[ErrorSetup], object] = field(compare=False)
    messages: tuple[str, str]

    def run(self, world: World) -> dict:
        self.action(ErrorSetup(world))
        return {}


def _other_batch_on_rank_1(s: ErrorSetup) -> torch.Tensor:
    # the same documents in another order: the same token count on each rank, another batch
    cu = s.permuted if s.rank == 1 else s.cu
    return s.attend(cu_seqlens_q=cu, cu_seqlens_k=cu)


def _short_q_on_rank_1(s: ErrorSetup) -> torch.Tensor:
    return s.attend(q=s.q[:-1] if s.rank == 1 else s.q)


# ErrorSetup's batch (5, 0, 9) gives each rank of ulysses=2 7 tokens
SHORT_Q = (
    "q: under context parallelism must hold this rank's token count of shard_plan(cu_seqlens, mesh, "
    "placement), got 6 tokens where this cu_seqlens sharded over ulysses=2 x ring=1 (placement "
    "'balanced') gives 7 per rank; pass the local shards, hcp_compile.shard_plan(cu_seqlens, mesh).shard(x)")


def _local_cu_seqlens(s: ErrorSetup) -> torch.Tensor:
    # each rank's shard with cu_seqlens of its own 7 tokens, the same on both ranks
    local = cu_seqlens((s.q.shape[0],))
    return s.attend(cu_seqlens_q=local, cu_seqlens_k=local)


def _compiled(s: ErrorSetup, **overrides) -> torch.Tensor:
    args = {"q": s.q, "k": s.k, "v": s.v, "cu_seqlens_q": s.cu, "cu_seqlens_k": s.cu,
            "max_seqlen_q": s.longest, "max_seqlen_k": s.longest, "causal": True, **overrides}
    return compiled_attention(s.world.mesh)(**args)


def _compiled_local_cu_seqlens(s: ErrorSetup) -> torch.Tensor:
    local = cu_seqlens((s.q.shape[0],))
    return _compiled(s, cu_seqlens_q=local, cu_seqlens_k=local)


def _compiled_short_q_on_rank_1(s: ErrorSetup) -> torch.Tensor:
    short = s.q[:-1] if s.rank == 1 else s.q
    return _compiled(s, q=short, k=s.k[:short.shape[0]], v=s.v[:short.shape[0]])


def _cu_int64_on_rank_1(s: ErrorSetup) -> torch.Tensor:
    cu = s.cu.long() if s.rank == 1 else s.cu
    return s.attend(cu_seqlens_q=cu, cu_seqlens_k=cu)


CU_INT64 = ("cu_seqlens_q: expected dtype torch.int32 (as varlen attention kernels take), got torch.int64; "
            "convert with cu_seqlens_q.to(torch.int32)")
# ErrorSetup's shard of 7 tokens given cu_seqlens [0, 7], its own
LOCAL_CU = (
    "{arguments}: under context parallelism must hold this rank's token count of shard_plan(cu_seqlens, "
    "mesh, placement), got 7 tokens where this cu_seqlens sharded over ulysses=2 x ring=1 (placement "
    "'balanced') gives 4 per rank; cu_seqlens ends at 7, no more tokens than this rank holds: pass "
    "the GLOBAL cu_seqlens and max_seqlen (of the whole packed batch, the same on every rank) with "
    "this rank's shards of q, k, v, hcp_compile.shard_plan(cu_seqlens, mesh).shard(x)")
# every rank, through both doors: what the lowest rank that broke the rule found
LOCAL_CU_TEXT = CHECK_FAILED + on_rank(0, 0, LOCAL_CU.format(arguments="q, k, v"))
SHORT_Q_TEXT = CHECK_FAILED + on_rank(0, 1, SHORT_Q)
COMPILED_SHORT_Q_TEXT = CHECK_FAILED + on_rank(0, 1, SHORT_Q.replace("q: ", "q, k, v: ", 1))
OTHER_BATCH = CHECK_FAILED + f"  - {SAME_BATCH}"
RANK_CASES = [
    RankCase("messages-other-batch", _other_batch_on_rank_1, (OTHER_BATCH,) * 2),
    RankCase("messages-one-rank-short-q", _short_q_on_rank_1, (SHORT_Q_TEXT,) * 2),
    RankCase("messages-local-cu-seqlens", _local_cu_seqlens, (LOCAL_CU_TEXT,) * 2),
    RankCase("messages-compiled-local-cu-seqlens", _compiled_local_cu_seqlens, (LOCAL_CU_TEXT,) * 2),
    RankCase("messages-compiled-one-rank-short-q", _compiled_short_q_on_rank_1, (COMPILED_SHORT_Q_TEXT,) * 2),
    RankCase("messages-one-rank-cu-int64", _cu_int64_on_rank_1, (ANOTHER_RANK, CU_INT64)),
]


def rank_cases(mesh: tuple[int, int]) -> list[RankCase]:
    """The suite of the 2-rank world (hcp_compile/testing/worlds.py)."""
    return RANK_CASES


@pytest.mark.parametrize("case", RANK_CASES, ids=lambda c: c.id)
def test_ranks_that_disagree_error_text(cp_world, case):
    """A batch rule broken on any rank, or ranks given different batches, raise the same text
    on every rank, eager and compiled; a rank whose input fails another rule raises its own
    error, the others say that another rank did."""
    records = cp_world(RANK_MESH, suite="test_error_messages:rank_cases").per_rank(case.id)
    assert [record.message for record in records] == list(case.messages)
    own_errors = [message != ANOTHER_RANK for message in case.messages]
    assert [record.raised_instance_of(hc.InputError) for record in records] == own_errors
