"""Ring steps a sliding window leaves without a visible key, through the compiled door
(docs/design.md §3.3, §5.3): eager CP skips their calls (``RankPlan.active``); a compiled
graph runs every step, so the tables op hands it those steps' tables empty, decided by the
same ``RankPlan.active``, and their block calls compute nothing (the rows outside every
segment: test_window_skip_kernels.py).

Checked: the tables op's tables of the skipped steps are empty and the others the plan's, and
a block op on them calls no kernel (on the host, no process group); compiled attention
(``aot_eager``) under a window on 1 x 2 and 2 x 2 meshes, over batches where the window
skips a step on some ranks only and batches where it skips none, a recompile for a new token
count and a ``torch._dynamo.reset()`` between them, forward and backward against the float64
reference (cases run in one gloo world per mesh: ``suite="test_window_skip"``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

import hcp_compile as hc
from checks import assert_compiled_rank_matches, expected_for
from compile_cases import CompileCounter, VarlenAttention, fresh_dynamo, run_attention
from cp_cases import AttentionCase, World, cu_seqlens, mesh_id, seeded
from hcp_compile.batch import layout
from hcp_compile.batch.placements import PLACEMENTS
from hcp_compile.batch.prepared import BatchValues, MeshShape, find, prepare
from hcp_compile.batch.schedule import ScheduleTables
from hcp_compile.compiled import inserted  # noqa: F401  (registers hcp::schedule_tables)
from hcp_compile.kernels import KERNELS, BlockSpec, run_forward
from hcp_compile.kernels.contract import HOST_READS

WINDOW = (2, 0)  # causal, two keys back: smaller than a ring chunk of these batches
# batches of the compiled cases, in order: the window skips the ring step on some ranks only
# ("mixed"), on none ("none"); the token counts change from the first to the second (a
# recompile with dynamic sizes) and the second to the third
SKIP_DOCS = {
    "mixed": (3, 2, 1, 9),
    "none": (29, 0, 13, 2, 0, 1, 0, 7, 3),
    "mixed-other": (0, 5, 3, 5),
    "mixed-after-reset": (1, 0, 3, 3),
}
SEQUENCE = ("mixed", "none", "mixed-other", "mixed-after-reset")
RESET_BEFORE = SEQUENCE.index("mixed-after-reset")  # torch._dynamo.reset(), then compiled anew
MESHES = ((1, 2), (2, 2))
KERNEL = "flex"  # the kernel whose mask once let rows past the segments attend each other
WORLD_DEADLINE_S = 300


@dataclass(frozen=True)
class SkipBatch(AttentionCase):
    """An :class:`AttentionCase` whose ``docs`` is a key of :data:`SKIP_DOCS`."""

    @property
    def lengths(self) -> tuple[int, ...]:
        return SKIP_DOCS[self.docs]


def skip_batches() -> list[SkipBatch]:
    return [SkipBatch(docs, 4, 2, True, WINDOW) for docs in SEQUENCE]


def active_steps(lengths: tuple[int, ...], mesh: tuple[int, int], ring_rank: int, ulysses_rank: int) -> tuple:
    """Which ring steps of the rank's compiled schedule (every step) the window leaves with a
    visible key."""
    prepared = prepare(BatchValues.of(cu_seqlens(lengths).long()), MeshShape(*mesh))
    return prepared.rank_plan(ring_rank, ulysses_rank, True, WINDOW, mesh[1]).active


# --------------------------------------------------------------------------------------------
# the tables on the host
# --------------------------------------------------------------------------------------------

class CountingKernel:
    """The torch kernel, counting its calls."""

    name = "counting"
    masks_by_position = True

    def __init__(self):
        self.calls = 0

    def supports(self, request):
        return None

    def forward(self, q, k, v, spec):
        self.calls += 1
        return KERNELS["torch"].forward(q, k, v, spec)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("mesh", MESHES, ids=mesh_id)
def test_compiled_tables_of_the_steps_a_window_skips_are_empty(mesh, placement, monkeypatch):
    """``hcp::schedule_tables`` (what a compiled graph's attention reads) gives the steps that
    ``RankPlan.active`` marks as skipped every segment empty, the table's length kept, and the
    other steps and the local region the plan's tables; a block op on an emptied step calls
    no kernel (the host knows its table) and gives rows without keys."""
    counting = CountingKernel()
    monkeypatch.setitem(KERNELS, "counting", counting)
    ulysses, ring = mesh
    cu = cu_seqlens(SKIP_DOCS["mixed"]).long()
    prepared = find(cu, MeshShape(ulysses, ring, placement))
    skipped = 0
    for ring_rank in range(ring):
        for ulysses_rank in range(ulysses):
            plan = prepared.rank_plan(ring_rank, ulysses_rank, True, WINDOW, ring)
            sizes = layout.size_values(plan.sizes)
            flat = torch.ops.hcp.schedule_tables(cu, torch.device("cpu"), ulysses, ring, placement, ring_rank,
                                                 ulysses_rank, ring, True, *WINDOW, sizes, False)
            got, full = ScheduleTables.unflat(*flat, plan.sizes, ring, plan.windowed), plan.tables
            assert torch.equal(got.local_cu, full.local_cu)
            for step, active in enumerate(plan.active):
                tables = (got.cu_q[step], got.cu_k[step])
                if active:
                    assert torch.equal(tables[0], full.cu_q[step]) and torch.equal(tables[1], full.cu_k[step])
                    continue
                skipped += 1
                assert int(full.cu_q[step][-1]) > 0 and int(full.cu_k[step][-1]) > 0, "premise: the step has rows"
                assert tables[0].shape == full.cu_q[step].shape and not tables[0].any() and not tables[1].any()
                rows, keys = int(full.cu_q[step][-1]), int(full.cu_k[step][-1])
                q = seeded("skip/q", rows, 2, 8)
                k = v = seeded("skip/k", keys, 1, 8)
                spec = BlockSpec(*tables, 8, 8, False, 1.0, *WINDOW, got.q_positions, got.k_positions[step])
                out, lse = run_forward("counting", q, k, v, spec)
                assert counting.calls == 0 and not out.any() and torch.isneginf(lse).all()
    assert skipped, "premise: the window skips a step on some rank"


# --------------------------------------------------------------------------------------------
# compiled attention in a gloo world per mesh
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CompiledSkipCase:
    """One ``VarlenAttention`` under the window compiled with ``aot_eager`` (``dynamic=None``:
    static first, a recompile with dynamic sizes for a new token count), fed the batches of
    :data:`SEQUENCE`; before batch :data:`RESET_BEFORE` Dynamo is reset and the module compiled
    anew. Per batch the rank's results and which of its steps the window leaves active."""

    kernel: str = KERNEL
    # False: the host's copies of the tables are not found (HOST_READS), so the block ops call
    # the kernel on the emptied steps' tables, which must compute nothing on its own
    host_knows: bool = True

    @property
    def id(self) -> str:
        return f"window-skip-{self.kernel}" + ("" if self.host_knows else "-kernel-alone")

    def run(self, world: World) -> dict:
        unknown = mock.patch.object(HOST_READS, "values", lambda tensor: None)
        with contextlib.nullcontext() if self.host_knows else unknown:
            return self._run(world)

    def _run(self, world: World) -> dict:
        fresh_dynamo()
        result: dict = {"graphs_after": []}
        compiled, counter = None, None
        ring_rank, ulysses_rank = divmod(world.rank, world.ulysses)
        for index, batch in enumerate(skip_batches()):
            if index == RESET_BEFORE:
                torch._dynamo.reset()
                compiled = None
            if compiled is None:
                counter = CompileCounter(hc.backend(mesh=world.mesh, inner="aot_eager", kernel=self.kernel))
                module = VarlenAttention(True, None, WINDOW)
                compiled = torch.compile(module, backend=counter, dynamic=None, fullgraph=True)
            got = run_attention(batch, world, compiled)
            result.update({f"{index}/{n}": value for n, value in got.items()})
            result[f"{index}/active"] = active_steps(batch.lengths, (world.ulysses, world.ring), ring_rank,
                                                     ulysses_rank)
            result["graphs_after"].append(counter.graphs)
        return result


def suite(mesh: tuple[int, int]) -> list[CompiledSkipCase]:
    """The cases one world of ``mesh`` runs (hcp_compile/testing/worlds.py): the kernel alone
    on the emptied tables on the smaller mesh only (a compile costs seconds on 2 cores)."""
    return [CompiledSkipCase(), *([CompiledSkipCase(host_knows=False)] if mesh == MESHES[0] else [])]


CASES = [pytest.param(mesh, case, id=f"{mesh_id(mesh)}-{case.id}") for mesh in MESHES for case in suite(mesh)]


@pytest.mark.parametrize("mesh, case", CASES)
def test_compiled_attention_under_a_window_skipping_steps_matches_reference(cp_world, mesh, case):
    results = cp_world(mesh, suite="test_window_skip", deadline_s=WORLD_DEADLINE_S).values(case.id)
    for index, batch in enumerate(skip_batches()):
        reference = expected_for(batch)
        for rank, result in enumerate(results):
            assert_compiled_rank_matches(result, index, reference, rank, against_eager=False)
        skipping = [False in result[f"{index}/active"] for result in results]
        mixed = batch.docs.startswith("mixed")
        assert (any(skipping) and not all(skipping)) if mixed else not any(skipping), (
            f"premise of batch {batch.docs}: steps skipped per rank {skipping}")
    for rank, result in enumerate(results):
        # a recompile for the second batch's sizes, none after it, one after the reset
        assert result["graphs_after"] == [1, 2, 2, 1], f"rank {rank}: {result['graphs_after']}"
