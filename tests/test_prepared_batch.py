"""A batch prepared ahead of time (``prepare_batch`` in a DataLoader worker, no process group)
is pickled to the training process and taken as it is by ``shard_plan``, eager CP and the
compiled graph, which derive nothing again and give the results of the on-the-fly path
(docs/design.md §2, §9; the per-batch host work off the critical path). Also: the
fingerprint the ranks agree on tells any number of placements apart, and ``check`` flags
exactly the broken rules.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import hcp_compile as hc
from hcp_compile.testing.reference import reference_with_grads
from checks import assert_matches, assert_raised, local_rows
from compile_cases import sharded_attention
from cp_cases import World, cu_seqlens, seeded
from hcp_compile import validation
from hcp_compile.batch import layout, pickling, prepared, schedule
from hcp_compile.batch.placements import PLACEMENTS
from hcp_compile.batch.cache import BATCHES
from hcp_compile.batch.prepared import BatchValues, MeshShape, PreparedBatch, prepare_batch
from hcp_compile.exchange.agreement import fingerprint
from hcp_compile.exchange.schemes import DEFAULT_SCHEME

MESH = (2, 2)  # (ulysses, ring)
SUITE = "test_prepared_batch:suite"
# short documents and two long ones: local, group and ring placements on 2 x 2
DOCS = (3, 2, 4, 1, 2, 3, 5, 2, 1, 3, 2, 4, 6, 2, 3, 44, 1, 2, 5, 3, 2, 4, 1, 3, 30)
HEADS, HEAD_DIM = (4, 2), 8
MASK = {"causal": True, "window": (5, 0)}  # a window: the steps it skips are derived too


def global_inputs() -> dict[str, torch.Tensor]:
    tokens = sum(DOCS)
    return {name: seeded(f"prepared/{name}", tokens, heads, HEAD_DIM)
            for name, heads in (("q", HEADS[0]), ("k", HEADS[1]), ("v", HEADS[1]), ("dout", HEADS[0]))}


class _PreparedBatches(Dataset):
    """What a trainer's loader yields: the batch, prepared in the worker for this rank."""

    def __init__(self, rank: int):
        self.rank = rank

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> tuple[int, PreparedBatch]:
        batch = prepare_batch(cu_seqlens(DOCS), ulysses=MESH[0], ring=MESH[1], rank=self.rank,
                              causal=MASK["causal"], window=MASK["window"])
        return os.getpid(), batch


# what preparing a batch derives; the prepared path must call none of it again
_DERIVATIONS = ((layout, "batch_layout"), (layout, "rank_size_values"), (layout, "rank_tokens"),
                (layout, "step_sees_any_key"), (layout, "rank_segments"))


