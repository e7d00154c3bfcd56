"""What the batch cache (hcp_compile/batch/cache.py) keeps for the doors' calls: eager CP and
compiled CP on rank 0 of a fake 2 x 2 world (torch's fake process group: collectives return at
once and move no data), and the single-device op. The host copies of a batch's device tensors
(``kernels.contract.HOST_READS``) are the batch's like the kernels' memos: dropped when the batch
is evicted, and by ``clear_batch_cache()``. How often a door asks for its batch: eager CP's
check kept with the batch per call, the op's one look-up, and benchmarks/walk.py, which counts
the walk. Also eager CP without the agreement: no verdict for a call that breaks nothing, the
agreement's text for one that does."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from hcp_compile.testing.worlds import fake_world

import hcp_compile as hc
from cp_cases import cu_seqlens, seeded
from hcp_compile import context, validation
from hcp_compile.batch import prepared
from hcp_compile.batch.cache import BATCHES, BatchCache
from hcp_compile.batch.prepared import MeshShape
from hcp_compile.batch.schedule import cache_keys_needed
from hcp_compile.compiled import inserted
from hcp_compile.kernels import KERNELS
from hcp_compile.kernels import flex_mask
from hcp_compile.kernels.contract import HOST_READS

ULYSSES, RING = 2, 2
LENGTHS = (300, 120, 60, 20)
SHAPE = MeshShape(ULYSSES, RING, "balanced")


@pytest.fixture(autouse=True)
def no_batch_kept() -> Iterator[None]:
    hc.clear_batch_cache()
    yield
    hc.clear_batch_cache()


def attend(q, k, v, cu, longest):
    return hc.varlen_attention(q, k, v, cu, cu, longest, longest, causal=True)


def local_shards(cu, mesh) -> list[torch.Tensor]:
    plan = hc.shard_plan(cu, mesh)
    return [plan.shard(seeded(f"doors/{n}", int(cu[-1]), 4, 16)).requires_grad_() for n in "qkv"]


class RecordingKernel:
    """The torch kernel, keeping the specs of the blocks it gets."""

    def __init__(self, inner):
        self.inner, self.specs = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, q, k, v, spec):
        self.specs.append(spec)
        return self.inner.forward(q, k, v, spec)


def test_clear_batch_cache_leaves_nothing_of_a_batch_held(monkeypatch):
    """After eager CP (forward and backward), compiled CP and single-device flex calls, and
    ``clear_batch_cache()``: no prepared batch, host read of ``cu_seqlens``, host copy of a
    schedule's tables or flex mask of these batches is alive anywhere, while the user's
    ``cu_seqlens`` tensors still are."""
    masks = []
    build = flex_mask.build_document_mask
    monkeypatch.setattr(flex_mask, "build_document_mask", lambda *a, **kw: masks.append(build(*a, **kw)) or masks[-1])
    cu, single_cu = cu_seqlens(LENGTHS), cu_seqlens((5, 9, 3))
    with fake_world(ULYSSES, RING) as mesh:
        local = local_shards(cu, mesh)
        with hc.context_parallel(mesh, kernel="torch"):
            attend(*local, cu, max(LENGTHS)).sum().backward()
        compiled = torch.compile(attend, backend=hc.backend(mesh=mesh, inner="aot_eager"), fullgraph=True)
        compiled(*local, cu, max(LENGTHS))
        q, k, v = (seeded(f"doors/single/{n}", 17, 2, 8) for n in "qkv")
        torch.ops.hcp.varlen_attention(q, k, v, single_cu, single_cu.clone(), 9, 9, True, 0.5, -1, -1, "flex")
        batch = prepared.find(cu, SHAPE)
        held = [batch, prepared.find(single_cu, None), HOST_READS.get(cu), HOST_READS.get(single_cu),
                batch.rank_plan(0, 0, True, (-1, -1)).flat[0], *masks]
        assert all(kept is not None for kept in held) and masks
        alive = [weakref.ref(kept) for kept in held]
        del held, batch, masks[:], local, compiled
        torch._dynamo.reset()
        hc.clear_batch_cache()
        gc.collect()
        assert [i for i, ref in enumerate(alive) if ref() is not None] == []
        assert HOST_READS.get(cu) is None and len(BATCHES) == 0


def test_evicting_a_batch_drops_its_host_copies_but_reads_its_values_still_need():
    """A batch evicted takes its tables' host copies along, and the read of its values unless
    the cache keeps these values for another mesh shape."""
    cache = BatchCache(capacity=2)
    cu = cu_seqlens(LENGTHS)
    values = prepared.host_values(cu)
    shapes = [MeshShape(2, 1), MeshShape(1, 2)]
    batches = [cache.adopt(prepared.prepare_batch(cu, ulysses=s.ulysses, ring=s.ring)) for s in shapes]
    tables = [b.device_tables(0, 0, True, (-1, -1), torch.device("cpu"))[1][0] for b in batches]
    assert all(HOST_READS.values(t) is not None for t in tables)
    cache.adopt(prepared.prepare_batch(cu_seqlens((7, 7)), ulysses=2, ring=1))  # evicts the 2 x 1 batch
    assert HOST_READS.values(tables[0]) is None and HOST_READS.values(tables[1]) is not None
    assert HOST_READS.get(cu) is values  # its values are still kept, for 1 x 2
    cache.adopt(prepared.prepare_batch(cu_seqlens((8, 8)), ulysses=2, ring=1))  # evicts the 1 x 2 one
    assert HOST_READS.values(tables[1]) is None and HOST_READS.get(cu) is None


def test_an_eager_block_after_clear_batch_cache_takes_the_batch_prepared_again(monkeypatch):
    """A ``context_parallel`` block's next call after ``clear_batch_cache()`` runs on the batch
    prepared again: its blocks' cache keys are that batch's (dropped with it) and their
    segmentations' host copies are known, as on the first call."""
    recording = RecordingKernel(KERNELS["torch"])
    monkeypatch.setitem(KERNELS, "torch", recording)
    cu = cu_seqlens(LENGTHS)
    with fake_world(ULYSSES, RING) as mesh:
        local = local_shards(cu, mesh)
        with hc.context_parallel(mesh, kernel="torch"):
            attend(*local, cu, max(LENGTHS))
            hc.clear_batch_cache()
            recording.specs.clear()
            attend(*local, cu, max(LENGTHS))
    first = BATCHES.cache_keys(prepared.find(cu, SHAPE), (0, 0), cache_keys_needed(RING))
    assert recording.specs
    for spec in recording.specs:
        assert spec.cache_key in range(first, first + cache_keys_needed(RING))
        assert HOST_READS.values(spec.cu_q) is not None and HOST_READS.values(spec.cu_k) is not None


