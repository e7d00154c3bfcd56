"""Partly marked models under ``backend="hcp"`` (docs/design.md §5.2): once any module is marked
with ``@hcp_compile.attention``, only marked modules are rewritten. An unmarked attention that
takes the batch's ``cu_seqlens`` must raise on every rank, naming the fix, instead of attending
over the rank's shard as if it were the whole batch; an unmarked attention over inputs of its
own (not sharded) stays single-device and correct.

Marks are process-global, so these cases run in a world of their own: two processes
(ulysses 1 x ring 2, gloo), inner compiler ``aot_eager`` and ``eager``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

import hcp_compile as hc
from hcp_compile.testing.reference import reference_attention
from checks import assert_matches, assert_raised
from cp_cases import HEAD_DIM, World, cu_seqlens, seeded
from hcp_compile.passes.match import UnsupportedAttention

MESH = (1, 2)  # (ulysses, ring)
SUITE = "test_marking:suite"
DEADLINE_S = 240
DOCS = (5, 0, 9, 3)  # the context-parallel batch
OWN_DOCS = (4, 6)  # the unmarked layer's own batch, the same on every rank
HEADS = (4, 2)


class Attention(nn.Module):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int) -> Tensor:
        return hc.varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True)


class MarkedAndUnmarked(nn.Module):
    """One marked attention module (an instance mark) and one unmarked, each on its inputs."""

    def __init__(self):
        super().__init__()
        self.marked = hc.attention(Attention())
        self.unmarked = Attention()

    def forward(self, batch: tuple, own: tuple) -> tuple[Tensor, Tensor]:
        return self.marked(*batch), self.unmarked(*own)


def global_qkv(name: str, docs: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
    tokens = sum(docs)
    return tuple(seeded(f"{name}/{n}", tokens, heads, HEAD_DIM)
                 for n, heads in zip("qkv", (HEADS[0], HEADS[1], HEADS[1])))


@dataclass(frozen=True)
class PartlyMarkedCase:
    """``own_batch``: the unmarked layer attends over a batch of its own, the same on every
    rank; otherwise over the context-parallel batch's shards and ``cu_seqlens``."""

    inner: str
    own_batch: bool

    @property
    def id(self) -> str:
        return f"{'own-batch' if self.own_batch else 'shared-batch'}-{self.inner}"

    def run(self, world: World) -> dict:
        torch._dynamo.reset()
        cu = cu_seqlens(DOCS)
        plan = hc.shard_plan(cu, world.mesh)
        batch = (*(plan.shard(t) for t in global_qkv("batch", DOCS)), cu, max(DOCS))
        own_cu = cu_seqlens(OWN_DOCS)
        own = (*global_qkv("own", OWN_DOCS), own_cu, max(OWN_DOCS)) if self.own_batch else batch
        model = torch.compile(MarkedAndUnmarked(), fullgraph=True,
                              backend=hc.backend(mesh=world.mesh, inner=self.inner))
        out, own_out = model(batch, own)
        return {"out": out, "own_out": own_out, "global_index": plan.global_index}


SHARED = [PartlyMarkedCase(inner, own_batch=False) for inner in ("aot_eager", "eager")]
OWN = PartlyMarkedCase("aot_eager", own_batch=True)


def suite(mesh: tuple[int, int]) -> list:
    return [OWN, *SHARED]


@pytest.fixture(scope="module")
def world(cp_world):
    return cp_world(MESH, suite=SUITE, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("case", SHARED, ids=lambda c: c.id)
def test_unmarked_attention_on_the_sharded_batch_raises_on_every_rank(world, case):
    for rank, record in enumerate(world.per_rank(case.id)):
        assert_raised(record, UnsupportedAttention, "hcp::varlen_attention at unmarked: ", f"rank {rank}")
        assert record.raised_instance_of(hc.InputError)
        for part in ("in no module marked with @hcp_compile.attention",
                     "would attend over this rank's shard as if it were the whole batch",
                     "mark its module too", "or mark no module"):
            assert part in record.message, f"rank {rank}: {part!r} not in {record.message!r}"


def test_unmarked_attention_on_its_own_batch_stays_single_device(world):
    cu, own_cu = cu_seqlens(DOCS).tolist(), cu_seqlens(OWN_DOCS).tolist()
    expected = reference_attention(*global_qkv("batch", DOCS), cu, cu, causal=True)
    expected_own = reference_attention(*global_qkv("own", OWN_DOCS), own_cu, own_cu, causal=True)
    for rank, result in enumerate(world.values(OWN.id)):
        index = result["global_index"]
        local = expected[index.clamp(min=0)].masked_fill((index < 0)[:, None, None], 0)
        assert_matches(result["out"], local, f"rank {rank} marked (context-parallel) out")
        assert_matches(result["own_out"], expected_own, f"rank {rank} unmarked (single-device) out")