@contextmanager
def counting_derivations() -> Iterator[dict[str, int]]:
    calls = {name: 0 for _, name in _DERIVATIONS}
    originals = [(module, name, getattr(module, name)) for module, name in _DERIVATIONS]

    def counted(name, original):
        def call(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return call

    for module, name, original in originals:
        setattr(module, name, counted(name, original))
    try:
        yield calls
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def attend(plan: hc.ShardPlan, world: World, cu: torch.Tensor, compiled: bool) -> dict:
    """Forward and backward of the batch's attention on this rank's shards, eager or compiled."""
    return sharded_attention(plan, world, global_inputs(), cu, max(DOCS), MASK["causal"], MASK["window"], compiled)


@dataclass(frozen=True)
class AheadOfTimeCase:
    """The batch prepared in a DataLoader worker, then the same batch prepared on the fly."""

    id: str = "prepared-in-a-worker-then-on-the-fly"

    def run(self, world: World) -> dict:
        loader = DataLoader(_PreparedBatches(world.rank), batch_size=None, num_workers=1,
                            multiprocessing_context="fork")
        (worker, batch), = list(loader)
        cu = cu_seqlens(DOCS)
        with counting_derivations() as calls:
            plan = hc.shard_plan(batch, world.mesh)
            ahead = {"eager": attend(plan, world, cu, compiled=False),
                     "compiled": attend(plan, world, cu, compiled=True)}
        hc.clear_batch_cache()  # forget it: the on-the-fly path derives everything again
        with counting_derivations() as on_the_fly_calls:
            fly_plan = hc.shard_plan(cu, world.mesh)
            on_the_fly = {"eager": attend(fly_plan, world, cu, compiled=False),
                          "compiled": attend(fly_plan, world, cu, compiled=True)}
        return {"worker": worker, "pid": os.getpid(), "calls": calls,
                "on_the_fly_calls": on_the_fly_calls, "ahead": ahead, "on_the_fly": on_the_fly,
                "global_index": plan.global_index, "fly_global_index": fly_plan.global_index}


@dataclass(frozen=True)
class OtherShapeCase:
    """A batch prepared for another placement than the plan's is refused, naming it."""

    id: str = "prepared-for-another-placement"

    def run(self, world: World) -> dict:
        batch = prepare_batch(cu_seqlens(DOCS), ulysses=MESH[0], ring=MESH[1], placement="zigzag")
        hc.shard_plan(batch, world.mesh)
        return {}


AHEAD, OTHER_SHAPE = AheadOfTimeCase(), OtherShapeCase()


def suite(mesh: tuple[int, int]) -> list:
    return [AHEAD, OTHER_SHAPE]


@pytest.fixture(scope="module")
def world(cp_world):
    return cp_world(MESH, suite=SUITE)


def test_batch_prepared_in_a_worker_is_taken_as_it_is_and_matches_the_reference(world):
    x = global_inputs()
    cu = cu_seqlens(DOCS).tolist()
    expected = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu, cu, **MASK)
    for rank, result in enumerate(world.values(AHEAD.id)):
        assert result["worker"] != result["pid"], f"rank {rank}: not prepared in another process"
        assert not any(result["calls"].values()), f"rank {rank}: derived again: {result['calls']}"
        # the counters see a derivation: the on-the-fly path makes them
        assert result["on_the_fly_calls"]["batch_layout"] >= 1, f"rank {rank}: {result['on_the_fly_calls']}"
        assert torch.equal(result["global_index"], result["fly_global_index"]), f"rank {rank}: plans differ"
        index = result["global_index"]
        for path in ("eager", "compiled"):
            for name in ("out", "dq", "dk", "dv"):
                got = result["ahead"][path][name]
                assert_matches(got, local_rows(expected[name], index), f"rank {rank} {path} {name}")
                assert torch.equal(got, result["on_the_fly"][path][name]), (
                    f"rank {rank} {path} {name}: prepared ahead differs from on the fly"
                )


def test_batch_prepared_for_another_placement_is_refused_naming_it(world):
    for rank, record in enumerate(world.per_rank(OTHER_SHAPE.id)):
        assert_raised(record, hc.InputError, "cu_seqlens: a PreparedBatch for ulysses=2 x ring=2 with "
                      "placement='zigzag', but shard_plan lays out for ulysses=2 x ring=2 with "
                      "placement='balanced'", f"rank {rank}")


# --------------------------------------------------------------------------------------------
# one process
# --------------------------------------------------------------------------------------------

FINGERPRINT_CODE = """
import torch
from hcp_compile.batch.prepared import BatchValues, MeshShape
from hcp_compile.exchange.agreement import fingerprint
print(fingerprint(BatchValues.of(torch.tensor({cu})).digest, MeshShape(2, 2, "balanced"), True, "ring"))
"""


def test_fingerprint_tells_apart_any_number_of_placements_and_flags():
    """The old salt (2 * index + recompute_exchange, below 8) fitted four placements: nine
    more names than there are placements must still give distinct fingerprints."""
    values = BatchValues.of(cu_seqlens(DOCS).long())
    names = [*PLACEMENTS, *(f"rule{i}" for i in range(9))]
    prints = {(name, flag): fingerprint(values.digest, MeshShape(2, 2, name), flag, DEFAULT_SCHEME)
              for name in names for flag in (False, True)}
    assert len(set(prints.values())) == len(prints)
    # its negation must fit an int64 too: the ranks all-reduce the max of both
    assert all(0 <= p < 2**62 for p in prints.values())
    other_batch = BatchValues.of(cu_seqlens(tuple(reversed(DOCS))).long())
    assert fingerprint(other_batch.digest, MeshShape(2, 2, "balanced"), False, DEFAULT_SCHEME) != prints["balanced", False]