def test_without_the_agreement_a_good_call_builds_no_verdict(monkeypatch):
    def no_verdict(*args):
        raise AssertionError("a verdict was built without the agreement")

    monkeypatch.setattr(validation, "verdict", no_verdict)
    cu = cu_seqlens(LENGTHS)
    with fake_world(ULYSSES, RING) as mesh:
        local = local_shards(cu, mesh)
        with hc.context_parallel(mesh, agree_across_ranks=False):
            attend(*local, cu, max(LENGTHS))


@pytest.mark.parametrize("bad", ["max_seqlen", "kernel"])
def test_without_the_agreement_a_bad_call_raises_the_agreements_text(bad):
    """A call that breaks a batch rule (``max_seqlen`` below the longest document) or a rule of
    its own (a kernel that cannot run it) raises the same text with the agreement as without
    (over the fake world the agreement returns the rank's own verdict)."""
    cu = cu_seqlens(LENGTHS)
    longest, kernel = (max(LENGTHS) - 1, "auto") if bad == "max_seqlen" else (max(LENGTHS), "flash")
    texts = []
    with fake_world(ULYSSES, RING) as mesh:
        local = local_shards(cu, mesh)
        for agree in (True, False):
            with hc.context_parallel(mesh, agree_across_ranks=agree, kernel=kernel):
                with pytest.raises(hc.InputError) as raised:
                    attend(*local, cu, longest)
            texts.append(str(raised.value))
    assert texts[0] == texts[1]


def test_an_eager_call_is_checked_once_per_batch_and_call(monkeypatch):
    """The layers of a model make the same call: eager CP checks it against the batch once
    (kept with the batch, as the compiled graph's check), again for another call, and a call
    that breaks a rule raises each time."""
    from hcp_compile.batch import call as batch_call

    checks = []
    check = batch_call.check
    monkeypatch.setattr(batch_call, "check", lambda *args: checks.append(1) or check(*args))
    cu = cu_seqlens(LENGTHS)
    with fake_world(ULYSSES, RING) as mesh:
        local = local_shards(cu, mesh)
        with hc.context_parallel(mesh):
            for _ in range(3):
                attend(*local, cu, max(LENGTHS))
            assert len(checks) == 1
            attend(*local, cu, max(LENGTHS) + 1)
            assert len(checks) == 2
            for _ in range(2):
                with pytest.raises(hc.InputError, match="max_seqlen"):
                    attend(*local, cu, max(LENGTHS) - 1)
            assert len(checks) == 3


