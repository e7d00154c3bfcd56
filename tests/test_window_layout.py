"""A batch laid out for a sliding window (``shard_plan(..., window=)``, docs/design.md §2.4)
attended eagerly and compiled on gloo worlds of 1 x 2 and 2 x 2 ranks: the attention runs on
the layout that sharded its tokens (shard_plan's record of the values), whatever window its
own calls use, and gives the float64 reference's rows; ranks whose layouts differ, or a batch
prepared for another window than the plan's, raise on every rank instead of computing.

The batch: two long documents that the window's layout turns (``BatchLayout.turn``) and the
plain one does not, with the same token count per rank, so that a door laying the batch out
without the window would compute wrong rows without any size telling."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import pytest
import torch

import hcp_compile as hc
from checks import assert_matches, assert_raised, local_rows
from compile_cases import sharded_attention
from cp_cases import World, cu_seqlens, seeded
from hcp_compile.batch.prepared import prepare_batch
from hcp_compile.testing.reference import reference_with_grads

DOCS = (3, 2, 4, 1, 2, 3, 5, 2, 1, 3, 2, 4, 6, 2, 3, 96, 1, 2, 5, 3, 2, 4, 1, 3, 30, 80, 26)
WINDOW = (6, 0)
HEADS, HEAD_DIM = (4, 2), 8
MESHES = ((1, 2), (2, 2))
SUITE = "test_window_layout:suite"
# the masks the batch is attended with: its layout's window, and plain causal (a model's
# global layers beside its windowed ones)
MASKS = {"window": WINDOW, "causal": (-1, -1)}


def global_inputs(docs: tuple[int, ...]) -> dict[str, torch.Tensor]:
    tokens = sum(docs)
    return {name: seeded(f"window-layout/{name}", tokens, heads, HEAD_DIM)
            for name, heads in (("q", HEADS[0]), ("k", HEADS[1]), ("v", HEADS[1]), ("dout", HEADS[0]))}


def attend(plan: hc.ShardPlan, world: World, docs: tuple[int, ...], window: tuple[int, int], compiled: bool) -> dict:
    """Forward and backward of the batch's causal attention under ``window`` on this rank's
    shards, eager or compiled."""
    return sharded_attention(plan, world, global_inputs(docs), cu_seqlens(docs), max(docs), True, window, compiled)


@dataclass(frozen=True)
class LaidOutForTheWindowCase:
    """shard_plan with the window; eager under both masks, compiled under the window."""

    id: str = "laid-out-for-the-window"

    def run(self, world: World) -> dict:
        plan = hc.shard_plan(cu_seqlens(DOCS), world.mesh, window=WINDOW)
        # the plain layout of the same values, from a prepared batch (no record of it)
        plain = prepare_batch(cu_seqlens(DOCS), ulysses=world.ulysses, ring=world.ring)
        results = {f"eager {name}": attend(plan, world, DOCS, mask, compiled=False) for name, mask in MASKS.items()}
        results["compiled window"] = attend(plan, world, DOCS, WINDOW, compiled=True)
        ring_rank, ulysses_rank = divmod(world.rank, world.ulysses)
        return {"global_index": plan.global_index, "window": plan.window, "results": results,
                "plain_index": plain.tokens(ring_rank, ulysses_rank).global_index,
                "summary": plan.summary(HEADS[0], HEADS[1], HEAD_DIM, torch.float32)}


def reordered(docs: tuple[int, ...]) -> tuple[int, ...]:
    """Other values of the same documents: a batch of its own in the batch cache."""
    return docs[1:] + docs[:1]


@dataclass(frozen=True)
class RanksLayOutDifferentlyCase:
    """Rank 0 lays the batch out for the window, the others without: eager or compiled, every
    rank raises (their fingerprints differ) and none computes."""

    compiled: bool
    docs: tuple[int, ...]

    @property
    def id(self) -> str:
        return f"ranks-lay-out-differently-{'compiled' if self.compiled else 'eager'}"

    def run(self, world: World) -> dict:
        window = WINDOW if world.rank == 0 else (-1, -1)
        plan = hc.shard_plan(cu_seqlens(self.docs), world.mesh, window=window)
        return attend(plan, world, self.docs, WINDOW, compiled=self.compiled)


@dataclass(frozen=True)
class PreparedForTheWindowCase:
    """A batch prepared ahead for the window (``prepare_batch(..., layout_window=)``, pickled
    as from a DataLoader worker): refused by a plan without the window, taken by one with it."""

    id: str = "prepared-for-the-window"

    def run(self, world: World) -> dict:
        docs = reordered(reordered(DOCS))
        sent = pickle.dumps(prepare_batch(cu_seqlens(docs), ulysses=world.ulysses, ring=world.ring,
                                          rank=world.rank, window=WINDOW, layout_window=WINDOW))
        refused = ""
        try:
            hc.shard_plan(pickle.loads(sent), world.mesh)
        except hc.InputError as error:
            refused = str(error)
        plan = hc.shard_plan(pickle.loads(sent), world.mesh, window=WINDOW)
        return {"refused": refused, "global_index": plan.global_index,
                "eager": attend(plan, world, docs, WINDOW, compiled=False)}


LAID_OUT, PREPARED = LaidOutForTheWindowCase(), PreparedForTheWindowCase()
DIFFERENTLY = [RanksLayOutDifferentlyCase(compiled, docs)
               for compiled, docs in ((False, reordered(DOCS)), (True, tuple(reversed(DOCS))))]


def suite(mesh: tuple[int, int]) -> list:
    return [LAID_OUT, *DIFFERENTLY, PREPARED]


@pytest.fixture(scope="module", params=MESHES, ids=lambda mesh: f"{mesh[0]}x{mesh[1]}")
def world(request, cp_world):
    return cp_world(request.param, suite=SUITE)


def expected(docs: tuple[int, ...], window: tuple[int, int]) -> dict[str, torch.Tensor]:
    x, cu = global_inputs(docs), cu_seqlens(docs).tolist()
    return reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu, cu, causal=True, window=window)


def test_both_doors_attend_the_layout_that_sharded_the_tokens(world):
    by_mask = {"eager window": expected(DOCS, WINDOW), "eager causal": expected(DOCS, (-1, -1))}
    by_mask["compiled window"] = by_mask["eager window"]
    values = world.values(LAID_OUT.id)
    # the window's layout is not the plain one on some rank: a door laying the batch out
    # without the window would read the wrong rows
    assert any(not torch.equal(v["global_index"], v["plain_index"]) for v in values)
    for rank, value in enumerate(values):
        assert value["window"] == WINDOW and "work (pairs, window (6, 0))" in value["summary"]
        assert value["global_index"].numel() == value["plain_index"].numel()
        for path, result in value["results"].items():
            for name in ("out", "dq", "dk", "dv"):
                assert_matches(result[name], local_rows(by_mask[path][name], value["global_index"]),
                               f"rank {rank} {path} {name}")


@pytest.mark.parametrize("case", DIFFERENTLY, ids=lambda case: case.id)
def test_ranks_with_different_layouts_all_raise(world, case):
    for rank, record in enumerate(world.per_rank(case.id)):
        assert_raised(record, hc.InputError, "must be the same on every rank", f"rank {rank}")


def test_a_batch_prepared_for_the_window_needs_the_plan_s_window(world):
    docs = reordered(reordered(DOCS))
    reference = expected(docs, WINDOW)
    for rank, value in enumerate(world.values(PREPARED.id)):
        assert value["refused"].startswith(
            f"cu_seqlens: a PreparedBatch for ulysses={world.mesh[0]} x ring={world.mesh[1]} with "
            "placement='balanced' for window=(6, 0), but shard_plan lays out for"), value["refused"]
        assert "layout_window" in value["refused"]
        for name in ("out", "dq", "dk", "dv"):
            assert_matches(value["eager"][name], local_rows(reference[name], value["global_index"]),
                           f"rank {rank} {name}")