def test_fingerprint_is_the_same_in_another_process():
    """Ranks are processes: a per-process hash (Python's) would tell equal batches apart."""
    cu = cu_seqlens(DOCS).tolist()
    here = fingerprint(BatchValues.of(torch.tensor(cu)).digest, MeshShape(2, 2, "balanced"), True, "ring")
    there = subprocess.run([sys.executable, "-c", FINGERPRINT_CODE.format(cu=cu)], capture_output=True,
                           text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "random"})
    assert int(there.stdout) == here


def test_check_flags_exactly_the_broken_rules():
    batch = prepare_batch(cu_seqlens(DOCS), ulysses=2, ring=1, rank=0)
    others = BatchValues.of(cu_seqlens(tuple(reversed(DOCS))).long())
    call = validation.BatchCall(
        {"q": 10**6, "k": 10**6, "v": 10**6}, {"max_seqlen_q": max(DOCS) - 1, "max_seqlen_k": max(DOCS)},
        keys=others, rank=(0, 1), planned=MeshShape(2, 1, "zigzag"),
    )
    failures = validation.check(batch, call)
    # BATCH_RULES, one verdict slot per rule and argument: starts at 0 (q, k), non-decreasing
    # (q, k), shard tokens (q, k, v), same documents, max_seqlen (q, k), planned
    broken = [slot > 0 for slot in validation.verdict(failures, (0, 1))[::validation.FACTS]]
    assert broken == [False, False, False, False, True, True, True, True, True, False, True]
    assert [f.message.split(":")[0] for f in failures] == [
        "cu_seqlens_k", "max_seqlen_q", "cu_seqlens", "q", "k", "v"]
    fine = validation.BatchCall({n: sum(DOCS) for n in "qkv"}, {"max_seqlen_q": max(DOCS), "max_seqlen_k": max(DOCS)})
    assert validation.check(prepared.prepare(batch.batch, None), fine) == ()  # a single device


def test_pickled_batch_holds_what_the_host_derives():
    """Layout, sizes, tokens and tables survive pickling, equal to a fresh derivation."""
    cu = cu_seqlens(DOCS)
    batch = pickle.loads(pickle.dumps(prepare_batch(cu, ulysses=2, ring=2, rank=3, causal=True)))
    fresh = layout.batch_layout(cu, 2, 2, PLACEMENTS["balanced"])
    for f in fields(fresh):
        got, want = getattr(batch.layout, f.name), getattr(fresh, f.name)
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, f.name
    sizes = layout.rank_sizes(layout.rank_size_values(fresh, 1, 1).tolist(), 1, 2)
    assert batch.rank_sizes(1, 1) == sizes
    assert torch.equal(batch.tokens(1, 1).global_index, layout.rank_tokens(fresh, sizes, 1).global_index)
    want = schedule.plan_rank(fresh, sizes, 1, True, (-1, -1), 2).flat
    for got, expected in zip(batch.tables(1, 1, True, (-1, -1), steps=2).flat(), want):
        assert torch.equal(got, expected)