def test_the_single_device_op_finds_its_batch_once(monkeypatch):
    """Its check and its blocks' cache key come from one look-up of the batch."""
    from hcp_compile import ops

    found = []
    find = ops.find
    monkeypatch.setattr(ops, "find", lambda *args: found.append(1) or find(*args))
    cu = cu_seqlens((5, 9, 3))
    q, k, v = (seeded(f"doors/single/{n}", 17, 2, 8) for n in "qkv")
    for cu_k in (cu, cu.clone()):
        found.clear()
        torch.ops.hcp.varlen_attention(q, k, v, cu, cu_k, 9, 9, True, 0.5, -1, -1, "torch")
        assert len(found) == 1


def test_a_batch_looked_up_by_value_is_the_most_recently_used():
    cache = BatchCache(capacity=2)
    first = cache.adopt(prepared.prepare_batch(cu_seqlens((3, 4)), ulysses=2, ring=1))
    cache.adopt(prepared.prepare_batch(cu_seqlens((5,)), ulysses=2, ring=1))
    assert cache.prepared((first.batch.digest, MeshShape(2, 1)), lambda: None) is first  # another key object
    cache.adopt(prepared.prepare_batch(cu_seqlens((6,)), ulysses=2, ring=1))  # evicts (5,)
    assert cache.prepared((first.batch.digest, MeshShape(2, 1)), lambda: None) is first


def test_the_walk_tool_prints_every_doors_walk(monkeypatch, capsys):
    from benchmarks import walk

    monkeypatch.setattr("sys.argv", ["walk", "--lengths", "40,30,20,10"])
    walk.main()
    printed = capsys.readouterr().out
    header, _, *rows = printed.splitlines()
    for column in ("eager, first call", "eager, batch seen", "compiled, batch seen", "one device, batch seen"):
        assert column in header
    assert rows[-1].startswith("total") and not dist.is_initialized()


def test_find_keeps_a_tensors_batch_until_the_tensor_or_the_cache_changes():
    """``BatchCache.find`` answers again for the same tensor and version without building;
    a write into the tensor, another tensor of the same values, a batch laid out again or
    ``clear`` ask the finder again; nothing is kept for a tensor freed."""
    cache, built = BatchCache(), []

    def finder(cu):
        def build():
            built.append(1)
            return cache.adopt(prepared.prepare_batch(cu, ulysses=2, ring=1))
        return build

    cu = cu_seqlens((3, 4))
    first = cache.find(cu, SHAPE, finder(cu))
    assert cache.find(cu, SHAPE, finder(cu)) is first and len(built) == 1
    same_values = cu.clone()
    assert cache.find(same_values, SHAPE, finder(same_values)) is first and len(built) == 2
    cu[1] = 2  # in place: the tensor's version moves
    assert cache.find(cu, SHAPE, finder(cu)) is not first and len(built) == 3
    cache.record_plan(first)  # a batch laid out again may change what a tensor's values find
    cache.find(same_values, SHAPE, finder(same_values))
    assert len(built) == 4
    cache.clear()
    cache.find(same_values, SHAPE, finder(same_values))
    assert len(built) == 5
    freed = weakref.ref(same_values)
    del same_values
    gc.collect()
    assert freed() is None and len(cache._by_tensor) == 0


def test_an_eager_block_sees_a_batch_laid_out_again_for_a_window():
    """The block keeps a call's check per cu_seqlens tensor; ``shard_plan`` laying the same
    values out for a window between two calls makes the next call take that layout (the
    shards are laid out for it), not the kept one."""
    cu = cu_seqlens(LENGTHS)
    with fake_world(ULYSSES, RING) as mesh:
        local = local_shards(cu, mesh)
        with hc.context_parallel(mesh) as block:
            attend(*local, cu, max(LENGTHS))
            before, = block._checks.values()
            assert before.prepared.mesh.window == (-1, -1)
            windowed = hc.shard_plan(cu, mesh, window=(64, 0))
            local = [windowed.shard(seeded(f"doors/{n}", int(cu[-1]), 4, 16)) for n in "qkv"]
            hc.varlen_attention(*local, cu, cu, max(LENGTHS), max(LENGTHS), causal=True, window_size=(64, 0))
            after = [kept for kept in block._checks.values() if kept is not before]
            assert [checked.prepared.mesh.window for checked in after] == [(64, 0)]


