"""A rank that skips an attention call (it caught an exception and went on, or stopped) must not
leave the other ranks waiting forever in the agreement before the call: they raise
``hcp_compile.AgreementTimeout`` after ``agreement_timeout_s`` (default: the process group's own
timeout), saying which collective, after how long, the likely cause and the fix
(docs/design.md §9). One world of two processes (ulysses 1 x ring 2, gloo), eager and compiled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import hcp_compile as hc
from hcp_compile.testing.reference import reference_attention
from checks import assert_matches, assert_raised
from cp_cases import ERROR_DOCS, ErrorSetup, World, cu_seqlens, short_timeout_groups

MESH = (1, 2)  # (ulysses, ring)
SUITE = "test_agreement_timeout:suite"
DEADLINE_S = 150
SKIPPING_RANK = 1
# how much longer than its timeout a wait may take on a loaded machine: far below the other
# timeouts in play (the fresh groups' 30 s for SKIPPED, the world's 60 s), which a wait that
# ignored agreement_timeout_s would run into
LATE_S = 10


@dataclass(frozen=True)
class SkippedCallCase:
    """Rank 1 skips the attention call and waits in another collective (a barrier over the
    world, as the next step's would be); rank 0 makes the call on fresh groups (a timed-out
    all-reduce leaves its group unusable) whose own timeout is ``group_timeout_s``."""

    id: str
    agreement_timeout_s: float | None
    group_timeout_s: float

    def run(self, world: World) -> dict:
        groups = short_timeout_groups(world, seconds=self.group_timeout_s)
        setup = ErrorSetup(world)
        context = hc.context_parallel(groups, agreement_timeout_s=self.agreement_timeout_s)
        try:
            if world.rank != SKIPPING_RANK:
                setup.attend(context=context)
        finally:
            dist.barrier()  # both ranks meet again here, whatever the call did
        return {}


@dataclass(frozen=True)
class SkippedCompiledCallCase:
    """The compiled door: both ranks run a graph compiled by the hcp backend once, then rank 1
    skips the second call; rank 0's graph waits in its agreement op (``hcp::agree_on_batch``)
    at most the backend's ``agreement_timeout_s``, as eager CP's does."""

    id: str = "rank-1-skips-the-compiled-call"
    agreement_timeout_s: float = 1.5

    def run(self, world: World) -> dict:
        groups = short_timeout_groups(world, seconds=30)
        setup = ErrorSetup(world)

        def attend(q, k, v, cu_seqlens, max_seqlen):
            return hc.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)

        options = {"mesh": groups, "inner": "eager", "agreement_timeout_s": self.agreement_timeout_s}
        compiled = torch.compile(attend, backend="hcp", fullgraph=True, options=options)
        args = (setup.q, setup.k, setup.v, setup.cu, setup.longest)
        torch._dynamo.reset()
        try:
            compiled(*args)  # both ranks: the graph is compiled and runs
            if world.rank != SKIPPING_RANK:
                compiled(*args)
        finally:
            dist.barrier()
            torch._dynamo.reset()
        return {}


@dataclass(frozen=True)
class EveryRankCallsCase:
    """Every rank makes the call with a timeout: it waits as long as needed and no longer."""

    id: str = "every-rank-calls-with-a-timeout"

    def run(self, world: World) -> dict:
        setup = ErrorSetup(world)
        out = setup.attend(options={"agreement_timeout_s": 30.0})
        return {"out": out, "global_index": setup.plan.global_index}


SKIPPED = SkippedCallCase("rank-1-skips-the-call", agreement_timeout_s=1.5, group_timeout_s=30)
# agreement_timeout_s=None: the groups' own timeout, read from their backend
SKIPPED_GROUP_TIMEOUT = SkippedCallCase("rank-1-skips-the-call-group-timeout", None, 2.5)
SKIPPED_COMPILED = SkippedCompiledCallCase()
EVERY_RANK = EveryRankCallsCase()


def suite(mesh: tuple[int, int]) -> list:
    return [EVERY_RANK, SKIPPED, SKIPPED_GROUP_TIMEOUT, SKIPPED_COMPILED]


@pytest.fixture(scope="module")
def world(cp_world):
    return cp_world(MESH, suite=SUITE, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("case", [SKIPPED, SKIPPED_GROUP_TIMEOUT], ids=lambda c: c.id)
def test_a_skipped_call_raises_agreement_timeout_on_the_waiting_rank(world, case):
    waiting, skipping = world.per_rank(case.id)
    assert not skipping.raised, f"rank {SKIPPING_RANK}: {skipping.describe()}"
    assert_raised(waiting, hc.AgreementTimeout, "varlen_attention: the agreement all-reduce", "rank 0")
    assert waiting.raised_instance_of(RuntimeError)
    expected_s = case.agreement_timeout_s or case.group_timeout_s
    waited = float(re.search(r"timed out after ([\d.]+) s", waiting.message).group(1))
    assert expected_s <= waited < expected_s + LATE_S, waiting.message
    option = (f"agreement_timeout_s={case.agreement_timeout_s:g}" if case.agreement_timeout_s
              else "agreement_timeout_s=None, the process group's timeout")
    for part in (option, "ring group, global ranks [0, 1]", "skipped this call or stopped",
                 "caught an exception and went on", "context_parallel(mesh, agreement_timeout_s=...)"):
        assert part in waiting.message, f"{part!r} not in {waiting.message!r}"


def test_a_skipped_compiled_call_raises_agreement_timeout_on_the_waiting_rank(world):
    """The same protocol through the compiled door: the same error, after the backend's
    ``agreement_timeout_s``."""
    case = SKIPPED_COMPILED
    waiting, skipping = world.per_rank(case.id)
    assert not skipping.raised, f"rank {SKIPPING_RANK}: {skipping.describe()}"
    assert_raised(waiting, hc.AgreementTimeout,
                  "the compiled graph's varlen_attention: the agreement all-reduce", "rank 0")
    waited = float(re.search(r"timed out after ([\d.]+) s", waiting.message).group(1))
    assert case.agreement_timeout_s <= waited < case.agreement_timeout_s + LATE_S, waiting.message
    assert "agreement_timeout_s=1.5" in waiting.message


def test_every_rank_calling_with_a_timeout_matches_the_reference(world):
    cu = cu_seqlens(ERROR_DOCS).tolist()
    expected = reference_attention(*ErrorSetup.global_qkv(), cu, cu, causal=True)
    for rank, result in enumerate(world.values(EVERY_RANK.id)):
        index = result["global_index"]
        local = expected[index.clamp(min=0)].masked_fill((index < 0)[:, None, None], 0)
        assert_matches(result["out"], local, f"rank {rank} out")


@pytest.mark.parametrize("bad", [0, -1.0, True, "10"])
def test_agreement_timeout_must_be_positive_seconds(bad):
    with pytest.raises(hc.InputError, match="agreement_timeout_s: expected a number of seconds > 0"):
        hc.CPOptions(agreement_timeout_s=bad)