def test_compiled_check_keeps_each_calls_own_verdict():
    """``hcp::batch_layout`` keeps its result per call: the same batch with other token counts,
    or after ``shard_plan`` laid its values out for another mesh shape, gets the verdict that
    ``validation.check`` gives that call, not the one kept for the first."""
    import hcp_compile.compiled.inserted  # noqa: F401 -- registers hcp::batch_layout

    cu = cu_seqlens(DOCS)
    batch = prepared.prepare(prepared.host_values(cu), MeshShape(2, 2, "balanced"))
    BATCHES.record_plan(batch)
    tokens = batch.rank_tokens(1, 1)

    def verdict(count: int) -> list[int]:
        on_host = torch.ops.hcp.batch_layout(cu, cu, 2, 2, "balanced", 1, 1, [count] * 3, [max(DOCS)] * 2,
                                             False, DEFAULT_SCHEME, "ring")
        return on_host[:validation.VERDICT_LENGTH].tolist()

    def expected(count: int) -> list[int]:
        call = validation.BatchCall({n: count for n in "qkv"}, {"max_seqlen_q": max(DOCS), "max_seqlen_k": max(DOCS)},
                                     rank=(1, 1), planned=BATCHES.planned(batch.batch.digest))
        return validation.verdict(validation.check(batch, call), (1, 1))

    assert verdict(tokens) == expected(tokens) and not any(expected(tokens))
    assert verdict(tokens + 1) == expected(tokens + 1) and any(expected(tokens + 1))
    assert verdict(tokens) == expected(tokens)  # the first call's, kept
    BATCHES.record_plan(prepared.prepare(batch.batch, MeshShape(1, 4, "balanced")))
    assert verdict(tokens) == expected(tokens) and any(expected(tokens))  # now planned for 1 x 4


def test_pickled_batch_crosses_as_one_tensor():
    """A DataLoader moves each tensor of a worker's result through a shared-memory segment of
    its own: a prepared batch hands its pickler one tensor (its buffer), and the unshard rows,
    which a worker preparing one rank's batch leaves out, are derived again on first use."""
    cu = cu_seqlens(DOCS)
    prepared_batch = prepare_batch(cu, ulysses=2, ring=2, rank=3, causal=True)

    class Counting(pickle.Pickler):
        tensors = 0

        def persistent_id(self, obj):
            if isinstance(obj, torch.Tensor):
                Counting.tensors += 1
            return None

    Counting(io.BytesIO()).dump(prepared_batch)
    assert Counting.tensors == 1
    every_rank = pickle.loads(pickle.dumps(prepare_batch(cu, ulysses=2, ring=2, causal=True)))
    batch = pickle.loads(pickle.dumps(prepared_batch))
    with counting_derivations() as calls:
        rows = batch.unshard_rows()
    assert calls["rank_tokens"] == 3  # the other ranks' tokens: the rows were not sent
    with counting_derivations() as calls:
        assert torch.equal(rows, every_rank.unshard_rows())
    assert not any(calls.values())  # sent by a worker that prepared every rank