def test_every_walk_of_cu_seqlens_enters_each_room_of_the_batch_package_at_most_twice():
    """Issue 50's bar, for every walk benchmarks/walk.py counts: an eager first call (the batch
    that ``shard_plan`` laid out: its check finds the batch kept for the tensor, the schedule is
    one entry that derives the rank's plan in one pass down the layers), the calls of a batch
    seen through both doors (an eager call finds its kept check and schedule, a compiled call's
    host points one look-up each) and the single-device op."""
    from benchmarks import walk
    from benchmarks.speed_setup import fake_process_group

    with fake_process_group(0, ULYSSES * RING):
        found = walk.walks(list(LENGTHS), "aot_eager")
    assert len(found) == 4
    for door, seen in found.items():
        rooms = {module: count for module, count in seen.entries.items() if module.startswith("hcp_compile.batch.")}
        assert rooms and all(count <= 2 for count in rooms.values()), (door, rooms)


@pytest.mark.parametrize("window", [(-1, -1), (24, 0)])
def test_a_ranks_plan_is_derived_in_one_pass_down_the_layers(window):
    """prepare -> schedule -> layout once each: deriving a rank's plan for a mask (what a first
    call, or a DataLoader worker's ``warm``, does) enters the schedule and the layout once, with
    every step's tables, positions and skipped steps from one pass over its stream tables, and
    never turns back up to the prepared batch."""
    from benchmarks import walk

    # rank 3's sizes and tokens derived, and its plan for another mask than the walked one
    batch = prepared.prepare_batch(cu_seqlens(LENGTHS), ulysses=ULYSSES, ring=RING, rank=3, window=(8, 0))
    seen = walk.walk(lambda: batch.rank_plan(1, 1, True, window))
    rooms = {module.removeprefix("hcp_compile.batch."): count for module, count in seen.entries.items()}
    assert rooms == {"prepared": 1, "schedule": 1, "layout": 1}, rooms
    assert seen.stops["hcp_compile.batch.prepared"] == 2  # in, and back with the plan


def test_calls_of_a_batch_seen_look_nothing_up_by_value(monkeypatch):
    """Once a batch is seen, neither door reads, hashes or looks up its ``cu_seqlens`` values
    again: eager CP's first call finds the batch ``shard_plan`` kept for the tensor and later
    ones take their kept check, and each host point of a compiled call (the graph choice,
    ``hcp::batch_layout``, ``hcp::schedule_tables``) finds the batch kept for its tensor."""
    by_value = []
    find_by_value = prepared.find_by_value
    counted = lambda *args: by_value.append(1) or find_by_value(*args)  # noqa: E731
    for module in (prepared, context, inserted):  # the doors' own fallbacks and find's
        monkeypatch.setattr(module, "find_by_value", counted)
    cu = cu_seqlens(LENGTHS)
    longest = max(LENGTHS)
    with fake_world(ULYSSES, RING) as mesh:
        local = local_shards(cu, mesh)
        with hc.context_parallel(mesh):
            attend(*local, cu, longest)
            assert by_value == []
            attend(*local, cu, longest)
            assert by_value == []
        compiled = torch.compile(attend, backend=hc.backend(mesh=mesh, inner="aot_eager"), fullgraph=True)
        compiled(*local, cu, longest)
        by_value.clear()
        compiled(*local, cu, longest)
        assert by_value == []


def test_the_first_call_runs_on_the_layout_shard_plan_kept_for_its_tensor():
    """``shard_plan`` keeps its batch for the tensor it was given, under the key the doors ask
    with (the mesh shape without the layout's window): a first call of that tensor runs on the
    layout laid out for the plan's window, as one found by value does, and a plan for another
    window of the same tensor replaces it."""
    cu = cu_seqlens(LENGTHS)
    with fake_world(ULYSSES, RING) as mesh:
        for window in ((-1, -1), (64, 0), (-1, -1)):
            plan = hc.shard_plan(cu, mesh, window=window)
            assert prepared.find(cu, SHAPE) is plan.prepared
            assert prepared.find_by_value(cu, SHAPE) is plan.prepared
            assert plan.prepared.mesh.window == window