def test_pack_restores_every_tensor_and_the_rest():
    """Tensors of every dtype and shape (0-d, empty, strided, one held twice) come back equal,
    the one held twice as one tensor, beside the rest of the object."""
    shared = torch.arange(6, dtype=torch.int32)
    obj = {
        "shared": shared, "again": [shared, (shared,)], "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64), "empty": torch.empty(0, 4, dtype=torch.int64),
        "strided": torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)[:, ::2], "text": "x", "number": 7,
    }
    buffer, data = pickling.pack(obj)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    back = pickle.loads(pickle.dumps(pickling.unpack(buffer, data)))
    for name in ("shared", "bool", "scalar", "empty", "strided"):
        got, want = back[name], obj[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    assert back["again"][0] is back["shared"] and back["again"][1][0] is back["shared"]
    assert (back["text"], back["number"]) == ("x", 7)
    with pytest.raises(ValueError, match="only CPU tensors"):
        pickling.pack({"t": torch.empty(2, device="meta")})


@pytest.mark.parametrize("arguments, match", [
    ({"cu_seqlens": cu_seqlens(DOCS).long()}, "cu_seqlens: expected dtype torch.int32"),
    ({"cu_seqlens": cu_seqlens(DOCS) + 1}, "cu_seqlens: must start at 0"),
    ({"ulysses": 0}, "ulysses: expected a positive int"),
    ({"rank": 4}, "rank: expected a rank of the context-parallel mesh, 0 <= rank < 4"),
    ({"placement": "round"}, "placement: expected one of"),
    ({"window": (-2, 0)}, "window_size"),
])
def test_prepare_batch_rejects_bad_arguments_naming_them(arguments, match):
    with pytest.raises(hc.InputError, match=match):
        prepare_batch(**{"cu_seqlens": cu_seqlens(DOCS), "ulysses": 2, "ring": 2, **arguments})



@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("window", [(-1, -1), (8, 0)])
def test_warm_derives_the_tables_the_attention_asks_for(ulysses, ring, window, monkeypatch):
    """``prepare_batch(..., window=)`` (a DataLoader worker's) derives every rank's schedule
    tables under the key both doors look them up by (``window_by_position``): the attention
    then builds none on the training step, also on a ring of one with a window."""
    ready = prepare_batch(cu_seqlens(DOCS), ulysses=ulysses, ring=ring, window=window)

    def rebuilt(*args, **kwargs):
        raise AssertionError("schedule tables built again on the training step")

    monkeypatch.setattr(layout, "rank_segments", rebuilt)
    for rank in range(ulysses * ring):
        ready.tables(*divmod(rank, ulysses), True, window)


def test_tables_prepared_ahead_on_a_ring_of_one_with_a_window_are_the_ones_the_step_uses(one_rank_mesh):
    """A worker's batch for a mesh with a ring of one and a window (positions need not be
    passed there, so the keys of the tables differ from a plain ``window != (-1, -1)``): the
    training step, eager and compiled, derives nothing again, and its results are the
    reference's."""
    cu = cu_seqlens(DOCS)
    sent = pickle.loads(pickle.dumps(prepare_batch(cu, ulysses=1, ring=1, rank=0, **MASK)))
    x = global_inputs()
    expected = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu.tolist(), cu.tolist(), **MASK)
    world = World(rank=0, ulysses=1, ring=1, mesh=one_rank_mesh)
    with counting_derivations() as calls:
        plan = hc.shard_plan(sent, one_rank_mesh)
        results = {"eager": attend(plan, world, cu, compiled=False), "compiled": attend(plan, world, cu, compiled=True)}
    assert not any(calls.values()), f"derived again on the step: {calls}"
    for path, result in results.items():
        for name, got in result.items():
            assert_matches(got, local_rows(expected[name], plan.global_index), f"{path} {name}")


# --------------------------------------------------------------------------------------------
# the host copy of a schedule's tables (what cudnn's backward in chunks reads)
# --------------------------------------------------------------------------------------------

# 2 x 1 (Ulysses alone), 1 x 2 and 2 x 2 (a ring), each in every placement
CP_SHAPES = [MeshShape(u, r, p) for u, r in ((2, 1), (1, 2), (2, 2)) for p in PLACEMENTS]


def mesh_id(mesh: MeshShape) -> str:
    return f"{mesh.ulysses}x{mesh.ring}-{mesh.placement}"

# short documents, empty ones and two that go round the ring
CP_DOCS = (300, 5, 0, 129, 700, 1, 100, 2, 37, 0, 1000, 3)


@dataclass(frozen=True)
class CPBlock:
    """One block of a rank's schedule: its name, spec and the row counts of its q and k."""

    name: str
    spec: hc.kernels.BlockSpec
    rows_q: int
    rows_k: int


def schedule_blocks(lengths: tuple[int, ...], mesh: MeshShape, device: torch.device | str = "cpu", *,
                    causal: bool = True, window: tuple[int, int] = (-1, -1)) -> Iterator[tuple[tuple[int, int], list]]:
    """Every rank's ``(ring rank, Ulysses rank)`` and the blocks of its schedule as eager CP
    builds them (the prepared batch's device tables, ``rank_schedule``, the specs of
    hierarchical.py): the local region (its rows) and each ring step (the exchange stream's
    rows against the stream, or against another rank's ring section)."""
    from hcp_compile.batch.schedule import rank_schedule
    from hcp_compile.hierarchical import _local_spec, _step_spec

    batch = prepared.prepare(prepared.host_values(cu_seqlens(lengths)), mesh)
    for ring_rank in range(mesh.ring):
        for ulysses_rank in range(mesh.ulysses):
            plan, flat = batch.device_tables(ring_rank, ulysses_rank, causal, window, torch.device(device))
            sizes = plan.sizes
            sched = rank_schedule(flat, sizes, plan.shape, ring_rank, mesh.ring, max(lengths), windowed=plan.windowed,
                                  causal=causal, scale=0.125,
                                  window=window, kernel="cudnn",
                                  first_cache_key=BATCHES.cache_keys(batch, (ring_rank, ulysses_rank),
                                                                     schedule.cache_keys_needed(mesh.ring)),
                                  scheme=DEFAULT_SCHEME, kv_heads=1, ulysses=mesh.ulysses)
            # the local block covers every row exactly where the rank has no exchange region
            assert sched.local_holds_every_row == (sizes.own_exchange == 0)
            blocks = [CPBlock("local", _local_spec(sched), sizes.local, sizes.local)]
            blocks += [CPBlock(f"step {i} (keys of ring rank {step.source})", _step_spec(step, sched), sizes.stream,
                               sizes.stream if i == 0 else sizes.ring_width)
                       for i, step in enumerate(sched.steps)]
            yield (ring_rank, ulysses_rank), blocks


@pytest.mark.parametrize("mesh", CP_SHAPES, ids=mesh_id)
def test_schedule_blocks_segmentations_are_known_on_the_host(mesh):
    """Every block of every rank's schedule (views of the device tables) finds the host copy
    of its segmentations in ``HOST_READS``, equal to the device values, without reading them
    back; a tensor copied from them, another tensor, is not known."""
    from hcp_compile.kernels.contract import HOST_READS

    seen_steps = 0
    for rank, blocks in schedule_blocks(CP_DOCS, mesh):
        for block in blocks:
            for side in ("cu_q", "cu_k"):
                device = getattr(block.spec, side)
                host = HOST_READS.values(device)
                assert host is not None, f"rank {rank} {block.name} {side}: not known on the host"
                assert host.tolist() == device.tolist(), f"rank {rank} {block.name} {side}"
                assert HOST_READS.values(device.clone()) is None
            seen_steps += block.name != "local"
    assert seen_steps == mesh.ulysses * mesh.ring * (2 if mesh.ring > 1 else 1)  # the ring went round


def test_compiled_tables_op_keeps_the_host_copy_for_the_graphs_aliases():
    """A compiled graph's blocks get the tables op's output as aliases that Inductor makes of
    it (``reinterpret_tensor``: no view of it, another tensor on its storage), which still
    find the host copy, also once the op's output itself is gone."""
    import hcp_compile.compiled.inserted  # noqa: F401 -- registers hcp::schedule_tables
    from hcp_compile.kernels.contract import HOST_READS

    mesh, (ring_rank, ulysses_rank) = MeshShape(1, 2, "balanced"), (1, 0)
    cu = cu_seqlens(CP_DOCS)
    batch = prepared.prepare(prepared.host_values(cu), mesh)
    sizes = batch.rank_sizes(ring_rank, ulysses_rank)
    steps = layout.schedule_steps(sizes, mesh.ring)
    tables, _ = torch.ops.hcp.schedule_tables(cu.long(), torch.device("cpu"), mesh.ulysses, mesh.ring, mesh.placement,
                                              ring_rank, ulysses_rank, steps, True, -1, -1, layout.size_values(sizes),
                                              False)
    expected = batch.tables(ring_rank, ulysses_rank, True, (-1, -1), steps).flat()[0]
    start, length = sizes.local_entries + 1, 4 * sizes.step_entries[0] + 1  # the own step's cu_q
    alias = torch._C._dynamo.guards._reinterpret_tensor(tables, (length,), (1,), start)
    del tables
    assert alias._base is None
    assert HOST_READS.values(alias).tolist() == alias.tolist() == expected[start:start + length].tolist()
